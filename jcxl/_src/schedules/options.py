"""Knobs of the online tuner (`TunerOptions`), apart from the tuner so that
its parts (drift, race) read them without importing the tuner."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class TunerOptions:
  """Knobs of the online tuner.

  Example:
    >>> step = jcxl.cxl_offload(train_step, schedule="dap")
    >>> step.tuner.options = jcxl.planning.TunerOptions(max_replans=2)

  Attributes:
    warmup_steps: steps run before the first measurement (the first call
      compiles; caches warm up).
    measure_steps: steps measured before each re-plan (their medians
      are used: the first step after a recompile runs slow).
    max_replans: plan changes (recompiles) allowed over the whole run.
    check_every: once converged, measure one step in this many at first;
    check_every_max: each check that finds nothing doubles the interval,
      up to this (measuring costs the host a few ms a step).
    drift: how much slower than the settled plan's median step (over
      its last checks) measured steps must run for the tuner to take it as
      the host's new pace (a new baseline, the plan kept).
    confirm_every: once a check looks off, measure one step in this many
      to confirm it (a burst of load on a shared machine lasts a few
      steps; a drift lasts).
    link_drift: relative change of the plan's modelled step time when the
      links' measured bandwidths replace those it was made for, that
      triggers a re-plan, if the link slowed and the measured step runs
      slower than its baseline (where copies share the host's cores,
      achieved bandwidth swings with the load while the step does not).
    min_gain: fraction of the step a re-plan must be predicted to save
      for the tuner to switch plans (and recompile).
    explore: uniform prefetch distances raced against the model's plan
      once it holds (each within the budget, each one compile); the
      fastest is kept.
    race_rounds: measured rounds of a race (each candidate runs
      `race_block` steps a round, after one round of one step each that
      warms them up).
    race_block: steps each candidate runs back to back in its turn, the
      last one measured: a plan is run back to back in production, and
      on a host whose caches and buffers are warm for the plan that ran
      last, a step right after another plan's runs slower (by up to 20%
      measured on XLA:CPU), and not by the same for every plan.
    race_alpha: after `race_rounds`, a candidate leaves the race once it
      ran slower than the fastest (by median) in so many of their rounds
      that chance would do so this often at most (a sign test: a step
      that runs 40% slow, one in five or so on a shared host, moves it
      by one round, where it would move a median over three rounds by
      5-35%); the others race on,
    race_max_rounds: until one is left or this many rounds were measured
      (close candidates are told apart by more steps, not by luck).
    max_tuning_steps: steps a tuning episode runs plans to measure them
      (warm-up, measuring, racing, baseline) before the best plan measured
      so far is kept and the tuner is settled.
    max_compile_s: seconds an episode may spend compiling (each plan
      from its start, the one in progress included; not the first call's,
      which any schedule pays); then the plans not compiled yet are dropped
      (a compile in progress cannot be stopped: its plan is not used).
  """
  warmup_steps: int = 1
  measure_steps: int = 3
  max_replans: int = 6
  check_every: int = 8
  check_every_max: int = 32
  confirm_every: int = 4
  drift: float = 0.15
  link_drift: float = 0.05
  min_gain: float = 0.02
  explore: tuple[int, ...] = (0, 1, 2, 3)
  race_rounds: int = 3
  race_block: int = 2
  race_alpha: float = 0.125
  race_max_rounds: int = 12
  max_tuning_steps: int = 64
  max_compile_s: float = 60.0

  def __post_init__(self):
    value = self.max_tuning_steps
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError("TunerOptions.max_tuning_steps must be an int >= 1, "
                       f"but got {value!r}")
    if not (isinstance(self.max_compile_s, (int, float))
            and self.max_compile_s >= 0 and math.isfinite(self.max_compile_s)):
      raise ValueError("TunerOptions.max_compile_s must be a finite number "
                       f">= 0, but got {self.max_compile_s!r}")
