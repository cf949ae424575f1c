// The jcxl pool: tiers of memory outside the device (host DRAM, CXL memory,
// nvme files), objects in them addressed by stable int32 handles, and the
// copy engine that moves their bytes.
//
// Lifetime: Python owns each Pool through a shared_ptr; the pool registry
// (Pool::Find) holds weak references so that FFI handlers can reach a pool
// by its id without keeping it alive. Close() fails new requests, waits for
// transfers in flight, then releases every arena.
//
// Handles are unique in the process, not only in their pool, so a handle of
// one pool is rejected by every other (see HandleSpace in pool.cc).
#ifndef JCXL_FFI_POOL_H_
#define JCXL_FFI_POOL_H_

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocator.h"
#include "arena.h"
#include "copy_engine.h"
#include "host_update.h"
#include "link_model.h"
#include "page_locks.h"
#include "status.h"
#include "update_program.h"

namespace jcxl {

enum class TierKind { kHost = 0, kCxl = 1, kNvme = 2 };
constexpr int kNumTiers = 3;
const char* TierName(TierKind kind);

struct TierConfig {
  uint64_t capacity = 0;       // 0: the tier is off
  std::vector<int> nodes;      // memory tiers: NUMA nodes (empty: unbound)
  std::vector<double> weights;  // per node, e.g. bandwidth; empty: equal
  bool emulated = false;        // no real hardware: say so everywhere
  double link_bytes_per_second = 0;  // > 0: emulate a link with this cap
  int64_t link_latency_ns = 0;
};

struct PoolConfig {
  TierConfig tiers[kNumTiers];
  std::string nvme_dir;         // the pool's own (private) directory
  bool keep_nvme_files = false;
  bool spill = false;           // a full tier spills to the next (host->cxl->nvme)
  int copy_threads = 2;
  uint64_t chunk_bytes = 4ull << 20;
  std::vector<int> copy_cpus;   // CPUs for the copy workers (empty: any)
  // Update workers (host_update.h): 0: one per CPU the process may use, at
  // most kMaxDefaultUpdateThreads; started at the first update run.
  int update_threads = 0;
  HybridOptions allocator;
};

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

// Bytes of a memory-tier object lent to a DMA engine outside the pool (a
// GPU's copy engine), from Pool::BeginDirect until Pool::EndDirect.
struct DirectRange {
  char* address = nullptr;
  uint64_t bytes = 0;
  int32_t handle = 0;
  Direction direction = Direction::kFromPool;
  // The memory arena's mapping the bytes lie in (for PageLocks).
  char* region_base = nullptr;
  uint64_t region_bytes = 0;
};

// A memory arena's mapping, for a DMA engine to page-lock once.
struct MemoryRegion {
  char* base = nullptr;
  uint64_t bytes = 0;
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

class Pool {
 public:
  static StatusOr<std::shared_ptr<Pool>> Create(const PoolConfig& config);
  // The open pool with this id, or nullptr.
  static std::shared_ptr<Pool> Find(int32_t id);
  ~Pool();

  int32_t id() const { return id_; }

  // Reserves an object; `shape` and `dtype` are recorded for checks. A tier
  // too fragmented to hold it, though its free bytes would, is compacted
  // first (waiting up to `timeout_ns` for the transfers in flight).
  StatusOr<int32_t> Allocate(TierKind tier, uint64_t bytes,
                             std::vector<int64_t> shape, std::string dtype,
                             int64_t timeout_ns = kMaxTimeoutNs);
  // A copy of object `source` in `dtype` ("float32" or "bfloat16", the
  // source too), in the source's tier, that the pool keeps equal to the
  // source converted (round to nearest even): a read of the copy after the
  // source was written by anything else first converts the source anew.
  // An update program that writes the source may write the copy from the
  // same register (one pass, the copy then fresh); nothing else may write
  // it. Lets a device fetch bfloat16 weights of float32 master weights.
  StatusOr<int32_t> AllocateCopy(int32_t source, std::string dtype,
                                 int64_t timeout_ns = kMaxTimeoutNs);
  // Frees an object once its transfers in flight are done.
  Status Free(int32_t handle, int64_t timeout_ns);
  // Starts a copy of `bytes` from `src` into the object at byte `offset`.
  // `owner`, if given, keeps `src` alive until the copy is done (see
  // TransferRequest::buffer_owner): the caller may then drop the ticket.
  StatusOr<std::shared_ptr<Ticket>> Write(int32_t handle, const void* src,
                                          uint64_t bytes, uint64_t offset,
                                          int priority, uint64_t chunk_bytes,
                                          std::shared_ptr<void> owner = {});
  // Starts a copy of the object's bytes [offset, offset + bytes) to `dst`.
  StatusOr<std::shared_ptr<Ticket>> Read(int32_t handle, void* dst,
                                         uint64_t bytes, uint64_t offset,
                                         int priority, uint64_t chunk_bytes,
                                         std::shared_ptr<void> owner = {});
  // The address of bytes [offset, offset + bytes) of an object, for a copy
  // made by another engine (cudaMemcpyAsync). The object stays pinned, as
  // during a transfer (Free and Compact wait), until EndDirect, which also
  // counts the bytes as read or written. Refused (kInvalidArgument) where
  // the bytes must go through the copy engine: an nvme object, or a tier
  // behind a link model (an emulated or capped link).
  StatusOr<DirectRange> BeginDirect(int32_t handle, uint64_t bytes,
                                    uint64_t offset, Direction direction);
  void EndDirect(const DirectRange& range);
  // Page-locking for a DMA engine outside the pool (see page_locks.h): the
  // engine installs its locker and locks what its direct transfers touch;
  // freed pages in a locked chunk are never given back to the system, and
  // Close() unlocks every chunk before it unmaps the arenas (or, while a
  // direct range is still lent past its timeout, the last EndDirect does).
  PageLocks& page_locks() { return page_locks_; }
  // Every memory arena's mapping (what BeginDirect addresses lie in).
  std::vector<MemoryRegion> MemoryRegions();
  // Runs `fn` in Close(), after the transfers in flight and before the
  // arenas are unmapped (to unregister them from a DMA engine).
  void OnClose(std::function<void()> fn);
  StatusOr<ObjectInfo> Info(int32_t handle);
  std::vector<int32_t> Handles();
  // Where each page of a memory-tier object sits (move_pages).
  StatusOr<std::vector<int>> PageNodes(int32_t handle);
  // Moves objects to remove holes; handles stay valid.
  Status Compact(int64_t timeout_ns);
  std::vector<TierStats> Stats();
  std::vector<TransferRecord> DrainRecords();
  // Changes an emulated link (a slower or shared link mid-run).
  Status SetLink(TierKind tier, double bytes_per_second, int64_t latency_ns);
  // A test hook: makes chosen transfers fail or stall (see
  // CopyEngine::InjectFault), to check that every waiter gets an error.
  Status InjectFault(const FaultSpec& spec);
  uint64_t faults_injected();

