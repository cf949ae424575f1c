#!/usr/bin/env bash
# Builds the C++ core's unit tests (ffi/tests) twice, under AddressSanitizer +
# UndefinedBehaviorSanitizer (LeakSanitizer on: a leak fails the run) and
# under ThreadSanitizer, runs each build with ctest, then fuzzes the core
# (tools/fuzz.sh: at least 10^5 operations per target under ASan + UBSan),
# and exits non-zero on any failed test, broken invariant or sanitizer
# report. Needs only a C++17 compiler with sanitizer runtimes and CMake (no
# Python, no jax); the fuzzers use clang's libFuzzer where it is or can be
# installed, else a random driver (see tools/fuzz.sh).
#
#   tools/cpp_tests.sh            # all three, into build/asan, build/tsan and
#                                 # build/fuzz-*
#   tools/cpp_tests.sh tsan       # only one of them
#   JOBS=4 tools/cpp_tests.sh     # parallel compile and test jobs (default:
#                                 # the number of CPUs)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${JOBS:-$(nproc)}"
builds=("$@")
if [[ ${#builds[@]} -eq 0 ]]; then builds=(asan tsan fuzz); fi

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export TSAN_OPTIONS="halt_on_error=1"
ulimit -c 0  # abort_on_error must not leave core files behind

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi

# Reports that fail the run even if a test's exit status hid them.
report_pattern='ERROR: AddressSanitizer|ERROR: LeakSanitizer|WARNING: ThreadSanitizer|ThreadSanitizer: reported|runtime error:|SUMMARY: (Address|Thread|UndefinedBehavior|Leak)Sanitizer'

run_ctest() {  # dir [prefix command...]; output also into dir/ctest.out
  local dir="$1"
  shift
  "$@" ctest --test-dir "${dir}" --output-on-failure --timeout 180 \
    -j "${jobs}" 2>&1 | tee "${dir}/ctest.out"
}

# LeakSanitizer must be live in the asan build, or leaks pass unnoticed (it
# cannot run under ptrace, for one): a program that leaks on purpose must
# fail with its report.
check_leak_detection() {  # dir
  local canary="$1/lsan_canary"
  printf '%s\n' '#include <cstdlib>' \
    'void* volatile kept;' \
    'int main() { kept = std::malloc(77); kept = nullptr; return 0; }' \
    >"${canary}.cc"
  "${CXX:-c++}" -fsanitize=address -g "${canary}.cc" -o "${canary}"
  if "${canary}" >"${canary}.out" 2>&1 ||
    ! grep -q "ERROR: LeakSanitizer: detected memory leaks" "${canary}.out"; then
    echo "LeakSanitizer did not report a deliberate leak (${canary}.out):" \
      "leaks in the tests would go unnoticed" >&2
    return 1
  fi
  echo "=== asan: LeakSanitizer is on (a deliberate leak was reported)"
}

failures=()
summaries=()
for build in "${builds[@]}"; do
  case "${build}" in
    asan) sanitize="address,undefined" ;;
    tsan) sanitize="thread" ;;
    fuzz)
      start=${SECONDS}
      status=0
      mkdir -p "${root}/build"
      JOBS="${jobs}" bash "${root}/tools/fuzz.sh" 2>&1 |
        tee "${root}/build/fuzz.out" || status=$?
      result="$(grep -E "operations in" "${root}/build/fuzz.out" |
        grep -v "inputs" | sed 's/^ *//' | paste -sd ';' -)"
      summaries+=("fuzz: ${result:-no result} ($((SECONDS - start)) s, exit ${status})")
      if [[ ${status} -ne 0 ]]; then failures+=("fuzz"); fi
      continue
      ;;
    *)
      echo "unknown build '${build}': expected asan, tsan or fuzz" >&2
      exit 2
      ;;
  esac
  dir="${root}/build/${build}"
  start=${SECONDS}
  echo "=== ${build}: configure and build (-fsanitize=${sanitize}) in ${dir}"
  cmake -S "${root}" -B "${dir}" "${generator[@]}" \
    -DJCXL_BUILD_EXTENSION=OFF -DJCXL_BUILD_TESTS=ON \
    -DJCXL_SANITIZE="${sanitize}" -DCMAKE_BUILD_TYPE=Debug >/dev/null
  cmake --build "${dir}" -j "${jobs}"
  built=${SECONDS}

  echo "=== ${build}: ctest"
  log="${dir}/Testing/Temporary/LastTest.log"
  status=0
  run_ctest "${dir}" || status=$?
  # Newer kernels randomize mmap with more bits than older TSan runtimes
  # accept; without address randomization the runtime finds its layout.
  if [[ ${status} -ne 0 && "${build}" == tsan ]] &&
    grep -q "unexpected memory mapping" "${log}" 2>/dev/null; then
    echo "=== tsan: 'unexpected memory mapping'; rerunning under setarch -R"
    status=0
    run_ctest "${dir}" setarch "$(uname -m)" -R || status=$?
    if [[ ${status} -ne 0 ]] &&
      grep -q "unexpected memory mapping" "${log}" 2>/dev/null; then
      echo "TSan still cannot map its shadow memory. Lower the kernel's mmap" \
        "randomization and rerun: sudo sysctl vm.mmap_rnd_bits=28" >&2
    fi
  fi
  if grep -Eq "${report_pattern}" "${log}" 2>/dev/null; then
    echo "=== ${build}: sanitizer reports in ${log}:" >&2
    grep -E "${report_pattern}" "${log}" | sort | uniq -c >&2
    status=1
  fi
  if [[ "${build}" == asan ]]; then
    check_leak_detection "${dir}" || status=1
  fi
  result="$(grep -E "tests passed" "${dir}/ctest.out" || echo "no result")"
  times="build $((built - start)) s, tests $((SECONDS - built)) s"
  summaries+=("${build}: ${result} (${times}, exit ${status})")
  if [[ ${status} -ne 0 ]]; then failures+=("${build}"); fi
done

echo "=== summary (${SECONDS} s in all)"
for line in "${summaries[@]}"; do echo "  ${line}"; done
if [[ ${#failures[@]} -ne 0 ]]; then
  echo "FAILED: ${failures[*]}" >&2
  exit 1
fi
echo "all C++ tests passed under ${builds[*]}"
