"""What the online tuner learned of its step: the cost model's inputs as
measured, the step time the model does not see, and the links the running
plan was made for (see tuner.py).

The tuner starts from estimates (layer bytes, the tiers' links, compute
estimated from the step's equations) and replaces them with measured
medians; its plans, predictions and link drift are all asked of this.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence

from jcxl._src.schedules import costmodel
from jcxl._src.schedules.profile import StepProfile
from jcxl._src.schedules.plan import LayerSchedule


class StepModel:
  """The cost model of one step function, as learned from measured steps."""

  def __init__(self):
    self.segments: list[costmodel.Segment] = []
    self.links: dict[str, costmodel.Link] = {}
    # Step time the model does not see (dispatch, host work), measured
    # against its prediction for the plan that ran; added to predictions.
    self.overhead_s = 0.0
    self._planned_for: dict[str, float] = {}  # tier -> bandwidth used
    # The plan's modelled step on the links it was made for, by plan.
    self._planned_step: tuple[LayerSchedule, float] | None = None

  def estimate(self, segments: Sequence[costmodel.Segment],
               links: Mapping[str, costmodel.Link]) -> None:
    """Starts from estimates (the first trace's); once it has segments,
    later traces' estimates would undo what was measured (unless
    `new_timeline` was called)."""
    if not self.segments:
      self.segments, self.links = list(segments), {**links, **self.links}
      self._planned_step = None

  def new_timeline(self) -> None:
    """The step's fetches changed (weights kept where they were refetched,
    or the other way: see kept_weights): its next trace's segments are
    taken, on the links as learned."""
    self.segments = []

  def choose(self, prefetch_budget: int | None,
             start: Mapping[str, int] | None) -> costmodel.Choice:
    """The cost model's best plan on what was measured, predicted with the
    step time it does not model."""
    choice = costmodel.choose_schedule(self.segments, self.links,
                                       prefetch_budget=prefetch_budget,
                                       start=start)
    return dataclasses.replace(
        choice, prediction=self._with_overhead(choice.prediction))

  def predict(self, prefetch: Mapping[str, int],
              chunk_bytes: Mapping[str, int] | None = None
              ) -> costmodel.Prediction:
    """A plan's step on what was measured (with the step time the model
    does not see, as last measured)."""
    return self._with_overhead(costmodel.simulate(
        self.segments, prefetch, self.links, chunk_bytes))

  def learn(self, window: Sequence[StepProfile], schedule: LayerSchedule,
            measured_s: float,
            chunk_bytes: Mapping[str, int] | None = None) -> None:
    """Learns each segment's compute, the links and what the model does
    not see from `schedule`'s measured steps `window` (medians);
    `chunk_bytes` as in `learn_overhead`."""
    self._planned_step = None  # the model changes
    matched = [p.segment_compute_s for p in window
               if p.segment_compute_s is not None]
    if matched:
      median = [statistics.median(c) for c in zip(*matched)]
      self.segments = [dataclasses.replace(s, compute_s=c)
                       for s, c in zip(self.segments, median)]
    # Measured bandwidth is bytes over busy time: per-transfer overheads
    # are in it already, so the learned link has no separate latency.
    for tier in self.links:
      seen = [p.bandwidth_by_tier[tier] for p in window
              if tier in p.bandwidth_by_tier]
      if seen:
        self.links[tier] = costmodel.Link(statistics.median(seen), 0.0)
    self.learn_overhead(schedule, measured_s, chunk_bytes)

  def learn_overhead(self, schedule: LayerSchedule, measured_s: float,
                     chunk_bytes: Mapping[str, int] | None = None) -> None:
    """Learns the step time the model does not see, from `schedule`'s
    measured step, modelled with `chunk_bytes` (`schedule`'s own if
    None)."""
    self.overhead_s = 0.0
    modelled = self.predict(dict(schedule.prefetch), dict(
        schedule.chunk_bytes if chunk_bytes is None else chunk_bytes)).step_s
    self.overhead_s = max(0.0, measured_s - modelled)

  # ------------------------------------------------ the links planned for

  def planned(self) -> None:
    """A plan was made on the links as learned now: its link drift is
    judged from them."""
    self._planned_for = {t: l.bandwidth for t, l in self.links.items()}
    self._planned_step = None

  def ran_at(self, bandwidths: Mapping[str, float]) -> None:
    """The kept plan ran on its own at `bandwidths` (tier -> bytes/s):
    what it runs at from now on, its link drift is judged from those."""
    self._planned_for.update(bandwidths)
    self._planned_step = None

  def link_slowed(self, schedule: LayerSchedule,
                  bandwidths: Mapping[str, float], by: float) -> bool:
    """Whether `schedule`'s modelled step runs slower by more than `by`
    (a fraction) on the links at the measured `bandwidths` than on those
    it was made for.

    A link counts by what it does to this plan's step: the achieved
    bandwidth of small or well-hidden transfers swings widely with no
    effect on the step at all. Only a slower link counts: a faster one
    leaves the plan as good.
    """
    measured = {t: costmodel.Link(bw) for t, bw in bandwidths.items()
                if t in self.links}
    if not measured:
      return False
    then = self._planned_step_s(schedule)
    moved = self._step_s(schedule, {**self._planned_links(), **measured}) - then
    return moved > by * then

  def _planned_links(self) -> dict[str, costmodel.Link]:
    return {**self.links, **{t: costmodel.Link(bw)
                             for t, bw in self._planned_for.items()}}

  def _planned_step_s(self, schedule: LayerSchedule) -> float:
    """The plan's modelled step on the links it was made for (cached: the
    checks of a settled plan ask it again and again)."""
    if self._planned_step is None or self._planned_step[0] != schedule:
      self._planned_step = (schedule,
                            self._step_s(schedule, self._planned_links()))
    return self._planned_step[1]

  def _step_s(self, schedule: LayerSchedule,
              links: Mapping[str, costmodel.Link]) -> float:
    """`schedule`'s modelled step time on `links`."""
    return costmodel.simulate(self.segments, dict(schedule.prefetch),
                              links, dict(schedule.chunk_bytes)).step_s

  def _with_overhead(self, p: costmodel.Prediction) -> costmodel.Prediction:
    return dataclasses.replace(p, step_s=p.step_s + self.overhead_s)
