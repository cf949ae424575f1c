#include "pool.h"

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

std::mutex g_registry_mu;
std::map<int32_t, std::weak_ptr<Pool>>& Registry() {
  static auto* registry = new std::map<int32_t, std::weak_ptr<Pool>>();
  return *registry;
}
int32_t g_next_pool_id = 1;

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

Pool::Pool(const PoolConfig& config)
    : config_(config), owner_pid_(getpid()) {}

StatusOr<std::shared_ptr<Pool>> Pool::Create(const PoolConfig& config) {
  std::shared_ptr<Pool> pool(new Pool(config));
  JCXL_RETURN_IF_ERROR(pool->Init());
  std::lock_guard<std::mutex> lock(g_registry_mu);
  pool->id_ = g_next_pool_id++;
  Registry()[pool->id_] = pool;
  return pool;
}

std::shared_ptr<Pool> Pool::Find(int32_t id) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = Registry().find(id);
  return it == Registry().end() ? nullptr : it->second.lock();
}

namespace {

// A capacity below the allocator's alignment rounds down to an arena that
// holds nothing: an error, not a tier that silently refuses every object.
Status CheckHoldsAPage(TierKind kind, const HybridAllocator& allocator,
                       uint64_t bytes) {
  if (allocator.capacity() > 0) return Status::Ok();
  return Status(Code::kInvalidArgument,
                std::string(TierName(kind)) + " tier: a capacity of " +
                    std::to_string(bytes) + " bytes (per node) is below its "
                    "allocation granularity of " +
                    std::to_string(allocator.extents().alignment()) +
                    " bytes; give it at least that, or 0 to turn it off");
}

}  // namespace

Status Pool::Init() {
  for (int t = 0; t < kNumTiers; ++t) {
    const TierConfig& tier_config = config_.tiers[t];
    Tier& tier = tiers_[t];
    tier.kind = static_cast<TierKind>(t);
    if (tier_config.capacity == 0) continue;
    tier.enabled = true;
    if (tier_config.link_bytes_per_second > 0 ||
        tier_config.link_latency_ns > 0) {
      tier.link = std::make_unique<LinkModel>(
          tier_config.link_bytes_per_second, tier_config.link_latency_ns);
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
      JCXL_RETURN_IF_ERROR(CheckHoldsAPage(tier.kind, *entry.allocator,
                                           tier_config.capacity));
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
      entry.allocator = std::make_unique<HybridAllocator>(share,
                                                          config_.allocator);
      JCXL_RETURN_IF_ERROR(CheckHoldsAPage(tier.kind, *entry.allocator,
                                           share));
      tier.arenas.push_back(std::move(entry));
    }
  }
  engine_ = std::make_unique<CopyEngine>(config_.copy_threads,
                                         config_.chunk_bytes,
                                         config_.copy_cpus);
  if (config_.update_threads < 0) {
    return Status(Code::kInvalidArgument,
                  "update_threads must be >= 0 (0: one per CPU), got " +
                      std::to_string(config_.update_threads));
  }
  updater_ = std::make_unique<HostUpdater>(config_.update_threads);
  return Status::Ok();
}

