"""The offloaded steps dispatched and maybe still running, from every thread.

JAX keeps the tokens of side-effecting computations per thread:
``jax.effects_barrier()`` waits only for what the calling thread
dispatched. A pool's objects are the process's, though: a training loop
run in a worker thread, then ``jcxl.gather`` (or a checkpoint, a delete,
a close, the exit) in the main thread, must see every store that loop
dispatched, and a step dispatched from one thread must not read an object
that a step of another thread is still writing.

So every offloaded step notes its call here, by its results (all ready
once it is over, failed or not) and the pool objects it uses. `barrier`
waits for all of them, `wait_for_others` for other threads' that share an
object with a step about to be dispatched, `wait_for_steps` (at exit, or
when a pool is collected) for all of them within a bound.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import jax

from jcxl._src import jax_compat

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class _Step:
  arrays: list[Any]  # the call's outputs
  handles: frozenset[int]  # the pool objects it fetches or stores
  thread: int
  thread_name: str


_lock = threading.Lock()
_steps: list[_Step] = []  # noted and maybe still running


def _arrays(results: Any) -> list[Any]:
  return [x for x in jax.tree_util.tree_leaves(results)
          if isinstance(x, jax.Array)]


def running(results: Any) -> bool:
  """Whether the call that made `results` still runs (a failed one is
  over: its arrays are ready, holding its error)."""
  for x in _arrays(results):
    try:
      # Deleted (donated to a later step, which is noted itself): asked
      # is_ready(), jax 0.10 crashes.
      if not x.is_deleted() and not x.is_ready():
        return True
    except Exception:  # pylint: disable=broad-except
      pass  # not a live array any more: nothing of it runs
  return False


def note(results: Any, handles: frozenset[int]) -> None:
  """Notes that this thread dispatched a step using `handles`, whose
  outputs are `results`."""
  arrays = _arrays(results)
  current = threading.current_thread()
  with _lock:
    _steps[:] = [s for s in _steps if running(s.arrays)]
    if arrays:
      _steps.append(_Step(arrays, handles, current.ident, current.name))


def wait_for_results(results: Any, timeout_s: float) -> bool:
  """Waits until the call that made `results` is over, at most
  `timeout_s`; whether it is."""
  arrays = _arrays(results)
  deadline = time.monotonic() + timeout_s
  pause = 1e-3
  while running(arrays):
    if time.monotonic() >= deadline:
      return False
    time.sleep(pause)
    pause = min(pause * 2, 0.05)
  return True


def _finish(step: _Step) -> Exception | None:
  """Waits for `step` and forgets it; its error, if it failed."""
  error = None
  for x in step.arrays:
    try:
      x.block_until_ready()
    except Exception as e:  # pylint: disable=broad-except
      if not x.is_deleted():  # a deleted output says nothing of the step
        error = error or e
  with _lock:
    if step in _steps:
      _steps.remove(step)
  return error


def _pending(keep) -> list[_Step]:
  with _lock:
    return [s for s in _steps if keep(s)]


def wait_for_others(handles: frozenset[int]) -> None:
  """Before this thread dispatches a step using `handles`: waits for the
  steps other threads dispatched that use any of them. A failed one is
  logged, not raised: its error is its own thread's."""
  me = threading.get_ident()
  for step in _pending(lambda s: s.thread != me and
                       not handles.isdisjoint(s.handles)):
    error = _finish(step)
    if error is not None:
      logger.warning("jcxl: a step dispatched from thread %r failed: %s",
                     step.thread_name, error)


def barrier() -> None:
  """Waits for every step dispatched so far, from any thread, and for this
  thread's other side-effecting computations (``jax.effects_barrier``).
  The first failure is raised (once), after everything was waited for."""
  errors = [_finish(step) for step in _pending(lambda s: True)]
  try:
    jax_compat.effects_barrier()
  except Exception as e:  # pylint: disable=broad-except
    errors.append(e)
  error = next((e for e in errors if e is not None), None)
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


def wait_for_steps(timeout_s: float, why: str) -> None:
  """Waits, at most `timeout_s`, until no step dispatched by any thread is
  running, before `why` (closing a pool they may use at exit); logs a
  warning naming how many still run if the bound is hit."""
  steps = _pending(lambda s: running(s.arrays))
  if not steps:
    return
  if not wait_for_results([x for s in steps for x in s.arrays], timeout_s):
    still = sum(running(s.arrays) for s in steps)
    logger.warning(
        "jcxl: %d step(s) still running after %g s when %s; their "
        "transfers fail and their results are incomplete", still,
        timeout_s, why)
