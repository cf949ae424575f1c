#!/usr/bin/env bash
# Builds the fuzz targets (ffi/fuzz/*_fuzzer.cc: the allocators, and the
# pool's handle API) under AddressSanitizer + UndefinedBehaviorSanitizer,
# leak detection on, and runs each until it has done FUZZ_MIN_OPS operations
# (each followed by its invariant checks), in rounds of FUZZ_ROUND_SECONDS,
# for at most FUZZ_MAX_SECONDS. Exits non-zero on a crash, a broken
# invariant, a sanitizer report, or too few operations.
#
# The engine is libFuzzer (clang -fsanitize=fuzzer). Where clang or its
# libFuzzer runtime is missing and apt-get can install them (as root, or
# with sudo that asks no password), they are installed first; otherwise the
# targets are built with the default compiler and a seeded random driver
# (ffi/fuzz/standalone_main.cc), which has no coverage feedback, and the
# script says so. FUZZ_ENGINE=libfuzzer|standalone forces one.
#
#   tools/fuzz.sh                    # both targets, 10^5 operations each
#   FUZZ_MIN_OPS=1000000 FUZZ_MAX_SECONDS=900 tools/fuzz.sh pool_fuzzer
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${JOBS:-$(nproc)}"
min_ops="${FUZZ_MIN_OPS:-100000}"
round_seconds="${FUZZ_ROUND_SECONDS:-15}"
max_seconds="${FUZZ_MAX_SECONDS:-240}"
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then targets=(allocator_fuzzer pool_fuzzer); fi

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
ulimit -c 0
report_pattern='ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error:|SUMMARY: (Address|UndefinedBehavior|Leak)Sanitizer|ERROR: libFuzzer|invariant violated'

can_libfuzzer() {  # compiles and links an empty libFuzzer target
  local dir
  dir="$(mktemp -d)"
  printf '%s\n' '#include <cstddef>' '#include <cstdint>' \
    'extern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }' \
    >"${dir}/probe.cc"
  local ok=1
  clang++ -fsanitize=fuzzer,address,undefined "${dir}/probe.cc" \
    -o "${dir}/probe" >/dev/null 2>&1 || ok=0
  rm -rf "${dir}"
  [[ ${ok} -eq 1 ]]
}

install_clang() {  # best effort; says what it does
  local sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      sudo=(sudo -n)
    else
      echo "=== fuzz: clang with libFuzzer is missing and apt-get needs root"
      return 1
    fi
  fi
  command -v apt-get >/dev/null 2>&1 || return 1
  echo "=== fuzz: installing clang and its libFuzzer runtime with apt-get"
  local packages=(clang)
  if ! command -v clang++ >/dev/null 2>&1; then
    "${sudo[@]}" apt-get install -y -q --no-install-recommends clang \
      >/dev/null 2>&1 ||
      { "${sudo[@]}" apt-get update -q >/dev/null 2>&1 &&
        "${sudo[@]}" apt-get install -y -q --no-install-recommends clang \
          >/dev/null 2>&1; } || return 1
  fi
  local major
  major="$(clang++ -dumpversion | cut -d. -f1)"
  # Debian 12 and later ship libFuzzer in libclang-rt-<major>-dev.
  "${sudo[@]}" apt-get install -y -q --no-install-recommends \
    "libclang-rt-${major}-dev" >/dev/null 2>&1 || true
  can_libfuzzer
}

engine="${FUZZ_ENGINE:-}"
if [[ -z "${engine}" ]]; then
  if command -v clang++ >/dev/null 2>&1 && can_libfuzzer; then
    engine=libfuzzer
  elif install_clang; then
    engine=libfuzzer
  else
    engine=standalone
    echo "=== fuzz: NOTE: no clang with libFuzzer here; running the targets" \
      "under a seeded random driver (no coverage feedback) built with" \
      "${CXX:-the default compiler}"
  fi
