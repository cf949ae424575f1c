"""cxl_offload(update='host') keeps each layer's weights on the device from
their forward to their backward use where device_budget holds them (those
nearest the loss first), refetches the others, and says which in its plan."""

from __future__ import annotations

from experiments.common import make_train_step
import jax
import jax.numpy as jnp
import jcxl
from jcxl._src.offload import step as step_lib
from jcxl._src.schedules import costmodel
from jcxl._src.schedules import model as model_lib
import numpy as np
import optax
import pytest

DIM, LAYERS, BATCH, STEPS = 32, 4, 8, 3
# Bytes of one layer's weight matrix: what keeping it costs, and what its
# second fetch moves (its bias has no backward use: no refetch).
LAYER_BYTES = DIM * DIM * 4
# The device need of the stand-in device below, kept weights aside.
BASE = 1 << 20


def mlp():
  rng = np.random.default_rng(0)
  params = {f"layer{i}": {
      "w": (rng.normal(size=(DIM, DIM)) * 0.3).astype(np.float32),
      "b": np.zeros(DIM, np.float32)} for i in range(LAYERS)}

  def loss_fn(p, x):
    h = x
    for i in range(LAYERS):
      h = jnp.tanh(h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])
    return jnp.mean((h - 0.5) ** 2)
  return params, loss_fn


# A model whose weights outweigh its activations, for the device memory
# that refetching frees on the real (XLA:CPU) step.
WIDE, WIDE_LAYERS = 256, 8
WIDE_BYTES = WIDE * WIDE * 4


def wide_mlp():
  rng = np.random.default_rng(0)
  params = {f"layer{i}": (rng.normal(size=(WIDE, WIDE)) * 0.05).astype(
      np.float32) for i in range(WIDE_LAYERS)}

  def loss_fn(p, x):
    h = x
    for i in range(WIDE_LAYERS):
      h = jnp.tanh(h @ p[f"layer{i}"])
    return jnp.mean(h ** 2)
  return params, loss_fn


def batches(n):
  rng = np.random.default_rng(1)
  return [rng.normal(size=(BATCH, DIM)).astype(np.float32) for _ in range(n)]


