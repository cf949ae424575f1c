#!/usr/bin/env bash
# Installs what tests/vm_test.py needs to boot a Linux VM under QEMU: the
# emulator, a stock kernel in /boot, the CXL/NVDIMM/DAX user tools, and
# virtme-ng (which boots that kernel on this machine's own root file system,
# read-only) in a virtual environment of its own, .vm-venv. Each piece is
# installed only when missing, so a second run takes a second.
#
#   tools/vm_setup.sh           # as root (or with sudo available)
#
# On anything but Linux x86-64 it installs nothing and says so; the VM tests
# then skip with that reason.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vm_venv="${VM_VENV:-${root}/.vm-venv}"
python="${PYTHON:-python3}"

if [[ "$(uname -s)" != Linux || "$(uname -m)" != x86_64 ]]; then
  echo "vm_setup: $(uname -s) $(uname -m) is not Linux x86-64; the VM tests" \
    "(QEMU x86-64 guests) will skip" >&2
  exit 0
fi

# apt package -> a program that shows it is installed.
declare -A wanted=(
  [qemu-system-x86]=/usr/bin/qemu-system-x86_64
  [ndctl]=/usr/bin/ndctl  # also ships cxl(1)
  [daxctl]=/usr/bin/daxctl
  # virtme-ng builds an initramfs around a static busybox to load a stock
  # kernel's modules (9p, virtio).
  [busybox-static]=/bin/busybox
)
present() {  # package program
  [[ -x "$2" ]] || return 1
  if [[ "$1" == busybox-static ]]; then
    ! ldd "$2" >/dev/null 2>&1  # a static binary has no dynamic section
  fi
}
missing=()
for package in "${!wanted[@]}"; do
  present "${package}" "${wanted[${package}]}" || missing+=("${package}")
done
# A kernel with its modules; /boot/vmlinuz-* must be readable to boot it.
if ! compgen -G "/boot/vmlinuz-*" >/dev/null; then
  missing+=(linux-image-amd64)
fi

if [[ ${#missing[@]} -gt 0 ]]; then
  sudo=()
  if [[ "$(id -u)" != 0 ]]; then
    if ! command -v sudo >/dev/null 2>&1; then
      echo "vm_setup: need root to install ${missing[*]} (no sudo)" >&2
      exit 1
    fi
    sudo=(sudo -n)
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "vm_setup: no apt-get to install ${missing[*]}" >&2
    exit 1
  fi
  echo "vm_setup: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -q
  "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if [[ ! -x "${vm_venv}/bin/vng" ]]; then
  echo "vm_setup: installing virtme-ng into ${vm_venv}" >&2
  "${python}" -m venv "${vm_venv}"
  "${vm_venv}/bin/python" -m pip install -q --upgrade pip
  # The version tests/vm_test.py was written against (its command line).
  "${vm_venv}/bin/python" -m pip install -q "virtme-ng==1.42"
fi
