"""Dynamic Adaptive Pipelining: the online tuner behind ``schedule='dap'``.

It starts from the cost model's plan (layer bytes, the tiers' links, compute
estimated from the step's equations) within the device budget, then measures
a few steps, re-plans from what it measured (each segment's compute, each
tier's achieved bandwidth) and recompiles only when the plan changes, a
bounded number of times. When the model's plan holds, it races it against a
few uniform prefetch distances within the budget (compiled once each, run in
turn, a few steps back to back each per round, the last one timed; those not
surely slower than the fastest for more rounds) and keeps whichever ran
fastest: the model does not see everything (copies competing with compute
for the host's cores, say), the device does; the model then learns from the
kept plan's steps. Once settled, it measures one step every so often (less
often while nothing changes); when a link slows from what the plan was made
for, and the step with it (another job shares the link, say), and a few more
measured steps, spaced out, confirm it, it re-plans, and races again if the
plan changed. When only the step slows (the host got busier), every plan
slows alike: it keeps the plan and measures a new baseline.

What tuning costs is bounded by construction. Plans to come compile on a
thread of their own (``compile_ahead``) while the plan that ran last keeps
training at its own pace; those steps are "waited" steps. A tuning
episode (from the first step, or from a check that looked off) runs at
most `max_tuning_steps` steps that tune (warm up, measure, race, take a
baseline): at the limit the fastest plan measured so far is kept. It
compiles for at most `max_compile_s` seconds: then the plans not compiled
yet are dropped, and it goes on with those that are. Each episode's cost
(steps, waited steps, compiles, compile seconds) is in ``Tuner.costs``.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import statistics
from collections.abc import Mapping, Sequence

from jcxl._src.schedules import costmodel
from jcxl._src.schedules.drift import Checks
from jcxl._src.schedules.drift import Drift
from jcxl._src.schedules.drift import median_bandwidths
from jcxl._src.schedules.model import StepModel
from jcxl._src.schedules.options import TunerOptions
from jcxl._src.schedules.profile import StepProfile
from jcxl._src.schedules.race import Race
from jcxl._src.schedules.race import Turn
from jcxl._src.schedules.race import describe
from jcxl._src.schedules.plan import LayerSchedule
from jcxl._src.units import format_bytes

logger = logging.getLogger(__name__)

# Starts the reason a re-plan gives for keeping the plan it has.
_KEPT = "re-planned on what was measured:"
# Steps in a row a measurement waits for one that follows this step's own
# (see `wants_measurement`): where every step follows another program's,
# that is how the plan runs, and it is measured so.
_MAX_DEFERRED = 2


class Phase(enum.Enum):
  """Where the tuner is; each phase says which steps are measured and
  what a measurement does (see Tuner._wanted, Tuner._advance)."""
  WARMUP = "warmup"      # steps before the first measurement
  MEASURE = "measure"    # the plan measured for a re-plan
  RACE = "race"          # candidates run in turn (see race.py)
  BASELINE = "baseline"  # the kept plan measured alone: drift's baseline
  STEADY = "steady"      # settled: a check every so often
  CONFIRM = "confirm"    # a check looked off: a few more, spaced out


@dataclasses.dataclass(frozen=True)
class TuningCost:
  """What one tuning episode cost, until the tuner settled.

  Attributes:
    steps: steps from the episode's start until settled (waited included).
    waited_steps: of those, steps that ran the plan that ran before while
      the next plans compiled on the compiling thread.
    compiles: plans compiled in the episode (the first call's included).
    compile_s: seconds spent compiling them (off the step's path but for
      the first call's).
    limited: why it settled early ("tuning steps", "compile"), or "".
  """
  steps: int
  waited_steps: int
  compiles: int
  compile_s: float
  limited: str = ""


@dataclasses.dataclass(frozen=True)
class TunerEvent:
  """One thing the tuner did, for its history.

  Example:
    >>> for event in step.tuner.history:  # schedule="dap"
    ...   print(event.step, event.what, event.detail)
  """
  step: int
  # plan, replan, holds, race, raced, settled, drift (a link slowed: it
  # re-plans, and races if the plan changed), slower (only the step
  # slowed: a new baseline), frozen, budget
  what: str
  predicted_s: float | None
  measured_s: float | None
  detail: str = ""


class Tuner:
  """Chooses and re-chooses a ``LayerSchedule`` for one step function.

  A step made with ``schedule="dap"`` has one (``step.tuner``).

  Example:
    >>> step = jcxl.cxl_offload(train_step, schedule="dap")
    >>> state, loss = step(state, batch)
    >>> step.tuner.schedule, step.tuner.replans, step.tuner.history[-1]
  """

  def __init__(self, start: LayerSchedule | None, budget: int | None,
               options: TunerOptions = TunerOptions()):
    self.options = options
    self.budget = budget
    self.schedule = start
    self.version = 0  # the compiled step's cache key: one per plan tried
    self.replans = 0
    self.history: list[TunerEvent] = []
    self.prediction: costmodel.Prediction | None = None
    self.reasons: tuple[str, ...] = ()
    self._base_bytes: int | None = None  # device need with no prefetch
    self._base_floor = 0  # raised by each plan found over the budget
    self.model = StepModel()  # what it learned of the step
    self._window: list[StepProfile] = []
    self._phase = Phase.WARMUP
    self._steps = 0
    self._checks = Checks(options)  # the settled plan's
    # Steps in a row not measured because they followed another program's.
    self._deferred = 0
    self._ran_version: int | None = None  # the plan the last step ran
    # Per plan tried: its compile-cache version and the step time measured
    # with it, so that a plan the cost model liked but the device did not
    # is dropped for the best one measured (without a recompile).
    self._versions: dict[LayerSchedule, int] = {}
    self._measured: dict[LayerSchedule, float] = {}
    self._race: Race | None = None  # the race in progress
    self._ran_schedule: LayerSchedule | None = None
    # The tuning episode in progress (see TuningCost), and those settled.
    self._cost = TuningCost(0, 0, 0, 0.0)
    self.costs: list[TuningCost] = []
    # Compile seconds before the first step: the step cannot run without
    # them, a fixed schedule's step neither; not held against the limit.
    self._first_compile_s = 0.0

  # ------------------------------------------------------------ planning

  @property
  def prefetch_budget(self) -> int | None:
    """The device bytes prefetching may use (the budget less the step's own
    need), or None."""
    if self.budget is None or self._base_bytes is None:
      return None
    return max(0, self.budget - self._base_bytes)

  @property
  def converged(self) -> bool:
    """Whether the tuner has settled on a plan (its steady phase)."""
    return self._phase is Phase.STEADY

  @property
  def tuning_steps(self) -> int:
    """Steps the episode in progress (or the last one) ran to tune, not
    counting those that waited for compiles: at most `max_tuning_steps`."""
    return self._cost.steps - self._cost.waited_steps

  def resolve(self, segments: Sequence[costmodel.Segment],
              links: Mapping[str, costmodel.Link]) -> LayerSchedule:
    """The schedule to compile with (called while the step is traced)."""
    self.model.estimate(segments, links)
    if self.schedule is None:
      self._replan("plan", measured_s=None)
    elif self.prediction is None:  # a saved plan to start from
      self.prediction = self.predict(dict(self.schedule.prefetch))
      self.version = self._versions.setdefault(self.schedule,
                                               len(self._versions))
    return self.schedule

  def _replan(self, what: str, measured_s: float | None,
              over_budget: bool = False) -> bool:
    start = dict(self.schedule.prefetch) if self.schedule else None
    choice = self.model.choose(self.prefetch_budget, start)
    schedule = LayerSchedule.of(choice.prefetch, choice.chunk_bytes,
                                name="dap")
    if self.schedule is not None and not over_budget:
      # A new plan must promise enough to pay for its recompile: measured
      # noise alone would otherwise move the plan back and forth.
      current = self.predict(dict(self.schedule.prefetch))
      if choice.prediction.step_s > current.step_s * (
          1 - self.options.min_gain):
        # The reasons stay the kept plan's, with why the other was not
        # taken (its own reasons explain a plan that does not run).
        kept = (f"{_KEPT} the model plans this one again "
                f"({current.step_s * 1e3:.2f} ms)" if schedule == self.schedule
                else f"{_KEPT} the model's best plan now "
                f"({choice.prediction.step_s * 1e3:.2f} ms) saves less than "
                f"{self.options.min_gain:.0%} of this one's "
                f"{current.step_s * 1e3:.2f} ms; kept")
        schedule, choice = self.schedule, dataclasses.replace(
            choice, prediction=current, reasons=tuple(
                r for r in self.reasons if not r.startswith(_KEPT)) + (kept,))
    changed = schedule != self.schedule
    if changed and self.schedule is not None:
      # Re-plans into the budget are not limited (each has less prefetch
      # than the last, see calibrate); the others are.
      if self.replans >= self.options.max_replans and not over_budget:
        self._event("frozen", measured_s, "re-plan limit reached "
                    f"({self.options.max_replans}); keeping the plan")
        return False
      self.replans += 1
    self.version = self._versions.setdefault(schedule, len(self._versions))
    self.schedule = schedule
    self.prediction = choice.prediction
    self.reasons = choice.reasons
    self.model.planned()
    self._event(what if changed else "holds", measured_s,
                "; ".join(choice.reasons))
    return changed

  def calibrate(self, need_bytes: int,
                schedule: LayerSchedule | None = None) -> bool:
    """Learns the device need without prefetch from a compiled plan's
    need (`schedule`, the current plan by default); re-plans (True) if the
    current plan is over the budget.

    The device's need does not grow byte for byte with the prefetched
    bytes (XLA reuses buffers around its peak), so a plan over the budget
    leaves later plans at most half its prefetch, less the overage: the
    re-plans that follow end within log2 of its prefetched bytes.
    """
    schedule = schedule or self.schedule
    peak = costmodel.peak_prefetch_bytes(self.model.segments,
                                         dict(schedule.prefetch))
    over = self.budget is not None and need_bytes > self.budget
    if over:
      allowed = min(self.budget - need_bytes + peak, peak // 2)
      self._base_floor = max(self._base_floor, self.budget - allowed)
    self._base_bytes = max(need_bytes - peak, self._base_floor)
    if not over:
      return False
    before = self.schedule
    race = self._race
    if race is not None and schedule in race.times:  # it leaves the race
      race.drop(schedule)
      self._event("budget", None, f"{describe(schedule, race.base)} "
                  f"needs {need_bytes} B of device memory, over the budget: "
                  "out of the race")
      if schedule == before:
        self._switch(race.base)
      return self.schedule != before
    if schedule != before:  # a plan the tuner has left already
      return False
    self._replan("budget", measured_s=None, over_budget=True)
    return self.schedule != before

  # ----------------------------------------------------------- compiling

  def version_of(self, schedule: LayerSchedule) -> int:
    """The compile-cache version of `schedule` (one per plan tried)."""
    return self._versions.setdefault(schedule, len(self._versions))

  def upcoming(self) -> list[LayerSchedule]:
    """The plans the next steps run: every candidate of a race (it starts
    once all are compiled), else the current plan."""
    if self._phase is Phase.RACE:
      return list(dict.fromkeys([self.schedule, *self._race.times]))
    return [self.schedule]

  def compiled(self, schedule: LayerSchedule, need_bytes: int,
               seconds: float) -> bool:
    """Takes a plan compiled on the compiling thread: its device need and
    compile time. Returns whether it is within the budget (usable)."""
    self.add_compile(seconds)
    self.calibrate(need_bytes, schedule)
    return self.budget is None or need_bytes <= self.budget

  def add_compile(self, seconds: float) -> None:
    """Counts a compile of `seconds` into the episode's cost."""
    if not self._steps:
      self._first_compile_s += seconds
    self._cost = dataclasses.replace(
        self._cost, compiles=self._cost.compiles + 1,
        compile_s=self._cost.compile_s + seconds)

  def waited(self, missing: Sequence[LayerSchedule],
             compiling_s: float = 0.0) -> None:
    """A step ran the plan that ran last while `missing` compile (the one
    compiling now for `compiling_s`). Past `max_compile_s` of compiling in
    this episode, the plans not compiled are dropped."""
    self._steps += 1
    self._cost = dataclasses.replace(
        self._cost, steps=self._cost.steps + 1,
        waited_steps=self._cost.waited_steps + 1)
    spent = self._cost.compile_s + compiling_s - (
        0.0 if self.costs else self._first_compile_s)
    if spent >= self.options.max_compile_s:
      self.give_up(missing, f"{spent:.1f} s compiling, the limit is "
                   f"{self.options.max_compile_s:g} s")

  def give_up(self, missing: Sequence[LayerSchedule], why: str) -> None:
    """Drops plans to come that could not be compiled (in time): a race
    goes on with those that are; a re-plan keeps the fastest plan measured."""
    missing = set(missing) & set(self.upcoming())
    if not missing:
      return
    self._cost = dataclasses.replace(self._cost, limited="compile")
    self._event("compile limit", None, f"{why}: {len(missing)} plan(s) not "
                "compiled yet dropped")
    if self._phase is not Phase.RACE:
      # A re-plan waiting for its compile: keep the fastest plan this
      # episode measured (the one that ran, where none was), not merely
      # the last to run.
      ran = self._ran_schedule or self.schedule
      measured = {c: t for c, t in self._measured.items()
                  if c not in missing}
      self._settle(min(measured, key=measured.get) if measured else ran)
      return
    race = self._race
    for c in missing:
      race.drop(c)
    if len(race.times) <= 1:
      self._settle(next(iter(race.times), race.base))
      return
    race.restart()
    self._switch(race.next_turn())

  # ----------------------------------------------------------- measuring

  def wants_measurement(self, after_other: bool = False) -> bool:
    """Whether the next step should be measured (asked once a step).

    `after_other`: the host ran another offloaded program's step since
    this step's last one. Such a step, and the first of a plan after
    another plan's, runs slower than one right after its own (caches,
    buffers and threads warm for the other program: by up to 40% measured
    on XLA:CPU), and a plan runs back to back in a training loop: the
    measurement waits for the next step, up to `_MAX_DEFERRED` steps.
    Checks of a settled plan taken on such steps saw drifts that were not
    there wherever two programs alternate (a benchmark's rounds, a
    train/eval loop). A race's turns have their own warm-up step.
    """
    wanted = self._wanted()
    switched = self._ran_version not in (None, self.version)
    if (wanted and (after_other or switched) and self._phase is not Phase.RACE
        and self._deferred < _MAX_DEFERRED):
      self._deferred += 1
      return False
    return wanted

  @property
  def measurement_due(self) -> bool:
    """Whether the tuner's state asks for the next step to be measured,
    before `wants_measurement` defers it for a step that follows another
    program's: a function of what the tuner decided alone (its peers in
    a multi-process run agree it, see schedules.dap)."""
    return self._wanted()

  def _wanted(self) -> bool:
    if self._phase is Phase.WARMUP:
      return self._steps >= self.options.warmup_steps
    if self._phase is Phase.STEADY:
      return self._checks.due(self._checks.every)
    if self._phase is Phase.RACE:  # the last step of a measured turn
      return self._race.measures_next
    if self._phase is Phase.CONFIRM:
      return self._checks.due(self.options.confirm_every)
    return True

  def step_done(self, profile: StepProfile | None) -> bool:
    """Takes the next step's measurement (None: not measured).

    Returns whether the next step runs another plan (compiled already or
    to be compiled).
    """
    before, was_steady = self.schedule, self._phase is Phase.STEADY
    self._steps += 1
    self._ran_version, self._ran_schedule = self.version, self.schedule
    switches = self._advance(profile)
    if was_steady:
      if self._phase is not Phase.STEADY:  # a check looked off: a new episode
        self._cost = TuningCost(0, 0, 0, 0.0)
      return switches
    self._cost = dataclasses.replace(self._cost, steps=self._cost.steps + 1)
    if (self._phase is not Phase.STEADY and
        self.tuning_steps >= self.options.max_tuning_steps):
      self._keep_best()
    if self._phase is Phase.STEADY:
      self.costs.append(self._cost)
    return switches or self.schedule != before

  def _keep_best(self) -> None:
    """Settles on the fastest plan measured so far in this episode (the
    plan that ran, where none was): the tuning step limit."""
    measured = dict(self._measured)
    if self._race is not None:
      measured.update(self._race.finish())
    best = (min(measured, key=measured.get) if measured
            else self._ran_schedule)
    self._race = None
    if best in measured:  # the prediction is what it was measured at
      self.model.learn_overhead(best, measured[best],
                                dict(self.schedule.chunk_bytes))
    self._switch(best)
    self._phase, self._window = Phase.STEADY, []
    self._checks.reset(self.options,
                       [measured[best]] if best in measured else [])
    self._cost = dataclasses.replace(self._cost, limited="tuning steps")
    self._event("settled", measured.get(best), "tuning step limit "
                f"({self.options.max_tuning_steps}) reached: keeping the "
                "fastest plan measured so far" + (
                    f", {_ms(measured[best])} a step" if best in measured
                    else " (none measured: the plan that ran)"))

  def _advance(self, profile: StepProfile | None) -> bool:
    """The state machine's step (see step_done)."""
    if self._phase is Phase.RACE:
      return self._race_step(profile)
    if profile is None:
      self._checks.since += 1
      return False
    self._checks.measured()
    self._deferred = 0
    if self._phase is Phase.STEADY:
      if self._drifted([profile]) is None:
        self._checks.passed(profile.step_s, self.options)
        # The prediction follows the plan's recent steps, not only the
        # three its baseline measured (the host's pace moves).
        self.model.learn_overhead(self.schedule, self._checks.baseline_s)
        self.prediction = self.predict(dict(self.schedule.prefetch))
        return False
      # One slow step is often just the machine: measure a few more,
      # spaced out, before believing it (no re-plan, no recompile on
      # noise).
      self._phase, self._window = Phase.CONFIRM, [profile]
      return False
    self._window.append(profile)
    if len(self._window) < self.options.measure_steps:
      return False
    measured = statistics.median(p.step_s for p in self._window)
    if self._phase is Phase.BASELINE:
      # What drift is judged against, and what the model learns last: the
      # kept plan run on its own, as it will run from now on (a race's
      # steps ran beside other plans').
      self._checks.recent = [p.step_s for p in self._window]
      self.model.learn(self._window, self.schedule, measured)
      self.prediction = self.predict(dict(self.schedule.prefetch))
      self.model.ran_at(median_bandwidths(self._window))
      self._phase, self._window = Phase.STEADY, []
      self._event("settled", measured, "baseline for drift: "
                  f"{measured * 1e3:.2f} ms a step")
      return False
    if self._phase is Phase.CONFIRM:
      drift = self._drifted(self._window)
      if drift is None:
        self._phase, self._window = Phase.STEADY, []
        return False
      seen = (f"measured {measured * 1e3:.2f} ms against "
              f"{_ms(self._checks.baseline_s)} (the settled plan's median over "
              "its recent checks); links " + ", ".join(
                  f"{t} {b / 1e9:.2f} GB/s" for t, b in
                  median_bandwidths(self._window).items()))
      if drift is Drift.STEP:
        # The links run as the plan was made for: the host slowed (another
        # job on its cores, say). That slows every plan alike; a race
        # would cost steps and find the same plan.
        self._event("slower", measured, seen + " as planned: keeping the "
                    "plan, measuring a new baseline")
        self._settle(self.schedule)
        return False
      self._event("drift", measured, seen)
      self._measured.clear()  # times under the old conditions
    after_drift = self._phase is Phase.CONFIRM
    self._measured[self.schedule] = measured
    changed = self._learn_and_replan(measured)
    self._window = []
    self._phase = Phase.MEASURE
    if changed:
      return True
    if after_drift:
      # The model, on the links as measured now, keeps the plan the last
      # race settled on: no race (its candidates ran before).
      self._settle(self.schedule)
      return False
    return self._start_race(measured)

  # -------------------------------------------------------------- racing
  # (see race.py)

  def _start_race(self, measured_s: float) -> bool:
    base = self.schedule
    candidates = [base]
    if self._measured:  # a plan the model left may have run faster
      fastest = min(self._measured, key=self._measured.get)
      if fastest != base:
        candidates.append(fastest)
    budget = self.prefetch_budget
    for k in self.options.explore:
      candidate = LayerSchedule.of(
          {name: k for name, _ in base.prefetch}, dict(base.chunk_bytes),
          name="dap")
      if candidate in candidates or (
          budget is not None and costmodel.peak_prefetch_bytes(
              self.model.segments, dict(candidate.prefetch)) > budget):
        continue
      if candidate not in self._versions:
        if self.replans >= self.options.max_replans:
          continue
        self.replans += 1
      candidates.append(candidate)
    if len(candidates) == 1:
      self._settle(base)
      return False
    self._race = Race(candidates, base, self.options)
    block = max(1, self.options.race_block)
    self._event("race", measured_s, "measuring in turn"
                + (f" ({block} steps each back to back, the last timed)"
                   if block > 1 else "") + ": " + ", ".join(
        describe(c, base) for c in candidates))
    self._phase = Phase.RACE
    self._switch(self._race.next_turn())
    return True

  def _race_step(self, profile: StepProfile | None) -> bool:
    turn = self._race.step(self.schedule, profile)
    if turn is Turn.OVER:
      return self._end_race()
    if turn is Turn.GOES_ON:
      return False
    before = self.schedule
    self._switch(self._race.next_turn())
    return self.schedule != before

  def _end_race(self) -> bool:
    race = self._race
    medians = race.finish()
    self._measured.update(medians)
    best = min(medians, key=medians.get)
    verdict = ("raced (median step; its compute, stall and bytes copied "
               "while computing): " + ", ".join(
        f"{describe(c, race.base)} {t * 1e3:.2f} ms "
        f"({_split(race.times[c])})" for c, t in medians.items())
               + f"; keeping {describe(best, race.base)}")
    self._event("raced", medians[best], verdict)
    # choose_schedule's reasons explain the model's plan: only where it is
    # kept do they explain the plan that runs.
    self.reasons = (tuple(r for r in self.reasons if not r.startswith("raced"))
                    if best == race.base else ()) + (verdict,)
    # The race's steps (interleaved, compiled steps warmed up) say more
    # than the window measured right after a recompile, and the kept
    # plan's own steps say how it computes: where the device shares the
    # host's cores with the copies (XLA:CPU), compute runs slower under a
    # plan that overlaps more transfers with it.
    self.model.learn(race.times[best], best, medians[best],
                     dict(self.schedule.chunk_bytes))
    before = self.schedule
    self._settle(best)
    return self.schedule != before

  def _settle(self, schedule: LayerSchedule) -> None:
    """Keeps `schedule`; its next steps are measured for a baseline."""
    self._race = None
    self._switch(schedule)
    self._window = []
    self._phase = Phase.BASELINE
    self._checks.reset(self.options)

  def _switch(self, schedule: LayerSchedule) -> None:
    self.schedule = schedule
    self.version = self._versions.setdefault(schedule, len(self._versions))
    self.prediction = self.predict(dict(schedule.prefetch))

  def _drifted(self, profiles: Sequence[StepProfile]) -> Drift | None:
    """Whether a link slowed from what the plan was made for and the step
    with it, or only the step slowed from its baseline, or neither (None);
    medians over `profiles`."""
    base = self._checks.baseline_s
    step_s = statistics.median(p.step_s for p in profiles)
    slowed = self.model.link_slowed(
        self.schedule, median_bandwidths(profiles), self.options.link_drift)
    if slowed and (not base or step_s > base):
      return Drift.LINK
    if base and step_s > (1 + self.options.drift) * base:
      return Drift.STEP
    return None

  def _learn_and_replan(self, measured_s: float) -> bool:
    self.model.learn(self._window, self.schedule, measured_s)
    return self._replan("replan", measured_s)

  def _event(self, what: str, measured_s: float | None, detail: str) -> None:
    event = TunerEvent(self._steps, what,
                       self.prediction.step_s if self.prediction else None,
                       measured_s, detail)
    self.history.append(event)
    logger.info("dap step %d: %s (predicted %s, measured %s) %s", event.step,
                what, _ms(event.predicted_s), _ms(measured_s), detail)

  def predict(self, prefetch: Mapping[str, int]) -> costmodel.Prediction:
    """The cost model's view of another plan, on what was measured (with
    the step time it does not model, as last measured)."""
    return self.model.predict(
        prefetch, dict(self.schedule.chunk_bytes) if self.schedule else None)

  @property
  def links(self) -> dict[str, costmodel.Link]:
    """Each tier's link as the model learned it."""
    return dict(self.model.links)


def _split(profiles: Sequence[StepProfile]) -> str:
  """Median compute, stall and bytes copied while computing of measured
  steps, for the history: on a device that shares the host's cores with
  the copies (XLA:CPU), compute slows while transfers overlap it."""
  compute = [sum(p.segment_compute_s) for p in profiles
             if p.segment_compute_s is not None]
  overlap = [sum(p.segment_overlap_bytes) for p in profiles
             if p.segment_overlap_bytes is not None]
  stall = statistics.median(p.stall_s for p in profiles)
  return ((f"{statistics.median(compute) * 1e3:.1f} + " if compute else "")
          + f"{stall * 1e3:.1f} stalled" + (
              f", {format_bytes(int(statistics.median(overlap)))} copied "
              "while computing" if overlap else ""))


def _ms(seconds: float | None) -> str:
  return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"
