#include "object_table.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <numeric>

#include "numa.h"

namespace jcxl {
namespace {

// A handle is (generation << kIndexBits) | index, always positive as int32:
// a freed handle's generation no longer matches, so it is never mistaken for
// the object that reuses its slot.
constexpr int kIndexBits = 22;
constexpr uint32_t kIndexMask = (1u << kIndexBits) - 1;
constexpr uint32_t kMaxGeneration = (1u << (31 - kIndexBits)) - 1;

uint32_t IndexOf(int32_t handle) {
  return static_cast<uint32_t>(handle) & kIndexMask;
}

// The handle indices of every pool in the process. An index belongs to one
// pool at a time, so a handle of one pool is unknown to every other pool
// (it can never reach another pool's memory). Its generation moves on at
// every free, and freed indices are reused oldest first. An index whose
// generations are used up is retired, never reused: a generation that came
// round again would make a stale handle name a new object. (That takes
// kMaxGeneration frees of each of the 2^22 indices, about 2 * 10^9.)
class HandleSpace {
 public:
  static HandleSpace& Get() {
    static auto* space = new HandleSpace();
    return *space;
  }
  // A new handle, or 0 when every index is in use.
  int32_t Take() {
    std::lock_guard<std::mutex> lock(mu_);
    uint32_t index;
    if (!free_.empty()) {
      index = free_.front();
      free_.pop_front();
    } else if (generations_.size() <= kIndexMask) {
      index = static_cast<uint32_t>(generations_.size());
      generations_.push_back(1);
    } else {
      return 0;
    }
    return static_cast<int32_t>(
        (static_cast<uint32_t>(generations_[index]) << kIndexBits) | index);
  }
  void Give(int32_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint32_t index = IndexOf(handle);
    uint16_t& generation = generations_[index];
    if (generation == kMaxGeneration) return;  // retired
    ++generation;
    free_.push_back(index);
  }

 private:
  std::mutex mu_;
  std::vector<uint16_t> generations_;
  std::deque<uint32_t> free_;
};

// A memory arena whose holes pass this fraction of its reserved bytes is
// compacted after a free (when no transfer is in flight): churn then never
// strands more than this. The nvme tier compacts only when an allocation
// needs it, since its moves are file I/O.
constexpr double kCompactAboveHoleFraction = 0.02;
// What one free() may move while it holds the pool's lock (a few ms of
// memmove, plus at most one extent); the rest is
// left to the frees after it, or to an allocation that needs the room.
constexpr uint64_t kCompactBytesPerFree = uint64_t{64} << 20;

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string out = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    out += std::to_string(shape[i]);
    if (shape.size() == 1 || i + 1 < shape.size()) out += ",";
    if (i + 1 < shape.size()) out += " ";
  }
  return out + ")";
}

}  // namespace

const char* TierName(TierKind kind) {
  switch (kind) {
    case TierKind::kHost:
      return "host";
    case TierKind::kCxl:
      return "cxl";
    case TierKind::kNvme:
      return "nvme";
  }
  return "?";
}

uint32_t ObjectTable::IndexOf(int32_t handle) { return jcxl::IndexOf(handle); }

namespace {

// A capacity below the allocator's alignment rounds down to an arena that
// holds nothing: an error, not a tier that silently refuses every object.
Status CheckHoldsAPage(TierKind kind, const HybridAllocator& allocator,
                       uint64_t bytes) {
  if (allocator.capacity() > 0) return Status::Ok();
  return Status(Code::kInvalidArgument,
                std::string(TierName(kind)) + " tier: a capacity of " +
                    std::to_string(bytes) +
                    " bytes (per node) is below its "
                    "allocation granularity of " +
                    std::to_string(allocator.extents().alignment()) +
                    " bytes; give it at least that, or 0 to turn it off");
}

}  // namespace

