"""Compiles the plans a DAP tuner runs next, off the step's path.

A plan to race or a re-plan is compiled on a thread of its own while the
step keeps running the plan that ran last (XLA's compile releases the
GIL; a model's step compiled for about 8 s, 190 steps of its 42 ms). The
scheduler hands each compiled plan's device need and compile time (or its
failure) to the tuner from `harvest`, on the caller's thread: the tuner
never sees the compiling thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

from jcxl._src.schedules.plan import LayerSchedule
from jcxl._src.schedules.tuner import Tuner

logger = logging.getLogger(__name__)


class CompileAhead:
  """The compiling thread of one DAP step.

  `compile_plan(args, schedule)` compiles the step for `args` with
  `schedule` and returns what a call runs and its device need in bytes;
  it must touch no tuner state (it runs on the compiling thread).
  """

  def __init__(self, tuner: Tuner,
               compile_plan: Callable[[Any, LayerSchedule], tuple[Any, int]]):
    self._tuner = tuner
    self._compile_plan = compile_plan
    self._executor: concurrent.futures.ThreadPoolExecutor | None = None
    # Per plan submitted: the call signature it is for, its future, and
    # when it started compiling (None while queued).
    self._jobs: dict[LayerSchedule, list[Any]] = {}

  def missing(self, signature: Any, args: Any,
              is_compiled: Callable[[LayerSchedule], bool]
              ) -> list[LayerSchedule]:
    """The tuner's next plans not compiled for `signature` yet; those not
    submitted yet are submitted (with `args`), in the order it runs them.
    Plans the tuner dropped that have not begun compiling are cancelled."""
    upcoming = self._tuner.upcoming()
    for schedule, job in list(self._jobs.items()):
      if schedule not in upcoming and job[1].cancel():  # dropped: not begun
        del self._jobs[schedule]
    wanted = [s for s in upcoming if not is_compiled(s)]
    for schedule in wanted:
      if schedule not in self._jobs or self._jobs[schedule][0] != signature:
        if self._executor is None:
          self._executor = concurrent.futures.ThreadPoolExecutor(
              max_workers=1, thread_name_prefix="jcxl-dap-compile")
        job = [signature, None, None]
        job[1] = self._executor.submit(self._timed, job, args, schedule)
        self._jobs[schedule] = job
    return wanted

  def compiling_s(self) -> float:
    """How long the compile in progress has run (0: none)."""
    started = [j[2] for j in self._jobs.values()
               if j[2] is not None and not j[1].done()]
    return time.perf_counter() - min(started) if started else 0.0

  def harvest(self) -> list[tuple[Any, LayerSchedule, Any]]:
    """The plans whose compile ended since the last call, in the order
    they were submitted: (signature, plan, (what a call runs, device need
    in bytes, compile seconds)), or for a compile that failed (signature,
    plan, its exception), logged as a warning."""
    done = []
    for schedule, (signature, future, started) in list(self._jobs.items()):
      if not future.done():
        continue
      del self._jobs[schedule]
      try:
        done.append((signature, schedule, future.result()))
      except Exception as e:  # pylint: disable=broad-except
        logger.warning("dap: compiling a plan to try failed; it is not "
                       "tried: %r", e)
        done.append((signature, schedule, e))
    return done

  def _timed(self, job: list[Any], args: Any, schedule: LayerSchedule
             ) -> tuple[Any, int, float]:
    job[2] = time.perf_counter()
    entry, need = self._compile_plan(args, schedule)
    return entry, need, time.perf_counter() - job[2]
