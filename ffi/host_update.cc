#include "host_update.h"

#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <system_error>
#include <utility>

#include "copy_engine.h"
#include "numa.h"

namespace jcxl {
namespace {

std::atomic<uint64_t> g_next_run_id{1};

uint64_t ItemBytes(UpdateDType dtype) {
  return dtype == UpdateDType::kBF16 ? 2 : 4;
}

// Elements per block of a run on memory objects: several blocks per worker
// (a worker that is slowed down, by the machine's other load, holds the
// run's end up by one block at most), 16 Ki at least (a block's
// bookkeeping stays negligible), 256 Ki at most (1 MiB of each f32 array).
// A multiple of 1024 elements: blocks never share a cache line.
int64_t MemoryBlock(int64_t elements, int workers) {
  const int64_t per = elements / (4 * std::max(workers, 1));
  const int64_t block = std::clamp<int64_t>(per, 16 << 10, 256 << 10);
  return (block + 1023) / 1024 * 1024;
}

// An nvme run's blocks fill the staging buffers (kStageBytes of f32), so
// every block but the last starts and ends on a file block (O_DIRECT, and
// no two workers write the same file block).
constexpr int64_t kStagedBlock = static_cast<int64_t>(kStageBytes / 4);

struct FreeDeleter {
  void operator()(char* p) const { free(p); }
};

std::string RunName(uint64_t id, int32_t program_id) {
  return "update run " + std::to_string(id) + " of program " +
         std::to_string(program_id);
}

}  // namespace

Status UpdateRun::Wait(int64_t timeout_ns) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool finished = cv_.wait_for(
      lock, std::chrono::nanoseconds(std::min(timeout_ns, kMaxTimeoutNs)),
      [this] { return done_; });
  if (!finished) {
    return Status(Code::kTimeout,
                  RunName(id_, program_id_) + " (" +
                      std::to_string(elements_) +
                      " elements) did not finish within " +
                      std::to_string(timeout_ns / 1000000) +
                      " ms; it keeps running, and the objects it writes are "
                      "not ready");
  }
  return status_;
}

bool UpdateRun::done() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

int UpdateRun::workers() {
  std::lock_guard<std::mutex> lock(mu_);
  return workers_;
}

struct HostUpdater::Run {
  std::shared_ptr<UpdateRun> handle;  // what the waiters hold
  UpdateJob job;
  std::vector<UpdateArray> in, out;   // memory arrays (null for nvme)
  // The distinct nvme objects, each staged once per block.
  struct Staged {
    const UpdateTarget* target = nullptr;
    bool read = false;
    bool written = false;
  };
  std::vector<Staged> staged;
  std::vector<int> in_stage, out_stage;  // index into staged, or -1
  uint64_t read_bytes_per_element = 0;
  uint64_t written_bytes_per_element = 0;
  // The handles of the objects it reads (every object input) and writes:
  // a run starts only once no earlier run under way writes what it touches
  // or touches what it writes.
  std::vector<int32_t> reads, writes;
  int64_t elements = 0;
  int64_t block = 0;
  int64_t blocks = 0;
  // Guarded by HostUpdater::mu_:
  int group = -1;  // the node whose workers run it; -1: all
  int64_t next_block = 0;
  int in_progress = 0;
  bool failed = false;  // no block is taken any more
  bool completed = false;
  std::vector<const Worker*> ran;  // the workers that ran its blocks
  Status status;
  // Whether a worker may still take a block of it; mu_ held.
  bool blocks_left() const { return !failed && next_block < blocks; }
};

struct HostUpdater::Worker {
  int group = -1;  // its node; -1: the machine has one
  std::vector<int> cpus;
  std::thread thread;
  // nvme staging, kept for later runs.
  std::vector<std::unique_ptr<char, FreeDeleter>> stage;
  std::unique_ptr<char, FreeDeleter> bounce;
};

HostUpdater::HostUpdater(int threads, bool staging)
    : threads_(threads > 0
                   ? threads
                   : std::max(std::clamp(
                                  static_cast<int>(numa::AllowedCpus().size()),
                                  1, kMaxDefaultUpdateThreads),
                              staging ? kMinStagingUpdateThreads : 1)) {}

