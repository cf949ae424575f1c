// The stream handlers for XLA's CUDA platform: the same six targets as
// ffi/stream_handlers.h (same names, operands and attributes), moving bytes
// between the pool and GPU memory without blocking the host.
//
//   fetch_start  records "ready" on the compute stream (after copying a
//                device-side slice index into a page-locked slot there) and
//                queues the copy on the device's to-device copy stream.
//   fetch_done   the compute stream waits for the copy's "done" event.
//   store_start  the same on the from-device copy stream; store_done waits.
//   after        returns its operand (ordering only).
//
// Which path a transfer takes (direct DMA from page-locked pool memory, or
// staged through a bounce buffer), the threads, lifetimes and page locking
// are DeviceTransfers' (ffi/device_transfers.h); this file implements its
// device interface with the CUDA runtime and binds the FFI handlers. No
// CUDA host function is used.
//
// The handle of each device comes from the `device_handles` attribute
// (ordinal, handle pairs: the PoolArray's handles are static in a compiled
// step), the slice index from `static_index` when it is a constant (>= 0),
// else from the index operand on the device.
#ifndef JCXL_FFI_CUDA_CUDA_HANDLERS_H_
#define JCXL_FFI_CUDA_CUDA_HANDLERS_H_

#include <cstdint>
#include <map>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jcxl::cuda {

XLA_FFI_DECLARE_HANDLER_SYMBOL(kCudaFetchStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCudaFetchStartInto);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCudaFetchDone);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCudaAfter);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCudaStoreStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCudaStoreDone);
// The update handlers' twins (ffi/update_handlers.h), in
// cuda_update_handlers.cc.
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCudaUpdateStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCudaUpdateDone);

// Host <-> device bandwidth of plain cudaMemcpyAsync between page-locked
// host memory (cudaHostAlloc) and device memory, on device `ordinal`: the
// baseline the pool's transfers are measured against. Bytes per second, or
// a negative CUDA error code (no device, no driver).
double MemcpyBandwidth(int ordinal, uint64_t bytes, bool to_device,
                       int repeats);

// Execution `run` fails: the compute stream `stream` (a cudaStream_t) of
// device `ordinal` waits for every transfer the execution started and no
// `done` took, before XLA frees its buffers on that stream. Every CUDA
// handler calls it before it returns an error.
void AbortExecution(void* stream, int ordinal, int64_t run);

// Returns once every transfer issued so far has completed and been logged
// (LogStreamWait): the completion thread logs each one shortly after it
// ends, and a step's profile must see all of its own.
void Flush();

// What the transfers so far did, summed over devices: direct, direct after
// reading a device index, staged (and staged because page-locking failed),
// stale waits, failures, and the bounce buffers' allocations and reuses.
std::map<std::string, uint64_t> Counters();

// The number of CUDA devices (0 without a driver or a device).
int DeviceCount();

}  // namespace jcxl::cuda

#endif  // JCXL_FFI_CUDA_CUDA_HANDLERS_H_
