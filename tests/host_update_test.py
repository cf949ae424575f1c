"""cxl_offload(update='host'|'auto'): the optimizer update next to the
memory, equal to the device update, moving less."""

from __future__ import annotations

import json

from absl import app
from absl import flags
from absl.testing import flagsaver
from experiments import host_update
from experiments.common import make_train_step as make_step
import jax
import jax.numpy as jnp
import jcxl
from jcxl._src.host_update import choose as host_update_choose
from models import common
from models import gpt2
from models import llama
import numpy as np
import optax
import pytest

DIM, LAYERS, BATCH, STEPS = 32, 3, 8, 20

OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw_masked": lambda: optax.adamw(
        1e-2, weight_decay=1e-2,
        mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
    "adamw_cosine": lambda: optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, STEPS),
        weight_decay=1e-3),
    "sgd_momentum": lambda: optax.sgd(
        optax.exponential_decay(5e-2, 5, 0.5), momentum=0.9),
    "sgd_nesterov": lambda: optax.sgd(5e-2, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(1e-3, weight_decay=1e-2),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.05),
                                      optax.adamw(1e-2)),
}


# Optimizers whose update XLA computes as traced (products contracted into
# the sums that use them, as the host update does too). Adam's divisions
# XLA rewrites (a / b / c as a / (b * c), a / s as a * (1 / s)).
BIT_EXACT = ("sgd_momentum", "sgd_nesterov", "lion")


def mlp(scan: bool):
  rng = np.random.default_rng(0)
  w = lambda *s: (rng.normal(size=s) * 0.3).astype(np.float32)
  if scan:
    params = {"blocks": {"w": w(LAYERS, DIM, DIM),
                         "b": np.zeros((LAYERS, DIM), np.float32)},
              "head": {"w": w(DIM, 4)}}
  else:
    params = {f"layer{i}": {"w": w(DIM, DIM), "b": np.zeros(DIM, np.float32)}
              for i in range(LAYERS)}
    params["head"] = {"w": w(DIM, 4)}

  def loss_fn(p, x):
    h = x
    if scan:
      h = jax.lax.scan(lambda h, l: (jnp.tanh(h @ l["w"] + l["b"]), None), h,
                       p["blocks"])[0]
    else:
      for i in range(LAYERS):
        h = jnp.tanh(h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])
    return jnp.mean((h @ p["head"]["w"] - 0.5) ** 2)
  return params, loss_fn


def _bf16_compute(loss_fn):
  """`loss_fn` computing in bfloat16 from float32 master weights."""
  def bf16_loss(p, x):
    p16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), p)
    return loss_fn(p16, x.astype(jnp.bfloat16)).astype(jnp.float32)
  return bf16_loss


def batches(n, shape=(BATCH, DIM)):
  rng = np.random.default_rng(1)
  return [rng.normal(size=shape).astype(np.float32) for _ in range(n)]


def run(pool, params, loss_fn, tx, data, update, tier="cxl", **offload):
  """Trains on `data`: the step, its losses, the final parameters and
  optimizer state (see `run_counted`)."""
  return run_counted(pool, params, loss_fn, tx, data, update, tier,
                     **offload)[:4]


def run_counted(pool, params, loss_fn, tx, data, update, tier="cxl",
                sharding=None, **offload):
  """As `run`, and the bytes the last step read from and wrote to `tier`
  (the pool's counters); `sharding(tree)`: the state's shardings."""
  step = jcxl.cxl_offload(make_step(loss_fn, tx), update=update, **offload)
  place = lambda tree: jcxl.place(tree, tier, pool=pool, sharding=(
      sharding(tree) if sharding else None))
  p, s = place(params), place(tx.init(params))
  losses = []
  for x in data:
    before = pool.stats()[tier]
    p, s, loss = step(p, s, x)
    losses.append(float(loss))  # the step (its stores and updates) is done
    after = pool.stats()[tier]
  return (step, losses, jcxl.gather(p), jcxl.gather(s),
          (after.bytes_read - before.bytes_read,
           after.bytes_written - before.bytes_written))