HostUpdater::~HostUpdater() {
  std::vector<std::shared_ptr<Run>> ended;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    for (const std::shared_ptr<Run>& run : active_) {
      if (run->completed || !run->blocks_left()) continue;
      run->failed = true;
      run->status = Status(
          Code::kClosed,
          RunName(run->handle->id(), run->job.program_id) +
              ": the pool was closed while it ran (" +
              std::to_string(run->next_block) + " of " +
              std::to_string(run->blocks) +
              " blocks started); its objects are partly updated");
    }
    for (std::shared_ptr<Run>& run : queue_) {
      run->completed = true;
      run->status = Status(Code::kClosed,
                           RunName(run->handle->id(), run->job.program_id) +
                               ": the pool was closed before it ran");
      ended.push_back(std::move(run));
    }
    queue_.clear();
  }
  cv_.notify_all();
  for (std::unique_ptr<Worker>& worker : workers_) {
    if (worker->thread.joinable()) worker->thread.join();
  }
  std::vector<std::shared_ptr<Run>> unfinished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::shared_ptr<Run>& run : active_) {
      if (!run->completed) {
        run->completed = true;  // no worker took its last block
        unfinished.push_back(run);
      }
    }
    if (!active_.empty()) stats_.busy_ns += NowNs() - busy_since_ns_;
    active_.clear();
  }
  // In order: the active runs came before the queued ones.
  for (const std::shared_ptr<Run>& run : unfinished) Complete(run);
  for (const std::shared_ptr<Run>& run : ended) Complete(run);
}

Status HostUpdater::StartWorkers() {
  started_ = true;
  const std::map<int, std::vector<int>> nodes = numa::AllowedCpusByNode();
  std::vector<std::pair<int, const std::vector<int>*>> groups;
  if (nodes.size() > 1) {
    for (const auto& [node, cpus] : nodes) groups.emplace_back(node, &cpus);
  }
  std::vector<int> assigned(groups.size(), 0);
  for (int i = 0; i < threads_; ++i) {
    auto worker = std::make_unique<Worker>();
    if (!groups.empty()) {
      // The node with the fewest workers per CPU so far.
      size_t best = 0;
      for (size_t g = 1; g < groups.size(); ++g) {
        if (static_cast<double>(assigned[g]) / groups[g].second->size() <
            static_cast<double>(assigned[best]) /
                groups[best].second->size()) {
          best = g;
        }
      }
      ++assigned[best];
      worker->group = groups[best].first;
      worker->cpus = *groups[best].second;
    }
    Worker* raw = worker.get();
    try {
      worker->thread = std::thread([this, raw] { WorkerLoop(raw); });
    } catch (const std::system_error& e) {
      if (workers_.empty()) {
        return Status(Code::kInternal,
                      std::string("cannot start update threads: ") +
                          e.what());
      }
      break;  // run with the ones that started
    }
    workers_.push_back(std::move(worker));
  }
  return Status::Ok();
}

bool HostUpdater::Eligible(const Run& run, const Worker& worker) const {
  return run.group < 0 || worker.group == run.group;
}