Status ObjectTable::Init() {
  for (int t = 0; t < kNumTiers; ++t) {
    const TierConfig& tier_config = config_.tiers[t];
    Tier& tier = tiers_[t];
    tier.kind = static_cast<TierKind>(t);
    if (tier_config.capacity == 0) continue;
    tier.enabled = true;
    if (tier_config.link_bytes_per_second > 0 ||
        tier_config.link_latency_ns > 0) {
      tier.link = std::make_unique<LinkModel>(tier_config.link_bytes_per_second,
                                              tier_config.link_latency_ns);
    }
    if (tier.kind == TierKind::kNvme) {
      if (config_.nvme_dir.empty()) {
        return Status(Code::kInvalidArgument,
                      "the nvme tier needs a directory (nvme_dir)");
      }
      auto arena = FileArena::Create(config_.nvme_dir + "/tier.swap",
                                     config_.keep_nvme_files);
      if (!arena.ok()) return arena.status();
      HybridOptions options = config_.allocator;
      options.alignment = std::max<uint64_t>(options.alignment, kBlockBytes);
      options.slab_max_bytes = 0;  // objects own whole blocks: no RMW races
      TierArena entry;
      entry.arena = std::move(*arena);
      entry.allocator =
          std::make_unique<HybridAllocator>(tier_config.capacity, options);
      JCXL_RETURN_IF_ERROR(
          CheckHoldsAPage(tier.kind, *entry.allocator, tier_config.capacity));
      tier.arenas.push_back(std::move(entry));
      continue;
    }
    std::vector<int> nodes = tier_config.nodes;
    std::vector<double> weights = tier_config.weights;
    if (nodes.empty()) nodes.push_back(-1);
    if (weights.size() != nodes.size()) weights.assign(nodes.size(), 1.0);
    const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (!(weights[i] > 0)) {
        return Status(Code::kInvalidArgument,
                      std::string(TierName(tier.kind)) +
                          " tier: node weights must be positive");
      }
      // A node whose weight gives it less than one extent still gets one,
      // rather than an arena that holds nothing.
      const uint64_t share = std::max<uint64_t>(
          config_.allocator.alignment,
          static_cast<uint64_t>(static_cast<double>(tier_config.capacity) *
                                weights[i] / total));
      std::vector<int> bind;
      if (nodes[i] >= 0) bind.push_back(nodes[i]);
      auto arena = MemoryArena::Create(share, bind);
      if (!arena.ok()) return arena.status();
      TierArena entry;
      entry.node = nodes[i];
      entry.weight = weights[i];
      entry.arena = std::move(*arena);
      entry.allocator =
          std::make_unique<HybridAllocator>(share, config_.allocator);
      JCXL_RETURN_IF_ERROR(CheckHoldsAPage(tier.kind, *entry.allocator, share));
      tier.arenas.push_back(std::move(entry));
    }
  }
  return Status::Ok();
}

bool ObjectTable::closed() {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

StatusOr<ObjectTable::Object*> ObjectTable::Lookup(int32_t handle) {
  if (closed_) {
    return Status(Code::kClosed,
                  "pool " + std::to_string(id_) + " is closed; handle " +
                      std::to_string(handle) + " can no longer be used");
  }
  auto it = handle > 0 ? objects_.find(IndexOf(handle)) : objects_.end();
  if (it == objects_.end() || it->second.handle != handle) {
    return Status(Code::kNotFound,
                  "handle " + std::to_string(handle) + " is unknown to pool " +
                      std::to_string(id_) + " (freed, or another pool's)");
  }
  return &it->second;
}

StatusOr<int32_t> ObjectTable::AllocateIn(int t, uint64_t bytes) {
  Tier& tier = tiers_[t];
  // Weighted placement across the tier's nodes: the node whose share would
  // stay lowest relative to its weight (its bandwidth) goes first.
  std::vector<size_t> order(tier.arenas.size());
  std::iota(order.begin(), order.end(), 0);
  auto load = [&](size_t i) {
    const TierArena& arena = tier.arenas[i];
    return static_cast<double>(arena.allocator->Stats().live + bytes) /
           arena.weight;
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return load(a) < load(b); });
  Status last;
  for (size_t i : order) {
    StatusOr<Allocation> allocation = tier.arenas[i].allocator->Allocate(bytes);
    if (!allocation.ok()) {
      last = allocation.status();
      continue;
    }
    const int32_t handle = HandleSpace::Get().Take();
    if (handle == 0) {
      tier.arenas[i].allocator->Free(*allocation);
      return Status(Code::kExhausted,
                    "this process's pools hold the most objects they can (" +
                        std::to_string(kIndexMask + 1) +
                        " handles, each reused for at most " +
                        std::to_string(kMaxGeneration) + " objects)");
    }
    Object& object = objects_[IndexOf(handle)];
    object.handle = handle;
    object.tier = t;
    object.arena = static_cast<int>(i);
    object.allocation = *allocation;
    object.pins = 0;
    return handle;
  }
  return last;
}

