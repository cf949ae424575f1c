#include "stream_handlers.h"

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pool.h"

namespace ffi = xla::ffi;

namespace jcxl {
namespace {

const char* DTypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::C64: return "complex64";
    case ffi::DataType::C128: return "complex128";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    default: return "unsupported";
  }
}

std::string DimsString(const std::vector<int64_t>& dims) {
  std::string out = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return out + (dims.size() == 1 ? ",)" : ")");
}

ffi::Error Fail(const char* handler, const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string(handler) + ": " + message);
}

// The XLA error code for a pool Status: the step's exception starts with its
// name (DEADLINE_EXCEEDED for a timeout, DATA_LOSS for a failed read or
// write, FAILED_PRECONDITION for a closed pool).
ffi::ErrorCode ErrorCodeOf(Code code) {
  switch (code) {
    case Code::kNotFound:
      return ffi::ErrorCode::kNotFound;
    case Code::kExhausted:
      return ffi::ErrorCode::kResourceExhausted;
    case Code::kClosed:
      return ffi::ErrorCode::kFailedPrecondition;
    case Code::kTimeout:
      return ffi::ErrorCode::kDeadlineExceeded;
    case Code::kIo:
      return ffi::ErrorCode::kDataLoss;
    case Code::kInvalidArgument:
      return ffi::ErrorCode::kInvalidArgument;
    default:
      return ffi::ErrorCode::kInternal;
  }
}

ffi::Error Fail(const char* handler, const Status& status) {
  return ffi::Error(ErrorCodeOf(status.code()),
                    std::string(handler) + ": " + status.message());
}

// How long a `done` whose wait timed out gives the cancelled copy to stop
// before the step fails and XLA may reuse the buffer.
constexpr int64_t kCancelGraceNs = 2'000'000'000;

// Copies in flight, by the address of the buffer they read or write.
class InFlight {
 public:
  static InFlight& Get() {
    static auto* table = new InFlight();
    return *table;
  }
  // A buffer address is reused only once XLA freed the buffer; if a failed
  // step left a copy behind at this address, stop it and let it finish
  // before the new one may run (cancelled, it ends after the chunk it is
  // on).
  void Add(const void* address, std::shared_ptr<Ticket> ticket) {
    std::shared_ptr<Ticket> stale;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto [it, inserted] = tickets_.try_emplace(address, ticket);
      if (!inserted) {
        stale = std::move(it->second);
        it->second = std::move(ticket);
      }
    }
    if (stale) {
      stale->Cancel();
      stale->Wait(INT64_MAX);
    }
  }
  // Puts back a copy that is still running after its `done` gave up, so the
  // next transfer into this address waits for it (see Add).
  void Restore(const void* address, std::shared_ptr<Ticket> ticket) {
    std::lock_guard<std::mutex> lock(mu_);
    tickets_.try_emplace(address, std::move(ticket));
  }
  std::shared_ptr<Ticket> Take(const void* address) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = tickets_.find(address);
    if (it == tickets_.end()) return nullptr;
    std::shared_ptr<Ticket> ticket = std::move(it->second);
    tickets_.erase(it);
    return ticket;
  }

 private:
  std::mutex mu_;
  std::unordered_map<const void*, std::shared_ptr<Ticket>> tickets_;
};

// The error branch of an ErrorOr, from the same message Fail() builds.
template <typename... Args>
ffi::Unexpected<ffi::Error> Unexpected(Args&&... args) {
  return ffi::Unexpected<ffi::Error>(Fail(std::forward<Args>(args)...));
}

struct Target {
  std::shared_ptr<Pool> pool;
  int32_t handle = 0;
  uint64_t offset = 0;  // bytes into the object
};

