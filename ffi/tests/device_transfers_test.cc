// Tests of the GPU transfer logic (device_transfers.h) and of page locking
// (page_locks.h) against a fake device: its compute stream runs each call
// at once, its copy streams queue their copies and run them only when an
// event recorded after them is synced or waited on. A bounce buffer, index
// slot or pinned range given back before its copy ran therefore shows as
// wrong bytes, and a chunked registration as the locker's calls.
#include "device_transfers.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "check.h"
#include "pool_fixtures.h"
#include "pool.h"
#include "test_util.h"

namespace jcxl {
namespace {

class FakeLocker : public PageLocker {
 public:
  StatusOr<bool> Lock(char* address, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    locks.push_back({address, bytes});
    if (fail) return Status(Code::kInternal, "fake: out of lockable memory");
    return borrowed.count(address) == 0;  // else someone else's
  }
  void Unlock(char* address, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    unlocks.push_back({address, bytes});
  }
  size_t lock_calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return locks.size();
  }
  size_t unlock_calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return unlocks.size();
  }
  std::atomic<bool> fail{false};
  std::set<char*> borrowed;  // chunks "registered by someone else"
  std::vector<LockedPiece> locks;
  std::vector<LockedPiece> unlocks;

 private:
  std::mutex mu_;
};

struct FakeState {
  std::mutex mu;
  std::deque<std::function<void()>> queued[2];  // by Direction
  uint64_t run[2] = {0, 0};
  uint64_t enqueued[2] = {0, 0};
  std::map<DeviceEvent, std::pair<int, uint64_t>> events;  // stream, position
  std::map<DeviceEvent, int64_t> recorded_ns;
  std::vector<int64_t> ran_ns[2];  // when each copy ran, by position
  DeviceEvent next_event = 1;
  uint64_t copies[2] = {0, 0};
  uint64_t copy_calls = 0;
  uint64_t fail_copy_at = 0;  // this Copy call fails (1-based; 0: none)
  int64_t live_events = 0;
  int64_t live_host_buffers = 0;
  std::vector<std::thread::id> allocating_threads;  // one per AllocHost
  size_t AllocationsOn(std::thread::id thread) {
    std::lock_guard<std::mutex> lock(mu);
    return std::count(allocating_threads.begin(), allocating_threads.end(),
                      thread);
  }
  // While closed, Sync (what jcxl's own threads call) waits; the compute
  // stream's waits do not. The compute gate holds only the Syncs of
  // compute-stream events (a done's log waits for one).
  std::mutex gate_mu;
  std::condition_variable gate_cv;
  bool gate_closed = false;
  bool compute_gate_closed = false;
  void SetGate(bool closed, bool compute_only = false) {
    {
      std::lock_guard<std::mutex> lock(gate_mu);
      (compute_only ? compute_gate_closed : gate_closed) = closed;
    }
    gate_cv.notify_all();
  }
};

class FakeDevice : public DeviceOps {
 public:
  FakeDevice(std::shared_ptr<FakeState> state,
             std::shared_ptr<FakeLocker> locker)
      : s_(std::move(state)), locker_(std::move(locker)) {}

  Status CopyIndexOnCompute(void*, int32_t* slot, const void* index) override {
    std::memcpy(slot, index, sizeof(int32_t));
    return Status::Ok();
  }
  StatusOr<DeviceEvent> RecordOnCompute(void*) override {
    return NewEvent(-1, 0);
  }
  Status ComputeWaits(void*, DeviceEvent event) override {
    return RunUpTo(event);
  }
  Status CopyWaits(Direction, DeviceEvent) override {
    return Status::Ok();  // compute's events have completed already
  }
  Status Copy(Direction direction, void* device, void* host,
              uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (++s_->copy_calls == s_->fail_copy_at) {
      return Status(Code::kInternal, "fake: copy failed to queue");
    }
    const int d = static_cast<int>(direction);
    s_->queued[d].push_back([=] {
      if (direction == Direction::kFromPool) {
        std::memcpy(device, host, bytes);
      } else {
        std::memcpy(host, device, bytes);
      }
    });
    ++s_->enqueued[d];
    ++s_->copies[d];
    return Status::Ok();
  }
  StatusOr<DeviceEvent> RecordOnCopy(Direction direction) override {
    const int d = static_cast<int>(direction);
    std::lock_guard<std::mutex> lock(s_->mu);
    return NewEventLocked(d, s_->enqueued[d]);
  }
  Status Sync(DeviceEvent event) override {
    bool compute;
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      auto it = s_->events.find(event);
      compute = it != s_->events.end() && it->second.first < 0;
    }
    {
      std::unique_lock<std::mutex> lock(s_->gate_mu);
      s_->gate_cv.wait(lock, [&] {
        return !s_->gate_closed && !(compute && s_->compute_gate_closed);
      });
    }
    return RunUpTo(event);
  }
  Status RunUpTo(DeviceEvent event) {
    std::lock_guard<std::mutex> lock(s_->mu);
    auto it = s_->events.find(event);
    if (it == s_->events.end()) {
      return Status(Code::kInternal, "fake: unknown or released event");
    }
    auto [stream, position] = it->second;
    if (stream < 0) return Status::Ok();
    while (s_->run[stream] < position) {
      s_->queued[stream].front()();
      s_->queued[stream].pop_front();
      ++s_->run[stream];
      s_->ran_ns[stream].push_back(NowNs());
    }
    return Status::Ok();
  }
  int64_t ElapsedNs(DeviceEvent, DeviceEvent) override { return 1000; }
  // A copy stream's event happened when the copy before it ran; a compute
  // stream's (and an empty copy stream's) when it was recorded.
  int64_t HostNsOf(DeviceEvent event) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    auto it = s_->events.find(event);
    if (it == s_->events.end()) return -1;
    auto [stream, position] = it->second;
    if (stream < 0 || position == 0) return s_->recorded_ns[event];
    if (s_->ran_ns[stream].size() < position) return -1;  // not run yet
    return s_->ran_ns[stream][position - 1];
  }
  void ReleaseEvent(DeviceEvent event) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->events.erase(event);
    s_->recorded_ns.erase(event);
    --s_->live_events;
  }
  StatusOr<void*> AllocHost(uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    ++s_->live_host_buffers;
    s_->allocating_threads.push_back(std::this_thread::get_id());
    return std::calloc(bytes, 1);
  }
  void FreeHost(void* p) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    --s_->live_host_buffers;
    std::free(p);
  }
  std::shared_ptr<PageLocker> Locker() override { return locker_; }

 private:
  StatusOr<DeviceEvent> NewEvent(int stream, uint64_t position) {
    std::lock_guard<std::mutex> lock(s_->mu);
    return NewEventLocked(stream, position);
  }
  DeviceEvent NewEventLocked(int stream, uint64_t position) {
    const DeviceEvent event = s_->next_event++;
    s_->events[event] = {stream, position};
    s_->recorded_ns[event] = NowNs();
    ++s_->live_events;
    return event;
  }
  std::shared_ptr<FakeState> s_;
  std::shared_ptr<FakeLocker> locker_;
};

