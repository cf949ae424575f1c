#include "device_transfers.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "link_model.h"

namespace jcxl {
namespace {

// How long a staged copy that timed out gets to stop before its bounce
// buffer would be reused; past it the buffer is never reused.
constexpr int64_t kCancelGraceNs = 2'000'000'000;
constexpr uint64_t kSmallestClass = 64;
constexpr uint64_t kLargeClassStep = 64ull << 20;
// Idle bounce bytes kept beyond a step's working set.
constexpr uint64_t kBounceIdleCap = 512ull << 20;
// Index slots allocated ahead (a slot is held from a start until a worker
// has read it), refilled by the completion thread below a quarter.
constexpr size_t kIndexSlots = 64;

}  // namespace

// ----------------------------------------------------------- HostBufferCache

HostBufferCache::HostBufferCache(
    std::function<StatusOr<void*>(uint64_t)> alloc,
    std::function<void(void*)> free, uint64_t idle_cap_bytes)
    : alloc_(std::move(alloc)),
      free_(std::move(free)),
      idle_cap_bytes_(idle_cap_bytes) {}

HostBufferCache::~HostBufferCache() {
  for (auto& [bytes, data] : idle_) free_(data);
}

uint64_t HostBufferCache::SizeClass(uint64_t bytes) {
  if (bytes <= kSmallestClass) return kSmallestClass;
  if (bytes > kLargeClassStep) {
    return (bytes + kLargeClassStep - 1) / kLargeClassStep * kLargeClassStep;
  }
  uint64_t size = kSmallestClass;
  while (size < bytes) size <<= 1;
  return size;
}

StatusOr<HostBufferCache::Buffer> HostBufferCache::Acquire(uint64_t bytes) {
  const uint64_t size = SizeClass(bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = idle_.find(size);
    if (it != idle_.end()) {
      Buffer buffer{it->second, size};
      idle_.erase(it);
      ++stats_.reuses;
      stats_.idle_bytes -= size;
      stats_.in_use_bytes += size;
      stats_.peak_in_use_bytes =
          std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
      return buffer;
    }
  }
  StatusOr<void*> data = alloc_(size);
  if (!data.ok()) return data.status();
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.allocations;
  stats_.in_use_bytes += size;
  stats_.peak_in_use_bytes =
      std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  return Buffer{*data, size};
}

void HostBufferCache::Release(Buffer buffer) {
  if (buffer.data == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  idle_.emplace(buffer.bytes, buffer.data);
  stats_.in_use_bytes -= buffer.bytes;
  stats_.idle_bytes += buffer.bytes;
}

void HostBufferCache::Reserve(uint64_t bytes, size_t low, size_t high) {
  const uint64_t size = SizeClass(bytes);
  size_t idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle = idle_.count(size);
  }
  if (idle >= low) return;
  for (; idle < high; ++idle) {
    StatusOr<void*> data = alloc_(size);
    if (!data.ok()) return;  // Acquire will try, and report it
    std::lock_guard<std::mutex> lock(mu_);
    idle_.emplace(size, *data);
    ++stats_.allocations;
    stats_.idle_bytes += size;
  }
}

void HostBufferCache::Trim() {
  std::vector<void*> excess;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t keep = std::max(idle_cap_bytes_, stats_.peak_in_use_bytes);
    while (stats_.idle_bytes > keep && !idle_.empty()) {
      auto largest = std::prev(idle_.end());
      stats_.idle_bytes -= largest->first;
      excess.push_back(largest->second);
      idle_.erase(largest);
      ++stats_.frees;
    }
  }
  for (void* data : excess) free_(data);
}

HostBufferCache::Stats HostBufferCache::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

// --------------------------------------------------------------- TaskThreads

TaskThreads::TaskThreads(int threads) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
}

TaskThreads::~TaskThreads() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& thread : threads_) thread.join();
}

void TaskThreads::Post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
    ++posted_;
  }
  cv_.notify_all();
}

void TaskThreads::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t target = posted_;
  cv_.wait(lock, [&] { return finished_ >= target; });
}

void TaskThreads::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and nothing left to run
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    task();
    task = nullptr;  // what it captured goes before the next task runs
    lock.lock();
    ++finished_;
    cv_.notify_all();
  }
}

// ----------------------------------------------------------- DeviceTransfers

struct DeviceTransfers::Job {
  DeviceOps* ops = nullptr;
  DeviceRequest r;
  TransferRecord record;
  DeviceEvent ready = 0;
  DeviceEvent done = 0;  // set before `finished`, never changed after
  HostBufferCache::Buffer slot;
  HostBufferCache::Buffer bounce;
  bool bounce_lost = false;  // a cancelled copy may still write it
  DirectRange range;
  bool pinned = false;  // range is the pool's until Complete ends it
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;  // `done` is recorded, or the transfer failed
  Status status;
  bool completed = false;  // Complete filled `record` (the log waits)

