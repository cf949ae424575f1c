// Tests of ExecutionTransfers: an execution that fails stops every copy it
// started before its buffers are freed, so that no copy outlives the buffer
// it reads or writes. The stress test fails executions at random points
// (a start refused, a copy that fails, stalls or times out, the engine
// closed) on several threads, frees each failed execution's buffers at once
// and lets AddressSanitizer catch any copy that still touches them.
#include "execution_transfers.h"

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "arena.h"
#include "check.h"
#include "copy_engine.h"
#include "copy_fixtures.h"
#include "link_model.h"
#include "test_util.h"

namespace jcxl {
namespace {

constexpr uint64_t kArenaBytes = 4 * kMiB;

std::unique_ptr<MemoryArena> NewArena() { return NewMemoryArena(kArenaBytes); }

TransferRequest Copy(Arena* arena, LinkModel* link, uint64_t offset,
                     void* buffer, uint64_t bytes, Direction direction) {
  TransferRequest request = Request(arena, offset, buffer, bytes, direction);
  request.link = link;
  request.chunk_bytes = 16 * kKiB;
  request.label = "test object";
  return request;
}

TEST(AbortStopsEveryCopyOfTheExecutionAndNoOther) {
  auto arena = NewArena();
  LinkModel link(50e6, 0);  // 64 KiB takes about 1.3 ms
  CopyEngine engine(2, 16 * kKiB, {});
  ExecutionTransfers table;
  std::vector<std::vector<char>> buffers(4, std::vector<char>(64 * kKiB));
  std::vector<std::shared_ptr<Ticket>> tickets;
  for (int i = 0; i < 4; ++i) {
    tickets.push_back(engine.Submit(Copy(arena.get(), &link, i * 64 * kKiB,
                                         buffers[i].data(), 64 * kKiB,
                                         Direction::kFromPool)));
    CHECK_OK(table.Add(i < 3 ? 7 : 8, buffers[i].data(), tickets.back()));
  }
  CHECK_EQ(table.Abort(7), 3);
  for (int i = 0; i < 3; ++i) CHECK(tickets[i]->done());
  CHECK_EQ(table.in_flight(), size_t{1});  // execution 8's
  std::shared_ptr<Ticket> other = table.Take(buffers[3].data());
  CHECK(other != nullptr);
  CHECK_OK(other->Wait(kLongWaitNs));
  CHECK(table.Take(buffers[0].data()) == nullptr);
}

TEST(AStartAfterItsExecutionFailedIsRefusedAndStopped) {
  auto arena = NewArena();
  LinkModel link(50e6, 0);
  CopyEngine engine(1, 16 * kKiB, {});
  ExecutionTransfers table;
  CHECK(!table.failed(11));
  CHECK_EQ(table.Abort(11), 0);
  CHECK(table.failed(11));
  CHECK(!table.failed(12));
  std::vector<char> buffer(256 * kKiB);
  std::shared_ptr<Ticket> ticket = engine.Submit(Copy(
      arena.get(), &link, 0, buffer.data(), buffer.size(),
      Direction::kFromPool));
  Status refused = table.Add(11, buffer.data(), ticket);
  CHECK_CODE(refused, Code::kInternal);
  CHECK_CONTAINS(refused.message(), "execution 11 already failed");
  CHECK(ticket->done());
  CHECK_EQ(table.in_flight(), size_t{0});
}

TEST(ACopyLeftAtAReusedAddressIsStoppedFirst) {
  auto arena = NewArena();
  CopyEngine engine(1, 16 * kKiB, {});
  ExecutionTransfers table;
  std::vector<char> buffer(64 * kKiB);
  FaultSpec stall;
  stall.kind = FaultSpec::Kind::kStall;
  engine.InjectFault(stall);
  std::shared_ptr<Ticket> left = engine.Submit(Copy(
      arena.get(), nullptr, 0, buffer.data(), buffer.size(),
      Direction::kFromPool));
  CHECK_OK(table.Add(1, buffer.data(), left));  // its `done` never ran
  std::shared_ptr<Ticket> next = engine.Submit(Copy(
      arena.get(), nullptr, 0, buffer.data(), buffer.size(),
      Direction::kFromPool));
  CHECK_OK(table.Add(2, buffer.data(), next));
  CHECK(left->done());
  CHECK_CODE(left->Wait(0), Code::kTimeout);  // cancelled
  CHECK_OK(table.Take(buffer.data())->Wait(kLongWaitNs));
}

// What a stress thread saw, checked on the main thread (a CHECK may not
// fail on another thread).
struct Tally {
  std::mutex mu;
  std::vector<std::string> problems;
  uint64_t copies = 0;
  uint64_t failed_executions = 0;
  uint64_t good_executions = 0;
  uint64_t named_errors = 0;
  void Problem(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    problems.push_back(what);
  }
};

// A failure must name what failed (the transfer, or the execution).
bool Named(const Status& status) {
  const std::string& m = status.message();
  return !status.ok() && status.code() != Code::kInternal
             ? m.find("transfer ") != std::string::npos
             : m.find("execution ") != std::string::npos;
}

// One execution: `copies` starts, then their dones; it fails at a random
// point. Its buffers are freed as soon as it is over, failed or not, as
// XLA frees an execution's buffers.
void RunExecution(int thread, int64_t run, std::mt19937_64& rng,
                  CopyEngine& engine, Arena* arena, LinkModel* link,
                  ExecutionTransfers& table, Tally& tally) {
  const int copies = 1 + static_cast<int>(rng() % 8);
  // 0..copies-1: the start of that copy is refused (object freed, tier
  // full, pool closed: no copy is submitted); copies..2*copies-1: that
  // done fails for a reason not its copy's (another call of the step);
  // 2*copies: no injected failure (its copies may still fail or time out).
  const int fail_at = static_cast<int>(rng() % (2 * copies + 2));
  std::vector<std::unique_ptr<char[]>> buffers;
  std::vector<std::shared_ptr<Ticket>> tickets;
  bool failed = false;
  for (int i = 0; i < copies && !failed; ++i) {
    const uint64_t bytes = (1 + rng() % 16) * 4 * kKiB;
    buffers.emplace_back(new char[bytes]);
    if (i == fail_at) {
      failed = true;
      break;
    }
    const Direction direction =
        rng() % 2 ? Direction::kFromPool : Direction::kToPool;
    if (direction == Direction::kToPool) {
      std::memset(buffers.back().get(), static_cast<int>(run), bytes);
    }
    // Each thread's copies have pool bytes of their own, as a step's
    // objects are its own: no two copies race on them.
    const uint64_t offset = (thread * 8 + i) * 64 * kKiB;
    tickets.push_back(engine.Submit(Copy(arena, link, offset,
                                         buffers.back().get(), bytes,
                                         direction)));
    Status filed = table.Add(run, buffers.back().get(), tickets.back());
    if (!filed.ok()) tally.Problem("a good execution's copy was refused");
  }
  for (int i = 0; i < static_cast<int>(tickets.size()) && !failed; ++i) {
    if (copies + i == fail_at) {
      failed = true;
      break;
    }
    std::shared_ptr<Ticket> ticket = table.Take(buffers[i].get());
    if (!ticket) {
      tally.Problem("a done found no copy");
      failed = true;
      break;
    }
    // Short deadlines: some waits time out while the copy runs.
    Status status = ticket->Wait(static_cast<int64_t>(rng() % 4) * kMs);
    if (!status.ok()) {
      ExecutionTransfers::Stop(ticket);
      if (!Named(status)) tally.Problem("unnamed error: " + status.message());
      std::lock_guard<std::mutex> lock(tally.mu);
      ++tally.named_errors;
      failed = true;
    }
  }
  if (failed) {
    table.Abort(run);
    // A start racing the failure on another thread of the execution.
    if (rng() % 4 == 0) {
      auto late = std::make_unique<char[]>(4 * kKiB);
      std::shared_ptr<Ticket> ticket = engine.Submit(
          Copy(arena, link, thread * 8 * 64 * kKiB, late.get(), 4 * kKiB,
               Direction::kFromPool));
      Status refused = table.Add(run, late.get(), ticket);
      if (refused.ok() || !Named(refused) || !ticket->done()) {
        tally.Problem("a start after the execution failed ran on");
      }
    }
  }
  for (const auto& ticket : tickets) {
    if (!ticket->done()) tally.Problem("a copy outlived its execution");
  }
  std::lock_guard<std::mutex> lock(tally.mu);
  tally.copies += tickets.size();
  ++(failed ? tally.failed_executions : tally.good_executions);
  // `buffers` are freed here: ASan reports any copy still touching them.
}

TEST(FailedExecutionsNeverLeaveACopyBehind) {
  auto arena = NewArena();
  LinkModel link(400e6, 20'000);  // 64 KiB takes about 160 us
  ExecutionTransfers table;
  Tally tally;
  std::atomic<int64_t> next_run{1};
  {
    CopyEngine engine(2, 16 * kKiB, {});
    constexpr int kThreads = 4;
    constexpr int kExecutions = 400;
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937_64 rng(1234 + t);
        for (int e = 0; e < kExecutions; ++e) {
          // Now and then a fault on the copies of every thread: failed
          // copies (an I/O error) or stalls (their waits time out).
          if (t == 0 && e % 25 == 0) {
            FaultSpec fault;
            fault.kind = e % 50 ? FaultSpec::Kind::kFail
                                : FaultSpec::Kind::kStall;
            fault.count = 1 + static_cast<int64_t>(rng() % 4);
            fault.skip = rng() % 8;
            engine.InjectFault(fault);
          }
          RunExecution(t, next_run++, rng, engine, arena.get(), &link,
                       table, tally);
        }
      });
    }
    for (auto& thread : threads) thread.join();
  }
  // The engine (the pool) closed: executions started after that fail too.
  {
    auto engine = std::make_unique<CopyEngine>(1, 16 * kKiB,
                                               std::vector<int>{});
    std::mt19937_64 rng(99);
    std::vector<std::unique_ptr<char[]>> buffers;
    for (int i = 0; i < 8; ++i) {
      buffers.emplace_back(new char[64 * kKiB]);
      CHECK_OK(table.Add(-5, buffers.back().get(),
                         engine->Submit(Copy(arena.get(), &link, 0,
                                             buffers.back().get(), 64 * kKiB,
                                             Direction::kFromPool))));
    }
    engine.reset();  // fails what is queued, joins the workers
    for (auto& buffer : buffers) {
      std::shared_ptr<Ticket> ticket = table.Take(buffer.get());
      CHECK(ticket != nullptr);
      Status status = ticket->Wait(kLongWaitNs);
      if (!status.ok()) {
        CHECK(Named(status));
        table.Abort(-5);
        break;
      }
    }
  }
  CHECK_EQ(table.in_flight(), size_t{0});
  for (const std::string& problem : tally.problems) {
    std::fprintf(stderr, "problem: %s\n", problem.c_str());
  }
  CHECK(tally.problems.empty());
  std::printf("  %llu copies, %llu executions failed, %llu good, "
              "%llu named copy errors\n",
              static_cast<unsigned long long>(tally.copies),
              static_cast<unsigned long long>(tally.failed_executions),
              static_cast<unsigned long long>(tally.good_executions),
              static_cast<unsigned long long>(tally.named_errors));
  CHECK_GT(tally.copies, uint64_t{2000});
  CHECK_GT(tally.failed_executions, uint64_t{300});
  CHECK_GT(tally.good_executions, uint64_t{100});
}

}  // namespace
}  // namespace jcxl

JCXL_TEST_MAIN()
