// Tests of the copy engine: bytes arrive intact, priorities overtake at chunk
// boundaries, the emulated link is never beaten, records are consistent, and
// shutting down fails queued work instead of hanging.
#include "copy_engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "arena.h"
#include "check.h"
#include "copy_fixtures.h"
#include "test_util.h"
#include "link_model.h"

namespace jcxl {
namespace {


// Memory behind a vector, with a gate that holds every access until opened,
// a count of accesses and an offset at which accesses fail.
class TestArena : public Arena {
 public:
  explicit TestArena(uint64_t bytes) : bytes_(bytes, 0) {}

  Status Read(uint64_t offset, void* dst, uint64_t bytes, void*) override {
    JCXL_RETURN_IF_ERROR(Enter(offset));
    if (bytes > 0) std::memcpy(dst, &bytes_[offset], bytes);
    return Status::Ok();
  }
  Status Write(uint64_t offset, const void* src, uint64_t bytes,
               void*) override {
    JCXL_RETURN_IF_ERROR(Enter(offset));
    if (bytes > 0) std::memcpy(&bytes_[offset], src, bytes);
    return Status::Ok();
  }
  Status Move(uint64_t from, uint64_t to, uint64_t bytes) override {
    std::memmove(&bytes_[to], &bytes_[from], bytes);
    return Status::Ok();
  }
  void Release(uint64_t, uint64_t) override {}
  std::string Describe() const override { return "test arena"; }

  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = false;
  }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  // Waits until `n` accesses have entered (possibly blocked at the gate).
  void AwaitEntered(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return entered_ >= n; });
  }
  void FailAt(uint64_t offset) { fail_at_ = offset; }
  int entered() {
    std::lock_guard<std::mutex> lock(mu_);
    return entered_;
  }
  char* data() { return bytes_.data(); }

 private:
  Status Enter(uint64_t offset) {
    std::unique_lock<std::mutex> lock(mu_);
    ++entered_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return open_; });
    if (offset == fail_at_) {
      return Status(Code::kIo, "test arena: failing offset " +
                                   std::to_string(offset));
    }
    return Status::Ok();
  }

  std::vector<char> bytes_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
  int entered_ = 0;
  std::atomic<uint64_t> fail_at_{UINT64_MAX};
};

void CheckRecordTimes(const TransferRecord& record) {
  CHECK_GT(record.queued_ns, 0);
  CHECK_LE(record.queued_ns, record.started_ns);
  CHECK_LE(record.started_ns, record.finished_ns);
}

TEST(ManyRequestsCompleteWithCorrectBytes) {
  std::unique_ptr<MemoryArena> arena = NewMemoryArena(16 * kMiB);
  CopyEngine engine(/*threads=*/4, /*chunk_bytes=*/64 * kKiB, {});
  CHECK_EQ(engine.threads(), 4);
  constexpr int kRequests = 120;
  constexpr uint64_t kSlot = 128 * kKiB;  // each request owns one slot
  std::mt19937_64 rng(3);
  std::vector<std::vector<char>> sources, results;
  std::vector<uint64_t> sizes, offsets;
  std::atomic<int> completions{0};
  std::vector<std::shared_ptr<Ticket>> tickets;
  for (int i = 0; i < kRequests; ++i) {
    const uint64_t bytes = 1 + rng() % kSlot;
    const uint64_t offset = i * kSlot + rng() % 64;
    sizes.push_back(std::min(bytes, kSlot - 64));
    offsets.push_back(offset);
    sources.push_back(Pattern(sizes.back(), i));
    TransferRequest request =
        Request(arena.get(), offset, sources.back().data(),
                sizes.back(), Direction::kToPool, static_cast<int>(rng() % 3));
    request.chunk_bytes = rng() % 2 ? 0 : 1 + rng() % (32 * kKiB);
    request.on_complete = [&completions](const Status&) { ++completions; };
    tickets.push_back(engine.Submit(std::move(request)));
  }
  for (auto& ticket : tickets) CHECK_OK(ticket->Wait(kLongWaitNs));
  CHECK_EQ(completions.load(), kRequests);  // ran before the waiters woke
  results.resize(kRequests);
  tickets.clear();
  for (int i = 0; i < kRequests; ++i) {
    results[i].assign(sizes[i], 0);
    tickets.push_back(engine.Submit(
        Request(arena.get(), offsets[i], results[i].data(), sizes[i],
                Direction::kFromPool, i % 5)));
  }
  for (int i = 0; i < kRequests; ++i) {
    CHECK_OK(tickets[i]->Wait(kLongWaitNs));
    CHECK(tickets[i]->done());
    CHECK(results[i] == sources[i]);
  }
  std::vector<TransferRecord> records = engine.DrainRecords();
  CHECK_EQ(records.size(), 2u * kRequests);
  std::vector<uint64_t> ids;
  for (const TransferRecord& record : records) {
    CheckRecordTimes(record);
    CHECK(record.ok);
    ids.push_back(record.id);
  }
  std::sort(ids.begin(), ids.end());
  CHECK(std::adjacent_find(ids.begin(), ids.end()) == ids.end());  // unique
  CHECK(engine.DrainRecords().empty());
}

