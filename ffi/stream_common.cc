#include "stream_common.h"

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

std::string Name(int32_t handle) { return "handle " + std::to_string(handle); }

// The shape the buffer must have for slice-or-object access, or an error.
Status CheckShape(const Slice& slice, const std::vector<int64_t>& object,
                  const BufferShape& buffer) {
  std::vector<int64_t> expected = object;
  const std::vector<int64_t>& got = buffer.dims;
  if (slice.stacked && slice.block_rows > 0) {
    // A block of `block_rows` rows along axis 0; the last block may be
    // shorter (the buffer says how long).
    const int64_t rows = got.empty() ? 0 : got[0];
    if (expected.empty() || got.size() != expected.size() || rows < 1 ||
        rows > slice.block_rows || rows > expected[0]) {
      return Status(Code::kInvalidArgument,
                    Name(slice.handle) + " of shape " + DimsString(object) +
                        " has no block of " + std::to_string(rows) +
                        " rows (blocks of " +
                        std::to_string(slice.block_rows) + " rows)");
    }
    expected[0] = rows;
  } else if (slice.stacked) {
    if (expected.empty()) {
      return Status(Code::kInvalidArgument,
                    Name(slice.handle) + " of shape " + DimsString(object) +
                        " has no slices");
    }
    expected.erase(expected.begin());
  }
  if (got != expected) {
    return Status(Code::kInvalidArgument,
                  Name(slice.handle) + " holds shape " + DimsString(object) +
                      (slice.stacked && slice.block_rows == 0
                           ? " (one slice of it)"
                           : "") +
                      " but the step's " +
                      (slice.block_rows > 0 ? "row block" : "buffer") +
                      " has shape " + DimsString(got));
  }
  return Status::Ok();
}

}  // namespace

ffi::Error Fail(const char* handler, const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string(handler) + ": " + message);
}

ffi::Error Fail(const char* handler, const Status& status) {
  return ffi::Error(ErrorCodeOf(status.code()),
                    std::string(handler) + ": " + status.message());
}

ffi::Error NoTransferInFlight(const char* handler) {
  return ffi::Error(
      ffi::ErrorCode::kInternal,
      std::string(handler) +
          ": no transfer in flight for this buffer; XLA must have copied "
          "it between start and done (a start and its done must not be "
          "separated by a loop boundary)");
}

BufferShape ShapeOf(const ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  return {buffer.element_type(), std::vector<int64_t>(dims.begin(), dims.end()),
          static_cast<uint64_t>(buffer.size_bytes())};
}

StatusOr<uint64_t> SliceOffset(const Slice& slice,
                               const std::vector<int64_t>& object_shape,
                               int64_t index, const BufferShape& buffer) {
  if (!slice.stacked) return uint64_t{0};
  if (slice.block_rows > 0) {
    const int64_t rows = buffer.dims.empty() ? 0 : buffer.dims[0];
    if (index < 0 || rows < 1 || object_shape.empty() ||
        index > (object_shape[0] - rows) / slice.block_rows) {
      return Status(Code::kInvalidArgument,
                    Name(slice.handle) + " of shape " +
                        DimsString(object_shape) + " has no block " +
                        std::to_string(index) + " of " +
                        std::to_string(rows) + " rows (blocks of " +
                        std::to_string(slice.block_rows) + " rows)");
    }
    return static_cast<uint64_t>(index) * slice.block_rows *
           (buffer.bytes / rows);
  }
  if (index < 0 || object_shape.empty() || index >= object_shape[0]) {
    return Status(Code::kInvalidArgument,
                  Name(slice.handle) + " of shape " +
                      DimsString(object_shape) + " has no slice " +
                      std::to_string(index));
  }
  return static_cast<uint64_t>(index) * buffer.bytes;
}

ffi::ErrorOr<Target> Resolve(const char* handler, const Slice& slice,
                             int64_t index, const BufferShape& buffer) {
  Target target;
  target.pool = Pool::Find(slice.pool_id);
  if (!target.pool) {
    return Unexpected(handler,
                      Status(Code::kClosed,
                             "pool " + std::to_string(slice.pool_id) +
                                 " is closed or was never opened"));
  }
  StatusOr<ObjectInfo> info = target.pool->objects().Info(slice.handle);
  if (!info.ok()) return Unexpected(handler, info.status());
  const char* dtype = DTypeName(buffer.dtype);
  if (info->dtype != dtype) {
    return Unexpected(handler, Name(slice.handle) + " holds " + info->dtype +
                                   " but the step's buffer is " + dtype);
  }
  Status shape = CheckShape(slice, info->shape, buffer);
  if (!shape.ok()) return Unexpected(handler, shape);
  target.object_shape = info->shape;
  if (index >= 0 || !slice.stacked) {
    StatusOr<uint64_t> offset =
        SliceOffset(slice, info->shape, index, buffer);
    if (!offset.ok()) return Unexpected(handler, offset.status());
    target.offset = *offset;
  }
  return target;
}

}  // namespace jcxl
