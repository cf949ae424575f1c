#include "copy_engine.h"

#include <stdlib.h>
#include <sys/prctl.h>
#include <time.h>

#include <algorithm>

#include "numa.h"

namespace jcxl {
namespace {

constexpr size_t kMaxRecords = 1 << 16;
// How often a stalled or sleeping chunk looks for a cancellation.
constexpr int64_t kPollNs = 10'000'000;

std::string WhatOf(const TransferRecord& record, const std::string& label) {
  return "transfer " + std::to_string(record.id) + " of " +
         (label.empty() ? "handle " + std::to_string(record.handle) : label);
}

}  // namespace

Status Ticket::Wait(int64_t timeout_ns) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool finished = cv_.wait_for(
      lock, std::chrono::nanoseconds(std::min(timeout_ns, kMaxTimeoutNs)),
      [this] { return done_; });
  if (!finished) {
    return Status(Code::kTimeout,
                  WhatOf(record_, label_) + " (" +
                      std::to_string(record_.bytes) +
                      " bytes) did not finish within " +
                      std::to_string(timeout_ns / 1000000) + " ms");
  }
  return status_;
}

void Ticket::Cancel() { cancelled_.store(true, std::memory_order_relaxed); }

bool Ticket::done() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

TransferRecord Ticket::record() {
  std::lock_guard<std::mutex> lock(mu_);
  return record_;
}

CopyEngine::CopyEngine(int threads, uint64_t chunk_bytes, std::vector<int> cpus)
    : chunk_bytes_(std::max<uint64_t>(chunk_bytes, kBlockBytes)),
      cpus_(std::move(cpus)) {
  threads = std::max(threads, 1);
  for (int i = 0; i < threads; ++i) {
    workers_.emplace_back([this] { WorkerLoop(); });
  }
}

CopyEngine::~CopyEngine() {
  std::vector<std::shared_ptr<Request>> finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    while (!queue_.empty()) {
      const Chunk& chunk = queue_.top();
      Request& request = *chunk.request;
      if (request.status.ok()) {
        request.status = Status(
            Code::kClosed, WhatOf(request.spec.record, request.spec.label) +
                               ": the pool was closed before it ran");
      }
      if (--request.chunks_left == 0) finished.push_back(chunk.request);
      queue_.pop();
    }
  }
  cv_.notify_all();
  stall_cv_.notify_all();  // stalled chunks fail as kClosed
  for (auto& request : finished) Finish(request);
  for (std::thread& worker : workers_) worker.join();
}

std::shared_ptr<Ticket> CopyEngine::Submit(TransferRequest spec) {
  auto request = std::make_shared<Request>();
  request->ticket = std::make_shared<Ticket>();
  const uint64_t chunk =
      spec.chunk_bytes > 0 ? std::max(spec.chunk_bytes, kBlockBytes)
                           : chunk_bytes_;
  request->ticket->label_ = spec.label;
  request->spec = std::move(spec);
  TransferRecord& record = request->spec.record;
  record.direction = request->spec.direction;
  record.bytes = request->spec.bytes;
  record.priority = request->spec.priority;
  record.queued_ns = NowNs();
  // Decided under the lock: once the chunks are queued a worker may fail and
  // finish the request, so its status is no longer ours to read.
  bool closed = false;
  int request_chunks = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    record.id = next_id_++;
    request->ticket->record_ = record;
    if (stopping_) {
      request->status = Status(Code::kClosed, "the pool is closed");
      closed = true;
    } else {
      FaultSpec& f = fault_;
      if (f.kind != FaultSpec::Kind::kNone &&
          (f.tier < 0 || f.tier == record.tier) &&
          (f.direction < 0 ||
           f.direction == static_cast<int>(record.direction))) {
        if (f.skip > 0) {
          --f.skip;
        } else if (f.count != 0) {
          request->fault = f.kind;
          request->stall_epoch = stall_epoch_;
          ++faults_injected_;
          if (f.count > 0) --f.count;
        }
      }
      const uint64_t bytes = request->spec.bytes;
      const uint64_t chunks = bytes == 0 ? 1 : (bytes + chunk - 1) / chunk;
      request->chunks_left = static_cast<int>(chunks);
      request_chunks = static_cast<int>(chunks);
      const uint64_t sequence = next_sequence_++;
      for (uint64_t i = 0; i < chunks; ++i) {
        const uint64_t offset = i * chunk;
        queue_.push({request, offset, std::min(chunk, bytes - offset),
                     sequence});
      }
    }
  }
  if (closed) {
    Finish(request);
  } else {
    // Wake one worker per chunk (not all of them for a one-chunk request).
    for (int i = 0; i < std::min<int>(request_chunks, threads()); ++i) {
      cv_.notify_one();
    }
  }
  return request->ticket;
}

void CopyEngine::InjectFault(const FaultSpec& spec) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    fault_ = spec;
    ++stall_epoch_;
  }
  stall_cv_.notify_all();
}

uint64_t CopyEngine::faults_injected() {
  std::lock_guard<std::mutex> lock(mu_);
  return faults_injected_;
}

std::vector<TransferRecord> CopyEngine::DrainRecords() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<TransferRecord> out(records_.begin(), records_.end());
  records_.clear();
  return out;
}

