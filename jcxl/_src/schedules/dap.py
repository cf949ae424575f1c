"""The Scheduler of ``schedule='dap'`` (see schedules.scheduler): a `Tuner`
chooses the plans and learns from measured steps, and the plans it runs
next compile on a thread of their own (`CompileAhead`).

In a multi-process run whose step spans processes, each process's tuner
decides only from values every process agreed (see schedules.agreement): a
plan compiled ahead is used once every process has compiled it, and a
step's measurement, compile and wait are exchanged at the step's end
(where the tuner may measure it, or it waited for compiles; one exchange
through JAX's coordination service, about a millisecond or a few). Every
process then switches plans at the same step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jcxl._src.schedules import plan as schedule_lib
from jcxl._src.schedules import agreement as agreement_lib
from jcxl._src.schedules.compile_ahead import CompileAhead
from jcxl._src.schedules.profile import StepProfile
from jcxl._src.schedules.tuner import Tuner
from jcxl._src.schedules.costmodel import device_need


class DapScheduler:
  """A step's plans chosen, measured and re-chosen online.

  Attributes:
    agreement: the step's exchanges with its peer processes
      (``distributed.Agreement``), or None where the step runs in one
      process only.
  """

  def __init__(self, schedule: schedule_lib.DapSchedule, budget: int | None,
               compile_plan: Callable[[Any, schedule_lib.LayerSchedule],
                                      tuple[Any, int]]):
    self.tuner = Tuner(schedule.start, budget)
    self.ahead = CompileAhead(self.tuner, compile_plan)
    self.agreement = None
    # Under an agreement: plans compiled here, not yet by every process
    # (plan -> (signature, (entry, need, seconds) or the exception)); and
    # those every process has, for the next harvest.
    self._held: dict[schedule_lib.LayerSchedule, tuple[Any, Any]] = {}
    self._agreed: list[tuple[Any, schedule_lib.LayerSchedule, Any]] = []
    self._peers: list[Any] | None = None  # the last step's exchange
    # Call signatures by first call: the same numbers in every process
    # (its own signature holds its own handles), naming what a plan was
    # compiled for in an exchange.
    self._signatures: dict[Any, int] = {}
    self._steps = 0  # steps agreed: names the exchange in its errors

  @property
  def version(self) -> int:
    return self.tuner.version

  def resolve(self, segments, links) -> schedule_lib.LayerSchedule:
    if self.agreement is not None and not self.tuner.model.segments:
      # The first estimates are measured in each process: agreed first.
      values = self.agreement.exchange(
          agreement_lib.encode_estimates(segments, links),
          about="the cost model's first estimates")
      segments, links = agreement_lib.agreed_estimates(segments, links,
                                                       values)
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
    need = device_need(executable.memory_analysis())
    if self.agreement is not None:
      values = self.agreement.exchange([need, seconds],
                                       about="a compile on the step's path")
      need, seconds = max(v[0] for v in values), max(v[1] for v in values)
    self.tuner.add_compile(seconds)
    return self.tuner.calibrate(need)

  def harvest(self) -> list[tuple[Any, int, Any]]:
    done = []
    for signature, schedule, result in self.ahead.harvest():
      if self.agreement is not None:
        self._held[schedule] = (signature, result)
      elif isinstance(result, Exception):
        self.tuner.give_up([schedule], f"its compile failed: {result!r}")
      else:
        entry, need, seconds = result
        if self.tuner.compiled(schedule, need, seconds):
          done.append((signature, schedule, entry))
    done += self._agreed
    self._agreed = []
    return [(signature, self.tuner.version_of(schedule), entry)
            for signature, schedule, entry in done]

  def compiling(self, signature: Any, args: Any,
                is_compiled: Callable[[int], bool]) -> list[Any]:
    version_of = self.tuner.version_of
    self._signatures.setdefault(signature, len(self._signatures))
    if self.agreement is None:
      return self.ahead.missing(signature, args,
                                lambda s: is_compiled(version_of(s)))
    # Compiled here but not yet everywhere: not compiled again, not run.
    self.ahead.missing(signature, args, lambda s: is_compiled(version_of(
        s)) or (s in self._held and self._held[s][0] == signature))
    return [s for s in self.tuner.upcoming() if not is_compiled(version_of(s))]

  def wants_measurement(self, after_other: bool) -> bool:
    return self.tuner.wants_measurement(after_other)

  def step_done(self, profile: StepProfile | None,
                waited_for: Sequence[Any]) -> None:
    compiling_s = self.ahead.compiling_s() if waited_for else 0.0
    # Exchanged only where it can matter, which every process knows alike:
    # a step whose measurement the tuner may take, or one that waited for
    # plans to compile (until every process has them). A settled plan's
    # steps mostly go without.
    agree = self.agreement is not None and (
        bool(waited_for) or self.tuner.measurement_due)
    if agree:
      profile, compiling_s = self._agree_step(profile, compiling_s)
    if waited_for:
      self.tuner.waited(waited_for, compiling_s)
    else:
      self.tuner.step_done(profile)
    if agree:
      self._take_agreed_compiles()

  def _agree_step(self, profile: StepProfile | None, compiling_s: float
                  ) -> tuple[StepProfile | None, float]:
    """Exchanges this step's measurement and the plans compiled here;
    returns the agreed measurement and compile time in progress."""
    ready, failed = {}, {}
    for schedule, (signature, result) in self._held.items():
      if isinstance(result, Exception):
        failed[agreement_lib.plan_key(schedule)] = repr(result)
      else:
        ready[self._ready_key(schedule, signature)] = list(result[1:])
    values = self.agreement.exchange(
        {"profile": agreement_lib.encode_profile(profile),
         "compiling_s": compiling_s, "ready": ready, "failed": failed},
        about=f"the end of its step {self._steps}")
    self._steps += 1
    self._peers = values
    return (agreement_lib.agreed_profile([v["profile"] for v in values]),
            max(v["compiling_s"] for v in values))

  def _ready_key(self, schedule: schedule_lib.LayerSchedule,
                 signature: Any) -> str:
    """A plan compiled for a call signature, named alike in every
    process."""
    number = self._signatures.setdefault(signature, len(self._signatures))
    return f"{agreement_lib.plan_key(schedule)}/{number}"

  def _take_agreed_compiles(self) -> None:
    """Tells the tuner of the plans every process has compiled (or one
    failed to), in the order of their keys: each process's tuner takes the
    same compiles at the same step."""
    values, self._peers = self._peers, None
    held = {self._ready_key(s, signature): s
            for s, (signature, _) in self._held.items()}
    upcoming = {agreement_lib.plan_key(s): s for s in self.tuner.upcoming()}
    failed = {}
    for v in values:
      for key, why in v["failed"].items():
        failed.setdefault(key, why)
    for key in sorted(failed):
      for s in [s for s in self._held if agreement_lib.plan_key(s) == key]:
        del self._held[s]
      if key in upcoming:  # the same in every process
        self.tuner.give_up([upcoming[key]],
                           f"its compile failed: {failed[key]}")
    everywhere = set.intersection(*(set(v["ready"]) for v in values))
    for key in sorted(k for k in everywhere
                      if k.split("/")[0] not in failed):
      schedule = held[key]  # ready here too
      signature, (entry, _, _) = self._held.pop(schedule)
      need = max(v["ready"][key][0] for v in values)
      seconds = max(v["ready"][key][1] for v in values)
      if self.tuner.compiled(schedule, need, seconds):
        self._agreed.append((signature, schedule, entry))