Pool::~Pool() {
  if (!closed()) Close(/*timeout_ns=*/60'000'000'000);
  std::lock_guard<std::mutex> lock(g_registry_mu);
  Registry().erase(id_);
}

bool Pool::closed() {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

StatusOr<Pool::Object*> Pool::Lookup(int32_t handle) {
  if (closed_) {
    return Status(Code::kClosed, "pool " + std::to_string(id_) +
                                     " is closed; handle " +
                                     std::to_string(handle) +
                                     " can no longer be used");
  }
  auto it = handle > 0 ? objects_.find(IndexOf(handle)) : objects_.end();
  if (it == objects_.end() || it->second.handle != handle) {
    return Status(Code::kNotFound, "handle " + std::to_string(handle) +
                                       " is unknown to pool " +
                                       std::to_string(id_) +
                                       " (freed, or another pool's)");
  }
  return &it->second;
}

StatusOr<int32_t> Pool::AllocateIn(int t, uint64_t bytes) {
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

StatusOr<int32_t> Pool::Allocate(TierKind kind, uint64_t bytes,
                                 std::vector<int64_t> shape,
                                 std::string dtype, int64_t timeout_ns) {
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) {
    return Status(Code::kClosed, "pool " + std::to_string(id_) + " is closed");
  }
  if (bytes == 0) {
    return Status(Code::kInvalidArgument,
                  "cannot store an object of 0 bytes (shape " +
                      ShapeString(shape) + ")");
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
          compacted = " (compacting to make room failed: " +
                      status.message() + ")";
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

namespace {

// The elements a shape holds, or -1 if the product overflows int64.
int64_t ElementsOf(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && n > INT64_MAX / d)) return -1;
    n *= d;
  }
  return n;
}

}  // namespace

StatusOr<int32_t> Pool::AllocateCopy(int32_t source, std::string dtype,
                                     int64_t timeout_ns) {
  TierKind tier;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  auto program = std::make_shared<UpdateProgram>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    StatusOr<Object*> found = Lookup(source);
    if (!found.ok()) return found.status();
    const Object& object = **found;
    const int64_t elements = ElementsOf(object.shape);
    StatusOr<UpdateTarget> checked =
        UpdateTargetOf(source, "the source of a copy", elements);
    if (!checked.ok()) return checked.status();
    if (object.copy_of != 0) {
      return Status(Code::kInvalidArgument,
                    Label(source, object) + " is itself a copy (of handle " +
                        std::to_string(object.copy_of) +
                        "); copy its source");
    }
    if (dtype != "float32" && dtype != "bfloat16") {
      return Status(Code::kInvalidArgument,
                    "a copy is float32 or bfloat16, not " + dtype);
    }
    tier = static_cast<TierKind>(object.tier);
    shape = object.shape;
    bytes = static_cast<uint64_t>(elements) * (dtype == "float32" ? 4 : 2);
    program->num_elements = elements;
    program->inputs.push_back(UpdateInput{});
    program->inputs[0].handle = source;
  }
  StatusOr<int32_t> handle =
      Allocate(tier, bytes, shape, dtype, timeout_ns);
  if (!handle.ok()) return handle;
  std::lock_guard<std::mutex> lock(mu_);
  StatusOr<Object*> found = Lookup(*handle);
  if (!found.ok()) return found.status();
  program->outputs.push_back(UpdateOutput{0, *handle});
  (*found)->copy_of = source;
  (*found)->refresh = std::move(program);
  return handle;
}

Status Pool::RefreshIfStale(int32_t handle) {
  std::unique_lock<std::mutex> lock(mu_);
  // As StartUpdate: a refresh takes addresses, and joins no compaction.
  unpinned_cv_.wait(lock, [this] { return !compacting_; });
  StatusOr<Object*> found = Lookup(handle);
  if (!found.ok() || (*found)->copy_of == 0) return Status::Ok();
  const Object& copy = **found;
  StatusOr<Object*> source = Lookup(copy.copy_of);
  if (!source.ok()) {
    return Status(Code::kNotFound,
                  Label(handle, copy) + " is a copy of handle " +
                      std::to_string(copy.copy_of) +
                      ", which was freed: it can no longer be read");
  }
  if (copy.copied_writes == (*source)->writes) return Status::Ok();
  const uint64_t writes = (*source)->writes;
  std::shared_ptr<UpdateRun> run = copy.refreshing;
  if (run == nullptr || copy.refreshing_writes != writes) {
    StatusOr<std::shared_ptr<UpdateRun>> started =
        StartProgram(lock, copy.refresh, 0, {});
    if (!started.ok()) return started.status();
    run = *started;
    (*found)->refreshing = run;
    (*found)->refreshing_writes = writes;
  }
  lock.unlock();
  Status status = run->Wait(kMaxTimeoutNs);
  if (!status.ok()) {
    return Status(status.code(), "refreshing the copy " +
                                     std::to_string(handle) + ": " +
                                     status.message());
  }
  lock.lock();
  found = Lookup(handle);
  if (found.ok() && (*found)->refreshing == run) {
    (*found)->copied_writes = writes;
    (*found)->refreshing = nullptr;
  }
  return Status::Ok();
}