def assert_close(a, b, rtol=1e-6):
  """Each leaf within `rtol` of the other's largest magnitude (an element
  near zero has no relative precision to speak of)."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    np.testing.assert_allclose(x, y, rtol=0,
                               atol=rtol * max(np.abs(y).max(), 1e-30))


@pytest.fixture
def pool():
  with jcxl.Pool(host="64MiB", cxl="256MiB") as p:
    yield p


class EqualityTest:

  @pytest.mark.parametrize("name", sorted(OPTIMIZERS))
  @pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
  def test_host_update_equals_device_update(self, pool, name, scan):
    params, loss_fn = mlp(scan)
    data = batches(STEPS)
    _, dev_losses, dev_p, dev_s = run(pool, params, loss_fn,
                                      OPTIMIZERS[name](), data, "device")
    step, losses, p, s = run(pool, params, loss_fn, OPTIMIZERS[name](), data,
                             "host")
    np.testing.assert_allclose(losses, dev_losses, rtol=1e-6)
    # clip_by_global_norm's norm sums every gradient, in another order on
    # the host than in XLA's reduction (whose split depends on the CPU
    # backend): a few parts in 1e7 of the clip's scale, which adam
    # amplifies for an element of small second moment (1.07e-6 seen).
    rtol = 2e-6 if name.startswith("clip") else 1e-6
    assert_close(p, dev_p, rtol)
    assert_close(s, dev_s, rtol)
    if name in BIT_EXACT and not scan:  # XLA's operations: the same bits
      # (Scanned state's device update runs a loop over layers, whose
      # fusions XLA contracts otherwise: within the tolerance above.)
      for x, y in zip(jax.tree.leaves((p, s)), jax.tree.leaves((dev_p, dev_s))):
        np.testing.assert_array_equal(x, y)
    assert losses[-1] < losses[0]
    # The step counts (scalars) are updated in the step.
    counts = {l.name for l in step.plan.layers if l.nbytes <= 4}
    updates = {l.name: l.update for l in step.plan.layers}
    assert {updates.pop(c) for c in counts} <= {"device"}
    assert set(updates.values()) == {"host"}, step.plan

  def test_a_zoo_model_equals_the_device_update(self, pool):
    config = gpt2.tiny()
    params = jax.tree.map(np.asarray, common.init_params(config))
    loss = common.make_loss(config)
    rng = np.random.default_rng(2)
    data = [{"x": t[:, :-1], "y": t[:, 1:]} for t in
            (rng.integers(0, 256, size=(2, 33)).astype(np.int32)
             for _ in range(STEPS))]
    tx = lambda: optax.chain(optax.clip_by_global_norm(1.0),
                             optax.adamw(1e-3, weight_decay=0.1))
    _, dev_losses, dev_p, dev_s = run(pool, params, loss, tx(), data,
                                      "device")
    step, losses, p, s = run(pool, params, loss, tx(), data, "host")
    np.testing.assert_allclose(losses, dev_losses, rtol=1e-6)
    # Adam divides by the root of each gradient's square: a gradient that
    # is rounding noise (the attention's key bias: softmax ignores it) is
    # amplified to whole steps, so two compiled programs' noise (the device
    # update's and jax.jit's alike) moves such leaves apart; and XLA
    # rewrites adam's divisions (a / b / c as a / (b * c)), which the host
    # computes as written. Each leaf is as close to the device update as
    # that is to jax.jit, or within 2e-6 of its largest value.
    jitted = jax.jit(make_step(loss, tx()))
    ref = (jax.tree.map(jnp.asarray, params), tx().init(params))
    for batch in data:
      *ref, _ = jitted(*ref, batch)
    def distance(a, b):
      return [float(np.abs(np.subtract(x, y, dtype=np.float64)).max() /
                    max(np.abs(np.asarray(y)).max(), 1e-30))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    to_device = distance((p, s), (dev_p, dev_s))
    device_to_jit = distance((dev_p, dev_s), tuple(ref))
    for ours, theirs in zip(to_device, device_to_jit):
      assert ours <= max(2e-6, 3 * theirs), (ours, theirs)
    assert "host" in {l.update for l in step.plan.layers}


  def test_nvme_state_is_updated_through_staging(self, tmp_path):
    params, loss_fn = mlp(scan=False)
    data = batches(4)
    with jcxl.Pool(host="64MiB", cxl="64MiB", nvme="64MiB",
                   nvme_dir=tmp_path) as pool:
      _, dev_losses, dev_p, dev_s = run(pool, params, loss_fn,
                                        optax.adamw(1e-2), data, "device",
                                        tier="nvme")
      step, losses, p, s = run(pool, params, loss_fn, optax.adamw(1e-2),
                               data, "host", tier="nvme")
    np.testing.assert_allclose(losses, dev_losses, rtol=1e-6)
    assert_close(p, dev_p)
    assert_close(s, dev_s)
    assert "host" in {l.update for l in step.plan.layers}


class TrafficTest:

  def test_only_gradients_leave_the_device(self, pool):
    params, loss_fn = mlp(scan=False)
    n = sum(x.size for x in jax.tree.leaves(params))
    moved = {update: run_counted(pool, params, loss_fn, optax.adamw(1e-2),
                                 batches(2), update)[4]
             for update in ("device", "host")}
    # The host update writes only gradients out: 4 bytes per parameter
    # (and adamw's step count, a scalar updated in the step).
    assert moved["host"][1] == 4 * n + 4
    # The device update writes weights and both moments back.
    assert moved["device"][1] == 12 * n + 4
    # Neither moment comes in on the host path.
    assert moved["host"][0] <= moved["device"][0] - 8 * n

  @pytest.mark.parametrize("compute,refetch,moved", [
      # The cast of each gradient to float32 runs on the host: 2 bytes out.
      ("bfloat16", True, (None, 2)),
      # Weights in once (and the step count), gradients out.
      ("float32", False, (4, 4)),
      # bfloat16 copies of the weights in, bfloat16 gradients out.
      ("bfloat16", False, (2, 2)),
  ])
  def test_bytes_a_parameter(self, pool, compute, refetch, moved):
    params, loss_fn = mlp(scan=False)
    if compute == "bfloat16":
      loss_fn = _bf16_compute(loss_fn)
    n = sum(x.size for x in jax.tree.leaves(params))
    data = batches(3)
    _, dev_losses, dev_p, _ = run(pool, params, loss_fn, optax.adamw(1e-2),
                                  data, "device")
    step, losses, p, _, (read, written) = run_counted(
        pool, params, loss_fn, optax.adamw(1e-2), data, "host",
        refetch=refetch)
    if moved[0] is not None:
      assert read == moved[0] * n + 4  # and the step count
    assert written == moved[1] * n + 4
    copies = [u for u in step.plan.updates if u.startswith("weight copies")]
    assert copies == ([] if compute == "float32" else [
        "weight copies: 7 float32 weights fetched as bfloat16 copies the "
        "host update writes (6.44 KiB less per fetch)"])
    np.testing.assert_allclose(losses, dev_losses, rtol=1e-6)
    assert_close(p, dev_p)

  def test_refetch_must_be_a_bool(self):
    with pytest.raises(TypeError, match="refetch must be True or False"):
      jcxl.cxl_offload(lambda x: x, refetch="no")


class ChoicesTest:

  def test_auto_explains_each_layer_and_matches(self, pool):
    params, loss_fn = mlp(scan=False)
    data = batches(4)
    _, dev_losses, dev_p, _ = run(pool, params, loss_fn, optax.adam(1e-2),
                                  data, "device")
    step, losses, p, _ = run(pool, params, loss_fn, optax.adam(1e-2), data,
                             "auto")
    np.testing.assert_allclose(losses, dev_losses, rtol=1e-6)
    assert_close(p, dev_p)
    text = str(step.plan)
    assert "updates:" in text
    for layer in step.plan.layers:
      assert layer.update in ("host", "device")
      assert any(u.startswith(f"{layer.name}: {layer.update}")
                 for u in step.plan.updates), text

  def test_a_norm_of_the_leaf_is_refused_on_the_host_by_name(self, pool):
    params, loss_fn = mlp(scan=False)
    with pytest.raises(ValueError, match="scale_by_trust_ratio"):
      run(pool, params, loss_fn, optax.lamb(1e-3), batches(1), "host")

  def test_auto_keeps_what_the_host_cannot_run_on_the_device(self, pool):
    params, loss_fn = mlp(scan=False)
    data = batches(3)
    _, dev_losses, _, _ = run(pool, params, loss_fn, optax.lamb(1e-3), data,
                              "device")
    step, losses, _, _ = run(pool, params, loss_fn, optax.lamb(1e-3), data,
                             "auto")
    np.testing.assert_allclose(losses, dev_losses, rtol=1e-6)
    # The moments need a norm of the leaf: on the device. (The weights
    # may take their device-computed update on the host.)
    assert {l.update for l in step.plan.layers} <= {"device", "mixed"}
    assert "scale_by_trust_ratio" in str(step.plan)

  def test_state_sharded_over_devices_stays_on_the_device(self, pool):
    params, loss_fn = mlp(scan=False)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    rows = lambda tree: jax.tree.map(  # rows over the two (a scalar: both)
        lambda a: jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(*("x",)[:np.ndim(a)])), tree)
    tx = optax.adam(1e-2)
    data = batches(3)
    with pytest.raises(ValueError, match=r"update='host' cannot run the "
                       r"update of .* its state is sharded over 2 devices"):
      run(pool, params, loss_fn, tx, data, "host", sharding=rows)
    step, losses, _, _ = run(pool, params, loss_fn, tx, data, "auto",
                             sharding=rows)
    _, dev_losses, _, _ = run(pool, params, loss_fn, tx, data, "device")
    np.testing.assert_allclose(losses, dev_losses, rtol=1e-6)
    assert {l.update for l in step.plan.layers} == {"device"}
    assert "sharded over 2 devices" in str(step.plan)

  def test_an_unknown_update_is_refused(self):
    with pytest.raises(ValueError, match="update must be one of"):
      jcxl.cxl_offload(lambda x: x, update="cpu")


def _host_preferred(monkeypatch):
  """'auto' then runs every update on the host that the host can run."""
  monkeypatch.setattr(host_update_choose, "measured_rates", lambda pool_id: (
      host_update_choose.Rates(host_update=1e15, device_update=1.0)))


class NothingSilentlyWrongTest:
  """'host' and 'auto' either give the device update's state or refuse by
  name; planning needs no room in the user's tiers."""

  def test_auto_writes_back_a_moment_the_device_computes(self, pool,
                                                         monkeypatch):
    # novograd's moment comes from a lax.cond on the device, and its
    # weight's update reads the new moment: that update must not take
    # the moment's store (which left the moment at its initial zeros).
    _host_preferred(monkeypatch)
    params, loss_fn = mlp(scan=False)
    data = batches(3)
    _, dev_losses, dev_p, dev_s = run(pool, params, loss_fn,
                                      optax.novograd(1e-2), data, "device")
    _, losses, p, s = run(pool, params, loss_fn, optax.novograd(1e-2), data,
                          "auto")
    np.testing.assert_allclose(losses, dev_losses, rtol=1e-6)
    assert_close(p, dev_p)
    assert_close(s, dev_s)
    assert np.abs(s[0].mu["layer0"]["w"]).max() > 0
    with pytest.raises(ValueError, match=r"update of \[.*reads the "
                       r"new value of \[0\].mu.*optax.scale_by_novograd"):
      run(pool, params, loss_fn, optax.novograd(1e-2), data, "host")

  @pytest.mark.parametrize("update", ["host", "auto"])
  def test_hyperparameters_in_the_state(self, pool, monkeypatch, update):
    # inject_hyperparams keeps the learning rate as a scalar in the state,
    # so in the pool: each host update gets it as a scalar argument.
    _host_preferred(monkeypatch)
    params, loss_fn = mlp(scan=False)
    tx = lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2)
    data = batches(3)
    _, dev_losses, dev_p, dev_s = run(pool, params, loss_fn, tx(), data,
                                      "device")
    step, losses, p, s = run(pool, params, loss_fn, tx(), data, update)
    np.testing.assert_allclose(losses, dev_losses, rtol=1e-6)
    assert_close(p, dev_p)
    assert_close(s, dev_s)
    assert "host" in {l.update for l in step.plan.layers}

  def test_a_returned_new_weight_keeps_its_update_on_the_device(
      self, pool, monkeypatch):
    _host_preferred(monkeypatch)
    params, loss_fn = mlp(scan=False)
    tx = optax.adam(1e-2)

    def step_fn(p, s, x):  # also returns a new weight, for logging
      p, s, loss = make_step(loss_fn, tx)(p, s, x)
      return p, s, (loss, p["layer1"]["w"])

    def train(update):
      step = jcxl.cxl_offload(step_fn, update=update)
      p = jcxl.place(params, "cxl", pool=pool)
      s = jcxl.place(tx.init(params), "cxl", pool=pool)
      for x in batches(3):
        p, s, (loss, w) = step(p, s, x)
      return step, float(loss), np.asarray(w), jcxl.gather(p)

    _, dev_loss, dev_w, dev_p = train("device")
    step, loss, w, p = train("auto")
    np.testing.assert_allclose(loss, dev_loss, rtol=1e-6)
    np.testing.assert_array_equal(w, p["layer1"]["w"])
    assert_close(p, dev_p)
    paths = {l.name: l.update for l in step.plan.layers}
    assert paths["['layer1']"] in ("device", "mixed")
    assert paths["['layer0']"] == "host"
    with pytest.raises(ValueError, match=r"update of \['layer1'\]\['w'\] "
                       "on the host: a value its update computes is also "
                       "returned by the step"):
      train("host")

  @pytest.mark.parametrize("update", ["device", "host", "auto"])
  def test_one_value_written_into_two_leaves(self, pool, update):
    # Each leaf gets it (one was left as it was).
    def step_fn(a, b, x):
      g = jax.grad(lambda w: jnp.sum(jnp.tanh(w * x)))(a["w"])
      new = {"w": a["w"] - 0.1 * g}
      return new, new

    a0 = {"w": np.ones((8, 8), np.float32)}
    b0 = {"w": np.zeros((8, 8), np.float32)}
    want = jax.jit(step_fn)(a0, b0, 2.0)
    a, b = jcxl.cxl_offload(step_fn, update=update)(
        jcxl.place(a0, "cxl", pool=pool), jcxl.place(b0, "cxl", pool=pool),
        2.0)
    for got, ref in ((a, want[0]), (b, want[1])):
      if update == "device":
        np.testing.assert_array_equal(jcxl.gather(got)["w"], ref["w"])
      else:
        assert_close(jcxl.gather(got), ref)

  def test_a_program_the_pool_would_refuse_stays_on_the_device(
      self, pool, monkeypatch):
    # (As one past the pool's register limit would be.)
    _host_preferred(monkeypatch)

    def refuse(program):
      raise ValueError("update program: has 20000 registers")
    monkeypatch.setattr(jcxl.experimental.updates.Program, "validate", refuse)
    params, loss_fn = mlp(scan=False)
    data = batches(2)
    with pytest.raises(ValueError, match=r"cannot run the update of .* the "
                       r"host cannot run its program \(update program: has "
                       "20000 registers"):
      run(pool, params, loss_fn, optax.adam(1e-2), data, "host")
    step, losses, p, _ = run(pool, params, loss_fn, optax.adam(1e-2), data,
                             "auto")
    _, dev_losses, dev_p, _ = run(pool, params, loss_fn, optax.adam(1e-2),
                                  data, "device")
    assert {l.update for l in step.plan.layers} == {"device"}
    np.testing.assert_array_equal(losses, dev_losses)
    assert_close(p, dev_p, rtol=0)

  def test_auto_with_no_room_for_the_gradients_runs_on_the_device(self):
    params, loss_fn = mlp(scan=False)
    data = batches(2)
    tx = optax.adam(1e-2)
    ref = jax.jit(make_step(loss_fn, tx))
    ref_p, ref_s = params, tx.init(params)
    for x in data:
      ref_p, ref_s, ref_loss = ref(ref_p, ref_s, x)
    with jcxl.Pool(host="16MiB", cxl="16MiB") as pool:
      p = jcxl.place(params, "cxl", pool=pool)
      s = jcxl.place(tx.init(params), "cxl", pool=pool)
      fillers = [pool.allocate((pool.stats()["cxl"].free,), np.uint8,
                               "cxl")]
      for leaf in jax.tree.leaves(params):  # and the slabs' free slots
        while True:
          try:
            fillers.append(pool.allocate(leaf.shape, leaf.dtype, "cxl"))
          except jcxl.PoolExhaustedError:
            break
      step = jcxl.cxl_offload(make_step(loss_fn, tx), update="auto")
      for x in data:
        p, s, loss = step(p, s, x)
      assert {l.update for l in step.plan.layers} == {"device"}
      assert "no room for the host update's gradients" in str(step.plan)
      np.testing.assert_array_equal(loss, ref_loss)
      assert_close(jcxl.gather(p), ref_p, rtol=0)
      for h in fillers:
        pool.free(h)

  def test_auto_measures_without_room_in_the_pool(self):
    # The host tier has less than the 64 MiB the host update's rate is
    # measured on: nothing of it is needed, nothing is left in it.
    params, loss_fn = mlp(scan=False)
    with jcxl.Pool(host="64MiB", cxl="64MiB") as pool:
      filler = pool.allocate((40 << 20,), np.uint8, "host")
      host_objects = lambda: {h for h in pool.handles()
                              if pool.info(h).tier.value == "host"}
      before = host_objects()
      _, losses, p, _ = run(pool, params, loss_fn, optax.adam(1e-2),
                            batches(2), "auto")
      assert host_objects() == before
      pool.free(filler)
      _, dev_losses, dev_p, _ = run(pool, params, loss_fn,
                                    optax.adam(1e-2), batches(2), "device")
    np.testing.assert_allclose(losses, dev_losses, rtol=1e-6)
    assert_close(p, dev_p)

  @pytest.mark.parametrize("update", ["device", "auto"])
  def test_a_full_fast_tier_is_planned(self, update):
    # The state fills the host tier (as tiers_by_reads places it): the
    # tier's link is measured without storing a probe in it.
    params, loss_fn = mlp(scan=False)
    data = batches(2)
    with jcxl.Pool(host="16MiB", cxl="64MiB") as pool:
      ref = jax.jit(make_step(loss_fn, optax.adam(1e-2)))
      ref_p, ref_s = params, optax.adam(1e-2).init(params)
      for x in data:
        ref_p, ref_s, ref_loss = ref(ref_p, ref_s, x)
      filler = pool.allocate((pool.stats()["host"].free - (1 << 20),),
                             np.uint8, "host")
      _, losses, p, _ = run(pool, params, loss_fn, optax.adam(1e-2), data,
                            update, tier="host")
      pool.free(filler)
    np.testing.assert_allclose(losses[-1], ref_loss, rtol=1e-6)
    assert_close(p, ref_p)

  def test_state_made_in_the_fast_tier_by_reads(self):
    # docs/scale.md's recipe, with a host tier smaller than a link probe.
    params, loss_fn = mlp(scan=False)
    tx = optax.adamw(1e-2)
    data = batches(2)
    ref = jax.jit(make_step(loss_fn, tx))
    ref_p, ref_s = params, tx.init(params)
    for x in data:
      ref_p, ref_s, ref_loss = ref(ref_p, ref_s, x)
    with jcxl.Pool(host="4MiB", cxl="64MiB") as pool:
      shapes = jax.eval_shape(lambda: params)
      param_kinds, opt_kinds = jcxl.tiers_by_reads(
          [(shapes, 3), (jax.eval_shape(tx.init, shapes), 1)], pool)
      p = jcxl.init_in_pool(lambda: params, pool=pool, kinds=param_kinds)
      s = jcxl.init_in_pool(tx.init, p, pool=pool, kinds=opt_kinds)
      assert pool.stats()["host"].live > 0
      step = jcxl.cxl_offload(make_step(loss_fn, tx))
      for x in data:
        p, s, loss = step(p, s, x)
      np.testing.assert_array_equal(loss, ref_loss)
      assert_close(jcxl.gather(p), ref_p, rtol=0)


