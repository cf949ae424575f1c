#include "pool.h"

#include <unistd.h>

#include <map>
#include <mutex>
#include <utility>

namespace jcxl {
namespace {

std::mutex g_registry_mu;
std::map<int32_t, std::weak_ptr<Pool>>& Registry() {
  static auto* registry = new std::map<int32_t, std::weak_ptr<Pool>>();
  return *registry;
}
int32_t g_next_pool_id = 1;

}  // namespace

Pool::Pool(const PoolConfig& config)
    : table_(config),
      updates_(table_),
      transfers_(table_, updates_),
      direct_(table_, updates_),
      test_hooks_(table_, transfers_, updates_),
      owner_pid_(getpid()) {}

StatusOr<std::shared_ptr<Pool>> Pool::Create(const PoolConfig& config) {
  std::shared_ptr<Pool> pool(new Pool(config));
  JCXL_RETURN_IF_ERROR(pool->Init());
  std::lock_guard<std::mutex> lock(g_registry_mu);
  pool->table_.id_ = g_next_pool_id++;
  Registry()[pool->table_.id_] = pool;
  return pool;
}

std::shared_ptr<Pool> Pool::Find(int32_t id) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = Registry().find(id);
  return it == Registry().end() ? nullptr : it->second.lock();
}

Status Pool::Init() {
  JCXL_RETURN_IF_ERROR(table_.Init());
  const PoolConfig& config = table_.config_;
  transfers_.engine_ = std::make_unique<CopyEngine>(
      config.copy_threads, config.chunk_bytes, config.copy_cpus);
  if (config.update_threads < 0) {
    return Status(Code::kInvalidArgument,
                  "update_threads must be >= 0 (0: one per CPU), got " +
                      std::to_string(config.update_threads));
  }
  updates_.updater_ = std::make_unique<HostUpdater>(
      config.update_threads,
      /*staging=*/config.tiers[static_cast<int>(TierKind::kNvme)].capacity > 0);
  // Under the table's mutex, which guards updater_ (Close takes it away).
  table_.promote_run_ = [this](uint64_t run) {
    if (updates_.updater_) updates_.updater_->Promote(run);
  };
  return Status::Ok();
}

Pool::~Pool() {
  if (!closed()) Close(/*timeout_ns=*/60'000'000'000);
  std::lock_guard<std::mutex> lock(g_registry_mu);
  Registry().erase(id());
}

Status Pool::Close(int64_t timeout_ns) {
  std::unique_lock<std::mutex> lock(table_.mu_);
  if (table_.closed_) {
    return Status(Code::kClosed,
                  "pool " + std::to_string(id()) + " is already closed");
  }
  table_.closed_ = true;  // from here every new request fails
  if (getpid() != owner_pid_) {
    // A forked child's copy (see owner_pid_): leaked on purpose.
    (void)transfers_.engine_.release();
    (void)updates_.updater_.release();
    for (ObjectTable::Tier& tier : table_.tiers_) {
      for (ObjectTable::TierArena& arena : tier.arenas) {
        (void)arena.arena.release();
      }
      tier.arenas.clear();
    }
    direct_.on_close_.clear();
    return Status::Ok();
  }
  // Let transfers already queued finish; past the timeout they are failed.
  Status waited = table_.WaitUnpinned(lock, timeout_ns, -1);
  // Taken under the lock (DrainRecords and Transfer read the engine),
  // destroyed outside it: its workers' completions take the lock to unpin.
  std::unique_ptr<CopyEngine> engine = std::move(transfers_.engine_);
  std::unique_ptr<HostUpdater> updater = std::move(updates_.updater_);
  updates_.updates_.clear();
  lock.unlock();
  engine.reset();  // joins the workers; queued transfers fail as kClosed
  // Likewise: queued runs fail as kClosed, one past the timeout stops
  // after its blocks under way; none touches the arenas after this.
  if (updater) {
    const UpdateStats final_stats = updater->stats();
    updater.reset();
    std::lock_guard<std::mutex> relock(table_.mu_);
    updates_.closed_update_stats_ = final_stats;
  }
  std::vector<std::function<void()>> on_close;
  lock.lock();
  on_close.swap(direct_.on_close_);
  lock.unlock();
  for (auto& fn : on_close) fn();
  lock.lock();
  table_.ReleaseAll();
  return waited.ok()
             ? Status::Ok()
             : Status(Code::kTimeout,
                      "pool closed, but " + waited.message() + " were failed");
}

}  // namespace jcxl