void CopyEngine::WorkerLoop() {
  numa::PinThreadToCpus(cpus_);  // best effort: near the pool's nodes
  // An emulated link's chunk sleeps until its delivery time. With the
  // default 50 us timer slack a worker woke 75-100 us late here: one 64 KiB
  // transfer on a 2 GB/s link took 234 us, about 130 with this. It is this
  // thread's own slack: no other thread is touched.
  prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
  char* bounce = nullptr;
  uint64_t bounce_size = 0;
  for (;;) {
    Chunk chunk;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) break;  // stopping
      chunk = queue_.top();
      queue_.pop();
      Request& request = *chunk.request;
      if (!request.started) {
        request.started = true;
        request.spec.record.started_ns = NowNs();
      }
    }
    // aligned_alloc wants a size that is a multiple of the alignment.
    const uint64_t needed =
        (Arena::BounceBytes(chunk.bytes) + kBlockBytes - 1) / kBlockBytes *
        kBlockBytes;
    if (needed > bounce_size) {
      free(bounce);
      bounce = static_cast<char*>(aligned_alloc(kBlockBytes, needed));
      bounce_size = bounce ? needed : 0;
    }
    RunChunk(chunk, bounce);
  }
  free(bounce);
}

void CopyEngine::Stall(Request& request, Status* status) {
  std::unique_lock<std::mutex> lock(mu_);
  // Cancel() cannot notify: it does not know the engine. Hence the polling.
  while (!stopping_ && stall_epoch_ == request.stall_epoch &&
         !request.ticket->cancelled()) {
    stall_cv_.wait_for(lock, std::chrono::nanoseconds(kPollNs));
  }
  if (stopping_) {
    *status = Status(Code::kClosed, "injected stall: the pool was closed "
                                    "while the transfer stalled");
  }
}

void CopyEngine::SleepUntil(int64_t deadline_ns, const Ticket& ticket) {
  for (int64_t now = NowNs(); now < deadline_ns && !ticket.cancelled();
       now = NowNs()) {
    const int64_t wait = std::min(deadline_ns - now, kPollNs);
    timespec ts{static_cast<time_t>(wait / 1000000000),
                static_cast<long>(wait % 1000000000)};
    nanosleep(&ts, nullptr);
  }
}

void CopyEngine::RunChunk(const Chunk& chunk, char* bounce) {
  Request& request = *chunk.request;
  const TransferRequest& spec = request.spec;
  const Ticket& ticket = *request.ticket;
  Status status;
  int64_t started_ns;
  FaultSpec::Kind fault;
  {
    std::lock_guard<std::mutex> lock(mu_);
    started_ns = request.spec.record.started_ns;
    fault = request.fault;
  }
  if (fault == FaultSpec::Kind::kStall && chunk.offset == 0) {
    Stall(request, &status);  // only the first chunk: the others run on
  }
  if (!status.ok()) {
    // Closed while stalled.
  } else if (ticket.cancelled()) {
    status = Status(Code::kTimeout,
                    "cancelled: its waiter timed out before it finished");
  } else if (fault == FaultSpec::Kind::kFail) {
    status = Status(Code::kIo, "injected fault: the transfer failed without "
                               "moving a byte");
  } else if (bounce == nullptr) {
    status = Status(Code::kExhausted, "copy engine: no memory for a buffer");
  } else {
    const int64_t deadline =
        spec.link ? spec.link->Reserve(chunk.bytes, started_ns) : 0;
    char* buffer = static_cast<char*>(spec.buffer) + chunk.offset;
    const uint64_t offset = spec.arena_offset + chunk.offset;
    if (chunk.bytes == 0) {
      // An empty request (its buffer may be null): nothing to copy.
    } else if (spec.direction == Direction::kFromPool) {
      status = spec.arena->Read(offset, buffer, chunk.bytes, bounce);
    } else {
      status = spec.arena->Write(offset, buffer, chunk.bytes, bounce);
    }
    if (deadline > 0) SleepUntil(deadline, ticket);
  }
  bool last;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status.ok() && request.status.ok()) {
      request.status =
          Status(status.code(), WhatOf(spec.record, spec.label) + ": " +
                                    status.message());
    }
    last = --request.chunks_left == 0;
  }
  if (last) Finish(chunk.request);
}

void CopyEngine::Finish(const std::shared_ptr<Request>& request) {
  TransferRecord record = request->spec.record;
  record.finished_ns = NowNs();
  if (record.started_ns == 0) record.started_ns = record.finished_ns;
  record.ok = request->status.ok();
  if (request->spec.on_complete) request->spec.on_complete(request->status);
  // No chunk touches the buffer any more: the caller may be the last owner.
  request->spec.buffer_owner.reset();
  {
    std::lock_guard<std::mutex> lock(mu_);
    records_.push_back(record);
    if (records_.size() > kMaxRecords) records_.pop_front();
  }
  Ticket& ticket = *request->ticket;
  {
    std::lock_guard<std::mutex> lock(ticket.mu_);
    ticket.done_ = true;
    ticket.status_ = request->status;
    ticket.record_ = record;
  }
  ticket.cv_.notify_all();
}

}  // namespace jcxl
