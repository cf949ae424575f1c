// Tests of the extent and hybrid allocators: fit policy, coalescing, the top
// mark, error messages, slab classes, compaction with handle-stable remaps,
// and a randomized run against a shadow model of the arena.
#include "allocator.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "check.h"

namespace jcxl {
namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
constexpr uint64_t kPage = 4096;

uint64_t Get(StatusOr<uint64_t> result) {
  CHECK_OK(result);
  return *result;
}

Allocation Get(StatusOr<Allocation> result) {
  CHECK_OK(result);
  return *result;
}

uint64_t SumOf(const std::map<uint64_t, uint64_t>& extents) {
  uint64_t total = 0;
  for (const auto& [offset, size] : extents) total += size;
  return total;
}

// Bookkeeping every ExtentAllocator must keep, whatever happened before.
void CheckExtentInvariants(const ExtentAllocator& allocator) {
  CHECK_EQ(allocator.hole_bytes(), SumOf(allocator.holes()));
  CHECK_EQ(allocator.allocated_bytes(), SumOf(allocator.live()));
  CHECK_EQ(allocator.top(),
           allocator.allocated_bytes() + allocator.hole_bytes());
  CHECK_LE(allocator.top(), allocator.capacity());
  // Live extents and holes tile [0, top) exactly, and no two holes touch
  // (they would have been coalesced).
  std::map<uint64_t, std::pair<uint64_t, bool>> all;  // offset -> (size, hole)
  for (const auto& [offset, size] : allocator.live()) {
    all[offset] = {size, false};
  }
  for (const auto& [offset, size] : allocator.holes()) {
    CHECK(all.count(offset) == 0);
    all[offset] = {size, true};
  }
  uint64_t cursor = 0;
  bool previous_hole = false;
  for (const auto& [offset, entry] : all) {
    CHECK_EQ(offset, cursor);
    CHECK_GT(entry.first, 0u);
    CHECK_EQ(entry.first % allocator.alignment(), 0u);
    CHECK(!(previous_hole && entry.second));
    previous_hole = entry.second;
    cursor += entry.first;
  }
  CHECK_EQ(cursor, allocator.top());
  CHECK(!previous_hole);  // a hole at the top would have lowered the top
  uint64_t largest = 0;
  for (const auto& [offset, size] : allocator.holes()) {
    largest = std::max(largest, size);
  }
  CHECK_EQ(allocator.largest_hole(), largest);
}

TEST(ExtentBestFitPicksSmallestHoleThatFits) {
  for (FitPolicy policy : {FitPolicy::kBestFit, FitPolicy::kFirstFit}) {
    ExtentAllocator allocator(1 * kMiB, kPage, policy);
    const uint64_t a = Get(allocator.Allocate(4 * kKiB));
    const uint64_t big = Get(allocator.Allocate(16 * kKiB));
    const uint64_t b = Get(allocator.Allocate(4 * kKiB));
    const uint64_t small = Get(allocator.Allocate(8 * kKiB));
    const uint64_t c = Get(allocator.Allocate(4 * kKiB));
    CHECK_EQ(a, 0u);
    CHECK_EQ(big, 4 * kKiB);
    CHECK_EQ(small, 24 * kKiB);
    CHECK_OK(allocator.Free(big));
    CHECK_OK(allocator.Free(small));
    CHECK_EQ(allocator.holes().size(), 2u);
    const uint64_t got = Get(allocator.Allocate(6 * kKiB));  // rounds to 8 KiB
    if (policy == FitPolicy::kBestFit) {
      CHECK_EQ(got, small);  // the 8 KiB hole, not the 16 KiB one before it
      CHECK_EQ(allocator.holes().size(), 1u);
      CHECK_EQ(allocator.holes().begin()->second, 16 * kKiB);
    } else {
      CHECK_EQ(got, big);  // the first hole that fits
      CHECK_EQ(allocator.holes().at(big + 8 * kKiB), 8 * kKiB);
    }
    CHECK_EQ(allocator.live().at(got), 8 * kKiB);
    CHECK_EQ(allocator.top(), c + 4 * kKiB);
    (void)b;
    CheckExtentInvariants(allocator);
  }
}

TEST(ExtentBestFitPrefersHoleOverTop) {
  ExtentAllocator allocator(1 * kMiB, kPage);
  const uint64_t a = Get(allocator.Allocate(8 * kKiB));
  Get(allocator.Allocate(4 * kKiB));
  CHECK_OK(allocator.Free(a));
  const uint64_t top = allocator.top();
  CHECK_EQ(Get(allocator.Allocate(8 * kKiB)), a);
  CHECK_EQ(allocator.top(), top);
  CHECK_EQ(allocator.hole_bytes(), 0u);
}

TEST(ExtentFreeCoalescesWithBothNeighbours) {
  ExtentAllocator allocator(1 * kMiB, kPage);
  const uint64_t a = Get(allocator.Allocate(4 * kKiB));
  const uint64_t b = Get(allocator.Allocate(8 * kKiB));
  const uint64_t c = Get(allocator.Allocate(12 * kKiB));
  const uint64_t d = Get(allocator.Allocate(4 * kKiB));
  CHECK_OK(allocator.Free(a));
  CHECK_OK(allocator.Free(c));
  CHECK_EQ(allocator.holes().size(), 2u);
  CHECK_EQ(allocator.hole_bytes(), 16 * kKiB);
  CHECK_OK(allocator.Free(b));  // joins the hole before and the one after
  CHECK_EQ(allocator.holes().size(), 1u);
  CHECK_EQ(allocator.holes().begin()->first, 0u);
  CHECK_EQ(allocator.holes().begin()->second, 24 * kKiB);
  CHECK_EQ(allocator.largest_hole(), 24 * kKiB);
  CHECK_EQ(allocator.top(), d + 4 * kKiB);
  CheckExtentInvariants(allocator);
  // The merged hole serves a request none of its parts could.
  CHECK_EQ(Get(allocator.Allocate(24 * kKiB)), 0u);
  CHECK_EQ(allocator.hole_bytes(), 0u);
  CheckExtentInvariants(allocator);
}

TEST(ExtentTopShrinksWhenLastExtentIsFreed) {
  ExtentAllocator allocator(1 * kMiB, kPage);
  const uint64_t a = Get(allocator.Allocate(4 * kKiB));
  const uint64_t b = Get(allocator.Allocate(4 * kKiB));
  const uint64_t c = Get(allocator.Allocate(4 * kKiB));
  CHECK_EQ(allocator.top(), 12 * kKiB);
  CHECK_OK(allocator.Free(c));
  CHECK_EQ(allocator.top(), 8 * kKiB);
  CHECK(allocator.holes().empty());
  // A hole below the last extent merges into the top when that goes too.
  const uint64_t d = Get(allocator.Allocate(4 * kKiB));
  CHECK_EQ(d, c);
  CHECK_OK(allocator.Free(b));
  CHECK_EQ(allocator.hole_bytes(), 4 * kKiB);
  CHECK_OK(allocator.Free(d));
  CHECK_EQ(allocator.top(), 4 * kKiB);
  CHECK(allocator.holes().empty());
  CHECK_EQ(allocator.hole_bytes(), 0u);
  CHECK_OK(allocator.Free(a));
  CHECK_EQ(allocator.top(), 0u);
  CHECK_EQ(allocator.allocated_bytes(), 0u);
  CheckExtentInvariants(allocator);
}

TEST(ExtentExhaustionMessageNamesSizes) {
  ExtentAllocator allocator(64 * kKiB, kPage);
  const uint64_t a = Get(allocator.Allocate(8 * kKiB));
  Get(allocator.Allocate(40 * kKiB));
  CHECK_OK(allocator.Free(a));
  // 24 KiB free (an 8 KiB hole and 16 KiB above the top), none of it in one
  // piece large enough.
  StatusOr<uint64_t> result = allocator.Allocate(20 * kKiB);
  CHECK_CODE(result, Code::kExhausted);
  const std::string& message = result.status().message();
  CHECK_CONTAINS(message, "20.00 KiB");  // the request
  CHECK_CONTAINS(message, "24.00 KiB");  // free in all
  CHECK_CONTAINS(message, "64.00 KiB");  // the capacity
  CHECK_CONTAINS(message, "16.00 KiB");  // the largest free extent
  // A failed request changes nothing.
  CHECK_EQ(allocator.top(), 48 * kKiB);
  CHECK_EQ(allocator.hole_bytes(), 8 * kKiB);
  CheckExtentInvariants(allocator);
  CHECK_EQ(Get(allocator.Allocate(16 * kKiB)), 48 * kKiB);
}

TEST(ExtentRequestsPastAnyArenaAreExhausted) {
  ExtentAllocator allocator(64 * kKiB, kPage);
  CHECK_CODE(allocator.Allocate(UINT64_MAX), Code::kExhausted);
  CHECK_CODE(allocator.Allocate(UINT64_MAX - kPage), Code::kExhausted);
  CHECK_CODE(allocator.Allocate(64 * kKiB + 1), Code::kExhausted);
  CHECK_EQ(Get(allocator.Allocate(64 * kKiB)), 0u);
}

TEST(ZeroByteRequestIsRejected) {
  ExtentAllocator extents(1 * kMiB, kPage);
  CHECK_CODE(extents.Allocate(0), Code::kInvalidArgument);
  HybridAllocator hybrid(1 * kMiB);
  CHECK_CODE(hybrid.Allocate(0), Code::kInvalidArgument);
  CHECK_EQ(hybrid.Stats().allocations, 0u);
  CHECK_EQ(hybrid.Stats().reserved, 0u);
}

TEST(DoubleFreeReturnsNotFound) {
  ExtentAllocator extents(1 * kMiB, kPage);
  const uint64_t a = Get(extents.Allocate(4 * kKiB));
  Get(extents.Allocate(4 * kKiB));
  CHECK_OK(extents.Free(a));
  CHECK_CODE(extents.Free(a), Code::kNotFound);
  CHECK_CODE(extents.Free(12345), Code::kNotFound);
  CheckExtentInvariants(extents);

  HybridAllocator hybrid(4 * kMiB);
  const Allocation large = Get(hybrid.Allocate(100 * kKiB));
  CHECK_OK(hybrid.Free(large));
  CHECK_CODE(hybrid.Free(large), Code::kNotFound);

  // A slab object whose span still holds another object: the second free must
  // not hand its slot out twice.
  const Allocation first = Get(hybrid.Allocate(100));
  const Allocation second = Get(hybrid.Allocate(100));
  CHECK_EQ(first.span, second.span);
  CHECK_OK(hybrid.Free(first));
  CHECK_CODE(hybrid.Free(first), Code::kNotFound);
  CHECK_EQ(hybrid.Stats().slab_objects, 1u);
  const Allocation third = Get(hybrid.Allocate(100));
  const Allocation fourth = Get(hybrid.Allocate(100));
  CHECK(hybrid.OffsetOf(third) != hybrid.OffsetOf(fourth));
  CHECK(hybrid.OffsetOf(third) != hybrid.OffsetOf(second));
  CHECK(hybrid.OffsetOf(fourth) != hybrid.OffsetOf(second));
  // A slab object whose span went back to the extents.
  CHECK_OK(hybrid.Free(second));
  CHECK_OK(hybrid.Free(third));
  CHECK_OK(hybrid.Free(fourth));
  CHECK_EQ(hybrid.Stats().slab_spans, 0u);
  CHECK_CODE(hybrid.Free(fourth), Code::kNotFound);
  CHECK_EQ(hybrid.Stats().frees, 5u);
}

TEST(SmallObjectsShareASpanThatIsReturnedWhenEmpty) {
  HybridOptions options;
  HybridAllocator allocator(8 * kMiB, options);
  std::vector<Allocation> objects;
  for (int i = 0; i < 100; ++i) objects.push_back(Get(allocator.Allocate(100)));
  const uint64_t slot_bytes = allocator.FootprintOf(100);
  CHECK_EQ(slot_bytes, 112u);
  AllocatorStats stats = allocator.Stats();
  CHECK_EQ(stats.slab_spans, 1u);
  CHECK_EQ(stats.slab_objects, 100u);
  CHECK_EQ(stats.extent_objects, 0u);
  CHECK_EQ(stats.live, 100u * 100u);
  CHECK_EQ(stats.reserved, options.span_bytes);  // one span, nothing else
  CHECK_EQ(allocator.extents().live_extents(), 1u);
  const uint64_t span_offset = allocator.extents().live().begin()->first;
  std::vector<uint64_t> offsets;
  for (const Allocation& object : objects) {
    CHECK(object.is_slab());
    CHECK_EQ(object.span, objects[0].span);
    offsets.push_back(allocator.OffsetOf(object));
  }
  std::sort(offsets.begin(), offsets.end());
  for (size_t i = 0; i < offsets.size(); ++i) {
    CHECK_EQ(offsets[i], span_offset + i * slot_bytes);  // packed from start
  }
  // Another size class takes a span of its own.
  const Allocation other = Get(allocator.Allocate(1000));
  CHECK(other.is_slab());
  CHECK(other.span != objects[0].span);
  CHECK_EQ(allocator.Stats().slab_spans, 2u);
  // A full span gets a second one for the same class.
  const uint32_t per_span = static_cast<uint32_t>(options.span_bytes / 112);
  std::vector<Allocation> more;
  for (uint32_t i = 100; i < per_span + 1; ++i) {
    more.push_back(Get(allocator.Allocate(97)));
  }
  CHECK_EQ(allocator.Stats().slab_spans, 3u);
  CHECK(more.back().span != objects[0].span);
  for (const Allocation& object : more) CHECK_OK(allocator.Free(object));
  CHECK_EQ(allocator.Stats().slab_spans, 2u);
  // Freeing all but one keeps the span; the last free returns it.
  for (size_t i = 1; i < objects.size(); ++i) {
    CHECK_OK(allocator.Free(objects[i]));
  }
  CHECK_EQ(allocator.Stats().slab_spans, 2u);
  CHECK_OK(allocator.Free(objects[0]));
  CHECK_EQ(allocator.Stats().slab_spans, 1u);
  CHECK_OK(allocator.Free(other));
  stats = allocator.Stats();
  CHECK_EQ(stats.slab_spans, 0u);
  CHECK_EQ(stats.slab_objects, 0u);
  CHECK_EQ(stats.live, 0u);
  CHECK_EQ(stats.reserved, 0u);
  CHECK_EQ(allocator.extents().live_extents(), 0u);
  // A freed span id is reused, and the span starts empty.
  const Allocation again = Get(allocator.Allocate(100));
  CHECK_EQ(allocator.OffsetOf(again), 0u);
  CHECK_EQ(allocator.Stats().slab_spans, 1u);
}

TEST(LargeObjectsAreExtents) {
  HybridAllocator allocator(8 * kMiB);
  const Allocation large = Get(allocator.Allocate(64 * kKiB + 1));
  CHECK(!large.is_slab());
  CHECK_EQ(allocator.OffsetOf(large), large.extent_offset);
  CHECK_EQ(allocator.extents().live().at(large.extent_offset), 68 * kKiB);
  const Allocation slab = Get(allocator.Allocate(64 * kKiB));
  CHECK(slab.is_slab());
  HybridOptions no_slabs;
  no_slabs.slab_max_bytes = 0;
  HybridAllocator extents_only(8 * kMiB, no_slabs);
  const Allocation tiny = Get(extents_only.Allocate(1));
  CHECK(!tiny.is_slab());
  CHECK_EQ(extents_only.FootprintOf(1), kPage);
}

TEST(SlabClassesLargerThanASpanBecomeExtents) {
  // Classes past span_bytes would have no slot in a span.
  HybridOptions options;
  options.slab_max_bytes = 1 * kMiB;
  options.span_bytes = 256 * kKiB;
  HybridAllocator allocator(16 * kMiB, options);
  const Allocation big = Get(allocator.Allocate(512 * kKiB));
  CHECK(!big.is_slab());
  CHECK_EQ(allocator.FootprintOf(512 * kKiB), 512 * kKiB);
  const Allocation medium = Get(allocator.Allocate(200 * kKiB));
  CHECK_LE(allocator.FootprintOf(200 * kKiB), options.span_bytes);
  CHECK_OK(allocator.Free(big));
  CHECK_OK(allocator.Free(medium));
  CHECK_EQ(allocator.Stats().reserved, 0u);
}

TEST(FootprintOfMatchesTheSpaceObjectsTake) {
  HybridAllocator allocator(64 * kMiB);
  CHECK_EQ(allocator.FootprintOf(1), 16u);
  CHECK_EQ(allocator.FootprintOf(16), 16u);
  CHECK_EQ(allocator.FootprintOf(17), 32u);
  CHECK_EQ(allocator.FootprintOf(128), 128u);
  CHECK_EQ(allocator.FootprintOf(129), 160u);
  CHECK_EQ(allocator.FootprintOf(64 * kKiB), 64 * kKiB);
  CHECK_EQ(allocator.FootprintOf(64 * kKiB + 1), 68 * kKiB);
  CHECK_EQ(allocator.FootprintOf(1 * kMiB), 1 * kMiB);
  // Padding stays at most about a quarter of a slab object.
  for (uint64_t bytes = 1; bytes <= 64 * kKiB; bytes += 37) {
    const uint64_t footprint = allocator.FootprintOf(bytes);
    CHECK_GE(footprint, bytes);
    if (bytes > 128) CHECK_LE(footprint, bytes + bytes / 4 + 16);
  }
  // Two objects of one class sit exactly one footprint apart; an extent object
  // takes exactly its footprint.
  for (uint64_t bytes : {1ull, 100ull, 129ull, 5000ull, 40000ull}) {
    const Allocation a = Get(allocator.Allocate(bytes));
    const Allocation b = Get(allocator.Allocate(bytes));
    CHECK_EQ(allocator.OffsetOf(b) - allocator.OffsetOf(a),
             allocator.FootprintOf(bytes));
  }
  const uint64_t before = allocator.extents().allocated_bytes();
  Get(allocator.Allocate(100 * kKiB + 3));
  CHECK_EQ(allocator.extents().allocated_bytes() - before,
           allocator.FootprintOf(100 * kKiB + 3));
}

TEST(CompactMovesExtentsAndKeepsHandlesStable) {
  HybridAllocator allocator(16 * kMiB);
  const Allocation hole1 = Get(allocator.Allocate(100 * kKiB));
  const Allocation small = Get(allocator.Allocate(100));  // a span
  const Allocation hole2 = Get(allocator.Allocate(300 * kKiB));
  Allocation large = Get(allocator.Allocate(200 * kKiB));
  const Allocation small2 = Get(allocator.Allocate(3000));  // another span
  const uint64_t span_bytes = HybridOptions().span_bytes;
  const uint64_t small_before = allocator.OffsetOf(small);
  const uint64_t small2_before = allocator.OffsetOf(small2);
  const uint64_t large_before = allocator.OffsetOf(large);
  CHECK_OK(allocator.Free(hole1));
  CHECK_OK(allocator.Free(hole2));
  CHECK_EQ(allocator.Stats().hole_bytes, 400 * kKiB);

  const std::vector<Move> moves = allocator.Compact();
  CHECK_EQ(moves.size(), 3u);
  uint64_t last_to = 0;
  for (size_t i = 0; i < moves.size(); ++i) {
    CHECK_LT(moves[i].to, moves[i].from);
    if (i > 0) CHECK_GE(moves[i].to, last_to);
    last_to = moves[i].to + moves[i].bytes;
  }
  // Slab objects follow their span on their own.
  CHECK_EQ(allocator.OffsetOf(small), small_before - 100 * kKiB);
  // Extent objects are remapped by the caller through the moves.
  for (const Move& move : moves) {
    if (move.from == large.extent_offset) large.extent_offset = move.to;
  }
  CHECK_EQ(allocator.OffsetOf(large), large_before - 400 * kKiB);
  CHECK_EQ(allocator.OffsetOf(small2), small2_before - 400 * kKiB);
  const AllocatorStats stats = allocator.Stats();
  CHECK_EQ(stats.hole_bytes, 0u);
  CHECK_EQ(stats.reserved, 2 * span_bytes + 200 * kKiB);
  CheckExtentInvariants(allocator.extents());
  // The remapped handles still free cleanly, and a second compact is a no-op.
  CHECK_OK(allocator.Free(large));
  CHECK_OK(allocator.Free(small));
  CHECK_EQ(allocator.Compact().size(), 1u);  // small2's span, down to 0
  CHECK_EQ(allocator.OffsetOf(small2), small2_before - 400 * kKiB - 456 * kKiB);
  CHECK_OK(allocator.Free(small2));
  CHECK_EQ(allocator.Stats().reserved, 0u);
}

// The randomized run: a byte image of the arena in which every live object's
// footprint holds its own tag. Compaction moves the image as the returned
// moves say; then every object must still find its tag at OffsetOf().
class ShadowArena {
 public:
  explicit ShadowArena(uint64_t capacity) : bytes_(capacity, 0) {}
  void Stamp(uint64_t offset, uint64_t size, uint32_t tag) {
    for (uint64_t at : Probes(offset, size)) {
      std::memcpy(&bytes_[at], &tag, sizeof(tag));
    }
  }
  bool Holds(uint64_t offset, uint64_t size, uint32_t tag) const {
    for (uint64_t at : Probes(offset, size)) {
      uint32_t found;
      std::memcpy(&found, &bytes_[at], sizeof(found));
      if (found != tag) return false;
    }
    return true;
  }
  void Apply(const Move& move) {
    std::memmove(&bytes_[move.to], &bytes_[move.from], move.bytes);
  }