constexpr uint64_t kChunk = 1 * kMiB;  // the fake's lock chunk

// Holds the fake's completions back while in scope; opens the gate again
// on the way out, also when a CHECK ends the test early (no hang).
class GateClosed {
 public:
  explicit GateClosed(FakeState& state, bool compute_only = false)
      : state_(state), compute_only_(compute_only) {
    state_.SetGate(true, compute_only_);
  }
  ~GateClosed() { Open(); }
  void Open() { state_.SetGate(false, compute_only_); }

 private:
  FakeState& state_;
  const bool compute_only_;
};

struct Rig {
  std::shared_ptr<FakeState> state = std::make_shared<FakeState>();
  std::shared_ptr<FakeLocker> locker = std::make_shared<FakeLocker>();
  std::mutex log_mu;
  std::vector<DeviceWait> waits;
  std::unique_ptr<DeviceTransfers> transfers;

  Rig() {
    transfers = std::make_unique<DeviceTransfers>(
        std::make_unique<FakeDevice>(state, locker), kChunk,
        [this](const DeviceWait& wait) {
          std::lock_guard<std::mutex> lock(log_mu);
          waits.push_back(wait);
        });
  }
};

PoolConfig HostAndEmulatedCxl(uint64_t host = 16 * kMiB) {
  PoolConfig config;
  config.tiers[0].capacity = host;
  config.tiers[1].capacity = 16 * kMiB;
  config.tiers[1].emulated = true;
  config.tiers[1].link_bytes_per_second = 1e11;  // a link model: staged
  config.copy_threads = 2;
  config.chunk_bytes = 256 * kKiB;
  return config;
}

int32_t Put(Pool& pool, TierKind tier, const std::vector<char>& bytes) {
  StatusOr<int32_t> handle = pool.objects().Allocate(
      tier, bytes.size(), {int64_t(bytes.size())}, "uint8");
  CHECK_OK(handle);
  StatusOr<std::shared_ptr<Ticket>> ticket =
      pool.transfers().Write(*handle, bytes.data(), bytes.size(), 0, 0, 0);
  CHECK_OK(ticket);
  CHECK_OK((*ticket)->Wait(kLongWaitNs));
  return *handle;
}

std::vector<char> Get(Pool& pool, int32_t handle, uint64_t bytes,
                      uint64_t offset = 0) {
  std::vector<char> out(bytes);
  StatusOr<std::shared_ptr<Ticket>> ticket =
      pool.transfers().Read(handle, out.data(), bytes, offset, 0, 0);
  CHECK_OK(ticket);
  CHECK_OK((*ticket)->Wait(kLongWaitNs));
  return out;
}

DeviceRequest Fetch(std::shared_ptr<Pool> pool, int32_t handle,
                    std::vector<char>& device, uint64_t offset = 0) {
  DeviceRequest r;
  r.pool = std::move(pool);
  r.handle = handle;
  r.device_buffer = device.data();
  r.bytes = device.size();
  r.direction = Direction::kFromPool;
  r.offset = offset;
  r.timeout_ns = kLongWaitNs;
  return r;
}

DeviceRequest Store(std::shared_ptr<Pool> pool, int32_t handle,
                    std::vector<char>& device) {
  DeviceRequest r = Fetch(std::move(pool), handle, device);
  r.direction = Direction::kToPool;
  return r;
}

