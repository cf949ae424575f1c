#include "execution_transfers.h"

#include <string>
#include <utility>
#include <vector>

namespace jcxl {

Status AlreadyFailed(int64_t run, const std::string& what) {
  return Status(Code::kInternal,
                "execution " + std::to_string(run) +
                    " already failed (an earlier error of this step): " +
                    what);
}

ExecutionTransfers& ExecutionTransfers::Get() {
  static auto* table = new ExecutionTransfers();
  return *table;
}

void ExecutionTransfers::Stop(const std::shared_ptr<Ticket>& ticket) {
  ticket->Cancel();
  // Cancelled, a copy ends after the chunk it is on (an injected stall or an
  // emulated link's wait ends at once): no deadline, the buffer's life
  // depends on it.
  ticket->Wait(kMaxTimeoutNs);
  while (!ticket->done()) ticket->Wait(kMaxTimeoutNs);
}

Status ExecutionTransfers::Add(int64_t run, const void* buffer,
                               std::shared_ptr<Ticket> ticket) {
  std::shared_ptr<Ticket> stale;
  bool refused = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.count(run)) {
      refused = true;
    } else {
      auto [it, inserted] = filed_.try_emplace(buffer, Filed{run, ticket});
      if (!inserted) {
        stale = std::move(it->second.ticket);
        it->second = Filed{run, ticket};
      }
    }
  }
  // A buffer address is reused only once XLA freed the buffer, so a copy
  // still filed there belongs to an execution that is over.
  if (stale) Stop(stale);
  if (refused) {
    Stop(ticket);
    return AlreadyFailed(run, "this transfer was stopped before it ran");
  }
  return Status::Ok();
}

std::shared_ptr<Ticket> ExecutionTransfers::Take(const void* buffer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = filed_.find(buffer);
  if (it == filed_.end()) return nullptr;
  std::shared_ptr<Ticket> ticket = std::move(it->second.ticket);
  filed_.erase(it);
  return ticket;
}

int ExecutionTransfers::Abort(int64_t run) {
  std::vector<std::shared_ptr<Ticket>> stopping;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.insert(run).second) {
      failed_order_.push_back(run);
      if (failed_order_.size() > kMaxFailedRuns) {
        failed_.erase(failed_order_.front());
        failed_order_.pop_front();
      }
    }
    for (auto it = filed_.begin(); it != filed_.end();) {
      if (it->second.run == run) {
        stopping.push_back(std::move(it->second.ticket));
        it = filed_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // Cancel them all first, so that they stop together.
  for (const auto& ticket : stopping) ticket->Cancel();
  for (const auto& ticket : stopping) Stop(ticket);
  return static_cast<int>(stopping.size());
}

bool ExecutionTransfers::failed(int64_t run) {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_.count(run) > 0;
}

size_t ExecutionTransfers::in_flight() {
  std::lock_guard<std::mutex> lock(mu_);
  return filed_.size();
}

}  // namespace jcxl