StatusOr<int32_t> ObjectTable::Allocate(TierKind kind, uint64_t bytes,
                                        std::vector<int64_t> shape,
                                        std::string dtype, int64_t timeout_ns) {
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) {
    return Status(Code::kClosed, "pool " + std::to_string(id_) + " is closed");
  }
  if (bytes == 0) {
    return Status(
        Code::kInvalidArgument,
        "cannot store an object of 0 bytes (shape " + ShapeString(shape) + ")");
  }
  const int first = static_cast<int>(kind);
  if (!tiers_[first].enabled) {
    return Status(Code::kInvalidArgument,
                  std::string("the ") + TierName(kind) +
                      " tier is off in this pool (capacity 0)");
  }
  std::string why;
  for (int t = first; t < kNumTiers; ++t) {
    if (!tiers_[t].enabled) continue;
    StatusOr<int32_t> handle = AllocateIn(t, bytes);
    std::string compacted;
    if (handle.status().code() == Code::kExhausted) {
      // Free bytes scattered in holes: gather them, then try again.
      bool fits = false;
      for (const TierArena& arena : tiers_[t].arenas) {
        fits = fits || arena.allocator->FitsAfterCompact(bytes);
      }
      if (!fits) {
        compacted = " (compacting cannot help: too few bytes are free)";
      } else {
        Status status = CompactLocked(lock, timeout_ns, t);
        if (closed_) {  // while it waited for transfers
          return Status(Code::kClosed, "pool " + std::to_string(id_) +
                                           " was closed during the "
                                           "allocation");
        }
        if (status.ok()) {
          handle = AllocateIn(t, bytes);
        } else {
          compacted =
              " (compacting to make room failed: " + status.message() + ")";
        }
      }
    }
    if (handle.ok()) {
      Object& object = objects_.at(IndexOf(*handle));
      object.shape = std::move(shape);
      object.dtype = std::move(dtype);
      return handle;
    }
    if (handle.status().code() != Code::kExhausted) return handle.status();
    why += std::string(why.empty() ? "" : "; ") + TierName(tiers_[t].kind) +
           ": " + handle.status().message() + compacted;
    if (!config_.spill) break;
  }
  return Status(Code::kExhausted,
                std::string("the ") + TierName(kind) +
                    " tier is full: cannot store " + FormatBytes(bytes) +
                    " (shape " + ShapeString(shape) + ", " + dtype + "). " +
                    why +
                    (config_.spill ? ""
                                   : ". Spilling to the next tier is off "
                                     "(Pool(spill=True) allows it)"));
}

Status ObjectTable::CheckWritable(int32_t handle, const Object& object) {
  if (object.copy_of == 0) return Status::Ok();
  return Status(Code::kInvalidArgument,
                Label(handle, object) + " is a copy the pool keeps of handle " +
                    std::to_string(object.copy_of) +
                    "; write the source (the copy follows it)");
}

namespace {

// Whether a transfer in `direction` must wait for `run` (id, writes it).
bool Blocks(const std::pair<uint64_t, bool>& run, Direction direction) {
  return direction == Direction::kToPool || run.second;
}

}  // namespace

bool ObjectTable::Follows(const Object& object, Direction direction) {
  return std::any_of(object.runs.begin(), object.runs.end(),
                     [&](const std::pair<uint64_t, bool>& run) {
                       return Blocks(run, direction);
                     });
}