  ~Job() {
    if (ready) ops->ReleaseEvent(ready);
    if (done) ops->ReleaseEvent(done);
  }
};

DeviceTransfers::DeviceTransfers(std::unique_ptr<DeviceOps> ops,
                                 uint64_t lock_chunk_bytes,
                                 std::function<void(const DeviceWait&)> log)
    : ops_(std::move(ops)),
      log_(std::move(log)),
      lock_chunk_bytes_(lock_chunk_bytes),
      bounce_([this](uint64_t n) { return ops_->AllocHost(n); },
              [this](void* p) { ops_->FreeHost(p); }, kBounceIdleCap),
      slots_([this](uint64_t n) { return ops_->AllocHost(n); },
             [this](void* p) { ops_->FreeHost(p); }, 0) {
  // Once, with the device's setup: page-locked allocations synchronize,
  // so none is made per start on XLA's launch thread.
  slots_.Reserve(sizeof(int32_t), kIndexSlots, kIndexSlots);
}

DeviceTransfers::~DeviceTransfers() { Drain(); }

void DeviceTransfers::Drain() {
  workers_.Drain();
  completions_.Drain();
  logs_.Drain();
}

DeviceCounters DeviceTransfers::counters() {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

void DeviceTransfers::WaitFinished(Job& job) {
  std::unique_lock<std::mutex> lock(job.mu);
  job.cv.wait(lock, [&] { return job.finished; });
}

Status DeviceTransfers::Start(DeviceRequest request) {
  std::shared_ptr<Job> stale;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = in_flight_.find(request.device_buffer);
    if (it != in_flight_.end()) {
      stale = std::move(it->second);
      in_flight_.erase(it);
      ++counters_.stale_waits;
    }
  }
  if (stale) {
    // A failed step left this copy behind, and XLA reuses its buffer: the
    // compute stream (and so this transfer's `ready`) waits for it.
    WaitFinished(*stale);
    if (stale->done) {
      JCXL_RETURN_IF_ERROR(ops_->ComputeWaits(request.compute, stale->done));
    }
  }
  auto job = std::make_shared<Job>();
  job->ops = ops_.get();
  job->r = std::move(request);
  const DeviceRequest& r = job->r;
  StatusOr<ObjectInfo> info = r.pool->objects().Info(r.handle);
  job->record.handle = r.handle;
  job->record.tier = info.ok() ? static_cast<int>(info->tier) : 0;
  job->record.node = info.ok() ? info->node : -1;
  job->record.direction = r.direction;
  job->record.bytes = r.bytes;
  job->record.priority = r.priority;
  job->record.queued_ns = NowNs();
  if (r.index_on_device != nullptr) {
    StatusOr<HostBufferCache::Buffer> slot = slots_.Acquire(sizeof(int32_t));
    if (!slot.ok()) return slot.status();
    job->slot = *slot;
    Status copied = ops_->CopyIndexOnCompute(
        r.compute, static_cast<int32_t*>(job->slot.data), r.index_on_device);
    if (!copied.ok()) {
      slots_.Release(job->slot);
      return copied;
    }
  }
  StatusOr<DeviceEvent> ready = ops_->RecordOnCompute(r.compute);
  if (!ready.ok()) {
    // The index copy may still run on the compute stream: its slot is
    // never reused.
    return ready.status();
  }
  job->ready = *ready;
  bool taken = false;
  Status started;
  if (r.index_on_device == nullptr) {
    started = StartDirect(job, r.offset, &taken);
    if (!started.ok() && !taken) return started;  // nothing was queued
  }
  if (!taken) workers_.Post([this, job] { RunDeferred(job); });
  // Also a direct start that failed part-way: a later start into its
  // buffer waits for the copies it did queue.
  std::lock_guard<std::mutex> lock(mu_);
  in_flight_[job->r.device_buffer] = job;
  return started;
}

