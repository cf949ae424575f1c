"""Tests of the streaming ops: fetch/store in jitted code, per shard."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import jcxl
import numpy as np
import pytest
from jcxl._src import topology as topology_lib
from jcxl._src.placement import gather
from jcxl._src.placement import place
from jcxl._src.stream import fetch
from jcxl._src.stream import fetch_done
from jcxl._src.stream import fetch_start
from jcxl._src.stream import layer_scan
from jcxl._src.stream import store

P = jax.sharding.PartitionSpec
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "sysfs")


@pytest.fixture
def pool():
  with jcxl.Pool(host="128MiB", cxl="512MiB") as p:
    yield p


def rand(*shape, seed=0):
  return (np.random.default_rng(seed).random(shape, np.float32) - 0.5) * 0.2


def mesh_of(shape, names):
  devices = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  return jax.sharding.Mesh(devices, names)


class DenseTest:

  def test_forward_and_gradient_bit_identical(self, pool):
    w, x = rand(64, 32), rand(8, 64, seed=1)
    pw = place(w, "cxl", pool=pool)

    def loss_resident(w, x):
      return jnp.sum(jnp.tanh(x @ w) ** 2)

    def loss_offloaded(placeholder, x):
      return jnp.sum(jnp.tanh(x @ fetch(pw, wrt=placeholder)) ** 2)

    ref = jax.jit(jax.value_and_grad(loss_resident, argnums=(0, 1)))(w, x)
    got = jax.jit(jax.value_and_grad(loss_offloaded, argnums=(0, 1)))(
        jnp.zeros_like(w), x)
    assert np.array_equal(ref[0], got[0])
    for a, b in zip(ref[1], got[1]):
      assert np.array_equal(a, b)

  def test_lowered_hlo_has_custom_calls(self, pool):
    pw = place(rand(16, 16), "host", pool=pool)
    text = jax.jit(lambda p, x: x @ fetch(p)).lower(pw, rand(2, 16)).as_text()
    assert "jcxl_fetch_start" in text and "jcxl_fetch_done" in text
    text = jax.jit(lambda p: store(p, jnp.ones((16, 16)))).lower(pw).as_text()
    assert "jcxl_store_start" in text and "jcxl_store_done" in text

  @pytest.mark.parametrize("tier", ["host", "cxl", "nvme"])
  def test_store_then_fetch(self, tier, tmp_path):
    with jcxl.Pool(host="16MiB", cxl="16MiB", nvme="16MiB",
                   nvme_dir=tmp_path) as pool:
      pw = place(rand(32, 8), tier, pool=pool)
      new = rand(32, 8, seed=5)

      @jax.jit
      def update(p, v):
        token = store(p, v * 2)
        return fetch(p, after=token)

      np.testing.assert_array_equal(update(pw, new), new * 2)
      np.testing.assert_array_equal(gather(pw), new * 2)
      assert pool.stats()[tier].bytes_written >= 2 * new.nbytes

  def test_jit_cache_reused(self, pool):
    pw = place(rand(8, 8), "cxl", pool=pool)
    traces = []

    @jax.jit
    def f(p, x):
      traces.append(1)
      return x @ fetch(p)

    for _ in range(3):
      f(pw, rand(2, 8))
    assert len(traces) == 1


class StackedTest:

  def test_scan_with_traced_index_and_gradient(self, pool):
    layers, dim = 5, 32
    w, x = rand(layers, dim, dim), rand(4, dim, seed=2)
    pw = place(w, "cxl", pool=pool)

    def resident(w, x):
      return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x,
                          w)[0].sum()

    def offloaded(placeholder, x):
      def body(h, i):
        return jnp.tanh(h @ fetch(pw, i, wrt=placeholder[i])), None
      return jax.lax.scan(body, x, jnp.arange(layers))[0].sum()

    ref = jax.jit(jax.value_and_grad(resident, argnums=(0, 1)))(w, x)
    for fn in (offloaded, jax.checkpoint(offloaded)):
      got = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(
          jnp.zeros_like(w), x)
      assert np.array_equal(ref[0], got[0])
      for a, b in zip(ref[1], got[1]):
        assert np.array_equal(a, b)

  @pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
  def test_layer_scan_exact_and_memory_bounded(self, pool, prefetch):
    layers, dim, batch = 10, 256, 8
    w, x = rand(layers, dim, dim), rand(batch, dim, seed=3)
    pw = place(w, "cxl", pool=pool)
    body = lambda h, wi: jnp.tanh(h @ wi)
    ref = jax.jit(lambda w, x: jax.lax.scan(
        lambda h, wi: (body(h, wi), None), x, w)[0])(w, x)
    f = jax.jit(lambda p, x: layer_scan(body, x, p, prefetch=prefetch))
    assert np.array_equal(f(pw, x), ref)
    layer_bytes = dim * dim * 4
    activations = 4 * batch * dim * 4
    temp = f.lower(pw, x).compile().memory_analysis().temp_size_in_bytes
    assert temp <= (prefetch + 2) * layer_bytes + activations
    assert temp >= max(1, prefetch) * layer_bytes  # the buffers are real

  def test_store_slice(self, pool):
    w = rand(4, 8, 8)
    pw = place(w, "host", pool=pool)
    jax.jit(lambda p: store(p, jnp.full((8, 8), 7.0), 2))(pw)
    expected = w.copy()
    expected[2] = 7.0
    np.testing.assert_array_equal(gather(pw), expected)

  def test_bad_index_fails_the_step(self, pool):
    pw = place(rand(4, 8), "host", pool=pool)
    with pytest.raises(Exception, match="no slice 9"):
      jax.block_until_ready(jax.jit(lambda p: fetch(p, 9))(pw))

  def test_in_flight_buffer_across_loop_boundary_fails_loudly(self, pool):
    # start in iteration i, done in i + 1: XLA may copy the carry; the copy
    # must then be reported, never returned as garbage.
    w = rand(6, 16, 16)
    pw = place(w, "host", pool=pool)

    def body(state, i):
      h, pending_buffer = state
      from jcxl._src.stream import Pending
      wi = fetch_done(Pending(pending_buffer, None, None,
                              np.int64(pool._timeout_s * 1000)))
      nxt = fetch_start(pw, jnp.minimum(i + 1, 5), after=h)
      return (jnp.tanh(h @ wi), nxt.buffer), None

    def run(x):
      first = fetch_start(pw, 0).buffer
      return jax.lax.scan(body, (x, first), jnp.arange(5))[0][0]

    x = rand(2, 16, seed=4)
    ref = x
    for i in range(5):
      ref = np.tanh(ref @ w[i])
    try:
      got = jax.block_until_ready(jax.jit(run)(x))
    except Exception as e:  # the safety check fired
      assert "no transfer in flight" in str(e)
    else:
      np.testing.assert_allclose(got, ref, rtol=1e-5)


class ShardedTest:

  @pytest.mark.parametrize("mesh_shape,names,spec", [
      ((8,), ("fsdp",), P("fsdp", None)),
      ((8,), ("fsdp",), P()),
      ((2, 4), ("data", "model"), P("data", "model")),
      ((2, 4), ("data", "model"), P("model", None)),
  ], ids=["fsdp", "replicated", "2d", "2d-partial"])
  def test_forward_and_gradient_match_resident(self, pool, mesh_shape, names,
                                               spec):
    mesh = mesh_of(mesh_shape, names)
    sharding = jax.sharding.NamedSharding(mesh, spec)
    w, x = rand(64, 32), rand(16, 64, seed=6)
    pw = place(w, "cxl", pool=pool, sharding=sharding)
    assert len(pw.local_handles) == 8
    shard_bytes = int(np.prod(pw.shard_shape)) * 4
    for _, handle in pw.local_handles:
      assert pool.info(handle).nbytes == shard_bytes
    w_dev = jax.device_put(w, sharding)

    def loss(w, x):
      return jnp.sum(jnp.tanh(x @ w) ** 2)

    ref = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(w_dev, x)
    got = jax.jit(jax.value_and_grad(
        lambda ph, x: loss(fetch(pw, wrt=ph), x), argnums=(0, 1)))(
            jnp.zeros_like(w_dev), x)
    assert np.array_equal(ref[0], got[0])
    for a, b in zip(ref[1], got[1]):
      assert np.array_equal(a, b)
    fetched = jax.jit(fetch)(pw)
    assert fetched.sharding.is_equivalent_to(sharding, 2)
    np.testing.assert_array_equal(gather(pw), w)

  def test_sharded_stacked_layer_scan(self, pool):
    mesh = mesh_of((8,), ("fsdp",))
    sharding = jax.sharding.NamedSharding(mesh, P(None, "fsdp", None))
    w, x = rand(6, 64, 64), rand(8, 64, seed=7)
    pw = place(w, "cxl", pool=pool, sharding=sharding)
    body = lambda h, wi: jnp.tanh(h @ wi)
    ref = jax.jit(lambda w, x: jax.lax.scan(
        lambda h, wi: (body(h, wi), None), x, w)[0])(
            jax.device_put(w, sharding), x)
    got = jax.jit(lambda p, x: layer_scan(body, x, p, prefetch=1))(pw, x)
    assert np.array_equal(ref, got)

  def test_sharded_store(self, pool):
    mesh = mesh_of((8,), ("fsdp",))
    sharding = jax.sharding.NamedSharding(mesh, P("fsdp"))
    pw = place(np.zeros(64, np.float32), "host", pool=pool, sharding=sharding)
    jax.jit(lambda p: store(p, jnp.arange(64, dtype=jnp.float32)))(pw)
    np.testing.assert_array_equal(gather(pw), np.arange(64))


class PlaceTest:

  def test_kinds_rules_and_trees(self, pool):
    tree = {"embed": rand(8, 4), "layers": [rand(4, 4), rand(4)],
            "head": rand(4, 2)}
    placed = place(tree, [(r"embed", "host"), (r"\['head'\]", "device"),
                          (r".*", "cxl")], pool=pool)
    assert placed["embed"].memory_kind == "host"
    assert isinstance(placed["head"], jax.Array)
    assert [a.memory_kind for a in placed["layers"]] == ["cxl", "cxl"]
    assert placed["layers"][1].path == "['layers'][1]"
    back = gather(placed)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
      np.testing.assert_array_equal(a, b)
    by_tree = place(tree, {"embed": "nvme" if False else "host",
                           "layers": "cxl", "head": "pinned_host"},
                    pool=pool)
    assert by_tree["head"].sharding.memory_kind == "pinned_host"
    assert by_tree["layers"][0].memory_kind == "cxl"

  def test_repr_says_where(self, pool):
    pw = place(rand(4, 4), "cxl", pool=pool)
    text = repr(pw)
    assert "float32[4,4]" in text and "EMULATED" in text
    assert f"pool {pool.id}" in text

  def test_unknown_memory_kind(self, pool):
    with pytest.raises(ValueError, match=r"must be one of 'device'.*'gpu'"):
      place({"w": rand(2)}, "gpu", pool=pool)
    with pytest.raises(ValueError, match=r"no placement rule matches leaf"):
      place({"w": rand(2)}, [("^x$", "cxl")], pool=pool)

  def test_pool_kinds_need_a_pool(self):
    with pytest.raises(ValueError, match="need a pool"):
      place(rand(2), "cxl")

  def test_sharding_devices_must_match_pool_node(self):
    topo = topology_lib.discover(os.path.join(FIXTURES, "two_socket_two_cxl"))
    with jcxl.Pool(host="8MiB", cxl="8MiB", topology=topo, node=1) as pool:
      with pytest.raises(ValueError, match=r"leaf \['w'\].*node 0.*node 1"):
        place({"w": rand(4)}, "cxl", pool=pool)

  def test_failed_place_frees_what_it_stored(self):
    with jcxl.Pool(host=0, cxl="8MiB") as pool:
      with pytest.raises(jcxl.PoolExhaustedError):
        place([rand(1024, 1024), rand(1024, 1024), rand(1024, 1024)], "cxl",
              pool=pool)
      assert pool.handles() == []


class TraceTimeErrorsTest:

  def test_closed_pool(self):
    pool = jcxl.Pool(host="8MiB", cxl="8MiB")
    pw = place({"w": rand(4)}, "cxl", pool=pool)["w"]
    pool.close()
    with pytest.raises(jcxl.PoolClosedError, match=r"PoolArray \['w'\]"):
      jax.jit(fetch)(pw)

  def test_freed_object(self, pool):
    pw = place({"w": rand(4)}, "cxl", pool=pool)["w"]
    pw.delete()
    with pytest.raises(jcxl.UnknownHandleError,
                       match=r"PoolArray \['w'\].*freed"):
      jax.jit(fetch)(pw)

  def test_store_shape_or_dtype_mismatch(self, pool):
    pw = place({"w": rand(4, 4)}, "cxl", pool=pool)["w"]
    with pytest.raises(ValueError, match=r"\['w'\].*float32\[4, 3\]"):
      jax.jit(lambda p: store(p, jnp.ones((4, 3))))(pw)
    with pytest.raises(ValueError, match=r"int32"):
      jax.jit(lambda p: store(p, jnp.ones((4, 4), jnp.int32)))(pw)

  def test_not_a_pool_array(self):
    with pytest.raises(TypeError, match="takes a jcxl.PoolArray"):
      fetch(jnp.ones(3))


class StreamedScanTest:

  @pytest.mark.parametrize("reverse", [False, True])
  @pytest.mark.parametrize("prefetch", [0, 1, 2, 5])
  def test_matches_lax_scan_with_xs_and_ys(self, pool, reverse, prefetch):
    from jcxl._src.stream import streamed_scan
    layers = 9  # prefetch 1: 3 turns of the ring loop, then 3 unrolled
    w, xs = rand(layers, 8, 8), rand(layers, 8, seed=9)
    pw = place(w, "cxl", pool=pool)
    body = lambda c, wi, x: (jnp.tanh(c @ wi + x), c.sum())
    ref = jax.jit(lambda w, xs: jax.lax.scan(
        lambda c, wx: body(c, *wx), jnp.ones(8), (w, xs),
        reverse=reverse))(w, xs)
    got = jax.jit(lambda p, xs: streamed_scan(
        body, jnp.ones(8), p, xs, length=layers, reverse=reverse,
        prefetch=prefetch))(pw, xs)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
      assert np.array_equal(a, b)


class RowBlocksTest:
  """Blocks of rows of one object: the last may be shorter; no other."""

  def test_blocks_round_trip_and_bad_block_fails(self, pool):
    from jcxl._src.pool_array import RowBlocks
    table = np.arange(50 * 8, dtype=np.float32).reshape(50, 8)
    x = jcxl.place(table, "cxl", pool=pool)
    assert RowBlocks(x, 16).shape == (3, 16, 8)
    assert RowBlocks(x, 16, tail=True).shape == (4, 2, 8)
    # Views are made inside the traced step (as cxl_offload makes them).
    read = jax.jit(lambda x, i, tail: jcxl.fetch(RowBlocks(x, 16, tail), i),
                   static_argnums=2)
    np.testing.assert_array_equal(read(x, 2, False), table[32:48])
    np.testing.assert_array_equal(read(x, 3, True), table[48:50])
    # Doubled in place, block by block.
    double = jax.jit(lambda x, i, tail: jcxl.store(
        RowBlocks(x, 16, tail), jcxl.fetch(RowBlocks(x, 16, tail), i) * 2,
        i), static_argnums=2)
    for i in range(3):
      double(x, i, False)
    double(x, 3, True)
    np.testing.assert_array_equal(jcxl.gather(x), table * 2)
    # A block past the end is refused by the copy engine, not read.
    with pytest.raises(Exception, match="has no block 3 of 16 rows"):
      jax.block_until_ready(read(x, 3, False))
    with pytest.raises(ValueError, match="no last block"):
      RowBlocks(jcxl.place(table[:48], "cxl", pool=pool), 16, tail=True)