TEST(RequestsAreSplitIntoChunks) {
  TestArena arena(1 * kMiB);
  CopyEngine engine(1, 64 * kKiB, {});
  std::vector<char> buffer(300 * kKiB);
  CHECK_OK(engine.Submit(Request(&arena, 0, buffer.data(), buffer.size(),
                                 Direction::kToPool))
               ->Wait(kLongWaitNs));
  CHECK_EQ(arena.entered(), 5);  // 300 KiB in 64 KiB chunks
  TransferRequest small = Request(&arena, 0, buffer.data(), buffer.size(),
                                  Direction::kFromPool);
  small.chunk_bytes = 100;  // below a block: a block per chunk
  CHECK_OK(engine.Submit(std::move(small))->Wait(kLongWaitNs));
  CHECK_EQ(arena.entered(), 5 + 75);
}

TEST(HighPriorityOvertakesLongLowPriorityRequest) {
  TestArena arena(4 * kMiB);
  CopyEngine engine(/*threads=*/1, /*chunk_bytes=*/16 * kKiB, {});
  std::vector<char> low_buffer(1 * kMiB), high_buffer(64 * kKiB);
  std::vector<char> fifo_a(16 * kKiB), fifo_b(16 * kKiB);
  arena.Close();  // hold the worker on the low request's first chunk
  auto low = engine.Submit(Request(&arena, 0, low_buffer.data(),
                                   low_buffer.size(), Direction::kFromPool,
                                   /*priority=*/10));
  arena.AwaitEntered(1);
  auto a = engine.Submit(Request(&arena, 2 * kMiB, fifo_a.data(),
                                 fifo_a.size(), Direction::kFromPool, 10));
  auto b = engine.Submit(Request(&arena, 3 * kMiB, fifo_b.data(),
                                 fifo_b.size(), Direction::kFromPool, 10));
  auto high = engine.Submit(Request(&arena, 1 * kMiB, high_buffer.data(),
                                    high_buffer.size(), Direction::kFromPool,
                                    /*priority=*/-1));
  arena.Open();
  CHECK_OK(low->Wait(kLongWaitNs));
  CHECK_OK(high->Wait(kLongWaitNs));
  CHECK_OK(a->Wait(kLongWaitNs));
  CHECK_OK(b->Wait(kLongWaitNs));
  const TransferRecord l = low->record(), h = high->record();
  CheckRecordTimes(l);
  CheckRecordTimes(h);
  CHECK_EQ(h.priority, -1);
  CHECK_EQ(l.priority, 10);
  CHECK_LT(l.started_ns, h.started_ns);
  CHECK_LT(h.finished_ns, l.finished_ns);  // overtook at a chunk boundary
  CHECK_LT(h.finished_ns, a->record().finished_ns);
  // Equal priorities run in submission order.
  CHECK_LT(l.finished_ns, a->record().finished_ns);
  CHECK_LT(a->record().finished_ns, b->record().finished_ns);
  // The records come out in completion order.
  std::vector<TransferRecord> records = engine.DrainRecords();
  CHECK_EQ(records.size(), 4u);
  CHECK_EQ(records[0].id, h.id);
  CHECK_EQ(records[1].id, l.id);
}