TEST(KnownIndexFromHostTierIsDirectAndLocksOnlyTheChunksItTouches) {
  Rig rig;
  std::shared_ptr<Pool> pool = NewPool(HostAndEmulatedCxl(64 * kMiB));
  std::vector<char> small = Pattern(256 * kKiB, 1);
  std::vector<char> wide = Pattern(3 * kMiB, 2);  // spans 3 or 4 chunks
  const int32_t a = Put(*pool, TierKind::kHost, small);
  const int32_t b = Put(*pool, TierKind::kHost, wide);
  std::vector<char> got_a(small.size()), got_b(wide.size());
  CHECK_OK(rig.transfers->Start(Fetch(pool, a, got_a)));
  CHECK_OK(rig.transfers->Start(Fetch(pool, b, got_b)));
  CHECK_OK(rig.transfers->Done(nullptr, got_a.data()));
  CHECK_OK(rig.transfers->Done(nullptr, got_b.data()));
  CHECK(got_a == small);
  CHECK(got_b == wide);
  rig.transfers->Drain();
  DeviceCounters counters = rig.transfers->counters();
  CHECK_EQ(counters.direct, uint64_t{2});
  CHECK_EQ(counters.staged, uint64_t{0});
  // Lazily, chunk by chunk: what the two objects touch, not 64 MiB.
  PageLockStats locks = pool->direct().page_locks().stats();
  CHECK_EQ(rig.locker->lock_calls(), size_t(locks.locked_chunks));
  CHECK_LE(locks.locked_bytes, 5 * kMiB);
  for (const LockedPiece& piece : rig.locker->locks) {
    CHECK_EQ(piece.bytes, kChunk);
  }
  // One copy per locked chunk a range touches (the wide one: at least 3).
  char* base = pool->direct().MemoryRegions()[0].base;
  uint64_t pieces = 0;
  for (int32_t handle : {a, b}) {
    StatusOr<ObjectInfo> info = pool->objects().Info(handle);
    CHECK_OK(info);
    pieces += pool->direct()
                  .page_locks()
                  .Pieces(base, base + info->offset, info->bytes)
                  .size();
  }
  CHECK_GE(pieces, uint64_t{4});
  CHECK_EQ(rig.state->copies[1], pieces);
  CHECK_EQ(rig.transfers->bounce_stats().allocations, uint64_t{0});
  // The object's direct range was unpinned and counted by the completion.
  CHECK_OK(pool->objects().Free(a, 0));
  CHECK_EQ(pool->objects().Stats()[0].bytes_read,
           uint64_t(small.size() + wide.size()));
  CHECK_OK(pool->Close(kLongWaitNs));
  CHECK_EQ(rig.locker->unlocks.size(), rig.locker->locks.size());
}

TEST(DeviceIndexIsReadFromItsSlotNotFromTheOperandXlaReuses) {
  Rig rig;
  std::shared_ptr<Pool> pool = NewPool(HostAndEmulatedCxl());
  constexpr int kLayers = 8;
  constexpr uint64_t kLayer = 64 * kKiB;
  std::vector<char> stacked = Pattern(kLayers * kLayer, 3);
  for (TierKind tier : {TierKind::kHost, TierKind::kCxl}) {
    const int32_t handle = Put(*pool, tier, stacked);
    for (int32_t layer : {3, 0, 7}) {
      int32_t index_operand = layer;  // the step's device-side index
      std::vector<char> got(kLayer);
      DeviceRequest r = Fetch(pool, handle, got);
      r.index_on_device = &index_operand;
      r.offset_of = [](int64_t i) -> StatusOr<uint64_t> {
        if (i < 0 || i >= kLayers) {
          return Status(Code::kInvalidArgument, "has no slice");
        }
        return static_cast<uint64_t>(i) * kLayer;
      };
      CHECK_OK(rig.transfers->Start(std::move(r)));
      index_operand = 5;  // XLA reused the operand's memory after start
      CHECK_OK(rig.transfers->Done(nullptr, got.data()));
      CHECK(std::equal(got.begin(), got.end(),
                       stacked.begin() + layer * kLayer));
    }
  }
  rig.transfers->Drain();
  DeviceCounters counters = rig.transfers->counters();
  // The host tier's scan fetches stay direct DMA; the emulated cxl tier's
  // keep its link model, staged.
  CHECK_EQ(counters.direct_after_index, uint64_t{3});
  CHECK_EQ(counters.staged, uint64_t{3});
  CHECK_EQ(counters.failed, uint64_t{0});
}

TEST(BadDeviceIndexFailsTheDoneAndReleasesItsSlot) {
  Rig rig;
  std::shared_ptr<Pool> pool = NewPool(HostAndEmulatedCxl());
  const int32_t handle = Put(*pool, TierKind::kHost, Pattern(4 * kKiB, 4));
  int32_t index_operand = 9;
  std::vector<char> got(1 * kKiB);
  DeviceRequest r = Fetch(pool, handle, got);
  r.index_on_device = &index_operand;
  r.offset_of = [](int64_t i) -> StatusOr<uint64_t> {
    return Status(Code::kInvalidArgument,
                  "has no slice " + std::to_string(i));
  };
  CHECK_OK(rig.transfers->Start(std::move(r)));
  Status done = rig.transfers->Done(nullptr, got.data());
  CHECK_CODE(done, Code::kInvalidArgument);
  CHECK_CONTAINS(done.message(), "has no slice 9");
  rig.transfers->Drain();
  CHECK_EQ(rig.transfers->counters().failed, uint64_t{1});
  CHECK_OK(pool->objects().Free(handle, 0));  // nothing left pinned
}

