#include "cuda/cuda_handlers.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "device_transfers.h"
#include "link_model.h"
#include "pool.h"
#include "stream_common.h"
#include "stream_handlers.h"

namespace jcxl::cuda {
namespace {

// Every CUDA handler's context: XLA's compute stream and the device.
template <typename Binding>
auto CudaContext(Binding&& binding) {
  return std::move(binding)
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Ctx<ffi::RunId>();
}

ffi::Error CudaFail(const char* handler, const char* what, cudaError_t error) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string(handler) + ": " + what + ": " +
                        cudaGetErrorString(error));
}

#define JCXL_CUDA_RETURN_IF_ERROR(handler, what, call) \
  do {                                                 \
    cudaError_t error_ = (call);                       \
    if (error_ != cudaSuccess) {                       \
      return CudaFail(handler, what, error_);          \
    }                                                  \
  } while (0)

DeviceEvent ToHandle(cudaEvent_t event) {
  return reinterpret_cast<DeviceEvent>(event);
}
cudaEvent_t ToEvent(DeviceEvent event) {
  return reinterpret_cast<cudaEvent_t>(event);
}

Status CudaStatus(const char* what, cudaError_t error) {
  if (error == cudaSuccess) return Status::Ok();
  return Status(Code::kInternal, std::string(what) + ": " +
                                     cudaGetErrorString(error));
}

// Page-locks chunks of a pool's arenas (portable: every device's DMA may
// use them).
class CudaLocker : public PageLocker {
 public:
  StatusOr<bool> Lock(char* address, uint64_t bytes) override {
    cudaError_t error =
        cudaHostRegister(address, bytes, cudaHostRegisterPortable);
    if (error == cudaErrorHostMemoryAlreadyRegistered) {
      cudaGetLastError();  // clears it
      // Someone else's registration: usable if it covers the chunk (its
      // ends, as far as CUDA tells), and never unregistered by jcxl.
      if (Registered(address) && Registered(address + bytes - 1)) {
        return false;
      }
      return Status(Code::kInternal,
                    "cudaHostRegister of " + FormatBytes(bytes) +
                        ": part of it is registered by someone else");
    }
    if (error != cudaSuccess) {
      cudaGetLastError();
      return CudaStatus(
          ("cudaHostRegister of " + FormatBytes(bytes)).c_str(), error);
    }
    return true;
  }
  void Unlock(char* address, uint64_t) override {
    cudaHostUnregister(address);
  }

 private:
  static bool Registered(void* address) {
    unsigned int flags = 0;
    if (cudaHostGetFlags(&flags, address) == cudaSuccess) return true;
    cudaGetLastError();
    return false;
  }
};

