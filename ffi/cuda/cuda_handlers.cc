#include "cuda/cuda_handlers.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "pool.h"
#include "stream_common.h"

namespace jcxl::cuda {
namespace {

// Every CUDA handler's context: XLA's compute stream and the device.
template <typename Binding>
auto CudaContext(Binding&& binding) {
  return std::move(binding)
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>();
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

// Per device, one copy stream per direction: fetches, stores and compute
// all overlap (a GPU has a copy engine each way).
struct Streams {
  cudaStream_t to_device = nullptr;
  cudaStream_t from_device = nullptr;
};

ffi::ErrorOr<Streams> StreamsFor(const char* handler, int ordinal) {
  static std::mutex mu;
  static auto* by_device = new std::map<int, Streams>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = by_device->find(ordinal);
  if (it != by_device->end()) return it->second;
  Streams streams;
  cudaError_t error =
      cudaStreamCreateWithFlags(&streams.to_device, cudaStreamNonBlocking);
  if (error == cudaSuccess) {
    error = cudaStreamCreateWithFlags(&streams.from_device,
                                      cudaStreamNonBlocking);
  }
  if (error != cudaSuccess) {
    return ffi::Unexpected<ffi::Error>(
        CudaFail(handler, "creating the copy streams", error));
  }
  by_device->emplace(ordinal, streams);
  return streams;
}

std::mutex g_registered_mu;
std::unordered_set<int32_t>& Registered() {
  static auto* pools = new std::unordered_set<int32_t>();
  return *pools;
}

// Page-locks a pool's memory arenas (once per pool), so that the DMA reads
// and writes them directly; they are unregistered when the pool closes,
// before it unmaps them.
Status EnsureRegistered(Pool& pool) {
  std::lock_guard<std::mutex> lock(g_registered_mu);
  if (Registered().count(pool.id())) return Status::Ok();
  std::vector<char*> done;
  for (const MemoryRegion& region : pool.MemoryRegions()) {
    cudaError_t error = cudaHostRegister(region.base, region.bytes,
                                         cudaHostRegisterPortable);
    if (error != cudaSuccess &&
        error != cudaErrorHostMemoryAlreadyRegistered) {
      for (char* base : done) cudaHostUnregister(base);
      return Status(Code::kInternal,
                    "cudaHostRegister of " + std::to_string(region.bytes) +
                        " bytes of pool " + std::to_string(pool.id()) +
                        " memory: " + cudaGetErrorString(error));
    }
    if (error == cudaSuccess) done.push_back(region.base);
  }
  const int32_t id = pool.id();
  pool.OnClose([done, id] {
    for (char* base : done) cudaHostUnregister(base);
    std::lock_guard<std::mutex> lock(g_registered_mu);
    Registered().erase(id);
  });
  Registered().insert(id);
  return Status::Ok();
}

// Page-locked bounce buffers for staged transfers, reused by size. A host
// function (which may not call CUDA) gives a buffer back; buffers beyond
// the cache's cap are freed on the next Acquire.
class Bounce {
 public:
  static Bounce& Get() {
    static auto* bounce = new Bounce();
    return *bounce;
  }
  StatusOr<void*> Acquire(uint64_t bytes) {
    std::vector<void*> excess;
    void* found = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      excess.swap(to_free_);
      auto it = free_.find(bytes);
      if (it != free_.end()) {
        found = it->second;
        cached_bytes_ -= bytes;
        free_.erase(it);
      }
    }
    for (void* p : excess) cudaFreeHost(p);
    if (found != nullptr) return found;
    void* p = nullptr;
    cudaError_t error = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (error != cudaSuccess) {
      return Status(Code::kExhausted,
                    "cudaHostAlloc of a " + std::to_string(bytes) +
                        "-byte bounce buffer: " + cudaGetErrorString(error));
    }
    return p;
  }
  void Release(void* p, uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (cached_bytes_ + bytes > kCacheBytes) {
      to_free_.push_back(p);
      return;
    }
    cached_bytes_ += bytes;
    free_.emplace(bytes, p);
  }

 private:
  static constexpr uint64_t kCacheBytes = 512ull << 20;
  std::mutex mu_;
  std::multimap<uint64_t, void*> free_;
  std::vector<void*> to_free_;
  uint64_t cached_bytes_ = 0;
};

constexpr uint64_t kIndexSlotBytes = 64;

// A staged transfer, shared by its start, its host functions and its done.
struct Staged {
  std::shared_ptr<Pool> pool;
  Slice slice;
  std::vector<int64_t> object_shape;
  BufferShape buffer;
  uint64_t offset = 0;
  int32_t* index_slot = nullptr;  // where the device's index lands, if any
  void* bounce = nullptr;
  Direction direction = Direction::kFromPool;
  int priority = 0;
  uint64_t chunk_bytes = 0;
  int64_t timeout_ns = 0;
  Status status;  // written by RunStaged, read by done after the event
};

// How long a staged copy that timed out gets to stop before its bounce
// buffer is reused.
constexpr int64_t kCancelGraceNs = 2'000'000'000;

// Host function, in stream order: the pool's copy engine moves the bytes
// between the object and the bounce buffer (the link model applies).
void CUDART_CB RunStaged(void* arg) {
  std::unique_ptr<std::shared_ptr<Staged>> owner(
      static_cast<std::shared_ptr<Staged>*>(arg));
  Staged& s = **owner;
  if (s.index_slot != nullptr) {
    StatusOr<uint64_t> offset =
        SliceOffset(s.slice, s.object_shape, *s.index_slot, s.buffer);
    if (offset.ok()) {
      s.offset = *offset;
    } else {
      s.status = offset.status();
    }
  }
  if (s.status.ok()) {
    StatusOr<std::shared_ptr<Ticket>> ticket =
        s.direction == Direction::kFromPool
            ? s.pool->Read(s.slice.handle, s.bounce, s.buffer.bytes,
                           s.offset, s.priority, s.chunk_bytes)
            : s.pool->Write(s.slice.handle, s.bounce, s.buffer.bytes,
                            s.offset, s.priority, s.chunk_bytes);
    s.status = ticket.ok() ? (*ticket)->Wait(s.timeout_ns) : ticket.status();
    if (ticket.ok() && !(*ticket)->done()) {
      (*ticket)->Cancel();
      (*ticket)->Wait(kCancelGraceNs);
    }
  }
  if (!s.status.ok() && s.direction == Direction::kFromPool) {
    // The done fails the step; the buffer gets NaNs, never stale bytes.
    std::memset(s.bounce, 0xff, s.buffer.bytes);
  }
}

void CUDART_CB ReleaseStaged(void* arg) {
  std::unique_ptr<std::shared_ptr<Staged>> owner(
      static_cast<std::shared_ptr<Staged>*>(arg));
  Staged& s = **owner;
  Bounce::Get().Release(s.bounce, s.buffer.bytes);
  if (s.index_slot != nullptr) {
    Bounce::Get().Release(s.index_slot, kIndexSlotBytes);
  }
}

struct DirectDone {
  std::shared_ptr<Pool> pool;
  DirectRange range;
};

void CUDART_CB EndDirect(void* arg) {
  std::unique_ptr<DirectDone> done(static_cast<DirectDone*>(arg));
  done->pool->EndDirect(done->range);
}

struct Flight {
  cudaEvent_t done = nullptr;
  std::shared_ptr<Staged> staged;  // null for a direct copy
};

// Copies in flight, by the address of their device buffer.
class InFlight {
 public:
  static InFlight& Get() {
    static auto* table = new InFlight();
    return *table;
  }
  void Add(const void* address, Flight flight) {
    Flight stale;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto [it, inserted] = flights_.try_emplace(address, flight);
      if (inserted) return;
      stale = std::move(it->second);
      it->second = std::move(flight);
    }
    // A failed step left this copy behind: it ends on its own stream.
    cudaEventDestroy(stale.done);
  }
  bool Take(const void* address, Flight* flight) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = flights_.find(address);
    if (it == flights_.end()) return false;
    *flight = std::move(it->second);
    flights_.erase(it);
    return true;
  }