TEST(StagedTransfersReuseBounceBuffersOnlyAfterTheirCopiesRan) {
  Rig rig;
  std::shared_ptr<Pool> pool = NewPool(HostAndEmulatedCxl());
  constexpr int kObjects = 4;
  std::vector<std::vector<char>> values;
  std::vector<int32_t> handles;
  for (int i = 0; i < kObjects; ++i) {
    values.push_back(Pattern(300 * kKiB, 10 + i));
    handles.push_back(Put(*pool, TierKind::kCxl, values.back()));
  }
  for (int round = 0; round < 3; ++round) {
    std::vector<std::vector<char>> got(kObjects,
                                       std::vector<char>(300 * kKiB));
    for (int i = 0; i < kObjects; ++i) {
      CHECK_OK(rig.transfers->Start(Fetch(pool, handles[i], got[i])));
    }
    for (int i = kObjects - 1; i >= 0; --i) {
      CHECK_OK(rig.transfers->Done(nullptr, got[i].data()));
      CHECK(got[i] == values[i]);
    }
    rig.transfers->Drain();
  }
  // A bounce buffer stays taken until the device ran its copy: here the
  // fake's copies run only once the completion thread may sync.
  GateClosed gate(*rig.state);
  std::vector<char> got(300 * kKiB);
  CHECK_OK(rig.transfers->Start(Fetch(pool, handles[0], got)));
  const int64_t deadline = NowNs() + kLongWaitNs;
  auto queued = [&] {
    std::lock_guard<std::mutex> lock(rig.state->mu);
    return rig.state->copies[1] == uint64_t{3 * kObjects + 1};
  };
  while (!queued() && NowNs() < deadline) std::this_thread::yield();
  // Room for a completion that would give the buffer back too early.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK_GT(rig.transfers->bounce_stats().in_use_bytes, uint64_t{0});
  gate.Open();
  CHECK_OK(rig.transfers->Done(nullptr, got.data()));
  CHECK(got == values[0]);
  rig.transfers->Drain();
  HostBufferCache::Stats bounce = rig.transfers->bounce_stats();
  // At most one per transfer in flight at once, then only reuses.
  CHECK_LE(bounce.allocations, uint64_t{kObjects});
  CHECK_EQ(bounce.allocations + bounce.reuses, uint64_t{3 * kObjects + 1});
  CHECK_EQ(bounce.in_use_bytes, uint64_t{0});
  CHECK_EQ(bounce.frees, uint64_t{0});
  // A staged store: device bytes into the emulated tier.
  std::vector<char> device = Pattern(300 * kKiB, 99);
  CHECK_OK(rig.transfers->Start(Store(pool, handles[0], device)));
  CHECK_OK(rig.transfers->Done(nullptr, device.data()));
  CHECK(Get(*pool, handles[0], device.size()) == device);
  CHECK_EQ(rig.transfers->counters().staged, uint64_t{3 * kObjects + 2});
}

TEST(DirectStoreWritesThePoolsOwnPages) {
  Rig rig;
  std::shared_ptr<Pool> pool = NewPool(HostAndEmulatedCxl());
  const int32_t handle = Put(*pool, TierKind::kHost, Pattern(128 * kKiB, 5));
  std::vector<char> device = Pattern(128 * kKiB, 6);
  CHECK_OK(rig.transfers->Start(Store(pool, handle, device)));
  CHECK_OK(rig.transfers->Done(nullptr, device.data()));
  CHECK(Get(*pool, handle, device.size()) == device);
  rig.transfers->Drain();
  CHECK_EQ(rig.transfers->counters().direct, uint64_t{1});
  CHECK_EQ(rig.state->copies[0], uint64_t{1});
}

TEST(ALockFailureFallsBackToStagedAndIsNotRetried) {
  Rig rig;
  rig.locker->fail = true;
  std::shared_ptr<Pool> pool = NewPool(HostAndEmulatedCxl());
  std::vector<char> value = Pattern(200 * kKiB, 7);
  const int32_t handle = Put(*pool, TierKind::kHost, value);
  for (int i = 0; i < 3; ++i) {
    std::vector<char> got(value.size());
    CHECK_OK(rig.transfers->Start(Fetch(pool, handle, got)));
    CHECK_OK(rig.transfers->Done(nullptr, got.data()));
    CHECK(got == value);
  }
  rig.transfers->Drain();
  DeviceCounters counters = rig.transfers->counters();
  CHECK_EQ(counters.staged_lock_failed, uint64_t{3});
  CHECK_EQ(counters.staged, uint64_t{3});
  CHECK_EQ(counters.direct, uint64_t{0});
  CHECK_EQ(rig.locker->lock_calls(), size_t{1});  // remembered, not retried
  PageLockStats locks = pool->direct().page_locks().stats();
  CHECK_EQ(locks.failed_chunks, uint64_t{1});
  CHECK_EQ(locks.refused_ranges, uint64_t{3});
  CHECK_CONTAINS(locks.last_error, "out of lockable memory");
}

