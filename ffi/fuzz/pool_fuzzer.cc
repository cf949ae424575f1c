// Fuzz target: the pool's handle API, driven by the input's bytes.
//
// Each input opens two pools (A with host, cxl and nvme tiers, B with a host
// tier) and decodes its bytes into operations on them: allocate (and write
// the whole object), free, write or read a range, compact, use a freed, a
// foreign (B's), a made-up or an out-of-range handle, churn B, and run an
// update program (x <- -x) on an object, then wait for it, or free the
// object or compact the pool while it runs (both must wait for it), and make
// a bfloat16 copy the pool keeps of a float32 object (AllocateCopy). A
// shadow copy of every object's bytes says what each read must return (a
// copy's: its source's, converted, whatever wrote the source; a copy whose
// source was freed is refused). After every operation:
//   * A lists exactly the live handles, and every one of them resolves;
//   * no two live objects overlap, each lies below its arena's reserved
//     mark, and every reserved byte is an object's, a slab span's or a
//     hole's (per tier: allocator statistics against the objects);
//   * stale, foreign and made-up handles are rejected (kNotFound) and
//     out-of-range accesses refused (kInvalidArgument) without effect;
//   * after a compaction every handle still resolves and reads back its
//     bytes.
#include <stdlib.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "fuzz_input.h"
#include "pool.h"

namespace jcxl::fuzz {
namespace {

Counter g_counter("pool_fuzzer");
constexpr int64_t kWaitNs = 30'000'000'000;  // a hang fails the run
// Live objects at most: the checks after each operation stay cheap, and a
// long input does many operations rather than fill the pool with tiny ones.
constexpr size_t kMaxObjects = 48;

std::string H(int32_t handle) { return "handle " + std::to_string(handle); }

// Bytes that depend on the seed and on each byte's position.
void Fill(char* out, uint64_t bytes, uint64_t seed) {
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&state] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  uint64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    const uint64_t word = next();
    std::memcpy(out + i, &word, 8);
  }
  const uint64_t tail = next();
  std::memcpy(out + i, &tail, bytes - i);
}

Status Wait(StatusOr<std::shared_ptr<Ticket>> ticket) {
  if (!ticket.ok()) return ticket.status();
  return (*ticket)->Wait(kWaitNs);
}

