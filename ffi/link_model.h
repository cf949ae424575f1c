// The emulated link of a tier with no real hardware behind it (the cxl tier
// on a machine without CXL memory): a bandwidth cap shared by every transfer
// on the link, plus a fixed latency per transfer. A chunk may not complete
// before the time the model gives it.
#ifndef JCXL_FFI_LINK_MODEL_H_
#define JCXL_FFI_LINK_MODEL_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>

namespace jcxl {

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class LinkModel {
 public:
  LinkModel(double bytes_per_second, int64_t latency_ns) {
    Set(bytes_per_second, latency_ns);
  }

  // Changes the model mid-run (a link that another job starts sharing).
  void Set(double bytes_per_second, int64_t latency_ns) {
    std::lock_guard<std::mutex> lock(mu_);
    bytes_per_second_ = bytes_per_second;
    latency_ns_ = latency_ns;
  }
  double bytes_per_second() const {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_per_second_;
  }
  int64_t latency_ns() const {
    std::lock_guard<std::mutex> lock(mu_);
    return latency_ns_;
  }

  // Books `bytes` on the link behind every earlier booking and returns the
  // steady-clock time (ns) before which they must not be delivered: the end
  // of their booking plus the latency. Latency is pipelined (it does not
  // occupy the link), so a chunked transfer pays it once overall. No booking
  // starts before `not_before_ns` (when the transfer started), so a transfer
  // never takes less than its bytes over the bandwidth plus the latency.
  int64_t Reserve(uint64_t bytes, int64_t not_before_ns) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t now = NowNs();
    const int64_t wire_ns =
        bytes_per_second_ > 0
            ? static_cast<int64_t>(static_cast<double>(bytes) * 1e9 /
                                   bytes_per_second_)
            : 0;
    // A link left idle for a moment within a transfer (both copy threads
    // descheduled) may catch up by one chunk's worth of time; idle time
    // beyond that is lost, so the long-run rate never exceeds the cap.
    busy_until_ns_ =
        std::max({busy_until_ns_, now - wire_ns, not_before_ns}) + wire_ns;
    return busy_until_ns_ + latency_ns_;
  }

 private:
  mutable std::mutex mu_;
  double bytes_per_second_ = 0;
  int64_t latency_ns_ = 0;
  int64_t busy_until_ns_ = 0;
};

}  // namespace jcxl

#endif  // JCXL_FFI_LINK_MODEL_H_
