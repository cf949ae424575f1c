"""The race: the model's plan checked against what the device does.

The plan and the uniform distances of `options.explore` (within the budget)
run in turn, `race_block` steps each per round (the last one timed), for
`race_rounds` rounds after a round that warms each compiled plan up.
Interleaving puts the machine's changing load on every candidate alike;
each is judged by its median. Candidates not yet surely slower than the
fastest then race on (up to `race_max_rounds`): the closer two plans, the
more steps it takes to tell them apart on a noisy machine.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Sequence

from jcxl._src.schedules.options import TunerOptions
from jcxl._src.schedules.profile import StepProfile
from jcxl._src.schedules.plan import LayerSchedule


class Turn(enum.Enum):
  """What a race's step leads to."""
  GOES_ON = enum.auto()  # the running candidate's turn goes on
  NEXT = enum.auto()     # the next candidate's turn: see `Race.next_turn`
  OVER = enum.auto()     # the race is over: see `Race.finish`


class Race:
  """A race in progress: each candidate's measured steps, and whose turn
  it is."""

  def __init__(self, candidates: Sequence[LayerSchedule],
               base: LayerSchedule, options: TunerOptions):
    self.options = options
    self.base = base  # the model's plan
    self.times: dict[LayerSchedule, list[StepProfile]] = {
        c: [] for c in candidates}
    # Candidates that fell behind: out of the next rounds, still reported.
    self.out: dict[LayerSchedule, list[StepProfile]] = {}
    self.queue = list(candidates)
    self.round = 0
    self.left = 0  # steps left in the running candidate's turn

  def next_turn(self) -> LayerSchedule:
    """The next candidate in the queue, whose turn starts."""
    # Round 0 warms each compiled plan up: a step is enough.
    self.left = max(1, self.options.race_block) if self.round > 0 else 1
    return self.queue.pop(0)

  @property
  def measures_next(self) -> bool:
    """Whether the next step is measured: the last of a measured turn."""
    return self.left == 1 and self.round > 0

  def step(self, running: LayerSchedule,
           profile: StepProfile | None) -> Turn:
    """Takes a step of `running`'s turn (measured: `profile`)."""
    self.left -= 1
    if self.left > 0:
      return Turn.GOES_ON
    if self.round > 0 and profile is not None:
      self.times[running].append(profile)
    if not self.queue:
      order = self._contenders()
      self.round += 1
      alone = len(order) == 1 and self.times[order[0]]  # and measured
      if alone or self.round > max(self.options.race_rounds,
                                   self.options.race_max_rounds):
        return Turn.OVER
      shift = self.round % len(order)
      self.queue = order[shift:] + order[:shift]
    return Turn.NEXT

  def drop(self, candidate: LayerSchedule) -> None:
    """Takes `candidate` out (over the budget, or not compiled in time)."""
    self.times.pop(candidate, None)
    self.queue = [c for c in self.queue if c != candidate]

  def restart(self) -> None:
    """Starts over with the candidates left (nothing raced yet: the race
    waited for them all to compile)."""
    self.round = 0
    self.queue = list(self.times)

  def medians(self) -> dict[LayerSchedule, float]:
    return {c: statistics.median(p.step_s for p in profiles)
            for c, profiles in self.times.items() if profiles}

  def finish(self) -> dict[LayerSchedule, float]:
    """Every candidate's median step, those that left early included."""
    self.times.update(self.out)
    self.out = {}
    return self.medians()

  def _contenders(self) -> list[LayerSchedule]:
    """The candidates that run the next round: all of them for the first
    `race_rounds`, then those not surely slower than the fastest median
    (`surely_slower`)."""
    if self.round < max(1, self.options.race_rounds):
      return list(self.times)
    medians = self.medians()
    leader = min(medians, key=medians.get)
    for c in [c for c in self.times if c != leader and surely_slower(
        self.times[c], self.times[leader], self.options.race_alpha)]:
      self.out[c] = self.times.pop(c)
    return list(self.times)


def surely_slower(times: Sequence[StepProfile],
                  fastest: Sequence[StepProfile], alpha: float) -> bool:
  """Whether `times` ran slower than `fastest` in so many of the rounds
  both ran (paired by round) that chance alone would do so at most
  `alpha` of the time."""
  pairs = list(zip(times, fastest))
  slower = sum(a.step_s > b.step_s for a, b in pairs)
  chance = sum(math.comb(len(pairs), k) for k in range(slower, len(pairs) + 1))
  return bool(pairs) and chance / 2**len(pairs) <= alpha


def describe(schedule: LayerSchedule, base: LayerSchedule) -> str:
  """How a raced plan is named in the tuner's history."""
  if schedule == base:
    return "the model's plan"
  distances = set(dict(schedule.prefetch).values())
  if len(distances) == 1:
    return f"every layer {distances.pop()} ahead"
  return "an earlier plan"
