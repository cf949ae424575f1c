"""Open pools by id, so that a PoolArray (which carries only its pool's id,
a static value under jit) can find its pool, and FFI targets registration."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from jcxl import _jcxl
from jcxl._src import errors

if TYPE_CHECKING:
  from jcxl._src.pool import Pool

logger = logging.getLogger(__name__)

_pools: weakref.WeakValueDictionary[int, Pool] = weakref.WeakValueDictionary()
_lock = threading.Lock()
_ffi_registered = False
# The results of steps dispatched (by any thread) and maybe still running:
# what uses a pool's objects must not outlive them (see wait_for_steps).
_steps: list[list[Any]] = []


def add_pool(pool: Pool) -> None:
  with _lock:
    _pools[pool.id] = pool


def find_pool(pool_id: int, *, what: str = "a PoolArray") -> Pool:
  """The open pool with this id, or PoolClosedError naming `what`."""
  pool = _pools.get(pool_id)
  if pool is None or pool.closed:
    raise errors.PoolClosedError(
        f"{what} lives in pool {pool_id}, which is closed; its data is gone")
  return pool


def _running(results: list[Any]) -> bool:
  """Whether the step that makes `results` still runs (a failed one is
  over: its arrays are ready, holding its error)."""
  for x in results:
    try:
      # Deleted (donated to a later step, which is listed itself): asked
      # is_ready(), jax 0.10 crashes.
      if not x.is_deleted() and not x.is_ready():
        return True
    except Exception:  # pylint: disable=broad-except
      pass  # not a live array any more: nothing of it runs
  return False


def _arrays(results: Any) -> list[Any]:
  import jax  # pylint: disable=g-import-not-at-top
  return [x for x in jax.tree_util.tree_leaves(results)
          if isinstance(x, jax.Array)]


def step_dispatched(results: Any) -> None:
  """Notes a dispatched step by its results (all ready once it is over)."""
  arrays = _arrays(results)
  with _lock:
    _steps[:] = [r for r in _steps if _running(r)]
    if arrays:
      _steps.append(arrays)


def wait_for_results(results: Any, timeout_s: float) -> bool:
  """Waits until every array in `results` is ready (its step is over,
  failed or not), at most `timeout_s`; whether they all are."""
  arrays = _arrays(results)
  deadline = time.monotonic() + timeout_s
  pause = 1e-3
  while _running(arrays):
    if time.monotonic() >= deadline:
      return False
    time.sleep(pause)
    pause = min(pause * 2, 0.05)
  return True


def wait_for_steps(timeout_s: float, why: str) -> None:
  """Waits, at most `timeout_s`, until no step dispatched by any thread is
  running, before `why` (closing a pool they may use); logs a warning
  naming how many still run if the bound is hit."""
  with _lock:
    steps = [r for r in _steps if _running(r)]
  if not steps:
    return
  if not wait_for_results(steps, timeout_s):
    running = sum(_running(r) for r in steps)
    logger.warning(
        "jcxl: %d step(s) still running after %g s when %s; their "
        "transfers fail and their results are incomplete", running,
        timeout_s, why)


def open_pools() -> list[Pool]:
  with _lock:
    return [p for p in _pools.values() if not p.closed]


def cuda_available() -> bool:
  """Whether jcxl was built with its CUDA handlers and JAX has a CUDA GPU."""
  if not getattr(_jcxl, "cuda_built", False):
    return False
  import jax  # pylint: disable=g-import-not-at-top
  try:
    return bool(jax.devices("cuda"))
  except RuntimeError:  # no CUDA backend
    return False


def flush_device_transfers() -> None:
  """Returns once every GPU transfer issued so far is logged for the
  profiler (the CUDA handlers log each one from a thread of their own,
  shortly after it ends); nothing to do without them."""
  if getattr(_jcxl, "cuda_built", False):
    _jcxl.cuda_flush()


def register_ffi_targets() -> None:
  """Registers jcxl's XLA FFI targets for the CPU platform, and for CUDA
  where a GPU is there and jcxl was built with CUDA (once)."""
  # Imported here, not above: the pool, which imports this module, works
  # without jax (in a VM under software emulation, importing jax takes
  # minutes).
  import jax  # pylint: disable=g-import-not-at-top
  from jcxl._src import jax_compat  # pylint: disable=g-import-not-at-top

  global _ffi_registered
  with _lock:
    if _ffi_registered:
      return
    for name, capsule in _jcxl.registrations().items():
      jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    if cuda_available():
      for name, capsule in _jcxl.cuda_registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    jax_compat.allow_ffi_effects_in_remat()
    _ffi_registered = True
