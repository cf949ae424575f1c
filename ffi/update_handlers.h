// XLA FFI handlers that run an update program (update_program.h) on pool
// objects from inside a jitted step, as a start/done pair:
//
//   jcxl_update_start(scalars: f32[N], after) -> token: s32[2]
//       attributes pool_id: i32, program: i32. Reads the run's N scalars
//       (the step's learning rate, bias corrections...), starts the run on
//       the pool's update workers and returns at once; the token holds the
//       run's id (low and high 32 bits), by which its done finds it.
//   jcxl_update_done(token: s32[2], after) -> s32[1]
//       attribute timeout_ms: i64. Waits for the run; its error, or a
//       timeout, fails the step with a message naming the program.
//
// Both are side-effecting (the objects change in place). `after` is only a
// data dependency: the start must come after the stores of what the
// program reads (the gradients), the done before the fetches of what it
// writes. Runs are by id, not by buffer address, so XLA may copy the token.
// A handler that fails first stops the copies its execution has in flight
// (execution_transfers.h): XLA frees the execution's buffers on the error.
#ifndef JCXL_FFI_UPDATE_HANDLERS_H_
#define JCXL_FFI_UPDATE_HANDLERS_H_

#include <cstdint>
#include <memory>

#include "host_update.h"
#include "status.h"
#include "stream_common.h"
#include "xla/ffi/api/ffi.h"

namespace jcxl {

// What the CPU and CUDA handlers share, on host values: starts a run of
// `program` in pool `pool_id` and files it for its done; the run's id.
ffi::ErrorOr<uint64_t> StartUpdateRun(const char* handler, int32_t pool_id,
                                      int32_t program, const float* scalars,
                                      int64_t count);
// Takes the run filed under `id` and waits for it (`timeout_ms` < 0: does
// not; the pool orders later transfers of its objects after it).
ffi::Error WaitUpdateRun(const char* handler, uint64_t id,
                         int64_t timeout_ms);

inline void RunIdToToken(uint64_t id, int32_t token[2]) {
  token[0] = static_cast<int32_t>(static_cast<uint32_t>(id));
  token[1] = static_cast<int32_t>(static_cast<uint32_t>(id >> 32));
}

inline uint64_t RunIdOfToken(const int32_t token[2]) {
  return static_cast<uint64_t>(static_cast<uint32_t>(token[0])) |
         (static_cast<uint64_t>(static_cast<uint32_t>(token[1])) << 32);
}

// (scalars, after) -> token
template <typename Binding>
auto UpdateStartSignature(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Attr<int32_t>("pool_id")
      .template Attr<int32_t>("program");
}

// (token, after) -> s32[1]
template <typename Binding>
auto UpdateDoneSignature(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Attr<int64_t>("timeout_ms");
}

XLA_FFI_DECLARE_HANDLER_SYMBOL(kUpdateStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kUpdateDone);

}  // namespace jcxl

#endif  // JCXL_FFI_UPDATE_HANDLERS_H_