StatusOr<std::shared_ptr<UpdateRun>> HostUpdater::Submit(UpdateJob job) {
  auto run = std::make_shared<Run>();
  run->handle = std::make_shared<UpdateRun>();
  run->handle->id_ = g_next_run_id.fetch_add(1);
  run->handle->program_id_ = job.program_id;
  run->handle->elements_ = job.program->num_elements;
  run->job = std::move(job);
  const UpdateProgram& program = *run->job.program;
  run->elements = program.num_elements;
  const std::vector<bool> read = UpdateInputsRead(program);
  auto stage_of = [&](const UpdateTarget& target) {
    for (size_t k = 0; k < run->staged.size(); ++k) {
      if (run->staged[k].target->handle == target.handle) {
        return static_cast<int>(k);
      }
    }
    run->staged.push_back({&target, false, false});
    return static_cast<int>(run->staged.size() - 1);
  };
  run->in.resize(program.inputs.size());
  run->in_stage.assign(program.inputs.size(), -1);
  for (size_t i = 0; i < program.inputs.size(); ++i) {
    if (program.inputs[i].kind != UpdateInput::Kind::kObject) continue;
    const UpdateTarget& target = run->job.in[i];
    run->in[i] = {target.memory, target.dtype};
    if (target.file != nullptr && read[i]) {
      run->in_stage[i] = stage_of(target);
      run->staged[run->in_stage[i]].read = true;
    }
    if (read[i]) run->read_bytes_per_element += ItemBytes(target.dtype);
    run->reads.push_back(target.handle);
  }
  run->out.resize(program.outputs.size());
  run->out_stage.assign(program.outputs.size(), -1);
  for (size_t o = 0; o < program.outputs.size(); ++o) {
    const UpdateTarget& target = run->job.out[o];
    run->out[o] = {target.memory, target.dtype};
    if (target.file != nullptr) {
      run->out_stage[o] = stage_of(target);
      run->staged[run->out_stage[o]].written = true;
    }
    run->written_bytes_per_element += ItemBytes(target.dtype);
    run->writes.push_back(target.handle);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) {
    return Status(Code::kClosed,
                  RunName(run->handle->id(), run->job.program_id) +
                      ": the pool is closing");
  }
  if (!started_) JCXL_RETURN_IF_ERROR(StartWorkers());
  int eligible = 0;
  for (const std::unique_ptr<Worker>& worker : workers_) {
    eligible += worker->group == run->job.node;
  }
  run->group = eligible > 0 ? run->job.node : -1;
  if (eligible == 0) eligible = static_cast<int>(workers_.size());
  run->block = run->staged.empty() ? MemoryBlock(run->elements, eligible)
                                   : kStagedBlock;
  // At least one block, so that a worker (never Submit) completes it.
  run->blocks = std::max<int64_t>(
      1, (run->elements + run->block - 1) / run->block);
  queue_.push_back(run);
  Admit();
  return run->handle;
}

bool HostUpdater::Conflict(const Run& run, const Run& other) {
  auto meets = [](const std::vector<int32_t>& a,
                  const std::vector<int32_t>& b) {
    return std::find_first_of(a.begin(), a.end(), b.begin(), b.end()) !=
           a.end();
  };
  return meets(run.writes, other.reads) || meets(run.writes, other.writes) ||
         meets(run.reads, other.writes);
}

void HostUpdater::Admit() {
  bool admitted = false;
  while (!queue_.empty()) {
    // Only once every block of the runs under way is taken: a run's blocks
    // go before a later run's.
    if (std::any_of(active_.begin(), active_.end(),
                    [](const std::shared_ptr<Run>& run) {
                      return run->blocks_left();
                    })) {
      break;
    }
    const Run& next = *queue_.front();
    if (std::any_of(active_.begin(), active_.end(),
                    [&](const std::shared_ptr<Run>& run) {
                      return Conflict(next, *run);
                    })) {
      break;  // it waits for them: later runs wait behind it, in order
    }
    if (active_.empty()) {
      busy_since_ns_ = NowNs();
    }
    if (std::any_of(active_.begin(), active_.end(),
                    [](const std::shared_ptr<Run>& run) {
                      return !run->completed;
                    })) {
      ++stats_.overlapped;  // not one only finishing its on_complete
    }
    active_.push_back(std::move(queue_.front()));
    queue_.pop_front();
    admitted = true;
  }
  if (admitted) cv_.notify_all();
}