Status DeviceTransfers::StartDirect(const std::shared_ptr<Job>& job,
                                    uint64_t offset, bool* taken) {
  const DeviceRequest& r = job->r;
  Pool& pool = *r.pool;
  StatusOr<DirectRange> range =
      pool.direct().BeginDirect(r.handle, r.bytes, offset, r.direction);
  if (!range.ok()) {
    // Refused (nvme, a link model): staged. Anything else is the step's
    // error (a freed handle, a closed pool).
    return range.status().code() == Code::kInvalidArgument ? Status::Ok()
                                                           : range.status();
  }
  PageLocks& locks = pool.direct().page_locks();
  if (!locks.installed()) locks.Install(ops_->Locker(), lock_chunk_bytes_);
  Status locked = locks.Ensure(range->region_base, range->region_bytes,
                               range->address, range->bytes);
  if (!locked.ok()) {
    DirectRange unused = *range;
    unused.bytes = 0;  // nothing moved
    pool.direct().EndDirect(unused);
    std::lock_guard<std::mutex> lock(mu_);
    ++counters_.staged_lock_failed;
    return Status::Ok();
  }
  job->range = *range;
  job->pinned = true;
  *taken = true;
  Status status = ops_->CopyWaits(r.direction, job->ready);
  char* device = static_cast<char*>(r.device_buffer);
  uint64_t done = 0;
  for (const LockedPiece& piece :
       locks.Pieces(range->region_base, range->address, range->bytes)) {
    if (!status.ok()) break;
    status = ops_->Copy(r.direction, device + done, piece.address,
                        piece.bytes);
    if (status.ok()) done += piece.bytes;
  }
  // Recorded also after a failed copy if earlier ones were queued: the
  // range is unpinned, and the buffer reused, only once they ran.
  if (status.ok() || done > 0) {
    StatusOr<DeviceEvent> recorded = ops_->RecordOnCopy(r.direction);
    if (recorded.ok()) {
      job->done = *recorded;
    } else {
      if (status.ok()) status = recorded.status();
      // Queued copies with no way to know when they end: the range stays
      // pinned (and Close keeps it mapped) for good.
      if (done > 0) job->pinned = false;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++(r.index_on_device ? counters_.direct_after_index : counters_.direct);
  }
  Finish(job, status);
  return status;
}

void DeviceTransfers::RunDeferred(const std::shared_ptr<Job>& job) {
  const DeviceRequest& r = job->r;
  uint64_t offset = r.offset;
  if (r.index_on_device != nullptr) {
    Status synced = ops_->Sync(job->ready);
    if (!synced.ok()) {
      Finish(job, synced);
      return;
    }
    const int32_t index = *static_cast<int32_t*>(job->slot.data);
    slots_.Release(job->slot);  // read: the compute stream wrote it
    job->slot = {};
    StatusOr<uint64_t> at = r.offset_of(index);
    if (!at.ok()) {
      Finish(job, at.status());
      return;
    }
    offset = *at;
    bool taken = false;
    Status started = StartDirect(job, offset, &taken);
    if (taken) return;  // StartDirect finished it
    if (!started.ok()) {
      Finish(job, started);
      return;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++counters_.staged;
  }
  Finish(job, RunStaged(*job, offset));
}

Status DeviceTransfers::RunStaged(Job& job, uint64_t offset) {
  const DeviceRequest& r = job.r;
  StatusOr<HostBufferCache::Buffer> bounce = bounce_.Acquire(r.bytes);
  if (!bounce.ok()) return bounce.status();
  job.bounce = *bounce;
  const bool fetch = r.direction == Direction::kFromPool;
  // The pool's side, through the copy engine (the link model applies).
  auto pool_copy = [&]() -> Status {
    StatusOr<std::shared_ptr<Ticket>> ticket =
        fetch ? r.pool->transfers().Read(r.handle, job.bounce.data, r.bytes,
                                         offset, r.priority, r.chunk_bytes)
              : r.pool->transfers().Write(r.handle, job.bounce.data, r.bytes,
                                          offset, r.priority, r.chunk_bytes);
    if (!ticket.ok()) return ticket.status();
    Status status = (*ticket)->Wait(r.timeout_ns);
    if (!(*ticket)->done()) {
      (*ticket)->Cancel();
      (*ticket)->Wait(kCancelGraceNs);
      job.bounce_lost = !(*ticket)->done();
    }
    return status;
  };
  auto device_copy = [&]() -> Status {
    JCXL_RETURN_IF_ERROR(ops_->CopyWaits(r.direction, job.ready));
    JCXL_RETURN_IF_ERROR(
        ops_->Copy(r.direction, r.device_buffer, job.bounce.data, r.bytes));
    StatusOr<DeviceEvent> recorded = ops_->RecordOnCopy(r.direction);
    if (!recorded.ok()) return recorded.status();
    job.done = *recorded;
    return Status::Ok();
  };
  if (fetch) {
    Status read = pool_copy();
    if (job.bounce_lost) return read;
    // A failed read fails the step; the buffer gets NaNs, never stale bytes.
    if (!read.ok()) std::memset(job.bounce.data, 0xff, r.bytes);
    Status copied = device_copy();
    return read.ok() ? copied : read;
  }
  JCXL_RETURN_IF_ERROR(device_copy());
  JCXL_RETURN_IF_ERROR(ops_->Sync(job.done));
  return pool_copy();
}

void DeviceTransfers::Finish(const std::shared_ptr<Job>& job, Status status) {
  if (!status.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counters_.failed;
  }
  {
    std::lock_guard<std::mutex> lock(job->mu);
    job->status = std::move(status);  // before Complete may read it
    job->finished = true;
  }
  job->cv.notify_all();
  completions_.Post([this, job] { Complete(job); });
}

void DeviceTransfers::Complete(const std::shared_ptr<Job>& job) {
  int64_t transfer_ns = -1;
  int64_t ended_ns = -1;
  bool ok = true;
  if (job->done) {
    ok = ops_->Sync(job->done).ok();
    if (ok) {
      transfer_ns = ops_->ElapsedNs(job->ready, job->done);
      ended_ns = ops_->HostNsOf(job->done);
    }
  }
  bool job_ok;
  {
    std::lock_guard<std::mutex> lock(job->mu);
    job_ok = ok && job->status.ok();
  }
  if (job->pinned) {
    if (!job_ok) job->range.bytes = 0;  // not known to have moved
    job->r.pool->direct().EndDirect(job->range);
    job->pinned = false;
  }
  slots_.Release(job->slot);
  job->slot = {};
  slots_.Reserve(sizeof(int32_t), kIndexSlots / 4, kIndexSlots);
  if (!job->bounce_lost) bounce_.Release(job->bounce);
  job->bounce = {};
  bounce_.Trim();
  {
    // The DMA's end as the device saw it, not this thread's reaping.
    const int64_t now = NowNs();
    const int64_t end = ended_ns >= 0 ? std::min(ended_ns, now) : now;
    std::lock_guard<std::mutex> lock(job->mu);
    job->record.finished_ns = end;
    job->record.started_ns =
        transfer_ns >= 0
            ? std::max(job->record.queued_ns, end - transfer_ns)
            : job->record.queued_ns;
    job->record.ok = job_ok;
    job->completed = true;
  }
  job->cv.notify_all();
  // Off the launch path and outside any device callback: the last
  // reference may close the pool, which unlocks its pages.
  job->r.pool.reset();
}

Status DeviceTransfers::AbortRun(void* compute, int64_t run) {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = in_flight_.begin(); it != in_flight_.end();) {
      if (it->second->r.run == run) {
        jobs.push_back(std::move(it->second));
        it = in_flight_.erase(it);
      } else {
        ++it;
      }
    }
  }
  Status first;
  for (const auto& job : jobs) {
    WaitFinished(*job);
    if (!job->done) continue;  // failed before any copy was queued
    Status waited = ops_->ComputeWaits(compute, job->done);
    if (!waited.ok() && first.ok()) first = waited;
  }
  return first;
}