Status Pool::CheckWritable(int32_t handle, const Object& object) {
  if (object.copy_of == 0) return Status::Ok();
  return Status(Code::kInvalidArgument,
                Label(handle, object) + " is a copy the pool keeps of handle " +
                    std::to_string(object.copy_of) +
                    "; write the source (the copy follows it)");
}

Status Pool::WaitUnpinned(std::unique_lock<std::mutex>& lock,
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
    return Status(Code::kTimeout,
                  "transfers still in flight after " +
                      std::to_string(timeout_ns / 1000000) + " ms");
  }
  return Status::Ok();
}

void Pool::ReleaseTop(TierArena& arena, uint64_t old_top) {
  const uint64_t top = arena.allocator->extents().top();
  if (top >= old_top) return;
  char* base = arena.arena->base();
  if (base == nullptr) {
    arena.arena->Release(top, old_top - top);
    return;
  }
  // Pages a DMA engine has locked stay: it would keep targeting them.
  page_locks_.ReleaseUnlocked(
      base + top, old_top - top, [&](char* address, uint64_t bytes) {
        arena.arena->Release(address - base, bytes);
      });
}

Status Pool::Free(int32_t handle, int64_t timeout_ns) {
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

void Pool::CompactIfFragmented(Tier& tier, size_t a) {
  if (tier.kind == TierKind::kNvme || total_pins_ > 0 || compacting_) return;
  const ExtentAllocator& extents = tier.arenas[a].allocator->extents();
  if (static_cast<double>(extents.hole_bytes()) >
      kCompactAboveHoleFraction * static_cast<double>(extents.top())) {
    Status status = CompactArena(tier, a, kCompactBytesPerFree);
    (void)status;  // a memory arena's moves cannot fail
  }
}

StatusOr<Pool::Object*> Pool::LookupRange(std::unique_lock<std::mutex>& lock,
                                          int32_t handle, uint64_t bytes,
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

StatusOr<std::shared_ptr<Ticket>> Pool::Transfer(
    int32_t handle, void* buffer, uint64_t bytes, uint64_t offset,
    int priority, uint64_t chunk_bytes, Direction direction,
    std::shared_ptr<void> owner) {
  std::unique_lock<std::mutex> lock(mu_);
  StatusOr<Object*> found = LookupRange(lock, handle, bytes, offset);
  if (!found.ok()) return found.status();
  Object* object = *found;
  if (direction == Direction::kToPool) {
    JCXL_RETURN_IF_ERROR(CheckWritable(handle, *object));
  }
  if (bytes > 0 && buffer == nullptr) {
    return Status(Code::kInvalidArgument, "null buffer for handle " +
                                              std::to_string(handle));
  }
  Tier& tier = tiers_[object->tier];
  TierArena& arena = tier.arenas[object->arena];
  TransferRequest request;
  request.arena = arena.arena.get();
  request.arena_offset = arena.allocator->OffsetOf(object->allocation) + offset;
  request.buffer = buffer;
  request.bytes = bytes;
  request.direction = direction;
  request.link = tier.link.get();
  request.priority = priority;
  request.chunk_bytes = chunk_bytes;
  request.record.handle = handle;
  request.record.tier = object->tier;
  request.record.node = arena.node;
  request.label = Label(handle, *object);
  request.buffer_owner = std::move(owner);
  const uint32_t index = IndexOf(handle);
  const int tier_index = object->tier;
  request.on_complete = [this, index, tier_index, direction,
                         bytes](const Status&) {
    Unpin(index, tier_index, direction, bytes);
  };
  ++object->pins;
  ++total_pins_;
  // Submitted under the lock: Close() takes the engine away only under it,
  // after setting closed_ (so Submit never finishes a request inline here).
  return engine_->Submit(std::move(request));
}

StatusOr<DirectRange> Pool::BeginDirect(int32_t handle, uint64_t bytes,
                                        uint64_t offset, Direction direction) {
  if (direction == Direction::kFromPool) {
    JCXL_RETURN_IF_ERROR(RefreshIfStale(handle));
  }
  std::unique_lock<std::mutex> lock(mu_);
  StatusOr<Object*> found = LookupRange(lock, handle, bytes, offset);
  if (!found.ok()) return found.status();
  Object* object = *found;
  if (direction == Direction::kToPool) {
    JCXL_RETURN_IF_ERROR(CheckWritable(handle, *object));
  }
  Tier& tier = tiers_[object->tier];
  TierArena& arena = tier.arenas[object->arena];
  if (arena.arena->base() == nullptr || tier.link) {
    return Status(Code::kInvalidArgument,
                  Label(handle, *object) +
                      " is not directly addressable (nvme file, or a tier "
                      "behind a link model); use the copy engine");
  }
  DirectRange range;
  range.address = arena.arena->base() +
                  arena.allocator->OffsetOf(object->allocation) + offset;
  range.bytes = bytes;
  range.handle = handle;
  range.direction = direction;
  range.region_base = arena.arena->base();
  range.region_bytes = arena.arena->mapped_bytes();
  ++object->pins;
  ++total_pins_;
  ++direct_pins_;
  return range;
}

void Pool::EndDirect(const DirectRange& range) {
  int tier = 0;
  std::vector<TierArena> unmap;  // outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(IndexOf(range.handle));
    tier = it == objects_.end() ? 0 : it->second.tier;
    if (--direct_pins_ == 0) unmap.swap(retired_arenas_);
  }
  // The last direct copy Close outwaited: its chunks unlock now, before the
  // arenas Close kept mapped for it are unmapped.
  if (!unmap.empty()) page_locks_.UnlockAll();
  Unpin(IndexOf(range.handle), tier, range.direction, range.bytes);
}

std::vector<MemoryRegion> Pool::MemoryRegions() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<MemoryRegion> regions;
  for (Tier& tier : tiers_) {
    for (TierArena& arena : tier.arenas) {
      if (arena.arena->base() != nullptr) {
        regions.push_back({arena.arena->base(), arena.arena->mapped_bytes()});
      }
    }
  }
  return regions;
}

