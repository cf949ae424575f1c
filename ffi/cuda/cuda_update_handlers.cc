// The update handlers (ffi/update_handlers.h) for XLA's CUDA platform: the
// same targets, operands and attributes; the run is the host's, so each
// handler copies what it reads and writes between the step's device
// buffers and the host, in compute-stream order.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/cuda_handlers.h"
#include "update_handlers.h"

namespace jcxl::cuda {
namespace {

ffi::Error CudaError(const char* handler, const char* what,
                     cudaError_t error) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string(handler) + ": " + what + ": " +
                        cudaGetErrorString(error));
}

#define JCXL_CUDA_UPDATE_RETURN_IF_ERROR(handler, what, call) \
  do {                                                        \
    cudaError_t error_ = (call);                              \
    if (error_ != cudaSuccess) {                              \
      return CudaError(handler, what, error_);                \
    }                                                         \
  } while (0)

// The scalars come from the step's earlier kernels: synchronizing the
// stream after their copy also makes every store the step queued before
// (what the program reads) land in the pool before the run starts.
ffi::Error UpdateStart(cudaStream_t stream, int32_t ordinal,
                       ffi::Buffer<ffi::F32> scalars,
                       ffi::Result<ffi::Buffer<ffi::S32>> token,
                       int32_t pool_id, int32_t program) {
  const char* handler = "jcxl_update_start";
  if (token->element_count() != 2) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      std::string(handler) + ": the token must be s32[2]");
  }
  JCXL_CUDA_UPDATE_RETURN_IF_ERROR(handler, "cudaSetDevice",
                                   cudaSetDevice(ordinal));
  std::vector<float> host(scalars.element_count());
  if (!host.empty()) {
    JCXL_CUDA_UPDATE_RETURN_IF_ERROR(
        handler, "copying the scalars to the host",
        cudaMemcpyAsync(host.data(), scalars.typed_data(),
                        host.size() * sizeof(float), cudaMemcpyDeviceToHost,
                        stream));
  }
  JCXL_CUDA_UPDATE_RETURN_IF_ERROR(handler, "cudaStreamSynchronize",
                                   cudaStreamSynchronize(stream));
  ffi::ErrorOr<uint64_t> id =
      StartUpdateRun(handler, pool_id, program, host.data(),
                     static_cast<int64_t>(host.size()));
  if (id.has_error()) return id.error();
  int32_t value[2];
  RunIdToToken(*id, value);
  JCXL_CUDA_UPDATE_RETURN_IF_ERROR(
      handler, "copying the token to the device",
      cudaMemcpyAsync(token->typed_data(), value, sizeof(value),
                      cudaMemcpyHostToDevice, stream));
  // `value` is on this stack frame: the copy must be done before it goes.
  JCXL_CUDA_UPDATE_RETURN_IF_ERROR(handler, "cudaStreamSynchronize",
                                   cudaStreamSynchronize(stream));
  return ffi::Error::Success();
}

ffi::Error UpdateDone(cudaStream_t stream, int32_t ordinal,
                      ffi::Buffer<ffi::S32> token,
                      ffi::Result<ffi::Buffer<ffi::S32>> out,
                      int64_t timeout_ms) {
  const char* handler = "jcxl_update_done";
  if (token.element_count() != 2) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      std::string(handler) + ": the token must be s32[2]");
  }
  JCXL_CUDA_UPDATE_RETURN_IF_ERROR(handler, "cudaSetDevice",
                                   cudaSetDevice(ordinal));
  int32_t value[2];
  JCXL_CUDA_UPDATE_RETURN_IF_ERROR(
      handler, "copying the token to the host",
      cudaMemcpyAsync(value, token.typed_data(), sizeof(value),
                      cudaMemcpyDeviceToHost, stream));
  JCXL_CUDA_UPDATE_RETURN_IF_ERROR(handler, "cudaStreamSynchronize",
                                   cudaStreamSynchronize(stream));
  ffi::Error waited =
      WaitUpdateRun(handler, RunIdOfToken(value), timeout_ms);
  if (waited.failure()) return waited;
  JCXL_CUDA_UPDATE_RETURN_IF_ERROR(
      handler, "cudaMemsetAsync",
      cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream));
  return ffi::Error::Success();
}

// A failed update fails the step: the transfers it started are waited for
// first (see AbortExecution).
ffi::Error UpdateStartImpl(cudaStream_t stream, int32_t ordinal,
                           ffi::RunId run, ffi::Buffer<ffi::F32> scalars,
                           ffi::AnyBuffer,
                           ffi::Result<ffi::Buffer<ffi::S32>> token,
                           int32_t pool_id, int32_t program) {
  ffi::Error error = UpdateStart(stream, ordinal, scalars, token, pool_id,
                                 program);
  if (error.failure()) AbortExecution(stream, ordinal, run.run_id);
  return error;
}

ffi::Error UpdateDoneImpl(cudaStream_t stream, int32_t ordinal,
                          ffi::RunId run, ffi::Buffer<ffi::S32> token,
                          ffi::AnyBuffer,
                          ffi::Result<ffi::Buffer<ffi::S32>> out,
                          int64_t timeout_ms) {
  ffi::Error error = UpdateDone(stream, ordinal, token, out, timeout_ms);
  if (error.failure()) AbortExecution(stream, ordinal, run.run_id);
  return error;
}

template <typename Binding>
auto CudaContext(Binding&& binding) {
  return std::move(binding)
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Ctx<ffi::RunId>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kCudaUpdateStart, UpdateStartImpl,
    UpdateStartSignature(CudaContext(ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kCudaUpdateDone, UpdateDoneImpl,
    UpdateDoneSignature(CudaContext(ffi::Ffi::Bind())));

}  // namespace jcxl::cuda
