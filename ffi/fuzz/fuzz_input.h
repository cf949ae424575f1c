// Helpers shared by the fuzz targets: a decoder that turns the fuzzer's
// bytes into choices, a check that stops the run on a broken invariant, and
// the count of operations each target reports when the process exits.
#ifndef JCXL_FFI_FUZZ_FUZZ_INPUT_H_
#define JCXL_FFI_FUZZ_FUZZ_INPUT_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace jcxl::fuzz {

// Reads choices off the input, front to back; once it is used up every
// choice is the smallest one and done() is true.
class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  bool done() const { return pos_ >= size_; }
  uint8_t Byte() { return done() ? 0 : data_[pos_++]; }

  // A value in [lo, hi], from as many bytes as the range needs.
  uint64_t Range(uint64_t lo, uint64_t hi) {
    if (hi <= lo) return lo;
    const uint64_t span = hi - lo;
    uint64_t value = 0;
    for (uint64_t left = span; left > 0; left >>= 8) {
      value = (value << 8) | Byte();
    }
    return lo + (span == UINT64_MAX ? value : value % (span + 1));
  }

  // An object size: slab-sized, page-sized or large, up to `max_bytes`.
  uint64_t Size(uint64_t max_bytes) {
    switch (Byte() % 4) {
      case 0:
      case 1:
        return Range(1, 4096);
      case 2:
        return Range(4097, 96 * 1024);
      default:
        return Range(1, max_bytes);
    }
  }

  int32_t Int32() {
    return static_cast<int32_t>(static_cast<uint32_t>(Range(0, UINT32_MAX)));
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// Operations done over the whole run, printed when the process exits
// ("<target>: N operations in M inputs"); tools/fuzz.sh reads the line.
struct Counter {
  const char* target;
  uint64_t operations = 0;
  uint64_t inputs = 0;
  explicit Counter(const char* name) : target(name) {}
  ~Counter() {
    std::fprintf(stderr, "%s: %llu operations in %llu inputs\n", target,
                 static_cast<unsigned long long>(operations),
                 static_cast<unsigned long long>(inputs));
  }
};

[[noreturn]] inline void Violated(const char* file, int line,
                                  const char* condition,
                                  const std::string& detail) {
  std::fprintf(stderr, "%s:%d: invariant violated: %s\n  %s\n", file, line,
               condition, detail.c_str());
  std::fflush(stderr);
  std::abort();  // the fuzzer keeps the input that got here
}

}  // namespace jcxl::fuzz

// Stops the run (abort: libFuzzer saves the input) if `condition` is false.
#define FUZZ_CHECK(condition, detail)                                       \
  do {                                                                      \
    if (!(condition)) {                                                     \
      ::jcxl::fuzz::Violated(__FILE__, __LINE__, #condition, (detail));     \
    }                                                                       \
  } while (0)

#endif  // JCXL_FFI_FUZZ_FUZZ_INPUT_H_
