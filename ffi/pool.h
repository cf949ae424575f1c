// The jcxl pool: tiers of memory outside the device (host DRAM, CXL memory,
// nvme files), objects in them addressed by stable int32 handles, and what
// moves and changes their bytes. A Pool owns one part per job and lends
// each out by reference:
//   objects()    the object table: handles, pins, compaction (object_table.h)
//   transfers()  copies by the pool's copy engine (transfers.h)
//   direct()     memory lent to DMA engines outside the pool (direct_access.h)
//   updates()    update programs and the copies kept fresh (update_service.h)
//   test_hooks() fault injection, held update workers (pool_test_hooks.h)
//
// Lifetime: Python owns each Pool through a shared_ptr; the pool registry
// (Pool::Find) holds weak references so that FFI handlers can reach a pool
// by its id without keeping it alive. Close() fails new requests, waits for
// transfers in flight, then releases every arena.
#ifndef JCXL_FFI_POOL_H_
#define JCXL_FFI_POOL_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>

#include "direct_access.h"
#include "object_table.h"
#include "pool_config.h"
#include "pool_test_hooks.h"
#include "status.h"
#include "transfers.h"
#include "update_service.h"

namespace jcxl {

class Pool {
 public:
  static StatusOr<std::shared_ptr<Pool>> Create(const PoolConfig& config);
  // The open pool with this id, or nullptr.
  static std::shared_ptr<Pool> Find(int32_t id);
  ~Pool();

  int32_t id() const { return table_.id_; }
  ObjectTable& objects() { return table_; }
  Transfers& transfers() { return transfers_; }
  DirectAccess& direct() { return direct_; }
  UpdateService& updates() { return updates_; }
  PoolTestHooks& test_hooks() { return test_hooks_; }

  Status Close(int64_t timeout_ns);
  bool closed() { return table_.closed(); }
  const PoolConfig& config() const { return table_.config_; }

 private:
  explicit Pool(const PoolConfig& config);
  Status Init();

  // Declared in the order they are made: each part reaches the ones before.
  ObjectTable table_;
  UpdateService updates_;
  Transfers transfers_;
  DirectAccess direct_;
  PoolTestHooks test_hooks_;
  // The process that made the pool. In a child it forked, the pool's copy
  // shares the parent's nvme file and lacks the copy engine's threads:
  // Close there forgets the pool without joining, waiting or unlinking.
  pid_t owner_pid_;
};

}  // namespace jcxl

#endif  // JCXL_FFI_POOL_H_