// A private directory for the nvme tier, removed with what is left in it.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("JCXL_FUZZ_DIR");
    std::string templ = std::string(base ? base : "/tmp") + "/jcxl_fuzz.XXXXXX";
    std::vector<char> buffer(templ.begin(), templ.end());
    buffer.push_back('\0');
    if (mkdtemp(buffer.data()) != nullptr) path_ = buffer.data();
  }
  ~TempDir() {
    if (path_.empty()) return;
    unlink((path_ + "/tier.swap").c_str());
    rmdir(path_.c_str());
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

class PoolFuzzer {
 public:
  PoolFuzzer(FuzzInput& in, std::shared_ptr<Pool> a, std::shared_ptr<Pool> b)
      : in_(in), a_(std::move(a)), b_(std::move(b)) {}

  void Run() {
    while (!in_.done()) {
      switch (in_.Byte() % 14) {
        case 0:
        case 1:
        case 2:
          Allocate();
          break;
        case 3:
          Free();
          break;
        case 4:
          Write();
          break;
        case 5:
          Read();
          break;
        case 6:
          Compact();
          break;
        case 7:
          Stale();
          break;
        case 8:
          Foreign();
          break;
        case 9:
          MadeUp();
          break;
        case 10:
          OutOfRange();
          break;
        case 11:
          Update();
          break;
        case 12:
          Copy();
          break;
        default:
          ChurnB();
          break;
      }
      ++g_counter.operations;
      SyncCopies();
      CheckLayout();
    }
    CheckAllBytes();
  }

 private:
  // A buffer for reads and writes, reused (large allocations are slow under
  // AddressSanitizer).
  char* Scratch(uint64_t bytes) {
    if (scratch_.size() < bytes) scratch_.resize(bytes);
    return scratch_.data();
  }

  int32_t Pick() {
    auto it = shadow_.begin();
    std::advance(it, in_.Range(0, shadow_.size() - 1));
    return it->first;
  }

  void Allocate() {
    if (shadow_.size() >= kMaxObjects) return Free();
    const TierKind tier = static_cast<TierKind>(in_.Byte() % 3);
    const uint64_t bytes = in_.Size(128 << 10);
    // Some objects are float32 (for update programs).
    const bool floats = bytes % 4 == 0 && in_.Byte() % 2 == 0;
    StatusOr<int32_t> handle =
        floats ? a_->objects().Allocate(
                     tier, bytes, {static_cast<int64_t>(bytes / 4)}, "float32")
               : a_->objects().Allocate(tier, bytes,
                                        {static_cast<int64_t>(bytes)}, "uint8");
    if (!handle.ok()) {
      FUZZ_CHECK(handle.status().code() == Code::kExhausted,
                 handle.status().message());
      return;
    }
    FUZZ_CHECK(*handle > 0 && shadow_.count(*handle) == 0,
               H(*handle) + " handed out twice");
    for (int32_t old : stale_) {
      FUZZ_CHECK(old != *handle, H(*handle) + " was freed a moment ago");
    }
    std::vector<char> data(bytes);
    Fill(data.data(), bytes, next_seed_++);
    const Status written = Wait(a_->transfers().Write(
        *handle, data.data(), bytes, 0, 0, in_.Range(0, 3) * 64 * 1024));
    FUZZ_CHECK(written.ok(), written.message());
    shadow_[*handle] = std::move(data);
    if (floats) floats_.insert(*handle);
  }

  void Free() {
    if (shadow_.empty()) return;
    FreeHandle(Pick());
  }

  void FreeHandle(int32_t handle) {
    const Status freed = a_->objects().Free(handle, kWaitNs);
    FUZZ_CHECK(freed.ok(), freed.message());
    shadow_.erase(handle);
    floats_.erase(handle);
    copy_of_.erase(handle);
    stale_.push_back(handle);
    if (stale_.size() > 32) stale_.erase(stale_.begin());
  }

  // x <- -x on an object: registered only where it holds float32; while it
  // runs, a free or a compaction of the pool must wait for it.
  void Update() {
    if (shadow_.empty()) return;
    const int32_t handle = Pick();
    std::vector<char>& data = shadow_[handle];
    const bool floats = floats_.count(handle) > 0;
    UpdateProgram program;
    program.num_elements = static_cast<int64_t>(data.size() / 4);
    program.inputs = {{UpdateInput::Kind::kObject, handle}};
    program.code = {{UpdateOp::kNeg, 0}};
    program.outputs = {{1, handle}};
    StatusOr<int32_t> id = a_->updates().RegisterUpdate(program);
    if (!floats) {
      FUZZ_CHECK(id.status().code() == Code::kInvalidArgument,
                 "an update program registered on uint8 " + H(handle));
      return;
    }
    FUZZ_CHECK(id.ok(), id.status().message());
    StatusOr<std::shared_ptr<UpdateRun>> run =
        a_->updates().StartUpdate(*id, {});
    FUZZ_CHECK(run.ok(), run.status().message());
    for (size_t i = 3; i < data.size(); i += 4) data[i] ^= '\x80';
    switch (in_.Byte() % 3) {
      case 0:
        break;
      case 1:
        FreeHandle(handle);  // waits for the run
        FUZZ_CHECK((*run)->Wait(kWaitNs).ok(), "the run failed");
        FUZZ_CHECK(a_->updates().StartUpdate(*id, {}).status().code() ==
                       Code::kNotFound,
                   "a run started on freed " + H(handle));
        break;
      default:
        Compact();  // waits for the run, then checks every object's bytes
        break;
    }
    const Status waited = (*run)->Wait(kWaitNs);
    FUZZ_CHECK(waited.ok(), waited.message());
    FUZZ_CHECK(a_->updates().ReleaseUpdate(*id).ok(), "release failed");
  }

  void Write() {
    if (shadow_.empty()) return;
    const int32_t handle = Pick();
    std::vector<char>& data = shadow_[handle];
    const uint64_t offset = in_.Range(0, data.size() - 1);
    const uint64_t bytes = in_.Range(1, data.size() - offset);
    char* update = Scratch(bytes);
    Fill(update, bytes, next_seed_++);
    const Status written = Wait(a_->transfers().Write(
        handle, update, bytes, offset, in_.Byte() % 3, in_.Range(0, 3) * 4096));
    if (copy_of_.count(handle)) {
      FUZZ_CHECK(written.code() == Code::kInvalidArgument,
                 "a write of the copy " + H(handle) + " accepted");
      return;
    }
    FUZZ_CHECK(written.ok(), written.message());
    std::memcpy(data.data() + offset, update, bytes);
  }

  void Read() {
    if (shadow_.empty()) return;
    const int32_t handle = Pick();
    const std::vector<char>& data = shadow_[handle];
    const uint64_t offset = in_.Range(0, data.size() - 1);
    const uint64_t bytes = in_.Range(1, data.size() - offset);
    char* out = Scratch(bytes);
    const Status read = Wait(a_->transfers().Read(
        handle, out, bytes, offset, in_.Byte() % 3, in_.Range(0, 3) * 4096));
    if (Orphan(handle)) {
      FUZZ_CHECK(read.code() == Code::kNotFound,
                 "the copy " + H(handle) + " of a freed object was read");
      return;
    }
    FUZZ_CHECK(read.ok(), read.message());
    FUZZ_CHECK(std::memcmp(out, data.data() + offset, bytes) == 0,
               H(handle) + " read back other bytes at " +
                   std::to_string(offset));
  }

  void Compact() {
    const Status compacted = a_->objects().Compact(kWaitNs);
    FUZZ_CHECK(compacted.ok(), compacted.message());
    for (const TierStats& tier : a_->objects().Stats()) {
      for (const ArenaStats& arena : tier.arenas) {
        FUZZ_CHECK(arena.allocator.hole_bytes == 0, "holes after compact");
      }
    }
    CheckAllBytes();  // the handles held, and so did the bytes
  }

  // Every call on a handle `pool` does not hold answers kNotFound.
  void Rejects(Pool& pool, int32_t handle) {
    char buffer[16] = {};
    FUZZ_CHECK(pool.objects().Info(handle).status().code() == Code::kNotFound,
               H(handle) + " resolved in pool " + std::to_string(pool.id()));
    FUZZ_CHECK(
        pool.transfers().Read(handle, buffer, 1, 0, 0, 0).status().code() ==
            Code::kNotFound,
        H(handle) + " could be read");
    FUZZ_CHECK(
        pool.transfers().Write(handle, buffer, 1, 0, 0, 0).status().code() ==
            Code::kNotFound,
        H(handle) + " could be written");
    FUZZ_CHECK(pool.objects().Free(handle, kWaitNs).code() == Code::kNotFound,
               H(handle) + " could be freed");
  }

  void Stale() {
    if (!stale_.empty()) Rejects(*a_, stale_[in_.Range(0, stale_.size() - 1)]);
  }

  void Foreign() {
    if (!b_handles_.empty()) {
      const int32_t handle = b_handles_[in_.Range(0, b_handles_.size() - 1)];
      Rejects(*a_, handle);
      FUZZ_CHECK(b_->objects().Info(handle).ok(),
                 H(handle) + " lost in pool B");
    }
    if (!shadow_.empty()) {
      const int32_t handle = Pick();
      Rejects(*b_, handle);
    }
  }

  void MadeUp() {
    const int32_t handle = in_.Int32();
    if (shadow_.count(handle) == 0) Rejects(*a_, handle);
  }

  void OutOfRange() {
    if (shadow_.empty()) return;
    const int32_t handle = Pick();
    if (Orphan(handle)) return;  // refused before its range is looked at
    const uint64_t size = shadow_[handle].size();
    const uint64_t offset = in_.Range(0, size + 8192);
    const uint64_t bytes =
        offset > size ? in_.Range(0, 64) : size - offset + in_.Range(1, 4096);
    std::vector<char> buffer(bytes + 1, 0x5a);
    FUZZ_CHECK(a_->transfers()
                       .Read(handle, buffer.data(), bytes, offset, 0, 0)
                       .status()
                       .code() == Code::kInvalidArgument,
               "read past the end of " + H(handle) + " accepted");
    FUZZ_CHECK(a_->transfers()
                       .Write(handle, buffer.data(), bytes, offset, 0, 0)
                       .status()
                       .code() == Code::kInvalidArgument,
               "write past the end of " + H(handle) + " accepted");
  }

  void ChurnB() {
    if (in_.Byte() % 2 == 0 || b_handles_.empty()) {
      StatusOr<int32_t> handle = b_->objects().Allocate(
          TierKind::kHost, in_.Range(1, 8192), {}, "uint8");
      if (handle.ok()) b_handles_.push_back(*handle);
    } else {
      const size_t i = in_.Range(0, b_handles_.size() - 1);
      const int32_t handle = b_handles_[i];
      FUZZ_CHECK(b_->objects().Free(handle, kWaitNs).ok(),
                 "pool B's free failed");
      b_handles_.erase(b_handles_.begin() + i);
      Rejects(*b_, handle);
    }
  }

  void CheckAllBytes() {
    SyncCopies();  // mid-operation too (an update's compaction checks)
    for (const auto& [handle, data] : shadow_) {
      if (Orphan(handle)) continue;  // its reads are refused (Read)
      char* out = Scratch(data.size());
      const Status read =
          Wait(a_->transfers().Read(handle, out, data.size(), 0, 0, 0));
      FUZZ_CHECK(read.ok(), H(handle) + ": " + read.message());
      FUZZ_CHECK(std::memcmp(out, data.data(), data.size()) == 0,
                 H(handle) + " lost its bytes" +
                     (copy_of_.count(handle)
                          ? " (a copy of " + H(copy_of_.at(handle)) + ")"
                          : ""));
    }
  }

  void CheckLayout() {
    std::vector<int32_t> handles = a_->objects().Handles();
    std::sort(handles.begin(), handles.end());
    std::vector<int32_t> expected;
    for (const auto& [handle, data] : shadow_) expected.push_back(handle);
    FUZZ_CHECK(handles == expected, "the pool lists other handles");

    const std::vector<TierStats> stats = a_->objects().Stats();
    const HybridOptions& options = a_->config().allocator;
    // Per (tier, node): objects as (offset, footprint), live bytes, counts.
    struct Arena {
      std::vector<std::pair<uint64_t, uint64_t>> spans;
      uint64_t live = 0;
      uint64_t slab = 0;
      uint64_t extent = 0;
      uint64_t extent_bytes = 0;
    };
    std::map<std::pair<int, int>, Arena> arenas;
    for (const auto& [handle, data] : shadow_) {
      StatusOr<ObjectInfo> info = a_->objects().Info(handle);
      FUZZ_CHECK(info.ok(), info.status().message());
      FUZZ_CHECK(info->bytes == data.size(), H(handle) + " changed size");
      const uint64_t alignment = info->tier == TierKind::kNvme
                                     ? std::max<uint64_t>(options.alignment,
                                                          kBlockBytes)
                                     : options.alignment;
      const uint64_t footprint =
          info->slab ? info->bytes
                     : (info->bytes + alignment - 1) / alignment * alignment;
      Arena& arena = arenas[{static_cast<int>(info->tier), info->node}];
      arena.spans.emplace_back(info->offset, footprint);
      arena.live += info->bytes;
      if (info->slab) {
        ++arena.slab;
      } else {
        ++arena.extent;
        arena.extent_bytes += footprint;
      }
    }
    for (const TierStats& tier : stats) {
      for (const ArenaStats& stat : tier.arenas) {
        const AllocatorStats& s = stat.allocator;
        Arena& arena = arenas[{static_cast<int>(tier.kind), stat.node}];
        std::sort(arena.spans.begin(), arena.spans.end());
        uint64_t end = 0;
        for (const auto& [offset, footprint] : arena.spans) {
          FUZZ_CHECK(offset >= end, std::string(TierName(tier.kind)) +
                                        ": objects overlap at " +
                                        std::to_string(offset));
          end = offset + footprint;
        }
        FUZZ_CHECK(end <= s.reserved, "an object lies past the reserved mark");
        FUZZ_CHECK(s.reserved <= s.capacity, "reserved past the capacity");
        FUZZ_CHECK(s.live == arena.live, std::string(TierName(tier.kind)) +
                                             ": live bytes disagree");
        FUZZ_CHECK(s.slab_objects == arena.slab, "slab count disagrees");
        FUZZ_CHECK(s.extent_objects == arena.extent, "extent count disagrees");
        // Every reserved byte: an extent object's, a span's or a hole's.
        FUZZ_CHECK(arena.extent_bytes + s.slab_spans * options.span_bytes +
                           s.hole_bytes ==
                       s.reserved,
                   std::string(TierName(tier.kind)) +
                       ": reserved bytes not accounted for");
        FUZZ_CHECK(s.largest_free >= s.largest_hole, "largest free < hole");
      }
    }
  }

  // A bfloat16 copy of a float32 object: it must read back as its source
  // converted; nothing but the pool writes it, and it copies no copy.
  void Copy() {
    if (shadow_.empty()) return;
    const int32_t source = Pick();
    StatusOr<int32_t> copy = a_->updates().AllocateCopy(source, "bfloat16");
    if (!floats_.count(source)) {  // bytes, or a copy
      FUZZ_CHECK(copy.status().code() == Code::kInvalidArgument,
                 "a copy of " + H(source) + " made");
      return;
    }
    if (!copy.ok()) {
      FUZZ_CHECK(copy.status().code() == Code::kExhausted,
                 copy.status().message());
      return;
    }
    StatusOr<ObjectInfo> info = a_->objects().Info(*copy);
    FUZZ_CHECK(info.ok() && info->copy_of == source,
               H(*copy) + " is not a copy of " + H(source));
    copy_of_[*copy] = source;
    shadow_[*copy] = {};
    SyncCopies();
  }

  bool Orphan(int32_t handle) const {
    auto it = copy_of_.find(handle);
    return it != copy_of_.end() && shadow_.count(it->second) == 0;
  }

  // A copy's expected bytes: its source's float32s, converted.
  void SyncCopies() {
    for (const auto& [copy, source] : copy_of_) {
      auto found = shadow_.find(source);
      if (found == shadow_.end()) continue;
      const std::vector<char>& from = found->second;
      std::vector<char>& to = shadow_[copy];
      to.resize(from.size() / 2);
      for (size_t k = 0; k < from.size() / 4; ++k) {
        uint32_t bits;
        std::memcpy(&bits, from.data() + 4 * k, 4);
        const uint16_t half =
            (bits & 0x7fffffffu) > 0x7f800000u
                ? static_cast<uint16_t>(((bits >> 16) & 0x8000u) | 0x7fc0u)
                : static_cast<uint16_t>(
                      (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
        std::memcpy(to.data() + 2 * k, &half, 2);
      }
    }
  }

  FuzzInput& in_;
  std::shared_ptr<Pool> a_;
  std::shared_ptr<Pool> b_;
  std::map<int32_t, std::vector<char>> shadow_;  // A's objects and bytes
  std::set<int32_t> floats_;                     // of those, float32 ones
  std::map<int32_t, int32_t> copy_of_;           // copies, by their source
  std::vector<int32_t> stale_;                   // freed in A, recently
  std::vector<int32_t> b_handles_;
  std::vector<char> scratch_;
  uint64_t next_seed_ = 1;
};

}  // namespace
}  // namespace jcxl::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace jcxl;
  using namespace jcxl::fuzz;
  // The pools' arenas ask for huge pages; each input maps fresh ones, and a
  // fault on them may compact memory synchronously (milliseconds of system
  // time per input). The bookkeeping under test is the same without.
  static const bool no_huge_pages = prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0;
  (void)no_huge_pages;
  FuzzInput in(data, size);
  ++g_counter.inputs;
  const uint8_t shape = in.Byte();
  TempDir dir;
  FUZZ_CHECK(!dir.path().empty(), "cannot make a directory for the nvme tier");
  PoolConfig config;
  config.tiers[0].capacity = 2 << 20;
  config.tiers[1].capacity = 2 << 20;
  config.tiers[1].emulated = true;
  config.tiers[2].capacity = 4 << 20;
  config.nvme_dir = dir.path();
  config.spill = shape & 1;
  config.copy_threads = 1 + (shape >> 1) % 2;
  config.update_threads = 1 + (shape >> 4) % 2;
  config.chunk_bytes = (shape & 4) ? 64 << 10 : 4 << 20;
  config.allocator.span_bytes = (shape & 8) ? 64 << 10 : 256 << 10;
  StatusOr<std::shared_ptr<Pool>> a = Pool::Create(config);
  FUZZ_CHECK(a.ok(), a.status().message());
  PoolConfig small;
  small.tiers[0].capacity = 1 << 20;
  small.copy_threads = 1;
  StatusOr<std::shared_ptr<Pool>> b = Pool::Create(small);
  FUZZ_CHECK(b.ok(), b.status().message());
  PoolFuzzer(in, *a, *b).Run();
  FUZZ_CHECK((*a)->Close(kWaitNs).ok(), "closing pool A failed");
  FUZZ_CHECK((*b)->Close(kWaitNs).ok(), "closing pool B failed");
  return 0;
}
