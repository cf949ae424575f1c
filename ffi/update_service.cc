#include "update_service.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <utility>

namespace jcxl {
namespace {

// The elements a shape holds, or -1 if the product overflows int64.
int64_t ElementsOf(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && n > INT64_MAX / d)) return -1;
    n *= d;
  }
  return n;
}

}  // namespace

StatusOr<int32_t> UpdateService::AllocateCopy(int32_t source, std::string dtype,
                                              int64_t timeout_ns) {
  TierKind tier;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  auto program = std::make_shared<UpdateProgram>();
  {
    std::lock_guard<std::mutex> lock(table_.mu_);
    StatusOr<ObjectTable::Object*> found = table_.Lookup(source);
    if (!found.ok()) return found.status();
    const ObjectTable::Object& object = **found;
    const int64_t elements = ElementsOf(object.shape);
    StatusOr<UpdateTarget> checked =
        UpdateTargetOf(source, "the source of a copy", elements);
    if (!checked.ok()) return checked.status();
    if (object.copy_of != 0) {
      return Status(Code::kInvalidArgument,
                    table_.Label(source, object) +
                        " is itself a copy (of handle " +
                        std::to_string(object.copy_of) + "); copy its source");
    }
    if (dtype != "float32" && dtype != "bfloat16") {
      return Status(Code::kInvalidArgument,
                    "a copy is float32 or bfloat16, not " + dtype);
    }
    tier = static_cast<TierKind>(object.tier);
    shape = object.shape;
    bytes = static_cast<uint64_t>(elements) * (dtype == "float32" ? 4 : 2);
    program->num_elements = elements;
    program->inputs.push_back(UpdateInput{});
    program->inputs[0].handle = source;
  }
  StatusOr<int32_t> handle =
      table_.Allocate(tier, bytes, shape, dtype, timeout_ns);
  if (!handle.ok()) return handle;
  std::lock_guard<std::mutex> lock(table_.mu_);
  StatusOr<ObjectTable::Object*> found = table_.Lookup(*handle);
  if (!found.ok()) return found.status();
  program->outputs.push_back(UpdateOutput{0, *handle});
  (*found)->copy_of = source;
  (*found)->refresh = std::move(program);
  return handle;
}

Status UpdateService::RefreshIfStale(int32_t handle) {
  std::unique_lock<std::mutex> lock(table_.mu_);
  // First the runs that write it: a copy a run writes is fresh once done.
  JCXL_RETURN_IF_ERROR(table_.AwaitRuns(lock, handle, Direction::kFromPool));
  // As StartUpdate: a refresh takes addresses, and joins no compaction.
  table_.unpinned_cv_.wait(lock, [this] { return !table_.compacting_; });
  StatusOr<ObjectTable::Object*> found = table_.Lookup(handle);
  if (!found.ok() || (*found)->copy_of == 0) return Status::Ok();
  const ObjectTable::Object& copy = **found;
  StatusOr<ObjectTable::Object*> source = table_.Lookup(copy.copy_of);
  if (!source.ok()) {
    return Status(Code::kNotFound,
                  table_.Label(handle, copy) + " is a copy of handle " +
                      std::to_string(copy.copy_of) +
                      ", which was freed: it can no longer be read");
  }
  if (copy.copied_writes == (*source)->writes) return Status::Ok();
  const uint64_t writes = (*source)->writes;
  std::shared_ptr<UpdateRun> run = copy.refreshing;
  if (run == nullptr || copy.refreshing_writes != writes) {
    StatusOr<std::shared_ptr<UpdateRun>> started =
        StartProgram(lock, copy.refresh, 0, {});
    if (!started.ok()) return started.status();
    run = *started;
    (*found)->refreshing = run;
    (*found)->refreshing_writes = writes;
  }
  lock.unlock();
  Status status = run->Wait(kMaxTimeoutNs);
  if (!status.ok()) {
    return Status(status.code(), "refreshing the copy " +
                                     std::to_string(handle) + ": " +
                                     status.message());
  }
  lock.lock();
  found = table_.Lookup(handle);
  if (found.ok() && (*found)->refreshing == run) {
    (*found)->copied_writes = writes;
    (*found)->refreshing = nullptr;
  }
  return Status::Ok();
}

