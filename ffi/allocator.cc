#include "allocator.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

namespace jcxl {

std::string FormatBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char buffer[32];
  if (unit == 0) {
    std::snprintf(buffer, sizeof(buffer), "%llu B",
                  static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buffer, sizeof(buffer), "%.2f %s", value, kUnits[unit]);
  }
  return buffer;
}

// ---------------------------------------------------------------- extents

std::map<uint64_t, uint64_t> FinalOffsets(const std::vector<Move>& moves) {
  std::map<uint64_t, uint64_t> origin;  // where an extent is -> where it was
  for (const Move& move : moves) {
    auto it = origin.find(move.from);
    const uint64_t first = it == origin.end() ? move.from : it->second;
    if (it != origin.end()) origin.erase(it);
    origin[move.to] = first;
  }
  std::map<uint64_t, uint64_t> out;
  for (const auto& [now, was] : origin) out[was] = now;
  return out;
}

ExtentAllocator::ExtentAllocator(uint64_t capacity, uint64_t alignment,
                                 FitPolicy policy)
    : capacity_(capacity - capacity % alignment),
      alignment_(alignment),
      policy_(policy) {}

uint64_t ExtentAllocator::RoundUp(uint64_t bytes) const {
  return (bytes + alignment_ - 1) / alignment_ * alignment_;
}

