#!/usr/bin/env bash
# Prepares this checkout for an offline Bazel build with Debian's Bazel 4.
#
#   tools/bazel_setup.sh [--no-install]
#
# 1. Installs Debian's bazel-bootstrap (Bazel 4.2.3) and the rules
#    repositories that Bazel would otherwise download (bazel-rules-cc,
#    bazel-rules-java), unless they are installed or --no-install is given.
# 2. Copies rules_cc into .bazel_local/ and patches it for Bazel 4.2, and
#    writes a stand-in for @remote_coverage_tools there.
# 3. Finds a Python interpreter with jax and nanobind: $JCXL_PYTHON, else the
#    active virtual environment, else ./.venv, else python3 on PATH.
# 4. Makes .bazel_local/python, a virtual environment that sees the same
#    packages without their import hooks (see step 4 below).
# 5. Writes .bazelrc.local (read by .bazelrc) pointing Bazel at all of it.
#
# Then: bazel build //... && bazel test //...
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${root}"

install=1
for arg in "$@"; do
  case "${arg}" in
    --no-install) install=0 ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "bazel_setup: unknown argument '${arg}' (allowed: --no-install)" >&2
      exit 2
      ;;
  esac
done

debian_share=/usr/share/bazel
packages=(bazel-bootstrap bazel-rules-cc bazel-rules-java patch)

# --- 1. Debian packages ------------------------------------------------------
missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "${pkg}" 2>/dev/null | grep -q 'ok installed' ||
    missing+=("${pkg}")
done
if ((${#missing[@]})); then
  if ((!install)); then
    echo "bazel_setup: missing Debian packages: ${missing[*]}" >&2
    exit 1
  fi
  sudo=()
  if ((EUID != 0)); then sudo=(sudo); fi
  echo "bazel_setup: installing ${missing[*]}"
  "${sudo[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q \
    --no-install-recommends "${missing[@]}"
fi
for dir in "${debian_share}/rules/cc" "${debian_share}/rules/java"; do
  if [[ ! -f "${dir}/WORKSPACE" ]]; then
    echo "bazel_setup: ${dir} is missing; is this Debian 12 or later?" >&2
    exit 1
  fi
done

# --- 2. Local repositories ---------------------------------------------------
local_dir="${root}/.bazel_local"
rm -rf "${local_dir}"
mkdir -p "${local_dir}"
cp -R "${debian_share}/rules/cc" "${local_dir}/rules_cc"
chmod -R u+w "${local_dir}/rules_cc"
if grep -q use_cpp_toolchain \
  "${local_dir}/rules_cc/cc/private/rules_impl/compiler_flag.bzl"; then
  patch --quiet -d "${local_dir}/rules_cc" -p1 \
    <"${root}/third_party/bazel/rules_cc_bazel4.patch"
fi
mkdir -p "${local_dir}/remote_coverage_tools"
touch "${local_dir}/remote_coverage_tools/WORKSPACE"
cp "${root}/third_party/bazel/remote_coverage_tools.BUILD" \
  "${local_dir}/remote_coverage_tools/BUILD"

# --- 3. Python ---------------------------------------------------------------
python="${JCXL_PYTHON:-}"
if [[ -z "${python}" && -n "${VIRTUAL_ENV:-}" ]]; then
  python="${VIRTUAL_ENV}/bin/python"
fi
if [[ -z "${python}" && -x "${root}/.venv/bin/python" ]]; then
  python="${root}/.venv/bin/python"
fi
if [[ -z "${python}" ]]; then
  python="$(command -v python3 || true)"
fi
if [[ -z "${python}" ]]; then
  echo "bazel_setup: no Python found; set JCXL_PYTHON=/path/to/python" >&2
  exit 1
fi
# Keep a virtual environment's own path: resolving its symlink would lose the
# environment and with it jax and nanobind.
case "${python}" in
  /*) ;;
  */*) python="$(cd "$(dirname "${python}")" && pwd)/$(basename "${python}")" ;;
  *) python="$(command -v "${python}" || true)" ;;
esac
if [[ ! -x "${python}" ]]; then
  echo "bazel_setup: '${python}' is not an executable Python" >&2
  exit 1
fi
if ! report="$("${python}" - <<'PY' 2>&1
import sys, sysconfig
import jax, nanobind
print("python    ", sys.executable, "%d.%d" % sys.version_info[:2])
print("headers   ", sysconfig.get_paths()["include"])
print("xla ffi   ", jax.ffi.include_dir(), "(jax %s)" % jax.__version__)
print("nanobind  ", nanobind.source_dir(), "(%s)" % nanobind.__version__)
PY
)"; then
  echo "bazel_setup: ${python} cannot import jax and nanobind:" >&2
  echo "${report}" | tail -n 3 >&2
  echo "Install them (${python} -m pip install jax nanobind) or set" \
    "JCXL_PYTHON to an interpreter that has them." >&2
  exit 1