 private:
  static std::array<uint64_t, 3> Probes(uint64_t offset, uint64_t size) {
    // Objects are at least 16 bytes (the smallest slot) in footprint.
    return {offset, offset + (size / 2) / 4 * 4, offset + size - 4};
  }
  std::vector<uint8_t> bytes_;
};

struct Live {
  Allocation allocation;
  uint32_t tag;
};

void CheckHybrid(const HybridAllocator& allocator,
                 const std::map<uint32_t, Live>& live,
                 const ShadowArena& image, uint64_t span_bytes) {
  const AllocatorStats stats = allocator.Stats();
  const ExtentAllocator& extents = allocator.extents();
  CheckExtentInvariants(extents);
  CHECK_EQ(stats.reserved, SumOf(extents.live()) + SumOf(extents.holes()));
  CHECK_EQ(stats.hole_bytes, SumOf(extents.holes()));
  uint64_t requested = 0;
  uint64_t extent_bytes = 0;
  uint64_t slab_objects = 0;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // [begin, end)
  for (const auto& [id, object] : live) {
    const Allocation& a = object.allocation;
    const uint64_t offset = allocator.OffsetOf(a);
    const uint64_t footprint = allocator.FootprintOf(a.bytes);
    requested += a.bytes;
    CHECK_LE(offset + footprint, stats.reserved);
    CHECK(image.Holds(offset, footprint, object.tag));
    if (a.is_slab()) {
      ++slab_objects;
    } else {
      extent_bytes += footprint;
      CHECK_EQ(extents.live().at(a.extent_offset), footprint);
    }
    ranges.push_back({offset, offset + footprint});
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    CHECK_LE(ranges[i - 1].second, ranges[i].first);  // no overlap
  }
  CHECK_EQ(stats.live, requested);
  CHECK_EQ(stats.slab_objects, slab_objects);
  CHECK_EQ(stats.extent_objects, live.size() - slab_objects);
  CHECK_EQ(SumOf(extents.live()), extent_bytes + stats.slab_spans * span_bytes);
  CHECK_EQ(stats.largest_free,
           std::max(extents.largest_hole(), stats.capacity - stats.reserved));
}

TEST(RandomizedHybridAgainstShadowModel) {
  constexpr uint64_t kCapacity = 24 * kMiB;
  constexpr int kOps = 10000;
  HybridOptions options;
  HybridAllocator allocator(kCapacity, options);
  ShadowArena image(kCapacity);
  std::mt19937_64 rng(20240611);
  std::map<uint32_t, Live> live;
  uint32_t next_tag = 1;
  int exhausted = 0;
  int compactions = 0;
  for (int op = 0; op < kOps; ++op) {
    const uint64_t dice = rng() % 1000;
    if (dice < 5) {
      const AllocatorStats before = allocator.Stats();
      const std::vector<Move> moves = allocator.Compact();
      ++compactions;
      std::map<uint64_t, uint64_t> remap;
      uint64_t floor = 0;
      for (const Move& move : moves) {
        CHECK_LT(move.to, move.from);
        CHECK_GE(move.to, floor);
        floor = move.to + move.bytes;
        image.Apply(move);
        remap[move.from] = move.to;
      }
      for (auto& [id, object] : live) {
        if (object.allocation.is_slab()) continue;
        auto it = remap.find(object.allocation.extent_offset);
        if (it != remap.end()) object.allocation.extent_offset = it->second;
      }
      const AllocatorStats after = allocator.Stats();
      CHECK_EQ(after.hole_bytes, 0u);
      CHECK_EQ(after.reserved, before.reserved - before.hole_bytes);
      CHECK_EQ(after.live, before.live);
    } else if (dice < 550 || live.empty()) {
      // Mostly small objects, some large ones, a few near the slab limit.
      uint64_t bytes;
      const uint64_t kind = rng() % 10;
      if (kind < 6) {
        bytes = 1 + rng() % 2048;
      } else if (kind < 8) {
        bytes = 1 + rng() % options.slab_max_bytes;
      } else {
        bytes = options.slab_max_bytes + 1 + rng() % (2 * kMiB);
      }
      const AllocatorStats before = allocator.Stats();
      const uint64_t extent_size = allocator.extents().RoundUp(bytes);
      StatusOr<Allocation> result = allocator.Allocate(bytes);
      if (!result.ok()) {
        CHECK_CODE(result, Code::kExhausted);
        ++exhausted;
        // Best fit only fails when no free extent is large enough.
        const uint64_t needed =
            bytes > options.slab_max_bytes ? extent_size : options.span_bytes;
        CHECK_LT(before.largest_free, needed);
        const AllocatorStats after = allocator.Stats();
        CHECK_EQ(after.reserved, before.reserved);
        CHECK_EQ(after.live, before.live);
        CHECK_EQ(after.hole_bytes, before.hole_bytes);
      } else {
        const Allocation a = *result;
        CHECK_EQ(a.bytes, bytes);
        CHECK_EQ(a.is_slab(), bytes <= options.slab_max_bytes);
        const uint32_t tag = next_tag++;
        image.Stamp(allocator.OffsetOf(a), allocator.FootprintOf(bytes), tag);
        live[tag] = {a, tag};
      }
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      CHECK_OK(allocator.Free(it->second.allocation));
      live.erase(it);
    }
    // The cheap part of the model after every op, all of it every few ops
    // (and after every compaction: that is where handles could go stale).
    const AllocatorStats stats = allocator.Stats();
    CHECK_EQ(stats.reserved, allocator.extents().allocated_bytes() +
                                 allocator.extents().hole_bytes());
    CHECK_EQ(stats.slab_objects + stats.extent_objects, live.size());
    if (op % 16 == 0 || dice < 5) {
      CheckHybrid(allocator, live, image, options.span_bytes);
    }
  }
  CheckHybrid(allocator, live, image, options.span_bytes);
  // The run must have exercised every path.
  CHECK_GT(exhausted, 0);
  CHECK_GT(compactions, 20);
  for (auto& [id, object] : live) CHECK_OK(allocator.Free(object.allocation));
  CHECK_EQ(allocator.Stats().reserved, 0u);
  CHECK_EQ(allocator.Stats().slab_spans, 0u);
}

TEST(RandomizedExtentsBothPolicies) {
  for (FitPolicy policy : {FitPolicy::kBestFit, FitPolicy::kFirstFit}) {
    constexpr uint64_t kCapacity = 8 * kMiB;
    ExtentAllocator allocator(kCapacity, kPage, policy);
    std::mt19937_64 rng(7);
    std::map<uint64_t, uint64_t> live;  // offset -> rounded size
    for (int op = 0; op < 10000; ++op) {
      const uint64_t dice = rng() % 100;
      if (dice == 0) {
        const std::vector<Move> moves = allocator.Compact();
        std::map<uint64_t, uint64_t> packed;
        for (const auto& [offset, size] : live) {
          uint64_t to = offset;
          for (const Move& move : moves) {
            if (move.from == offset) to = move.to;
          }
          packed[to] = size;
        }
        live = std::move(packed);
      } else if (dice < 55 || live.empty()) {
        const uint64_t bytes = 1 + rng() % (256 * kKiB);
        const uint64_t size = allocator.RoundUp(bytes);
        const uint64_t largest_free =
            std::max(allocator.largest_hole(), kCapacity - allocator.top());
        StatusOr<uint64_t> result = allocator.Allocate(bytes);
        CHECK_EQ(result.ok(), largest_free >= size);
        if (result.ok()) {
          CHECK_EQ(*result % kPage, 0u);
          live[*result] = size;
        }
      } else {
        auto it = live.begin();
        std::advance(it, rng() % live.size());
        CHECK_OK(allocator.Free(it->first));
        live.erase(it);
      }
      CHECK_EQ(allocator.top(),
               allocator.allocated_bytes() + allocator.hole_bytes());
      if (op % 8 == 0 || dice == 0) {
        CHECK(allocator.live() == live);
        CheckExtentInvariants(allocator);
      }
    }
  }
}

TEST(PowerOfTwoAndThreeHalvesSizesFitTheirSlabClassExactly) {
  HybridAllocator allocator(64 << 20);
  for (uint64_t bytes : {uint64_t{256}, uint64_t{384}, uint64_t{3072},
                         uint64_t{4096}, uint64_t{16384}, uint64_t{32768},
                         uint64_t{49152}, uint64_t{65536}}) {
    CHECK_EQ(allocator.FootprintOf(bytes), bytes);
  }
  // Any other size pads by at most a quarter.
  for (uint64_t bytes = 129; bytes <= (64 << 10); bytes += 97) {
    CHECK_LE(allocator.FootprintOf(bytes), bytes + bytes / 4);
  }
}

TEST(FormatBytesIsReadable) {
  CHECK_EQ(FormatBytes(0), std::string("0 B"));
  CHECK_EQ(FormatBytes(1023), std::string("1023 B"));
  CHECK_EQ(FormatBytes(1536), std::string("1.50 KiB"));
  CHECK_EQ(FormatBytes(3ull << 30), std::string("3.00 GiB"));
}

// A bounded compaction (what free() runs under the pool's lock) moves at
// most its budget plus one extent, keeps every live extent's bytes (moves
// applied in order, found through FinalOffsets), and repeated calls remove
// every hole.
TEST(CompactSomeIsBoundedAndKeepsExtents) {
  constexpr uint64_t kCapacity = 16 * kMiB;
  constexpr uint64_t kBudget = 512 * kKiB;
  ExtentAllocator allocator(kCapacity, kPage);
  std::mt19937_64 rng(11);
  std::map<uint64_t, uint64_t> live;  // offset -> rounded size
  for (int op = 0; op < 4000; ++op) {
    if (rng() % 10 < 6 || live.empty()) {
      StatusOr<uint64_t> result = allocator.Allocate(1 + rng() % (300 * kKiB));
      if (result.ok()) live[*result] = allocator.live().at(*result);
    } else {
      auto it = std::next(live.begin(), rng() % live.size());
      CHECK_OK(allocator.Free(it->first));
      live.erase(it);
    }
    if (op % 7 != 0) continue;
    const std::vector<Move> moves = allocator.CompactSome(kBudget);
    uint64_t moved = 0, largest = 0;
    for (const Move& move : moves) {
      CHECK_LT(move.to, move.from);
      moved += move.bytes;
      largest = std::max(largest, move.bytes);
    }
    CHECK(moved <= kBudget + largest);
    std::map<uint64_t, uint64_t> now;
    const std::map<uint64_t, uint64_t> final_offsets = FinalOffsets(moves);
    for (const auto& [offset, size] : live) {
      auto it = final_offsets.find(offset);
      now[it == final_offsets.end() ? offset : it->second] = size;
    }
    live = std::move(now);
    CHECK(live == allocator.live());
    CheckExtentInvariants(allocator);
  }
  for (int i = 0; i < 1000 && allocator.hole_bytes() > 0; ++i) {
    allocator.CompactSome(kBudget);
  }
  CHECK_EQ(allocator.hole_bytes(), 0u);
  CHECK_EQ(allocator.top(), allocator.allocated_bytes());
}

}  // namespace
}  // namespace jcxl

JCXL_TEST_MAIN()

