"""How an offloaded step gets its schedule: `Scheduler`, the one interface
between the step (tracing, compiling, running, measuring) and whatever
chooses the plans it runs.

A schedule fixed before the step runs ('fixed:k', 'sync', 'bucket',
'plan:PATH') is a `StaticScheduler`: one plan, nothing measured, nothing
compiled ahead. 'dap' is a ``schedules.dap.DapScheduler``: a tuner that
measures steps and moves the plan, with the plans to come compiled off the
step's path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from jcxl._src.schedules import plan as schedule_lib
from jcxl._src.schedules import costmodel
from jcxl._src.schedules.profile import StepProfile
from jcxl._src.schedules.dap import DapScheduler
from jcxl._src.schedules.tuner import Tuner


class Scheduler(Protocol):
  """What an offloaded step asks of its schedule, call by call.

  Attributes:
    tuner: the DAP tuner (``step.tuner``); None for a fixed schedule.
    version: the current plan's part of the compile-cache key.
    agreement: set by the step where its arrays span processes
      (``distributed.Agreement``): every choice that changes the compiled
      step is then made from values all processes exchanged.
  """
  tuner: Tuner | None
  version: int
  agreement: Any

  def resolve(self, segments: Sequence[costmodel.Segment],
              links: Mapping[str, costmodel.Link]
              ) -> schedule_lib.LayerSchedule:
    """The plan to compile with (called while the step is traced)."""

  def report(self, plan: schedule_lib.Plan) -> schedule_lib.Plan:
    """`plan` (the record of a compiled plan) as ``step.plan`` shows it
    now: its predicted step and reasons, as the scheduler knows them."""

  def compiled(self, executable: Any, seconds: float) -> bool:
    """Takes a compile on the step's path; True: the plan moved (it was
    over the budget), compile again."""

  def harvest(self) -> list[tuple[Any, int, Any]]:
    """Plans compiled off the step's path since the last call, as
    (call signature, version, what `compile_plan` returned)."""

  def compiling(self, signature: Any, args: Any,
                is_compiled: Callable[[int], bool]) -> list[Any]:
    """The next plans for `signature` not compiled yet (`is_compiled` by
    version), now compiling off the step's path: the step runs the plan
    that ran last meanwhile. Empty: run the current plan."""

  def wants_measurement(self, after_other: bool) -> bool:
    """Whether this step is to be measured (asked once a step);
    `after_other`: another offloaded step ran since this one's last."""

  def step_done(self, profile: StepProfile | None,
                waited_for: Sequence[Any]) -> None:
    """A step ran: measured (`profile`), or not (None); `waited_for`: it
    ran the plan before while these compiled."""


class StaticScheduler:
  """The Scheduler of a schedule chosen before the step runs."""
  tuner = None
  version = 0  # one plan per call signature
  agreement = None  # one plan: nothing to agree but the settings

  def __init__(self, schedule: schedule_lib.Schedule):
    self._schedule = schedule

  def resolve(self, segments, links) -> schedule_lib.LayerSchedule:
    return self._schedule.resolve(segments, links)

  def report(self, plan: schedule_lib.Plan) -> schedule_lib.Plan:
    return plan

  def compiled(self, executable, seconds) -> bool:
    del executable, seconds
    return False

  def harvest(self) -> list[tuple[Any, int, Any]]:
    return []

  def compiling(self, signature, args, is_compiled) -> list[Any]:
    del signature, args, is_compiled
    return []

  def wants_measurement(self, after_other: bool) -> bool:
    del after_other
    return False

  def step_done(self, profile, waited_for) -> None:
    del profile, waited_for


def for_schedule(schedule: schedule_lib.Schedule, budget: int | None,
                 compile_plan: Callable[[Any, schedule_lib.LayerSchedule],
                                        tuple[Any, int]]) -> Scheduler:
  """The scheduler of a parsed `schedule`; `compile_plan(args, plan)`
  compiles the step with a plan off its path (see schedules.compile_ahead)."""
  if isinstance(schedule, schedule_lib.DapSchedule):
    return DapScheduler(schedule, budget, compile_plan)
  return StaticScheduler(schedule)
