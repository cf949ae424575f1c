// A tiny test harness for the jcxl C++ core, so that its unit tests build
// with nothing but a compiler (no gtest). Tests register themselves with
// TEST(name); JCXL_TEST_MAIN() runs them all, or only those whose names
// contain one of the command-line arguments.
//
//   TEST(AllocatorRejectsZeroBytes) {
//     ExtentAllocator allocator(1 << 20, 4096);
//     CHECK_EQ(allocator.Allocate(0).status().code(), Code::kInvalidArgument);
//   }
//
// A failed CHECK prints file:line, the expression and the values it compared,
// then ends the current test (the remaining tests still run). The program
// exits with 1 if any test failed.
#ifndef JCXL_FFI_TESTS_CHECK_H_
#define JCXL_FFI_TESTS_CHECK_H_

#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "status.h"

namespace jcxl::testing {

inline const char* CodeName(Code code) {
  switch (code) {
    case Code::kOk:
      return "kOk";
    case Code::kInvalidArgument:
      return "kInvalidArgument";
    case Code::kNotFound:
      return "kNotFound";
    case Code::kExhausted:
      return "kExhausted";
    case Code::kClosed:
      return "kClosed";
    case Code::kTimeout:
      return "kTimeout";
    case Code::kIo:
      return "kIo";
    case Code::kInternal:
      return "kInternal";
  }
  return "Code(?)";
}

template <typename T, typename = void>
struct IsStreamable : std::false_type {};
template <typename T>
struct IsStreamable<T, std::void_t<decltype(std::declval<std::ostream&>()
                                            << std::declval<const T&>())>>
    : std::true_type {};

// How a CHECK_* operand is printed when the check fails.
template <typename T>
std::string Show(const T& value) {
  if constexpr (std::is_same_v<T, Code>) {
    return CodeName(value);
  } else if constexpr (std::is_same_v<T, Status>) {
    return std::string(CodeName(value.code())) + ": " + value.message();
  } else if constexpr (std::is_same_v<T, bool>) {
    return value ? "true" : "false";
  } else if constexpr (std::is_enum_v<T>) {
    return std::to_string(static_cast<long long>(value));
  } else if constexpr (std::is_same_v<T, std::string> ||
                       std::is_same_v<std::decay_t<T>, const char*> ||
                       std::is_same_v<std::decay_t<T>, char*>) {
    return "\"" + std::string(value) + "\"";
  } else if constexpr (IsStreamable<T>::value) {
    std::ostringstream out;
    out << value;
    return out.str();
  } else {
    return "<unprintable>";
  }
}

inline const Status& StatusOf(const Status& status) { return status; }
template <typename T>
const Status& StatusOf(const StatusOr<T>& result) {
  return result.status();
}

// Thrown by a failed CHECK; caught by the runner, never by a test.
struct Failure {};

struct TestCase {
  const char* name;
  void (*body)();
};

inline std::vector<TestCase>& Registry() {
  static std::vector<TestCase> tests;
  return tests;
}

struct Registrar {
  Registrar(const char* name, void (*body)()) {
    Registry().push_back({name, body});
  }
};

[[noreturn]] inline void Fail(const char* file, int line,
                              const std::string& what) {
  std::fprintf(stderr, "%s:%d: Failure\n%s\n", file, line, what.c_str());
  std::fflush(stderr);
  throw Failure{};
}

template <typename A, typename B>
void CheckOp(bool passed, const char* file, int line, const char* expression,
             const A& a, const B& b) {
  if (passed) return;
  Fail(file, line,
       std::string("  CHECK(") + expression + ")\n    left:  " + Show(a) +
           "\n    right: " + Show(b));
}

inline int RunAll(int argc, char** argv) {
  int failed = 0;
  int ran = 0;
  std::vector<std::string> failures;
  for (const TestCase& test : Registry()) {
    bool selected = argc <= 1;
    for (int i = 1; i < argc; ++i) {
      if (std::strstr(test.name, argv[i]) != nullptr) selected = true;
    }
    if (!selected) continue;
    ++ran;
    std::printf("[ RUN      ] %s\n", test.name);
    std::fflush(stdout);
    const auto start = std::chrono::steady_clock::now();
    bool ok = true;
    try {
      test.body();
    } catch (const Failure&) {
      ok = false;
    }
    const long long ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(
            std::chrono::steady_clock::now() - start)
            .count();
    std::printf("[ %s ] %s (%lld ms)\n", ok ? "      OK" : " FAILED ",
                test.name, ms);
    std::fflush(stdout);
    if (!ok) {
      ++failed;
      failures.push_back(test.name);
    }
  }
  std::printf("[==========] %d tests ran, %d passed, %d failed\n", ran,
              ran - failed, failed);
  for (const std::string& name : failures) {
    std::printf("[  FAILED  ] %s\n", name.c_str());
  }
  if (ran == 0) {
    std::printf("no test matched the given names\n");
    return 1;
  }
  return failed == 0 ? 0 : 1;
}

}  // namespace jcxl::testing

