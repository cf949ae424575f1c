// Tests of the pool: tiers, handles and their generations, spilling, compaction
// with live objects, waiting for transfers, closing, NUMA placement, and
// several threads at once (run under ThreadSanitizer too).
#include "pool.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "pool_fixtures.h"
#include "test_util.h"

namespace jcxl {
namespace {


PoolConfig ThreeTiers(const std::string& nvme_dir, uint64_t host = 8 * kMiB,
                      uint64_t cxl = 8 * kMiB, uint64_t nvme = 32 * kMiB) {
  PoolConfig config;
  config.tiers[0].capacity = host;
  config.tiers[0].nodes = {0};  // this machine's only node: binding is real
  config.tiers[1].capacity = cxl;
  config.tiers[1].emulated = true;
  config.tiers[2].capacity = nvme;
  config.nvme_dir = nvme_dir;
  config.copy_threads = 2;
  config.chunk_bytes = 256 * kKiB;
  return config;
}

int32_t Alloc(Pool& pool, TierKind tier, uint64_t bytes) {
  StatusOr<int32_t> handle =
      pool.objects().Allocate(tier, bytes, {int64_t(bytes)}, "u8");
  CHECK_OK(handle);
  CHECK_GT(*handle, 0);
  return *handle;
}

Status WriteNow(Pool& pool, int32_t handle, const std::vector<char>& data,
                uint64_t offset = 0) {
  StatusOr<std::shared_ptr<Ticket>> ticket =
      pool.transfers().Write(handle, data.data(), data.size(), offset, 0, 0);
  if (!ticket.ok()) return ticket.status();
  return (*ticket)->Wait(kLongWaitNs);
}

StatusOr<std::vector<char>> ReadNow(Pool& pool, int32_t handle, uint64_t bytes,
                                    uint64_t offset = 0) {
  std::vector<char> out(bytes);
  StatusOr<std::shared_ptr<Ticket>> ticket =
      pool.transfers().Read(handle, out.data(), bytes, offset, 0, 0);
  if (!ticket.ok()) return ticket.status();
  Status status = (*ticket)->Wait(kLongWaitNs);
  if (!status.ok()) return status;
  return out;
}

TEST(CreateWithThreeTiers) {
  TempDir dir;
  PoolConfig config = ThreeTiers(dir.path());
  std::shared_ptr<Pool> pool = NewPool(config);
  CHECK(pool->id() > 0);
  CHECK(Pool::Find(pool->id()) == pool);
  CHECK(Exists(dir.path() + "/tier.swap"));
  std::vector<TierStats> stats = pool->objects().Stats();
  CHECK_EQ(stats.size(), 3u);
  for (int t = 0; t < kNumTiers; ++t) {
    CHECK(stats[t].enabled);
    CHECK_EQ(stats[t].arenas.size(), 1u);
    CHECK_EQ(static_cast<int>(stats[t].kind), t);
    CHECK_EQ(stats[t].arenas[0].allocator.capacity,
             config.tiers[t].capacity);
  }
  CHECK_EQ(stats[0].arenas[0].node, 0);
  CHECK(!stats[0].emulated);
  CHECK(stats[1].emulated);
  CHECK_CONTAINS(stats[0].arenas[0].description, "nodes [0]");
  // Node 0 exists here, so the host tier's binding must have worked.
  CHECK(stats[0].arenas[0].description.find("binding failed") ==
        std::string::npos);
  CHECK_CONTAINS(stats[2].arenas[0].description, "tier.swap");
  const int32_t id = pool->id();
  pool.reset();
  CHECK(Pool::Find(id) == nullptr);
  CHECK(!Exists(dir.path()));  // the pool's private directory went with it
}

TEST(CreateRejectsBadConfigs) {
  PoolConfig no_dir;
  no_dir.tiers[2].capacity = 1 * kMiB;
  StatusOr<std::shared_ptr<Pool>> pool = Pool::Create(no_dir);
  CHECK_CODE(pool, Code::kInvalidArgument);
  CHECK_CONTAINS(pool.status().message(), "nvme_dir");
  PoolConfig bad_weights;
  bad_weights.tiers[0].capacity = 1 * kMiB;
  bad_weights.tiers[0].nodes = {0};
  bad_weights.tiers[0].weights = {0.0};
  pool = Pool::Create(bad_weights);
  CHECK_CODE(pool, Code::kInvalidArgument);
  CHECK_CONTAINS(pool.status().message(), "weights must be positive");
  PoolConfig host_only;
  host_only.tiers[0].capacity = 1 * kMiB;
  std::shared_ptr<Pool> ok = NewPool(host_only);
  StatusOr<int32_t> off =
      ok->objects().Allocate(TierKind::kCxl, 100, {100}, "u8");
  CHECK_CODE(off, Code::kInvalidArgument);
  CHECK_CONTAINS(off.status().message(), "cxl tier is off");
  CHECK_CODE(ok->objects().Allocate(TierKind::kHost, 0, {0}, "f32"),
             Code::kInvalidArgument);
}

TEST(WriteReadRoundTripsInEveryTier) {
  TempDir dir;
  std::shared_ptr<Pool> pool = NewPool(ThreeTiers(dir.path()));
  for (TierKind tier : {TierKind::kHost, TierKind::kCxl, TierKind::kNvme}) {
    // A slab object, a large extent object spanning several chunks, and odd
    // sizes that leave the nvme tier's blocks partly covered.
    for (uint64_t bytes : {uint64_t{100}, uint64_t{5000},
                           uint64_t{1 * kMiB + 333}}) {
      const int32_t handle = Alloc(*pool, tier, bytes);
      StatusOr<ObjectInfo> info = pool->objects().Info(handle);
      CHECK_OK(info);
      CHECK(info->tier == tier);
      CHECK_EQ(info->bytes, bytes);
      CHECK_EQ(info->dtype, std::string("u8"));
      CHECK(info->shape == std::vector<int64_t>{int64_t(bytes)});
      CHECK_EQ(info->slab, tier != TierKind::kNvme && bytes <= 64 * kKiB);
      const std::vector<char> data = Pattern(bytes, bytes + int(tier));
      CHECK_OK(WriteNow(*pool, handle, data));
      StatusOr<std::vector<char>> back = ReadNow(*pool, handle, bytes);
      CHECK_OK(back);
      CHECK(*back == data);
      // A slice at an unaligned offset, then the whole object again.
      const uint64_t offset = bytes / 3 + 1;
      const std::vector<char> slice = Pattern(bytes / 3, 99);
      CHECK_OK(WriteNow(*pool, handle, slice, offset));
      StatusOr<std::vector<char>> part = ReadNow(*pool, handle, slice.size(),
                                                 offset);
      CHECK_OK(part);
      CHECK(*part == slice);
      std::vector<char> expected = data;
      std::memcpy(&expected[offset], slice.data(), slice.size());
      back = ReadNow(*pool, handle, bytes);
      CHECK_OK(back);
      CHECK(*back == expected);
    }
  }
  const std::vector<TierStats> stats = pool->objects().Stats();
  for (const TierStats& tier : stats) {
    CHECK_GT(tier.bytes_written, 0u);
    CHECK_GT(tier.bytes_read, 0u);
  }
  const std::vector<TransferRecord> records = pool->transfers().DrainRecords();
  CHECK_EQ(records.size(), 3u * 3u * 5u);
  for (const TransferRecord& record : records) {
    CHECK(record.ok);
    CHECK_LE(record.queued_ns, record.started_ns);
    CHECK_LE(record.started_ns, record.finished_ns);
  }
}

TEST(OutOfRangeAccessIsRejected) {
  PoolConfig config;
  config.tiers[0].capacity = 1 * kMiB;
  std::shared_ptr<Pool> pool = NewPool(config);
  const int32_t handle = Alloc(*pool, TierKind::kHost, 1000);
  std::vector<char> buffer(2000);
  CHECK_CODE(pool->transfers().Write(handle, buffer.data(), 1001, 0, 0, 0),
             Code::kInvalidArgument);
  CHECK_CODE(pool->transfers().Read(handle, buffer.data(), 10, 995, 0, 0),
             Code::kInvalidArgument);
  CHECK_CODE(pool->transfers().Read(handle, buffer.data(), 1, UINT64_MAX, 0, 0),
             Code::kInvalidArgument);
  CHECK_CODE(pool->transfers().Read(handle, nullptr, 10, 0, 0, 0),
             Code::kInvalidArgument);
  StatusOr<std::shared_ptr<Ticket>> empty =
      pool->transfers().Read(handle, nullptr, 0, 0, 0, 0);
  CHECK_OK(empty);
  CHECK_OK((*empty)->Wait(kLongWaitNs));
}

TEST(UnknownAndFreedHandlesAreNotFound) {
  PoolConfig config;
  config.tiers[0].capacity = 1 * kMiB;
  std::shared_ptr<Pool> pool = NewPool(config);
  std::vector<char> buffer(16);
  for (int32_t bad : {0, -1, 12345, INT32_MAX}) {
    CHECK_CODE(pool->objects().Info(bad), Code::kNotFound);
    CHECK_CODE(pool->objects().Free(bad, kLongWaitNs), Code::kNotFound);
    CHECK_CODE(pool->transfers().Read(bad, buffer.data(), 16, 0, 0, 0),
               Code::kNotFound);
  }
  const int32_t handle = Alloc(*pool, TierKind::kHost, 16);
  CHECK_OK(pool->objects().Free(handle, kLongWaitNs));
  StatusOr<ObjectInfo> info = pool->objects().Info(handle);
  CHECK_CODE(info, Code::kNotFound);
  CHECK_CONTAINS(info.status().message(), std::to_string(handle));
  CHECK_CODE(pool->objects().Free(handle, kLongWaitNs), Code::kNotFound);
  CHECK_CODE(pool->transfers().Write(handle, buffer.data(), 16, 0, 0, 0),
             Code::kNotFound);
  CHECK_CODE(pool->objects().PageNodes(handle), Code::kNotFound);
  CHECK(pool->objects().Handles().empty());
}

TEST(StaleHandleAfterSlotReuseIsRejected) {
  PoolConfig config;
  config.tiers[0].capacity = 1 * kMiB;
  std::shared_ptr<Pool> pool = NewPool(config);
  constexpr int32_t kIndexMask = (1 << 22) - 1;
  const int32_t first = Alloc(*pool, TierKind::kHost, 64);
  CHECK_OK(pool->objects().Free(first, kLongWaitNs));
  // Freed indices are reused oldest first, across every pool of the
  // process: allocate and free until `first`'s index comes round again.
  int32_t second = Alloc(*pool, TierKind::kHost, 64);
  for (int i = 0; i < 100000 && (second & kIndexMask) != (first & kIndexMask);
       ++i) {
    CHECK(second != first);
    CHECK_OK(pool->objects().Free(second, kLongWaitNs));
    second = Alloc(*pool, TierKind::kHost, 64);
  }
  CHECK(second != first);
  // Same slot, next generation.
  CHECK_EQ(second & kIndexMask, first & kIndexMask);
  CHECK_CODE(pool->objects().Info(first), Code::kNotFound);
  CHECK_CODE(pool->objects().Free(first, kLongWaitNs), Code::kNotFound);
  const std::vector<char> data = Pattern(64, 1);
  CHECK_CODE(WriteNow(*pool, first, data), Code::kNotFound);
  CHECK_OK(WriteNow(*pool, second, data));
  CHECK_OK(pool->objects().Info(second));
  CHECK(pool->objects().Handles() == std::vector<int32_t>{second});
  // Past its last generation (9 bits) a slot is retired, never wrapped
  // round: no handle is ever given out twice, none is <= 0, and every stale
  // one stays rejected.
  std::vector<int32_t> seen = {first, second};
  int32_t handle = second;
  for (int i = 0; i < 1100; ++i) {
    CHECK_OK(pool->objects().Free(handle, kLongWaitNs));
    const int32_t next = Alloc(*pool, TierKind::kHost, 64);
    CHECK_GT(next, 0);
    CHECK(std::find(seen.begin(), seen.end(), next) == seen.end());
    CHECK_CODE(pool->objects().Info(handle), Code::kNotFound);
    CHECK_CODE(pool->objects().Info(first), Code::kNotFound);
    seen.push_back(next);
    handle = next;
  }
  CHECK_OK(pool->objects().Info(handle));
}

// A handle names one object of one pool: every other pool rejects it, open
// or closed, whatever objects it holds, and its own objects stay intact.
TEST(ForeignHandlesAreRejected) {
  TempDir dir_a, dir_b;
  std::shared_ptr<Pool> a = NewPool(ThreeTiers(dir_a.path()));
  std::shared_ptr<Pool> b = NewPool(ThreeTiers(dir_b.path()));
  std::vector<int32_t> handles_a, handles_b;
  std::vector<std::vector<char>> data_b;
  for (int i = 0; i < 30; ++i) {
    const TierKind tier = static_cast<TierKind>(i % 3);
    const uint64_t bytes = i % 2 ? 100 + i : 70 * kKiB + i;
    handles_a.push_back(Alloc(*a, tier, bytes));
    handles_b.push_back(Alloc(*b, tier, bytes));
    data_b.push_back(Pattern(bytes, i));
    CHECK_OK(WriteNow(*b, handles_b.back(), data_b.back()));
  }
  std::vector<char> buffer(64, 7);
  auto rejected_by_b = [&](int32_t foreign) {
    CHECK_CODE(b->objects().Info(foreign), Code::kNotFound);
    CHECK_CODE(b->transfers().Read(foreign, buffer.data(), 16, 0, 0, 0),
               Code::kNotFound);
    CHECK_CODE(b->transfers().Write(foreign, buffer.data(), 16, 0, 0, 0),
               Code::kNotFound);
    CHECK_CODE(b->objects().PageNodes(foreign), Code::kNotFound);
    CHECK_CODE(b->objects().Free(foreign, kLongWaitNs), Code::kNotFound);
  };
  for (int32_t h : handles_a) {
    rejected_by_b(h);
    CHECK_OK(a->objects().Info(h));
  }
  for (int32_t h : handles_b) CHECK_CODE(a->objects().Info(h), Code::kNotFound);
  const Status message = b->objects().Info(handles_a[0]).status();
  CHECK_CONTAINS(message.message(), "another pool's");
  // Freed in A, or A closed: still nothing B answers to.
  CHECK_OK(a->objects().Free(handles_a[0], kLongWaitNs));
  rejected_by_b(handles_a[0]);
  CHECK_OK(a->Close(kLongWaitNs));
  for (int32_t h : handles_a) rejected_by_b(h);
  // B's objects never changed.
  for (size_t i = 0; i < handles_b.size(); ++i) {
    StatusOr<std::vector<char>> back =
        ReadNow(*b, handles_b[i], data_b[i].size());
    CHECK_OK(back);
    CHECK(*back == data_b[i]);
  }
}

TEST(FullTierIsExhaustedWithTierName) {
  TempDir dir;
  PoolConfig config = ThreeTiers(dir.path(), 1 * kMiB, 1 * kMiB, 1 * kMiB);
  std::shared_ptr<Pool> pool = NewPool(config);
  Alloc(*pool, TierKind::kCxl, 768 * kKiB);
  StatusOr<int32_t> full =
      pool->objects().Allocate(TierKind::kCxl, 512 * kKiB, {128, 1024}, "f32");
  CHECK_CODE(full, Code::kExhausted);
  const std::string& message = full.status().message();
  CHECK_CONTAINS(message, "cxl tier is full");
  CHECK_CONTAINS(message, "512.00 KiB");
  CHECK_CONTAINS(message, "(128, 1024)");
  CHECK_CONTAINS(message, "f32");
  CHECK_CONTAINS(message, "spill=True");
  // Without spilling, the tiers below are not used.
  CHECK_EQ(pool->objects().Stats()[2].arenas[0].allocator.extent_objects, 0u);
}

TEST(SpillGoesHostThenCxlThenNvme) {
  TempDir dir;
  PoolConfig config = ThreeTiers(dir.path(), 1 * kMiB, 1 * kMiB, 2 * kMiB);
  config.spill = true;
  std::shared_ptr<Pool> pool = NewPool(config);
  std::vector<int32_t> handles;
  std::vector<TierKind> expected = {TierKind::kHost, TierKind::kCxl,
                                    TierKind::kNvme, TierKind::kNvme};
  for (size_t i = 0; i < expected.size(); ++i) {
    handles.push_back(Alloc(*pool, TierKind::kHost, 768 * kKiB));
    StatusOr<ObjectInfo> info = pool->objects().Info(handles.back());
    CHECK_OK(info);
    CHECK(info->tier == expected[i]);
    CHECK_OK(WriteNow(*pool, handles.back(), Pattern(768 * kKiB, i)));
  }
  // Everything full: the message names every tier it tried.
  StatusOr<int32_t> none =
      pool->objects().Allocate(TierKind::kHost, 768 * kKiB, {}, "");
  CHECK_CODE(none, Code::kExhausted);
  CHECK_CONTAINS(none.status().message(), "host:");
  CHECK_CONTAINS(none.status().message(), "cxl:");
  CHECK_CONTAINS(none.status().message(), "nvme:");
  // A cxl request never spills up into host.
  CHECK_OK(pool->objects().Free(handles[0], kLongWaitNs));
  CHECK_CODE(pool->objects().Allocate(TierKind::kCxl, 768 * kKiB, {}, ""),
             Code::kExhausted);
  for (size_t i = 1; i < handles.size(); ++i) {
    StatusOr<std::vector<char>> back = ReadNow(*pool, handles[i], 768 * kKiB);
    CHECK_OK(back);
    CHECK(*back == Pattern(768 * kKiB, i));
  }
}

// No extent is large enough, but the free bytes are: Allocate compacts the
// tier and succeeds, the other objects keep their bytes; past the free
// bytes it says that compacting cannot help.
TEST(FragmentedTierCompactsBeforeRefusing) {
  TempDir dir;
  CHECK(dir.ok());
  auto pool = NewPool(ThreeTiers(dir.path(), 8 * kMiB, 8 * kMiB, 8 * kMiB));
  std::vector<int32_t> handles;
  for (int i = 0; i < 32; ++i) {
    handles.push_back(Alloc(*pool, TierKind::kNvme, 256 * kKiB));
    CHECK_OK(WriteNow(*pool, handles.back(), Pattern(256 * kKiB, i)));
  }
  for (int i = 0; i < 32; i += 2)
    CHECK_OK(pool->objects().Free(handles[i], kLongWaitNs));
  StatusOr<int32_t> big =
      pool->objects().Allocate(TierKind::kNvme, 4 * kMiB, {}, "", kLongWaitNs);
  CHECK_OK(big);
  for (int i = 1; i < 32; i += 2) {
    StatusOr<std::vector<char>> back = ReadNow(*pool, handles[i], 256 * kKiB);
    CHECK_OK(back);
    CHECK(*back == Pattern(256 * kKiB, i));
  }
  StatusOr<int32_t> none = pool->objects().Allocate(TierKind::kNvme, 512 * kKiB,
                                                    {}, "", kLongWaitNs);
  CHECK_CODE(none, Code::kExhausted);
  CHECK(none.status().message().find("compacting cannot help") !=
        std::string::npos);
}

TEST(CompactKeepsDataAndHandles) {
  TempDir dir;
  std::shared_ptr<Pool> pool = NewPool(ThreeTiers(dir.path()));
  std::mt19937_64 rng(11);
  std::map<int32_t, std::vector<char>> live;
  std::vector<int32_t> order;
  for (TierKind tier : {TierKind::kHost, TierKind::kCxl, TierKind::kNvme}) {
    for (int i = 0; i < 40; ++i) {
      const uint64_t bytes =
          rng() % 2 ? 1 + rng() % 2000 : 64 * kKiB + rng() % (200 * kKiB);
      const int32_t handle = Alloc(*pool, tier, bytes);
      live[handle] = Pattern(bytes, handle);
      CHECK_OK(WriteNow(*pool, handle, live[handle]));
      order.push_back(handle);
    }
  }
  // Free every other object: holes everywhere, and emptied slab spans.
  std::map<int32_t, uint64_t> offsets_before;
  for (size_t i = 0; i < order.size(); ++i) {
    if (i % 2 == 0) {
      CHECK_OK(pool->objects().Free(order[i], kLongWaitNs));
      live.erase(order[i]);
    }
  }
  for (const auto& [handle, data] : live) {
    offsets_before[handle] = pool->objects().Info(handle)->offset;
  }
  uint64_t holes = 0;
  for (const TierStats& tier : pool->objects().Stats()) {
    holes += tier.arenas[0].allocator.hole_bytes;
  }
  CHECK_GT(holes, 0u);
  CHECK_OK(pool->objects().Compact(kLongWaitNs));
  int moved = 0;
  for (const TierStats& tier : pool->objects().Stats()) {
    CHECK_EQ(tier.arenas[0].allocator.hole_bytes, 0u);
  }
  for (const auto& [handle, data] : live) {
    StatusOr<ObjectInfo> info = pool->objects().Info(handle);
    CHECK_OK(info);
    CHECK_LE(info->offset, offsets_before[handle]);
    if (info->offset < offsets_before[handle]) ++moved;
    StatusOr<std::vector<char>> back = ReadNow(*pool, handle, data.size());
    CHECK_OK(back);
    CHECK(*back == data);
  }
  CHECK_GT(moved, 0);
  // Handles stay usable for writes and frees after the move.
  for (const auto& [handle, data] : live) {
    const std::vector<char> again = Pattern(data.size(), handle + 7);
    CHECK_OK(WriteNow(*pool, handle, again));
    StatusOr<std::vector<char>> back = ReadNow(*pool, handle, again.size());
    CHECK_OK(back);
    CHECK(*back == again);
    CHECK_OK(pool->objects().Free(handle, kLongWaitNs));
  }
  for (const TierStats& tier : pool->objects().Stats()) {
    CHECK_EQ(tier.arenas[0].allocator.reserved, 0u);
  }
}

TEST(FreeWaitsForTransfersInFlight) {
  PoolConfig config;
  config.tiers[1].capacity = 16 * kMiB;
  config.tiers[1].emulated = true;
  config.tiers[1].link_bytes_per_second = 100e6;  // 4 MiB: about 42 ms
  config.chunk_bytes = 512 * kKiB;
  std::shared_ptr<Pool> pool = NewPool(config);
  const int32_t handle = Alloc(*pool, TierKind::kCxl, 4 * kMiB);
  const std::vector<char> data = Pattern(4 * kMiB, 5);
  // The write is held by an injected stall, so the short wait below times
  // out however slowly this thread is scheduled.
  FaultSpec stall;
  stall.kind = FaultSpec::Kind::kStall;
  stall.direction = static_cast<int>(Direction::kToPool);
  CHECK_OK(pool->test_hooks().InjectFault(stall));
  StatusOr<std::shared_ptr<Ticket>> ticket =
      pool->transfers().Write(handle, data.data(), data.size(), 0, 0, 0);
  CHECK_OK(ticket);
  // Too short a wait: the object stays.
  const Status early = pool->objects().Free(handle, 1 * kMs);
  CHECK_CODE(early, Code::kTimeout);
  CHECK_CONTAINS(early.message(), "cannot free handle");
  CHECK_OK(pool->objects().Info(handle));
  CHECK_OK(pool->test_hooks().InjectFault(
      FaultSpec{}));  // releases the stalled write
  // A long one returns only after the transfer's last chunk (the ticket
  // itself may wake its waiters a moment later).
  CHECK_OK(pool->objects().Free(handle, kLongWaitNs));
  const int64_t freed_at = NowNs();
  CHECK_CODE(pool->objects().Info(handle), Code::kNotFound);
  CHECK_OK((*ticket)->Wait(kLongWaitNs));
  const TransferRecord record = (*ticket)->record();
  CHECK_LE(record.finished_ns, freed_at);
  // The link model holds for pool transfers too.
  CHECK_GE(record.finished_ns - record.queued_ns,
           static_cast<int64_t>(4 * kMiB / 100e6 * 1e9));
  CHECK_EQ(pool->objects().Stats()[1].link_bytes_per_second, 100e6);
}

TEST(FreeWhileOtherThreadsAllocate) {
  // Free waits with the pool's lock released; objects allocated meanwhile
  // may grow the object table under it.
  PoolConfig config;
  config.tiers[1].capacity = 64 * kMiB;
  config.tiers[1].link_bytes_per_second = 200e6;
  config.chunk_bytes = 256 * kKiB;
  std::shared_ptr<Pool> pool = NewPool(config);
  for (int round = 0; round < 3; ++round) {
    const int32_t handle = Alloc(*pool, TierKind::kCxl, 2 * kMiB);
    const std::vector<char> data = Pattern(2 * kMiB, round);
    StatusOr<std::shared_ptr<Ticket>> ticket =
        pool->transfers().Write(handle, data.data(), data.size(), 0, 0, 0);
    CHECK_OK(ticket);
    std::atomic<bool> freed{false};
    std::vector<int32_t> extra;
    std::thread allocator([&] {
      while (!freed.load()) {
        StatusOr<int32_t> h =
            pool->objects().Allocate(TierKind::kCxl, 16, {}, "");
        if (h.ok()) extra.push_back(*h);
        if (extra.size() > 3000) break;
      }
    });
    const Status status = pool->objects().Free(handle, kLongWaitNs);
    const int64_t freed_at = NowNs();
    freed = true;
    allocator.join();
    CHECK_OK(status);
    CHECK_OK((*ticket)->Wait(kLongWaitNs));
    CHECK_LE((*ticket)->record().finished_ns, freed_at);
    for (int32_t h : extra) CHECK_OK(pool->objects().Free(h, kLongWaitNs));
  }
}

TEST(CloseTwiceAndRequestsAfterCloseAreClosed) {
  TempDir dir;
  std::shared_ptr<Pool> pool = NewPool(ThreeTiers(dir.path()));
  const int32_t handle = Alloc(*pool, TierKind::kNvme, 10000);
  CHECK_OK(WriteNow(*pool, handle, Pattern(10000, 1)));
  CHECK(!pool->closed());
  CHECK_OK(pool->Close(kLongWaitNs));
  CHECK(pool->closed());
  CHECK(!Exists(dir.path()));  // nvme file and directory removed
  const Status again = pool->Close(kLongWaitNs);
  CHECK_CODE(again, Code::kClosed);
  CHECK_CONTAINS(again.message(), "already closed");
  std::vector<char> buffer(16);
  CHECK_CODE(pool->objects().Allocate(TierKind::kHost, 16, {}, ""),
             Code::kClosed);
  CHECK_CODE(pool->transfers().Write(handle, buffer.data(), 16, 0, 0, 0),
             Code::kClosed);
  CHECK_CODE(pool->transfers().Read(handle, buffer.data(), 16, 0, 0, 0),
             Code::kClosed);
  CHECK_CODE(pool->objects().Free(handle, kLongWaitNs), Code::kClosed);
  CHECK_CODE(pool->objects().Info(handle), Code::kClosed);
  CHECK_CODE(pool->objects().PageNodes(handle), Code::kClosed);
  CHECK_CODE(pool->objects().Compact(kLongWaitNs), Code::kClosed);
  CHECK(pool->objects().Handles().empty());
  CHECK(pool->transfers().DrainRecords().empty());
  pool->objects().Stats();  // still answers, with no arenas
}

// A transfer abandoned mid-copy (its ticket and buffer dropped) while the
// pool closes: Close fails it once its timeout passes, and the buffer the
// engine held is let go by the time Close returns, never before the copy
// stopped touching it.
TEST(CloseReleasesTheBuffersOfAbandonedTransfers) {
  TempDir dir;
  CHECK(dir.ok());
  auto pool = NewPool(ThreeTiers(dir.path()));
  const int32_t handle = Alloc(*pool, TierKind::kCxl, 2 * kMiB);
  CHECK_OK(WriteNow(*pool, handle, Pattern(2 * kMiB, 3)));
  FaultSpec stall;
  stall.kind = FaultSpec::Kind::kStall;
  stall.direction = static_cast<int>(Direction::kFromPool);
  CHECK_OK(pool->test_hooks().InjectFault(stall));
  auto buffer = std::make_shared<std::vector<char>>(2 * kMiB);
  std::weak_ptr<std::vector<char>> watch = buffer;
  {
    StatusOr<std::shared_ptr<Ticket>> ticket = pool->transfers().Read(
        handle, buffer->data(), buffer->size(), 0, 0, 0, buffer);
    CHECK_OK(ticket);
  }
  buffer.reset();
  CHECK(!watch.expired());
  CHECK_CODE(pool->Close(50 * kMs), Code::kTimeout);
  CHECK(watch.expired());
}

TEST(CloseWaitsForTransfersAndKeepsFilesWhenAsked) {
  TempDir dir;
  PoolConfig config = ThreeTiers(dir.path());
  config.keep_nvme_files = true;
  config.tiers[2].link_bytes_per_second = 100e6;
  std::shared_ptr<Pool> pool = NewPool(config);
  const int32_t handle = Alloc(*pool, TierKind::kNvme, 2 * kMiB);
  const std::vector<char> data = Pattern(2 * kMiB, 3);
  StatusOr<std::shared_ptr<Ticket>> ticket =
      pool->transfers().Write(handle, data.data(), data.size(), 0, 0, 0);
  CHECK_OK(ticket);
  CHECK_OK(pool->Close(kLongWaitNs));
  CHECK((*ticket)->done());
  CHECK_OK((*ticket)->Wait(0));
  CHECK(Exists(dir.path() + "/tier.swap"));
}

TEST(PageNodesOfATouchedObjectAreNodeZero) {
  TempDir dir;
  std::shared_ptr<Pool> pool = NewPool(ThreeTiers(dir.path()));
  const int32_t handle = Alloc(*pool, TierKind::kHost, 256 * kKiB);
  CHECK_OK(WriteNow(*pool, handle, Pattern(256 * kKiB, 1)));
  StatusOr<std::vector<int>> nodes = pool->objects().PageNodes(handle);
  CHECK_OK(nodes);
  CHECK_EQ(nodes->size(), 256 * kKiB / 4096);
  for (int node : *nodes) CHECK_EQ(node, 0);
  // A slab object in the same tier.
  const int32_t small = Alloc(*pool, TierKind::kHost, 100);
  CHECK_OK(WriteNow(*pool, small, Pattern(100, 2)));
  nodes = pool->objects().PageNodes(small);
  CHECK_OK(nodes);
  CHECK_GE(nodes->size(), 1u);
  for (int node : *nodes) CHECK_EQ(node, 0);
  const int32_t on_disk = Alloc(*pool, TierKind::kNvme, 100);
  StatusOr<std::vector<int>> none = pool->objects().PageNodes(on_disk);
  CHECK_CODE(none, Code::kInvalidArgument);
  CHECK_CONTAINS(none.status().message(), "nvme");
}

TEST(SetLinkChangesTheModel) {
  PoolConfig config;
  config.tiers[0].capacity = 4 * kMiB;
  std::shared_ptr<Pool> pool = NewPool(config);
  CHECK_EQ(pool->objects().Stats()[0].link_bytes_per_second, 0.0);
  CHECK_OK(pool->objects().SetLink(TierKind::kHost, 0, 25 * kMs));
  CHECK_EQ(pool->objects().Stats()[0].link_latency_ns, 25 * kMs);
  const int32_t handle = Alloc(*pool, TierKind::kHost, 100);
  const int64_t start = NowNs();
  CHECK_OK(WriteNow(*pool, handle, Pattern(100, 1)));
  CHECK_GE(NowNs() - start, 25 * kMs);
  CHECK_CODE(pool->objects().SetLink(TierKind::kNvme, 1e9, 0),
             Code::kInvalidArgument);
}

// Several threads allocate, write, read back, check and free, while another
// compacts and reads statistics. Under ThreadSanitizer this must be clean.
TEST(ConcurrentWritersAndReaders) {
  TempDir dir;
  PoolConfig config = ThreeTiers(dir.path(), 16 * kMiB, 16 * kMiB, 32 * kMiB);
  config.spill = true;
  config.copy_threads = 3;
  config.chunk_bytes = 64 * kKiB;
  std::shared_ptr<Pool> pool = NewPool(config);
  constexpr int kThreads = 4;
  constexpr int kRounds = 40;
  std::atomic<int> failures{0};
  std::atomic<bool> done{false};
  auto worker = [&](int who) {
    std::mt19937_64 rng(who);
    std::vector<std::pair<int32_t, std::vector<char>>> mine;
    for (int round = 0; round < kRounds; ++round) {
      const TierKind tier = static_cast<TierKind>(rng() % 3);
      const uint64_t bytes = rng() % 2 ? 1 + rng() % 4000
                                       : 64 * kKiB + rng() % (300 * kKiB);
      StatusOr<int32_t> handle =
          pool->objects().Allocate(tier, bytes, {}, "u8");
      if (!handle.ok()) {
        ++failures;
        continue;
      }
      std::vector<char> data = Pattern(bytes, who * 1000 + round);
      // Two halves written at once, in two tickets, at different priorities.
      const uint64_t half = bytes / 2;
      auto first = pool->transfers().Write(*handle, data.data(), half, 0, 1, 0);
      auto second = pool->transfers().Write(*handle, data.data() + half,
                                            bytes - half, half, 0, 16 * kKiB);
      if (!first.ok() || !second.ok() ||
          !(*first)->Wait(kLongWaitNs).ok() ||
          !(*second)->Wait(kLongWaitNs).ok()) {
        ++failures;
        continue;
      }
      mine.emplace_back(*handle, std::move(data));
      // Read back a random earlier object; free one now and then.
      auto& [h, expected] = mine[rng() % mine.size()];
      StatusOr<std::vector<char>> back = ReadNow(*pool, h, expected.size());
      if (!back.ok() || *back != expected) ++failures;
      if (mine.size() > 4) {
        const size_t victim = rng() % mine.size();
        if (!pool->objects().Free(mine[victim].first, kLongWaitNs).ok())
          ++failures;
        mine.erase(mine.begin() + victim);
      }
    }
    for (auto& [h, expected] : mine) {
      StatusOr<std::vector<char>> back = ReadNow(*pool, h, expected.size());
      if (!back.ok() || *back != expected) ++failures;
      if (!pool->objects().Free(h, kLongWaitNs).ok()) ++failures;
    }
  };
  std::thread housekeeper([&] {
    int compactions = 0;
    while (!done.load()) {
      if (!pool->objects().Compact(kLongWaitNs).ok()) ++failures;
      ++compactions;
      pool->objects().Stats();
      pool->transfers().DrainRecords();
      pool->objects().Handles();
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (compactions == 0) ++failures;
  });
  std::vector<std::thread> workers;
  for (int i = 0; i < kThreads; ++i) workers.emplace_back(worker, i);
  for (std::thread& t : workers) t.join();
  done = true;
  housekeeper.join();
  CHECK_EQ(failures.load(), 0);
  CHECK(pool->objects().Handles().empty());
  for (const TierStats& tier : pool->objects().Stats()) {
    CHECK_EQ(tier.arenas[0].allocator.live, 0u);
  }
  CHECK_OK(pool->Close(kLongWaitNs));
}

// Transfers that fail or never finish: every waiter gets an error naming
// the object within its timeout, the pool closes in bounded time, and the
// objects no fault touched keep their bytes.
TEST(InjectedFaultsAreBoundedAndLeaveOtherObjectsIntact) {
  TempDir dir;
  std::shared_ptr<Pool> pool = NewPool(ThreeTiers(dir.path()));
  std::vector<std::pair<int32_t, std::vector<char>>> stored;
  for (int i = 0; i < 6; ++i) {
    const uint64_t bytes = 50 * kKiB + 1000 * i;
    const int32_t h = Alloc(*pool, static_cast<TierKind>(i % 3), bytes);
    stored.emplace_back(h, Pattern(bytes, 100 + i));
    CHECK_OK(WriteNow(*pool, h, stored.back().second));
  }
  auto intact = [&] {
    for (auto& [h, data] : stored) {
      StatusOr<std::vector<char>> back = ReadNow(*pool, h, data.size());
      CHECK_OK(back);
      CHECK(*back == data);
    }
  };
  FaultSpec fail;
  fail.kind = FaultSpec::Kind::kFail;
  fail.tier = static_cast<int>(TierKind::kNvme);
  fail.direction = static_cast<int>(Direction::kFromPool);
  CHECK_OK(pool->test_hooks().InjectFault(fail));
  const int32_t on_disk = stored[2].first;
  StatusOr<std::vector<char>> failed =
      ReadNow(*pool, on_disk, stored[2].second.size());
  CHECK_CODE(failed, Code::kIo);
  CHECK_CONTAINS(failed.status().message(),
                 "handle " + std::to_string(on_disk) + " (nvme tier");
  intact();

  FaultSpec stall;
  stall.kind = FaultSpec::Kind::kStall;
  stall.tier = static_cast<int>(TierKind::kCxl);
  CHECK_OK(pool->test_hooks().InjectFault(stall));
  const int32_t victim = Alloc(*pool, TierKind::kCxl, 4096);
  const std::vector<char> data = Pattern(4096, 9);
  StatusOr<std::shared_ptr<Ticket>> ticket =
      pool->transfers().Write(victim, data.data(), data.size(), 0, 0, 0);
  CHECK_OK(ticket);
  const Status timed_out = (*ticket)->Wait(50 * kMs);
  CHECK_CODE(timed_out, Code::kTimeout);
  CHECK_CONTAINS(timed_out.message(), "(cxl tier");
  CHECK_CONTAINS(timed_out.message(), "50 ms");
  const Status busy = pool->objects().Free(victim, 50 * kMs);
  CHECK_CODE(busy, Code::kTimeout);
  CHECK_CONTAINS(busy.message(), "cannot free handle " +
                                     std::to_string(victim) + " (cxl tier");
  (*ticket)->Cancel();
  CHECK_CODE((*ticket)->Wait(kLongWaitNs), Code::kTimeout);
  CHECK_OK(pool->objects().Free(victim, kLongWaitNs));
  CHECK_EQ(pool->test_hooks().faults_injected(), 2u);
  CHECK_OK(pool->test_hooks().InjectFault(FaultSpec{}));
  intact();

  // Closing with a transfer stalled: bounded by the close timeout.
  CHECK_OK(pool->test_hooks().InjectFault(stall));
  std::vector<char> buffer(16);
  StatusOr<std::shared_ptr<Ticket>> stuck = pool->transfers().Read(
      stored[1].first, buffer.data(), buffer.size(), 0, 0, 0);
  CHECK_OK(stuck);
  const int64_t start = NowNs();
  const Status closed = pool->Close(100 * kMs);
  CHECK_LT(NowNs() - start, 5000 * kMs);
  CHECK_CODE(closed, Code::kTimeout);
  CHECK_CODE((*stuck)->Wait(0), Code::kClosed);
  CHECK(!Exists(dir.path()));
}

// Close while other threads still use the pool: each call either works or
// says kClosed; nothing crashes, hangs or races.
TEST(CloseWhileInUse) {
  TempDir dir;
  PoolConfig config = ThreeTiers(dir.path());
  config.copy_threads = 2;
  config.chunk_bytes = 64 * kKiB;
  std::shared_ptr<Pool> pool = NewPool(config);
  std::atomic<int> unexpected{0};
  std::atomic<bool> stop{false};
  auto user = [&](int who) {
    std::vector<char> buffer(200 * kKiB, static_cast<char>(who));
    while (!stop.load()) {
      StatusOr<int32_t> handle = pool->objects().Allocate(
          static_cast<TierKind>(who % 3), buffer.size(), {}, "u8");
      if (!handle.ok()) {
        if (handle.status().code() != Code::kClosed) ++unexpected;
        continue;
      }
      auto ticket = pool->transfers().Write(*handle, buffer.data(),
                                            buffer.size(), 0, 0, 0);
      if (ticket.ok()) {
        const Status status = (*ticket)->Wait(kLongWaitNs);
        if (!status.ok() && status.code() != Code::kClosed) ++unexpected;
      } else if (ticket.status().code() != Code::kClosed) {
        ++unexpected;
      }
      const Status freed = pool->objects().Free(*handle, kLongWaitNs);
      if (!freed.ok() && freed.code() != Code::kClosed) ++unexpected;
      pool->objects().Stats();
      pool->transfers().DrainRecords();
    }
  };
  std::vector<std::thread> users;
  for (int i = 0; i < 3; ++i) users.emplace_back(user, i);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK_OK(pool->Close(kLongWaitNs));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  stop = true;
  for (std::thread& t : users) t.join();
  CHECK_EQ(unexpected.load(), 0);
  CHECK(pool->closed());
}

TEST(DirectRangesPinTheObjectAndCountTheirBytes) {
  TempDir dir;
  std::shared_ptr<Pool> pool = NewPool(ThreeTiers(dir.path()));
  const int32_t host = Alloc(*pool, TierKind::kHost, 4096);
  const std::vector<char> data = Pattern(4096, 7);
  CHECK_OK(WriteNow(*pool, host, data));
  StatusOr<DirectRange> range =
      pool->direct().BeginDirect(host, 1024, 512, Direction::kFromPool);
  CHECK_OK(range);
  CHECK(std::memcmp(range->address, data.data() + 512, 1024) == 0);
  bool inside = false;
  for (const MemoryRegion& region : pool->direct().MemoryRegions()) {
    inside |= range->address >= region.base &&
              range->address + 1024 <= region.base + region.bytes;
  }
  CHECK(inside);
  // Pinned: a free waits for EndDirect (here it times out).
  CHECK_CODE(pool->objects().Free(host, 50'000'000), Code::kTimeout);
  std::memcpy(range->address, "direct", 6);  // what a DMA would write
  pool->direct().EndDirect(*range);
  StatusOr<std::vector<char>> back = ReadNow(*pool, host, 6, 512);
  CHECK_OK(back);
  CHECK(std::memcmp(back->data(), "direct", 6) == 0);
  CHECK_EQ(pool->objects().Stats()[0].bytes_read, uint64_t{1024 + 6});
  CHECK_OK(pool->objects().Free(host, kLongWaitNs));
}

// Close gives up waiting for a direct copy (a GPU's DMA) still under way:
// the pool closes, but the range's memory stays mapped until EndDirect, so
// the late copy lands in memory nobody else uses instead of unmapped pages.
TEST(CloseKeepsADirectRangeMappedUntilItEnds) {
  TempDir dir;
  std::shared_ptr<Pool> pool = NewPool(ThreeTiers(dir.path()));
  const int32_t host = Alloc(*pool, TierKind::kHost, 64 * kKiB);
  StatusOr<DirectRange> range =
      pool->direct().BeginDirect(host, 64 * kKiB, 0, Direction::kToPool);
  CHECK_OK(range);
  CHECK_CODE(pool->Close(20 * kMs), Code::kTimeout);
  CHECK(pool->closed());
  std::memset(range->address, 0x5a, 64 * kKiB);  // the late DMA
  pool->direct().EndDirect(*range);              // unmaps it now
  CHECK(pool->direct().MemoryRegions().empty());
  CHECK_CODE(pool->objects().Info(host), Code::kClosed);
}

TEST(DirectRangesAreRefusedWhereTheCopyEngineMustMoveTheBytes) {
  TempDir dir;
  std::shared_ptr<Pool> pool = NewPool(ThreeTiers(dir.path()));
  const int32_t host = Alloc(*pool, TierKind::kHost, 64);
  CHECK_CODE(pool->direct().BeginDirect(host, 65, 0, Direction::kToPool),
             Code::kInvalidArgument);
  CHECK_CODE(pool->direct().BeginDirect(host + 1, 8, 0, Direction::kToPool),
             Code::kNotFound);
  CHECK_CODE(pool->direct().BeginDirect(Alloc(*pool, TierKind::kNvme, 64), 8, 0,
                                        Direction::kFromPool),
             Code::kInvalidArgument);
  // The emulated cxl tier has a link model: its bytes must go through it.
  TempDir other;
  PoolConfig config = ThreeTiers(other.path());
  config.tiers[1].link_bytes_per_second = 1e9;
  std::shared_ptr<Pool> linked = NewPool(config);
  StatusOr<DirectRange> cxl = linked->direct().BeginDirect(
      Alloc(*linked, TierKind::kCxl, 64), 8, 0, Direction::kFromPool);
  CHECK_CODE(cxl, Code::kInvalidArgument);
  CHECK_CONTAINS(cxl.status().message(), "link model");
}

TEST(CloseRunsItsHooksBeforeUnmapping) {
  PoolConfig config;
  config.tiers[0].capacity = 1 * kMiB;
  std::shared_ptr<Pool> pool = NewPool(config);
  std::vector<MemoryRegion> regions = pool->direct().MemoryRegions();
  CHECK_EQ(regions.size(), size_t{1});
  CHECK_GE(regions[0].bytes, uint64_t{1 * kMiB});
  int ran = 0;
  pool->direct().OnClose([&] {
    ++ran;
    regions[0].base[0] = 1;  // still mapped here
  });
  CHECK_OK(pool->Close(kLongWaitNs));
  CHECK_EQ(ran, 1);
}

}  // namespace
}  // namespace jcxl

JCXL_TEST_MAIN()