StatusOr<UpdateTarget> UpdateService::UpdateTargetOf(int32_t handle,
                                                     const std::string& role,
                                                     int64_t elements) {
  StatusOr<ObjectTable::Object*> found = table_.Lookup(handle);
  if (!found.ok()) {
    return Status(found.status().code(),
                  role + ": " + found.status().message());
  }
  const ObjectTable::Object& object = **found;
  UpdateTarget target;
  target.handle = handle;
  if (object.dtype == "float32") {
    target.dtype = UpdateDType::kF32;
  } else if (object.dtype == "bfloat16") {
    target.dtype = UpdateDType::kBF16;
  } else {
    return Status(Code::kInvalidArgument,
                  role + ": " + table_.Label(handle, object) + " holds " +
                      (object.dtype.empty() ? "untyped bytes" : object.dtype) +
                      "; update programs read and write float32 or bfloat16 "
                      "objects");
  }
  const int64_t held = ElementsOf(object.shape);
  const uint64_t item = target.dtype == UpdateDType::kBF16 ? 2 : 4;
  if (held != elements) {
    return Status(Code::kInvalidArgument,
                  role + ": " + table_.Label(handle, object) + " holds " +
                      std::to_string(held) +
                      " elements, but the program is for num_elements = " +
                      std::to_string(elements));
  }
  if (object.allocation.bytes != static_cast<uint64_t>(elements) * item) {
    return Status(Code::kInvalidArgument,
                  role + ": " + table_.Label(handle, object) + " holds " +
                      std::to_string(object.allocation.bytes) +
                      " bytes, not the " +
                      std::to_string(static_cast<uint64_t>(elements) * item) +
                      " of its shape and dtype");
  }
  const ObjectTable::TierArena& arena =
      table_.tiers_[object.tier].arenas[object.arena];
  const uint64_t offset = arena.allocator->OffsetOf(object.allocation);
  if (arena.arena->base() != nullptr) {
    target.memory = arena.arena->base() + offset;
  } else {
    target.file = arena.arena.get();
    target.file_offset = offset;
  }
  return target;
}

StatusOr<int32_t> UpdateService::RegisterUpdate(UpdateProgram program) {
  JCXL_RETURN_IF_ERROR(ValidateUpdateProgram(program));
  if (program.outputs.empty()) {
    return Status(Code::kInvalidArgument,
                  "update program: it writes no object (no outputs)");
  }
  std::lock_guard<std::mutex> lock(table_.mu_);
  if (table_.closed_) {
    return Status(Code::kClosed,
                  "pool " + std::to_string(table_.id_) + " is closed");
  }
  for (size_t i = 0; i < program.inputs.size(); ++i) {
    if (program.inputs[i].kind != UpdateInput::Kind::kObject) continue;
    StatusOr<UpdateTarget> target = UpdateTargetOf(
        program.inputs[i].handle, "update program: input " + std::to_string(i),
        program.num_elements);
    if (!target.ok()) return target.status();
  }
  for (size_t o = 0; o < program.outputs.size(); ++o) {
    const UpdateOutput& out = program.outputs[o];
    StatusOr<UpdateTarget> target = UpdateTargetOf(
        out.handle, "update program: output " + std::to_string(o),
        program.num_elements);
    if (!target.ok()) return target.status();
    const ObjectTable::Object& object =
        table_.objects_.at(ObjectTable::IndexOf(out.handle));
    const bool with_source = std::any_of(
        program.outputs.begin(), program.outputs.end(),
        [&](const UpdateOutput& other) {
          return other.handle == object.copy_of && other.reg == out.reg;
        });
    if (object.copy_of != 0 && !with_source) {
      return Status(Code::kInvalidArgument,
                    "update program: output " + std::to_string(o) + ": " +
                        table_.Label(out.handle, object) +
                        " is a copy the pool keeps of handle " +
                        std::to_string(object.copy_of) +
                        "; a program may write it only from the register "
                        "it writes the source from");
    }
  }
  if (next_update_id_ == INT32_MAX) {
    return Status(Code::kExhausted, "pool " + std::to_string(table_.id_) +
                                        " has registered the most update "
                                        "programs it can");
  }
  const int32_t id = next_update_id_++;
  updates_[id] = std::make_shared<const UpdateProgram>(std::move(program));
  return id;
}