TEST(EmulatedLinkIsNeverBeaten) {
  std::unique_ptr<MemoryArena> arena = NewMemoryArena(64 * kMiB);
  CopyEngine engine(/*threads=*/2, /*chunk_bytes=*/4 * kMiB, {});
  // 64 MiB at 1 GB/s: at least 67.1 ms on the wire, even with two workers.
  LinkModel link(1e9, 0);
  std::vector<char> buffer(64 * kMiB, 7);
  TransferRequest request = Request(arena.get(), 0, buffer.data(),
                                    buffer.size(), Direction::kToPool);
  request.link = &link;
  const int64_t start = NowNs();
  auto ticket = engine.Submit(std::move(request));
  CHECK_OK(ticket->Wait(kLongWaitNs));
  const int64_t elapsed = NowNs() - start;
  const int64_t wire_ns = static_cast<int64_t>(64.0 * kMiB);  // 1 ns a byte
  CHECK_GE(elapsed, wire_ns);
  const TransferRecord record = ticket->record();
  CHECK_GE(record.finished_ns - record.queued_ns, wire_ns);
  CHECK_GE(record.finished_ns - record.queued_ns, 64 * kMs);

  // A latency-only link delays even a tiny transfer by its latency.
  LinkModel latency(0, 30 * kMs);
  char byte = 1;
  TransferRequest tiny = Request(arena.get(), 100, &byte, 1,
                                 Direction::kToPool);
  tiny.link = &latency;
  const int64_t tiny_start = NowNs();
  CHECK_OK(engine.Submit(std::move(tiny))->Wait(kLongWaitNs));
  CHECK_GE(NowNs() - tiny_start, 30 * kMs);
  CHECK_EQ(arena->base()[100], 1);

  // Two transfers share one link's bandwidth: together they take as long as
  // their sum would alone.
  LinkModel shared(1e9, 0);
  std::vector<char> other(32 * kMiB, 3);
  TransferRequest first = Request(arena.get(), 0, buffer.data(),
                                  32 * kMiB, Direction::kFromPool);
  TransferRequest second = Request(arena.get(), 32 * kMiB,
                                   other.data(), 32 * kMiB,
                                   Direction::kFromPool);
  first.link = &shared;
  second.link = &shared;
  const int64_t both_start = NowNs();
  auto t1 = engine.Submit(std::move(first));
  auto t2 = engine.Submit(std::move(second));
  CHECK_OK(t1->Wait(kLongWaitNs));
  CHECK_OK(t2->Wait(kLongWaitNs));
  CHECK_GE(NowNs() - both_start, wire_ns);
}

TEST(FailedChunkFailsTheRequest) {
  TestArena arena(1 * kMiB);
  CopyEngine engine(2, 64 * kKiB, {});
  arena.FailAt(128 * kKiB);  // the third chunk
  std::vector<char> buffer(256 * kKiB);
  Status seen;
  TransferRequest request = Request(&arena, 0, buffer.data(), buffer.size(),
                                    Direction::kToPool);
  request.on_complete = [&seen](const Status& status) { seen = status; };
  auto ticket = engine.Submit(std::move(request));
  const Status status = ticket->Wait(kLongWaitNs);
  CHECK_CODE(status, Code::kIo);
  CHECK_CONTAINS(status.message(), "failing offset 131072");
  CHECK_CODE(seen, Code::kIo);
  CHECK(!ticket->record().ok);
  // The engine keeps working after a failure.
  CHECK_OK(engine.Submit(Request(&arena, 4096, buffer.data(), 100,
                                 Direction::kToPool))
               ->Wait(kLongWaitNs));
}

TEST(FailedRequestCompletesExactlyOnce) {
  // A request whose only chunk fails at once may finish before Submit
  // returns; it must still complete once (the pool unpins in on_complete).
  TestArena arena(1 * kMiB);
  CopyEngine engine(2, 64 * kKiB, {});
  arena.FailAt(0);
  std::vector<char> buffer(4096);
  std::atomic<int> completions{0};
  std::vector<std::shared_ptr<Ticket>> tickets;
  engine.DrainRecords();
  constexpr int kRequests = 300;
  for (int i = 0; i < kRequests; ++i) {
    TransferRequest request = Request(&arena, 0, buffer.data(), buffer.size(),
                                      Direction::kToPool);
    request.on_complete = [&completions](const Status&) { ++completions; };
    tickets.push_back(engine.Submit(std::move(request)));
  }
  for (auto& ticket : tickets) {
    CHECK_CODE(ticket->Wait(kLongWaitNs), Code::kIo);
  }
  CHECK_EQ(completions.load(), kRequests);
  CHECK_EQ(engine.DrainRecords().size(), static_cast<size_t>(kRequests));
}