class WithOtherPartsTest:

  def test_dap_with_the_host_update(self, pool):
    params, loss_fn = mlp(scan=False)
    data = batches(6)
    _, dev_losses, dev_p, _ = run(pool, params, loss_fn, optax.adamw(1e-2),
                                  data, "device")
    _, losses, p, _ = run(pool, params, loss_fn, optax.adamw(1e-2), data,
                          "host", schedule="dap")
    np.testing.assert_allclose(losses, dev_losses, rtol=1e-6)
    assert_close(p, dev_p)

  @pytest.mark.parametrize("first,second", [("host", "device"),
                                            ("device", "host")])
  def test_a_checkpoint_resumes_under_the_other_path(self, pool, tmp_path,
                                                     first, second):
    params, loss_fn = mlp(scan=False)
    tx = optax.adamw(1e-2)
    data = batches(6)
    _, losses, ref_p, _ = run(pool, params, loss_fn, tx, data, "device")
    step = jcxl.cxl_offload(make_step(loss_fn, tx), update=first)
    p = jcxl.place(params, "cxl", pool=pool)
    s = jcxl.place(tx.init(params), "cxl", pool=pool)
    for x in data[:3]:
      p, s, _ = step(p, s, x)
    path = jcxl.checkpoint.save(tmp_path / "ckpt", {"p": p, "s": s})
    restored = jcxl.checkpoint.restore(path, like={"p": p, "s": s})
    p, s = restored["p"], restored["s"]
    step = jcxl.cxl_offload(make_step(loss_fn, tx), update=second)
    resumed = []
    for x in data[3:]:
      p, s, loss = step(p, s, x)
      resumed.append(float(loss))
    np.testing.assert_allclose(resumed, losses[3:], rtol=1e-6)
    assert_close(jcxl.gather(p), ref_p)


