"""plan_host_updates: one pass that returns frozen records, each update
lowered once, its programs made once per structure and registered as
lowered."""

from __future__ import annotations

import dataclasses

from experiments.common import make_train_step
import jax
import jax.numpy as jnp
import jcxl
from jcxl._src.host_update import choose
from jcxl._src.host_update import lower
from jcxl._src.host_update import plan as plan_lib
from jcxl._src.host_update.ir import UpdateChoice
from jcxl._src.host_update.ir import UpdatePath
from jcxl._src.offload import analysis
import numpy as np
import optax
import pytest

DIM = 16


def _mlp():
  rng = np.random.default_rng(0)
  params = {f"layer{i}": {"w": (rng.normal(size=(DIM, DIM)) * 0.3
                                ).astype(np.float32),
                          "b": np.zeros(DIM, np.float32)} for i in range(2)}

  def loss_fn(p, x):
    for i in range(2):
      x = jnp.tanh(x @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])
    return jnp.mean(x ** 2)
  return params, loss_fn


@pytest.fixture
def pool():
  with jcxl.Pool(host="64MiB", cxl="64MiB") as p:
    yield p


@pytest.fixture
def planned(monkeypatch):
  """The plans the step's analyses made, and how often each update was
  lowered."""
  plans, lowered = [], []
  real_plan, real_lower = analysis.plan_host_updates, lower.lower

  def spy_plan(*args, **kwargs):
    plans.append(real_plan(*args, **kwargs))
    return plans[-1]

  def spy_lower(node, program):
    lowered.append(node)
    return real_lower(node, program)
  monkeypatch.setattr(analysis, "plan_host_updates", spy_plan)
  monkeypatch.setattr(lower, "lower", spy_lower)
  return plans, lowered


def _train(pool, update, data, **offload):
  params, loss_fn = _mlp()
  tx = optax.adam(1e-2)
  step = jcxl.cxl_offload(make_train_step(loss_fn, tx), update=update,
                          **offload)
  p = jcxl.place(params, "host", pool=pool)
  s = jcxl.place(tx.init(params), "host", pool=pool)
  losses = []
  for x in data:
    p, s, loss = step(p, s, x)
    losses.append(float(loss))
  return step, losses, jcxl.gather(p)


class HostUpdatePlanTest:

  def test_records_are_frozen_and_each_layer_has_a_choice(self, pool,
                                                          planned):
    plans, _ = planned
    x = np.ones((4, DIM), np.float32)
    _train(pool, "host", [x])
    plan = plans[-1]
    assert isinstance(plan, plan_lib.HostUpdatePlan)
    layers = {"['layer0']", "['layer1']"}
    assert plan.nodes and {n.layer for n in plan.nodes} == layers
    for layer in layers:
      assert plan.choices[layer] == UpdateChoice(layer, UpdatePath.HOST,
                                                 "update='host'")
      assert str(plan.choices[layer]) == "host: update='host'"
    # adam's step count: one element, updated in the step.
    assert plan.choices["[0].count"].path is UpdatePath.DEVICE
    node = plan.nodes[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
      node.program_id = 7
    with pytest.raises(dataclasses.FrozenInstanceError):
      plan.nodes = ()

  def test_each_update_is_lowered_once_and_registered_as_lowered(
      self, pool, planned):
    plans, lowered = planned
    rng = np.random.default_rng(1)
    data = [rng.normal(size=(4, DIM)).astype(np.float32) for _ in range(2)]
    # A second batch shape: the step is traced and planned again.
    data.append(rng.normal(size=(8, DIM)).astype(np.float32))
    step, _, _ = _train(pool, "host", data)  # (its programs live with it)
    assert len(plans) >= 2
    # Once per update found, in each analysis (not again for its cache
    # key, nor for its objects' programs).
    assert len(lowered) == sum(len(p.nodes) for p in plans)
    runs = pool.updates.stats().runs
    assert runs > 0
    first, last = plans[0].nodes, plans[-1].nodes
    # Made once per structure: the re-plan reuses the programs.
    assert [n.program_id for n in first] == [n.program_id for n in last]
    for node in last:
      handles = {k: x.local_handles[0][1] for k, x in node.staging.items()}
      copies = {c.source: c.copy.local_handles[0][1] for c in node.copies}
      registered = pool.updates.program(node.program_id)
      assert registered == lower.for_device(node, None, handles, copies)
      # The stand-ins are gone: every object handle is a real one.
      assert all(i.handle >= 0 for i in registered.inputs
                 if i.kind == jcxl.experimental.updates.InputKind.OBJECT)
      assert all(o.handle >= 0 for o in registered.outputs)
    del step

  def test_device_reasons_join_the_choices_by_name(self):
    host = UpdateChoice("a", UpdatePath.HOST, "cheaper")
    device = UpdateChoice("b", UpdatePath.DEVICE, "dearer")
    got = choose.with_device_reasons(
        {"a": host, "b": device}, {"a": "a norm", "b": "a norm",
                                   "c": "update='device'"})
    assert got["a"] == UpdateChoice(
        "a", UpdatePath.MIXED, "cheaper; the others on the device: a norm")
    assert got["b"] == UpdateChoice(
        "b", UpdatePath.DEVICE, "a norm; the others by cost: dearer")
    assert got["c"] == UpdateChoice("c", UpdatePath.DEVICE,
                                    "update='device'")
    assert str(got["a"]).startswith("mixed: cheaper")
    assert set(choose.no_room(got)) == {"a", "b", "c"}

  def test_host_update_matches_the_device_update(self, pool):
    rng = np.random.default_rng(2)
    data = [rng.normal(size=(4, DIM)).astype(np.float32) for _ in range(3)]
    _, dev_losses, dev_p = _train(pool, "device", data)
    step, losses, p = _train(pool, "host", data)
    np.testing.assert_allclose(losses, dev_losses, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(dev_p)):
      np.testing.assert_allclose(a, b, rtol=0,
                                 atol=1e-6 * max(np.abs(b).max(), 1e-30))
    paths = {l.name: l.update for l in step.plan.layers}
    assert paths["['layer0']"] == paths["['layer1']"] == "host"
    assert paths["[0].count"] == "device"  # adam's step count
