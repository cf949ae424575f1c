"""Watching a settled plan: when its next check is due, the baseline its
checks are judged against, and what a slower check means (`Drift`)."""

from __future__ import annotations

import enum
import random
import statistics
from collections.abc import Sequence

from jcxl._src.schedules.options import TunerOptions
from jcxl._src.schedules.profile import StepProfile

# Checks of a settled plan whose median is the baseline drift is judged by.
_RECENT_CHECKS = 9


class Drift(enum.Enum):
  """What slowed, by a settled plan's measured steps."""
  LINK = "link"  # a link, from what the plan was made for, and the step
  STEP = "step"  # only the step, from its baseline: the host's pace


class Checks:
  """A settled plan's checks: one step measured every so often (less often
  while nothing changes), and the times they measured."""

  def __init__(self, options: TunerOptions):
    self.recent: list[float] = []  # its baseline window, then its checks
    self.since = 0  # steps since the last check
    self.every = options.check_every
    # Steps from the last check to the next, drawn once per wait.
    self._spacing: int | None = None
    self._rng = random.Random(0)

  def reset(self, options: TunerOptions,
            recent: Sequence[float] = ()) -> None:
    """A new baseline: `recent` its times so far; checks often again."""
    self.recent = list(recent)
    self.since, self._spacing = 0, None
    self.every = options.check_every

  def due(self, interval: int) -> bool:
    """Whether the next step is one `interval` (spaced) from the last."""
    return self.since + 1 >= self._spaced(interval)

  def measured(self) -> None:
    self.since, self._spacing = 0, None

  def passed(self, step_s: float, options: TunerOptions) -> None:
    """A check found nothing: its time joins the baseline, and the next
    check waits twice as long (up to `check_every_max`)."""
    # Drift is judged median against median: a baseline that is the
    # fastest step seen makes the machine's noise look like drift.
    self.recent = (self.recent + [step_s])[-_RECENT_CHECKS:]
    self.every = min(2 * self.every,
                     max(options.check_every, options.check_every_max))

  @property
  def baseline_s(self) -> float | None:
    """The settled plan's median step over its last checks."""
    return statistics.median(self.recent) if self.recent else None

  def _spaced(self, interval: int) -> int:
    """Steps from the last check to the next: `interval`, give or take a
    quarter, drawn once per wait. At a fixed period a check can fall on
    the same step of a periodic loop every time: where two steps of this
    plan follow another plan's (a benchmark's rounds, a train/eval loop),
    on the first, which runs up to 40% slower, and the tuner saw a drift
    that was not there."""
    if self._spacing is None:
      self._spacing = interval + self._rng.randint(-(interval // 4),
                                                   interval // 4)
    return self._spacing


def median_bandwidths(profiles: Sequence[StepProfile]) -> dict[str, float]:
  seen: dict[str, list[float]] = {}
  for p in profiles:
    for tier, bw in p.bandwidth_by_tier.items():
      seen.setdefault(tier, []).append(bw)
  return {tier: statistics.median(bws) for tier, bws in seen.items()}
