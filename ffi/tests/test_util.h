// Helpers shared by the C++ unit tests: test data, files and directories.
#ifndef JCXL_FFI_TESTS_TEST_UTIL_H_
#define JCXL_FFI_TESTS_TEST_UTIL_H_

#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace jcxl {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
constexpr int64_t kMs = 1000000;
// How long a test waits for what must happen (a hang shows as a failure).
constexpr int64_t kLongWaitNs = 30'000 * kMs;

// Bytes that differ for every seed (a cheap xorshift: sanitizer builds are
// slow enough).
inline std::vector<char> Pattern(uint64_t bytes, uint64_t seed) {
  std::vector<char> out(bytes);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint64_t i = 0; i < bytes; i += 8) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    std::memcpy(&out[i], &state, std::min<uint64_t>(8, bytes - i));
  }
  return out;
}

inline bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

// The build tree (ctest runs each test in its build directory), a disk file
// system where O_DIRECT works; JCXL_TEST_DIR overrides it.
inline std::string BuildDir() {
  const char* dir = std::getenv("JCXL_TEST_DIR");
  return dir ? dir : ".";
}

// A fresh directory under `parent`, removed with whatever is left in it when
// the test ends.
class TempDir {
 public:
  explicit TempDir(const std::string& parent = BuildDir()) {
    std::string templ = parent + "/jcxl_test.XXXXXX";
    std::vector<char> buffer(templ.begin(), templ.end());
    buffer.push_back('\0');
    if (mkdtemp(buffer.data()) != nullptr) path_ = buffer.data();
  }
  ~TempDir() {
    if (path_.empty() || !Exists(path_)) return;
    std::string command = "rm -rf '" + path_ + "'";
    if (std::system(command.c_str()) != 0) {
      std::fprintf(stderr, "could not remove %s\n", path_.c_str());
    }
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace jcxl

#endif  // JCXL_FFI_TESTS_TEST_UTIL_H_
