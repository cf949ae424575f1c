// The logic of the GPU stream handlers (ffi/cuda/) in plain C++: what a
// transfer between the pool and device memory holds from its start to its
// done, on which thread each thing happens, and when each thing is given
// back. The device itself (streams, events, copies, page-locked host
// memory) sits behind DeviceOps: ffi/cuda implements it with the CUDA
// runtime, the CPU tests with a fake whose copy streams run their copies
// only when an event after them is waited on, so that anything given back
// too early shows as wrong bytes.
//
// A transfer (fetch: pool -> device; store: device -> pool) takes one of
// two paths:
//
//   direct  the object is in directly addressable memory (the host tier,
//           or a cxl tier on real CXL memory without a link model) and
//           its pages could be locked (PageLocks, in bounded chunks): the
//           device's DMA reads or writes the pool's bytes, one copy per
//           locked chunk, on the direction's copy stream after `ready`.
//   staged  everything else (nvme, a tier behind a link model, a chunk
//           that failed to lock): a jcxl worker thread lets the pool's
//           copy engine move the bytes through a page-locked bounce buffer
//           and queues the DMA of the bounce buffer.
//
// A slice index that lives on the device (a scan's loop counter) is copied
// into a page-locked slot on the step's compute stream before `ready` is
// recorded: XLA may reuse the index operand's memory once the start has
// passed. A worker waits for `ready`, reads the slot, then takes the direct
// path where it can (the DMA stays direct; only its issue waits for the
// index), else the staged one.
//
// Nothing runs inside a device callback: a completion thread waits for each
// transfer's `done` event, then unpins the object, returns the bounce
// buffer and the index slot and drops the pool reference (which may close
// the pool and unlock its pages). A separate log thread waits for each
// `done`'s compute-side wait and logs it with the transfer's timing (from
// the device's events) for the profiler, so that logging never holds back
// a release. Bounce buffers are reused by size class and freed only by the
// completion thread; index slots are allocated ahead, at construction and
// by the completion thread. A start whose device buffer still has a
// transfer in flight (a failed step left it behind, or a direct start that
// failed after queueing some of its copies) makes the compute stream wait
// for it first.
#ifndef JCXL_FFI_DEVICE_TRANSFERS_H_
#define JCXL_FFI_DEVICE_TRANSFERS_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "copy_engine.h"
#include "page_locks.h"
#include "pool.h"
#include "status.h"

namespace jcxl {

using DeviceEvent = uint64_t;  // 0: none

// One device's streams and events as the transfers use them. `compute` is
// the step's stream (XLA's), opaque here.
class DeviceOps {
 public:
  virtual ~DeviceOps() = default;
  // In compute-stream order.
  virtual Status CopyIndexOnCompute(void* compute, int32_t* slot,
                                    const void* index) = 0;
  virtual StatusOr<DeviceEvent> RecordOnCompute(void* compute) = 0;
  virtual Status ComputeWaits(void* compute, DeviceEvent event) = 0;
  // On the copy stream of `direction` (one each way).
  virtual Status CopyWaits(Direction direction, DeviceEvent event) = 0;
  // kFromPool: `host` -> `device`; kToPool: `device` -> `host`.
  virtual Status Copy(Direction direction, void* device, void* host,
                      uint64_t bytes) = 0;
  virtual StatusOr<DeviceEvent> RecordOnCopy(Direction direction) = 0;
  // Blocks until `event` completed: jcxl's own threads only.
  virtual Status Sync(DeviceEvent event) = 0;
  // Nanoseconds from `from` to `to`, both completed; negative if unknown.
  virtual int64_t ElapsedNs(DeviceEvent from, DeviceEvent to) = 0;
  // When the completed `event` happened, on the host clock (NowNs), as
  // closely as the device tells; negative if unknown.
  virtual int64_t HostNsOf(DeviceEvent event) = 0;
  // Back to the device's event pool (events are reused, never destroyed
  // on the launch path).
  virtual void ReleaseEvent(DeviceEvent event) = 0;
  virtual StatusOr<void*> AllocHost(uint64_t bytes) = 0;  // page-locked
  virtual void FreeHost(void* p) = 0;
  // Locks pools' arena pages for this device's DMA.
  virtual std::shared_ptr<PageLocker> Locker() = 0;
};

// Page-locked host buffers reused by size class. Acquire allocates only
// when no idle buffer of the class is left; Release never frees (it may run
// on XLA's launch thread); Trim frees idle buffers beyond the larger of
// `idle_cap_bytes` and the most ever in use at once (a step's working set),
// and runs on the completion thread.
class HostBufferCache {
 public:
  struct Buffer {
    void* data = nullptr;
    uint64_t bytes = 0;  // the size class
  };
  struct Stats {
    uint64_t allocations = 0;
    uint64_t reuses = 0;
    uint64_t frees = 0;
    uint64_t in_use_bytes = 0;
    uint64_t idle_bytes = 0;
    uint64_t peak_in_use_bytes = 0;
  };
  HostBufferCache(std::function<StatusOr<void*>(uint64_t)> alloc,
                  std::function<void(void*)> free, uint64_t idle_cap_bytes);
  ~HostBufferCache();  // frees every idle buffer
  static uint64_t SizeClass(uint64_t bytes);
  StatusOr<Buffer> Acquire(uint64_t bytes);
  void Release(Buffer buffer);
  // When fewer than `low` buffers of `bytes`' class are idle, allocates
  // idle ones up to `high` (ahead of Acquire, off the launch path).
  void Reserve(uint64_t bytes, size_t low, size_t high);
  void Trim();
  Stats stats();

