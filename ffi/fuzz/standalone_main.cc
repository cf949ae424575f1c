// Runs a fuzz target without libFuzzer (any C++ compiler, e.g. g++ with
// -fsanitize=address,undefined): random inputs from a seeded generator
// until a time budget is spent, or the input files given (to replay what a
// fuzzer found). No coverage feedback: it is a randomized driver, not a
// fuzzer, and tools/fuzz.sh says so when it falls back to it.
//
//   pool_fuzzer -max_total_time=20 -seed=1 -max_len=4096
//   pool_fuzzer crash-0123abcd
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

bool Flag(const char* arg, const char* name, long long* value) {
  const size_t n = std::strlen(name);
  if (std::strncmp(arg, name, n) != 0 || arg[n] != '=') return false;
  *value = std::atoll(arg + n + 1);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  long long seconds = 10, seed = 1, max_len = 4096, runs = -1;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    if (Flag(argv[i], "-max_total_time", &seconds) ||
        Flag(argv[i], "-seed", &seed) || Flag(argv[i], "-max_len", &max_len) ||
        Flag(argv[i], "-runs", &runs)) {
      continue;
    }
    if (argv[i][0] == '-') continue;  // other libFuzzer flags: ignored
    files.push_back(argv[i]);
  }
  if (!files.empty()) {
    for (const std::string& file : files) {
      std::ifstream in(file, std::ios::binary);
      std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                                 std::istreambuf_iterator<char>());
      std::fprintf(stderr, "running %s (%zu bytes)\n", file.c_str(),
                   bytes.size());
      LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
    }
    return 0;
  }
  std::mt19937_64 rng(static_cast<uint64_t>(seed));
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  std::vector<uint8_t> input;
  long long done = 0;
  while (std::chrono::steady_clock::now() < deadline &&
         (runs < 0 || done < runs)) {
    // Short inputs as often as long ones: both find different things.
    const size_t len = rng() % (1 + rng() % static_cast<uint64_t>(max_len));
    input.resize(len);
    for (uint8_t& byte : input) byte = static_cast<uint8_t>(rng());
    LLVMFuzzerTestOneInput(input.data(), input.size());
    ++done;
  }
  std::fprintf(stderr, "standalone driver: %lld inputs in about %lld s, "
               "seed %lld\n", done, seconds, seed);
  return 0;
}