// One device's copy streams (one each way: fetches, stores and compute all
// overlap) and a pool of timing events, reused so that no event is created
// or destroyed on the launch path once warm.
class CudaDevice : public DeviceOps {
 public:
  static StatusOr<std::unique_ptr<CudaDevice>> Create(int ordinal) {
    std::unique_ptr<CudaDevice> device(new CudaDevice(ordinal));
    JCXL_RETURN_IF_ERROR(CudaStatus("cudaSetDevice", cudaSetDevice(ordinal)));
    for (cudaStream_t* stream : {&device->to_device_, &device->from_device_}) {
      JCXL_RETURN_IF_ERROR(CudaStatus(
          "creating a copy stream",
          cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking)));
    }
    return device;
  }

  Status CopyIndexOnCompute(void* compute, int32_t* slot,
                            const void* index) override {
    return CudaStatus("copying the slice index",
                      cudaMemcpyAsync(slot, index, sizeof(int32_t),
                                      cudaMemcpyDeviceToHost,
                                      static_cast<cudaStream_t>(compute)));
  }
  StatusOr<DeviceEvent> RecordOnCompute(void* compute) override {
    return Record(static_cast<cudaStream_t>(compute));
  }
  Status ComputeWaits(void* compute, DeviceEvent event) override {
    return CudaStatus("cudaStreamWaitEvent",
                      cudaStreamWaitEvent(static_cast<cudaStream_t>(compute),
                                          ToEvent(event), 0));
  }
  Status CopyWaits(Direction direction, DeviceEvent event) override {
    JCXL_RETURN_IF_ERROR(Current());
    return CudaStatus(
        "cudaStreamWaitEvent",
        cudaStreamWaitEvent(StreamOf(direction), ToEvent(event), 0));
  }
  Status Copy(Direction direction, void* device, void* host,
              uint64_t bytes) override {
    JCXL_RETURN_IF_ERROR(Current());
    const bool to_device = direction == Direction::kFromPool;
    return CudaStatus(
        "cudaMemcpyAsync",
        to_device ? cudaMemcpyAsync(device, host, bytes,
                                    cudaMemcpyHostToDevice,
                                    StreamOf(direction))
                  : cudaMemcpyAsync(host, device, bytes,
                                    cudaMemcpyDeviceToHost,
                                    StreamOf(direction)));
  }
  StatusOr<DeviceEvent> RecordOnCopy(Direction direction) override {
    JCXL_RETURN_IF_ERROR(Current());
    return Record(StreamOf(direction));
  }
  Status Sync(DeviceEvent event) override {
    JCXL_RETURN_IF_ERROR(Current());
    return CudaStatus("cudaEventSynchronize",
                      cudaEventSynchronize(ToEvent(event)));
  }
  int64_t ElapsedNs(DeviceEvent from, DeviceEvent to) override {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, ToEvent(from), ToEvent(to)) !=
        cudaSuccess) {
      cudaGetLastError();
      return -1;
    }
    return static_cast<int64_t>(static_cast<double>(ms) * 1e6);
  }
  int64_t HostNsOf(DeviceEvent event) override {
    std::lock_guard<std::mutex> lock(anchor_mu_);
    // Re-anchored every second: a float of milliseconds since the anchor
    // keeps sub-microsecond precision that long.
    if (anchor_host_ns_ < 0 || NowNs() - anchor_host_ns_ > 1'000'000'000) {
      if (!Reanchor()) return -1;
    }
    float ms = 0;  // negative where the event came before the anchor
    if (cudaEventElapsedTime(&ms, anchor_, ToEvent(event)) != cudaSuccess) {
      cudaGetLastError();
      return -1;
    }
    return anchor_host_ns_ + static_cast<int64_t>(static_cast<double>(ms) *
                                                  1e6);
  }
  void ReleaseEvent(DeviceEvent event) override {
    std::lock_guard<std::mutex> lock(mu_);
    free_events_.push_back(ToEvent(event));
  }
  StatusOr<void*> AllocHost(uint64_t bytes) override {
    JCXL_RETURN_IF_ERROR(Current());
    void* p = nullptr;
    cudaError_t error = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (error != cudaSuccess) {
      return Status(Code::kExhausted,
                    "cudaHostAlloc of a " + FormatBytes(bytes) +
                        " page-locked buffer: " + cudaGetErrorString(error));
    }
    return p;
  }
  void FreeHost(void* p) override { cudaFreeHost(p); }
  std::shared_ptr<PageLocker> Locker() override { return locker_; }

 private:
  explicit CudaDevice(int ordinal)
      : ordinal_(ordinal), locker_(std::make_shared<CudaLocker>()) {}
  // The calling thread's current device (jcxl's threads start on none).
  Status Current() {
    return CudaStatus("cudaSetDevice", cudaSetDevice(ordinal_));
  }
  // Ties the device's event clock to the host's: an event recorded on an
  // idle stream of its own, synced by spinning (no wake-up latency), is
  // stamped at most that sync's latency late.
  bool Reanchor() {
    cudaError_t error = cudaSetDevice(ordinal_);
    if (error == cudaSuccess && anchor_ == nullptr) {
      error = cudaStreamCreateWithFlags(&anchor_stream_,
                                        cudaStreamNonBlocking);
      if (error == cudaSuccess) {
        error = cudaEventCreateWithFlags(&anchor_, cudaEventDefault);
      }
    }
    if (error == cudaSuccess) error = cudaEventRecord(anchor_, anchor_stream_);
    if (error == cudaSuccess) error = cudaEventSynchronize(anchor_);
    if (error != cudaSuccess) {
      cudaGetLastError();
      anchor_host_ns_ = -1;
      return false;
    }
    anchor_host_ns_ = NowNs();
    return true;
  }
  cudaStream_t StreamOf(Direction direction) {
    return direction == Direction::kFromPool ? to_device_ : from_device_;
  }
  StatusOr<DeviceEvent> Record(cudaStream_t stream) {
    cudaEvent_t event = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_events_.empty()) {
        event = free_events_.back();
        free_events_.pop_back();
      }
    }
    if (event == nullptr) {
      // Timing stays on (the profiler reads each transfer's and wait's
      // times from these events); synced by sleeping, not spinning, on
      // jcxl's threads.
      JCXL_RETURN_IF_ERROR(CudaStatus(
          "cudaEventCreateWithFlags",
          cudaEventCreateWithFlags(&event, cudaEventBlockingSync)));
    }
    cudaError_t error = cudaEventRecord(event, stream);
    if (error != cudaSuccess) {
      ReleaseEvent(ToHandle(event));
      return CudaStatus("cudaEventRecord", error);
    }
    return ToHandle(event);
  }

  const int ordinal_;
  cudaStream_t to_device_ = nullptr;
  cudaStream_t from_device_ = nullptr;
  std::shared_ptr<CudaLocker> locker_;
  std::mutex mu_;
  std::vector<cudaEvent_t> free_events_;
  std::mutex anchor_mu_;
  cudaStream_t anchor_stream_ = nullptr;
  cudaEvent_t anchor_ = nullptr;
  int64_t anchor_host_ns_ = -1;  // < 0: no anchor yet
};