uint64_t ExtentAllocator::largest_hole() const {
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

void ExtentAllocator::InsertHole(uint64_t offset, uint64_t size) {
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
  hole_bytes_ += size;
}

void ExtentAllocator::EraseHole(uint64_t offset, uint64_t size) {
  free_by_offset_.erase(offset);
  free_by_size_.erase({size, offset});
  hole_bytes_ -= size;
}

StatusOr<uint64_t> ExtentAllocator::Allocate(uint64_t bytes) {
  if (bytes == 0) {
    return Status(Code::kInvalidArgument, "cannot allocate 0 bytes");
  }
  const uint64_t size = RoundUp(bytes);
  if (size < bytes) {  // overflow
    return Status(Code::kExhausted, "request of " + std::to_string(bytes) +
                                        " bytes is larger than any arena");
  }
  uint64_t offset = 0;
  bool found = false;
  uint64_t hole_size = 0;
  if (policy_ == FitPolicy::kBestFit) {
    auto it = free_by_size_.lower_bound({size, 0});
    if (it != free_by_size_.end()) {
      hole_size = it->first;
      offset = it->second;
      found = true;
    }
  } else {
    for (const auto& [hole_offset, hole] : free_by_offset_) {
      if (hole >= size) {
        offset = hole_offset;
        hole_size = hole;
        found = true;
        break;
      }
    }
  }
  if (found) {
    EraseHole(offset, hole_size);
    if (hole_size > size) InsertHole(offset + size, hole_size - size);
  } else if (capacity_ - top_ >= size) {
    offset = top_;
    top_ += size;
  } else {
    return Status(Code::kExhausted,
                  "cannot allocate " + FormatBytes(size) + ": " +
                      FormatBytes(capacity_ - top_ + hole_bytes_) +
                      " free of " + FormatBytes(capacity_) +
                      ", largest free extent " +
                      FormatBytes(std::max(capacity_ - top_, largest_hole())));
  }
  live_.emplace(offset, size);
  allocated_bytes_ += size;
  return offset;
}

Status ExtentAllocator::Free(uint64_t offset) {
  auto it = live_.find(offset);
  if (it == live_.end()) {
    return Status(Code::kNotFound,
                  "no live extent at offset " + std::to_string(offset));
  }
  uint64_t start = offset;
  uint64_t size = it->second;
  live_.erase(it);
  allocated_bytes_ -= size;
  // Coalesce with the hole after, then the hole before.
  auto next = free_by_offset_.find(start + size);
  if (next != free_by_offset_.end()) {
    uint64_t next_size = next->second;
    EraseHole(next->first, next_size);
    size += next_size;
  }
  auto prev = free_by_offset_.lower_bound(start);
  if (prev != free_by_offset_.begin()) {
    --prev;
    if (prev->first + prev->second == start) {
      uint64_t prev_offset = prev->first;
      uint64_t prev_size = prev->second;
      EraseHole(prev_offset, prev_size);
      start = prev_offset;
      size += prev_size;
    }
  }
  if (start + size == top_) {
    top_ = start;  // the free range at the top is no longer reserved
  } else {
    InsertHole(start, size);
  }
  return Status::Ok();
}

std::vector<Move> ExtentAllocator::Compact() {
  std::vector<Move> moves;
  std::map<uint64_t, uint64_t> packed;
  uint64_t cursor = 0;
  for (const auto& [offset, size] : live_) {
    if (offset != cursor) moves.push_back({offset, cursor, size});
    packed.emplace_hint(packed.end(), cursor, size);
    cursor += size;
  }
  live_ = std::move(packed);
  free_by_offset_.clear();
  free_by_size_.clear();
  hole_bytes_ = 0;
  top_ = cursor;
  return moves;
}

std::vector<Move> ExtentAllocator::CompactSome(uint64_t max_bytes) {
  std::vector<Move> moves;
  uint64_t moved = 0;  // every step lowers top_: the loop ends
  while (moved < max_bytes && hole_bytes_ > 0 && !live_.empty()) {
    const auto last = std::prev(live_.end());
    const uint64_t offset = last->first;
    const uint64_t size = last->second;
    const auto fit = free_by_size_.lower_bound({size, 0});
    if (fit != free_by_size_.end()) {  // the top extent into a hole
      const uint64_t hole_size = fit->first;
      const uint64_t hole_offset = fit->second;
      EraseHole(hole_offset, hole_size);
      if (hole_size > size) InsertHole(hole_offset + size, hole_size - size);
      live_.erase(last);
      live_.emplace(hole_offset, size);
      moves.push_back({offset, hole_offset, size});
      moved += size;
      top_ = offset;
    } else {  // no hole holds it: slide what is above the highest hole
      const auto hole = std::prev(free_by_offset_.end());
      const uint64_t hole_offset = hole->first;
      const uint64_t hole_size = hole->second;
      const auto first = live_.lower_bound(hole_offset + hole_size);
      const std::vector<std::pair<uint64_t, uint64_t>> segment(first,
                                                               live_.end());
      uint64_t bytes = 0;
      size_t count = 0;  // the lowest extents of it that the budget allows
      for (const auto& [o, s] : segment) {
        if (count > 0 && bytes + s > max_bytes - moved) break;
        bytes += s;
        ++count;
      }
      EraseHole(hole_offset, hole_size);
      for (size_t i = 0; i < count; ++i) {
        const auto [o, s] = segment[i];
        live_.erase(o);
        live_.emplace(o - hole_size, s);
        moves.push_back({o, o - hole_size, s});
      }
      moved += bytes;
      if (count == segment.size()) {
        top_ -= hole_size;
      } else {  // the hole moved up, below the extents left in place
        InsertHole(segment[count].first - hole_size, hole_size);
        break;
      }
    }
    // A hole now ending at the top is no longer reserved.
    if (!free_by_offset_.empty()) {
      const auto highest = std::prev(free_by_offset_.end());
      if (highest->first + highest->second == top_) {
        top_ = highest->first;
        EraseHole(highest->first, highest->second);
      }
    }
  }
  return moves;
}

// ----------------------------------------------------------------- hybrid

HybridAllocator::HybridAllocator(uint64_t capacity, HybridOptions options)
    : options_(options), extents_(capacity, options.alignment) {
  // A class larger than a span would have no slot in it: such sizes are
  // extent objects.
  options_.slab_max_bytes =
      std::min(options_.slab_max_bytes, options_.span_bytes);
  if (options_.slab_max_bytes > 0) {
    // 16-byte steps to 128, then 2^k x {1, 1.25, 1.5, 1.75}: powers of two
    // and 1.5 x 2^k (the usual tensor sizes) fit exactly, and no object
    // pads by more than 25%.
    for (uint64_t size = 16; size <= 128; size += 16) {
      class_sizes_.push_back(size);
    }
    for (uint64_t power = 128; power < options_.slab_max_bytes; power *= 2) {
      for (uint64_t quarter : {5, 6, 7, 8}) {
        const uint64_t size =
            std::min<uint64_t>(power * quarter / 4, options_.slab_max_bytes);
        if (size > class_sizes_.back()) class_sizes_.push_back(size);
      }
    }
    partial_spans_.resize(class_sizes_.size());
  }
}

int HybridAllocator::ClassOf(uint64_t bytes) const {
  if (bytes > options_.slab_max_bytes || class_sizes_.empty()) return -1;
  auto it = std::lower_bound(class_sizes_.begin(), class_sizes_.end(), bytes);
  return it == class_sizes_.end() ? -1
                                  : static_cast<int>(it - class_sizes_.begin());
}

uint32_t HybridAllocator::SlotsPerSpan(int size_class) const {
  return static_cast<uint32_t>(options_.span_bytes / class_sizes_[size_class]);
}

uint64_t HybridAllocator::FootprintOf(uint64_t bytes) const {
  int size_class = ClassOf(bytes);
  return size_class < 0 ? extents_.RoundUp(bytes) : class_sizes_[size_class];
}

bool HybridAllocator::FitsAfterCompact(uint64_t bytes) const {
  const int size_class = ClassOf(bytes);
  if (size_class >= 0 && !partial_spans_[size_class].empty()) return true;
  const uint64_t needed =
      size_class < 0 ? extents_.RoundUp(bytes) : options_.span_bytes;
  if (needed < bytes) return false;  // rounding overflowed
  return extents_.capacity() - extents_.allocated_bytes() >= needed;
}

StatusOr<Allocation> HybridAllocator::Allocate(uint64_t bytes) {
  const auto start = std::chrono::steady_clock::now();
  if (bytes == 0) {
    return Status(Code::kInvalidArgument, "cannot allocate 0 bytes");
  }
  Allocation allocation;
  allocation.bytes = bytes;
  const int size_class = ClassOf(bytes);
  if (size_class < 0) {
    StatusOr<uint64_t> offset = extents_.Allocate(bytes);
    if (!offset.ok()) return offset.status();
    allocation.extent_offset = *offset;
    ++extent_objects_;
  } else {
    std::set<int32_t>& partial = partial_spans_[size_class];
    if (partial.empty()) {
      StatusOr<uint64_t> offset = extents_.Allocate(options_.span_bytes);
      if (!offset.ok()) return offset.status();
      int32_t id;
      if (free_span_ids_.empty()) {
        id = static_cast<int32_t>(spans_.size());
        spans_.emplace_back();
      } else {
        id = free_span_ids_.back();
        free_span_ids_.pop_back();
      }
      Span& span = spans_[id];
      span.offset = *offset;
      span.size_class = size_class;
      span.used = 0;
      const uint32_t slots = SlotsPerSpan(size_class);
      span.free_slots.resize(slots);
      // Hand out low slots first: objects pack towards the span's start.
      for (uint32_t i = 0; i < slots; ++i) span.free_slots[i] = slots - 1 - i;
      span.live_slots.assign(slots, false);
      partial.insert(id);
      ++slab_spans_;
    }
    const int32_t id = *partial.begin();
    Span& span = spans_[id];
    allocation.span = id;
    allocation.slot = span.free_slots.back();
    span.free_slots.pop_back();
    span.live_slots[allocation.slot] = true;
    ++span.used;
    if (span.free_slots.empty()) partial.erase(id);
    ++slab_objects_;
  }
  live_bytes_ += bytes;
  ++allocations_;
  const uint64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now() - start)
                          .count();
  alloc_ns_total_ += ns;
  alloc_ns_max_ = std::max(alloc_ns_max_, ns);
  return allocation;
}

