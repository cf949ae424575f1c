// The asynchronous copy engine: worker threads that move bytes between pool
// arenas and caller buffers. Requests are split into chunks so that a request
// needed sooner (a lower priority value) overtakes a long one already under
// way; each request keeps a record of when it was queued, started and
// finished, for the schedule tuner.
//
// Lifetime: the Pool owns its CopyEngine; the engine's destructor stops and
// joins the workers after failing whatever is still queued.
#ifndef JCXL_FFI_COPY_ENGINE_H_
#define JCXL_FFI_COPY_ENGINE_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <queue>
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
  // kTimeout if the request has not finished within `timeout_ns`.
  Status Wait(int64_t timeout_ns);
  bool done();
  TransferRecord record();

 private:
  friend class CopyEngine;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
  TransferRecord record_;
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

  uint64_t chunk_bytes_;
  std::vector<int> cpus_;
  std::mutex mu_;  // guards queue_, requests' counters, records_, stopping_
  std::condition_variable cv_;
  std::priority_queue<Chunk> queue_;
  std::deque<TransferRecord> records_;
  uint64_t next_sequence_ = 0;
  uint64_t next_id_ = 1;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace jcxl

#endif  // JCXL_FFI_COPY_ENGINE_H_