Status ObjectTable::AwaitRuns(std::unique_lock<std::mutex>& lock,
                              int32_t handle, Direction direction) {
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::nanoseconds(std::min(config_.run_wait_ns, kMaxTimeoutNs));
  bool late = false;
  std::vector<uint64_t> promoted;
  for (;;) {
    // Anew after each wait: the object may have been freed meanwhile.
    StatusOr<Object*> found = Lookup(handle);
    if (!found.ok()) return found.status();
    const Object& object = **found;
    if (!Follows(object, direction)) {
      if (direction == Direction::kFromPool && !object.damage.empty()) {
        return Status(Code::kInvalidArgument,
                      Label(handle, object) + " cannot be read: " +
                          object.damage);
      }
      return Status::Ok();
    }
    if (late) {
      const auto& [run, writes] = object.runs.front();
      return Status(Code::kTimeout,
                    Label(handle, object) + ": update run " +
                        std::to_string(run) + ", which " +
                        (writes ? "writes" : "reads") +
                        " it, was not done after " +
                        std::to_string(config_.run_wait_ns / 1000000) +
                        " ms");
    }
    // What it waits for goes first (its runs are queued in the order the
    // step's backward pass made them; a forward pass wants them reversed).
    if (promote_run_) {
      for (const std::pair<uint64_t, bool>& run : object.runs) {
        if (Blocks(run, direction) &&
            std::find(promoted.begin(), promoted.end(), run.first) ==
                promoted.end()) {
          promote_run_(run.first);
          promoted.push_back(run.first);
        }
      }
    }
    late = unpinned_cv_.wait_until(lock, deadline) == std::cv_status::timeout;
  }
}

Status ObjectTable::WaitUnpinned(std::unique_lock<std::mutex>& lock,
                                 int64_t timeout_ns, int64_t index) {
  // By index, not by pointer: while the lock is released, the object may
  // be freed and Close may clear objects_.
  auto idle = [&] {
    if (index < 0) return total_pins_ == 0;
    auto it = objects_.find(static_cast<uint32_t>(index));
    return it == objects_.end() || it->second.pins == 0;
  };
  if (!unpinned_cv_.wait_for(
          lock, std::chrono::nanoseconds(std::min(timeout_ns, kMaxTimeoutNs)),
          idle)) {
    return Status(Code::kTimeout, "transfers still in flight after " +
                                      std::to_string(timeout_ns / 1000000) +
                                      " ms");
  }
  return Status::Ok();
}

void ObjectTable::ReleaseTop(TierArena& arena, uint64_t old_top) {
  const uint64_t top = arena.allocator->extents().top();
  if (top >= old_top) return;
  char* base = arena.arena->base();
  if (base == nullptr) {
    arena.arena->Release(top, old_top - top);
    return;
  }
  // Pages a DMA engine has locked stay: it would keep targeting them.
  page_locks_.ReleaseUnlocked(base + top, old_top - top,
                              [&](char* address, uint64_t bytes) {
                                arena.arena->Release(address - base, bytes);
                              });
}

Status ObjectTable::Free(int32_t handle, int64_t timeout_ns) {
  std::unique_lock<std::mutex> lock(mu_);
  StatusOr<Object*> found = Lookup(handle);
  if (!found.ok()) return found.status();
  Status waited = WaitUnpinned(lock, timeout_ns, IndexOf(handle));
  if (!waited.ok()) {
    found = Lookup(handle);
    return Status(Code::kTimeout,
                  "cannot free " +
                      (found.ok() ? Label(handle, **found)
                                  : "handle " + std::to_string(handle)) +
                      ": " + waited.message());
  }
  // The wait released the lock: the handle may have been freed meanwhile.
  found = Lookup(handle);
  if (!found.ok()) return found.status();
  Object* object = *found;
  TierArena& arena = tiers_[object->tier].arenas[object->arena];
  const uint64_t old_top = arena.allocator->extents().top();
  JCXL_RETURN_IF_ERROR(arena.allocator->Free(object->allocation));
  ReleaseTop(arena, old_top);
  Tier& tier = tiers_[object->tier];
  const size_t arena_index = static_cast<size_t>(object->arena);
  objects_.erase(IndexOf(handle));
  HandleSpace::Get().Give(handle);
  CompactIfFragmented(tier, arena_index);
  return Status::Ok();
}

void ObjectTable::CompactIfFragmented(Tier& tier, size_t a) {
  if (tier.kind == TierKind::kNvme || total_pins_ > 0 || compacting_) return;
  const ExtentAllocator& extents = tier.arenas[a].allocator->extents();
  if (static_cast<double>(extents.hole_bytes()) >
      kCompactAboveHoleFraction * static_cast<double>(extents.top())) {
    Status status = CompactArena(tier, a, kCompactBytesPerFree);
    (void)status;  // a memory arena's moves cannot fail
  }
}