 private:
  std::mutex mu_;
  std::unordered_map<const void*, Flight> flights_;
};

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
};

ffi::Error StartDirect(const Request& r, Pool& pool,
                       std::shared_ptr<Pool> owner, const DirectRange& range,
                       cudaStream_t copy) {
  Status registered = EnsureRegistered(pool);
  if (!registered.ok()) {
    pool.EndDirect(range);
    return Fail(r.handler, registered);
  }
  const uint64_t chunk =
      r.chunk_bytes ? r.chunk_bytes : pool.config().chunk_bytes;
  const bool to_device = r.direction == Direction::kFromPool;
  char* device = static_cast<char*>(r.device_buffer);
  for (uint64_t done = 0; done < range.bytes; done += chunk) {
    const uint64_t n = std::min(chunk, range.bytes - done);
    cudaError_t error =
        to_device ? cudaMemcpyAsync(device + done, range.address + done, n,
                                    cudaMemcpyHostToDevice, copy)
                  : cudaMemcpyAsync(range.address + done, device + done, n,
                                    cudaMemcpyDeviceToHost, copy);
    if (error != cudaSuccess) {
      cudaStreamSynchronize(copy);  // the pieces already queued
      pool.EndDirect(range);
      return CudaFail(r.handler, "cudaMemcpyAsync", error);
    }
  }
  auto* done = new DirectDone{std::move(owner), range};
  cudaError_t error = cudaLaunchHostFunc(copy, EndDirect, done);
  if (error != cudaSuccess) {
    cudaStreamSynchronize(copy);
    EndDirect(done);
    return CudaFail(r.handler, "cudaLaunchHostFunc", error);
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<std::shared_ptr<Staged>> StartStaged(const Request& r,
                                                  Target target,
                                                  cudaStream_t copy) {
  auto staged = std::make_shared<Staged>();
  staged->pool = std::move(target.pool);
  staged->slice = r.slice;
  staged->object_shape = std::move(target.object_shape);
  staged->buffer = r.shape;
  staged->offset = target.offset;
  staged->direction = r.direction;
  staged->priority = r.priority;
  staged->chunk_bytes = r.chunk_bytes;
  staged->timeout_ns = r.timeout_ns;
  StatusOr<void*> bounce = Bounce::Get().Acquire(r.shape.bytes);
  if (!bounce.ok()) return Unexpected(r.handler, bounce.status());
  staged->bounce = *bounce;
  auto cleanup = [&](cudaError_t error, const char* what) {
    cudaStreamSynchronize(copy);
    Bounce::Get().Release(staged->bounce, r.shape.bytes);
    if (staged->index_slot) {
      Bounce::Get().Release(staged->index_slot, kIndexSlotBytes);
    }
    return ffi::Unexpected<ffi::Error>(CudaFail(r.handler, what, error));
  };
  const bool index_on_device = r.slice.stacked && r.static_index < 0;
  if (index_on_device) {
    StatusOr<void*> slot = Bounce::Get().Acquire(kIndexSlotBytes);
    if (!slot.ok()) {
      Bounce::Get().Release(staged->bounce, r.shape.bytes);
      return Unexpected(r.handler, slot.status());
    }
    staged->index_slot = static_cast<int32_t*>(*slot);
    cudaError_t error = cudaMemcpyAsync(staged->index_slot, r.index_on_device,
                                        sizeof(int32_t),
                                        cudaMemcpyDeviceToHost, copy);
    if (error != cudaSuccess) return cleanup(error, "copying the index");
  }
  if (r.direction == Direction::kToPool) {
    cudaError_t error =
        cudaMemcpyAsync(staged->bounce, r.device_buffer, r.shape.bytes,
                        cudaMemcpyDeviceToHost, copy);
    if (error != cudaSuccess) return cleanup(error, "cudaMemcpyAsync");
  }
  cudaError_t error = cudaLaunchHostFunc(
      copy, RunStaged, new std::shared_ptr<Staged>(staged));
  if (error != cudaSuccess) return cleanup(error, "cudaLaunchHostFunc");
  if (r.direction == Direction::kFromPool) {
    error = cudaMemcpyAsync(r.device_buffer, staged->bounce, r.shape.bytes,
                            cudaMemcpyHostToDevice, copy);
    if (error != cudaSuccess) return cleanup(error, "cudaMemcpyAsync");
  }
  error = cudaLaunchHostFunc(copy, ReleaseStaged,
                             new std::shared_ptr<Staged>(staged));
  if (error != cudaSuccess) return cleanup(error, "cudaLaunchHostFunc");
  return staged;
}

ffi::Error Start(const Request& r) {
  JCXL_CUDA_RETURN_IF_ERROR(r.handler, "cudaSetDevice",
                            cudaSetDevice(r.ordinal));
  ffi::ErrorOr<Target> target =
      Resolve(r.handler, r.slice, r.slice.stacked ? r.static_index : 0,
              r.shape);
  if (target.has_error()) return target.error();
  ffi::ErrorOr<Streams> streams = StreamsFor(r.handler, r.ordinal);
  if (streams.has_error()) return streams.error();
  cudaStream_t copy = r.direction == Direction::kFromPool
                          ? streams->to_device
                          : streams->from_device;
  // The copy may start once the compute stream got here: the buffer is then
  // allocated (a fetch) or written (a store).
  cudaEvent_t ready = nullptr;
  Flight flight;
  JCXL_CUDA_RETURN_IF_ERROR(
      r.handler, "cudaEventCreate",
      cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  JCXL_CUDA_RETURN_IF_ERROR(
      r.handler, "cudaEventCreate",
      cudaEventCreateWithFlags(&flight.done, cudaEventDisableTiming));
  cudaError_t error = cudaEventRecord(ready, r.compute);
  if (error == cudaSuccess) error = cudaStreamWaitEvent(copy, ready, 0);
  cudaEventDestroy(ready);  // released once the wait is done with it
  if (error != cudaSuccess) {
    cudaEventDestroy(flight.done);
    return CudaFail(r.handler, "ordering the copy after the step", error);
  }
  const bool index_known = !r.slice.stacked || r.static_index >= 0;
  StatusOr<DirectRange> direct =
      index_known ? target->pool->BeginDirect(r.slice.handle, r.shape.bytes,
                                              target->offset, r.direction)
                  : StatusOr<DirectRange>(Status(Code::kInvalidArgument,
                                                 "index on the device"));
  if (direct.ok()) {
    Pool& pool = *target->pool;
    ffi::Error started = StartDirect(r, pool, target->pool, *direct, copy);
    if (started.failure()) {
      cudaEventDestroy(flight.done);
      return started;
    }
  } else {
    ffi::ErrorOr<std::shared_ptr<Staged>> staged =
        StartStaged(r, std::move(*target), copy);
    if (staged.has_error()) {
      cudaEventDestroy(flight.done);
      return staged.error();
    }
    flight.staged = std::move(*staged);
  }
  error = cudaEventRecord(flight.done, copy);
  if (error != cudaSuccess) {
    cudaStreamSynchronize(copy);
    cudaEventDestroy(flight.done);
    return CudaFail(r.handler, "cudaEventRecord", error);
  }
  InFlight::Get().Add(r.device_buffer, std::move(flight));
  return ffi::Error::Success();
}

ffi::Error Done(const char* handler, cudaStream_t compute, int ordinal,
                const void* buffer) {
  JCXL_CUDA_RETURN_IF_ERROR(handler, "cudaSetDevice", cudaSetDevice(ordinal));
  Flight flight;
  if (!InFlight::Get().Take(buffer, &flight)) {
    return NoTransferInFlight(handler);
  }
  cudaError_t error = cudaStreamWaitEvent(compute, flight.done, 0);
  Status status;
  if (error == cudaSuccess && flight.staged) {
    // Its pool side ran on the host: wait for it, so that its error is the
    // step's (a staged tier is slow anyway; the direct path never waits).
    error = cudaEventSynchronize(flight.done);
    status = flight.staged->status;
  }
  cudaEventDestroy(flight.done);
  if (error != cudaSuccess) return CudaFail(handler, "waiting", error);
  if (!status.ok()) return Fail(handler, status);
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

ffi::Error FetchStartImpl(cudaStream_t stream, int32_t ordinal,
                          ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32> index,
                          ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out,
                          int32_t pool_id, bool stacked, int64_t block_rows,
                          int32_t priority, int64_t chunk_bytes,
                          ffi::Span<const int32_t> device_handles,
                          int64_t static_index, int64_t timeout_ms) {
  const char* handler = "jcxl_fetch_start";
  ffi::ErrorOr<int32_t> handle = HandleFor(handler, device_handles, ordinal);
  if (handle.has_error()) return handle.error();
  return Start({handler, stream, ordinal,
                Slice{pool_id, *handle, stacked, block_rows}, static_index,
                index.untyped_data(), ShapeOf(*out), out->untyped_data(),
                Direction::kFromPool, priority,
                static_cast<uint64_t>(chunk_bytes), TimeoutNs(timeout_ms)});
}

ffi::Error FetchStartIntoImpl(cudaStream_t stream, int32_t ordinal,
                              ffi::Buffer<ffi::S32> handle,
                              ffi::Buffer<ffi::S32> index, ffi::AnyBuffer after,
                              ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out,
                              int32_t pool_id, bool stacked,
                              int64_t block_rows, int32_t priority,
                              int64_t chunk_bytes,
                              ffi::Span<const int32_t> device_handles,
                              int64_t static_index, int64_t timeout_ms) {
  return FetchStartImpl(stream, ordinal, handle, index, after, out, pool_id,
                        stacked, block_rows, priority, chunk_bytes,
                        device_handles, static_index, timeout_ms);
}

ffi::Error FetchDoneImpl(cudaStream_t stream, int32_t ordinal,
                         ffi::AnyBuffer in, ffi::AnyBuffer,
                         ffi::Result<ffi::AnyBuffer> out, int64_t) {
  ffi::Error waited = Done("jcxl_fetch_done", stream, ordinal,
                           in.untyped_data());
  if (waited.failure()) return waited;
  return CopyIfNotAliased("jcxl_fetch_done", stream, out->untyped_data(),
                          in.untyped_data(), in.size_bytes());
}

ffi::Error StoreStartImpl(cudaStream_t stream, int32_t ordinal,
                          ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32> index,
                          ffi::AnyBuffer in, ffi::AnyBuffer,
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
                static_cast<uint64_t>(chunk_bytes), TimeoutNs(timeout_ms)});
}

ffi::Error StoreDoneImpl(cudaStream_t stream, int32_t ordinal,
                         ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> token,
                         int64_t) {
  ffi::Error waited = Done("jcxl_store_done", stream, ordinal,
                           in.untyped_data());
  if (waited.failure()) return waited;
  JCXL_CUDA_RETURN_IF_ERROR(
      "jcxl_store_done", "cudaMemsetAsync",
      cudaMemsetAsync(token->untyped_data(), 0, token->size_bytes(), stream));
  return ffi::Error::Success();
}

ffi::Error AfterImpl(cudaStream_t stream, int32_t, ffi::AnyBuffer x,
                     ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out) {
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