void Pool::OnClose(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  on_close_.push_back(std::move(fn));
}

void Pool::Unpin(uint32_t index, int tier, Direction direction,
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

StatusOr<std::shared_ptr<Ticket>> Pool::Write(int32_t handle, const void* src,
                                              uint64_t bytes, uint64_t offset,
                                              int priority,
                                              uint64_t chunk_bytes,
                                              std::shared_ptr<void> owner) {
  return Transfer(handle, const_cast<void*>(src), bytes, offset, priority,
                  chunk_bytes, Direction::kToPool, std::move(owner));
}

StatusOr<std::shared_ptr<Ticket>> Pool::Read(int32_t handle, void* dst,
                                             uint64_t bytes, uint64_t offset,
                                             int priority,
                                             uint64_t chunk_bytes,
                                             std::shared_ptr<void> owner) {
  JCXL_RETURN_IF_ERROR(RefreshIfStale(handle));
  return Transfer(handle, dst, bytes, offset, priority, chunk_bytes,
                  Direction::kFromPool, std::move(owner));
}

std::string Pool::Label(int32_t handle, const Object& object) {
  return "handle " + std::to_string(handle) + " (" +
         TierName(static_cast<TierKind>(object.tier)) + " tier, shape " +
         ShapeString(object.shape) + ", " +
         (object.dtype.empty() ? "bytes" : object.dtype) + ")";
}

ObjectInfo Pool::InfoOf(int32_t handle, const Object& object) {
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

StatusOr<ObjectInfo> Pool::Info(int32_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  StatusOr<Object*> found = Lookup(handle);
  if (!found.ok()) return found.status();
  return InfoOf(handle, **found);
}

std::vector<int32_t> Pool::Handles() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int32_t> handles;
  handles.reserve(objects_.size());
  for (const auto& [index, object] : objects_) handles.push_back(object.handle);
  std::sort(handles.begin(), handles.end(), [](int32_t a, int32_t b) {
    return IndexOf(a) < IndexOf(b);
  });
  return handles;
}

StatusOr<std::vector<int>> Pool::PageNodes(int32_t handle) {
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

Status Pool::Compact(int64_t timeout_ns) {
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) {
    return Status(Code::kClosed, "pool " + std::to_string(id_) + " is closed");
  }
  return CompactLocked(lock, timeout_ns, -1);
}

Status Pool::CompactLocked(std::unique_lock<std::mutex>& lock,
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

Status Pool::CompactArena(Tier& tier, size_t a, uint64_t max_bytes) {
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

std::vector<TierStats> Pool::Stats() {
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

std::vector<TransferRecord> Pool::DrainRecords() {
  std::lock_guard<std::mutex> lock(mu_);
  return engine_ ? engine_->DrainRecords() : std::vector<TransferRecord>{};
}

Status Pool::SetLink(TierKind kind, double bytes_per_second,
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

Status Pool::InjectFault(const FaultSpec& spec) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_ || !engine_) {
    return Status(Code::kClosed, "pool " + std::to_string(id_) + " is closed");
  }
  engine_->InjectFault(spec);
  return Status::Ok();
}

uint64_t Pool::faults_injected() {
  std::lock_guard<std::mutex> lock(mu_);
  return engine_ ? engine_->faults_injected() : 0;
}

StatusOr<UpdateTarget> Pool::UpdateTargetOf(int32_t handle,
                                            const std::string& role,
                                            int64_t elements) {
  StatusOr<Object*> found = Lookup(handle);
  if (!found.ok()) {
    return Status(found.status().code(), role + ": " +
                                             found.status().message());
  }
  const Object& object = **found;
  UpdateTarget target;
  target.handle = handle;
  if (object.dtype == "float32") {
    target.dtype = UpdateDType::kF32;
  } else if (object.dtype == "bfloat16") {
    target.dtype = UpdateDType::kBF16;
  } else {
    return Status(Code::kInvalidArgument,
                  role + ": " + Label(handle, object) + " holds " +
                      (object.dtype.empty() ? "untyped bytes" : object.dtype) +
                      "; update programs read and write float32 or bfloat16 "
                      "objects");
  }
  const int64_t held = ElementsOf(object.shape);
  const uint64_t item = target.dtype == UpdateDType::kBF16 ? 2 : 4;
  if (held != elements) {
    return Status(Code::kInvalidArgument,
                  role + ": " + Label(handle, object) + " holds " +
                      std::to_string(held) +
                      " elements, but the program is for num_elements = " +
                      std::to_string(elements));
  }
  if (object.allocation.bytes != static_cast<uint64_t>(elements) * item) {
    return Status(Code::kInvalidArgument,
                  role + ": " + Label(handle, object) + " holds " +
                      std::to_string(object.allocation.bytes) +
                      " bytes, not the " +
                      std::to_string(static_cast<uint64_t>(elements) * item) +
                      " of its shape and dtype");
  }
  const TierArena& arena = tiers_[object.tier].arenas[object.arena];
  const uint64_t offset = arena.allocator->OffsetOf(object.allocation);
  if (arena.arena->base() != nullptr) {
    target.memory = arena.arena->base() + offset;
  } else {
    target.file = arena.arena.get();
    target.file_offset = offset;
  }
  return target;
}

StatusOr<int32_t> Pool::RegisterUpdate(UpdateProgram program) {
  JCXL_RETURN_IF_ERROR(ValidateUpdateProgram(program));
  if (program.outputs.empty()) {
    return Status(Code::kInvalidArgument,
                  "update program: it writes no object (no outputs)");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) {
    return Status(Code::kClosed, "pool " + std::to_string(id_) + " is closed");
  }
  for (size_t i = 0; i < program.inputs.size(); ++i) {
    if (program.inputs[i].kind != UpdateInput::Kind::kObject) continue;
    StatusOr<UpdateTarget> target =
        UpdateTargetOf(program.inputs[i].handle,
                       "update program: input " + std::to_string(i),
                       program.num_elements);
    if (!target.ok()) return target.status();
  }
  for (size_t o = 0; o < program.outputs.size(); ++o) {
    const UpdateOutput& out = program.outputs[o];
    StatusOr<UpdateTarget> target = UpdateTargetOf(
        out.handle, "update program: output " + std::to_string(o),
        program.num_elements);
    if (!target.ok()) return target.status();
    const Object& object = objects_.at(IndexOf(out.handle));
    const bool with_source = std::any_of(
        program.outputs.begin(), program.outputs.end(),
        [&](const UpdateOutput& other) {
          return other.handle == object.copy_of && other.reg == out.reg;
        });
    if (object.copy_of != 0 && !with_source) {
      return Status(Code::kInvalidArgument,
                    "update program: output " + std::to_string(o) + ": " +
                        Label(out.handle, object) +
                        " is a copy the pool keeps of handle " +
                        std::to_string(object.copy_of) +
                        "; a program may write it only from the register "
                        "it writes the source from");
    }
  }
  if (next_update_id_ == INT32_MAX) {
    return Status(Code::kExhausted, "pool " + std::to_string(id_) +
                                        " has registered the most update "
                                        "programs it can");
  }
  const int32_t id = next_update_id_++;
  updates_[id] = std::make_shared<const UpdateProgram>(std::move(program));
  return id;
}

Status Pool::ReleaseUpdate(int32_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) {
    return Status(Code::kClosed, "pool " + std::to_string(id_) + " is closed");
  }
  if (updates_.erase(id) == 0) {
    return Status(Code::kNotFound, "update program " + std::to_string(id) +
                                       " is unknown to pool " +
                                       std::to_string(id_) +
                                       " (released, or never registered)");
  }
  return Status::Ok();
}

StatusOr<std::shared_ptr<UpdateRun>> Pool::StartUpdate(
    int32_t id, std::vector<float> scalars) {
  std::unique_lock<std::mutex> lock(mu_);
  // Addresses are taken now: no compaction may be moving objects.
  unpinned_cv_.wait(lock, [this] { return !compacting_; });
  if (closed_) {
    return Status(Code::kClosed, "pool " + std::to_string(id_) + " is closed");
  }
  auto it = updates_.find(id);
  if (it == updates_.end()) {
    return Status(Code::kNotFound, "update program " + std::to_string(id) +
                                       " is unknown to pool " +
                                       std::to_string(id_) +
                                       " (released, or never registered)");
  }
  return StartProgram(lock, it->second, id, std::move(scalars));
}

StatusOr<std::shared_ptr<UpdateRun>> Pool::StartProgram(
    std::unique_lock<std::mutex>& lock,
    std::shared_ptr<const UpdateProgram> shared, int32_t id,
    std::vector<float> scalars) {
  (void)lock;  // held
  const UpdateProgram& program = *shared;
  const std::string name =
      id == 0 ? "the refresh of a copy" : "update program " + std::to_string(id);
  if (scalars.size() != static_cast<size_t>(program.num_scalars)) {
    return Status(Code::kInvalidArgument,
                  name + " takes " + std::to_string(program.num_scalars) +
                      " scalars per run, but got " +
                      std::to_string(scalars.size()));
  }
  UpdateJob job;
  job.program = std::move(shared);
  job.program_id = id;
  job.scalars = std::move(scalars);
  job.in.resize(program.inputs.size());
  job.out.resize(program.outputs.size());
  std::vector<uint32_t> pinned;  // distinct object indices
  // Objects on one node's memory run on that node's workers.
  int node = -2;  // -2: none seen yet
  auto resolve = [&](int32_t handle, const std::string& role,
                     UpdateTarget* target) -> Status {
    StatusOr<UpdateTarget> found = UpdateTargetOf(
        handle, name + ": " + role, program.num_elements);
    if (!found.ok()) return found.status();
    *target = *found;
    const Object& object = objects_.at(IndexOf(handle));
    if (target->memory != nullptr) {
      const int arena_node = tiers_[object.tier].arenas[object.arena].node;
      const bool bound =
          arena_node >= 0 && !config_.tiers[object.tier].emulated;
      node = node == -2 && bound ? arena_node
             : node == arena_node && bound ? node
                                           : -1;
    }
    if (std::find(pinned.begin(), pinned.end(), IndexOf(handle)) ==
        pinned.end()) {
      pinned.push_back(IndexOf(handle));
    }
    return Status::Ok();
  };
  for (size_t i = 0; i < program.inputs.size(); ++i) {
    if (program.inputs[i].kind != UpdateInput::Kind::kObject) continue;
    JCXL_RETURN_IF_ERROR(resolve(program.inputs[i].handle,
                                 "input " + std::to_string(i) +
                                     " (freed since the program was "
                                     "registered?)",
                                 &job.in[i]));
  }
  for (size_t o = 0; o < program.outputs.size(); ++o) {
    JCXL_RETURN_IF_ERROR(resolve(program.outputs[o].handle,
                                 "output " + std::to_string(o) +
                                     " (freed since the program was "
                                     "registered?)",
                                 &job.out[o]));
  }
  job.node = node < 0 ? -1 : node;
  // What it writes, and the copies it writes beside their sources (fresh
  // once it succeeds: RegisterUpdate checked they come from one register).
  std::vector<uint32_t> written;
  std::vector<std::pair<uint32_t, uint32_t>> copies;  // (copy, source)
  for (const UpdateOutput& out : program.outputs) {
    written.push_back(IndexOf(out.handle));
    const int32_t source = objects_.at(IndexOf(out.handle)).copy_of;
    if (source != 0 && id != 0) {
      copies.emplace_back(IndexOf(out.handle), IndexOf(source));
    }
  }
  job.on_complete = [this, pinned, written, copies](const Status& status) {
    {
      std::lock_guard<std::mutex> relock(mu_);
      for (uint32_t index : pinned) {
        auto found = objects_.find(index);
        if (found != objects_.end()) --found->second.pins;
      }
      for (uint32_t index : written) {
        auto found = objects_.find(index);
        if (found != objects_.end()) ++found->second.writes;
      }
      for (const auto& [copy, source] : copies) {
        auto c = objects_.find(copy);
        auto s = objects_.find(source);
        if (status.ok() && c != objects_.end() && s != objects_.end()) {
          c->second.copied_writes = s->second.writes;
        }
      }
      total_pins_ -= static_cast<int>(pinned.size());
    }
    unpinned_cv_.notify_all();
  };
  // Pinned before the updater may run it: its completion takes mu_, held
  // here until the pins are counted.
  for (uint32_t index : pinned) ++objects_.at(index).pins;
  total_pins_ += static_cast<int>(pinned.size());
  StatusOr<std::shared_ptr<UpdateRun>> run = updater_->Submit(std::move(job));
  if (!run.ok()) {
    for (uint32_t index : pinned) --objects_.at(index).pins;
    total_pins_ -= static_cast<int>(pinned.size());
    unpinned_cv_.notify_all();
  }
  return run;
}

Status Pool::HoldUpdates(bool hold) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!updater_) {
    return Status(Code::kClosed, "pool " + std::to_string(id_) + " is closed");
  }
  updater_->Hold(hold);
  return Status::Ok();
}

