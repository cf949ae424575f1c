// A pool's transfers: copies between a caller's buffer and pool objects by
// the pool's copy engine (copy_engine.h), asynchronous, each object pinned
// until its copy is done (so that Free and Compact wait for it).
#ifndef JCXL_FFI_TRANSFERS_H_
#define JCXL_FFI_TRANSFERS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "copy_engine.h"
#include "object_table.h"
#include "status.h"

namespace jcxl {

class UpdateService;

class Transfers {
 public:
  Transfers(ObjectTable& table, UpdateService& updates)
      : table_(table), updates_(updates) {}
  Transfers(const Transfers&) = delete;
  Transfers& operator=(const Transfers&) = delete;

  // Starts a copy of `bytes` from `src` into the object at byte `offset`.
  // `owner`, if given, keeps `src` alive until the copy is done (see
  // TransferRequest::buffer_owner): the caller may then drop the ticket.
  StatusOr<std::shared_ptr<Ticket>> Write(int32_t handle, const void* src,
                                          uint64_t bytes, uint64_t offset,
                                          int priority, uint64_t chunk_bytes,
                                          std::shared_ptr<void> owner = {});
  // Starts a copy of the object's bytes [offset, offset + bytes) to `dst`
  // (a copy the pool keeps is first made fresh: update_service.h).
  StatusOr<std::shared_ptr<Ticket>> Read(int32_t handle, void* dst,
                                         uint64_t bytes, uint64_t offset,
                                         int priority, uint64_t chunk_bytes,
                                         std::shared_ptr<void> owner = {});
  std::vector<TransferRecord> DrainRecords();

 private:
  friend class Pool;
  friend class PoolTestHooks;

  StatusOr<std::shared_ptr<Ticket>> Transfer(int32_t handle, void* buffer,
                                             uint64_t bytes, uint64_t offset,
                                             int priority, uint64_t chunk_bytes,
                                             Direction direction,
                                             std::shared_ptr<void> owner);

  ObjectTable& table_;
  UpdateService& updates_;
  // Made by Pool::Create, taken away by Close (under the table's mutex).
  std::unique_ptr<CopyEngine> engine_;
};

}  // namespace jcxl

#endif  // JCXL_FFI_TRANSFERS_H_