TEST(ZeroByteRequestCompletes) {
  TestArena arena(1 * kMiB);
  CopyEngine engine(1, 64 * kKiB, {});
  auto ticket =
      engine.Submit(Request(&arena, 0, nullptr, 0, Direction::kFromPool));
  CHECK_OK(ticket->Wait(kLongWaitNs));
  CHECK_EQ(ticket->record().bytes, 0u);
  // Through a real arena too (a memcpy from or to a null buffer is undefined
  // even for 0 bytes).
  std::unique_ptr<MemoryArena> memory = NewMemoryArena(1 * kMiB);
  CHECK_OK(engine
               .Submit(Request(memory.get(), 0, nullptr, 0,
                               Direction::kFromPool))
               ->Wait(kLongWaitNs));
  CHECK_OK(engine
               .Submit(Request(memory.get(), 0, nullptr, 0,
                               Direction::kToPool))
               ->Wait(kLongWaitNs));
}

TEST(TicketWaitTimesOut) {
  TestArena arena(1 * kMiB);
  CopyEngine engine(1, 64 * kKiB, {});
  std::vector<char> buffer(4096);
  arena.Close();
  TransferRequest request = Request(&arena, 0, buffer.data(), buffer.size(),
                                    Direction::kFromPool);
  request.record.handle = 77;
  auto ticket = engine.Submit(std::move(request));
  const int64_t start = NowNs();
  const Status status = ticket->Wait(20 * kMs);
  CHECK_CODE(status, Code::kTimeout);
  CHECK_GE(NowNs() - start, 20 * kMs);
  CHECK_CONTAINS(status.message(), "handle 77");
  CHECK_CONTAINS(status.message(), "20 ms");
  CHECK(!ticket->done());
  CHECK_CODE(ticket->Wait(0), Code::kTimeout);
  arena.Open();
  CHECK_OK(ticket->Wait(kLongWaitNs));
  CHECK(ticket->done());
  CHECK_OK(ticket->Wait(0));  // a finished ticket answers at once
}

TEST(TicketWaitWithoutDeadline) {
  // The Python face passes INT64_MAX for "no timeout"; that must wait, not
  // overflow into a deadline in the past.
  TestArena arena(1 * kMiB);
  CopyEngine engine(1, 64 * kKiB, {});
  std::vector<char> buffer(4096);
  arena.Close();
  auto ticket = engine.Submit(Request(&arena, 0, buffer.data(), buffer.size(),
                                      Direction::kFromPool));
  std::thread opener([&arena] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    arena.Open();
  });
  const Status status = ticket->Wait(INT64_MAX);
  opener.join();
  CHECK_OK(status);
  CHECK(ticket->done());
  CHECK_OK(ticket->Wait(INT64_MAX));
}