UpdateStats Pool::update_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return updater_ ? updater_->stats() : closed_update_stats_;
}

Status Pool::Close(int64_t timeout_ns) {
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) {
    return Status(Code::kClosed,
                  "pool " + std::to_string(id_) + " is already closed");
  }
  closed_ = true;  // from here every new request fails
  if (getpid() != owner_pid_) {
    // A forked child's copy (see owner_pid_): leaked on purpose.
    (void)engine_.release();
    (void)updater_.release();
    for (Tier& tier : tiers_) {
      for (TierArena& arena : tier.arenas) (void)arena.arena.release();
      tier.arenas.clear();
    }
    on_close_.clear();
    return Status::Ok();
  }
  // Let transfers already queued finish; past the timeout they are failed.
  Status waited = WaitUnpinned(lock, timeout_ns, -1);
  // Taken under the lock (DrainRecords and Transfer read engine_), destroyed
  // outside it: its workers' completions take the lock to unpin.
  std::unique_ptr<CopyEngine> engine = std::move(engine_);
  std::unique_ptr<HostUpdater> updater = std::move(updater_);
  updates_.clear();
  lock.unlock();
  engine.reset();  // joins the workers; queued transfers fail as kClosed
  // Likewise: queued runs fail as kClosed, one past the timeout stops
  // after its blocks under way; none touches the arenas after this.
  if (updater) {
    const UpdateStats final_stats = updater->stats();
    updater.reset();
    std::lock_guard<std::mutex> relock(mu_);
    closed_update_stats_ = final_stats;
  }
  std::vector<std::function<void()>> on_close;
  on_close.swap(on_close_);
  for (auto& fn : on_close) fn();
  lock.lock();
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
  return waited.ok() ? Status::Ok()
                     : Status(Code::kTimeout,
                              "pool closed, but " + waited.message() +
                                  " were failed");
}

}  // namespace jcxl