StatusOr<ObjectTable::Object*> ObjectTable::LookupAfterRuns(
    std::unique_lock<std::mutex>& lock, int32_t handle, uint64_t bytes,
    uint64_t offset, Direction direction) {
  for (;;) {
    JCXL_RETURN_IF_ERROR(AwaitRuns(lock, handle, direction));
    StatusOr<Object*> found = LookupRange(lock, handle, bytes, offset);
    // A run may have started while LookupRange waited for a compaction.
    if (!found.ok() || !Follows(**found, direction)) return found;
  }
}

StatusOr<ObjectTable::Object*> ObjectTable::LookupRange(
    std::unique_lock<std::mutex>& lock, int32_t handle, uint64_t bytes,
    uint64_t offset) {
  unpinned_cv_.wait(lock, [this] { return !compacting_; });
  StatusOr<Object*> found = Lookup(handle);
  if (!found.ok()) return found.status();
  const uint64_t size = (*found)->allocation.bytes;
  if (offset > size || bytes > size - offset) {
    return Status(Code::kInvalidArgument,
                  "handle " + std::to_string(handle) + " holds " +
                      std::to_string(size) + " bytes; cannot access " +
                      std::to_string(bytes) + " bytes at offset " +
                      std::to_string(offset));
  }
  return found;
}

void ObjectTable::Unpin(uint32_t index, int tier, Direction direction,
                        uint64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(index);
    if (it != objects_.end()) {  // pinned: never freed
      --it->second.pins;
      if (direction == Direction::kToPool) ++it->second.writes;
    }
    --total_pins_;
    if (direction == Direction::kFromPool) {
      tiers_[tier].bytes_read += bytes;
    } else {
      tiers_[tier].bytes_written += bytes;
    }
  }
  unpinned_cv_.notify_all();
}

std::string ObjectTable::Label(int32_t handle, const Object& object) {
  return "handle " + std::to_string(handle) + " (" +
         TierName(static_cast<TierKind>(object.tier)) + " tier, shape " +
         ShapeString(object.shape) + ", " +
         (object.dtype.empty() ? "bytes" : object.dtype) + ")";
}

ObjectInfo ObjectTable::InfoOf(int32_t handle, const Object& object) {
  const TierArena& arena = tiers_[object.tier].arenas[object.arena];
  ObjectInfo info;
  info.handle = handle;
  info.tier = static_cast<TierKind>(object.tier);
  info.node = arena.node;
  info.offset = arena.allocator->OffsetOf(object.allocation);
  info.bytes = object.allocation.bytes;
  info.slab = object.allocation.is_slab();
  info.copy_of = object.copy_of;
  info.shape = object.shape;
  info.dtype = object.dtype;
  return info;
}

StatusOr<ObjectInfo> ObjectTable::Info(int32_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  StatusOr<Object*> found = Lookup(handle);
  if (!found.ok()) return found.status();
  return InfoOf(handle, **found);
}

std::vector<int32_t> ObjectTable::Handles() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int32_t> handles;
  handles.reserve(objects_.size());
  for (const auto& [index, object] : objects_) handles.push_back(object.handle);
  std::sort(handles.begin(), handles.end(),
            [](int32_t a, int32_t b) { return IndexOf(a) < IndexOf(b); });
  return handles;
}

StatusOr<std::vector<int>> ObjectTable::PageNodes(int32_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  StatusOr<Object*> found = Lookup(handle);
  if (!found.ok()) return found.status();
  const Object& object = **found;
  const TierArena& arena = tiers_[object.tier].arenas[object.arena];
  if (arena.arena->base() == nullptr) {
    return Status(Code::kInvalidArgument,
                  "handle " + std::to_string(handle) +
                      " lives in the nvme tier's file, not in memory pages");
  }
  return numa::PageNodes(
      arena.arena->base() + arena.allocator->OffsetOf(object.allocation),
      object.allocation.bytes);
}

Status ObjectTable::Compact(int64_t timeout_ns) {
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) {
    return Status(Code::kClosed, "pool " + std::to_string(id_) + " is closed");
  }
  return CompactLocked(lock, timeout_ns, -1);
}