class WeightCopiesTest:
  """bfloat16 copies of float32 master weights: the same bits as the cast
  they replace, kept fresh whatever writes the master."""

  @pytest.mark.parametrize("tier", ["cxl", "nvme"])
  def test_copies_compute_the_device_update_bit_for_bit(self, tier):
    params, loss_fn = mlp(scan=False)
    bf16_loss = _bf16_compute(loss_fn)
    tx = lambda: optax.sgd(5e-2, momentum=0.9)
    data = batches(STEPS)
    with jcxl.Pool(host="64MiB", cxl="64MiB", nvme="64MiB") as pool:
      _, dev_losses, dev_p, dev_s = run(pool, params, bf16_loss, tx(), data,
                                        "device", tier=tier)
      step, losses, p, s = run(pool, params, bf16_loss, tx(), data, "host",
                               tier=tier)
    assert any(u.startswith("weight copies: 7 ") for u in step.plan.updates)
    assert losses == dev_losses
    for x, y in zip(jax.tree.leaves((p, s)), jax.tree.leaves((dev_p, dev_s))):
      np.testing.assert_array_equal(x, y)

  def test_a_scanned_stack_moves_four_bytes_a_parameter(self, pool):
    model = llama.tiny(scan_layers=True, dtype=jnp.bfloat16)
    params = jax.tree.map(np.asarray, common.init_params(model))
    n = sum(x.size for x in jax.tree.leaves(params))
    loss_fn = common.make_loss(model)
    data = [jax.tree.map(np.asarray, llama.example_batch(model, seed=i))
            for i in range(4)]
    tx = lambda: optax.sgd(1e-2, momentum=0.9)
    _, dev_losses, dev_p, _ = run(pool, params, loss_fn, tx(), data,
                                  "device", refetch=False)
    step, losses, p, _, (read, written) = run_counted(
        pool, params, loss_fn, tx(), data, "host", refetch=False)
    # Every weight, the stacked blocks' included, comes in as bfloat16;
    # every gradient leaves so (the loop's casts to float32 moved after it,
    # onto the host).
    assert any(u.startswith(f"weight copies: {len(jax.tree.leaves(params))} ")
               for u in step.plan.updates)
    assert (read, written) == (2 * n, 2 * n)
    assert losses == dev_losses
    for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(dev_p)):
      np.testing.assert_array_equal(x, y)

  def test_a_master_written_elsewhere_is_what_the_step_reads(self, pool,
                                                             tmp_path):
    params, loss_fn = mlp(scan=False)
    bf16_loss = _bf16_compute(loss_fn)
    tx = optax.adamw(1e-2)
    data = batches(6)
    step = jcxl.cxl_offload(make_step(bf16_loss, tx), update="host")
    p = jcxl.place(params, "cxl", pool=pool)
    s = jcxl.place(tx.init(params), "cxl", pool=pool)
    for x in data[:3]:
      p, s, _ = step(p, s, x)
    path = jcxl.checkpoint.save(tmp_path / "ckpt", {"p": p, "s": s})
    first = []
    for x in data[3:]:
      p, s, loss = step(p, s, x)
      first.append(float(loss))
    # The masters go back three steps; their copies hold the newer weights
    # until read.
    jcxl.checkpoint.restore_into(path, {"p": p, "s": s})
    again = []
    for x in data[3:]:
      p, s, loss = step(p, s, x)
      again.append(float(loss))
    assert again == first
    # And a step with its update on the device writes the masters too.
    device_step = jcxl.cxl_offload(make_step(bf16_loss, tx))
    jcxl.checkpoint.restore_into(path, {"p": p, "s": s})
    p, s, loss = device_step(p, s, data[3])
    p, s, loss = step(p, s, data[4])
    ref = jcxl.cxl_offload(make_step(bf16_loss, tx), update="host")
    q, t = jcxl.checkpoint.restore(path, like={"p": p, "s": s}).values()
    q, t, _ = device_step(q, t, data[3])
    np.testing.assert_allclose(float(loss), float(ref(q, t, data[4])[2]),
                               rtol=1e-6)

  def test_a_step_traced_again_reuses_its_copies(self, pool):
    params, loss_fn = mlp(scan=False)
    tx = optax.adamw(1e-2)
    step = jcxl.cxl_offload(make_step(_bf16_compute(loss_fn), tx),
                            update="host")
    p = jcxl.place(params, "cxl", pool=pool)
    s = jcxl.place(tx.init(params), "cxl", pool=pool)
    x = batches(1)[0]
    p, s, _ = step(p, s, x)
    handles = set(pool.handles())
    copies = {h for h in handles if pool.info(h).copy_of}
    assert len(copies) == 7
    step.lower(p, s, x)  # traced again: the same objects, none made
    assert set(pool.handles()) == handles

  def test_a_pool_without_room_for_the_copies_fetches_the_masters(
      self, pool, monkeypatch):
    def full(*args, **kwargs):
      raise jcxl.PoolExhaustedError("no room (test)")
    monkeypatch.setattr(jcxl.Pool, "allocate_copy", full)
    params, loss_fn = mlp(scan=False)
    bf16_loss = _bf16_compute(loss_fn)
    data = batches(3)
    _, dev_losses, _, _ = run(pool, params, bf16_loss, optax.adamw(1e-2),
                              data, "device")
    step, losses, _, _ = run(pool, params, bf16_loss, optax.adamw(1e-2),
                             data, "host", refetch=False)
    assert not any("weight copies" in u for u in step.plan.updates)
    np.testing.assert_allclose(losses, dev_losses, rtol=1e-6)

  def test_a_weight_also_read_in_float32_has_no_copy(self, pool):
    params, loss_fn = mlp(scan=False)

    def mixed(p, x):  # the head's weight is read in float32 too
      return (_bf16_compute(loss_fn)(p, x) +
              1e-3 * jnp.sum(p["head"]["w"] ** 2))
    step, _, _, _ = run(pool, params, mixed, optax.adamw(1e-2), batches(1),
                        "host")
    assert any(u.startswith("weight copies: 6 ") for u in step.plan.updates)


