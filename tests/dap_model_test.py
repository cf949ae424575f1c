"""The step model the adaptive schedule's tuner learns (schedules/model.py)."""

from __future__ import annotations

import pytest

from jcxl._src.schedules import costmodel
from jcxl._src.schedules.model import StepModel
from jcxl._src.schedules.profile import StepProfile
from jcxl._src.schedules.plan import LayerSchedule

MiB = 1 << 20
SYNC = LayerSchedule.of({"a": 0, "b": 0})
AHEAD = LayerSchedule.of({"a": 0, "b": 1})  # b fetched during a's compute


def model_of(*segments):
  """A model estimated at `segments` (name, bytes, compute) on a 1 GB/s
  link."""
  model = StepModel()
  model.estimate([costmodel.Segment(n, b, "cxl", c) for n, b, c in segments],
                 {"cxl": costmodel.Link(1e9, 0.0)})
  return model


def measured(step_s, compute_s=None, bandwidth=None):
  return StepProfile(step_s=step_s, layers=(), segment_compute_s=compute_s,
                     bytes_by_tier={}, bandwidth_by_tier=(
                         {} if bandwidth is None else {"cxl": bandwidth}))


class StepModelTest:

  def test_learning_moves_the_prediction_to_the_measured_step(self):
    model = model_of(("a", 8 * MiB, 0.01), ("b", 8 * MiB, 0.01))
    before = model.predict(dict(SYNC.prefetch)).step_s
    # Each layer computes longer than estimated, the link runs at half the
    # speed, and the step takes more than both explain; one step is slow.
    window = [measured(0.2, (0.031, 0.019), 0.4e9),
              measured(0.09, (0.03, 0.021), 0.6e9),
              measured(0.085, (0.029, 0.02), 0.5e9)]
    model.learn(window, SYNC, 0.09)
    assert [s.compute_s for s in model.segments] == [0.03, 0.02]
    assert model.links == {"cxl": costmodel.Link(0.5e9, 0.0)}
    fetch = 8 * MiB / 0.5e9
    assert model.overhead_s == pytest.approx(0.09 - (2 * fetch + 0.05))
    assert abs(before - 0.09) > 0.04  # the estimate was far off
    assert model.predict(dict(SYNC.prefetch)).step_s == pytest.approx(0.09)
    # Another plan is predicted on what was learned, not on the estimate.
    ahead = costmodel.simulate(model.segments, dict(AHEAD.prefetch),
                               model.links)
    assert model.predict(dict(AHEAD.prefetch)).step_s == pytest.approx(
        ahead.step_s + model.overhead_s)

  def test_a_step_faster_than_modelled_takes_nothing_off(self):
    model = model_of(("a", 8 * MiB, 0.01), ("b", 8 * MiB, 0.01))
    modelled = model.predict(dict(SYNC.prefetch)).step_s
    model.learn([measured(0.01)], SYNC, 0.01)
    assert model.overhead_s == 0.0
    assert model.predict(dict(SYNC.prefetch)).step_s == modelled

  def test_later_estimates_do_not_undo_what_was_measured(self):
    model = model_of(("a", 8 * MiB, 0.01), ("b", 8 * MiB, 0.01))
    model.learn([measured(0.09, (0.03, 0.02), 0.5e9)], SYNC, 0.09)
    model.estimate([costmodel.Segment("a", MiB, "cxl", 0.5)],
                   {"cxl": costmodel.Link(9e9, 0.0)})
    assert [s.compute_s for s in model.segments] == [0.03, 0.02]
    assert model.links["cxl"].bandwidth == 0.5e9

  def test_a_slower_link_counts_by_its_effect_on_the_plan(self):
    # b's 8 ms fetch hides behind a's 50 ms of compute, 1 ahead, even at
    # half the bandwidth; fetched when needed, the step waits for it.
    model = model_of(("a", 0, 0.05), ("b", 8 * MiB, 0.01))
    model.planned()
    half = {"cxl": 0.5e9}
    assert not model.link_slowed(AHEAD, half, 0.05)
    assert model.link_slowed(SYNC, half, 0.05)
    assert not model.link_slowed(SYNC, {"cxl": 0.99e9}, 0.05)
    assert not model.link_slowed(SYNC, {"cxl": 2e9}, 0.05)  # faster
    assert not model.link_slowed(SYNC, {"nvme": 1e6}, 0.05)  # not its tier

  def test_a_plan_that_ran_at_a_bandwidth_is_judged_from_it(self):
    model = model_of(("a", 0, 0.05), ("b", 8 * MiB, 0.01))
    model.planned()
    model.ran_at({"cxl": 0.5e9})
    assert not model.link_slowed(SYNC, {"cxl": 0.5e9}, 0.05)
    assert model.link_slowed(SYNC, {"cxl": 0.25e9}, 0.05)
    model.planned()  # a new plan, on the links as learned (1 GB/s)
    assert model.link_slowed(SYNC, {"cxl": 0.5e9}, 0.05)