Status UpdateService::ReleaseUpdate(int32_t id) {
  std::lock_guard<std::mutex> lock(table_.mu_);
  if (table_.closed_) {
    return Status(Code::kClosed,
                  "pool " + std::to_string(table_.id_) + " is closed");
  }
  if (updates_.erase(id) == 0) {
    return Status(Code::kNotFound, "update program " + std::to_string(id) +
                                       " is unknown to pool " +
                                       std::to_string(table_.id_) +
                                       " (released, or never registered)");
  }
  return Status::Ok();
}

StatusOr<std::shared_ptr<UpdateRun>> UpdateService::StartUpdate(
    int32_t id, std::vector<float> scalars) {
  std::unique_lock<std::mutex> lock(table_.mu_);
  // Addresses are taken now: no compaction may be moving objects.
  table_.unpinned_cv_.wait(lock, [this] { return !table_.compacting_; });
  if (table_.closed_) {
    return Status(Code::kClosed,
                  "pool " + std::to_string(table_.id_) + " is closed");
  }
  auto it = updates_.find(id);
  if (it == updates_.end()) {
    return Status(Code::kNotFound, "update program " + std::to_string(id) +
                                       " is unknown to pool " +
                                       std::to_string(table_.id_) +
                                       " (released, or never registered)");
  }
  return StartProgram(lock, it->second, id, std::move(scalars));
}