def assert_close(a, b, rtol=1e-6):
  """Each leaf within `rtol` of the other's largest magnitude."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    np.testing.assert_allclose(x, y, rtol=0,
                               atol=rtol * max(np.abs(y).max(), 1e-30))


@pytest.fixture
def pool():
  with jcxl.Pool(host="64MiB", cxl="256MiB") as p:
    yield p


@pytest.fixture
def kept_weights_cost_their_bytes(monkeypatch):
  """A device on which the step needs BASE bytes and each kept layer's
  weights (at this model's size XLA:CPU's own need moves by less than its
  allocator's rounding). Gives
  ``use(step)``: the step whose plans it reads, and the needs it gave."""
  needs = []
  steps = []

  def need(memory_analysis):
    del memory_analysis
    plan = steps[0]._plan  # the plan of the compile being checked
    needs.append(BASE + sum(l.keep_bytes for l in plan.layers
                            if l.refetch == "kept"))
    return needs[-1]
  monkeypatch.setattr(step_lib, "device_need", need)
  return lambda step: steps.append(step) or needs


def run(pool, watch=lambda step: None, **offload):
  """STEPS steps under jax.jit and under cxl_offload(update='host'),
  compared (`watch` sees the step first); the step, the number of
  parameters, and the bytes its last step read from and wrote to the
  pool."""
  params, loss_fn = mlp()
  tx = optax.adamw(1e-2)
  train_step = make_train_step(loss_fn, tx)
  step = jcxl.cxl_offload(train_step, update="host", **offload)
  ref = (params, tx.init(params))
  placed = (jcxl.place(ref[0], "cxl", pool=pool),
            jcxl.place(ref[1], "cxl", pool=pool))
  watch(step)
  for x in batches(STEPS):
    *ref, ref_loss = jax.jit(train_step)(*ref, x)
    before = pool.stats()["cxl"]
    *placed, loss = step(*placed, x)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    after = pool.stats()["cxl"]
  assert_close(jcxl.gather(tuple(placed)), tuple(ref))
  n = sum(x.size for x in jax.tree.leaves(params))
  return (step, n, after.bytes_read - before.bytes_read,
          after.bytes_written - before.bytes_written)


def refetch_of(step):
  """Per layer of the model (not adamw's step count): kept or refetched."""
  return {l.name: l.refetch for l in step.plan.layers
          if l.name.startswith("['layer")}


class DefaultTest:

  def test_no_budget_keeps_every_layer_at_8_bytes_a_parameter(self, pool):
    step, n, read, written = run(pool)
    # The first layer's weights have no backward use (no gradient flows
    # to the input): nothing to keep or refetch.
    assert refetch_of(step) == {"['layer0']": "",
                                **{f"['layer{i}']": "kept"
                                   for i in range(1, LAYERS)}}
    assert [step.plan.layer(f"['layer{i}']").keep_bytes
            for i in range(LAYERS)] == [0] + [LAYER_BYTES] * (LAYERS - 1)
    # Weights in once, gradients out; and adamw's step count, each way.
    assert (read, written) == (4 * n + 4, 4 * n + 4)
    assert any(u.startswith("refetch=False: each weight is kept")
               for u in step.plan.updates), step.plan.updates
    assert "kept" in step.plan.table()

  def test_budget_between_keeps_the_layers_nearest_the_loss(
      self, pool, kept_weights_cost_their_bytes):
    # Room for two layers' kept weights, not three.
    budget = BASE + 2 * LAYER_BYTES + LAYER_BYTES // 2
    step, n, read, written = run(pool, kept_weights_cost_their_bytes,
                                 device_budget=budget)
    assert refetch_of(step) == {"['layer0']": "", "['layer1']": "refetched",
                                "['layer2']": "kept", "['layer3']": "kept"}
    # All kept, over the budget; then the two nearest the loss, within it.
    needs = kept_weights_cost_their_bytes(step)
    assert needs == [BASE + 3 * LAYER_BYTES, BASE + 2 * LAYER_BYTES]
    assert step.compiles == 2
    # The refetched layer's weight comes in twice: 8 to 12 B/param.
    assert read == 4 * n + 4 + LAYER_BYTES and written == 4 * n + 4
    line = next(u for u in step.plan.updates if u.startswith("refetch"))
    assert line.startswith(
        "refetch per layer: kept nearest the loss ['layer2'], ['layer3'] "
        "(8.00 KiB), refetched ['layer1'] (4.00 KiB): keeping each weight "
        "from its forward to its backward use would need 1.01 MiB"), line
    assert "over device_budget (1.01 MiB)" in line
    # The real step, too, is within the budget.
    params, _ = mlp()
    assert costmodel.device_need(step.compile(
        jcxl.place(params, "cxl", pool=pool),
        jcxl.place(optax.adamw(1e-2).init(params), "cxl", pool=pool),
        batches(1)[0]).memory_analysis()) <= budget

  def test_budget_for_none_refetches_every_layer(
      self, pool, kept_weights_cost_their_bytes):
    step, n, read, written = run(pool, kept_weights_cost_their_bytes,
                                 device_budget=BASE + LAYER_BYTES // 2)
    assert set(refetch_of(step).values()) == {"", "refetched"}
    assert read == 4 * n + 4 + (LAYERS - 1) * LAYER_BYTES
    assert written == 4 * n + 4
    assert any(u.startswith("refetch=True: keeping each weight")
               for u in step.plan.updates), step.plan.updates

  def test_refetched_weights_free_their_device_memory(self, pool):
    # The compiled step itself (no stand-in device): with every weight
    # refetched, the weights kept from forward to backward are gone from
    # its need. (A read-after ordering that held each fetched buffer until
    # the update once kept them all, refetched or not.)
    params, loss_fn = wide_mlp()
    placed = (jcxl.place(params, "cxl", pool=pool),
              jcxl.place(optax.adamw(1e-2).init(params), "cxl", pool=pool))
    x = np.ones((BATCH, WIDE), np.float32)
    need = {refetch: costmodel.device_need(jcxl.cxl_offload(
        make_train_step(loss_fn, optax.adamw(1e-2)), update="host",
        refetch=refetch).compile(*placed, x).memory_analysis())
            for refetch in (False, True)}
    # Kept: the WIDE_LAYERS - 1 weights with a backward use live at once.
    # Refetched: a few at a time (in use, and the next ones in flight).
    assert need[True] <= need[False] - (WIDE_LAYERS - 4) * WIDE_BYTES, need

  def test_where_refetching_every_layer_is_over_the_budget_it_raises(
      self, pool):
    params, _ = mlp()
    placed = (jcxl.place(params, "cxl", pool=pool),
              jcxl.place(optax.adamw(1e-2).init(params), "cxl", pool=pool))
    x = batches(1)[0]
    all_refetched = costmodel.device_need(jcxl.cxl_offload(
        make_train_step(mlp()[1], optax.adamw(1e-2)), update="host",
        refetch=True).compile(*placed, x).memory_analysis())
    # Half of it: below the step with any choice of weights kept.
    tight = jcxl.cxl_offload(
        make_train_step(mlp()[1], optax.adamw(1e-2)), update="host",
        device_budget=all_refetched // 2)
    with pytest.raises(MemoryError, match="but device_budget is"):
      tight(*placed, x)
    # All kept; over by more than the kept weights' bytes, all refetched;
    # then the error.
    assert tight.compiles == 2


class OverrideTest:

  def test_refetch_true_refetches_every_layer(self, pool):
    step, n, read, written = run(pool, refetch=True)
    assert set(refetch_of(step).values()) == {"", "refetched"}
    assert read == 4 * n + 4 + (LAYERS - 1) * LAYER_BYTES
    assert written == 4 * n + 4
    assert "refetch=True: as given (refetch=True)" in step.plan.updates

  def test_refetch_false_over_the_budget_is_the_budget_error(self, pool):
    params, loss_fn = mlp()
    placed = (jcxl.place(params, "cxl", pool=pool),
              jcxl.place(optax.adamw(1e-2).init(params), "cxl", pool=pool))
    make = lambda **kw: jcxl.cxl_offload(
        make_train_step(loss_fn, optax.adamw(1e-2)), update="host",
        refetch=False, **kw)
    need = costmodel.device_need(make().compile(
        *placed, batches(1)[0]).memory_analysis())
    step = make(device_budget=need - 1)
    with pytest.raises(MemoryError, match="but device_budget is"):
      step(*placed, batches(1)[0])
    assert step.compiles == 1  # as given: not moved off by the budget


class CostModelTest:

  def test_timeline_fetches_each_refetched_layer_twice(
      self, pool, kept_weights_cost_their_bytes):
    budget = BASE + 2 * LAYER_BYTES + LAYER_BYTES // 2
    step, n, read, _ = run(pool, kept_weights_cost_their_bytes,
                           device_budget=budget)
    # The cost model's fetches are the step's, kept and refetched alike.
    segments = step._segments
    assert sum(s.nbytes for s in segments) == read
    assert [s.name for s in segments if s.name == "['layer1']"] == [
        "['layer1']"] * 2
    assert [s.name for s in segments if s.name == "['layer3']"] == [
        "['layer3']"]

  def test_dap_plans_on_the_fetches_of_the_layers_as_kept(
      self, pool, kept_weights_cost_their_bytes):
    budget = BASE + 2 * LAYER_BYTES + LAYER_BYTES // 2
    step, n, read, _ = run(pool, kept_weights_cost_their_bytes,
                           device_budget=budget, schedule="dap")
    assert refetch_of(step)["['layer1']"] == "refetched"
    # Its first trace kept every layer: the model has the later one's.
    segments = step.tuner.model.segments
    assert sum(s.nbytes for s in segments) == read
    assert [s.name for s in segments].count("['layer1']") == 2

  def test_step_model_takes_a_new_timeline_when_told(self):
    link = {"cxl": costmodel.Link(1e9)}
    seg = lambda name, nbytes: costmodel.Segment(name, nbytes, "cxl", 1e-3)
    model = model_lib.StepModel()
    model.estimate([seg("a", 10), seg("b", 10)], link)
    # Estimates of the same fetches do not undo what was measured.
    model.segments[0] = costmodel.Segment("a", 10, "cxl", 5e-3)
    model.estimate([seg("a", 10), seg("b", 10)], link)
    assert model.segments[0].compute_s == 5e-3
    # a refetched for its backward use: one more fetch.
    model.new_timeline()
    model.estimate([seg("a", 10), seg("b", 10), seg("a", 10)], link)
    assert [s.name for s in model.segments] == ["a", "b", "a"]


class AutoTest:

  def test_auto_keeps_the_layers_it_updates_on_the_host(self, pool):
    params, loss_fn = mlp()
    tx = optax.adamw(1e-2)
    train_step = make_train_step(loss_fn, tx)
    step = jcxl.cxl_offload(train_step, update="auto")
    ref = (params, tx.init(params))
    placed = (jcxl.place(ref[0], "cxl", pool=pool),
              jcxl.place(ref[1], "cxl", pool=pool))
    for x in batches(2):
      *ref, ref_loss = jax.jit(train_step)(*ref, x)
      *placed, loss = step(*placed, x)
      np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert_close(jcxl.gather(tuple(placed)), tuple(ref))
    # Whichever path each layer's update takes (by measured rates): a
    # host-updated layer's weights are kept, a device-updated one's not
    # (its update fetches them again anyway).
    for l in step.plan.layers:
      if l.keep_bytes:
        assert l.refetch == ("kept" if l.update == "host" else "refetched"), l
