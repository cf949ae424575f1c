// Fuzz target: the allocators on their own, driven by the input's bytes.
//
// The first byte picks the extent allocator (best or first fit) or the hybrid
// allocator, with a capacity and slab options; every following op allocates,
// frees, frees what is not live (twice, or a made-up offset) or compacts.
// Objects are stamped into a simulated arena and compaction's moves are
// replayed on it. After every op:
//   * live extents and holes tile [0, top) exactly: no overlap, no gap,
//     aligned, holes coalesced and none touching the top;
//   * the allocator's byte counts equal the sums over its extents, and the
//     hybrid allocator's statistics the sums over the live objects;
//   * no two live objects overlap, each lies in a live extent, and each
//     still holds its stamp (compaction moved it, bytes and all).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "allocator.h"
#include "fuzz_input.h"

namespace jcxl::fuzz {
namespace {

Counter g_counter("allocator_fuzzer");
// Live objects at most (then allocations turn into frees): the checks after
// each operation stay cheap and long inputs do many operations.
constexpr size_t kMaxObjects = 64;

std::string At(uint64_t offset) {
  return "at offset " + std::to_string(offset);
}

// Live extents and holes tile the reserved range; the counts add up. (One
// merged walk over both maps, in address order: no allocation per check.)
void CheckExtents(const ExtentAllocator& a) {
  auto live = a.live().begin();
  auto hole = a.holes().begin();
  uint64_t cursor = 0;
  uint64_t live_bytes = 0;
  uint64_t hole_bytes = 0;
  uint64_t largest = 0;
  bool previous_hole = false;
  while (live != a.live().end() || hole != a.holes().end()) {
    const bool is_hole =
        live == a.live().end() ||
        (hole != a.holes().end() && hole->first < live->first);
    const auto [offset, size] = is_hole ? *hole++ : *live++;
    FUZZ_CHECK(offset == cursor, "gap or overlap " + At(offset) +
                                     ", expected " + std::to_string(cursor));
    FUZZ_CHECK(size > 0 && size % a.alignment() == 0 &&
                   offset % a.alignment() == 0,
               "unaligned extent " + At(offset));
    FUZZ_CHECK(!(is_hole && previous_hole),
               "holes not coalesced " + At(offset));
    previous_hole = is_hole;
    cursor += size;
    if (is_hole) {
      hole_bytes += size;
      largest = std::max(largest, size);
    } else {
      live_bytes += size;
    }
  }
  FUZZ_CHECK(!previous_hole, "a hole touches the top");
  FUZZ_CHECK(cursor == a.top(), "extents end at " + std::to_string(cursor) +
                                    ", top is " + std::to_string(a.top()));
  FUZZ_CHECK(a.top() <= a.capacity(), "top past the capacity");
  FUZZ_CHECK(live_bytes == a.allocated_bytes(), "allocated bytes disagree");
  FUZZ_CHECK(hole_bytes == a.hole_bytes(), "hole bytes disagree");
  FUZZ_CHECK(largest == a.largest_hole(), "largest hole disagrees");
  FUZZ_CHECK(a.live_extents() == a.live().size(), "extent count disagrees");
}

// A simulated arena, sparse: each object's first and last 8 bytes hold its
// id, and compaction's moves carry them along.
class Stamps {
 public:
  void Put(uint64_t offset, uint64_t size, uint64_t id) {
    Erase(offset, std::max<uint64_t>(size, 8));  // whatever was there before
    words_[offset] = id;
    words_[offset + std::max<uint64_t>(size, 8) - 8] = id;
  }
  bool Holds(uint64_t offset, uint64_t size, uint64_t id) const {
    auto first = words_.find(offset);
    auto last = words_.find(offset + std::max<uint64_t>(size, 8) - 8);
    return first != words_.end() && last != words_.end() &&
           first->second == id && last->second == id;
  }
  // As memmove(to, from, bytes) on the arena.
  void Move(const Move& move) {
    std::vector<std::pair<uint64_t, uint64_t>> carried;
    for (auto it = words_.lower_bound(move.from);
         it != words_.end() && it->first < move.from + move.bytes; ++it) {
      carried.emplace_back(it->first - move.from + move.to, it->second);
    }
    Erase(move.to, move.bytes);
    for (const auto& [offset, id] : carried) words_[offset] = id;
  }