void HostUpdater::WorkerLoop(Worker* worker) {
  numa::PinThreadToCpus(worker->cpus);  // best effort: near its node's memory
  for (;;) {
    std::shared_ptr<Run> run;
    int64_t block = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // The earliest active run with a block this worker may take.
      auto takeable = [&] {
        return std::find_if(
            active_.begin(), active_.end(),
            [&](const std::shared_ptr<Run>& r) {
              return r->blocks_left() && Eligible(*r, *worker);
            });
      };
      cv_.wait(lock, [&] {
        return stopping_ || (!held_ && takeable() != active_.end());
      });
      if (stopping_) break;
      run = *takeable();
      block = run->next_block++;
      ++run->in_progress;
      if (std::find(run->ran.begin(), run->ran.end(), worker) ==
          run->ran.end()) {
        run->ran.push_back(worker);
      }
      if (run->next_block == run->blocks) Admit();  // its last block is taken
    }
    Status status = RunBlock(*run, block, *worker);
    std::shared_ptr<Run> finished;
    {
      std::lock_guard<std::mutex> lock(mu_);
      --run->in_progress;
      if (!status.ok() && !run->failed) {
        run->failed = true;  // its blocks left are not taken
        run->status = Status(
            status.code(),
            RunName(run->handle->id(), run->job.program_id) + ": " +
                status.message());
        if (!stopping_) Admit();
      }
      if (run->in_progress == 0 && !run->completed && !run->blocks_left()) {
        run->completed = true;
        finished = run;
      }
    }
    if (finished) Finish(finished);
  }
}

void HostUpdater::Promote(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = std::find_if(queue_.begin(), queue_.end(),
                         [&](const std::shared_ptr<Run>& run) {
                           return run->handle->id() == id;
                         });
  if (it == queue_.end() || it == queue_.begin()) return;
  // From it back to the front: a run before it that uses what a moved one
  // writes, or writes what it uses, moves too (and stays before it).
  std::vector<std::shared_ptr<Run>> moved = {*it};
  std::deque<std::shared_ptr<Run>> stay;
  for (auto back = std::make_reverse_iterator(it); back != queue_.rend();
       ++back) {
    const bool follows = std::any_of(
        moved.begin(), moved.end(),
        [&](const std::shared_ptr<Run>& later) {
          return Conflict(**back, *later);
        });
    if (follows) {
      moved.push_back(*back);
    } else {
      stay.push_front(*back);
    }
  }
  std::deque<std::shared_ptr<Run>> queue(moved.rbegin(), moved.rend());
  queue.insert(queue.end(), stay.begin(), stay.end());
  queue.insert(queue.end(), std::next(it), queue_.end());
  queue_.swap(queue);
  Admit();
}

std::vector<uint64_t> HostUpdater::queued_runs() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint64_t> ids;
  for (const std::shared_ptr<Run>& run : queue_) ids.push_back(run->handle->id());
  return ids;
}

void HostUpdater::Finish(const std::shared_ptr<Run>& run) {
  // Its on_complete first, while it is still active: a run that uses its
  // objects starts only after, and one submitted meanwhile queues behind
  // it (and is skipped below if it failed).
  Complete(run);
  std::vector<std::shared_ptr<Run>> skipped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    active_.erase(std::find(active_.begin(), active_.end(), run));
    if (active_.empty()) stats_.busy_ns += NowNs() - busy_since_ns_;
    if (!run->status.ok() && !stopping_) skipped = SkipFollowers(*run);
    if (!stopping_) Admit();  // what waited for it, in order
  }
  for (const std::shared_ptr<Run>& follower : skipped) Complete(follower);
}

std::vector<std::shared_ptr<HostUpdater::Run>> HostUpdater::SkipFollowers(
    const Run& failed) {
  // A queued run that uses what a failed (or skipped) run writes, or
  // writes what it uses, would carry on from bytes that are not what the
  // runs before it say: it is not run, and its own followers neither.
  std::vector<const Run*> behind = {&failed};
  std::vector<std::shared_ptr<Run>> skipped;
  for (auto it = queue_.begin(); it != queue_.end();) {
    Run& run = **it;
    const auto after = std::find_if(
        behind.begin(), behind.end(),
        [&](const Run* earlier) { return Conflict(run, *earlier); });
    if (after == behind.end()) {
      ++it;
      continue;
    }
    run.completed = true;
    run.failed = true;
    run.status = Status(
        Code::kInvalidArgument,
        RunName(run.handle->id(), run.job.program_id) +
            ": not run: it follows, on an object both use, a run that "
            "failed (" + (*after)->status.message() + ")");
    behind.push_back(&run);
    skipped.push_back(std::move(*it));
    it = queue_.erase(it);
  }
  return skipped;
}