Status HybridAllocator::Free(const Allocation& allocation) {
  if (!allocation.is_slab()) {
    JCXL_RETURN_IF_ERROR(extents_.Free(allocation.extent_offset));
    --extent_objects_;
  } else {
    if (allocation.span >= static_cast<int32_t>(spans_.size()) ||
        spans_[allocation.span].size_class < 0) {
      return Status(Code::kNotFound,
                    "no slab span " + std::to_string(allocation.span));
    }
    Span& span = spans_[allocation.span];
    if (allocation.slot >= span.live_slots.size() ||
        !span.live_slots[allocation.slot]) {
      return Status(Code::kNotFound, "slot " + std::to_string(allocation.slot) +
                                         " of slab span " +
                                         std::to_string(allocation.span) +
                                         " is not in use");
    }
    span.live_slots[allocation.slot] = false;
    span.free_slots.push_back(allocation.slot);
    --span.used;
    --slab_objects_;
    if (span.used == 0) {
      // An empty span goes back to the extents, so slabs hold no dead space.
      partial_spans_[span.size_class].erase(allocation.span);
      JCXL_RETURN_IF_ERROR(extents_.Free(span.offset));
      span.size_class = -1;
      span.free_slots.clear();
      span.free_slots.shrink_to_fit();
      span.live_slots.clear();
      span.live_slots.shrink_to_fit();
      free_span_ids_.push_back(allocation.span);
      --slab_spans_;
    } else {
      partial_spans_[span.size_class].insert(allocation.span);
    }
  }
  live_bytes_ -= allocation.bytes;
  ++frees_;
  return Status::Ok();
}

uint64_t HybridAllocator::OffsetOf(const Allocation& allocation) const {
  if (!allocation.is_slab()) return allocation.extent_offset;
  const Span& span = spans_[allocation.span];
  return span.offset + allocation.slot * class_sizes_[span.size_class];
}

std::vector<Move> HybridAllocator::Compact(uint64_t max_bytes) {
  std::vector<Move> moves = max_bytes == UINT64_MAX
                                ? extents_.Compact()
                                : extents_.CompactSome(max_bytes);
  if (!moves.empty() && slab_spans_ > 0) {
    const std::map<uint64_t, uint64_t> remap = FinalOffsets(moves);
    for (Span& span : spans_) {
      if (span.size_class < 0) continue;
      auto it = remap.find(span.offset);
      if (it != remap.end()) span.offset = it->second;
    }
  }
  return moves;
}

AllocatorStats HybridAllocator::Stats() const {
  AllocatorStats stats;
  stats.capacity = extents_.capacity();
  stats.reserved = extents_.top();
  stats.live = live_bytes_;
  stats.hole_bytes = extents_.hole_bytes();
  stats.largest_hole = extents_.largest_hole();
  stats.largest_free = std::max(stats.largest_hole,
                                extents_.capacity() - extents_.top());
  stats.slab_objects = slab_objects_;
  stats.extent_objects = extent_objects_;
  stats.slab_spans = slab_spans_;
  stats.allocations = allocations_;
  stats.frees = frees_;
  stats.alloc_ns_total = alloc_ns_total_;
  stats.alloc_ns_max = alloc_ns_max_;
  return stats;
}

}  // namespace jcxl