// Each device's transfers, made on first use and kept for the process
// (never destroyed: no CUDA call may run during static destruction).
std::mutex g_transfers_mu;
std::map<int, DeviceTransfers*>& TransfersByDevice() {
  static auto* by_device = new std::map<int, DeviceTransfers*>();
  return *by_device;
}

ffi::ErrorOr<DeviceTransfers*> TransfersFor(const char* handler,
                                            int ordinal) {
  std::lock_guard<std::mutex> lock(g_transfers_mu);
  auto it = TransfersByDevice().find(ordinal);
  if (it != TransfersByDevice().end()) return it->second;
  StatusOr<std::unique_ptr<CudaDevice>> device = CudaDevice::Create(ordinal);
  if (!device.ok()) return Unexpected(handler, device.status());
  auto* transfers = new DeviceTransfers(
      std::move(*device), PageLocks::kDefaultChunkBytes,
      [](const DeviceWait& wait) {
        StreamWait logged;
        logged.record = wait.record;
        logged.wait_started_ns = wait.wait_started_ns;
        logged.wait_ns = wait.wait_ns;
        LogStreamWait(logged);
      });
  TransfersByDevice().emplace(ordinal, transfers);
  return transfers;
}

std::vector<DeviceTransfers*> AllTransfers() {
  std::lock_guard<std::mutex> lock(g_transfers_mu);
  std::vector<DeviceTransfers*> out;
  for (const auto& [ordinal, transfers] : TransfersByDevice()) {
    out.push_back(transfers);
  }
  return out;
}

ffi::ErrorOr<int32_t> HandleFor(const char* handler,
                                ffi::Span<const int32_t> pairs, int ordinal) {
  for (size_t i = 0; i + 1 < pairs.size(); i += 2) {
    if (pairs[i] == ordinal) return pairs[i + 1];
  }
  return Unexpected(handler, "no pool object for device ordinal " +
                                 std::to_string(ordinal) +
                                 " in device_handles");
}

struct Request {
  const char* handler;
  cudaStream_t compute;
  int ordinal;
  Slice slice;
  int64_t static_index;          // < 0: read `index_on_device`
  const void* index_on_device;   // the step's int32 index operand
  BufferShape shape;
  void* device_buffer;
  Direction direction;
  int priority;
  uint64_t chunk_bytes;
  int64_t timeout_ns;
  int64_t run;
};