 private:
  void Erase(uint64_t offset, uint64_t bytes) {
    words_.erase(words_.lower_bound(offset),
                 words_.lower_bound(offset + bytes));
  }
  std::map<uint64_t, uint64_t> words_;  // offset -> the 8 bytes there
};

// Compaction's moves: each from a live extent, downwards, in an order that
// makes forward copies safe.
void CheckMoves(const std::vector<Move>& moves,
                const std::map<uint64_t, uint64_t>& before) {
  uint64_t floor = 0;
  for (const Move& move : moves) {
    auto it = before.find(move.from);
    FUZZ_CHECK(it != before.end() && it->second == move.bytes,
               "move of something that was not a live extent " +
                   At(move.from));
    FUZZ_CHECK(move.to < move.from && move.to >= floor,
               "move to " + std::to_string(move.to) + " is unsafe");
    floor = move.to + move.bytes;
  }
}

void FuzzExtents(FuzzInput& in, uint64_t capacity, FitPolicy policy) {
  ExtentAllocator a(capacity, 4096, policy);
  Stamps stamps;
  std::map<uint64_t, uint64_t> objects;  // offset -> id
  uint64_t next_id = 1;
  while (!in.done()) {
    uint8_t op = in.Byte() % 8;
    if (op < 4 && objects.size() >= kMaxObjects) op = 4;
    if (op < 4) {  // allocate
      const uint64_t bytes = in.Size(capacity / 2);
      StatusOr<uint64_t> offset = a.Allocate(bytes);
      if (offset.ok()) {
        FUZZ_CHECK(objects.count(*offset) == 0, "handed out twice " +
                                                    At(*offset));
        FUZZ_CHECK(a.live().at(*offset) == a.RoundUp(bytes), "wrong size");
        objects[*offset] = next_id;
        stamps.Put(*offset, a.RoundUp(bytes), next_id++);
      } else {
        FUZZ_CHECK(offset.status().code() == Code::kExhausted,
                   offset.status().message());
      }
    } else if (op < 6 && !objects.empty()) {  // free, then free again
      auto it = objects.begin();
      std::advance(it, in.Range(0, objects.size() - 1));
      const uint64_t offset = it->first;
      FUZZ_CHECK(a.Free(offset).ok(), "free of a live extent failed");
      objects.erase(it);
      if (in.Byte() % 2) {
        FUZZ_CHECK(a.Free(offset).code() == Code::kNotFound,
                   "double free accepted " + At(offset));
      }
    } else if (op == 6) {  // free a made-up offset
      const uint64_t offset = in.Range(0, capacity);
      if (objects.count(offset) == 0) {
        FUZZ_CHECK(a.Free(offset).code() == Code::kNotFound,
                   "free of a made-up offset accepted " + At(offset));
      }
    } else {  // compact
      const std::map<uint64_t, uint64_t> before = a.live();
      std::vector<Move> moves = a.Compact();
      CheckMoves(moves, before);
      std::map<uint64_t, uint64_t> moved;
      for (const Move& move : moves) {
        stamps.Move(move);
        moved.emplace(move.from, move.to);
      }
      std::map<uint64_t, uint64_t> remapped;
      for (const auto& [offset, id] : objects) {
        auto it = moved.find(offset);
        remapped[it == moved.end() ? offset : it->second] = id;
      }
      objects = std::move(remapped);
      FUZZ_CHECK(a.hole_bytes() == 0, "holes left after compaction");
    }
    ++g_counter.operations;
    CheckExtents(a);
    FUZZ_CHECK(objects.size() == a.live().size(), "object count disagrees");
    for (const auto& [offset, id] : objects) {
      auto it = a.live().find(offset);
      FUZZ_CHECK(it != a.live().end(), "object not live " + At(offset));
      FUZZ_CHECK(stamps.Holds(offset, it->second, id),
                 "object lost its bytes " + At(offset));
    }
  }
}

struct Object {
  Allocation allocation;
  uint64_t id;
};

uint64_t Footprint(const HybridAllocator& a, const Allocation& allocation) {
  return allocation.is_slab() ? a.FootprintOf(allocation.bytes)
                              : a.extents().RoundUp(allocation.bytes);
}

void FuzzHybrid(FuzzInput& in, uint64_t capacity) {
  HybridOptions options;
  options.alignment = 4096;
  options.span_bytes = in.Byte() % 2 ? 256 << 10 : 64 << 10;
  options.slab_max_bytes = in.Byte() % 4 == 0 ? 0 : 64 << 10;
  HybridAllocator a(capacity, options);
  Stamps stamps;
  std::vector<Object> objects;
  uint64_t next_id = 1;
  while (!in.done()) {
    uint8_t op = in.Byte() % 8;
    if (op < 4 && objects.size() >= kMaxObjects) op = 4;
    if (op < 4) {  // allocate
      const uint64_t bytes = in.Size(capacity / 2);
      StatusOr<Allocation> allocation = a.Allocate(bytes);
      if (allocation.ok()) {
        objects.push_back({*allocation, next_id});
        stamps.Put(a.OffsetOf(*allocation), bytes, next_id++);
      } else {
        FUZZ_CHECK(allocation.status().code() == Code::kExhausted,
                   allocation.status().message());
      }
    } else if (op < 6 && !objects.empty()) {  // free, then free again
      const size_t i = in.Range(0, objects.size() - 1);
      const Allocation freed = objects[i].allocation;
      FUZZ_CHECK(a.Free(freed).ok(), "free of a live object failed");
      objects.erase(objects.begin() + i);
      if (in.Byte() % 2) {
        FUZZ_CHECK(a.Free(freed).code() == Code::kNotFound,
                   "double free accepted");
      }
    } else if (op == 6) {  // free an allocation the allocator never made
      Allocation made_up;
      made_up.bytes = in.Range(1, 1 << 20);
      made_up.span = static_cast<int32_t>(in.Range(0, 64)) - 1;
      made_up.slot = static_cast<uint32_t>(in.Range(0, 64));
      made_up.extent_offset = in.Range(0, capacity) | 1;  // never aligned
      if (made_up.is_slab()) made_up.span += 1 << 20;  // no such span
      FUZZ_CHECK(a.Free(made_up).code() == Code::kNotFound,
                 "free of a made-up allocation accepted");
    } else {  // compact; extent objects follow the moves, as the pool does
      const std::map<uint64_t, uint64_t> before = a.extents().live();
      std::vector<Move> moves = a.Compact();
      CheckMoves(moves, before);
      std::map<uint64_t, uint64_t> moved;
      for (const Move& move : moves) {
        stamps.Move(move);
        moved.emplace(move.from, move.to);
      }
      for (Object& object : objects) {
        if (object.allocation.is_slab()) continue;
        auto it = moved.find(object.allocation.extent_offset);
        if (it != moved.end()) object.allocation.extent_offset = it->second;
      }
    }
    ++g_counter.operations;
    CheckExtents(a.extents());
    const AllocatorStats stats = a.Stats();
    uint64_t live = 0;
    uint64_t slab = 0;
    uint64_t extent_bytes = 0;
    std::map<uint64_t, std::pair<uint64_t, uint64_t>> by_offset;
    for (const Object& object : objects) {
      const Allocation& allocation = object.allocation;
      const uint64_t offset = a.OffsetOf(allocation);
      const uint64_t footprint = Footprint(a, allocation);
      live += allocation.bytes;
      slab += allocation.is_slab();
      if (!allocation.is_slab()) extent_bytes += footprint;
      FUZZ_CHECK(by_offset.emplace(offset, std::make_pair(footprint,
                                                          object.id))
                     .second,
                 "two objects " + At(offset));
      FUZZ_CHECK(stamps.Holds(offset, allocation.bytes, object.id),
                 "object lost its bytes " + At(offset));
      // Inside a live extent (its own, or its span's).
      auto extent = a.extents().live().upper_bound(offset);
      FUZZ_CHECK(extent != a.extents().live().begin(),
                 "object outside every extent " + At(offset));
      --extent;
      FUZZ_CHECK(offset + footprint <= extent->first + extent->second,
                 "object past its extent " + At(offset));
    }
    uint64_t end = 0;
    for (const auto& [offset, entry] : by_offset) {
      FUZZ_CHECK(offset >= end, "objects overlap " + At(offset));
      end = offset + entry.first;
    }
    FUZZ_CHECK(stats.live == live, "live bytes disagree");
    FUZZ_CHECK(stats.slab_objects == slab, "slab object count disagrees");
    FUZZ_CHECK(stats.extent_objects == objects.size() - slab,
               "extent object count disagrees");
    FUZZ_CHECK(stats.reserved == a.extents().top(), "reserved disagrees");
    // Every allocated byte is an extent object's or a slab span's.
    FUZZ_CHECK(a.extents().allocated_bytes() ==
                   extent_bytes + stats.slab_spans * options.span_bytes,
               "allocated bytes not accounted for by objects and spans");
  }
}

}  // namespace
}  // namespace jcxl::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace jcxl;
  using namespace jcxl::fuzz;
  FuzzInput in(data, size);
  ++g_counter.inputs;
  const uint8_t mode = in.Byte();
  const uint64_t capacity = (1 + in.Byte() % 8) * (1 << 20) + 4096 * (mode / 4);
  switch (mode % 3) {
    case 0:
      FuzzExtents(in, capacity, FitPolicy::kBestFit);
      break;
    case 1:
      FuzzExtents(in, capacity, FitPolicy::kFirstFit);
      break;
    default:
      FuzzHybrid(in, capacity);
      break;
  }
  return 0;
}