Status DeviceTransfers::Done(void* compute, const void* buffer) {
  std::shared_ptr<Job> job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = in_flight_.find(buffer);
    if (it == in_flight_.end()) {
      return Status(Code::kNotFound, "no transfer in flight for this buffer");
    }
    job = std::move(it->second);
    in_flight_.erase(it);
  }
  WaitFinished(*job);
  Status status;
  {
    std::lock_guard<std::mutex> lock(job->mu);
    status = job->status;
  }
  if (!job->done) return status;
  StatusOr<DeviceEvent> before = ops_->RecordOnCompute(compute);
  Status waited = ops_->ComputeWaits(compute, job->done);
  StatusOr<DeviceEvent> after = ops_->RecordOnCompute(compute);
  const DeviceEvent pre = before.ok() ? *before : 0;
  const DeviceEvent post = after.ok() ? *after : 0;
  // On the log thread: its syncs hold back no release.
  logs_.Post([this, job, pre, post] {
    DeviceWait wait;
    int64_t started_ns = -1;
    if (pre && post && ops_->Sync(post).ok()) {
      wait.wait_ns = std::max<int64_t>(0, ops_->ElapsedNs(pre, post));
      started_ns = ops_->HostNsOf(pre);
    }
    wait.wait_started_ns =
        started_ns >= 0 ? started_ns : NowNs() - wait.wait_ns;
    {
      std::unique_lock<std::mutex> lock(job->mu);
      job->cv.wait(lock, [&] { return job->completed; });
      wait.record = job->record;
    }
    if (pre) ops_->ReleaseEvent(pre);
    if (post) ops_->ReleaseEvent(post);
    if (log_) log_(wait);
  });
  return waited.ok() ? status : waited;
}

}  // namespace jcxl
