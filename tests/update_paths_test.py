"""Every update path against jax.jit, over optax's transformations.

Each case trains a tiny model (two small layers) for `STEPS` steps with
one optax transformation under ``cxl_offload(update=...)`` and compares
its losses and final state with the same step under ``jax.jit``: bit for
bit where every layer's update runs on the device (but for
`DEVICE_ROUNDING`), within `RTOL` of each leaf's scale where the host
update runs (it computes what the jaxpr says, XLA rewrites some of it). With ``update='host'`` a transformation the host cannot run is
refused, naming the leaf and the transformation; ``update='auto'`` runs it
on the device. Nothing may come out silently different.

How the cases are chosen: every transformation under every update mode
(one compile each). The state's tier (host, cxl, nvme) and ``refetch``
rotate with the transformation's index `i` and the mode's index `m`: tier
``TIERS[(i + m) % 3]``, refetch ``(i + m) % 2 == 0``; over its three modes
each transformation so sees every tier and both refetch values once at
least (the full cross product would take six times as long).
"""

from __future__ import annotations

import functools

from experiments.common import make_train_step as make_step
import jax
import jax.numpy as jnp
import jcxl
import numpy as np
import optax
import pytest

STEPS, BATCH = 10, 8
RTOL = 1e-6
MODES = ("device", "host", "auto")
TIERS = ("host", "cxl", "nvme")

_adam = functools.partial(optax.adam, 1e-2)
TRANSFORMATIONS = {
    "adam": _adam,
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "lion": lambda: optax.lion(1e-3, weight_decay=1e-2),
    "sgd": lambda: optax.sgd(5e-2),
    "sgd_momentum": lambda: optax.sgd(5e-2, momentum=0.9),
    "sgd_nesterov": lambda: optax.sgd(5e-2, momentum=0.9, nesterov=True),
    "novograd": lambda: optax.novograd(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1e-2),
    "rmsprop": lambda: optax.rmsprop(1e-2),
    "adagrad": lambda: optax.adagrad(1e-2),
    "adabelief": lambda: optax.adabelief(1e-2),
    "yogi": lambda: optax.yogi(1e-2),
    "radam": lambda: optax.radam(1e-2),
    "sm3": lambda: optax.sm3(1e-2),
    "fromage": lambda: optax.fromage(1e-2),
    "noisy_sgd": lambda: optax.noisy_sgd(1e-2, key=0),
    "adamax": lambda: optax.adamax(1e-2),
    "amsgrad": lambda: optax.amsgrad(1e-2),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.05),
                                      optax.adamw(1e-2)),
    "masked_adam": lambda: optax.masked(
        _adam(), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
    "multi_steps": lambda: optax.MultiSteps(_adam(), every_k_schedule=2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=1e-2, weight_decay=1e-3),
    "inject_schedule": lambda: optax.inject_hyperparams(optax.sgd)(
        learning_rate=optax.linear_schedule(0.0, 5e-2, 4), momentum=0.9),
    "warmup_cosine": lambda: optax.adam(
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, STEPS)),
    "exponential_decay": lambda: optax.sgd(
        optax.exponential_decay(5e-2, 3, 0.5), momentum=0.9),
}


def _model():
  rng = np.random.default_rng(0)
  w = lambda *s: (rng.normal(size=s) * 0.3).astype(np.float32)
  params = {"l0": {"w": w(16, 32), "b": np.zeros(32, np.float32)},
            "l1": {"w": w(32, 16), "b": np.zeros(16, np.float32)}}

  def loss_fn(p, x):
    h = jnp.tanh(x @ p["l0"]["w"] + p["l0"]["b"])
    return jnp.mean((h @ p["l1"]["w"] + p["l1"]["b"] - 0.5) ** 2)
  data = [rng.normal(size=(BATCH, 16)).astype(np.float32)
          for _ in range(STEPS)]
  return params, loss_fn, data


@functools.cache
def _reference(name: str):
  """The step under jax.jit: losses, final parameters and state."""
  params, loss_fn, data = _model()
  tx = TRANSFORMATIONS[name]()
  step = jax.jit(make_step(loss_fn, tx))
  p, s, losses = params, tx.init(params), []
  for x in data:
    p, s, loss = step(p, s, x)
    losses.append(np.asarray(loss))
  return losses, jax.device_get(p), jax.device_get(s)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
  with jcxl.Pool(host="64MiB", cxl="64MiB", nvme="64MiB",
                 nvme_dir=tmp_path_factory.mktemp("nvme")) as p:
    yield p