#define TEST(name)                                                           \
  static void name();                                                        \
  static const ::jcxl::testing::Registrar name##_registrar_(#name,           \
                                                           &name);           \
  static void name()

#define JCXL_TEST_MAIN()                                                     \
  int main(int argc, char** argv) {                                          \
    return ::jcxl::testing::RunAll(argc, argv);                              \
  }

#define CHECK(condition)                                                     \
  do {                                                                       \
    if (!(condition)) {                                                      \
      ::jcxl::testing::Fail(__FILE__, __LINE__, "  CHECK(" #condition ")");  \
    }                                                                        \
  } while (0)

#define JCXL_CHECK_OP(op, a, b)                                              \
  do {                                                                       \
    const auto _jcxl_a = (a);                                                \
    const auto _jcxl_b = (b);                                                \
    ::jcxl::testing::CheckOp(_jcxl_a op _jcxl_b, __FILE__, __LINE__,         \
                             #a " " #op " " #b, _jcxl_a, _jcxl_b);           \
  } while (0)

#define CHECK_EQ(a, b) JCXL_CHECK_OP(==, a, b)
#define CHECK_NE(a, b) JCXL_CHECK_OP(!=, a, b)
#define CHECK_LT(a, b) JCXL_CHECK_OP(<, a, b)
#define CHECK_LE(a, b) JCXL_CHECK_OP(<=, a, b)
#define CHECK_GT(a, b) JCXL_CHECK_OP(>, a, b)
#define CHECK_GE(a, b) JCXL_CHECK_OP(>=, a, b)

// Passes for an ok Status or StatusOr; else prints the status.
#define CHECK_OK(expr)                                                       \
  do {                                                                       \
    const ::jcxl::Status _jcxl_s = ::jcxl::testing::StatusOf(expr);          \
    if (!_jcxl_s.ok()) {                                                     \
      ::jcxl::testing::Fail(__FILE__, __LINE__,                              \
                            "  CHECK_OK(" #expr ")\n    status: " +          \
                                ::jcxl::testing::Show(_jcxl_s));             \
    }                                                                        \
  } while (0)

// Checks the status code of a Status or StatusOr.
#define CHECK_CODE(expr, expected)                                           \
  do {                                                                       \
    const ::jcxl::Status _jcxl_s = ::jcxl::testing::StatusOf(expr);          \
    ::jcxl::testing::CheckOp(_jcxl_s.code() == (expected), __FILE__,         \
                             __LINE__, "code of " #expr " == " #expected,    \
                             _jcxl_s, (expected));                           \
  } while (0)

// Checks that a message contains a substring.
#define CHECK_CONTAINS(text, part)                                           \
  do {                                                                       \
    const std::string _jcxl_text = (text);                                   \
    const std::string _jcxl_part = (part);                                   \
    ::jcxl::testing::CheckOp(                                                \
        _jcxl_text.find(_jcxl_part) != std::string::npos, __FILE__,          \
        __LINE__, #text " contains " #part, _jcxl_text, _jcxl_part);         \
  } while (0)

#endif  // JCXL_FFI_TESTS_CHECK_H_
