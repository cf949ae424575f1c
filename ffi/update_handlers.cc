#include "update_handlers.h"

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "execution_transfers.h"
#include "pool.h"

namespace jcxl {
namespace {

// Past this many runs filed and not taken (steps that failed between a
// start and its done), the finished ones are dropped.
constexpr size_t kMaxFiledRuns = 4096;

// Runs started by jcxl_update_start, by id, until their done takes them.
class FiledRuns {
 public:
  static FiledRuns& Get() {
    static auto* runs = new FiledRuns();
    return *runs;
  }
  void Add(std::shared_ptr<UpdateRun> run) {
    std::lock_guard<std::mutex> lock(mu_);
    if (runs_.size() >= kMaxFiledRuns) {
      for (auto it = runs_.begin(); it != runs_.end();) {
        it = it->second->done() ? runs_.erase(it) : std::next(it);
      }
    }
    const uint64_t id = run->id();
    runs_.emplace(id, std::move(run));
  }
  std::shared_ptr<UpdateRun> Take(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = runs_.find(id);
    if (it == runs_.end()) return nullptr;
    std::shared_ptr<UpdateRun> run = std::move(it->second);
    runs_.erase(it);
    return run;
  }

 private:
  std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<UpdateRun>> runs_;
};

ffi::Error UpdateStart(ffi::Buffer<ffi::F32> scalars,
                       ffi::Result<ffi::Buffer<ffi::S32>> token,
                       int32_t pool_id, int32_t program) {
  const char* handler = "jcxl_update_start";
  if (token->element_count() != 2) {
    return Fail(handler, "the token must be s32[2], got " +
                             std::to_string(token->element_count()) +
                             " elements");
  }
  ffi::ErrorOr<uint64_t> id =
      StartUpdateRun(handler, pool_id, program, scalars.typed_data(),
                     static_cast<int64_t>(scalars.element_count()));
  if (id.has_error()) return id.error();
  RunIdToToken(*id, token->typed_data());
  return ffi::Error::Success();
}

ffi::Error UpdateDone(ffi::Buffer<ffi::S32> token,
                      ffi::Result<ffi::Buffer<ffi::S32>> out,
                      int64_t timeout_ms) {
  const char* handler = "jcxl_update_done";
  if (token.element_count() != 2) {
    return Fail(handler, "the token must be s32[2] (jcxl_update_start's), "
                         "got " + std::to_string(token.element_count()) +
                             " elements");
  }
  ffi::Error waited =
      WaitUpdateRun(handler, RunIdOfToken(token.typed_data()), timeout_ms);
  if (waited.failure()) return waited;
  std::memset(out->untyped_data(), 0, out->size_bytes());
  return ffi::Error::Success();
}

// A failed update fails the step: the copies it has in flight are stopped
// first (see ExecutionTransfers).
ffi::Error UpdateStartImpl(ffi::RunId run, ffi::Buffer<ffi::F32> scalars,
                           ffi::AnyBuffer,
                           ffi::Result<ffi::Buffer<ffi::S32>> token,
                           int32_t pool_id, int32_t program) {
  ffi::Error error = UpdateStart(scalars, token, pool_id, program);
  if (error.failure()) ExecutionTransfers::Get().Abort(run.run_id);
  return error;
}

ffi::Error UpdateDoneImpl(ffi::RunId run, ffi::Buffer<ffi::S32> token,
                          ffi::AnyBuffer,
                          ffi::Result<ffi::Buffer<ffi::S32>> out,
                          int64_t timeout_ms) {
  ffi::Error error = UpdateDone(token, out, timeout_ms);
  if (error.failure()) ExecutionTransfers::Get().Abort(run.run_id);
  return error;
}

}  // namespace

ffi::ErrorOr<uint64_t> StartUpdateRun(const char* handler, int32_t pool_id,
                                      int32_t program, const float* scalars,
                                      int64_t count) {
  std::shared_ptr<Pool> pool = Pool::Find(pool_id);
  if (!pool) {
    return Unexpected(handler, Status(Code::kClosed,
                                      "pool " + std::to_string(pool_id) +
                                          " is closed or was never opened"));
  }
  StatusOr<std::shared_ptr<UpdateRun>> run = pool->updates().StartUpdate(
      program, std::vector<float>(scalars, scalars + count));
  if (!run.ok()) return Unexpected(handler, run.status());
  const uint64_t id = (*run)->id();
  FiledRuns::Get().Add(std::move(*run));
  return id;
}

ffi::Error WaitUpdateRun(const char* handler, uint64_t id,
                         int64_t timeout_ms) {
  std::shared_ptr<UpdateRun> run = FiledRuns::Get().Take(id);
  if (!run) {
    return Fail(handler,
                Status(Code::kNotFound,
                       "no update run " + std::to_string(id) +
                           " is waiting for its done: it was already waited "
                           "for, or the token is not a jcxl_update_start's"));
  }
  // Left to the pool: what reads or writes its objects later waits for it
  // (ObjectTable::AwaitRuns), and fails where it failed.
  if (timeout_ms < 0) return ffi::Error::Success();
  // A run that times out keeps running (it touches only pool objects, never
  // the step's buffers); the step fails and its objects are not ready.
  Status status = run->Wait(TimeoutNs(timeout_ms));
  if (!status.ok()) return Fail(handler, status);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kUpdateStart, UpdateStartImpl,
    UpdateStartSignature(ffi::Ffi::Bind().Ctx<ffi::RunId>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kUpdateDone, UpdateDoneImpl,
    UpdateDoneSignature(ffi::Ffi::Bind().Ctx<ffi::RunId>()));

}  // namespace jcxl
