#include "pool_test_hooks.h"

namespace jcxl {

Status PoolTestHooks::InjectFault(const FaultSpec& spec) {
  std::lock_guard<std::mutex> lock(table_.mu_);
  if (table_.closed_ || !transfers_.engine_) {
    return Status(Code::kClosed,
                  "pool " + std::to_string(table_.id_) + " is closed");
  }
  transfers_.engine_->InjectFault(spec);
  return Status::Ok();
}

uint64_t PoolTestHooks::faults_injected() {
  std::lock_guard<std::mutex> lock(table_.mu_);
  return transfers_.engine_ ? transfers_.engine_->faults_injected() : 0;
}

Status PoolTestHooks::HoldUpdates(bool hold) {
  std::lock_guard<std::mutex> lock(table_.mu_);
  if (!updates_.updater_) {
    return Status(Code::kClosed,
                  "pool " + std::to_string(table_.id_) + " is closed");
  }
  updates_.updater_->Hold(hold);
  return Status::Ok();
}

std::vector<uint64_t> PoolTestHooks::QueuedRuns() {
  std::lock_guard<std::mutex> lock(table_.mu_);
  return updates_.updater_ ? updates_.updater_->queued_runs()
                           : std::vector<uint64_t>{};
}

void PoolTestHooks::PromoteRun(uint64_t id) {
  std::lock_guard<std::mutex> lock(table_.mu_);
  if (table_.promote_run_) table_.promote_run_(id);
}

}  // namespace jcxl