@pytest.fixture
def run_program():
  """Calls experiments.host_update's main with a command line; restores
  its flags."""
  saved = flagsaver.save_flag_values(host_update.FLAGS)
  yield lambda *args: host_update.main(
      host_update.FLAGS(["host_update", *args]))
  flagsaver.restore_flag_values(saved, host_update.FLAGS)


class ExperimentTest:

  def test_dry_run_measures_every_mode(self, run_program, tmp_path, capsys):
    json_out = tmp_path / "results.json"
    run_program("--dry_run", f"--json_out={json_out}")
    results = json.loads(json_out.read_text())
    assert set(results["median_step_s"]) == {"resident", "device", "host",
                                             "host_refetch"}
    # By default weights in once, gradients out (and the step count, on
    # this model of 0.1M parameters 0.0001 B/param); refetched, more.
    assert results["traffic"]["host"]["total_per_param"] == (
        pytest.approx(8, abs=0.01))
    assert set(results["host_refetch_by_layer"].values()) == {"kept"}
    assert results["traffic"]["host_refetch"]["total_per_param"] > 10
    traffic = results["traffic"]
    # Gradients out, 4 bytes per parameter; the device update writes 12.
    assert traffic["host"]["written_per_param"] == pytest.approx(4, abs=0.01)
    assert traffic["device"]["written_per_param"] == pytest.approx(
        12, abs=0.01)
    assert results["loss_max_relative_difference_host_vs_device"] <= 1e-6
    # bfloat16 compute: bfloat16 weight copies in, bfloat16 gradients out;
    # the tied embedding's gradient is float32.
    bf16 = results["bf16_compute"]
    assert bf16["llama_untied"]["host"]["read_per_param"] == pytest.approx(
        2, abs=0.01)
    assert bf16["llama_untied"]["host"]["total_per_param"] == pytest.approx(
        4, abs=0.01)
    assert 4.01 < bf16["gpt2_tied"]["host"]["total_per_param"] < 6
    assert bf16["llama_untied"]["host"]["weight_copies"].startswith(
        "weight copies: ")
    assert set(results["zoo"]) == set(host_update.zoo_models(larger=False))
    assert all(z["host_s"] > 0 and z["device_s"] > 0
               for z in results["zoo"].values())
    assert "EMULATED" in results["emulation"]
    assert "EMULATED" in capsys.readouterr().out

  def test_a_width_not_in_heads_of_64_is_refused(self, run_program):
    with pytest.raises(app.UsageError,
                       match="--n_embd must be a multiple of 64"):
      run_program("--n_embd=100")

  @pytest.mark.parametrize("flag", ["rounds", "zoo_rounds"])
  def test_no_rounds_is_refused(self, run_program, flag):
    with pytest.raises(flags.IllegalFlagValueError, match=flag):
      run_program(f"--{flag}=0")

  def test_json_out_that_is_a_directory_is_refused(self, run_program,
                                                   tmp_path):
    with pytest.raises(app.UsageError, match="is a directory"):
      run_program("--dry_run", f"--json_out={tmp_path}")
