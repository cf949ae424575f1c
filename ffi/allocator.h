// The hybrid object allocator. It hands out offsets inside one arena (a tier's
// address range on one NUMA node, or its nvme file); it never touches memory,
// so it is tested and fuzzed on its own and replayed on traces far larger
// than this machine's memory.
//
//   ExtentAllocator  best fit (or first fit, for the baseline) over aligned
//                    extents, coalescing free neighbours; a `top` mark splits
//                    the reserved part of the arena from the untouched rest.
//   HybridAllocator  small objects in size-class slabs (spans of fixed size
//                    carved from the extents), large ones as extents.
#ifndef JCXL_FFI_ALLOCATOR_H_
#define JCXL_FFI_ALLOCATOR_H_

#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "status.h"

namespace jcxl {

// One relocation of a live extent made by Compact(): the caller moves the
// bytes, in the order given (each destination lies below its source and above
// every earlier destination, so a forward copy is safe).
struct Move {
  uint64_t from = 0;
  uint64_t to = 0;
  uint64_t bytes = 0;
};

enum class FitPolicy { kBestFit, kFirstFit };

// Where each moved extent ends up, by where it was before `moves` (applied
// in order; an extent may move more than once).
std::map<uint64_t, uint64_t> FinalOffsets(const std::vector<Move>& moves);

class ExtentAllocator {
 public:
  ExtentAllocator(uint64_t capacity, uint64_t alignment,
                  FitPolicy policy = FitPolicy::kBestFit);

  // Returns the offset of an extent of at least `bytes` (rounded up to the
  // alignment), or kExhausted naming what is free.
  StatusOr<uint64_t> Allocate(uint64_t bytes);
  // Frees the extent that starts at `offset`; kNotFound if there is none.
  Status Free(uint64_t offset);
  // Slides every live extent down so no holes remain; returns the moves.
  std::vector<Move> Compact();
  // Removes holes from the top down, moving about `max_bytes` at most:
  // the highest extent goes into the smallest hole that holds it, or, where
  // none does, the extents above the highest hole slide down over it (only
  // as many of the lowest of them as fit in what is left of `max_bytes`, at
  // least one). Each step lowers the top or moves the hole up; an extent may
  // move
  // again (apply the moves in order; FinalOffsets says where each extent
  // ends up). A later call goes on where it stopped.
  std::vector<Move> CompactSome(uint64_t max_bytes);

  uint64_t capacity() const { return capacity_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t top() const { return top_; }  // bytes reserved (high-water mark)
  uint64_t hole_bytes() const { return hole_bytes_; }  // free below top
  uint64_t largest_hole() const;
  uint64_t allocated_bytes() const { return allocated_bytes_; }
  uint64_t live_extents() const { return live_.size(); }
  uint64_t RoundUp(uint64_t bytes) const;
  // Every live extent as (offset, size), in address order (for checks).
  const std::map<uint64_t, uint64_t>& live() const { return live_; }
  const std::map<uint64_t, uint64_t>& holes() const { return free_by_offset_; }

 private:
  void InsertHole(uint64_t offset, uint64_t size);
  void EraseHole(uint64_t offset, uint64_t size);

  uint64_t capacity_;
  uint64_t alignment_;
  FitPolicy policy_;
  uint64_t top_ = 0;
  uint64_t hole_bytes_ = 0;
  uint64_t allocated_bytes_ = 0;
  std::map<uint64_t, uint64_t> free_by_offset_;         // offset -> size
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_;  // (size, offset)
  std::map<uint64_t, uint64_t> live_;                   // offset -> size
};

// Where an object sits: an extent of its own, or a slot of a slab span.
struct Allocation {
  uint64_t bytes = 0;  // as requested
  int32_t span = -1;   // slab span id; -1 for an extent object
  uint32_t slot = 0;
  uint64_t extent_offset = 0;  // extent objects only
  bool is_slab() const { return span >= 0; }
};

struct AllocatorStats {
  uint64_t capacity = 0;
  uint64_t reserved = 0;  // address range in use, holes included
  uint64_t live = 0;      // bytes the live objects asked for
  uint64_t hole_bytes = 0;
  uint64_t largest_hole = 0;
  uint64_t largest_free = 0;  // the largest extent an allocation can get
  uint64_t slab_objects = 0;
  uint64_t extent_objects = 0;
  uint64_t slab_spans = 0;
  uint64_t allocations = 0;
  uint64_t frees = 0;
  uint64_t alloc_ns_total = 0;
  uint64_t alloc_ns_max = 0;
  // Free bytes stranded between live extents, as a fraction of `reserved`:
  // memory the footprint holds but no allocation is using.
  double external_fragmentation() const {
    return reserved == 0 ? 0.0 : static_cast<double>(hole_bytes) / reserved;
  }
};

struct HybridOptions {
  uint64_t alignment = 4096;       // extent granularity (a page: O_DIRECT and
                                   // per-page NUMA placement need it)
  uint64_t slab_max_bytes = 64 << 10;  // 0 disables slabs
  uint64_t span_bytes = 256 << 10;     // one slab span
};

class HybridAllocator {
 public:
  HybridAllocator(uint64_t capacity, HybridOptions options = {});

  StatusOr<Allocation> Allocate(uint64_t bytes);
  Status Free(const Allocation& allocation);
  // Where the object's bytes are now (slab objects move with their span).
  uint64_t OffsetOf(const Allocation& allocation) const;
  // Compacts the extents (slab spans move whole): all of them, or with a
  // `max_bytes`, about that many bytes' worth (ExtentAllocator::CompactSome);
  // returns the moves. Extent
  // objects must have their extent_offset remapped by the caller through the
  // returned moves; slab objects follow their span automatically.
  std::vector<Move> Compact(uint64_t max_bytes = UINT64_MAX);

  AllocatorStats Stats() const;
  const ExtentAllocator& extents() const { return extents_; }
  // Bytes a request takes in the arena (slot or rounded extent).
  uint64_t FootprintOf(uint64_t bytes) const;
  // Whether Allocate(bytes) would succeed after Compact(): the free bytes,
  // gathered into one extent, would hold it.
  bool FitsAfterCompact(uint64_t bytes) const;
  uint64_t capacity() const { return extents_.capacity(); }

 private:
  struct Span {
    uint64_t offset = 0;
    int size_class = -1;  // -1: span id free for reuse
    uint32_t used = 0;
    std::vector<uint32_t> free_slots;
    std::vector<bool> live_slots;  // catches a slot freed twice
  };
  int ClassOf(uint64_t bytes) const;
  uint32_t SlotsPerSpan(int size_class) const;

  HybridOptions options_;
  ExtentAllocator extents_;
  std::vector<uint64_t> class_sizes_;
  std::vector<Span> spans_;
  std::vector<int32_t> free_span_ids_;
  std::vector<std::set<int32_t>> partial_spans_;  // per class, with free slots
  uint64_t live_bytes_ = 0;
  uint64_t slab_objects_ = 0;
  uint64_t extent_objects_ = 0;
  uint64_t slab_spans_ = 0;
  uint64_t allocations_ = 0;
  uint64_t frees_ = 0;
  uint64_t alloc_ns_total_ = 0;
  uint64_t alloc_ns_max_ = 0;
};

// Human-readable byte count for error messages ("1.50 GiB").
std::string FormatBytes(uint64_t bytes);

}  // namespace jcxl

#endif  // JCXL_FFI_ALLOCATOR_H_
