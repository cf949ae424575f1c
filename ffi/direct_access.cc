#include "direct_access.h"

#include <utility>

#include "update_service.h"

namespace jcxl {

StatusOr<DirectRange> DirectAccess::BeginDirect(int32_t handle, uint64_t bytes,
                                                uint64_t offset,
                                                Direction direction) {
  if (direction == Direction::kFromPool) {
    JCXL_RETURN_IF_ERROR(updates_.RefreshIfStale(handle));
  }
  std::unique_lock<std::mutex> lock(table_.mu_);
  StatusOr<ObjectTable::Object*> found =
      table_.LookupAfterRuns(lock, handle, bytes, offset, direction);
  if (!found.ok()) return found.status();
  ObjectTable::Object* object = *found;
  if (direction == Direction::kToPool) {
    JCXL_RETURN_IF_ERROR(table_.CheckWritable(handle, *object));
  }
  ObjectTable::Tier& tier = table_.tiers_[object->tier];
  ObjectTable::TierArena& arena = tier.arenas[object->arena];
  if (arena.arena->base() == nullptr || tier.link) {
    return Status(Code::kInvalidArgument,
                  table_.Label(handle, *object) +
                      " is not directly addressable (nvme file, or a tier "
                      "behind a link model); use the copy engine");
  }
  DirectRange range;
  range.address = arena.arena->base() +
                  arena.allocator->OffsetOf(object->allocation) + offset;
  range.bytes = bytes;
  range.handle = handle;
  range.direction = direction;
  range.region_base = arena.arena->base();
  range.region_bytes = arena.arena->mapped_bytes();
  ++object->pins;
  ++table_.total_pins_;
  ++table_.direct_pins_;
  return range;
}

void DirectAccess::EndDirect(const DirectRange& range) {
  int tier = 0;
  std::vector<ObjectTable::TierArena> unmap;  // outside the lock
  {
    std::lock_guard<std::mutex> lock(table_.mu_);
    auto it = table_.objects_.find(ObjectTable::IndexOf(range.handle));
    tier = it == table_.objects_.end() ? 0 : it->second.tier;
    if (--table_.direct_pins_ == 0) unmap.swap(table_.retired_arenas_);
  }
  // The last direct copy Close outwaited: its chunks unlock now, before the
  // arenas Close kept mapped for it are unmapped.
  if (!unmap.empty()) table_.page_locks_.UnlockAll();
  table_.Unpin(ObjectTable::IndexOf(range.handle), tier, range.direction,
               range.bytes);
}

std::vector<MemoryRegion> DirectAccess::MemoryRegions() {
  std::lock_guard<std::mutex> lock(table_.mu_);
  std::vector<MemoryRegion> regions;
  for (ObjectTable::Tier& tier : table_.tiers_) {
    for (ObjectTable::TierArena& arena : tier.arenas) {
      if (arena.arena->base() != nullptr) {
        regions.push_back({arena.arena->base(), arena.arena->mapped_bytes()});
      }
    }
  }
  return regions;
}

void DirectAccess::OnClose(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(table_.mu_);
  on_close_.push_back(std::move(fn));
}

}  // namespace jcxl