TEST(FreedPagesInALockedChunkAreNeverReleased) {
  for (bool locked : {false, true}) {
    Rig rig;
    std::shared_ptr<Pool> pool = NewPool(HostAndEmulatedCxl());
    std::vector<char> value = Pattern(1 * kMiB, 8);
    const int32_t handle = Put(*pool, TierKind::kHost, value);
    StatusOr<ObjectInfo> info = pool->objects().Info(handle);
    CHECK_OK(info);
    char* address = pool->direct().MemoryRegions()[0].base + info->offset;
    if (locked) {  // a direct fetch locks its chunk
      std::vector<char> got(value.size());
      CHECK_OK(rig.transfers->Start(Fetch(pool, handle, got)));
      CHECK_OK(rig.transfers->Done(nullptr, got.data()));
      rig.transfers->Drain();
    }
    CHECK_OK(
        pool->objects().Free(handle, kLongWaitNs));  // the arena's top falls
    // Released pages read back as zeros; locked ones keep what the DMA
    // engine and the CPU share.
    const bool kept = std::memcmp(address, value.data(), value.size()) == 0;
    CHECK_EQ(kept, locked);
    CHECK_EQ(pool->direct().page_locks().stats().skipped_release_bytes,
             locked ? uint64_t{1 * kMiB} : uint64_t{0});
  }
}

TEST(ReleaseUnlockedSkipsExactlyTheLockedChunks) {
  std::vector<char> region(8 * kMiB);
  auto locker = std::make_shared<FakeLocker>();
  PageLocks locks;
  CHECK(locks.Install(locker, kChunk));
  CHECK(!locks.Install(std::make_shared<FakeLocker>(), kChunk));
  char* base = region.data();
  CHECK_OK(locks.Ensure(base, region.size(), base + 2 * kMiB + 5, 10));
  CHECK_OK(locks.Ensure(base, region.size(), base + 5 * kMiB - 1, 2));
  CHECK_CODE(locks.Ensure(base, region.size(), base + 8 * kMiB - 1, 2),
             Code::kInvalidArgument);
  // Chunks 2, 4 and 5 are locked.
  std::vector<std::pair<uint64_t, uint64_t>> released;
  locks.ReleaseUnlocked(base + kMiB / 2, 7 * kMiB,
                        [&](char* at, uint64_t bytes) {
                          released.push_back({uint64_t(at - base), bytes});
                        });
  const std::vector<std::pair<uint64_t, uint64_t>> want = {
      {kMiB / 2, kMiB + kMiB / 2}, {3 * kMiB, kMiB},
      {6 * kMiB, kMiB + kMiB / 2}};
  CHECK(released == want);
  CHECK_EQ(locks.stats().skipped_release_bytes, uint64_t{3 * kMiB});
  std::vector<LockedPiece> pieces =
      locks.Pieces(base, base + kMiB - 10, 2 * kMiB + 20);
  CHECK_EQ(pieces.size(), size_t{4});
  CHECK_EQ(pieces[0].bytes, uint64_t{10});
  CHECK_EQ(pieces[1].bytes, kChunk);
  CHECK_EQ(pieces[3].bytes, uint64_t{10});
  locks.UnlockAll();
  CHECK_EQ(locker->unlocks.size(), size_t{3});
}

TEST(AStaleTransferIsWaitedForBeforeItsBufferIsReused) {
  Rig rig;
  std::shared_ptr<Pool> pool = NewPool(HostAndEmulatedCxl());
  const std::vector<char> device_bytes = Pattern(256 * kKiB, 20);
  const std::vector<char> other = Pattern(256 * kKiB, 21);
  const int32_t stored = Put(*pool, TierKind::kHost, Pattern(256 * kKiB, 22));
  const int32_t fetched = Put(*pool, TierKind::kHost, other);
  std::vector<char> buffer = device_bytes;
  // A failed step: a store's start without its done. XLA then reuses the
  // buffer for a fetch, whose copy runs on the other copy stream: the
  // store must have read the buffer before the fetch overwrites it.
  CHECK_OK(rig.transfers->Start(Store(pool, stored, buffer)));
  CHECK_OK(rig.transfers->Start(Fetch(pool, fetched, buffer)));
  CHECK_OK(rig.transfers->Done(nullptr, buffer.data()));
  rig.transfers->Drain();
  CHECK(buffer == other);
  CHECK(Get(*pool, stored, device_bytes.size()) == device_bytes);
  CHECK_EQ(rig.transfers->counters().stale_waits, uint64_t{1});
}

