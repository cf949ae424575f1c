// The stream handlers for XLA's CUDA platform: the same six targets as
// ffi/stream_handlers.h (same names, operands and attributes), moving bytes
// between the pool and GPU memory without blocking the host.
//
//   fetch_start  the compute stream records "ready"; the device's
//                to-device copy stream waits for it, then copies the object
//                (or slice) into the step's buffer with cudaMemcpyAsync in
//                chunk_bytes pieces, and records "done".
//   fetch_done   the compute stream waits for "done" (no host wait).
//   store_start  the from-device copy stream waits for "ready", copies the
//                buffer into the pool, records "done"; store_done waits for
//                it on the compute stream.
//   after        returns its operand (ordering only).
//
// Where the bytes come from:
//   direct  an object of the host tier, or of a cxl tier on real CXL memory
//           (no link model), whose slice is known when the fetch is issued:
//           the DMA reads (writes) the pool's memory itself. Each memory
//           arena is page-locked once (cudaHostRegister) on first use and
//           unregistered when its pool closes.
//   staged  the nvme tier, a tier behind a link model (an emulated cxl
//           tier, which must keep its emulated bandwidth), and slices whose
//           index lives on the device (a loop counter): a host function on
//           the copy stream, run in stream order, reads the index, lets the
//           pool's copy engine move the bytes through a page-locked bounce
//           buffer, and the DMA moves the bounce buffer. Its `done` blocks
//           the host until that transfer ended, so that a failed read or
//           write surfaces as the step's error, never as silent garbage.
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

// Host <-> device bandwidth of plain cudaMemcpyAsync between page-locked
// host memory (cudaHostAlloc) and device memory, on device `ordinal`: the
// baseline the pool's transfers are measured against. Bytes per second, or
// a negative CUDA error code (no device, no driver).
double MemcpyBandwidth(int ordinal, uint64_t bytes, bool to_device,
                       int repeats);

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