// Resolves (pool, handle, index) and checks that `buffer` matches the object
// (or its slice `index` when `stacked`) in dtype, shape and bytes.
ffi::ErrorOr<Target> Resolve(const char* handler, int32_t pool_id,
                             ffi::Buffer<ffi::S32> handle,
                             ffi::Buffer<ffi::S32> index, bool stacked,
                             int64_t block_rows, const ffi::AnyBuffer& buffer) {
  if (handle.element_count() != 1 || index.element_count() != 1) {
    return Unexpected(handler, "expects one handle and one index per device, got " +
                             std::to_string(handle.element_count()) + " and " +
                             std::to_string(index.element_count()));
  }
  Target target;
  target.pool = Pool::Find(pool_id);
  if (!target.pool) {
    return Unexpected(handler, Status(Code::kClosed,
                                      "pool " + std::to_string(pool_id) +
                                          " is closed or was never opened"));
  }
  target.handle = handle.typed_data()[0];
  StatusOr<ObjectInfo> info = target.pool->Info(target.handle);
  if (!info.ok()) return Unexpected(handler, info.status());
  auto name = [&] { return "handle " + std::to_string(target.handle); };
  const char* dtype = DTypeName(buffer.element_type());
  if (info->dtype != dtype) {
    return Unexpected(handler, name() + " holds " + info->dtype +
                             " but the step's buffer is " + dtype);
  }
  std::vector<int64_t> expected = info->shape;
  const int64_t i = index.typed_data()[0];
  auto dims = buffer.dimensions();
  std::vector<int64_t> got(dims.begin(), dims.end());
  if (stacked && block_rows > 0) {
    // Block i of `block_rows` rows along axis 0; the last block may be
    // shorter (the buffer says how long).
    const int64_t rows = got.empty() ? 0 : got[0];
    if (expected.empty() || got.size() != expected.size() || rows < 1 ||
        rows > block_rows || rows > expected[0] || i < 0 ||
        i > (expected[0] - rows) / block_rows) {
      return Unexpected(handler,
                  name() + " of shape " + DimsString(info->shape) +
                      " has no block " + std::to_string(i) + " of " +
                      std::to_string(rows) + " rows (blocks of " +
                      std::to_string(block_rows) + " rows)");
    }
    expected[0] = rows;
    if (got != expected) {
      return Unexpected(handler, name() + " holds shape " +
                               DimsString(info->shape) +
                               " but the step's row block has shape " +
                               DimsString(got));
    }
    target.offset = static_cast<uint64_t>(i) * block_rows *
                    (buffer.size_bytes() / rows);
    return target;
  }
  if (stacked) {
    if (expected.empty() || i < 0 || i >= expected[0]) {
      return Unexpected(handler,
                  name() + " of shape " + DimsString(info->shape) +
                      " has no slice " + std::to_string(i));
    }
    expected.erase(expected.begin());
  }
  if (got != expected) {
    return Unexpected(handler, name() + " holds shape " + DimsString(info->shape) +
                             (stacked ? " (one slice of it)" : "") +
                             " but the step's buffer has shape " +
                             DimsString(got));
  }
  target.offset = stacked ? static_cast<uint64_t>(i) * buffer.size_bytes() : 0;
  return target;
}

constexpr size_t kMaxWaits = 1 << 16;
std::mutex g_waits_mu;
std::vector<StreamWait>& Waits() {
  static auto* waits = new std::vector<StreamWait>();
  return *waits;
}

void LogWait(const std::shared_ptr<Ticket>& ticket, int64_t started,
             int64_t ended) {
  StreamWait wait;
  wait.record = ticket->record();
  wait.wait_started_ns = started;
  wait.wait_ns = ended - started;
  std::lock_guard<std::mutex> lock(g_waits_mu);
  if (Waits().size() < kMaxWaits) Waits().push_back(wait);
}

ffi::Error Wait(const char* handler, const void* address, int64_t timeout_ms) {
  std::shared_ptr<Ticket> ticket = InFlight::Get().Take(address);
  if (!ticket) {
    return ffi::Error(
        ffi::ErrorCode::kInternal,
        std::string(handler) +
            ": no transfer in flight for this buffer; XLA must have copied "
            "it between start and done (a start and its done must not be "
            "separated by a loop boundary)");
  }
  const int64_t started = NowNs();
  Status status = ticket->Wait(timeout_ms * 1000000);
  LogWait(ticket, started, NowNs());
  if (!status.ok()) {
    if (!ticket->done()) {
      // The step fails here and XLA frees the buffer: stop the copy first.
      ticket->Cancel();
      if (!ticket->Wait(kCancelGraceNs).ok() && !ticket->done()) {
        InFlight::Get().Restore(address, ticket);
      }
    }
    return Fail(handler, status);
  }
  return ffi::Error::Success();
}

ffi::Error FetchStartImpl(ffi::Buffer<ffi::S32> handle,
                          ffi::Buffer<ffi::S32> index, ffi::AnyBuffer,
                          ffi::Result<ffi::AnyBuffer> out, int32_t pool_id,
                          bool stacked, int64_t block_rows, int32_t priority,
                          int64_t chunk_bytes) {
  auto target = Resolve("jcxl_fetch_start", pool_id, handle, index, stacked,
                        block_rows, *out);
  if (target.has_error()) return target.error();
  StatusOr<std::shared_ptr<Ticket>> ticket = target->pool->Read(
      target->handle, out->untyped_data(), out->size_bytes(), target->offset,
      priority, static_cast<uint64_t>(chunk_bytes));
  if (!ticket.ok()) return Fail("jcxl_fetch_start", ticket.status());
  InFlight::Get().Add(out->untyped_data(), std::move(*ticket));
  return ffi::Error::Success();
}