  // Update programs (update_program.h), run on the pool's own objects in
  // place by its update workers (host_update.h). RegisterUpdate checks the
  // program and that every object it reads or writes is in this pool and
  // holds exactly num_elements float32 or bfloat16 elements; it returns
  // the program's id.
  StatusOr<int32_t> RegisterUpdate(UpdateProgram program);
  Status ReleaseUpdate(int32_t id);
  // Starts a run of program `id` with `scalars` (num_scalars of them).
  // Its objects stay pinned, as during a transfer (Free and Compact wait),
  // until it is done; an object freed since the program was registered
  // fails the start (kNotFound, naming it). Runs go in the order started.
  StatusOr<std::shared_ptr<UpdateRun>> StartUpdate(int32_t id,
                                                   std::vector<float> scalars);
  UpdateStats update_stats();
  // A test hook: while held, update workers take no new block of a run (so
  // that a test can see Free, Compact and Close wait for runs).
  Status HoldUpdates(bool hold);

  Status Close(int64_t timeout_ns);
  bool closed();
  const PoolConfig& config() const { return config_; }

 private:
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
    int pins = 0;  // transfers in flight
    uint64_t writes = 0;  // writes of its bytes completed: a generation
    // A copy (AllocateCopy): its source, the source's `writes` it holds
    // (kStale: none yet), and the program that converts the source into it.
    int32_t copy_of = 0;
    uint64_t copied_writes = kStale;
    std::shared_ptr<const UpdateProgram> refresh;
    // The refresh in flight and the source's `writes` it converts: readers
    // that find the same source wait for it instead of writing the copy
    // again under each other's reads.
    std::shared_ptr<UpdateRun> refreshing;
    uint64_t refreshing_writes = kStale;
  };
  static constexpr uint64_t kStale = UINT64_MAX;

  explicit Pool(const PoolConfig& config);
  Status Init();
  // Resolves a handle; caller holds mu_.
  StatusOr<Object*> Lookup(int32_t handle);
  // Lookup, once no compaction runs, checking that bytes [offset, offset +
  // bytes) lie in the object; `lock` holds mu_.
  StatusOr<Object*> LookupRange(std::unique_lock<std::mutex>& lock,
                                int32_t handle, uint64_t bytes,
                                uint64_t offset);
  StatusOr<int32_t> AllocateIn(int tier, uint64_t bytes);
  std::string Label(int32_t handle, const Object& object);
  StatusOr<std::shared_ptr<Ticket>> Transfer(int32_t handle, void* buffer,
                                             uint64_t bytes, uint64_t offset,
                                             int priority, uint64_t chunk_bytes,
                                             Direction direction,
                                             std::shared_ptr<void> owner);
  void Unpin(uint32_t index, int tier, Direction direction, uint64_t bytes);
  // Before a read of `handle`: a copy whose source was written since it was
  // made is converted anew (waiting for the update workers).
  Status RefreshIfStale(int32_t handle);
  // Refuses a write of a copy by anything but the pool; caller holds mu_.
  Status CheckWritable(int32_t handle, const Object& object);
  // Starts a run of `program` (`id` 0: the pool's own); `lock` holds mu_,
  // taken once no compaction runs (the run's addresses are taken now).
  StatusOr<std::shared_ptr<UpdateRun>> StartProgram(
      std::unique_lock<std::mutex>& lock,
      std::shared_ptr<const UpdateProgram> program, int32_t id,
      std::vector<float> scalars);
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
  // Where an update program's `role` ("input 2") object is, after checking
  // it holds `elements` float32 or bfloat16 elements; caller holds mu_.
  StatusOr<UpdateTarget> UpdateTargetOf(int32_t handle,
                                        const std::string& role,
                                        int64_t elements);

  PoolConfig config_;
  int32_t id_ = 0;
  // The process that made the pool. In a child it forked, the pool's copy
  // shares the parent's nvme file and lacks the copy engine's threads:
  // Close there forgets the pool without joining, waiting or unlinking.
  pid_t owner_pid_;
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
  std::unique_ptr<CopyEngine> engine_;
  // Update programs by id; a run holds its own reference.
  std::map<int32_t, std::shared_ptr<const UpdateProgram>> updates_;
  int32_t next_update_id_ = 1;
  std::unique_ptr<HostUpdater> updater_;
  UpdateStats closed_update_stats_;  // what updater_ counted, once closed
  std::vector<std::function<void()>> on_close_;
  PageLocks page_locks_;
};

}  // namespace jcxl

#endif  // JCXL_FFI_POOL_H_