ffi::Error Start(const Request& r) {
  JCXL_CUDA_RETURN_IF_ERROR(r.handler, "cudaSetDevice",
                            cudaSetDevice(r.ordinal));
  const bool index_on_device = r.slice.stacked && r.static_index < 0;
  ffi::ErrorOr<Target> target = Resolve(
      r.handler, r.slice, r.slice.stacked ? r.static_index : 0, r.shape);
  if (target.has_error()) return target.error();
  ffi::ErrorOr<DeviceTransfers*> transfers =
      TransfersFor(r.handler, r.ordinal);
  if (transfers.has_error()) return transfers.error();
  DeviceRequest request;
  request.pool = std::move(target->pool);
  request.handle = r.slice.handle;
  request.compute = r.compute;
  request.device_buffer = r.device_buffer;
  request.bytes = r.shape.bytes;
  request.direction = r.direction;
  request.offset = target->offset;
  if (index_on_device) {
    request.index_on_device = r.index_on_device;
    request.offset_of = [slice = r.slice,
                         object_shape = std::move(target->object_shape),
                         shape = r.shape](int64_t index) {
      return SliceOffset(slice, object_shape, index, shape);
    };
  }
  request.priority = r.priority;
  request.chunk_bytes = r.chunk_bytes;
  request.timeout_ns = r.timeout_ns;
  request.run = r.run;
  Status started = (*transfers)->Start(std::move(request));
  if (!started.ok()) return Fail(r.handler, started);
  return ffi::Error::Success();
}

ffi::Error Done(const char* handler, cudaStream_t compute, int ordinal,
                const void* buffer) {
  JCXL_CUDA_RETURN_IF_ERROR(handler, "cudaSetDevice", cudaSetDevice(ordinal));
  ffi::ErrorOr<DeviceTransfers*> transfers = TransfersFor(handler, ordinal);
  if (transfers.has_error()) return transfers.error();
  Status done = (*transfers)->Done(compute, buffer);
  if (done.code() == Code::kNotFound) return NoTransferInFlight(handler);
  if (!done.ok()) return Fail(handler, done);
  return ffi::Error::Success();
}

ffi::Error CopyIfNotAliased(const char* handler, cudaStream_t stream,
                            void* out, const void* in, size_t bytes) {
  if (out == in) return ffi::Error::Success();
  JCXL_CUDA_RETURN_IF_ERROR(
      handler, "cudaMemcpyAsync",
      cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, stream));
  return ffi::Error::Success();
}

// Runs a handler's body; if it fails, the execution fails with it: the
// compute stream first waits for every transfer the execution started and
// no `done` took, since XLA frees the execution's buffers on that stream
// once it sees the error (as the CPU handlers stop theirs: see
// execution_transfers.h).
template <typename Body>
ffi::Error FailingStopsTheExecution(cudaStream_t stream, int32_t ordinal,
                                    ffi::RunId run, Body&& body) {
  ffi::Error error = body();
  if (error.failure()) AbortExecution(stream, ordinal, run.run_id);
  return error;
}

ffi::Error FetchStart(cudaStream_t stream, int32_t ordinal, int64_t run,
                      ffi::Buffer<ffi::S32> index,
                      ffi::Result<ffi::AnyBuffer> out, int32_t pool_id,
                      bool stacked, int64_t block_rows, int32_t priority,
                      int64_t chunk_bytes,
                      ffi::Span<const int32_t> device_handles,
                      int64_t static_index, int64_t timeout_ms) {
  const char* handler = "jcxl_fetch_start";
  ffi::ErrorOr<int32_t> handle = HandleFor(handler, device_handles, ordinal);
  if (handle.has_error()) return handle.error();
  return Start({handler, stream, ordinal,
                Slice{pool_id, *handle, stacked, block_rows}, static_index,
                index.untyped_data(), ShapeOf(*out), out->untyped_data(),
                Direction::kFromPool, priority,
                static_cast<uint64_t>(chunk_bytes), TimeoutNs(timeout_ms),
                run});
}

ffi::Error FetchStartImpl(cudaStream_t stream, int32_t ordinal,
                          ffi::RunId run, ffi::Buffer<ffi::S32>,
                          ffi::Buffer<ffi::S32> index, ffi::AnyBuffer,
                          ffi::Result<ffi::AnyBuffer> out, int32_t pool_id,
                          bool stacked, int64_t block_rows, int32_t priority,
                          int64_t chunk_bytes,
                          ffi::Span<const int32_t> device_handles,
                          int64_t static_index, int64_t timeout_ms) {
  return FailingStopsTheExecution(stream, ordinal, run, [&] {
    return FetchStart(stream, ordinal, run.run_id, index, out, pool_id,
                      stacked, block_rows, priority, chunk_bytes,
                      device_handles, static_index, timeout_ms);
  });
}