// As FetchStartImpl, into a buffer the step already holds (aliased to the
// result): a loop can then keep its fetched layers in place in its carry.
ffi::Error FetchStartIntoImpl(ffi::Buffer<ffi::S32> handle,
                              ffi::Buffer<ffi::S32> index, ffi::AnyBuffer after,
                              ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out,
                              int32_t pool_id, bool stacked, int64_t block_rows,
                              int32_t priority, int64_t chunk_bytes) {
  return FetchStartImpl(handle, index, after, out, pool_id, stacked, block_rows,
                        priority, chunk_bytes);
}

ffi::Error FetchDoneImpl(ffi::AnyBuffer in, ffi::AnyBuffer,
                         ffi::Result<ffi::AnyBuffer> out, int64_t timeout_ms) {
  ffi::Error waited = Wait("jcxl_fetch_done", in.untyped_data(), timeout_ms);
  if (waited.failure()) return waited;
  if (out->untyped_data() != in.untyped_data()) {  // not aliased after all
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  }
  return ffi::Error::Success();
}

ffi::Error StoreStartImpl(ffi::Buffer<ffi::S32> handle,
                          ffi::Buffer<ffi::S32> index, ffi::AnyBuffer in,
                          ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out,
                          int32_t pool_id, bool stacked, int64_t block_rows,
                          int32_t priority, int64_t chunk_bytes) {
  auto target = Resolve("jcxl_store_start", pool_id, handle, index, stacked,
                        block_rows, in);
  if (target.has_error()) return target.error();
  if (out->untyped_data() != in.untyped_data()) {  // not aliased after all
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  }
  StatusOr<std::shared_ptr<Ticket>> ticket = target->pool->Write(
      target->handle, out->untyped_data(), out->size_bytes(), target->offset,
      priority, static_cast<uint64_t>(chunk_bytes));
  if (!ticket.ok()) return Fail("jcxl_store_start", ticket.status());
  InFlight::Get().Add(out->untyped_data(), std::move(*ticket));
  return ffi::Error::Success();
}

ffi::Error StoreDoneImpl(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> token,
                         int64_t timeout_ms) {
  ffi::Error waited = Wait("jcxl_store_done", in.untyped_data(), timeout_ms);
  if (waited.failure()) return waited;
  std::memset(token->untyped_data(), 0, token->size_bytes());
  return ffi::Error::Success();
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(kFetchStart, FetchStartImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // handle
                                  .Arg<ffi::Buffer<ffi::S32>>()  // index
                                  .Arg<ffi::AnyBuffer>()         // after
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Attr<int32_t>("pool_id")
                                  .Attr<bool>("stacked")
                                  .Attr<int64_t>("block_rows")
                                  .Attr<int32_t>("priority")
                                  .Attr<int64_t>("chunk_bytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kFetchStartInto, FetchStartIntoImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // handle
                                  .Arg<ffi::Buffer<ffi::S32>>()  // index
                                  .Arg<ffi::AnyBuffer>()         // after
                                  .Arg<ffi::AnyBuffer>()         // into
                                  .Ret<ffi::AnyBuffer>()         // into, aliased
                                  .Attr<int32_t>("pool_id")
                                  .Attr<bool>("stacked")
                                  .Attr<int64_t>("block_rows")
                                  .Attr<int32_t>("priority")
                                  .Attr<int64_t>("chunk_bytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kFetchDone, FetchDoneImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // in
                                  .Arg<ffi::AnyBuffer>()  // after
                                  .Ret<ffi::AnyBuffer>()  // out, aliased
                                  .Attr<int64_t>("timeout_ms"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAfter, AfterImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // dep
                                  .Ret<ffi::AnyBuffer>());  // x, aliased

XLA_FFI_DEFINE_HANDLER_SYMBOL(kStoreStart, StoreStartImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // handle
                                  .Arg<ffi::Buffer<ffi::S32>>()  // index
                                  .Arg<ffi::AnyBuffer>()         // in
                                  .Arg<ffi::AnyBuffer>()         // after
                                  .Ret<ffi::AnyBuffer>()         // out, aliased
                                  .Attr<int32_t>("pool_id")
                                  .Attr<bool>("stacked")
                                  .Attr<int64_t>("block_rows")
                                  .Attr<int32_t>("priority")
                                  .Attr<int64_t>("chunk_bytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kStoreDone, StoreDoneImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // in
                                  .Ret<ffi::AnyBuffer>()  // token
                                  .Attr<int64_t>("timeout_ms"));

}  // namespace jcxl
