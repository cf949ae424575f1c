"""The offloaded steps dispatched and maybe still running, from every thread.

JAX keeps the tokens of side-effecting computations per thread:
``jax.effects_barrier()`` waits only for what the calling thread
dispatched. A pool's objects are the process's, though: a training loop
run in a worker thread, then ``jcxl.gather`` (or a checkpoint, a delete,
a close) in the main thread, must see every store that loop dispatched,
and a step dispatched from one thread must not read an object that a
step of another thread is still writing.

So every offloaded step notes here the results of its call and the pool
objects it uses, per thread; within one thread the steps run in the order
dispatched, so the last one a thread dispatched is the one to wait for.
`barrier` waits for every thread's, `wait_for_others` for other threads'
that share an object with a step about to be dispatched.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import jax

from jcxl._src import jax_compat

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Dispatched:
  results: Any  # the step's outputs: ready once it ran (or failed)
  handles: frozenset[int]  # the pool objects it fetches or stores
  thread: str


_lock = threading.Lock()
_last: dict[int, _Dispatched] = {}  # thread ident -> its last step


def note(results: Any, handles: frozenset[int]) -> None:
  """Notes that this thread dispatched a step using `handles`, whose
  outputs are `results`."""
  entry = _Dispatched(results, handles, threading.current_thread().name)
  with _lock:
    _last[threading.get_ident()] = entry


def _wait(ident: int, entry: _Dispatched) -> None:
  """Waits for `entry` and forgets it; a failure raises here, once (its
  own results raise it to the thread that dispatched it too)."""
  try:
    jax.block_until_ready(entry.results)
  finally:
    with _lock:
      if _last.get(ident) is entry:
        del _last[ident]


def wait_for_others(handles: frozenset[int]) -> None:
  """Before this thread dispatches a step using `handles`: waits for the
  steps other threads dispatched that use any of them. A failed one is
  logged, not raised: its error is its own thread's."""
  me = threading.get_ident()
  with _lock:
    others = [(i, e) for i, e in _last.items()
              if i != me and not handles.isdisjoint(e.handles)]
  for ident, entry in others:
    try:
      _wait(ident, entry)
    except Exception as e:  # pylint: disable=broad-except
      logger.warning("jcxl: a step dispatched from thread %r failed: %s",
                     entry.thread, e)


def barrier() -> None:
  """Waits for every step dispatched so far, from any thread, and for this
  thread's other side-effecting computations (``jax.effects_barrier``).
  The first failure is raised (once), after everything was waited for."""
  with _lock:
    pending = list(_last.items())
  error = None
  for ident, entry in pending:
    try:
      _wait(ident, entry)
    except Exception as e:  # pylint: disable=broad-except
      error = error or e
  try:
    jax_compat.effects_barrier()
  except Exception as e:  # pylint: disable=broad-except
    error = error or e
  if error is not None:
    raise error


def wait_before(why: str) -> None:
  """`barrier`, before `why` (freeing or closing what steps use): a failed
  step is logged, not raised (its results raise its error to whoever
  reads them)."""
  try:
    barrier()
  except Exception as e:  # pylint: disable=broad-except
    logger.warning("jcxl: a step dispatched before %s failed: %s", why, e)
