// Test hooks of a pool: faults injected into its transfers, and its update
// workers held, so that tests can check that every waiter gets an error and
// that Free, Compact and Close wait for what is in flight.
#ifndef JCXL_FFI_POOL_TEST_HOOKS_H_
#define JCXL_FFI_POOL_TEST_HOOKS_H_

#include <cstdint>
#include <vector>

#include "copy_engine.h"
#include "object_table.h"
#include "status.h"
#include "transfers.h"
#include "update_service.h"

namespace jcxl {

class PoolTestHooks {
 public:
  PoolTestHooks(ObjectTable& table, Transfers& transfers,
                UpdateService& updates)
      : table_(table), transfers_(transfers), updates_(updates) {}
  PoolTestHooks(const PoolTestHooks&) = delete;
  PoolTestHooks& operator=(const PoolTestHooks&) = delete;

  // Makes chosen transfers fail or stall (see CopyEngine::InjectFault).
  Status InjectFault(const FaultSpec& spec);
  uint64_t faults_injected();
  // While held, update workers take no new block of a run.
  Status HoldUpdates(bool hold);
  // The ids of the update runs queued (not yet started), in order.
  std::vector<uint64_t> QueuedRuns();
  // As a transfer that waits for run `id` does (HostUpdater::Promote).
  void PromoteRun(uint64_t id);

 private:
  ObjectTable& table_;
  Transfers& transfers_;
  UpdateService& updates_;
};

}  // namespace jcxl

#endif  // JCXL_FFI_POOL_TEST_HOOKS_H_