fi
compiler=()
if [[ "${engine}" == libfuzzer ]]; then
  compiler=(-DCMAKE_CXX_COMPILER=clang++)
fi

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
dir="${root}/build/fuzz-${engine}"
start=${SECONDS}
echo "=== fuzz: configure and build (${engine}, -fsanitize=address,undefined)" \
  "in ${dir}"
cmake -S "${root}" -B "${dir}" "${generator[@]}" "${compiler[@]}" \
  -DJCXL_BUILD_EXTENSION=OFF -DJCXL_BUILD_TESTS=OFF \
  -DJCXL_BUILD_FUZZERS=ON -DJCXL_FUZZ_ENGINE="${engine}" \
  -DJCXL_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  >/dev/null
cmake --build "${dir}" -j "${jobs}" --target "${targets[@]}"
echo "=== fuzz: built in $((SECONDS - start)) s"

# The nvme tier's file on tmpfs where there is one: the fuzzers check the
# pool's bookkeeping; the disk's O_DIRECT path has its own unit tests.
if [[ -z "${JCXL_FUZZ_DIR:-}" && -w /dev/shm ]]; then
  export JCXL_FUZZ_DIR=/dev/shm
fi

failures=()
summaries=()
for target in "${targets[@]}"; do
  corpus="${dir}/corpus/${target}"
  artifacts="${dir}/artifacts/${target}"
  mkdir -p "${corpus}" "${artifacts}"
  # A few long random seeds: many operations per input from the start.
  if [[ -z "$(ls -A "${corpus}")" ]]; then
    for i in 1 2 3 4; do
      head -c 4096 /dev/urandom >"${corpus}/seed-${i}"
    done
  fi
  log="${dir}/${target}.log"
  : >"${log}"
  ops=0
  rounds=0
  status=0
  target_start=${SECONDS}
  while [[ ${ops} -lt ${min_ops} &&
    $((SECONDS - target_start)) -lt ${max_seconds} ]]; do
    rounds=$((rounds + 1))
    round_log="${dir}/${target}.round.log"
    args=(-max_total_time="${round_seconds}" -max_len=4096 -seed="${rounds}")
    if [[ "${engine}" == libfuzzer ]]; then
      args+=(-len_control=0 -timeout=60 -rss_limit_mb=4096
        -artifact_prefix="${artifacts}/" -print_final_stats=1 "${corpus}")
    fi
    "${dir}/${target}" "${args[@]}" >"${round_log}" 2>&1 || status=$?
    cat "${round_log}" >>"${log}"
    done_now="$(sed -n "s/^${target}: \([0-9]*\) operations.*/\1/p" \
      "${round_log}" | tail -n 1)"
    ops=$((ops + ${done_now:-0}))
    if [[ ${status} -ne 0 ]] || grep -Eq "${report_pattern}" "${round_log}"; then
      if [[ ${status} -eq 0 ]]; then status=1; fi
      echo "=== fuzz: ${target} failed (exit ${status}); the end of its log:" >&2
      tail -n 60 "${round_log}" >&2
      ls "${artifacts}" >&2 || true
      break
    fi
  done
  seconds=$((SECONDS - target_start))
  if [[ ${status} -eq 0 && ${ops} -lt ${min_ops} ]]; then
    echo "=== fuzz: ${target} did only ${ops} operations in ${seconds} s" \
      "(at least ${min_ops} wanted)" >&2
    status=1
  fi
  summaries+=("${target}: ${ops} operations in ${rounds} rounds, ${seconds} s (${engine}), exit ${status}")
  if [[ ${status} -ne 0 ]]; then failures+=("${target}"); fi
done

echo "=== fuzz: summary"
for line in "${summaries[@]}"; do echo "  ${line}"; done
if [[ ${#failures[@]} -ne 0 ]]; then
  echo "FUZZ FAILED: ${failures[*]} (inputs that failed: ${dir}/artifacts)" >&2
  exit 1
fi
echo "fuzz: every target did at least ${min_ops} operations, all invariants held"
