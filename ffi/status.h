// Error values for the jcxl core: plain C++ code returns a Status (never
// throws), the nanobind module turns it into a Python exception and the FFI
// handlers into an ffi::Error.
#ifndef JCXL_FFI_STATUS_H_
#define JCXL_FFI_STATUS_H_

#include <optional>
#include <string>
#include <utility>

namespace jcxl {

enum class Code {
  kOk = 0,
  kInvalidArgument,  // bad size, shape, dtype, tier or option
  kNotFound,         // unknown or freed handle
  kExhausted,        // a tier (and everything it may spill to) is full
  kClosed,           // the pool was closed
  kTimeout,          // a transfer did not finish within its deadline
  kIo,               // the nvme tier's file system failed a read or write
  kInternal,
};

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message)
      : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

// A value or the Status that explains why there is none.
template <typename T>
class StatusOr {
 public:
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  StatusOr(Status status) : status_(std::move(status)) {}  // NOLINT

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() { return *value_; }
  const T& value() const { return *value_; }
  T* operator->() { return &*value_; }
  T& operator*() { return *value_; }

 private:
  Status status_;
  std::optional<T> value_;
};

#define JCXL_RETURN_IF_ERROR(expr)         \
  do {                                     \
    ::jcxl::Status _jcxl_status = (expr);  \
    if (!_jcxl_status.ok()) return _jcxl_status; \
  } while (0)

}  // namespace jcxl

#endif  // JCXL_FFI_STATUS_H_