def _assert_equal(got, want, exact: bool, what: str):
  """Bit for bit, or each leaf within `RTOL` of its largest magnitude."""
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got) == len(want), what
  for j, (x, y) in enumerate(zip(got, want)):
    x, y = _numbers(x), _numbers(y)
    assert x.dtype == y.dtype and x.shape == y.shape, (what, j)
    if exact or not np.issubdtype(y.dtype, np.floating):
      np.testing.assert_array_equal(x, y, err_msg=f"{what}, leaf {j}")
    else:
      scale = max(float(np.abs(y.astype(np.float64)).max()), 1e-30)
      np.testing.assert_allclose(
          x.astype(np.float64), y.astype(np.float64), rtol=0,
          atol=RTOL * scale, err_msg=f"{what}, leaf {j}")


def _numbers(x) -> np.ndarray:
  """`x` as numpy (a typed PRNG key as its key data)."""
  if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x)


def _updates(plan) -> dict[str, str]:
  """Per layer, the path `step.plan` names for its update."""
  return {l.name: l.update for l in plan.layers}


CASES = [(name, mode, TIERS[(i + m) % 3], (i + m) % 2 == 0)
         for i, name in enumerate(TRANSFORMATIONS)
         for m, mode in enumerate(MODES)]


class UpdatePathsTest:

  @pytest.mark.parametrize(
      "name,update,tier,refetch", CASES,
      ids=[f"{n}-{u}-{t}-{'refetch' if r else 'once'}"
           for n, u, t, r in CASES])
  def test_equals_jit_or_is_refused_by_name(self, pool, name, update, tier,
                                            refetch):
    params, loss_fn, data = _model()
    ref_losses, ref_p, ref_s = _reference(name)
    tx = TRANSFORMATIONS[name]()
    step = jcxl.cxl_offload(make_step(loss_fn, tx), update=update,
                            refetch=refetch)
    p = jcxl.place(params, tier, pool=pool)
    s = jcxl.place(tx.init(params), tier, pool=pool)
    try:
      losses = []
      try:
        for x in data:
          p, s, loss = step(p, s, x)
          losses.append(np.asarray(loss))
      except ValueError as e:
        if update != "host" or name not in REFUSED_ON_HOST:
          raise
        # The leaf and the transformation, by name.
        assert "update='host' cannot run the update of " in str(e)
        assert "['l" in str(e) and REFUSED_ON_HOST[name] in str(e), str(e)
        return
      assert not (update == "host" and name in REFUSED_ON_HOST), (
          f"{name} ran on the host; the test expects it refused")
      paths = _updates(step.plan)
      on_device = update == "device" or all(
          path == "device" for layer, path in paths.items()
          if layer.startswith("['l"))
      if update == "auto" and name in REFUSED_ON_HOST:
        # What the host cannot run is on the device (its weights may take
        # a device-computed update on the host: 'mixed').
        assert set(paths.values()) - {"host"}, paths
      on_device = on_device and name not in DEVICE_ROUNDING
      what = f"{name}, update={update!r}, {tier}, refetch={refetch}"
      _assert_equal(losses, ref_losses, on_device, f"{what}: losses")
      _assert_equal(jcxl.gather(p), ref_p, on_device, f"{what}: params")
      _assert_equal(jcxl.gather(s), ref_s, on_device, f"{what}: state")
    finally:
      for tree in (p, s):
        for leaf in jax.tree.leaves(
            tree, is_leaf=lambda x: isinstance(x, jcxl.PoolArray)):
          if isinstance(leaf, jcxl.PoolArray):
            leaf.delete()


# Transformations whose update 'host' refuses, and the transformation its
# message names: each reads the whole leaf (a norm, a factored or
# cover-set moment), or picks a moment's new value by a step-dependent
# branch (lax.cond). (lars and fromage scale the update by a norm of it,
# computed on the device; what they do to the state is elementwise.)
REFUSED_ON_HOST = {
    "novograd": "optax.scale_by_novograd",
    "adafactor": "optax.clip_by_block_rms",
    "lamb": "optax.scale_by_trust_ratio",
    "sm3": "optax.scale_by_sm3",
    "multi_steps": "optax.MultiSteps",
}

# Transformations whose device update XLA rounds differently inside the
# offloaded step than in one jitted program (sm3's update, fused across the
# reductions of its cover sets, differs in the last bit): within `RTOL`.
DEVICE_ROUNDING = ("sm3",)
