#include "stream_handlers.h"

#include <sys/mman.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "execution_transfers.h"
#include "pool.h"
#include "stream_common.h"

namespace jcxl {
namespace {

// Reads the handle and the slice index from the step's (host) operands.
ffi::ErrorOr<Target> ResolveOnHost(const char* handler, int32_t pool_id,
                                   ffi::Buffer<ffi::S32> handle,
                                   ffi::Buffer<ffi::S32> index, bool stacked,
                                   int64_t block_rows,
                                   const ffi::AnyBuffer& buffer) {
  if (handle.element_count() != 1 || index.element_count() != 1) {
    return Unexpected(handler,
                      "expects one handle and one index per device, got " +
                          std::to_string(handle.element_count()) + " and " +
                          std::to_string(index.element_count()));
  }
  Slice slice{pool_id, handle.typed_data()[0], stacked, block_rows};
  const int64_t i = index.typed_data()[0];
  if (stacked && i < 0) {  // < 0 means "not known yet" to Resolve
    return Unexpected(handler, SliceOffset(slice, {0}, i, ShapeOf(buffer))
                                   .status());
  }
  return Resolve(handler, slice, i, ShapeOf(buffer));
}

constexpr size_t kMaxWaits = 1 << 16;
std::mutex g_waits_mu;
std::vector<StreamWait>& Waits() {
  static auto* waits = new std::vector<StreamWait>();
  return *waits;
}
std::unordered_map<int32_t, WaitTotals>& Totals() {
  static auto* totals = new std::unordered_map<int32_t, WaitTotals>();
  return *totals;
}

void LogWait(const std::shared_ptr<Ticket>& ticket, int64_t started,
             int64_t ended) {
  StreamWait wait;
  wait.record = ticket->record();
  wait.wait_started_ns = started;
  wait.wait_ns = ended - started;
  LogStreamWait(wait);
}

}  // namespace

void LogStreamWait(const StreamWait& wait) {
  std::lock_guard<std::mutex> lock(g_waits_mu);
  WaitTotals& totals = Totals()[wait.record.handle];
  (wait.record.direction == Direction::kToPool ? totals.bytes_to_pool
                                               : totals.bytes_from_pool) +=
      wait.record.bytes;
  totals.wait_ns += wait.wait_ns;
  ++totals.transfers;
  if (Waits().size() < kMaxWaits) Waits().push_back(wait);
}

namespace {

// A fetch's destination on XLA:CPU is a new allocation each step, above
// malloc's mmap threshold for a large layer: its first touch faults in
// every 4 KiB page (a 64 MiB embedding took 19 ms to fetch, 4 ms into
// touched memory). Huge pages fault 512x fewer times. Advisory: it changes
// no byte, and is ignored where transparent huge pages are off.
constexpr uint64_t kHugePage = 2ull << 20;
void AdviseHugePages(void* data, uint64_t bytes) {
  if (bytes < 2 * kHugePage) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t last = (begin + bytes) & ~(kHugePage - 1);
  if (last > first) {
    madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
}

ffi::Error Wait(const char* handler, int64_t run, const void* address,
                int64_t timeout_ms) {
  ExecutionTransfers& table = ExecutionTransfers::Get();
  std::shared_ptr<Ticket> ticket = table.Take(address);
  if (!ticket && table.failed(run)) {
    // Another device's part of the execution failed and stopped this copy.
    return Fail(handler, AlreadyFailed(run, "its transfers were stopped"));
  }
  if (!ticket) return NoTransferInFlight(handler);
  const int64_t started = NowNs();
  Status status = ticket->Wait(TimeoutNs(timeout_ms));
  LogWait(ticket, started, NowNs());
  if (!status.ok()) {
    // The step fails here and XLA frees the buffer: stop the copy first.
    ExecutionTransfers::Stop(ticket);
    return Fail(handler, status);
  }
  return ffi::Error::Success();
}

// Files a copy the execution started; refused if the execution failed
// meanwhile on another thread (the copy is stopped).
ffi::Error File(const char* handler, int64_t run, const void* address,
                StatusOr<std::shared_ptr<Ticket>> ticket) {
  if (!ticket.ok()) return Fail(handler, ticket.status());
  Status filed =
      ExecutionTransfers::Get().Add(run, address, std::move(*ticket));
  if (!filed.ok()) return Fail(handler, filed);
  return ffi::Error::Success();
}

// Runs a handler's body; if it fails, the execution fails with it: every
// copy the execution still has in flight is stopped before XLA, seeing the
// error, frees its buffers.
template <typename Body>
ffi::Error FailingStopsTheExecution(ffi::RunId run, Body&& body) {
  ffi::Error error = body();
  if (error.failure()) ExecutionTransfers::Get().Abort(run.run_id);
  return error;
}

ffi::Error FetchStart(int64_t run, ffi::Buffer<ffi::S32> handle,
                      ffi::Buffer<ffi::S32> index,
                      ffi::Result<ffi::AnyBuffer> out, int32_t pool_id,
                      bool stacked, int64_t block_rows, int32_t priority,
                      int64_t chunk_bytes) {
  auto target = ResolveOnHost("jcxl_fetch_start", pool_id, handle, index,
                              stacked, block_rows, *out);
  if (target.has_error()) return target.error();
  AdviseHugePages(out->untyped_data(), out->size_bytes());
  StatusOr<std::shared_ptr<Ticket>> ticket = target->pool->transfers().Read(
      handle.typed_data()[0], out->untyped_data(), out->size_bytes(),
      target->offset, priority, static_cast<uint64_t>(chunk_bytes));
  return File("jcxl_fetch_start", run, out->untyped_data(),
              std::move(ticket));
}

ffi::Error FetchStartImpl(ffi::RunId run, ffi::Buffer<ffi::S32> handle,
                          ffi::Buffer<ffi::S32> index, ffi::AnyBuffer,
                          ffi::Result<ffi::AnyBuffer> out, int32_t pool_id,
                          bool stacked, int64_t block_rows, int32_t priority,
                          int64_t chunk_bytes, ffi::Span<const int32_t>,
                          int64_t, int64_t) {
  return FailingStopsTheExecution(run, [&] {
    return FetchStart(run.run_id, handle, index, out, pool_id, stacked,
                      block_rows, priority, chunk_bytes);
  });
}

// As FetchStartImpl, into a buffer the step already holds (aliased to the
// result): a loop can then keep its fetched layers in place in its carry.
ffi::Error FetchStartIntoImpl(ffi::RunId run, ffi::Buffer<ffi::S32> handle,
                              ffi::Buffer<ffi::S32> index, ffi::AnyBuffer,
                              ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out,
                              int32_t pool_id, bool stacked, int64_t block_rows,
                              int32_t priority, int64_t chunk_bytes,
                              ffi::Span<const int32_t>, int64_t, int64_t) {
  return FailingStopsTheExecution(run, [&] {
    return FetchStart(run.run_id, handle, index, out, pool_id, stacked,
                      block_rows, priority, chunk_bytes);
  });
}

ffi::Error FetchDoneImpl(ffi::RunId run, ffi::AnyBuffer in, ffi::AnyBuffer,
                         ffi::Result<ffi::AnyBuffer> out, int64_t timeout_ms) {
  return FailingStopsTheExecution(run, [&] {
    ffi::Error waited = Wait("jcxl_fetch_done", run.run_id, in.untyped_data(),
                             timeout_ms);
    if (waited.failure()) return waited;
    if (out->untyped_data() != in.untyped_data()) {  // not aliased after all
      std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
    }
    return ffi::Error::Success();
  });
}

ffi::Error StoreStart(int64_t run, ffi::Buffer<ffi::S32> handle,
                      ffi::Buffer<ffi::S32> index, ffi::AnyBuffer in,
                      ffi::Result<ffi::AnyBuffer> out, int32_t pool_id,
                      bool stacked, int64_t block_rows, int32_t priority,
                      int64_t chunk_bytes) {
  auto target = ResolveOnHost("jcxl_store_start", pool_id, handle, index,
                              stacked, block_rows, in);
  if (target.has_error()) return target.error();
  if (out->untyped_data() != in.untyped_data()) {  // not aliased after all
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  }
  StatusOr<std::shared_ptr<Ticket>> ticket = target->pool->transfers().Write(
      handle.typed_data()[0], out->untyped_data(), out->size_bytes(),
      target->offset, priority, static_cast<uint64_t>(chunk_bytes));
  return File("jcxl_store_start", run, out->untyped_data(),
              std::move(ticket));
}

ffi::Error StoreStartImpl(ffi::RunId run, ffi::Buffer<ffi::S32> handle,
                          ffi::Buffer<ffi::S32> index, ffi::AnyBuffer in,
                          ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out,
                          int32_t pool_id, bool stacked, int64_t block_rows,
                          int32_t priority, int64_t chunk_bytes,
                          ffi::Span<const int32_t>, int64_t, int64_t) {
  return FailingStopsTheExecution(run, [&] {
    return StoreStart(run.run_id, handle, index, in, out, pool_id, stacked,
                      block_rows, priority, chunk_bytes);
  });
}

ffi::Error StoreDoneImpl(ffi::RunId run, ffi::AnyBuffer in,
                         ffi::Result<ffi::AnyBuffer> token,
                         int64_t timeout_ms) {
  return FailingStopsTheExecution(run, [&] {
    ffi::Error waited = Wait("jcxl_store_done", run.run_id, in.untyped_data(),
                             timeout_ms);
    if (waited.failure()) return waited;
    std::memset(token->untyped_data(), 0, token->size_bytes());
    return ffi::Error::Success();
  });
}

// Returns `x` (in place) once `dep` exists; reads neither. It orders work
// that no data orders: compute after a fetch is issued, a done after the
// compute it should overlap.
ffi::Error AfterImpl(ffi::AnyBuffer x, ffi::AnyBuffer,
                     ffi::Result<ffi::AnyBuffer> out) {
  if (out->untyped_data() != x.untyped_data()) {  // not aliased after all
    std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
  }
  return ffi::Error::Success();
}

}  // namespace

std::vector<StreamWait> DrainStreamWaits() {
  std::lock_guard<std::mutex> lock(g_waits_mu);
  std::vector<StreamWait> out;
  out.swap(Waits());
  return out;
}

void ClearStreamWaits() {
  std::lock_guard<std::mutex> lock(g_waits_mu);
  Waits().clear();
}

std::unordered_map<int32_t, WaitTotals> DrainWaitTotals() {
  std::lock_guard<std::mutex> lock(g_waits_mu);
  std::unordered_map<int32_t, WaitTotals> out;
  out.swap(Totals());
  return out;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kFetchStart, FetchStartImpl,
    FetchStartSignature(ffi::Ffi::Bind().Ctx<ffi::RunId>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kFetchStartInto, FetchStartIntoImpl,
    FetchStartIntoSignature(ffi::Ffi::Bind().Ctx<ffi::RunId>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kFetchDone, FetchDoneImpl,
    FetchDoneSignature(ffi::Ffi::Bind().Ctx<ffi::RunId>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAfter, AfterImpl,
                              AfterSignature(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kStoreStart, StoreStartImpl,
    StoreStartSignature(ffi::Ffi::Bind().Ctx<ffi::RunId>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kStoreDone, StoreDoneImpl,
    StoreDoneSignature(ffi::Ffi::Bind().Ctx<ffi::RunId>()));

}  // namespace jcxl