TEST(DestroyingTheEngineFailsQueuedWorkAndNeverHangs) {
  TestArena arena(1 * kMiB);
  auto engine = std::make_unique<CopyEngine>(1, 16 * kKiB, std::vector<int>{});
  std::vector<char> running(64 * kKiB), queued(64 * kKiB), queued2(4096);
  arena.Close();
  auto in_flight = engine->Submit(Request(&arena, 0, running.data(),
                                          running.size(),
                                          Direction::kFromPool));
  arena.AwaitEntered(1);  // the worker holds the first chunk
  std::atomic<int> closed_callbacks{0};
  TransferRequest request = Request(&arena, 512 * kKiB, queued.data(),
                                    queued.size(), Direction::kToPool);
  request.on_complete = [&closed_callbacks](const Status& status) {
    if (status.code() == Code::kClosed) ++closed_callbacks;
  };
  auto waiting = engine->Submit(std::move(request));
  auto waiting2 = engine->Submit(Request(&arena, 900 * kKiB, queued2.data(),
                                         queued2.size(), Direction::kToPool));
  // Destroy on another thread: it fails the queued tickets at once, then
  // joins the worker, which the gate still holds.
  std::future<void> destroyed = std::async(std::launch::async, [&engine] {
    engine.reset();
  });
  // Should a check below fail, open the gate before `destroyed` waits for the
  // destructor (declared after it, so it runs first).
  struct OpenOnExit {
    TestArena& arena;
    ~OpenOnExit() { arena.Open(); }
  } open_on_exit{arena};
  CHECK_CODE(waiting->Wait(5000 * kMs), Code::kClosed);
  CHECK_CODE(waiting2->Wait(5000 * kMs), Code::kClosed);
  CHECK_EQ(closed_callbacks.load(), 1);
  CHECK(!waiting->record().ok);
  CHECK_LE(waiting->record().queued_ns, waiting->record().finished_ns);
  CHECK_EQ(destroyed.wait_for(std::chrono::milliseconds(20)),
           std::future_status::timeout);  // still joining the held worker
  arena.Open();
  if (destroyed.wait_for(std::chrono::seconds(30)) !=
      std::future_status::ready) {
    std::fprintf(stderr, "the engine's destructor hangs\n");
    std::_Exit(1);
  }
  destroyed.get();
  // The chunk under way finished; the rest of its request was failed.
  CHECK_CODE(in_flight->Wait(kLongWaitNs), Code::kClosed);
  // Nothing ran for the queued requests.
  CHECK_EQ(arena.entered(), 1);
  for (uint64_t i = 512 * kKiB; i < 512 * kKiB + 64 * kKiB; ++i) {
    CHECK_EQ(static_cast<int>(arena.data()[i]), 0);
  }
}

TEST(InjectedFailureMovesNoByteAndNamesTheTransfer) {
  TestArena arena(1 * kMiB);
  CopyEngine engine(2, 64 * kKiB, {});
  FaultSpec fault;
  fault.kind = FaultSpec::Kind::kFail;
  fault.skip = 1;  // the second matching transfer
  fault.direction = static_cast<int>(Direction::kToPool);
  engine.InjectFault(fault);
  const std::vector<char> data = Pattern(200 * kKiB, 5);
  std::vector<char> back(data.size());
  auto write = [&](uint64_t offset) {
    TransferRequest request = Request(&arena, offset,
                                      const_cast<char*>(data.data()),
                                      data.size(), Direction::kToPool);
    request.record.handle = 42;
    request.label = "handle 42 (test tier)";
    return engine.Submit(std::move(request));
  };
  // A read does not match the direction, so it neither fails nor counts.
  CHECK_OK(engine.Submit(Request(&arena, 0, back.data(), 4096,
                                 Direction::kFromPool))
               ->Wait(kLongWaitNs));
  CHECK_OK(write(0)->Wait(kLongWaitNs));
  auto failed = write(512 * kKiB);
  const Status status = failed->Wait(kLongWaitNs);
  CHECK_CODE(status, Code::kIo);
  CHECK_CONTAINS(status.message(), "injected fault");
  CHECK_CONTAINS(status.message(), "handle 42 (test tier)");
  CHECK(!failed->record().ok);
  CHECK_EQ(engine.faults_injected(), 1u);
  for (uint64_t i = 512 * kKiB; i < 512 * kKiB + data.size(); ++i) {
    CHECK_EQ(static_cast<int>(arena.data()[i]), 0);  // not a byte moved
  }
  CHECK_OK(write(512 * kKiB)->Wait(kLongWaitNs));  // count was 1
  CHECK(std::memcmp(arena.data() + 512 * kKiB, data.data(), data.size()) ==
        0);
}

