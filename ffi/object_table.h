// A pool's object table: its tiers' arenas and allocators, the objects in
// them by handle, the pins that keep an object in place while something
// reads or writes it, and compaction (which moves unpinned objects over the
// holes; handles stay valid).
//
// Handles are unique in the process, not only in their pool, so a handle of
// one pool is rejected by every other (see HandleSpace in object_table.cc).
//
// The table's mutex guards everything here. The pool's other parts
// (transfers.h, direct_access.h, update_service.h) are friends: they pin,
// unpin and resolve objects under that one mutex, so that a free or a
// compaction never races a copy, a lent range or an update run.
#ifndef JCXL_FFI_OBJECT_TABLE_H_
#define JCXL_FFI_OBJECT_TABLE_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocator.h"
#include "arena.h"
#include "copy_engine.h"
#include "link_model.h"
#include "page_locks.h"
#include "pool_config.h"
#include "status.h"
#include "update_program.h"

namespace jcxl {

class HostUpdater;
class UpdateRun;

struct ObjectInfo {
  int32_t handle = 0;
  TierKind tier = TierKind::kHost;
  int node = -1;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  bool slab = false;
  std::vector<int64_t> shape;
  std::string dtype;
  int32_t copy_of = 0;  // a copy the pool keeps (AllocateCopy): its source
};

struct ArenaStats {
  int node = -1;
  double weight = 1.0;
  std::string description;
  AllocatorStats allocator;
};

struct TierStats {
  TierKind kind = TierKind::kHost;
  bool enabled = false;
  bool emulated = false;
  double link_bytes_per_second = 0;
  int64_t link_latency_ns = 0;
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  std::vector<ArenaStats> arenas;
};

class ObjectTable {
 public:
  explicit ObjectTable(const PoolConfig& config) : config_(config) {}
  ObjectTable(const ObjectTable&) = delete;
  ObjectTable& operator=(const ObjectTable&) = delete;

  // Reserves an object; `shape` and `dtype` are recorded for checks. A tier
  // too fragmented to hold it, though its free bytes would, is compacted
  // first (waiting up to `timeout_ns` for the transfers in flight).
  StatusOr<int32_t> Allocate(TierKind tier, uint64_t bytes,
                             std::vector<int64_t> shape, std::string dtype,
                             int64_t timeout_ns = kMaxTimeoutNs);
  // Frees an object once its transfers in flight are done.
  Status Free(int32_t handle, int64_t timeout_ns);
  StatusOr<ObjectInfo> Info(int32_t handle);
  std::vector<int32_t> Handles();
  // Where each page of a memory-tier object sits (move_pages).
  StatusOr<std::vector<int>> PageNodes(int32_t handle);
  // Moves objects to remove holes; handles stay valid.
  Status Compact(int64_t timeout_ns);
  std::vector<TierStats> Stats();
  // Changes an emulated link (a slower or shared link mid-run).
  Status SetLink(TierKind tier, double bytes_per_second, int64_t latency_ns);
  bool closed();

 private:
  friend class Pool;
  friend class Transfers;
  friend class DirectAccess;
  friend class UpdateService;
  friend class PoolTestHooks;

  struct TierArena {
    int node = -1;
    double weight = 1.0;
    std::unique_ptr<Arena> arena;
    std::unique_ptr<HybridAllocator> allocator;
  };
  struct Tier {
    TierKind kind;
    bool enabled = false;
    std::unique_ptr<LinkModel> link;
    std::vector<TierArena> arenas;
    uint64_t bytes_read = 0;
    uint64_t bytes_written = 0;
  };
  struct Object {
    int32_t handle = 0;
    int tier = 0;
    int arena = 0;
    Allocation allocation;
    std::vector<int64_t> shape;
    std::string dtype;
    int pins = 0;         // transfers in flight
    uint64_t writes = 0;  // writes of its bytes completed: a generation
    // A copy (UpdateService::AllocateCopy): its source, the source's
    // `writes` it holds (kStale: none yet), and the program that converts
    // the source into it.
    int32_t copy_of = 0;
    uint64_t copied_writes = kStale;
    std::shared_ptr<const UpdateProgram> refresh;
    // The refresh in flight and the source's `writes` it converts: readers
    // that find the same source wait for it instead of writing the copy
    // again under each other's reads.
    std::shared_ptr<UpdateRun> refreshing;
    uint64_t refreshing_writes = kStale;
    // The update runs started on it and not yet done, by run id, and
    // whether each writes it: transfers wait for the runs they follow
    // (AwaitRuns), so a run may outlive the step that started it.
    std::vector<std::pair<uint64_t, bool>> runs;
    // Why its bytes are not what the runs started on it say (a run that
    // writes it failed, or was not run), or empty. A read fails with it; a
    // write of the whole object clears it.
    std::string damage;
  };
  static constexpr uint64_t kStale = UINT64_MAX;