TEST(AFailedExecutionsTransfersRunBeforeItsBuffersAreFreed) {
  Rig rig;
  std::shared_ptr<Pool> pool = NewPool(HostAndEmulatedCxl());
  const std::vector<char> a = Pattern(64 * kKiB, 40);
  const std::vector<char> b = Pattern(64 * kKiB, 41);
  const std::vector<char> c = Pattern(64 * kKiB, 42);
  const int32_t direct = Put(*pool, TierKind::kHost, a);
  const int32_t staged = Put(*pool, TierKind::kCxl, b);
  const int32_t other = Put(*pool, TierKind::kHost, c);
  std::vector<char> got_a(a.size()), got_b(b.size()), got_c(c.size());
  DeviceRequest fetch_a = Fetch(pool, direct, got_a);
  DeviceRequest fetch_b = Fetch(pool, staged, got_b);
  DeviceRequest fetch_c = Fetch(pool, other, got_c);
  fetch_a.run = fetch_b.run = 9;
  fetch_c.run = 10;  // another execution's
  CHECK_OK(rig.transfers->Start(std::move(fetch_a)));
  CHECK_OK(rig.transfers->Start(std::move(fetch_b)));
  CHECK_OK(rig.transfers->Start(std::move(fetch_c)));
  // Execution 9 fails with no `done` run: the fake runs a copy only once
  // the compute stream waits for an event after it, so the bytes show that
  // the compute stream (where XLA frees the buffers) waits for both.
  CHECK_OK(rig.transfers->AbortRun(nullptr, 9));
  CHECK(got_a == a);
  CHECK(got_b == b);
  CHECK_CODE(rig.transfers->Done(nullptr, got_a.data()), Code::kNotFound);
  CHECK_CODE(rig.transfers->Done(nullptr, got_b.data()), Code::kNotFound);
  CHECK_OK(rig.transfers->Done(nullptr, got_c.data()));
  rig.transfers->Drain();
  CHECK(got_c == c);
}

TEST(CompletionsLogWaitsReleaseEverythingAndDropThePoolOffTheLaunchThread) {
  Rig rig;
  std::shared_ptr<Pool> pool = NewPool(HostAndEmulatedCxl());
  std::vector<char> value = Pattern(64 * kKiB, 30);
  const int32_t direct = Put(*pool, TierKind::kHost, value);
  const int32_t staged = Put(*pool, TierKind::kCxl, value);
  std::atomic<bool> closed_on_launch_thread{true};
  const std::thread::id launch = std::this_thread::get_id();
  pool->direct().OnClose(
      [&] { closed_on_launch_thread = std::this_thread::get_id() == launch; });
  std::vector<char> got_direct(value.size()), got_staged(value.size());
  GateClosed gate(*rig.state);  // no completion before the test lets go
  CHECK_OK(rig.transfers->Start(Fetch(pool, direct, got_direct)));
  CHECK_OK(rig.transfers->Start(Fetch(pool, staged, got_staged)));
  pool.reset();  // the transfers hold the last references
  CHECK_OK(rig.transfers->Done(nullptr, got_direct.data()));
  CHECK_OK(rig.transfers->Done(nullptr, got_staged.data()));
  CHECK_CODE(rig.transfers->Done(nullptr, got_staged.data()),
             Code::kNotFound);
  gate.Open();
  rig.transfers->Drain();
  CHECK(got_direct == value && got_staged == value);
  CHECK(!closed_on_launch_thread);
  {
    std::lock_guard<std::mutex> lock(rig.log_mu);
    CHECK_EQ(rig.waits.size(), size_t{2});
    for (const DeviceWait& wait : rig.waits) {
      CHECK_EQ(wait.record.bytes, uint64_t(value.size()));
      CHECK(wait.record.direction == Direction::kFromPool);
      CHECK(wait.record.ok);
      CHECK_GE(wait.record.finished_ns, wait.record.started_ns);
      CHECK_EQ(wait.wait_ns, int64_t{1000});
    }
    CHECK_EQ(rig.waits[0].record.tier, 0);
    CHECK_EQ(rig.waits[1].record.tier, 1);
  }
  {
    std::lock_guard<std::mutex> lock(rig.state->mu);
    CHECK_EQ(rig.state->live_events, int64_t{0});
  }
  rig.transfers.reset();
  CHECK_EQ(rig.state->live_host_buffers, int64_t{0});
}

TEST(AFailedStagedReadFailsItsDoneAndTheNextIsExact) {
  Rig rig;
  std::shared_ptr<Pool> pool = NewPool(HostAndEmulatedCxl());
  std::vector<char> value = Pattern(96 * kKiB, 40);
  const int32_t handle = Put(*pool, TierKind::kCxl, value);
  FaultSpec fail;
  fail.kind = FaultSpec::Kind::kFail;
  CHECK_OK(pool->test_hooks().InjectFault(fail));
  std::vector<char> got(value.size(), 0);
  CHECK_OK(rig.transfers->Start(Fetch(pool, handle, got)));
  Status done = rig.transfers->Done(nullptr, got.data());
  CHECK(!done.ok());
  CHECK(std::all_of(got.begin(), got.end(),
                    [](char c) { return c == char(0xff); }));  // NaNs
  std::vector<char> device = Pattern(96 * kKiB, 41);
  CHECK_OK(pool->test_hooks().InjectFault(fail));  // and a failed staged write
  CHECK_OK(rig.transfers->Start(Store(pool, handle, device)));
  CHECK(!rig.transfers->Done(nullptr, device.data()).ok());
  CHECK_OK(rig.transfers->Start(Fetch(pool, handle, got)));
  CHECK_OK(rig.transfers->Done(nullptr, got.data()));
  CHECK(got == value);  // the failed write stored nothing
  rig.transfers->Drain();
  CHECK_EQ(rig.transfers->counters().failed, uint64_t{2});
  // The profiler sees the failures as failed.
  std::lock_guard<std::mutex> lock(rig.log_mu);
  CHECK_EQ(rig.waits.size(), size_t{3});
  CHECK(!rig.waits[0].record.ok && !rig.waits[1].record.ok);
  CHECK(rig.waits[2].record.ok);
}