TEST(InjectedStallTimesOutAndCancellingEndsIt) {
  TestArena arena(1 * kMiB);
  CopyEngine engine(2, 64 * kKiB, {});
  FaultSpec fault;
  fault.kind = FaultSpec::Kind::kStall;
  fault.tier = 2;
  engine.InjectFault(fault);
  std::memset(arena.data(), 9, 1 * kMiB);
  std::vector<char> stalled_buffer(4096, 0);
  TransferRequest request = Request(&arena, 0, stalled_buffer.data(),
                                    stalled_buffer.size(),
                                    Direction::kFromPool);
  request.record.tier = 2;
  request.label = "handle 7 (nvme tier, shape (4096,), uint8)";
  auto stalled = engine.Submit(std::move(request));
  // Transfers of other tiers, and the other worker, go on meanwhile.
  std::vector<char> other(256 * kKiB);
  CHECK_OK(engine.Submit(Request(&arena, 4096, other.data(), other.size(),
                                 Direction::kFromPool))
               ->Wait(kLongWaitNs));
  const int64_t start = NowNs();
  const Status waited = stalled->Wait(50 * kMs);
  CHECK_CODE(waited, Code::kTimeout);
  CHECK_GE(NowNs() - start, 50 * kMs);
  CHECK_CONTAINS(waited.message(), "handle 7 (nvme tier");
  CHECK_CONTAINS(waited.message(), "did not finish within 50 ms");
  const int64_t cancelled_at = NowNs();
  stalled->Cancel();
  const Status ended = stalled->Wait(kLongWaitNs);
  CHECK_LT(NowNs() - cancelled_at, 5000 * kMs);
  CHECK_CODE(ended, Code::kTimeout);
  CHECK_CONTAINS(ended.message(), "cancelled");
  CHECK(std::all_of(stalled_buffer.begin(), stalled_buffer.end(),
                    [](char c) { return c == 0; }));  // never written
}

TEST(InjectedStallIsReleasedByTheNextFault) {
  TestArena arena(1 * kMiB);
  CopyEngine engine(1, 64 * kKiB, {});
  FaultSpec fault;
  fault.kind = FaultSpec::Kind::kStall;
  fault.count = -1;
  engine.InjectFault(fault);
  std::vector<char> buffer(128 * kKiB);
  auto first = engine.Submit(Request(&arena, 0, buffer.data(), buffer.size(),
                                     Direction::kFromPool));
  CHECK_CODE(first->Wait(20 * kMs), Code::kTimeout);
  engine.InjectFault(FaultSpec{});  // clears the fault, releases the stall
  CHECK_OK(first->Wait(kLongWaitNs));
  CHECK_OK(engine.Submit(Request(&arena, 0, buffer.data(), buffer.size(),
                                 Direction::kFromPool))
               ->Wait(kLongWaitNs));
  CHECK_EQ(engine.faults_injected(), 1u);
}

TEST(DestroyingTheEngineEndsAnInjectedStall) {
  TestArena arena(1 * kMiB);
  auto engine = std::make_unique<CopyEngine>(1, 64 * kKiB, std::vector<int>{});
  FaultSpec fault;
  fault.kind = FaultSpec::Kind::kStall;
  engine->InjectFault(fault);
  std::vector<char> buffer(4096);
  auto stalled = engine->Submit(Request(&arena, 0, buffer.data(),
                                        buffer.size(), Direction::kToPool));
  CHECK_CODE(stalled->Wait(20 * kMs), Code::kTimeout);
  const int64_t start = NowNs();
  engine.reset();
  CHECK_LT(NowNs() - start, 5000 * kMs);
  const Status status = stalled->Wait(0);
  CHECK_CODE(status, Code::kClosed);
  CHECK_CONTAINS(status.message(), "stalled");
}

TEST(CancellingCutsAnEmulatedLinkWaitShort) {
  std::unique_ptr<MemoryArena> memory = NewMemoryArena(2 * kMiB);
  CopyEngine engine(1, 1 * kMiB, {});
  LinkModel link(1e6, 0);  // 1 MB/s: a 1 MiB transfer takes about a second
  std::vector<char> buffer(1 * kMiB);
  TransferRequest request = Request(memory.get(), 0, buffer.data(),
                                    buffer.size(), Direction::kFromPool);
  request.link = &link;
  auto ticket = engine.Submit(std::move(request));
  CHECK_CODE(ticket->Wait(20 * kMs), Code::kTimeout);
  const int64_t start = NowNs();
  ticket->Cancel();
  ticket->Wait(kLongWaitNs);
  CHECK(ticket->done());
  CHECK_LT(NowNs() - start, 500 * kMs);
}