Status HostUpdater::RunBlock(Run& run, int64_t block, Worker& worker) {
  const UpdateProgram& program = *run.job.program;
  const float* scalars = run.job.scalars.data();
  const int64_t first = block * run.block;
  const int64_t last = std::min(first + run.block, run.elements);
  if (first >= last) return Status::Ok();
  if (run.staged.empty()) {
    RunUpdateRange(program, run.in, run.out, scalars, first, last);
    return Status::Ok();
  }
  // Staged: the block's elements, from 0, in the worker's buffers for nvme
  // arrays and where they are for memory ones.
  while (worker.stage.size() < run.staged.size()) {
    char* buffer = static_cast<char*>(aligned_alloc(kBlockBytes, kStageBytes));
    if (buffer == nullptr) {
      return Status(Code::kExhausted, "no memory for an nvme staging buffer");
    }
    worker.stage.emplace_back(buffer);
  }
  if (!worker.bounce) {
    const uint64_t bytes = (Arena::BounceBytes(kStageBytes) + kBlockBytes - 1) /
                           kBlockBytes * kBlockBytes;
    worker.bounce.reset(static_cast<char*>(aligned_alloc(kBlockBytes, bytes)));
    if (!worker.bounce) {
      return Status(Code::kExhausted, "no memory for an nvme bounce buffer");
    }
  }
  const int64_t n = last - first;
  std::vector<UpdateArray> in = run.in, out = run.out;
  auto place = [&](std::vector<UpdateArray>& arrays,
                   const std::vector<int>& stages) {
    for (size_t i = 0; i < arrays.size(); ++i) {
      if (stages[i] >= 0) {
        arrays[i].data = worker.stage[stages[i]].get();
      } else if (arrays[i].data != nullptr) {
        arrays[i].data = static_cast<char*>(arrays[i].data) +
                         first * ItemBytes(arrays[i].dtype);
      }
    }
  };
  place(in, run.in_stage);
  place(out, run.out_stage);
  for (size_t k = 0; k < run.staged.size(); ++k) {
    const Run::Staged& staged = run.staged[k];
    if (!staged.read) continue;
    const uint64_t item = ItemBytes(staged.target->dtype);
    Status status = staged.target->file->Read(
        staged.target->file_offset + first * item, worker.stage[k].get(),
        n * item, worker.bounce.get());
    if (!status.ok()) {
      return Status(status.code(),
                    "reading handle " + std::to_string(staged.target->handle) +
                        ": " + status.message());
    }
  }
  RunUpdateRange(program, in, out, scalars, 0, n);
  for (size_t k = 0; k < run.staged.size(); ++k) {
    const Run::Staged& staged = run.staged[k];
    if (!staged.written) continue;
    const uint64_t item = ItemBytes(staged.target->dtype);
    Status status = staged.target->file->Write(
        staged.target->file_offset + first * item, worker.stage[k].get(),
        n * item, worker.bounce.get());
    if (!status.ok()) {
      return Status(status.code(),
                    "writing handle " + std::to_string(staged.target->handle) +
                        ": " + status.message());
    }
  }
  return Status::Ok();
}

void HostUpdater::Complete(const std::shared_ptr<Run>& run) {
  Status status;
  int workers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    status = run->status;
    workers = static_cast<int>(run->ran.size());
    ++stats_.runs;
    if (status.ok()) {
      stats_.elements += static_cast<uint64_t>(run->elements);
      stats_.bytes_read += run->elements * run->read_bytes_per_element;
      stats_.bytes_written += run->elements * run->written_bytes_per_element;
    } else {
      ++stats_.failed;
    }
  }
  if (run->job.on_complete) run->job.on_complete(status);
  UpdateRun& handle = *run->handle;
  {
    std::lock_guard<std::mutex> lock(handle.mu_);
    handle.done_ = true;
    handle.workers_ = workers;
    handle.status_ = status;
  }
  handle.cv_.notify_all();
}

void HostUpdater::Hold(bool hold) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    held_ = hold;
  }
  cv_.notify_all();
}

UpdateStats HostUpdater::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  UpdateStats stats = stats_;
  stats.threads = static_cast<int>(workers_.size());
  return stats;
}

}  // namespace jcxl
