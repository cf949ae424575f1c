"""Each segment's compute measured in the offloaded step itself."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jcxl
from jcxl._src import compute_measure
from jcxl._src import registry
from jcxl._src.offload.step import OffloadedStep
from jcxl._src.offload.step import step_timeline


def uneven_step():
  """An sgd step over three layers, the middle one doing far more work
  (the same product many times over) than the others, and its abstract
  arguments."""
  tx = optax.sgd(1e-3)
  params = {name: {"w": jax.ShapeDtypeStruct((256, 256), np.float32)}
            for name in ("first", "heavy", "last")}
  x = jax.ShapeDtypeStruct((256, 256), np.float32)

  def loss_fn(p, x):
    x = jnp.tanh(x @ p["first"]["w"])
    for _ in range(24):
      x = jnp.tanh(x @ p["heavy"]["w"])
    return jnp.mean(jnp.tanh(x @ p["last"]["w"]) ** 2)

  def step(p, s, x):
    loss, g = jax.value_and_grad(loss_fn)(p, x)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  return step, (params, jax.eval_shape(tx.init, params)), x


class MeasuredTimelineTest:

  def test_same_segments_as_the_planned_timeline(self):
    step, state, x = uneven_step()
    planned, planned_bytes = step_timeline(step, state, x)
    measured, layer_bytes = compute_measure.measured_timeline(
        step, state, x, steps=2)
    assert layer_bytes == planned_bytes
    assert ([(s.name, s.nbytes, s.tier) for s in measured]
            == [(s.name, s.nbytes, s.tier) for s in planned])
    assert all(s.compute_s >= 0 for s in measured)

  def test_the_layer_that_computes_most_measures_most(self):
    step, state, x = uneven_step()
    measured, _ = compute_measure.measured_timeline(step, state, x, steps=3)
    by_layer = {}
    for s in measured:
      by_layer[s.name] = by_layer.get(s.name, 0.0) + s.compute_s
    heavy = next(t for n, t in by_layer.items() if "heavy" in n)
    # 24 of the 26 products of the forward pass and their gradients.
    assert heavy > 0.5 * sum(by_layer.values())

  def test_leaves_no_pool_open(self):
    step, state, x = uneven_step()
    before = [id(p) for p in registry.open_pools()]
    compute_measure.measured_timeline(step, state, x, steps=1)
    assert [id(p) for p in registry.open_pools()] == before

  def test_unmatched_boundaries_are_a_clear_error(self, monkeypatch):
    # A profile whose waits did not match the timeline has no segment
    # times (see profile.profile_step): nothing is made up for them.
    measured = OffloadedStep.measured_call

    def unmatched(self, *args):
      results, profile = measured(self, *args)
      return results, dataclasses.replace(profile, segment_compute_s=None)

    monkeypatch.setattr(OffloadedStep, "measured_call", unmatched)
    step, state, x = uneven_step()
    with pytest.raises(RuntimeError, match="did not match its timeline"):
      compute_measure.measured_timeline(step, state, x, steps=1)

  def test_bad_steps(self):
    step, state, x = uneven_step()
    with pytest.raises(ValueError, match="steps must be >= 1"):
      compute_measure.measured_timeline(step, state, x, steps=0)


def test_measured_call_profiles_any_schedule():
  step_fn, state, x = uneven_step()
  params = jax.tree.map(lambda s: np.full(s.shape, 0.01, s.dtype), state[0])
  xs = np.ones(x.shape, np.float32)
  reference = jax.jit(step_fn)(params, optax.sgd(1e-3).init(params), xs)
  with jcxl.Pool(host="32MiB", cxl=0) as pool:  # link probe: 16 MiB
    placed = jcxl.place(params, "host", pool=pool)
    step = jcxl.cxl_offload(step_fn, schedule="fixed:1")
    (new_params, _, loss), profile = step.measured_call(
        placed, optax.sgd(1e-3).init(params), xs)
    assert profile is step.last_profile
    assert len(profile.segment_compute_s) == len(step._segments)
    assert sum(l.bytes_fetched for l in profile.layers) >= 3 * 256 * 256 * 4
    np.testing.assert_allclose(loss, reference[2], rtol=1e-6)
    np.testing.assert_allclose(jcxl.gather(new_params)["heavy"]["w"],
                               reference[0]["heavy"]["w"], rtol=1e-6)
