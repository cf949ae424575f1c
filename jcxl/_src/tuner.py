"""Dynamic Adaptive Pipelining: the online tuner behind ``schedule='dap'``.

It starts from the cost model's plan (layer bytes, the tiers' links,
compute estimated from the step's equations) within the device budget,
then measures a few steps, re-plans from what it measured (each segment's
compute, each tier's achieved bandwidth) and recompiles only when the plan
changes, a bounded number of times. When the model's plan holds, it also
measures a few uniform prefetch distances within the budget once, and
keeps whichever plan measured fastest: the model does not see everything
(copies competing with compute for the host's cores, say), the device
does. Once settled, it measures one step every so often; when the measured
step drifts from the plan's prediction (a link slowed because another job
shares it, say) it measures again and re-plans.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Mapping, Sequence

from jcxl._src import costmodel
from jcxl._src.profile import StepProfile
from jcxl._src.schedule import LayerSchedule

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TunerOptions:
  """Knobs of the online tuner.

  Attributes:
    warmup_steps: steps run before the first measurement (the first call
      compiles; caches warm up).
    measure_steps: steps measured before each re-plan (their medians
      are used: the first step after a recompile runs slow).
    max_replans: plan changes (recompiles) allowed over the whole run.
    check_every: once converged, measure one step in this many.
    drift: relative change of a measured step time or link bandwidth,
      against what the plan was made for, that triggers a re-plan.
    min_gain: fraction of the step a re-plan must be predicted to save
      for the tuner to switch plans (and recompile).
    explore: uniform prefetch distances measured once the model's plan
      holds (each within the budget, each one compile); the fastest
      measured plan is kept.
  """
  warmup_steps: int = 1
  measure_steps: int = 3
  max_replans: int = 6
  check_every: int = 8
  drift: float = 0.15
  min_gain: float = 0.02
  explore: tuple[int, ...] = (1, 2, 3)


@dataclasses.dataclass(frozen=True)
class TunerEvent:
  """One thing the tuner did, for its history."""
  step: int
  what: str  # plan, replan, explore, converged, drift, revert, frozen, budget
  predicted_s: float | None
  measured_s: float | None
  detail: str = ""


class Tuner:
  """Chooses and re-chooses a ``LayerSchedule`` for one step function."""

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
    self._segments: list[costmodel.Segment] = []
    self._links: dict[str, costmodel.Link] = {}
    self._planned_for: dict[str, float] = {}  # tier -> bandwidth used
    self._window: list[StepProfile] = []
    self._state = "warmup"
    self._baseline_s: float | None = None  # measured when it converged
    self._steps = 0
    self._since_check = 0
    # Per plan tried: its compile-cache version and the step time measured
    # with it, so that a plan the cost model liked but the device did not
    # is dropped for the best one measured (without a recompile).
    self._versions: dict[LayerSchedule, int] = {}
    self._measured: dict[LayerSchedule, float] = {}
    self._to_explore: list[int] = list(options.explore)
    self._exploring = False
    self._explore_from: LayerSchedule | None = None
    # Step time the model does not see (dispatch, host work), measured
    # against its prediction for the plan that ran; added to predictions.
    self._overhead_s = 0.0

  # ------------------------------------------------------------ planning

  @property
  def prefetch_budget(self) -> int | None:
    if self.budget is None or self._base_bytes is None:
      return None
    return max(0, self.budget - self._base_bytes)

  @property
  def converged(self) -> bool:
    return self._state == "steady"

  def resolve(self, segments: Sequence[costmodel.Segment],
              links: Mapping[str, costmodel.Link]) -> LayerSchedule:
    """The schedule to compile with (called while the step is traced)."""
    if not self._segments:  # estimates; measurements replace them later
      self._segments, self._links = list(segments), dict(links)
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
    choice = costmodel.plan(self._segments, self._links,
                            prefetch_budget=self.prefetch_budget, start=start)
    schedule = LayerSchedule.of(choice.prefetch, choice.chunk_bytes,
                                name="dap")
    choice = dataclasses.replace(
        choice, prediction=self._with_overhead(choice.prediction))
    if self.schedule is not None and not over_budget:
      # A new plan must promise enough to pay for its recompile: measured
      # noise alone would otherwise move the plan back and forth.
      current = self.predict(dict(self.schedule.prefetch))
      if choice.prediction.step_s > current.step_s * (
          1 - self.options.min_gain):
        schedule, choice = self.schedule, dataclasses.replace(
            choice, prediction=current)
    changed = schedule != self.schedule
    if changed and self.schedule is not None:
      if self.replans >= self.options.max_replans:
        self._event("frozen", measured_s, "re-plan limit reached "
                    f"({self.options.max_replans}); keeping the plan")
        self._state = "steady"
        return False
      self.replans += 1
    self.version = self._versions.setdefault(schedule, len(self._versions))
    self.schedule = schedule
    self.prediction = choice.prediction
    self.reasons = choice.reasons
    self._planned_for = {t: l.bandwidth for t, l in self._links.items()}
    self._event(what if changed else "converged", measured_s,
                "; ".join(choice.reasons))
    return changed

  def calibrate(self, need_bytes: int) -> bool:
    """Learns the device need without prefetch from a compiled plan's
    need; re-plans (True) if that plan is over the budget."""
    peak = costmodel.peak_prefetch_bytes(self._segments,
                                         dict(self.schedule.prefetch))
    self._base_bytes = need_bytes - peak
    if self.budget is None or need_bytes <= self.budget:
      return False
    before = self.schedule
    self._replan("budget", measured_s=None, over_budget=True)
    return self.schedule != before

  # ----------------------------------------------------------- measuring

  def wants_measurement(self) -> bool:
    """Whether the next step should be measured."""
    if self._state == "warmup":
      return self._steps >= self.options.warmup_steps
    if self._state == "measure":
      return True
    return self._since_check + 1 >= self.options.check_every

  def step_done(self, profile: StepProfile | None) -> bool:
    """Takes the next step's measurement (None: not measured).

    Returns whether the plan changed (the step must be recompiled).
    """
    self._steps += 1
    if profile is None:
      self._since_check += 1
      return False
    if self._state == "steady":
      self._since_check = 0
      if not self._drifted(profile):
        return False
      self._event("drift", profile.step_s,
                  f"measured {profile.step_s * 1e3:.2f} ms against "
                  f"{_ms(self._baseline_s)} when the plan converged; "
                  "links " + ", ".join(
                      f"{t} {b / 1e9:.2f} GB/s"
                      for t, b in profile.bandwidth_by_tier.items()))
      self._window = []
      self._measured.clear()  # times under the old conditions
      self._to_explore = list(self.options.explore)
    self._state = "measure"
    self._window.append(profile)
    if len(self._window) < self.options.measure_steps:
      return False
    measured = statistics.median(p.step_s for p in self._window)
    self._measured[self.schedule] = measured
    if self._exploring:
      return self._explore_next(measured)
    best = min(self._measured, key=self._measured.get)
    if self._measured[best] * (1 + self.options.min_gain) < measured:
      self._revert(best, measured)
      return True
    changed = self._learn_and_replan(measured)
    self._window = []
    if not changed:
      if self._to_explore:
        return self._explore_next(measured)
      self._state = "steady"
      self._baseline_s = measured
    return changed

  def _explore_next(self, measured_s: float) -> bool:
    """Switches to the next uniform distance to measure; when none is
    left, settles on the fastest plan measured. Returns whether the plan
    changed."""
    self._window = []
    # The candidates keep the model's plan's layers and chunk sizes.
    base = self._explore_from = self._explore_from or self.schedule
    while self._to_explore:
      k = self._to_explore.pop(0)
      candidate = LayerSchedule.of(
          {name: k for name, _ in base.prefetch}, dict(base.chunk_bytes),
          name="dap")
      budget = self.prefetch_budget
      if candidate in self._measured or (
          budget is not None and costmodel.peak_prefetch_bytes(
              self._segments, dict(candidate.prefetch)) > budget):
        continue
      if candidate not in self._versions:
        if self.replans >= self.options.max_replans:
          break
        self.replans += 1
      self._exploring = True
      self._switch(candidate)
      self._state = "measure"
      self._event("explore", measured_s,
                  f"measuring every layer {k} ahead against the model's "
                  "plan")
      return True
    self._exploring = False
    self._explore_from = None
    best = min(self._measured, key=self._measured.get)
    if best != self.schedule:
      self._revert(best, measured_s)
      return True
    self._state = "steady"
    self._baseline_s = measured_s
    return False

  def _switch(self, schedule: LayerSchedule) -> None:
    self.schedule = schedule
    self.version = self._versions.setdefault(schedule, len(self._versions))
    self.prediction = self.predict(dict(schedule.prefetch))

  def _drifted(self, profile: StepProfile) -> bool:
    """Whether a link or the step time moved from what the plan was
    made for (the step time against the one measured when it converged)."""
    tolerance = self.options.drift
    for tier, bw in profile.bandwidth_by_tier.items():
      planned = self._planned_for.get(tier)
      if planned and abs(bw - planned) > tolerance * planned:
        return True
    base = self._baseline_s
    return bool(base) and abs(profile.step_s - base) > tolerance * base

  def _revert(self, best: LayerSchedule, measured_s: float) -> None:
    """Back to the fastest plan measured (compiled already)."""
    self._event("revert", measured_s,
                f"this plan measured {measured_s * 1e3:.2f} ms, the fastest "
                f"one {self._measured[best] * 1e3:.2f} ms: back to it")
    self._switch(best)
    self._window = []
    self._state = "steady"
    self._baseline_s = self._measured[best]

  def _learn_and_replan(self, measured_s: float) -> bool:
    window = self._window
    matched = [p.segment_compute_s for p in window
               if p.segment_compute_s is not None]
    if matched:
      median = [statistics.median(c) for c in zip(*matched)]
      self._segments = [dataclasses.replace(s, compute_s=c)
                        for s, c in zip(self._segments, median)]
    # Measured bandwidth is bytes over busy time: per-transfer overheads
    # are in it already, so the learned link has no separate latency.
    for tier in self._links:
      seen = [p.bandwidth_by_tier[tier] for p in window
              if tier in p.bandwidth_by_tier]
      if seen:
        self._links[tier] = costmodel.Link(statistics.median(seen), 0.0)
    self._overhead_s = 0.0
    modelled = self.predict(dict(self.schedule.prefetch)).step_s
    self._overhead_s = max(0.0, measured_s - modelled)
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
    return self._with_overhead(costmodel.simulate(
        self._segments, prefetch, self._links,
        dict(self.schedule.chunk_bytes) if self.schedule else None))

  def _with_overhead(self, p: costmodel.Prediction) -> costmodel.Prediction:
    return dataclasses.replace(p, step_s=p.step_s + self._overhead_s)

  @property
  def links(self) -> dict[str, costmodel.Link]:
    return dict(self._links)


def _ms(seconds: float | None) -> str:
  return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"