ffi::Error FetchStartIntoImpl(cudaStream_t stream, int32_t ordinal,
                              ffi::RunId run, ffi::Buffer<ffi::S32>,
                              ffi::Buffer<ffi::S32> index, ffi::AnyBuffer,
                              ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out,
                              int32_t pool_id, bool stacked,
                              int64_t block_rows, int32_t priority,
                              int64_t chunk_bytes,
                              ffi::Span<const int32_t> device_handles,
                              int64_t static_index, int64_t timeout_ms) {
  return FailingStopsTheExecution(stream, ordinal, run, [&] {
    return FetchStart(stream, ordinal, run.run_id, index, out, pool_id,
                      stacked, block_rows, priority, chunk_bytes,
                      device_handles, static_index, timeout_ms);
  });
}

ffi::Error FetchDoneImpl(cudaStream_t stream, int32_t ordinal, ffi::RunId run,
                         ffi::AnyBuffer in, ffi::AnyBuffer,
                         ffi::Result<ffi::AnyBuffer> out, int64_t) {
  return FailingStopsTheExecution(stream, ordinal, run, [&] {
    ffi::Error waited = Done("jcxl_fetch_done", stream, ordinal,
                             in.untyped_data());
    if (waited.failure()) return waited;
    return CopyIfNotAliased("jcxl_fetch_done", stream, out->untyped_data(),
                            in.untyped_data(), in.size_bytes());
  });
}

ffi::Error StoreStart(cudaStream_t stream, int32_t ordinal, int64_t run,
                      ffi::Buffer<ffi::S32> index, ffi::AnyBuffer in,
                      ffi::Result<ffi::AnyBuffer> out, int32_t pool_id,
                      bool stacked, int64_t block_rows, int32_t priority,
                      int64_t chunk_bytes,
                      ffi::Span<const int32_t> device_handles,
                      int64_t static_index, int64_t timeout_ms) {
  const char* handler = "jcxl_store_start";
  ffi::ErrorOr<int32_t> handle = HandleFor(handler, device_handles, ordinal);
  if (handle.has_error()) return handle.error();
  ffi::Error copied = CopyIfNotAliased(handler, stream, out->untyped_data(),
                                       in.untyped_data(), in.size_bytes());
  if (copied.failure()) return copied;
  return Start({handler, stream, ordinal,
                Slice{pool_id, *handle, stacked, block_rows}, static_index,
                index.untyped_data(), ShapeOf(*out), out->untyped_data(),
                Direction::kToPool, priority,
                static_cast<uint64_t>(chunk_bytes), TimeoutNs(timeout_ms),
                run});
}

ffi::Error StoreStartImpl(cudaStream_t stream, int32_t ordinal,
                          ffi::RunId run, ffi::Buffer<ffi::S32>,
                          ffi::Buffer<ffi::S32> index, ffi::AnyBuffer in,
                          ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out,
                          int32_t pool_id, bool stacked, int64_t block_rows,
                          int32_t priority, int64_t chunk_bytes,
                          ffi::Span<const int32_t> device_handles,
                          int64_t static_index, int64_t timeout_ms) {
  return FailingStopsTheExecution(stream, ordinal, run, [&] {
    return StoreStart(stream, ordinal, run.run_id, index, in, out, pool_id,
                      stacked, block_rows, priority, chunk_bytes,
                      device_handles, static_index, timeout_ms);
  });
}

ffi::Error StoreDoneImpl(cudaStream_t stream, int32_t ordinal, ffi::RunId run,
                         ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> token,
                         int64_t) {
  return FailingStopsTheExecution(stream, ordinal, run, [&]() -> ffi::Error {
    ffi::Error waited = Done("jcxl_store_done", stream, ordinal,
                             in.untyped_data());
    if (waited.failure()) return waited;
    JCXL_CUDA_RETURN_IF_ERROR(
        "jcxl_store_done", "cudaMemsetAsync",
        cudaMemsetAsync(token->untyped_data(), 0, token->size_bytes(),
                        stream));
    return ffi::Error::Success();
  });
}

