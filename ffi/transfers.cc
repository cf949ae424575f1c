#include "transfers.h"

#include <utility>

#include "update_service.h"

namespace jcxl {

StatusOr<std::shared_ptr<Ticket>> Transfers::Write(
    int32_t handle, const void* src, uint64_t bytes, uint64_t offset,
    int priority, uint64_t chunk_bytes, std::shared_ptr<void> owner) {
  return Transfer(handle, const_cast<void*>(src), bytes, offset, priority,
                  chunk_bytes, Direction::kToPool, std::move(owner));
}

StatusOr<std::shared_ptr<Ticket>> Transfers::Read(int32_t handle, void* dst,
                                                  uint64_t bytes,
                                                  uint64_t offset, int priority,
                                                  uint64_t chunk_bytes,
                                                  std::shared_ptr<void> owner) {
  JCXL_RETURN_IF_ERROR(updates_.RefreshIfStale(handle));
  return Transfer(handle, dst, bytes, offset, priority, chunk_bytes,
                  Direction::kFromPool, std::move(owner));
}

StatusOr<std::shared_ptr<Ticket>> Transfers::Transfer(
    int32_t handle, void* buffer, uint64_t bytes, uint64_t offset, int priority,
    uint64_t chunk_bytes, Direction direction, std::shared_ptr<void> owner) {
  std::unique_lock<std::mutex> lock(table_.mu_);
  StatusOr<ObjectTable::Object*> found = table_.LookupAfterRuns(
      lock, handle, bytes, offset, direction);
  if (!found.ok()) return found.status();
  ObjectTable::Object* object = *found;
  if (direction == Direction::kToPool) {
    JCXL_RETURN_IF_ERROR(table_.CheckWritable(handle, *object));
    // The whole object rewritten: what a failed run left is gone.
    if (offset == 0 && bytes == object->allocation.bytes) {
      object->damage.clear();
    }
  }
  if (bytes > 0 && buffer == nullptr) {
    return Status(Code::kInvalidArgument,
                  "null buffer for handle " + std::to_string(handle));
  }
  ObjectTable::Tier& tier = table_.tiers_[object->tier];
  ObjectTable::TierArena& arena = tier.arenas[object->arena];
  TransferRequest request;
  request.arena = arena.arena.get();
  request.arena_offset = arena.allocator->OffsetOf(object->allocation) + offset;
  request.buffer = buffer;
  request.bytes = bytes;
  request.direction = direction;
  request.link = tier.link.get();
  request.priority = priority;
  request.chunk_bytes = chunk_bytes;
  request.record.handle = handle;
  request.record.tier = object->tier;
  request.record.node = arena.node;
  request.label = table_.Label(handle, *object);
  request.buffer_owner = std::move(owner);
  const uint32_t index = ObjectTable::IndexOf(handle);
  const int tier_index = object->tier;
  request.on_complete = [this, index, tier_index, direction,
                         bytes](const Status&) {
    table_.Unpin(index, tier_index, direction, bytes);
  };
  ++object->pins;
  ++table_.total_pins_;
  // Submitted under the lock: Close() takes the engine away only under it,
  // after setting the table closed (so Submit never finishes a request
  // inline here).
  return engine_->Submit(std::move(request));
}

std::vector<TransferRecord> Transfers::DrainRecords() {
  std::lock_guard<std::mutex> lock(table_.mu_);
  return engine_ ? engine_->DrainRecords() : std::vector<TransferRecord>{};
}

}  // namespace jcxl
