// The pool's update workers: threads that run update programs
// (update_program.h) on pool objects in place, each run split over the
// workers in blocks. Runs that share an object run in the order they were
// started (a run that reads what an earlier one wrote sees all of it);
// a run that shares none with the runs under way starts once their last
// blocks are taken, so workers (and the disk, for nvme runs) never wait at
// a run's end while independent runs are queued.
//
// Threads: one per allowed CPU (at most 16), and at least
// kMinStagingUpdateThreads where runs may stage nvme objects, unless told
// how many; started
// at the first run (a pool that never updates has none). On a machine of
// several NUMA nodes, each worker is pinned to the CPUs of one node; a run
// whose objects all live on one node's memory runs on that node's workers,
// any other run (an unbound or emulated tier, objects on several nodes, a
// node without workers) on all of them.
//
// Objects in memory arenas are read and written where they are; nvme
// objects go through staging buffers of each worker (kStageBytes per array
// of the program, plus one bounce buffer for FileArena's unaligned edges):
// a block is read, run, and written back.
//
// Lifetime: a pool's UpdateService (update_service.h) owns its HostUpdater
// and pins a run's objects from Submit until the run's on_complete; the
// destructor fails queued runs (kClosed), stops the running ones after the
// blocks under way, and joins.
#ifndef JCXL_FFI_HOST_UPDATE_H_
#define JCXL_FFI_HOST_UPDATE_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "arena.h"
#include "status.h"
#include "update_program.h"

namespace jcxl {

// The most update workers a pool starts by default (update_threads = 0).
constexpr int kMaxDefaultUpdateThreads = 16;
// The fewest it starts by default in a pool with an nvme tier: a staged
// block's worker waits on the disk while it reads and writes, and the
// disk is kept busy only while others have requests in flight (on a 2-CPU
// machine's virtual disk, 4 workers moved a median 1.15x what 2 did, 8
// 1.04x what 4 did).
constexpr int kMinStagingUpdateThreads = 4;
// Staging per nvme array and worker (a block of that many bytes of f32).
constexpr uint64_t kStageBytes = 4ull << 20;

struct UpdateStats {
  uint64_t runs = 0;           // finished, failed ones included
  uint64_t failed = 0;         // of those, the runs that ended with an error
  uint64_t elements = 0;       // of the runs that succeeded
  uint64_t bytes_read = 0;     // object bytes programs read
  uint64_t bytes_written = 0;  // object bytes programs wrote
  int64_t busy_ns = 0;         // wall time while any run was under way
  // Runs that started while an earlier one was still under way (sharing no
  // object with it).
  uint64_t overlapped = 0;
  int threads = 0;             // update workers started so far
};

// One run: waited for by the caller (or the FFI `done`).
class UpdateRun {
 public:
  // kTimeout if the run is not done within `timeout_ns` (it keeps running;
  // the objects it writes are not ready); else the run's status.
  Status Wait(int64_t timeout_ns);
  bool done();
  uint64_t id() const { return id_; }
  int32_t program_id() const { return program_id_; }
  // How many workers ran blocks of it (once done).
  int workers();

 private:
  friend class HostUpdater;
  uint64_t id_ = 0;  // unique in the process
  int32_t program_id_ = 0;
  int64_t elements_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  int workers_ = 0;
  Status status_;
};

// Where one array of a run lies: in memory, or in an nvme file.
struct UpdateTarget {
  int32_t handle = 0;
  UpdateDType dtype = UpdateDType::kF32;
  char* memory = nullptr;  // the object's first element, or null
  Arena* file = nullptr;   // nvme: the arena and the object's byte offset
  uint64_t file_offset = 0;
};

struct UpdateJob {
  std::shared_ptr<const UpdateProgram> program;
  int32_t program_id = 0;
  std::vector<float> scalars;
  std::vector<UpdateTarget> in;   // per input register (objects only used)
  std::vector<UpdateTarget> out;  // per output
  int node = -1;  // the NUMA node whose workers run it; -1: all workers
  // Runs once the run is over (on a worker, or in the destructor), before
  // its waiters wake.
  std::function<void(const Status&)> on_complete;
};

class HostUpdater {
 public:
  // `threads` workers, 0: one per allowed CPU, at most
  // kMaxDefaultUpdateThreads, and at least kMinStagingUpdateThreads if
  // `staging` (runs may stage nvme objects).
  HostUpdater(int threads, bool staging);
  ~HostUpdater();
  HostUpdater(const HostUpdater&) = delete;
  HostUpdater& operator=(const HostUpdater&) = delete;

  // Queues a run; never completes it inline (its on_complete may take a
  // lock the caller holds). Fails (on_complete not called) if the workers
  // cannot start or the updater is stopping.
  StatusOr<std::shared_ptr<UpdateRun>> Submit(UpdateJob job);
  UpdateStats stats();
  // Moves queued run `id` to the front of the queue, with the queued runs
  // before it that it follows (Conflict, transitively) kept before it: a
  // reader waits for it. Runs that share an object stay in the order they
  // were submitted. Nothing if it is not queued.
  void Promote(uint64_t id);
  // The ids of the queued runs, in order (a test's view).
  std::vector<uint64_t> queued_runs();
  // The workers a first run starts (resolved from the constructor's).
  int threads() const { return threads_; }
  // A test hook: while held, workers take no new block (runs queue up).
  void Hold(bool hold);

 private:
  struct Run;
  struct Worker;
  Status StartWorkers();  // mu_ held
  void WorkerLoop(Worker* worker);
  Status RunBlock(Run& run, int64_t block, Worker& worker);
  // Starts queued runs, in order, while the workers have no block of the
  // active runs left to take and the first queued run shares no object
  // with an active one; mu_ held.
  void Admit();
  // Whether `run` writes an object `other` reads or writes, or the other
  // way round.
  static bool Conflict(const Run& run, const Run& other);
  // Ends `run`: stats, on_complete, waiters; never with mu_ held.
  void Complete(const std::shared_ptr<Run>& run);
  // A worker's end of `run` (its last block done): Complete, then out of
  // active_, its failure passed on to its followers; mu_ not held.
  void Finish(const std::shared_ptr<Run>& run);
  // Takes the queued runs that follow failed `run` (Conflict) out of the
  // queue, failed, for Complete; mu_ held.
  std::vector<std::shared_ptr<Run>> SkipFollowers(const Run& run);
  bool Eligible(const Run& run, const Worker& worker) const;

  const int threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Run>> queue_;    // not started, in order
  std::vector<std::shared_ptr<Run>> active_;  // started, in order
  int64_t busy_since_ns_ = 0;  // when active_ last became non-empty
  bool started_ = false;
  bool stopping_ = false;
  bool held_ = false;
  std::vector<std::unique_ptr<Worker>> workers_;
  UpdateStats stats_;
};

}  // namespace jcxl

#endif  // JCXL_FFI_HOST_UPDATE_H_