ffi::Error AfterImpl(cudaStream_t stream, int32_t, ffi::RunId,
                     ffi::AnyBuffer x, ffi::AnyBuffer,
                     ffi::Result<ffi::AnyBuffer> out) {
  return CopyIfNotAliased("jcxl_after", stream, out->untyped_data(),
                          x.untyped_data(), x.size_bytes());
}

}  // namespace

double MemcpyBandwidth(int ordinal, uint64_t bytes, bool to_device,
                       int repeats) {
  cudaError_t error = cudaSetDevice(ordinal);
  if (error != cudaSuccess) return -static_cast<double>(error);
  void* host = nullptr;
  void* device = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  float ms = 0;
  error = cudaHostAlloc(&host, bytes, cudaHostAllocPortable);
  if (error == cudaSuccess) error = cudaMalloc(&device, bytes);
  if (error == cudaSuccess) {
    error = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  }
  if (error == cudaSuccess) error = cudaEventCreate(&start);
  if (error == cudaSuccess) error = cudaEventCreate(&stop);
  auto copy = [&] {
    return to_device ? cudaMemcpyAsync(device, host, bytes,
                                       cudaMemcpyHostToDevice, stream)
                     : cudaMemcpyAsync(host, device, bytes,
                                       cudaMemcpyDeviceToHost, stream);
  };
  if (error == cudaSuccess) error = copy();  // warm-up
  if (error == cudaSuccess) error = cudaEventRecord(start, stream);
  for (int i = 0; i < repeats && error == cudaSuccess; ++i) error = copy();
  if (error == cudaSuccess) error = cudaEventRecord(stop, stream);
  if (error == cudaSuccess) error = cudaEventSynchronize(stop);
  if (error == cudaSuccess) error = cudaEventElapsedTime(&ms, start, stop);
  if (stop) cudaEventDestroy(stop);
  if (start) cudaEventDestroy(start);
  if (stream) cudaStreamDestroy(stream);
  if (device) cudaFree(device);
  if (host) cudaFreeHost(host);
  if (error != cudaSuccess) return -static_cast<double>(error);
  return static_cast<double>(bytes) * repeats / (ms * 1e-3);
}

void AbortExecution(void* stream, int ordinal, int64_t run) {
  if (cudaSetDevice(ordinal) != cudaSuccess) return;
  ffi::ErrorOr<DeviceTransfers*> transfers = TransfersFor("jcxl", ordinal);
  // Best effort past the first error: the step fails with that one.
  if (!transfers.has_error()) (*transfers)->AbortRun(stream, run);
}

void Flush() {
  for (DeviceTransfers* transfers : AllTransfers()) transfers->Drain();
}

std::map<std::string, uint64_t> Counters() {
  Flush();  // every transfer so far is counted
  std::map<std::string, uint64_t> out;
  for (DeviceTransfers* transfers : AllTransfers()) {
    DeviceCounters c = transfers->counters();
    HostBufferCache::Stats bounce = transfers->bounce_stats();
    out["direct"] += c.direct;
    out["direct_after_index"] += c.direct_after_index;
    out["staged"] += c.staged;
    out["staged_lock_failed"] += c.staged_lock_failed;
    out["stale_waits"] += c.stale_waits;
    out["failed"] += c.failed;
    out["bounce_allocations"] += bounce.allocations;
    out["bounce_reuses"] += bounce.reuses;
    out["bounce_frees"] += bounce.frees;
    out["bounce_peak_bytes"] += bounce.peak_in_use_bytes;
  }
  return out;
}

int DeviceCount() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kCudaFetchStart, FetchStartImpl,
    FetchStartSignature(CudaContext(ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kCudaFetchStartInto, FetchStartIntoImpl,
    FetchStartIntoSignature(CudaContext(ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kCudaFetchDone, FetchDoneImpl,
    FetchDoneSignature(CudaContext(ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kCudaAfter, AfterImpl,
    AfterSignature(CudaContext(ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kCudaStoreStart, StoreStartImpl,
    StoreStartSignature(CudaContext(ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kCudaStoreDone, StoreDoneImpl,
    StoreDoneSignature(CudaContext(ffi::Ffi::Bind())));

}  // namespace jcxl::cuda