StatusOr<std::shared_ptr<UpdateRun>> UpdateService::StartProgram(
    std::unique_lock<std::mutex>& lock,
    std::shared_ptr<const UpdateProgram> shared, int32_t id,
    std::vector<float> scalars) {
  (void)lock;  // held
  const UpdateProgram& program = *shared;
  const std::string name = id == 0 ? "the refresh of a copy"
                                   : "update program " + std::to_string(id);
  if (scalars.size() != static_cast<size_t>(program.num_scalars)) {
    return Status(Code::kInvalidArgument,
                  name + " takes " + std::to_string(program.num_scalars) +
                      " scalars per run, but got " +
                      std::to_string(scalars.size()));
  }
  UpdateJob job;
  job.program = std::move(shared);
  job.program_id = id;
  job.scalars = std::move(scalars);
  job.in.resize(program.inputs.size());
  job.out.resize(program.outputs.size());
  std::vector<uint32_t> pinned;  // distinct object indices
  // Objects on one node's memory run on that node's workers.
  int node = -2;  // -2: none seen yet
  auto resolve = [&](int32_t handle, const std::string& role,
                     UpdateTarget* target) -> Status {
    StatusOr<UpdateTarget> found =
        UpdateTargetOf(handle, name + ": " + role, program.num_elements);
    if (!found.ok()) return found.status();
    *target = *found;
    const ObjectTable::Object& object =
        table_.objects_.at(ObjectTable::IndexOf(handle));
    if (!object.damage.empty()) {
      // It would carry what a failed run left on, as if it were right.
      return Status(Code::kInvalidArgument,
                    name + ": " + role + ": " + table_.Label(handle, object) +
                        " cannot be used: " + object.damage);
    }
    if (target->memory != nullptr) {
      const int arena_node =
          table_.tiers_[object.tier].arenas[object.arena].node;
      const bool bound =
          arena_node >= 0 && !table_.config_.tiers[object.tier].emulated;
      node = node == -2 && bound           ? arena_node
             : node == arena_node && bound ? node
                                           : -1;
    }
    if (std::find(pinned.begin(), pinned.end(), ObjectTable::IndexOf(handle)) ==
        pinned.end()) {
      pinned.push_back(ObjectTable::IndexOf(handle));
    }
    return Status::Ok();
  };
  for (size_t i = 0; i < program.inputs.size(); ++i) {
    if (program.inputs[i].kind != UpdateInput::Kind::kObject) continue;
    JCXL_RETURN_IF_ERROR(resolve(program.inputs[i].handle,
                                 "input " + std::to_string(i) +
                                     " (freed since the program was "
                                     "registered?)",
                                 &job.in[i]));
  }
  for (size_t o = 0; o < program.outputs.size(); ++o) {
    JCXL_RETURN_IF_ERROR(resolve(program.outputs[o].handle,
                                 "output " + std::to_string(o) +
                                     " (freed since the program was "
                                     "registered?)",
                                 &job.out[o]));
  }
  job.node = node < 0 ? -1 : node;
  // What it writes, and the copies it writes beside their sources (fresh
  // once it succeeds: RegisterUpdate checked they come from one register).
  std::vector<uint32_t> written;
  std::vector<std::pair<uint32_t, uint32_t>> copies;  // (copy, source)
  for (const UpdateOutput& out : program.outputs) {
    written.push_back(ObjectTable::IndexOf(out.handle));
    const int32_t source =
        table_.objects_.at(ObjectTable::IndexOf(out.handle)).copy_of;
    if (source != 0 && id != 0) {
      copies.emplace_back(ObjectTable::IndexOf(out.handle),
                          ObjectTable::IndexOf(source));
    }
  }
  // Its id, set below once Submit gives it (before on_complete can run:
  // that takes the table's mutex, held here).
  auto run_id = std::make_shared<uint64_t>(0);
  job.on_complete = [this, pinned, written, copies,
                     run_id](const Status& status) {
    {
      std::lock_guard<std::mutex> relock(table_.mu_);
      for (uint32_t index : pinned) {
        auto found = table_.objects_.find(index);
        if (found == table_.objects_.end()) continue;
        --found->second.pins;
        std::vector<std::pair<uint64_t, bool>>& runs = found->second.runs;
        runs.erase(std::remove_if(runs.begin(), runs.end(),
                                  [&](const std::pair<uint64_t, bool>& r) {
                                    return r.first == *run_id;
                                  }),
                   runs.end());
      }
      for (uint32_t index : written) {
        auto found = table_.objects_.find(index);
        if (found == table_.objects_.end()) continue;
        ++found->second.writes;
        if (!status.ok()) found->second.damage = status.message();
      }
      for (const auto& [copy, source] : copies) {
        auto c = table_.objects_.find(copy);
        auto s = table_.objects_.find(source);
        if (status.ok() && c != table_.objects_.end() &&
            s != table_.objects_.end()) {
          c->second.copied_writes = s->second.writes;
        }
      }
      table_.total_pins_ -= static_cast<int>(pinned.size());
      --runs_not_done_;
    }
    table_.unpinned_cv_.notify_all();
  };
  // Pinned before the updater may run it: its completion takes the table's
  // mutex, held here until the pins are counted.
  for (uint32_t index : pinned) ++table_.objects_.at(index).pins;
  table_.total_pins_ += static_cast<int>(pinned.size());
  StatusOr<std::shared_ptr<UpdateRun>> run = updater_->Submit(std::move(job));
  if (!run.ok()) {
    for (uint32_t index : pinned) --table_.objects_.at(index).pins;
    table_.total_pins_ -= static_cast<int>(pinned.size());
    table_.unpinned_cv_.notify_all();
    return run;
  }
  // Until it is done, transfers of its objects wait for it (AwaitRuns).
  ++runs_not_done_;
  *run_id = (*run)->id();
  for (uint32_t index : pinned) {
    table_.objects_.at(index).runs.emplace_back(
        *run_id,
        std::find(written.begin(), written.end(), index) != written.end());
  }
  return run;
}

Status UpdateService::WaitForRuns(int64_t timeout_ns) {
  std::unique_lock<std::mutex> lock(table_.mu_);
  if (!table_.unpinned_cv_.wait_for(
          lock, std::chrono::nanoseconds(std::min(timeout_ns, kMaxTimeoutNs)),
          [this] { return runs_not_done_ == 0; })) {
    return Status(Code::kTimeout,
                  std::to_string(runs_not_done_) +
                      " update runs still not done after " +
                      std::to_string(timeout_ns / 1000000) + " ms");
  }
  return Status::Ok();
}

UpdateStats UpdateService::update_stats() {
  std::lock_guard<std::mutex> lock(table_.mu_);
  return updater_ ? updater_->stats() : closed_update_stats_;
}

}  // namespace jcxl
