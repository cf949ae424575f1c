"""The Scheduler of ``schedule='dap'`` (see offload.scheduler): a `Tuner`
chooses the plans and learns from measured steps, and the plans it runs
next compile on a thread of their own (`CompileAhead`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jcxl._src import schedule as schedule_lib
from jcxl._src.dap.compile_ahead import CompileAhead
from jcxl._src.dap.profile import StepProfile
from jcxl._src.dap.tuner import Tuner
from jcxl._src.offload.compiled import device_need


class DapScheduler:
  """A step's plans chosen, measured and re-chosen online."""

  def __init__(self, schedule: schedule_lib.DapSchedule, budget: int | None,
               compile_plan: Callable[[Any, schedule_lib.LayerSchedule],
                                      tuple[Any, int]]):
    self.tuner = Tuner(schedule.start, budget)
    self.ahead = CompileAhead(self.tuner, compile_plan)

  @property
  def version(self) -> int:
    return self.tuner.version

  def resolve(self, segments, links) -> schedule_lib.LayerSchedule:
    return self.tuner.resolve(segments, links)

  def report(self, plan: schedule_lib.Plan) -> schedule_lib.Plan:
    # The tuner's prediction and reasons as they stand now (a race or a
    # baseline learns after the plan compiled), where `plan` is the one it
    # runs; else it has moved on to a plan not compiled yet.
    tuner = self.tuner
    if tuner.prediction is None or any(
        (l.prefetch, l.chunk_bytes) != (tuner.schedule.prefetch_for(l.name),
                                       tuner.schedule.chunk_for(l.name))
        for l in plan.layers):
      return plan
    return dataclasses.replace(plan, predicted_step_s=tuner.prediction.step_s,
                               reasons=tuner.reasons)

  def compiled(self, executable: Any, seconds: float) -> bool:
    # The tuner learns the step's memory without prefetch from its
    # compiles; a plan over the budget is re-planned within it, with less
    # prefetch each time (so this ends), or leaves a race for a plan
    # compiled already.
    self.tuner.add_compile(seconds)
    return self.tuner.calibrate(device_need(executable.memory_analysis()))

  def harvest(self) -> list[tuple[Any, int, Any]]:
    return [(signature, self.tuner.version_of(schedule), entry)
            for signature, schedule, entry in self.ahead.harvest()]

  def compiling(self, signature: Any, args: Any,
                is_compiled: Callable[[int], bool]) -> list[Any]:
    return self.ahead.missing(
        signature, args, lambda s: is_compiled(self.tuner.version_of(s)))

  def wants_measurement(self, after_other: bool) -> bool:
    return self.tuner.wants_measurement(after_other)

  def step_done(self, profile: StepProfile | None,
                waited_for: Sequence[Any]) -> None:
    if waited_for:
      self.tuner.waited(waited_for, self.ahead.compiling_s())
    else:
      self.tuner.step_done(profile)
