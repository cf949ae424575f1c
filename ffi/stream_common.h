// What the CPU and CUDA stream handlers share: resolving a (pool, handle,
// slice) against the step's buffer, and turning pool errors into XLA's.
#ifndef JCXL_FFI_STREAM_COMMON_H_
#define JCXL_FFI_STREAM_COMMON_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "pool.h"
#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace jcxl {

namespace ffi = xla::ffi;

ffi::Error Fail(const char* handler, const std::string& message);

// A step's deadline attribute in ns: saturated at kMaxTimeoutNs (a pool's
// timeout_s of 10^10 s would overflow int64 ns), negative as 0.
inline int64_t TimeoutNs(int64_t timeout_ms) {
  if (timeout_ms <= 0) return 0;
  return timeout_ms > kMaxTimeoutNs / 1'000'000 ? kMaxTimeoutNs
                                                : timeout_ms * 1'000'000;
}
// The XLA error code follows the pool's: the step's exception starts with
// its name (DEADLINE_EXCEEDED for a timeout, DATA_LOSS for a failed read or
// write, FAILED_PRECONDITION for a closed pool).
ffi::Error Fail(const char* handler, const Status& status);

// The error branch of an ErrorOr, from the same message Fail() builds.
template <typename... Args>
ffi::Unexpected<ffi::Error> Unexpected(Args&&... args) {
  return ffi::Unexpected<ffi::Error>(Fail(std::forward<Args>(args)...));
}

// A done with no start: the step's buffer is not the one its start saw.
ffi::Error NoTransferInFlight(const char* handler);

// The step's side of a transfer: the buffer's dtype, shape and bytes.
struct BufferShape {
  ffi::DataType dtype;
  std::vector<int64_t> dims;
  uint64_t bytes = 0;
};
BufferShape ShapeOf(const ffi::AnyBuffer& buffer);

// Which object a transfer is for, and which of its slices.
struct Slice {
  int32_t pool_id = 0;
  int32_t handle = 0;
  bool stacked = false;   // a slice along axis 0 (a layer, a row block)
  int64_t block_rows = 0;  // > 0: slices are blocks of this many rows
};

struct Target {
  std::shared_ptr<Pool> pool;
  std::vector<int64_t> object_shape;
  uint64_t offset = 0;  // bytes into the object
};

// Finds the pool and the object and checks that `buffer` matches it (or its
// slice `index`) in dtype and shape. `index` < 0 stands for an index not
// known on the host yet (a GPU's loop counter): the slice's shape is
// checked, and SliceOffset places it once the index is known.
ffi::ErrorOr<Target> Resolve(const char* handler, const Slice& slice,
                             int64_t index, const BufferShape& buffer);

// The byte offset of slice `index` whose shape `buffer` has (as Resolve
// computes it), or kInvalidArgument naming the object when there is none.
StatusOr<uint64_t> SliceOffset(const Slice& slice,
                               const std::vector<int64_t>& object_shape,
                               int64_t index, const BufferShape& buffer);

// The operands, results and attributes of each target, the same on either
// platform (the same call lowers for both); a platform's handler binds its
// context first. Every start takes the object's pool and slice, the copy's
// priority and pieces, and what only the CUDA handlers read: each device's
// handle, a constant slice index, the deadline of a staged copy.
template <typename Binding>
auto WithStartAttrs(Binding&& binding) {
  return std::move(binding)
      .template Attr<int32_t>("pool_id")
      .template Attr<bool>("stacked")
      .template Attr<int64_t>("block_rows")
      .template Attr<int32_t>("priority")
      .template Attr<int64_t>("chunk_bytes")
      .template Attr<ffi::Span<const int32_t>>("device_handles")
      .template Attr<int64_t>("static_index")
      .template Attr<int64_t>("timeout_ms");
}

// (handle, index, after) -> out
template <typename Binding>
auto FetchStartSignature(Binding&& binding) {
  return WithStartAttrs(std::move(binding)
                            .template Arg<ffi::Buffer<ffi::S32>>()
                            .template Arg<ffi::Buffer<ffi::S32>>()
                            .template Arg<ffi::AnyBuffer>()
                            .template Ret<ffi::AnyBuffer>());
}

// (handle, index, after, into) -> into (aliased)
template <typename Binding>
auto FetchStartIntoSignature(Binding&& binding) {
  return WithStartAttrs(std::move(binding)
                            .template Arg<ffi::Buffer<ffi::S32>>()
                            .template Arg<ffi::Buffer<ffi::S32>>()
                            .template Arg<ffi::AnyBuffer>()
                            .template Arg<ffi::AnyBuffer>()
                            .template Ret<ffi::AnyBuffer>());
}

// (in, after) -> in (aliased)
template <typename Binding>
auto FetchDoneSignature(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("timeout_ms");
}

// (x, dep) -> x (aliased)
template <typename Binding>
auto AfterSignature(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}

// (handle, index, in, after) -> in (aliased): FetchStartInto's operands.
template <typename Binding>
auto StoreStartSignature(Binding&& binding) {
  return FetchStartIntoSignature(std::move(binding));
}

// (in) -> token
template <typename Binding>
auto StoreDoneSignature(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("timeout_ms");
}

}  // namespace jcxl

#endif  // JCXL_FFI_STREAM_COMMON_H_
