"""A placed leaf reads as an array: tree utilities, NumPy and jax.numpy,
and helpers under their own jax.jit give what they give on the values."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jcxl

from porting_test import assert_close


@pytest.fixture
def pool():
  with jcxl.Pool(host="64MiB", cxl="256MiB", timeout_s=5.0) as p:
    yield p


def values():
  rng = np.random.default_rng(0)
  return {
      "dense": {"kernel": rng.normal(size=(16, 8)).astype(np.float32),
                "bias": rng.normal(size=(8,)).astype(np.float32)},
      "scale": np.float32(1.5),
      "step": np.int32(3),
  }


def is_pool_array(x):
  return isinstance(x, jcxl.PoolArray)


class MetadataTest:

  def test_leaves_are_the_placed_arrays(self, pool):
    placed = jcxl.place(values(), "cxl", pool=pool)
    leaves = jax.tree.leaves(placed)
    assert len(leaves) == len(jax.tree.leaves(values()))
    assert all(is_pool_array(x) for x in leaves)
    assert jax.tree.structure(placed) == jax.tree.structure(values())

  def test_shapes_dtypes_and_parameter_count_as_unplaced(self, pool):
    params = values()
    placed = jcxl.place(params, "cxl", pool=pool)
    meta = lambda x: (x.shape, x.dtype, x.size, x.ndim, x.nbytes)
    assert jax.tree.map(meta, placed) == jax.tree.map(
        lambda x: meta(jnp.asarray(x)), params)
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
    assert count(placed) == count(params) == 16 * 8 + 8 + 2
    log = lambda tree: [f"{jax.tree_util.keystr(p)}: {x.dtype}{list(x.shape)}"
                        for p, x in jax.tree_util.tree_leaves_with_path(tree)]
    assert log(placed) == log(jax.tree.map(jnp.asarray, params))
    kernel = placed["dense"]["kernel"]
    assert kernel.sharding == jnp.asarray(params["dense"]["kernel"]).sharding
    assert len(kernel) == 16


class ValuesTest:

  def test_numpy_and_jax_numpy_read_the_values(self, pool):
    params = values()
    placed = jcxl.place(params, "cxl", pool=pool)
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(params)):
      np.testing.assert_array_equal(np.asarray(got), want)
      assert np.asarray(got).dtype == np.asarray(want).dtype
      as_jax = jnp.asarray(got)
      assert isinstance(as_jax, jax.Array) and not is_pool_array(as_jax)
      np.testing.assert_array_equal(as_jax, want)
    kernel = placed["dense"]["kernel"]
    want = params["dense"]["kernel"]
    np.testing.assert_array_equal(np.asarray(kernel, np.float64),
                                  want.astype(np.float64))
    x = np.ones((2, 16), np.float32)
    for got, ref in [(kernel * 2, want * 2), (2 * kernel, 2 * want),
                     (x @ kernel, x @ want), (-kernel, -want),
                     (kernel[3], want[3]), (kernel.T, want.T),
                     (kernel.astype(jnp.bfloat16), want.astype(jnp.bfloat16)),
                     (kernel.sum(), want.sum()), (list(kernel)[-1], want[-1])]:
      np.testing.assert_allclose(np.asarray(got, np.float32),
                                 np.asarray(ref, np.float32), rtol=1e-6)

  def test_optax_tree_utils_as_on_the_values(self, pool):
    params = values()
    params.pop("step")  # an optimizer's params are floating point
    placed = jcxl.place(params, "cxl", pool=pool)
    tu = optax.tree_utils
    np.testing.assert_allclose(tu.tree_norm(placed), tu.tree_norm(params),
                               rtol=1e-6)
    np.testing.assert_allclose(optax.global_norm(placed),
                               optax.global_norm(params), rtol=1e-6)
    np.testing.assert_allclose(tu.tree_vdot(placed, placed),
                               tu.tree_vdot(params, params), rtol=1e-6)
    zeros = tu.tree_zeros_like(placed)
    assert not any(is_pool_array(x) for x in jax.tree.leaves(zeros))
    assert_close(zeros, tu.tree_zeros_like(params))
    assert_close(optax.adamw(1e-3).init(placed),
                 optax.adamw(1e-3).init(params))


class Mlp(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(32)(x))
    return nn.Dense(4)(x)


class JittedHelperTest:
  """A helper under its own jax.jit, called with placed state."""

  def test_an_eval_helper_equals_it_on_the_values(self, pool):
    model = Mlp()
    x = np.random.default_rng(1).normal(size=(8, 16)).astype(np.float32)
    params = model.init(jax.random.key(0), x)["params"]
    placed = jcxl.place(params, "cxl", pool=pool)

    @jax.jit
    def metrics(params, x):  # Flax's apply, jnp calls, operators
      logits = model.apply({"params": params}, x)
      norm = optax.global_norm(params)
      return {"mean": logits.mean(), "norm": norm,
              "bias": params["Dense_1"]["bias"] * 2}

    got, want = metrics(placed, x), metrics(params, x)
    assert_close(got, want, rtol=1e-6, atol=1e-6)
    # Fetched by the step where it reads them, not baked in as constants.
    text = metrics.lower(placed, x).as_text()
    assert text.count("jcxl_fetch_start") >= len(jax.tree.leaves(params))
    before = pool.stats()["cxl"].bytes_read
    jax.block_until_ready(metrics(placed, x))
    assert pool.stats()["cxl"].bytes_read - before >= sum(
        x.nbytes for x in jax.tree.leaves(params))
    assert_close(placed, params)  # read, not written

  def test_it_sees_what_an_offloaded_step_wrote(self, pool):
    tx = optax.sgd(0.1)
    params = values()
    params.pop("step")
    x = np.ones((2, 16), np.float32)

    def loss(params, x):
      h = x @ params["dense"]["kernel"] + params["dense"]["bias"]
      return jnp.sum(jnp.tanh(h) ** 2) * params["scale"]

    def train_step(params, opt_state, x):
      grads = jax.grad(loss)(params, x)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    evaluate = jax.jit(loss)
    kernel = jnp.asarray(params["dense"]["kernel"])
    closed_over = jax.jit(lambda x: x @ placed["dense"]["kernel"])
    placed = jcxl.place(params, "cxl", pool=pool)
    opt_state = tx.init(placed)
    ref_params, ref_state = params, tx.init(params)
    step = jcxl.cxl_offload(train_step)
    np.testing.assert_allclose(closed_over(x), x @ kernel, rtol=1e-6)
    for _ in range(2):
      placed, opt_state = step(placed, opt_state, x)
      ref_params, ref_state = jax.jit(train_step)(ref_params, ref_state, x)
      np.testing.assert_allclose(evaluate(placed, x),
                                 evaluate(ref_params, x), rtol=1e-5)
      # Closed over, the array is fetched each call: no stale constant.
      np.testing.assert_allclose(
          closed_over(x), x @ ref_params["dense"]["kernel"], rtol=1e-5)
    assert_close(placed, ref_params, rtol=1e-5)


class RefusedTest:

  def test_a_transformation_that_takes_arrays_names_the_fix(self, pool):
    placed = jcxl.place(values(), "cxl", pool=pool)
    with pytest.raises(TypeError, match=r"PoolArray.*jcxl.gather"):
      jax.device_put(placed)
    with pytest.raises(TypeError, match=r"PoolArray.*path=\['dense'\]"):
      jax.grad(lambda p: jnp.sum(p["dense"]["kernel"]))(placed)

  def test_numpy_inside_a_trace_is_refused(self, pool):
    kernel = jcxl.place(values(), "cxl", pool=pool)["dense"]["kernel"]
    with pytest.raises(TypeError, match="np.asarray cannot read"):
      jax.jit(lambda k: jnp.sum(np.asarray(k)))(kernel)


class PublicApiTest:

  def test_tuner_and_profiles_live_in_planning(self):
    for name in ("Tuner", "TunerEvent", "TunerOptions", "LayerProfile",
                 "StepProfile"):
      assert not hasattr(jcxl, name) and name not in jcxl.__all__, name
      assert name in jcxl.planning.__all__, name
      assert getattr(jcxl.planning, name).__doc__, name

  def test_pool_array_documents_reading_it_as_an_array(self):
    doc = jcxl.PoolArray.__doc__
    assert "Example:" in doc and "jax.tree.leaves" in doc
    assert "is_leaf" not in doc
