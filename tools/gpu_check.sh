#!/usr/bin/env bash
# The GPU check in one command, on a machine with a CUDA GPU: builds jcxl's
# extension with its CUDA handlers for this machine's Python and CUDA
# toolkit (into build/gpu, the module copied next to jcxl/ so that this
# checkout imports it), checks that JAX sees the GPU and that the handlers
# are there, then runs experiments.gpu_check under a deadline (every part's
# result is written as it ends, so a timeout keeps what ended).
#
#   bash tools/gpu_check.sh                       # all parts, runs/gpu_check
#   bash tools/gpu_check.sh --parts=scan_exact,faults --run_dir=/tmp/gc
#   PYTHON=/path/to/python GPU_CHECK_TIMEOUT=480 bash tools/gpu_check.sh
#
# Needs: a Python with jax and jaxlib for CUDA (jax.devices('cuda')), optax,
# flax, absl-py, nanobind, CMake >= 3.18, a C++17 compiler and the CUDA
# toolkit (nvcc, cudart). Any flag is passed to experiments.gpu_check.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${root}"
python="${PYTHON:-python3}"
deadline="${GPU_CHECK_TIMEOUT:-540}"
build="${root}/build/gpu"

echo "=== gpu_check: ${python} ($("${python}" --version 2>&1))"
if ! "${python}" -c "import jax; assert jax.devices('cuda')" 2>/dev/null; then
  echo "jax cannot see a CUDA GPU from ${python}: install jax for CUDA" \
    "(pip install 'jax[cuda12]' or 'jax[cuda13]') or set PYTHON" >&2
  exit 2
fi
nanobind_dir="$("${python}" -m nanobind --cmake_dir 2>/dev/null || true)"
if [[ -z "${nanobind_dir}" ]]; then
  echo "nanobind is missing for ${python}: pip install nanobind" >&2
  exit 2
fi

echo "=== gpu_check: building the extension with CUDA in ${build}"
mkdir -p "${root}/build"
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
cmake -S "${root}" -B "${build}" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DJCXL_CUDA=ON \
  -DPython_EXECUTABLE="$(command -v "${python}")" \
  -Dnanobind_DIR="${nanobind_dir}" >"${build}.configure.log" 2>&1 || {
  tail -30 "${build}.configure.log" >&2
  exit 1
}
grep "jcxl: CUDA" "${build}.configure.log" || true
cmake --build "${build}" -j "$(nproc)" --target _jcxl
cp "${build}"/_jcxl*.so "${root}/jcxl/"

"${python}" - <<'EOF'
import jcxl
from jcxl import _jcxl
assert _jcxl.cuda_built, "the extension was built without its CUDA handlers"
assert jcxl.cuda_available(), "jcxl's CUDA handlers see no GPU"
print("=== gpu_check: CUDA handlers built;", _jcxl.cuda_device_count(),
      "device(s)")
EOF

echo "=== gpu_check: running (deadline ${deadline} s)"
exec timeout --signal=TERM "${deadline}" "${python}" -m experiments.gpu_check "$@"