  // The index of a handle's object in objects_.
  static uint32_t IndexOf(int32_t handle);
  Status Init();
  // Resolves a handle; caller holds mu_.
  StatusOr<Object*> Lookup(int32_t handle);
  // Lookup, once no compaction runs, checking that bytes [offset, offset +
  // bytes) lie in the object; `lock` holds mu_.
  // LookupRange once no update run it follows is left (AwaitRuns): the
  // transfer in `direction` that it starts then comes after them.
  StatusOr<Object*> LookupAfterRuns(std::unique_lock<std::mutex>& lock,
                                    int32_t handle, uint64_t bytes,
                                    uint64_t offset, Direction direction);
  StatusOr<Object*> LookupRange(std::unique_lock<std::mutex>& lock,
                                int32_t handle, uint64_t bytes,
                                uint64_t offset);
  StatusOr<int32_t> AllocateIn(int tier, uint64_t bytes);
  std::string Label(int32_t handle, const Object& object);
  // Ends a pin taken for a copy of `bytes` in `direction`, counting them.
  void Unpin(uint32_t index, int tier, Direction direction, uint64_t bytes);
  // Refuses a write of a copy by anything but the pool; caller holds mu_.
  Status CheckWritable(int32_t handle, const Object& object);
  // Whether an update run not yet done writes `object` (before a read,
  // kFromPool) or uses it (before a write); caller holds mu_.
  static bool Follows(const Object& object, Direction direction);
  // Waits, releasing `lock` (mu_), until no update run `handle`'s transfer
  // in `direction` follows is left (Follows), up to config_.run_wait_ns;
  // then fails a read of a damaged object.
  Status AwaitRuns(std::unique_lock<std::mutex>& lock, int32_t handle,
                   Direction direction);
  // Waits for the transfers of object `index` (all objects if negative).
  Status WaitUnpinned(std::unique_lock<std::mutex>& lock, int64_t timeout_ns,
                      int64_t index);
  void ReleaseTop(TierArena& arena, uint64_t old_top);
  // Compacts tier `only_tier` (every tier if negative) once no transfer is
  // in flight, waiting up to `timeout_ns`; `lock` holds mu_.
  Status CompactLocked(std::unique_lock<std::mutex>& lock, int64_t timeout_ns,
                       int only_tier);
  // Slides arena `a` of `tier`'s objects down over its holes; caller holds
  // mu_ and no transfer is in flight.
  Status CompactArena(Tier& tier, size_t a, uint64_t max_bytes = UINT64_MAX);
  // After a free: compacts a memory arena whose holes passed
  // kCompactAboveHoleFraction of its reserved bytes, if no transfer is in
  // flight (it never waits); caller holds mu_.
  void CompactIfFragmented(Tier& tier, size_t a);
  ObjectInfo InfoOf(int32_t handle, const Object& object);
  // Close's end, once nothing is in flight: unmaps the arenas (or retires
  // those a lent range still uses), removes the nvme directory, gives the
  // handles back; caller holds mu_.
  void ReleaseAll();

  const PoolConfig config_;
  int32_t id_ = 0;  // the pool's (Pool::Create sets it)
  std::mutex mu_;
  std::condition_variable unpinned_cv_;
  bool closed_ = false;
  bool compacting_ = false;
  int total_pins_ = 0;
  int direct_pins_ = 0;  // BeginDirect ranges not yet ended
  // Memory arenas Close could not unmap: a DMA engine outside the pool may
  // still copy into a BeginDirect range. Unmapped at the last EndDirect.
  std::vector<TierArena> retired_arenas_;
  Tier tiers_[kNumTiers];
  // Live objects by handle index (node-based: an Object never moves).
  std::unordered_map<uint32_t, Object> objects_;
  // Set by the update service: moves a queued update run ahead, as a
  // transfer waits for it (AwaitRuns); called with mu_ held.
  std::function<void(uint64_t)> promote_run_;
  // Pages locked for DMA engines (direct_access.h): a free keeps them.
  PageLocks page_locks_;
};

}  // namespace jcxl

#endif  // JCXL_FFI_OBJECT_TABLE_H_