TEST(ADirectStartThatFailsPartWayIsWaitedForBeforeAnythingIsReused) {
  Rig rig;
  std::shared_ptr<Pool> pool = NewPool(HostAndEmulatedCxl());
  const std::vector<char> value = Pattern(3 * kMiB, 50);  // 3 or 4 pieces
  const std::vector<char> other = Pattern(3 * kMiB, 51);
  const int32_t handle = Put(*pool, TierKind::kHost, value);
  const int32_t next = Put(*pool, TierKind::kHost, other);
  std::vector<char> buffer(value.size());
  GateClosed gate(*rig.state);  // the queued first piece does not run yet
  {
    std::lock_guard<std::mutex> lock(rig.state->mu);
    rig.state->fail_copy_at = rig.state->copy_calls + 2;  // the 2nd piece
  }
  CHECK_CODE(rig.transfers->Start(Fetch(pool, handle, buffer)),
             Code::kInternal);
  // Its first piece may still read the object: it stays pinned.
  CHECK_CODE(pool->objects().Free(handle, 20'000'000), Code::kTimeout);
  // XLA reuses the buffer: the next fetch waits for that piece first.
  CHECK_OK(rig.transfers->Start(Fetch(pool, next, buffer)));
  CHECK_OK(rig.transfers->Done(nullptr, buffer.data()));
  CHECK(buffer == other);
  CHECK_EQ(rig.transfers->counters().stale_waits, uint64_t{1});
  gate.Open();
  rig.transfers->Drain();
  CHECK_OK(pool->objects().Free(handle, kLongWaitNs));
  CHECK_EQ(rig.transfers->counters().failed, uint64_t{1});
}

// A pool holding one host-tier object (direct transfers).
struct OneHostObject {
  OneHostObject(uint64_t bytes, uint64_t seed)
      : value(Pattern(bytes, seed)),
        handle(Put(*pool, TierKind::kHost, value)) {}
  std::shared_ptr<Pool> pool = NewPool(HostAndEmulatedCxl());
  const std::vector<char> value;
  const int32_t handle;
};

TEST(CloseKeepsALateDirectCopysChunksLockedUntilItEnds) {
  Rig rig;
  OneHostObject object(256 * kKiB, 60);
  auto& [pool, value, handle] = object;
  std::vector<char> got(value.size());
  GateClosed gate(*rig.state);
  // A failed step's fetch, never done, still copying past Close's timeout.
  CHECK_OK(rig.transfers->Start(Fetch(pool, handle, got)));
  CHECK_CODE(pool->Close(10'000'000), Code::kTimeout);
  CHECK_EQ(rig.locker->unlock_calls(), size_t{0});
  gate.Open();
  rig.transfers->Drain();  // the copy ran, then EndDirect unlocked
  CHECK(got == value);
  CHECK_EQ(rig.locker->unlock_calls(), rig.locker->lock_calls());
  CHECK_EQ(pool->direct().page_locks().stats().locked_chunks, uint64_t{0});
}

TEST(ALogThatWaitsHoldsBackNoRelease) {
  Rig rig;
  std::shared_ptr<Pool> pool = NewPool(HostAndEmulatedCxl());
  const std::vector<char> value = Pattern(64 * kKiB, 70);
  const int32_t handle = Put(*pool, TierKind::kCxl, value);  // staged
  // Every done's log waits for its compute-side event; the releases must
  // not queue behind it.
  GateClosed logs(*rig.state, /*compute_only=*/true);
  for (int i = 0; i < 2; ++i) {
    std::vector<char> got(value.size());
    CHECK_OK(rig.transfers->Start(Fetch(pool, handle, got)));
    CHECK_OK(rig.transfers->Done(nullptr, got.data()));
    CHECK(got == value);
  }
  const int64_t deadline = NowNs() + kLongWaitNs;
  while (rig.transfers->bounce_stats().in_use_bytes > 0 &&
         NowNs() < deadline) {
    std::this_thread::yield();
  }
  CHECK_EQ(rig.transfers->bounce_stats().in_use_bytes, uint64_t{0});
  {
    std::lock_guard<std::mutex> lock(rig.log_mu);
    CHECK_EQ(rig.waits.size(), size_t{0});  // still waiting
  }
  logs.Open();
  rig.transfers->Drain();
  std::lock_guard<std::mutex> lock(rig.log_mu);
  CHECK_EQ(rig.waits.size(), size_t{2});
}