Status ObjectTable::CompactLocked(std::unique_lock<std::mutex>& lock,
                                  int64_t timeout_ns, int only_tier) {
  compacting_ = true;  // new transfers wait (LookupRange)
  Status result = WaitUnpinned(lock, timeout_ns, -1);
  if (result.ok()) {
    for (int t = 0; t < kNumTiers; ++t) {
      if (only_tier >= 0 && t != only_tier) continue;
      for (size_t a = 0; a < tiers_[t].arenas.size(); ++a) {
        Status moved = CompactArena(tiers_[t], a);
        if (!moved.ok() && result.ok()) result = moved;
      }
    }
  }
  compacting_ = false;
  unpinned_cv_.notify_all();
  return result;
}

Status ObjectTable::CompactArena(Tier& tier, size_t a, uint64_t max_bytes) {
  TierArena& arena = tier.arenas[a];
  const uint64_t old_top = arena.allocator->extents().top();
  std::vector<Move> moves = arena.allocator->Compact(max_bytes);
  if (moves.empty()) return Status::Ok();
  Status result;
  for (const Move& move : moves) {  // in order: an extent may move twice
    Status moved = arena.arena->Move(move.from, move.to, move.bytes);
    if (!moved.ok() && result.ok()) result = moved;
  }
  const std::map<uint64_t, uint64_t> remap = FinalOffsets(moves);
  for (auto& [index, object] : objects_) {
    if (object.allocation.is_slab() ||
        object.tier != static_cast<int>(tier.kind) ||
        object.arena != static_cast<int>(a)) {
      continue;
    }
    auto it = remap.find(object.allocation.extent_offset);
    if (it != remap.end()) object.allocation.extent_offset = it->second;
  }
  ReleaseTop(arena, old_top);
  return result;
}

std::vector<TierStats> ObjectTable::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<TierStats> out;
  for (int t = 0; t < kNumTiers; ++t) {
    const Tier& tier = tiers_[t];
    TierStats stats;
    stats.kind = tier.kind;
    stats.enabled = tier.enabled;
    stats.emulated = config_.tiers[t].emulated;
    if (tier.link) {
      stats.link_bytes_per_second = tier.link->bytes_per_second();
      stats.link_latency_ns = tier.link->latency_ns();
    }
    stats.bytes_read = tier.bytes_read;
    stats.bytes_written = tier.bytes_written;
    for (const TierArena& arena : tier.arenas) {
      ArenaStats entry;
      entry.node = arena.node;
      entry.weight = arena.weight;
      entry.description = arena.arena->Describe();
      entry.allocator = arena.allocator->Stats();
      stats.arenas.push_back(std::move(entry));
    }
    out.push_back(std::move(stats));
  }
  return out;
}

Status ObjectTable::SetLink(TierKind kind, double bytes_per_second,
                            int64_t latency_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  Tier& tier = tiers_[static_cast<int>(kind)];
  if (!tier.enabled) {
    return Status(Code::kInvalidArgument,
                  std::string("the ") + TierName(kind) + " tier is off");
  }
  if (tier.link) {
    tier.link->Set(bytes_per_second, latency_ns);
  } else {
    tier.link = std::make_unique<LinkModel>(bytes_per_second, latency_ns);
  }
  return Status::Ok();
}

void ObjectTable::ReleaseAll() {
  // Before the arenas are unmapped; while a direct copy is still under way
  // (past the timeout) its pages stay locked, as mapped, until EndDirect.
  if (direct_pins_ == 0) page_locks_.UnlockAll();
  for (Tier& tier : tiers_) {
    for (TierArena& arena : tier.arenas) {
      // A direct copy still under way past the timeout: its memory stays
      // mapped until it ends (EndDirect), never reused while it copies.
      if (direct_pins_ > 0 && arena.arena->base() != nullptr) {
        retired_arenas_.push_back(std::move(arena));
      }
    }
    tier.arenas.clear();  // unmap, remove files
  }
  if (!config_.nvme_dir.empty() && !config_.keep_nvme_files) {
    rmdir(config_.nvme_dir.c_str());
  }
  for (const auto& [index, object] : objects_) {
    HandleSpace::Get().Give(object.handle);
  }
  objects_.clear();
}

}  // namespace jcxl