 private:
  std::function<StatusOr<void*>(uint64_t)> alloc_;
  std::function<void(void*)> free_;
  const uint64_t idle_cap_bytes_;
  std::mutex mu_;
  std::multimap<uint64_t, void*> idle_;
  Stats stats_;
};

// Threads that run posted tasks in order of posting (one thread: in order
// of posting, one at a time).
class TaskThreads {
 public:
  explicit TaskThreads(int threads);
  ~TaskThreads();  // runs what is queued, then joins
  void Post(std::function<void()> task);
  // Returns once every task posted before the call has run.
  void Drain();

 private:
  void Loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  uint64_t posted_ = 0;
  uint64_t finished_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

struct DeviceRequest {
  std::shared_ptr<Pool> pool;
  int32_t handle = 0;
  void* compute = nullptr;         // the step's stream
  void* device_buffer = nullptr;   // the step's buffer
  uint64_t bytes = 0;
  Direction direction = Direction::kFromPool;
  // Where the bytes are in the object: `offset` when the index is known
  // (index_on_device null), else offset_of(the index on the device).
  uint64_t offset = 0;
  const void* index_on_device = nullptr;
  std::function<StatusOr<uint64_t>(int64_t)> offset_of;
  int priority = 0;
  uint64_t chunk_bytes = 0;  // the copy engine's pieces (staged path)
  int64_t timeout_ns = 0;    // for the staged path's pool side
  int64_t run = 0;           // the execution that started it (XLA's RunId)
};

struct DeviceCounters {
  uint64_t direct = 0;            // known index, DMA from the pool
  uint64_t direct_after_index = 0;  // device index read, then direct DMA
  uint64_t staged = 0;            // through a bounce buffer
  uint64_t staged_lock_failed = 0;  // direct-capable, but its pages failed
                                    // to lock
  uint64_t stale_waits = 0;       // starts that waited for a left-behind copy
  uint64_t failed = 0;            // transfers that ended with an error
};

// One `done`, for the profiler: the transfer (times on the host clock,
// from the device's events) and how long the compute stream waited for it.
struct DeviceWait {
  TransferRecord record;
  int64_t wait_started_ns = 0;
  int64_t wait_ns = 0;
};

class DeviceTransfers {
 public:
  DeviceTransfers(std::unique_ptr<DeviceOps> ops, uint64_t lock_chunk_bytes,
                  std::function<void(const DeviceWait&)> log);
  ~DeviceTransfers();  // waits for every transfer's completion

  // Queues the transfer; returns once it is ordered after the compute
  // stream's work so far. Never blocks on the device, except to wait for a
  // transfer a failed step left behind in the same buffer.
  Status Start(DeviceRequest request);
  // Makes the compute stream wait for the transfer into/out of `buffer`;
  // the staged path's pool side is waited for on the host, so that its
  // error is the step's. kNotFound: no transfer in flight for `buffer`.
  Status Done(void* compute, const void* buffer);
  // Execution `run` fails: makes the compute stream wait for every transfer
  // it started and no `done` took (XLA frees the execution's buffers on the
  // compute stream once the error is returned), and forgets them. The first
  // error met, if any; the rest are still waited for.
  Status AbortRun(void* compute, int64_t run);
  // Returns once every queued transfer and completion has run (tests, and
  // the counters' readers).
  void Drain();
  DeviceCounters counters();
  HostBufferCache::Stats bounce_stats() { return bounce_.stats(); }

 private:
  struct Job;
  Status StartDirect(const std::shared_ptr<Job>& job, uint64_t offset,
                     bool* taken);
  void RunDeferred(const std::shared_ptr<Job>& job);
  Status RunStaged(Job& job, uint64_t offset);
  void Finish(const std::shared_ptr<Job>& job, Status status);
  void Complete(const std::shared_ptr<Job>& job);
  void WaitFinished(Job& job);

  std::unique_ptr<DeviceOps> ops_;
  std::function<void(const DeviceWait&)> log_;
  uint64_t lock_chunk_bytes_;
  HostBufferCache bounce_;
  HostBufferCache slots_;
  std::mutex mu_;
  std::unordered_map<const void*, std::shared_ptr<Job>> in_flight_;
  DeviceCounters counters_;
  // Declared last: destroyed (drained and joined) first, workers (which
  // post completions) before the log thread (which waits for them).
  TaskThreads completions_{1};
  TaskThreads logs_{1};
  TaskThreads workers_{2};
};

}  // namespace jcxl

#endif  // JCXL_FFI_DEVICE_TRANSFERS_H_