TEST(TransferTimesAreTheDevicesNotTheReapers) {
  Rig rig;
  OneHostObject object(64 * kKiB, 80);
  auto& [pool, value, handle] = object;
  std::vector<char> got(value.size());
  GateClosed gate(*rig.state);  // the completion reaps it only later
  CHECK_OK(rig.transfers->Start(Fetch(pool, handle, got)));
  CHECK_OK(rig.transfers->Done(nullptr, got.data()));  // the copy runs
  const int64_t copied_by = NowNs();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  gate.Open();
  rig.transfers->Drain();
  std::lock_guard<std::mutex> lock(rig.log_mu);
  CHECK_EQ(rig.waits.size(), size_t{1});
  const TransferRecord& record = rig.waits[0].record;
  CHECK_LE(record.finished_ns, copied_by);
  CHECK_GE(record.started_ns, record.queued_ns);
  CHECK_LE(record.started_ns, record.finished_ns);
  CHECK_LE(rig.waits[0].wait_started_ns, copied_by);
}

TEST(IndexSlotsAreAllocatedAheadNeverOnTheLaunchThread) {
  Rig rig;  // its setup allocates the first slots, once
  const std::thread::id launch = std::this_thread::get_id();
  const size_t at_setup = rig.state->AllocationsOn(launch);
  std::shared_ptr<Pool> pool = NewPool(HostAndEmulatedCxl());
  constexpr int kLayers = 4;
  constexpr uint64_t kLayer = 16 * kKiB;
  const std::vector<char> stacked = Pattern(kLayers * kLayer, 90);
  const int32_t handle = Put(*pool, TierKind::kHost, stacked);
  const size_t before = rig.state->AllocationsOn(launch);  // Put's own
  constexpr int kInFlight = 8;
  for (int round = 0; round < 40; ++round) {
    std::vector<std::vector<char>> got(kInFlight, std::vector<char>(kLayer));
    std::vector<int32_t> operands(kInFlight);
    for (int i = 0; i < kInFlight; ++i) {
      operands[i] = (round + i) % kLayers;
      DeviceRequest r = Fetch(pool, handle, got[i]);
      r.index_on_device = &operands[i];
      r.offset_of = [](int64_t at) -> StatusOr<uint64_t> {
        return static_cast<uint64_t>(at) * kLayer;
      };
      CHECK_OK(rig.transfers->Start(std::move(r)));
    }
    for (int i = 0; i < kInFlight; ++i) {
      CHECK_OK(rig.transfers->Done(nullptr, got[i].data()));
      CHECK(std::equal(got[i].begin(), got[i].end(),
                       stacked.begin() + operands[i] * kLayer));
    }
  }
  rig.transfers->Drain();
  CHECK_GT(at_setup, size_t{0});
  CHECK_EQ(rig.state->AllocationsOn(launch), before);
}

TEST(ChunksLockedBySomeoneElseAreUsedButNeverUnlocked) {
  std::vector<char> region(4 * kMiB);
  char* base = region.data();
  auto locker = std::make_shared<FakeLocker>();
  locker->borrowed.insert(base + kMiB);  // another library registered it
  PageLocks locks;
  CHECK(locks.Install(locker, kChunk));
  CHECK_OK(locks.Ensure(base, region.size(), base + kMiB / 2, 2 * kMiB));
  PageLockStats stats = locks.stats();
  CHECK_EQ(stats.locked_chunks, uint64_t{3});
  CHECK_EQ(stats.borrowed_chunks, uint64_t{1});
  // Locked all the same: its freed pages stay.
  uint64_t released = 0;
  locks.ReleaseUnlocked(base + kMiB, kMiB,
                        [&](char*, uint64_t bytes) { released += bytes; });
  CHECK_EQ(released, uint64_t{0});
  locks.UnlockAll();
  CHECK_EQ(locker->unlocks.size(), size_t{2});
  for (const LockedPiece& unlocked : locker->unlocks) {
    CHECK(unlocked.address != base + kMiB);
  }
}

TEST(HostBufferCacheKeepsAStepsWorkingSet) {
  int64_t live = 0;
  HostBufferCache cache(
      [&](uint64_t bytes) -> StatusOr<void*> {
        ++live;
        return std::malloc(bytes);
      },
      [&](void* p) {
        --live;
        std::free(p);
      },
      /*idle_cap_bytes=*/1 * kMiB);
  CHECK_EQ(HostBufferCache::SizeClass(1), uint64_t{64});
  CHECK_EQ(HostBufferCache::SizeClass(3 * kMiB), uint64_t{4 * kMiB});
  CHECK_EQ(HostBufferCache::SizeClass(600 * kMiB), uint64_t{640 * kMiB});
  // A working set of four 4 MiB buffers (16 MiB, over the idle cap) is
  // kept across steps: the second step allocates nothing.
  for (int step = 0; step < 2; ++step) {
    std::vector<HostBufferCache::Buffer> held;
    for (int i = 0; i < 4; ++i) {
      StatusOr<HostBufferCache::Buffer> buffer = cache.Acquire(3 * kMiB);
      CHECK_OK(buffer);
      held.push_back(*buffer);
    }
    for (auto& buffer : held) cache.Release(buffer);
    cache.Trim();
  }
  HostBufferCache::Stats stats = cache.stats();
  CHECK_EQ(stats.allocations, uint64_t{4});
  CHECK_EQ(stats.reuses, uint64_t{4});
  CHECK_EQ(stats.frees, uint64_t{0});
  CHECK_EQ(live, int64_t{4});
}

}  // namespace
}  // namespace jcxl

JCXL_TEST_MAIN()
