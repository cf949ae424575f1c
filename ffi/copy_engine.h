// The asynchronous copy engine: worker threads that move bytes between pool
// arenas and caller buffers. Requests are split into chunks so that a request
// needed sooner (a lower priority value) overtakes a long one already under
// way; each request keeps a record of when it was queued, started and
// finished, for the schedule tuner.
//
// Lifetime: the Pool owns its CopyEngine; the engine's destructor stops and
// joins the workers after failing whatever is still queued.
//
// Buffers: a request may own the caller's buffer (TransferRequest::
// buffer_owner); the engine then drops that reference only once no chunk of
// the request can touch the buffer again, so a caller may let go of its
// ticket and its buffer at any time, mid-copy included.
//
// Faults: a request whose waiter gave up is cancelled (Ticket::Cancel): its
// chunks not yet run are skipped, so it stops touching the caller's buffer
// soon after. For tests, InjectFault() makes chosen transfers fail without
// moving a byte, or stall until cancelled, released or the engine stops.
#ifndef JCXL_FFI_COPY_ENGINE_H_
#define JCXL_FFI_COPY_ENGINE_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <queue>
#include <string>
#include <thread>
#include <vector>

#include "arena.h"
#include "link_model.h"
#include "status.h"

namespace jcxl {

enum class Direction { kToPool = 0, kFromPool = 1 };

struct TransferRecord {
  uint64_t id = 0;
  int32_t handle = 0;
  int tier = 0;
  int node = -1;
  Direction direction = Direction::kFromPool;
  uint64_t bytes = 0;
  int priority = 0;
  int64_t queued_ns = 0;
  int64_t started_ns = 0;
  int64_t finished_ns = 0;
  bool ok = true;
};

// The longest wait a timeout gives (about 36 years): a longer one, such as
// INT64_MAX for "no deadline", would overflow steady_clock::now() + timeout.
constexpr int64_t kMaxTimeoutNs = int64_t{1} << 60;

// Completion of one request; waited on by the caller.
class Ticket {
 public:
  // kTimeout if the request has not finished within `timeout_ns`; the
  // message names the transfer's object and the time waited.
  Status Wait(int64_t timeout_ns);
  // Asks the engine to skip the chunks it has not run yet (and to end an
  // injected stall); the request then finishes with kTimeout. A chunk
  // already under way still completes: wait for done() before freeing the
  // buffer.
  void Cancel();
  bool cancelled() const { return cancelled_.load(std::memory_order_relaxed); }
  bool done();
  TransferRecord record();

 private:
  friend class CopyEngine;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::atomic<bool> cancelled_{false};
  Status status_;
  TransferRecord record_;
  // What the transfer moves, for messages; set before the ticket is shared.
  std::string label_;
};

// A test hook: which transfers fail or stall (see CopyEngine::InjectFault).
struct FaultSpec {
  enum class Kind { kNone = 0, kFail = 1, kStall = 2 };
  Kind kind = Kind::kNone;
  int tier = -1;        // only transfers of this tier (record.tier); -1: any
  int direction = -1;   // only this Direction; -1: either
  uint64_t skip = 0;    // matching transfers let through first
  int64_t count = 1;    // matching transfers then affected; -1: every one
};

struct TransferRequest {
  Arena* arena = nullptr;
  uint64_t arena_offset = 0;
  void* buffer = nullptr;  // the caller's side of the copy
  uint64_t bytes = 0;
  Direction direction = Direction::kFromPool;
  LinkModel* link = nullptr;  // emulated link, or nullptr
  int priority = 0;           // lower: needed sooner
  uint64_t chunk_bytes = 0;   // 0: the engine's default
  TransferRecord record;      // handle, tier, node filled in by the caller
  std::string label;          // what moves, for messages (may be empty)
  // Keeps `buffer` alive while the engine may touch it: released (on the
  // worker that finishes the last chunk, or in Submit or the destructor for
  // a request that never runs) before waiters wake. Null: the caller keeps
  // the buffer alive until the ticket is done.
  std::shared_ptr<void> buffer_owner;
  // Runs on a worker once the last chunk is done, before waiters wake.
  std::function<void(const Status&)> on_complete;
};

class CopyEngine {
 public:
  CopyEngine(int threads, uint64_t chunk_bytes, std::vector<int> cpus);
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  std::shared_ptr<Ticket> Submit(TransferRequest request);
  // Makes the transfers `spec` matches, from the next Submit on, fail (no
  // byte moved, kIo) or stall (their first chunk waits until the ticket is
  // cancelled, the next InjectFault call or the engine's destructor). A
  // kNone spec clears the fault and releases every stalled transfer.
  void InjectFault(const FaultSpec& spec);
  // Transfers a fault has hit so far.
  uint64_t faults_injected();
  // Completed records since the last call, oldest first (bounded history).
  std::vector<TransferRecord> DrainRecords();
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  int threads() const { return static_cast<int>(workers_.size()); }

 private:
  struct Request {
    TransferRequest spec;
    std::shared_ptr<Ticket> ticket;
    int chunks_left = 0;
    bool started = false;
    Status status;
    FaultSpec::Kind fault = FaultSpec::Kind::kNone;
    uint64_t stall_epoch = 0;  // the InjectFault call that stalled it
  };
  struct Chunk {
    std::shared_ptr<Request> request;
    uint64_t offset;  // within the request
    uint64_t bytes;
    uint64_t sequence;
    bool operator<(const Chunk& other) const {  // max-heap: invert
      if (request->spec.priority != other.request->spec.priority) {
        return request->spec.priority > other.request->spec.priority;
      }
      if (sequence != other.sequence) return sequence > other.sequence;
      return offset > other.offset;
    }
  };

  void WorkerLoop();
  void RunChunk(const Chunk& chunk, char* bounce);
  void Finish(const std::shared_ptr<Request>& request);
  // Holds an injected stall until it is released or cancelled; kClosed in
  // `status` if the engine stopped meanwhile.
  void Stall(Request& request, Status* status);
  // Sleeps until `deadline_ns` (the emulated link), or less if cancelled.
  void SleepUntil(int64_t deadline_ns, const Ticket& ticket);

  uint64_t chunk_bytes_;
  std::vector<int> cpus_;
  std::mutex mu_;  // guards queue_, requests' counters, records_, stopping_
  std::condition_variable cv_;        // work queued, or stopping
  std::condition_variable stall_cv_;  // stalls released, or stopping
  std::priority_queue<Chunk> queue_;
  std::deque<TransferRecord> records_;
  uint64_t next_sequence_ = 0;
  uint64_t next_id_ = 1;
  bool stopping_ = false;
  FaultSpec fault_;          // guarded by mu_
  uint64_t stall_epoch_ = 0;  // bumped by InjectFault: ends earlier stalls
  uint64_t faults_injected_ = 0;
  std::vector<std::thread> workers_;
};

}  // namespace jcxl

#endif  // JCXL_FFI_COPY_ENGINE_H_
