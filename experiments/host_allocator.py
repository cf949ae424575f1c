"""The host allocator the experiments are measured under: glibc's malloc
with transparent huge pages.

Where there is no accelerator the device is XLA:CPU, which takes every
buffer of a step (activations, gradients, the buffers fetches land in)
from glibc's malloc. With glibc's default 4 KiB pages, memory that malloc
hands back to the kernel between steps is faulted in again on the next
one: for experiments.host_update's 41.7M-parameter GPT about 170,000
faults and 0.4 s of kernel time in a 1.4 s resident step on a 2-core
machine, and more in an offloaded step, whose fetched weights land in
fresh buffers. A GPU's device allocator keeps its memory and has no such
cost, so an emulated device that pays it measures the page faults, not
the step. glibc 2.35 and later back malloc's memory with transparent huge
pages when ``GLIBC_TUNABLES`` holds ``glibc.malloc.hugetlb=1`` (512 times
fewer faults). glibc reads that once, at process start, so
``start_with_huge_pages`` runs the program again with it set.

A ``GLIBC_TUNABLES`` that already names ``glibc.malloc.hugetlb`` is the
user's choice and is kept; every results file's header says which
allocator ran (``describe``).
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb"
_ENV = "GLIBC_TUNABLES"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _tunables(environ: dict[str, str]) -> dict[str, str]:
  """GLIBC_TUNABLES's settings (``a=1:b=2``), by name."""
  pairs = (item.partition("=") for item in
           environ.get(_ENV, "").split(":") if item)
  return {name: value for name, _, value in pairs}


def _glibc_supports_it() -> bool:
  """glibc 2.35 or later, the first with the tunable."""
  libc, version = platform.libc_ver()
  if libc != "glibc":
    return False
  try:
    major, minor = (int(x) for x in version.split(".")[:2])
  except ValueError:
    return False
  return (major, minor) >= (2, 35)


def _kernel_thp_mode() -> str | None:
  """The kernel's THP mode ('always', 'madvise' or 'never'), None if
  unknown."""
  try:
    with open(_THP_MODE, encoding="ascii") as f:
      text = f.read()
  except OSError:
    return None
  start, end = text.find("["), text.find("]")
  return text[start + 1:end] if 0 <= start < end else None


def huge_pages_on(environ: dict[str, str] | None = None) -> bool:
  """Whether this process's malloc was started with huge pages."""
  value = _tunables(dict(os.environ if environ is None else environ)
                    ).get(TUNABLE)
  return value not in (None, "0") and _glibc_supports_it() and (
      _kernel_thp_mode() in ("always", "madvise"))


def describe() -> str:
  """The allocator this process runs under, for a results file's header."""
  setting = _tunables(dict(os.environ)).get(TUNABLE)
  if huge_pages_on():
    return (f"glibc malloc with transparent huge pages "
            f"({_ENV}={TUNABLE}={setting}; kernel THP "
            f"'{_kernel_thp_mode()}')")
  if not _glibc_supports_it():
    why = f"{platform.libc_ver()[0] or 'libc'} without {TUNABLE}"
  elif _kernel_thp_mode() not in ("always", "madvise"):
    why = f"kernel THP '{_kernel_thp_mode()}'"
  elif setting is not None:
    why = f"{_ENV} sets {TUNABLE}={setting}"
  else:
    why = f"{TUNABLE} not set"
  return f"malloc with 4 KiB pages ({why})"


def environment_with_huge_pages(environ: dict[str, str]
                                ) -> dict[str, str] | None:
  """`environ` with the tunable added; None where it should be left as it
  is (already named there, or glibc or the kernel cannot use it)."""
  if TUNABLE in _tunables(environ) or not _glibc_supports_it() or (
      _kernel_thp_mode() not in ("always", "madvise")):
    return None
  setting = f"{TUNABLE}=1"
  existing = environ.get(_ENV)
  return {**environ, _ENV: f"{existing}:{setting}" if existing else setting}


def start_with_huge_pages() -> None:
  """Runs this program again, from the start, with huge pages; returns
  (having changed nothing) where that is not wanted or possible.

  Call it first thing in a program's ``__main__`` block: `os.execve`
  replaces the process, so nothing done before it survives.
  """
  environ = environment_with_huge_pages(dict(os.environ))
  argv = getattr(sys, "orig_argv", None)
  if environ is None or not argv:
    return
  # Before app.run absl's logging is not set up yet: plain stderr.
  sys.stdout.flush()
  print(f"re-running with {_ENV}={environ[_ENV]} (malloc in huge pages: "
        "see experiments/host_allocator.py)", file=sys.stderr, flush=True)
  os.execve(sys.executable, [sys.executable, *argv[1:]], environ)
