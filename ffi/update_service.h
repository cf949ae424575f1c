// A pool's update service: update programs (update_program.h) registered on
// the pool and run on its own objects in place by its update workers
// (host_update.h), their statistics, and the copies of objects the pool
// keeps fresh (a bfloat16 copy of float32 master weights) with the same
// workers.
#ifndef JCXL_FFI_UPDATE_SERVICE_H_
#define JCXL_FFI_UPDATE_SERVICE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "host_update.h"
#include "object_table.h"
#include "status.h"
#include "update_program.h"

namespace jcxl {

class UpdateService {
 public:
  explicit UpdateService(ObjectTable& table) : table_(table) {}
  UpdateService(const UpdateService&) = delete;
  UpdateService& operator=(const UpdateService&) = delete;

  // Checks the program and that every object it reads or writes is in this
  // pool and holds exactly num_elements float32 or bfloat16 elements;
  // returns the program's id.
  StatusOr<int32_t> RegisterUpdate(UpdateProgram program);
  Status ReleaseUpdate(int32_t id);
  // Starts a run of program `id` with `scalars` (num_scalars of them).
  // Its objects stay pinned, as during a transfer (Free and Compact wait),
  // until it is done; an object freed since the program was registered
  // fails the start (kNotFound, naming it). Runs go in the order started.
  StatusOr<std::shared_ptr<UpdateRun>> StartUpdate(int32_t id,
                                                   std::vector<float> scalars);
  UpdateStats update_stats();
  // Waits until every run started is done (kTimeout past `timeout_ns`).
  Status WaitForRuns(int64_t timeout_ns);

  // A copy of object `source` in `dtype` ("float32" or "bfloat16", the
  // source too), in the source's tier, that the pool keeps equal to the
  // source converted (round to nearest even): a read of the copy after the
  // source was written by anything else first converts the source anew.
  // An update program that writes the source may write the copy from the
  // same register (one pass, the copy then fresh); nothing else may write
  // it. Lets a device fetch bfloat16 weights of float32 master weights.
  StatusOr<int32_t> AllocateCopy(int32_t source, std::string dtype,
                                 int64_t timeout_ns = kMaxTimeoutNs);
  // Before a read of `handle`: waits for the runs that write it
  // (ObjectTable::AwaitRuns); then a copy whose source was written since it
  // was made is converted anew (waiting for the update workers).
  Status RefreshIfStale(int32_t handle);

 private:
  friend class Pool;
  friend class PoolTestHooks;

  // Starts a run of `program` (`id` 0: the pool's own); `lock` holds the
  // table's mutex, taken once no compaction runs (the run's addresses are
  // taken now).
  StatusOr<std::shared_ptr<UpdateRun>> StartProgram(
      std::unique_lock<std::mutex>& lock,
      std::shared_ptr<const UpdateProgram> program, int32_t id,
      std::vector<float> scalars);
  // Where an update program's `role` ("input 2") object is, after checking
  // it holds `elements` float32 or bfloat16 elements; caller holds the
  // table's mutex.
  StatusOr<UpdateTarget> UpdateTargetOf(int32_t handle, const std::string& role,
                                        int64_t elements);

  ObjectTable& table_;
  // All below under the table's mutex.
  // Update programs by id; a run holds its own reference.
  std::map<int32_t, std::shared_ptr<const UpdateProgram>> updates_;
  int32_t next_update_id_ = 1;
  // Made by Pool::Create, taken away by Close.
  std::unique_ptr<HostUpdater> updater_;
  UpdateStats closed_update_stats_;  // what updater_ counted, once closed
  int64_t runs_not_done_ = 0;        // started, their on_complete not run
};

}  // namespace jcxl

#endif  // JCXL_FFI_UPDATE_SERVICE_H_
