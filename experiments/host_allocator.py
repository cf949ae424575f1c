"""The host allocator the experiments are measured under: glibc's malloc
keeping the memory it has, as a GPU's device allocator does.

Where there is no accelerator the device is XLA:CPU, which takes every
buffer of a step (activations, gradients, the buffers fetches land in)
from glibc's malloc. By default malloc gives freed memory back to the
kernel (buffers over 32 MiB are their own mappings, and the per-thread
arenas shrink), so the next step faults it in again, zeroed: for
experiments.host_update's 41.7M-parameter GPT about 170,000 faults and
0.4 s of kernel time in a 1.4 s resident step on a 2-core machine, and
more in an offloaded step, whose fetched weights land in fresh buffers. A
GPU's allocator reserves its memory once and reuses it, so an emulated
device that pays this measures the page faults, not the step.

``TUNABLES`` makes malloc keep what it has: one arena (the others would
give their heaps back), no mappings of their own for large buffers, no
trimming; and its memory in transparent huge pages (512 times fewer
faults while it grows). glibc reads ``GLIBC_TUNABLES`` only at process
start, so ``start`` runs the program again with them set. After the first
steps a step then faults in nothing. The price is a process that keeps
its peak heap until it exits, which a training job does anyway.

A ``GLIBC_TUNABLES`` that already sets any ``glibc.malloc`` tunable is the
user's choice and is kept; every results file's header says which
allocator ran (``describe``).
"""

from __future__ import annotations

import os
import platform
import sys

_ENV = "GLIBC_TUNABLES"
_PREFIX = "glibc.malloc."
TUNABLES = {
    "glibc.malloc.arena_max": "1",
    "glibc.malloc.mmap_max": "0",
    "glibc.malloc.trim_threshold": str(1 << 46),
    "glibc.malloc.hugetlb": "1",  # glibc 2.35 and later; older ones ignore it
}
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _tunables(environ: dict[str, str]) -> dict[str, str]:
  """GLIBC_TUNABLES's settings (``a=1:b=2``), by name."""
  pairs = (item.partition("=") for item in
           environ.get(_ENV, "").split(":") if item)
  return {name: value for name, _, value in pairs}


def _kernel_thp_mode() -> str:
  """The kernel's THP mode ('always', 'madvise', 'never'; '?' unknown)."""
  try:
    with open(_THP_MODE, encoding="ascii") as f:
      text = f.read()
  except OSError:
    return "?"
  start, end = text.find("["), text.find("]")
  return text[start + 1:end] if 0 <= start < end else "?"


def _is_glibc() -> bool:
  return platform.libc_ver()[0] == "glibc"


def tuned(environ: dict[str, str] | None = None) -> bool:
  """Whether a process with `environ` (default: this one's) runs with
  ``TUNABLES``."""
  settings = _tunables(dict(os.environ if environ is None else environ))
  return _is_glibc() and all(settings.get(k) == v
                             for k, v in TUNABLES.items())


def describe() -> str:
  """The allocator this process runs under, for a results file's header."""
  settings = _tunables(dict(os.environ))
  if not _is_glibc():
    return f"{platform.libc_ver()[0] or 'unknown libc'}'s malloc, untuned"
  if tuned():
    return ("glibc malloc keeping its memory, in huge pages (kernel THP "
            f"'{_kernel_thp_mode()}'): {_ENV}=" + ":".join(
                f"{k}={v}" for k, v in TUNABLES.items()))
  own = {k: v for k, v in settings.items() if k.startswith(_PREFIX)}
  if own:
    return f"glibc malloc as {_ENV} sets it: " + ":".join(
        f"{k}={v}" for k, v in own.items())
  return "glibc malloc's defaults (memory given back to the kernel)"


def environment_with_tunables(environ: dict[str, str]
                              ) -> dict[str, str] | None:
  """`environ` with ``TUNABLES`` added; None where it is to be left as it
  is (not glibc, or it already sets a glibc.malloc tunable)."""
  settings = _tunables(environ)
  if not _is_glibc() or any(k.startswith(_PREFIX) for k in settings):
    return None
  added = ":".join(f"{k}={v}" for k, v in TUNABLES.items())
  existing = environ.get(_ENV)
  return {**environ, _ENV: f"{existing}:{added}" if existing else added}


def _cannot_rerun() -> str | None:
  """Why running this program again would not run the same program, or
  None."""
  if not sys.executable:  # argv[0] was not found on PATH
    return "the interpreter's own path is unknown (sys.executable is empty)"
  if not os.access(sys.executable, os.X_OK):
    return f"the interpreter {sys.executable!r} cannot be run again"
  program = sys.argv[0] if sys.argv else ""
  if program in ("", "-"):
    return "the program was read from standard input, which is used up"
  if program != "-c" and not (os.path.isfile(program) or
                              os.path.isdir(program)):
    # e.g. python <(...): the pipe it was read from is used up
    return f"the program {program!r} cannot be read again"
  return None


def start() -> None:
  """Runs this program again, from the start, with ``TUNABLES``; returns
  (having changed nothing) where that is not wanted or possible.

  Where running it again would not run the same program (one read from
  standard input, an interpreter whose path is unknown), the program runs
  on, untuned, and says so on stderr; ``describe`` says so in its results.

  Call it first thing in a program's ``__main__`` block: `os.execve`
  replaces the process, so nothing done before it survives.
  """
  environ = environment_with_tunables(dict(os.environ))
  argv = getattr(sys, "orig_argv", None)
  if environ is None or not argv:
    return
  # Before app.run absl's logging is not set up yet: plain stderr.
  def untuned(why: str) -> None:
    print(f"not re-running with {_ENV}: {why}; running on with glibc "
          "malloc's defaults, untuned, as the results' header will say "
          "(see experiments/host_allocator.py)", file=sys.stderr, flush=True)

  why = _cannot_rerun()
  if why is not None:
    untuned(why)
    return
  sys.stdout.flush()
  print(f"re-running with {_ENV}={environ[_ENV]} (malloc keeps its memory: "
        "see experiments/host_allocator.py)", file=sys.stderr, flush=True)
  try:
    os.execve(sys.executable, [sys.executable, *argv[1:]], environ)
  except (OSError, ValueError) as e:  # the process is unchanged
    untuned(f"cannot run {sys.executable!r} ({e})")
