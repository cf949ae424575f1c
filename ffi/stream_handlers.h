// XLA FFI handlers that stream pool objects into and out of a jitted step,
// as pairs that overlap the copy with compute (the pattern XLA's own
// copy-start / copy-done follows; docs/design.md says why):
//
//   jcxl_fetch_start(handle, index, after) -> buffer   queue pool -> buffer
//   jcxl_fetch_start_into(handle, index, after, buffer) -> buffer (aliased)
//   jcxl_fetch_done(buffer, after) -> buffer (aliased) wait for that copy
//   jcxl_after(x, dep) -> x (aliased)                  order, no data moved
//   jcxl_store_start(handle, index, buffer, after) -> buffer (aliased)
//   jcxl_store_done(buffer) -> token                   wait for that copy
//
// `after` is ignored by the handler: it is a data dependency that keeps XLA
// from issuing the transfer before the value it names exists, which bounds
// how many streamed buffers are live at once. Handlers reach pools through
// Pool::Find(pool_id); copies in flight are filed by their buffer's address
// and their execution's RunId (ExecutionTransfers), so a `done` that receives
// a copy of the buffer fails loudly, and a handler that fails first stops
// every copy its execution started (XLA frees the buffers on an error).
#ifndef JCXL_FFI_STREAM_HANDLERS_H_
#define JCXL_FFI_STREAM_HANDLERS_H_

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "copy_engine.h"
#include "xla/ffi/api/ffi.h"

namespace jcxl {

// One `done` of a streamed transfer: how long the step blocked on it.
struct StreamWait {
  TransferRecord record;  // the copy itself (handle, bytes, times)
  int64_t wait_started_ns = 0;
  int64_t wait_ns = 0;  // time the step spent blocked in `done`
};

// Logs one `done` wait (the CUDA handlers log theirs here too, so that the
// profiler and report() see every platform's transfers).
void LogStreamWait(const StreamWait& wait);

// The `done` waits since the last call (bounded history), oldest first.
std::vector<StreamWait> DrainStreamWaits();

// Forgets the waits logged so far (the totals below are kept): a step
// about to be measured starts an empty history without handing the
// earlier steps' waits, up to the whole bound, to Python.
void ClearStreamWaits();

// What one pool object's waited-for transfers add up to. Kept for every
// wait, however many: the history of single waits above is bounded.
struct WaitTotals {
  uint64_t bytes_to_pool = 0;
  uint64_t bytes_from_pool = 0;
  int64_t wait_ns = 0;
  uint64_t transfers = 0;
};

// Per object handle, the totals since the last call.
std::unordered_map<int32_t, WaitTotals> DrainWaitTotals();

XLA_FFI_DECLARE_HANDLER_SYMBOL(kFetchStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kFetchStartInto);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kFetchDone);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kAfter);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kStoreStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kStoreDone);

}  // namespace jcxl

#endif  // JCXL_FFI_STREAM_HANDLERS_H_
