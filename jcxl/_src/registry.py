"""Open pools by id, so that a PoolArray (which carries only its pool's id,
a static value under jit) can find its pool, and FFI targets registration."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from jcxl import _jcxl
from jcxl._src import errors

# A jcxl._src.pool.Pool: pool.py registers its pools here, so this module
# does not import it (the dependency runs one way).
Pool = Any

_pools: weakref.WeakValueDictionary[int, Pool] = weakref.WeakValueDictionary()
_lock = threading.Lock()
_ffi_registered = False


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