// A buffer lent to the engine, whose deleter says when the engine let it go
// (a mutex, so that the test's later reads happen after the engine's).
class LentBuffer {
 public:
  explicit LentBuffer(std::vector<char> bytes)
      : bytes_(new std::vector<char>(std::move(bytes))) {}
  char* data() { return bytes_->data(); }
  // The engine's reference; the test then drops its own.
  std::shared_ptr<void> Lend() {
    return std::shared_ptr<void>(bytes_, [this](void* bytes) {
      delete static_cast<std::vector<char>*>(bytes);
      std::lock_guard<std::mutex> lock(mu_);
      released_ = true;
      cv_.notify_all();
    });
  }
  bool released() {
    std::lock_guard<std::mutex> lock(mu_);
    return released_;
  }
  // Waits (bounded) until the engine has let the buffer go.
  bool AwaitReleased() {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::nanoseconds(kLongWaitNs),
                        [this] { return released_; });
  }

 private:
  std::vector<char>* bytes_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;
};

// The caller drops its ticket (and holds no reference to the buffer) while
// a chunk is under way and more are queued: the engine's reference keeps
// the buffer alive until the last chunk is done (ASan reports a use after
// free if it does not), then lets it go.
TEST(AbandonedTransferKeepsItsBufferUntilTheEngineIsDone) {
  TestArena arena(4 * kMiB);
  CopyEngine engine(2, 64 * kKiB, {});
  for (Direction direction : {Direction::kFromPool, Direction::kToPool}) {
    const std::vector<char> stored = Pattern(kMiB, 11);
    std::memcpy(arena.data(), stored.data(), stored.size());
    const std::vector<char> sent = Pattern(kMiB, 12);
    LentBuffer buffer(sent);
    TransferRequest request =
        Request(&arena, 0, buffer.data(), kMiB, direction);
    request.buffer_owner = buffer.Lend();
    const int entered = arena.entered();
    arena.Close();  // every chunk waits at the gate: the copy is mid-way
    std::shared_ptr<Ticket> ticket = engine.Submit(std::move(request));
    arena.AwaitEntered(entered + 1);
    ticket.reset();
    CHECK(!buffer.released());  // the engine still holds it
    arena.Open();
    CHECK(buffer.AwaitReleased());
    if (direction == Direction::kToPool) {  // the whole copy arrived
      CHECK(std::memcmp(arena.data(), sent.data(), kMiB) == 0);
    }
  }
}

// The same, with the engine destroyed mid-copy: its destructor fails the
// queued chunks, joins the worker on the running one, and by the time it
// returns every abandoned buffer has been let go.
TEST(DestroyingTheEngineReleasesAbandonedBuffers) {
  TestArena arena(4 * kMiB);
  auto engine = std::make_unique<CopyEngine>(1, 64 * kKiB, std::vector<int>{});
  std::vector<std::weak_ptr<std::vector<char>>> watches;
  arena.Close();
  for (int i = 0; i < 3; ++i) {
    auto buffer = std::make_shared<std::vector<char>>(256 * kKiB);
    watches.push_back(buffer);
    TransferRequest request =
        Request(&arena, i * kMiB, buffer->data(), buffer->size(),
                i % 2 ? Direction::kToPool : Direction::kFromPool);
    request.buffer_owner = std::move(buffer);
    engine->Submit(std::move(request));  // ticket dropped at once
  }
  arena.AwaitEntered(1);
  for (const auto& watch : watches) CHECK(!watch.expired());
  std::thread opener([&arena] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    arena.Open();
  });
  engine.reset();
  opener.join();
  for (const auto& watch : watches) CHECK(watch.expired());
}

TEST(DestroyingAnIdleEngineReturns) {
  for (int threads : {1, 4}) {
    auto start = NowNs();
    { CopyEngine engine(threads, 0, {}); }
    CHECK_LT(NowNs() - start, 5000 * kMs);
  }
  CopyEngine engine(0, 0, {});  // at least one worker, at least one block
  CHECK_EQ(engine.threads(), 1);
  CHECK_EQ(engine.chunk_bytes(), kBlockBytes);
}

}  // namespace
}  // namespace jcxl

JCXL_TEST_MAIN()
