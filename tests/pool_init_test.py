"""jcxl.init_in_pool and jcxl.tiers_by_reads: state made in the pool."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jcxl
from experiments import big_model
from experiments import common as experiments_common
from models import common
from models import gpt2


def bits(x) -> np.ndarray:
  return np.asarray(x).reshape(-1).view(np.uint8)


def assert_bit_equal(got, want):
  got, want = jcxl.gather(got), want
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(bits(a), bits(b))


def stacked_init(key):
  """Three 'layers' made one at a time and stacked, plus a table and a
  bias of zeros: the pieces path and the fill path."""
  layers = [jax.random.normal(jax.random.fold_in(key, i), (64, 32)) * 0.02
            for i in range(3)]
  return {"layers": jnp.stack(layers),
          "table": jax.random.uniform(key, (50, 32)),
          "bias": jnp.zeros((32,))}


@pytest.fixture
def pool(tmp_path):
  with jcxl.Pool(host=0, cxl="16MiB", nvme="64MiB", nvme_dir=tmp_path) as p:
    yield p


class InitInPoolTest:

  def test_nnx_model_and_adamw_equal_in_memory_init(self, pool):
    config = gpt2.tiny(scan_layers=True, n_layer=1)
    want = common.init_params(config, seed=3)
    tx = optax.adamw(1e-3)
    params = jcxl.init_in_pool(lambda k: config.build(rngs=nnx.Rngs(k)),
                               jax.random.key(3), pool=pool, kinds="cxl")
    opt_state = jcxl.init_in_pool(tx.init, params, pool=pool, kinds="nvme")
    assert_bit_equal(params, want)
    assert_bit_equal(opt_state, tx.init(want))
    assert all(x.tier.value == "nvme" for x in jax.tree.leaves(
        opt_state, is_leaf=lambda x: isinstance(x, jcxl.PoolArray)))

  def test_stacked_pieces_and_fills_equal_jit(self, pool):
    key = jax.random.key(7)
    got = jcxl.init_in_pool(stacked_init, key, pool=pool, kinds="nvme")
    assert_bit_equal(got, jax.jit(stacked_init)(key))

  @pytest.mark.parametrize("scan_layers", [True, False])
  def test_layered_gpt2_init_equals_jit(self, pool, scan_layers):
    config = gpt2.tiny(scan_layers=scan_layers, n_layer=3)
    init = big_model.layered_init(config)
    got = jcxl.init_in_pool(init, jax.random.key(0), pool=pool, kinds="cxl")
    assert_bit_equal(got, jax.jit(init)(jax.random.key(0)))

  def test_bad_arguments(self, pool):
    with pytest.raises(TypeError, match="fn must be callable"):
      jcxl.init_in_pool(3, pool=pool)
    with pytest.raises(ValueError, match="kinds must be one of.*'device'"):
      jcxl.init_in_pool(stacked_init, jax.random.key(0), pool=pool,
                        kinds="device")
    assert pool.handles() == []

  def test_full_pool_frees_what_it_made(self, tmp_path):
    with jcxl.Pool(host=0, cxl="1MiB") as small:
      with pytest.raises(jcxl.PoolExhaustedError):
        jcxl.init_in_pool(lambda: {"a": jnp.ones((1024,)),
                                   "b": jnp.ones((1 << 20,))},
                          pool=small)
      assert small.handles() == []


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs Linux's resettable peak RSS")
class MemoryTest:
  """The peak stays near a few pieces whatever the model's size (4x the
  pieces add under an eighth of the model's growth); zeros are never
  whole."""

  PIECE = 8 << 20

  def init(self, pieces):
    rows = self.PIECE // 4 // 1024

    def init(key):
      return {"w": jnp.stack([jax.random.normal(jax.random.fold_in(key, i),
                                                (rows, 1024))
                              for i in range(pieces)]),
              "m": jnp.zeros((pieces * rows, 1024))}
    return init

  def test_peak_is_a_piece_not_the_model(self, tmp_path):
    with jcxl.Pool(host=0, cxl=0, nvme="1GiB", nvme_dir=tmp_path) as pool:
      peaks = {}
      # The first warms up JAX and XLA. Noise only adds to a peak (a
      # compile's scratch, freed buffers the allocator keeps on a busy
      # machine), so each size's least of two is its measure.
      for pieces in (2, 8, 8, 32, 32):
        out = {}
        peaks[pieces] = min(peaks.get(pieces, np.inf),
                            experiments_common.peak_rss_above(
            lambda: out.update(jcxl.init_in_pool(
                self.init(pieces), jax.random.key(0), pool=pool,
                kinds="nvme"))))
        got = jcxl.gather(out["m"])
        assert not np.asarray(got).any()
        jax.tree.map(lambda x: x.delete(), out,
                     is_leaf=lambda x: isinstance(x, jcxl.PoolArray))
      model = 2 * 32 * self.PIECE
      print(f"init: peak {peaks[8] / 2**20:.1f} MiB above baseline for "
            f"{model / 8 / 2**20:.0f} MiB of state, {peaks[32] / 2**20:.1f} "
            f"MiB for {model / 2**20:.0f} MiB, in pieces of "
            f"{self.PIECE / 2**20:.0f} MiB")
      # Holding the model would add the 24 pieces' 2 x 192 MiB; streaming
      # adds at most a few pieces (those in flight).
      grown = 2 * (32 - 8) * self.PIECE
      assert peaks[32] - peaks[8] < grown / 8, (peaks, grown)
      assert peaks[32] < model / 4
      assert pool.stats()["nvme"].bytes_written >= model


class TiersByReadsTest:

  def test_most_read_first_in_the_fast_tier(self, tmp_path):
    params = {"a": jax.ShapeDtypeStruct((1 << 20,), np.float32),
              "b": jax.ShapeDtypeStruct((1 << 20,), np.float32)}
    big = {"c": jax.ShapeDtypeStruct((3 << 20,), np.float32)}
    moments = {"mu": params, "nu": params}
    with jcxl.Pool(host=0, cxl="12MiB", nvme="64MiB",
                   nvme_dir=tmp_path) as pool:
      m, p = jcxl.tiers_by_reads([(moments, 1), (params, 3)], pool)
      assert p == {"a": "cxl", "b": "cxl"}
      # 12 MiB less two params leaves room for one moment.
      assert jax.tree.leaves(m) == ["cxl", "nvme", "nvme", "nvme"]
      # Larger first among leaves read as often: the 12 MiB one fills
      # the tier, the 4 MiB ones go to nvme.
      p, b = jcxl.tiers_by_reads([(params, 3), (big, 3)], pool)
      assert (p, b) == ({"a": "nvme", "b": "nvme"}, {"c": "cxl"})

  def test_the_fast_tier_holds_what_it_is_given(self, tmp_path):
    # 108 biases of 30 KiB (as a 36-block model's qkv biases, each with two
    # moments) take 32 KiB slots, 8 to a 256 KiB span: 14 spans, 3.5 MiB,
    # more than their bytes and a span; with a 600 KiB leaf they fill
    # more than 4 MiB. Counting each at its bytes after the first span
    # planned them all into the 4 MiB tier, and the last failed to store.
    tree = {"big": jax.ShapeDtypeStruct((150 * 1024,), np.float32),
            "biases": [jax.ShapeDtypeStruct((7680,), np.float32)
                       for _ in range(108)]}
    with jcxl.Pool(host=0, cxl="4MiB", nvme="64MiB",
                   nvme_dir=tmp_path) as pool:
      (kinds,) = jcxl.tiers_by_reads([(tree, 1)], pool)
      assert kinds["big"] == "cxl"
      assert "nvme" in kinds["biases"]
      made = jcxl.init_in_pool(
          lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree),
          pool=pool, kinds=kinds)
      got = jax.tree.map(lambda x: x.tier.value, made,
                         is_leaf=lambda x: isinstance(x, jcxl.PoolArray))
      assert got == kinds
      assert pool.stats()["cxl"].free < 256 << 10  # the room was used

  def test_errors(self, tmp_path):
    leaf = {"a": jax.ShapeDtypeStruct((4 << 20,), np.float32)}
    with jcxl.Pool(host=0, cxl="1MiB") as pool:
      with pytest.raises(ValueError, match="reads_per_step must be an int"):
        jcxl.tiers_by_reads([(leaf, 0)], pool)
      with pytest.raises(ValueError, match="fits in no tier"):
        jcxl.tiers_by_reads([(leaf, 1)], pool)


class SpilledTrainingTest:
  """The big run's path at a small size: state larger than a small cxl
  tier, the rest in nvme, created in the pool, trained offloaded; equal
  to the same steps on ordinary arrays."""

  def test_offloaded_matches_resident(self, tmp_path):
    config = gpt2.tiny(scan_layers=True)
    init = big_model.layered_init(config)
    tx = optax.adamw(1e-2)
    loss_fn = gpt2.make_loss(config)
    train_step = experiments_common.make_train_step(loss_fn, tx)
    key = jax.random.key(0)
    shapes = jax.eval_shape(init, key)
    opt_shapes = jax.eval_shape(tx.init, shapes)
    batches = [gpt2.example_batch(config, batch_size=2, seq_len=16, seed=s)
               for s in range(3)]
    params = jax.jit(init)(key)
    opt_state = tx.init(params)
    want = []
    for batch in batches:
      params, opt_state, loss = jax.jit(train_step)(params, opt_state, batch)
      want.append(float(loss))
    state_bytes = sum(x.size * x.dtype.itemsize
                      for x in jax.tree.leaves((shapes, opt_shapes)))
    with jcxl.Pool(host=0, cxl="512KiB", nvme="64MiB",
                   nvme_dir=tmp_path) as pool:
      assert state_bytes > 2 * pool.stats()["cxl"].capacity
      param_kinds, opt_kinds = jcxl.tiers_by_reads(
          [(shapes, 3), (opt_shapes, 1)], pool)
      p = jcxl.init_in_pool(init, key, pool=pool, kinds=param_kinds)
      o = jcxl.init_in_pool(tx.init, p, pool=pool, kinds=opt_kinds)
      tiers = {x.tier.value for x in jax.tree.leaves(
          (p, o), is_leaf=lambda x: isinstance(x, jcxl.PoolArray))}
      assert tiers == {"cxl", "nvme"}
      step = jcxl.cxl_offload(train_step, schedule="fixed:1")
      got = []
      for batch in batches:
        p, o, loss = step(p, o, batch)
        got.append(float(loss))
      np.testing.assert_allclose(got, want, rtol=1e-5)
      # Adam moves a value by at most about the learning rate a step: where
      # a gradient is rounding noise (the attention's key bias, see
      # STATE_LEAF_ATOL), its sign may differ, and so may the value, by
      # up to that much per step.
      noise = 2 * 1e-2 * len(batches)
      for a, b in zip(jax.tree.leaves(jcxl.gather(p)),
                      jax.tree.leaves(params)):
        b = np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=max(
            experiments_common.STATE_LEAF_ATOL * np.abs(b).max(), noise))
      assert pool.stats()["nvme"].bytes_read > state_bytes // 2
      # The plan says what each tier holds by how often it is fetched:
      # the cxl tier's bytes are mostly the parameters' (3x per step).
      cxl, nvme = step.plan.placement
      assert cxl.startswith("cxl: ") and nvme.startswith("nvme: ")
      assert "fetched 3x per step" in cxl.split(",")[0]
      assert "fetched 1x per step" in nvme