fi
echo "${report}"

# --- 4. Bazel's own view of that Python -------------------------------------
# A virtual environment over the same interpreter whose site-packages are
# those of ${python}, added as plain paths. Their .pth hooks do not run, so an
# editable `pip install -e .` of jcxl (whose import hook would send
# `import jcxl` to the source tree) cannot shadow the package that Bazel
# builds into a py_test's runfiles.
bazel_python="${local_dir}/python/bin/python"
if ! "${python}" - "${local_dir}/python" <<'PY'
import os, site, subprocess, sys
env_dir = sys.argv[1]
base = getattr(sys, "_base_executable", sys.executable)
subprocess.run([base, "-m", "venv", "--without-pip", env_dir], check=True)
dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
user_site = site.getusersitepackages() if site.ENABLE_USER_SITE else None
if user_site and os.path.isdir(user_site):
    dirs.append(user_site)
purelib = subprocess.run(
    [os.path.join(env_dir, "bin", "python"), "-c",
     "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
    check=True, capture_output=True, text=True).stdout.strip()
with open(os.path.join(purelib, "_jcxl_site_packages.pth"), "w") as f:
    f.write("\n".join(dirs) + "\n")
PY
then
  echo "bazel_setup: could not make ${local_dir}/python; Bazel uses" \
    "${python} itself (an editable jcxl install there shadows Bazel's)." >&2
  bazel_python="${python}"
elif ! "${bazel_python}" -c 'import jax, nanobind' 2>/dev/null; then
  echo "bazel_setup: ${bazel_python} cannot import jax and nanobind;" \
    "Bazel uses ${python} itself." >&2
  bazel_python="${python}"
fi

# --- 5. .bazelrc.local -------------------------------------------------------
# Bazel reads .bazelrc.local through .bazelrc's try-import. `query` and
# `fetch` do not inherit `build` options, so each line is written for all
# three commands.
repo_flags=(
  "--repo_env=JCXL_PYTHON=${bazel_python}"
  "--override_repository=rules_cc=${local_dir}/rules_cc"
  "--override_repository=rules_java=${debian_share}/rules/java"
  "--override_repository=remote_coverage_tools=${local_dir}/remote_coverage_tools"
)
{
  echo "# Written by tools/bazel_setup.sh for this machine; not for git."
  echo "# @jcxl_python's interpreter; Debian's rules repositories in place of"
  echo "# downloads (rules_cc patched for Bazel 4.2)."
  for command in build query fetch; do
    for flag in "${repo_flags[@]}"; do
      echo "${command} ${flag}"
    done
  done
  echo "# Debian's linux-sandbox logs a page of debug lines per action; this"
  echo "# sandbox enforces the same declared inputs quietly."
  echo "build --spawn_strategy=processwrapper-sandbox"
} >"${root}/.bazelrc.local"
echo "bazel      ${bazel_python}"
echo "bazel_setup: wrote .bazelrc.local; now run: bazel test //..."
