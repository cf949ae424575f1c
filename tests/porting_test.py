"""Train steps written for jax.jit run under cxl_offload unchanged.

Each test is a public training pattern (a Linen TrainState with dropout and
metrics, NNX in the functional and in-place styles, remat, MultiSteps, an
eval step, keyword / static / donated arguments) run for several steps
under plain jax.jit (nnx.jit for the in-place style) and under
cxl_offload, from the same start: losses and final state must agree.
"""

from __future__ import annotations

import flax.linen as nn
from flax import nnx
from flax.training import train_state
import jax
import jax.numpy as jnp
import jcxl
import numpy as np
import optax
import pytest

STEPS = 3
BATCH, FEATURES, CLASSES = 8, 16, 4
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture
def pool():
  with jcxl.Pool(host="64MiB", cxl="256MiB", timeout_s=0.5) as p:
    yield p


def is_pool_array(x):
  return isinstance(x, jcxl.PoolArray)


def assert_close(got, want, rtol=RTOL, atol=ATOL):
  """Two trees (placed or not) equal leaf for leaf within rtol/atol, of the
  same structure and dtypes."""
  got, want = jcxl.gather(got), jcxl.gather(want)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = jnp.asarray(g), jnp.asarray(w)
    if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
      g, w = jax.random.key_data(g), jax.random.key_data(w)
    assert g.dtype == w.dtype, (g.dtype, w.dtype)
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol,
                               atol=atol)


def batches(n=STEPS, seed=0):
  rng = np.random.default_rng(seed)
  return [{"x": rng.normal(size=(BATCH, FEATURES)).astype(np.float32),
           "y": rng.integers(0, CLASSES, BATCH).astype(np.int32)}
          for _ in range(n)]


# ----------------------------------------------------------- Linen models


class Classifier(nn.Module):
  hidden: int = 32

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.relu(nn.Dense(self.hidden, name="encoder")(x))
    x = nn.Dropout(0.3, deterministic=not train)(x)
    return nn.Dense(CLASSES, name="head")(x)


class State(train_state.TrainState):
  rng: jax.Array  # a typed key, split every step


def linen_state(tx=None):
  model = Classifier()
  params = model.init(jax.random.key(0), jnp.zeros((1, FEATURES)),
                      train=False)["params"]
  return State.create(apply_fn=model.apply, params=params,
                      tx=tx or optax.adamw(1e-2), rng=jax.random.key(1))


def linen_train_step(state, batch):
  rng, dropout = jax.random.split(state.rng)

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"], train=True,
                            rngs={"dropout": dropout})
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
    return loss, {"loss": loss, "accuracy": accuracy}

  (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      state.params)
  return state.apply_gradients(grads=grads).replace(rng=rng), metrics


def run_both(step, ref_state, placed, data, offload_kwargs=None, **jit_kwargs):
  """Runs `step` under jax.jit and cxl_offload; returns the final states."""
  resident = jax.jit(step, **jit_kwargs)
  offloaded = jcxl.cxl_offload(step, **(offload_kwargs or {}), **jit_kwargs)
  for batch in data:
    ref_state, ref_metrics = resident(ref_state, batch)
    placed, metrics = offloaded(placed, batch)
    assert_close(metrics, ref_metrics)
  return ref_state, placed, offloaded


class LinenTest:

  def test_train_state_with_dropout_metrics_key_and_python_step(self, pool):
    state = linen_state()
    assert isinstance(state.step, int)  # TrainState.create(step=0)
    placed = jcxl.place(state, "cxl", pool=pool)
    assert placed.step.dtype == np.int32  # as jnp.asarray(0) gives it
    assert isinstance(placed.rng, jax.Array)  # the key stays on the device
    ref, placed, _ = run_both(linen_train_step, state, placed, batches())
    assert_close(placed, ref)
    assert int(jcxl.gather(placed.step)) == STEPS

  def test_step_popping_from_its_batch_gets_its_own_dict(self, pool):
    def train_step(state, batch):
      labels = batch.pop("y")  # as Hugging Face's Flax examples do
      batch["extra"] = labels + 1  # a key of its own: not handed back
      return linen_train_step(state, {"x": batch["x"], "y": labels})

    state = linen_state()
    placed = jcxl.place(state, "cxl", pool=pool)
    data = batches()
    ref, placed, _ = run_both(train_step, state, placed, data)
    assert_close(placed, ref)
    assert all(sorted(batch) == ["x", "y"] for batch in data)

  def test_host_update_leaves_a_key_split_by_the_step_on_the_device(
      self, pool):
    state = linen_state().replace(rng=jax.random.PRNGKey(1))  # raw uint32
    placed = jcxl.place(state, "cxl", pool=pool)
    assert is_pool_array(placed.rng)
    ref, placed, step = run_both(linen_train_step, state, placed, batches(),
                                 offload_kwargs={"update": "host"})
    assert_close(placed, ref)
    paths = {l.name: l.update for l in step.plan.layers}
    assert paths[".rng"] == "device"
    assert {paths["['encoder']"], paths["['head']"]} == {"host"}
    assert any(line.startswith(".rng: device: not an optimizer update")
               for line in step.plan.updates), step.plan.updates

  def test_multisteps_accumulates_then_updates(self, pool):
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    state = linen_state(tx)
    placed = jcxl.place(state, "cxl", pool=pool)
    ref, placed, _ = run_both(linen_train_step, state, placed,
                              batches(n=5))
    assert_close(placed, ref)
    # Two updates applied (steps 2 and 4), a gradient half accumulated.
    assert int(jcxl.gather(placed.opt_state.gradient_step)) == 2

  def test_eval_step_reads_state_and_returns_metrics(self, pool):
    state = linen_state()
    placed = jcxl.place(state, "cxl", pool=pool)

    def eval_step(state, batch):
      logits = state.apply_fn({"params": state.params}, batch["x"],
                              train=False)
      return {"loss": optax.softmax_cross_entropy_with_integer_labels(
          logits, batch["y"]).mean()}

    offloaded = jcxl.cxl_offload(eval_step)
    before = jax.tree.leaves(placed)
    for batch in batches():
      assert_close(offloaded(placed, batch), jax.jit(eval_step)(state, batch))
    assert_close(placed, state)  # read, never written
    assert jax.tree.leaves(placed) == before

  def test_params_only_eval_returning_a_scalar(self, pool):
    state = linen_state()
    params = jcxl.place(state.params, "cxl", pool=pool)

    def predict(params, x):
      return Classifier().apply({"params": params}, x, train=False).sum()

    for batch in batches():
      np.testing.assert_allclose(
          jcxl.cxl_offload(predict)(params, batch["x"]),
          jax.jit(predict)(state.params, batch["x"]), rtol=RTOL)


  def test_a_single_array_output_of_its_shape_is_not_written_back(self,
                                                                   pool):
    # predict(w, x) -> x @ w returns an array of w's shape: a result, not
    # w's new value, as under jax.jit. Only donating w rewrites it.
    w = np.random.default_rng(1).normal(size=(FEATURES, FEATURES)).astype(
        np.float32)
    x = np.ones((FEATURES, FEATURES), np.float32)
    placed = jcxl.place(w, "cxl", pool=pool)

    def predict(w, x):
      return x @ w

    out = jcxl.cxl_offload(predict)(placed, x)
    assert not is_pool_array(out)
    np.testing.assert_allclose(out, jax.jit(predict)(w, x), rtol=RTOL)
    np.testing.assert_array_equal(jcxl.gather(placed), w)  # untouched

    def sgd(w, x):
      return w - 0.1 * jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)

    new = jcxl.cxl_offload(sgd, donate_argnums=0)(placed, x)
    assert is_pool_array(new) and new.local_handles == placed.local_handles
    np.testing.assert_allclose(jcxl.gather(new), jax.jit(sgd)(w, x),
                               rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------ remat blocks


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(4 * x.shape[-1], name="up")(x))
    return x + nn.Dense(x.shape[-1], name="down")(h)


class Tower(nn.Module):
  remat: bool
  depth: int = 4

  @nn.compact
  def __call__(self, x):
    block = nn.remat(Block) if self.remat else Block
    for i in range(self.depth):
      x = block(name=f"block{i}")(x)
    return jnp.mean(x ** 2)


class RematTest:

  def test_remat_blocks_equal_jit_refetch_and_need_less(self, pool):
    x = np.random.default_rng(3).normal(size=(256, 64)).astype(np.float32)
    params = Tower(remat=False).init(jax.random.key(0), x[:1])["params"]
    tx = optax.sgd(0.05)
    needs, fetched = {}, {}
    for remat in (False, True):
      def step(params, opt_state, x, remat=remat):
        loss, grads = jax.value_and_grad(
            lambda p: Tower(remat=remat).apply({"params": p}, x))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

      ref = (params, tx.init(params))
      placed = jcxl.place(ref, "cxl", pool=pool)
      offloaded = jcxl.cxl_offload(step)
      for _ in range(STEPS):
        *ref, ref_loss = jax.jit(step)(*ref, x)
        *placed, loss = offloaded(*placed, x)
        np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
      assert_close(placed, ref)
      needs[remat] = offloaded.device_need(*placed, x)
      offloaded.report()
      offloaded(*placed, x)
      fetched[remat] = {r.name: r.bytes_fetched for r in offloaded.report()}
    # Recomputed activations are not kept: the remat step needs less.
    assert needs[True] < needs[False], needs
    # Each block's kernels are fetched for the forward pass, again for its
    # recomputation (not kept from the forward pass) and for the update.
    for i in range(4):
      for name in ("up", "down"):
        kernel = params[f"block{i}"][name]["kernel"].nbytes
        got = fetched[True][f"['block{i}']['{name}']"]
        assert got >= 3 * kernel, (i, name, got, kernel)
      up = params[f"block{i}"]["up"]
      assert fetched[True][f"['block{i}']['up']"] == 3 * (
          up["kernel"].nbytes + up["bias"].nbytes)


  @pytest.mark.parametrize("flavour", ["jax.checkpoint", "nnx.remat"])
  def test_remat_flavours_equal_jit_and_fit_a_budget_only_remat_fits(
      self, pool, flavour):
    depth, width = 4, 64
    x = np.random.default_rng(4).normal(size=(256, width)).astype(np.float32)

    class Layer(nnx.Module):
      def __init__(self, rngs):
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

      def __call__(self, h):
        return h + self.down(nnx.gelu(self.up(h)))

    layers = [Layer(nnx.Rngs(i)) for i in range(depth)]
    graphdef, params = nnx.split(nnx.List(layers))

    def tower(params, x, remat):
      blocks = nnx.merge(graphdef, params)
      for block in blocks:
        if not remat:
          x = block(x)
        elif flavour == "nnx.remat":
          x = nnx.remat(lambda b, h: b(h))(block, x)
        else:
          b_def, b_state = nnx.split(block)
          x = jax.checkpoint(
              lambda s, h: nnx.merge(b_def, s)(h))(b_state, x)
      return jnp.mean(x ** 2)

    tx = optax.sgd(0.05)
    steps, needs = {}, {}
    for remat in (False, True):
      def step(params, opt_state, x, remat=remat):
        loss, grads = jax.value_and_grad(tower)(params, x, remat)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
      steps[remat] = step
      placed = jcxl.place((params, tx.init(params)), "cxl", pool=pool)
      needs[remat] = jcxl.cxl_offload(step).device_need(*placed, x)
    assert needs[True] < needs[False], needs

    # Under a budget between the two, the remat step runs, equal to jit;
    # the other is refused before it runs.
    budget = (needs[True] + needs[False]) // 2
    placed = jcxl.place((params, tx.init(params)), "cxl", pool=pool)
    with pytest.raises(MemoryError):
      jcxl.cxl_offload(steps[False], device_budget=budget)(*placed, x)
    ref = (params, tx.init(params))
    offloaded = jcxl.cxl_offload(steps[True], device_budget=budget)
    for _ in range(STEPS):
      *ref, ref_loss = jax.jit(steps[True])(*ref, x)
      *placed, loss = offloaded(*placed, x)
      np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    assert_close(placed, ref)


# ------------------------------------------------------------------- NNX


class Mlp(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.encoder = nnx.Linear(FEATURES, 32, rngs=rngs)
    self.dropout = nnx.Dropout(0.3, rngs=rngs)
    self.head = nnx.Linear(32, CLASSES, rngs=rngs)

  def __call__(self, x):
    return self.head(self.dropout(nnx.relu(self.encoder(x))))


def nnx_loss(model, batch):
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]).mean()


def nnx_pair():
  model = Mlp(nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


class NnxTest:

  def test_functional_style(self, pool):
    graphdef, state = nnx.split(nnx_pair())

    def train_step(state, batch):
      model, optimizer = nnx.merge(graphdef, state)
      loss, grads = nnx.value_and_grad(nnx_loss)(model, batch)
      optimizer.update(model, grads)
      return nnx.state((model, optimizer)), loss

    placed = jcxl.place(state, "cxl", pool=pool)
    ref, placed, _ = run_both(train_step, state, placed, batches())
    assert_close(placed, ref)

  @pytest.mark.parametrize("returns_loss", [True, False])
  def test_in_place_style(self, pool, returns_loss):
    def train_step(model, optimizer, batch):
      loss, grads = nnx.value_and_grad(nnx_loss)(model, batch)
      optimizer.update(model, grads)
      return loss if returns_loss else None

    ref_model, ref_optimizer = nnx_pair()
    model, optimizer = nnx_pair()
    model = jcxl.place(model, "cxl", pool=pool)
    optimizer = jcxl.place(optimizer, "cxl", pool=pool)
    resident = nnx.jit(train_step)
    offloaded = jcxl.cxl_offload(train_step)
    for batch in batches():
      ref_loss = resident(ref_model, ref_optimizer, batch)
      loss = offloaded(model, optimizer, batch)
      if returns_loss:
        np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
      else:
        assert loss is None
    assert_close(nnx.state(model), nnx.state(ref_model))
    assert_close(nnx.state(optimizer), nnx.state(ref_optimizer))
    # A module's parameters and their optimizer moments are one layer,
    # named by the module's path.
    layers = {l.name: l.nbytes for l in offloaded.plan.layers}
    for name in ("encoder", "head"):
      linear = getattr(ref_model, name)
      params = linear.kernel[...].nbytes + linear.bias[...].nbytes
      assert layers[f"['{name}']"] == 3 * params  # value, mu, nu

  def test_in_place_update_of_a_device_variable_is_written_back(self,
                                                                 pool):
    def train_step(model, batch):
      grads = nnx.grad(nnx_loss)(model, batch)
      model.head.kernel[...] -= 0.1 * grads.head.kernel[...]

    ref, _ = nnx_pair()
    model, _ = nnx_pair()
    model = jcxl.place(model, [(r"head", "device"), (r".*", "cxl")],
                       pool=pool)
    assert not is_pool_array(model.head.kernel[...])
    offloaded = jcxl.cxl_offload(train_step)
    for batch in batches():
      nnx.jit(train_step)(ref, batch)
      assert offloaded(model, batch) is None
    assert not is_pool_array(model.head.kernel[...])
    assert_close(nnx.state(model), nnx.state(ref))

  def test_metrics_updated_in_place(self, pool):
    def train_step(model, optimizer, metrics, batch):
      def loss_fn(model):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["y"]).mean(), logits
      (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(
          model)
      optimizer.update(model, grads)
      metrics.update(loss=loss, logits=logits, labels=batch["y"])

    def metrics():
      return nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                             loss=nnx.metrics.Average("loss"))

    ref_model, ref_optimizer = nnx_pair()
    ref_metrics = metrics()
    model, optimizer = nnx_pair()
    model = jcxl.place(model, "cxl", pool=pool)
    optimizer = jcxl.place(optimizer, "cxl", pool=pool)
    offloaded_metrics = metrics()
    offloaded = jcxl.cxl_offload(train_step)
    for batch in batches():
      nnx.jit(train_step)(ref_model, ref_optimizer, ref_metrics, batch)
      offloaded(model, optimizer, offloaded_metrics, batch)
    assert int(offloaded_metrics.accuracy.count[...]) == STEPS * BATCH
    assert_close(nnx.state(offloaded_metrics), nnx.state(ref_metrics))
    assert_close(offloaded_metrics.compute(), ref_metrics.compute())
    assert_close(nnx.state(model), nnx.state(ref_model))


# ------------------------------------------ keyword, static, donated args


class ArgumentsTest:

  def test_keyword_static_and_donated_arguments(self, pool):
    state = linen_state()

    def train_step(state, batch, *, scale, train):
      rng, dropout = jax.random.split(state.rng)

      def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"], train=train,
                                rngs={"dropout": dropout})
        return scale * optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["y"]).mean()

      loss, grads = jax.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads).replace(rng=rng), loss

    options = dict(static_argnames="train", donate_argnames="batch")
    resident = jax.jit(train_step, **options)
    offloaded = jcxl.cxl_offload(train_step, **options)
    placed = jcxl.place(state, "cxl", pool=pool)
    for i, batch in enumerate(batches()):
      train = i % 2 == 0
      ref_batch = jax.tree.map(jnp.asarray, batch)
      off_batch = jax.tree.map(jnp.asarray, batch)
      state, ref_loss = resident(state, scale=jnp.float32(2.0),
                                 batch=ref_batch, train=train)
      placed, loss = offloaded(placed, scale=jnp.float32(2.0),
                               batch=off_batch, train=train)
      np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    assert offloaded.compiles == 2  # one per value of the static `train`
    assert_close(placed, state)

  def test_static_argnums_and_positional_donation(self, pool):
    params = {"w": np.ones((FEATURES, CLASSES), np.float32)}

    def step(params, x, lr):
      grads = jax.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(params)
      return jax.tree.map(lambda p, g: p - lr * g, params, grads), x * 2

    options = dict(static_argnums=2, donate_argnums=1)
    resident = jax.jit(step, **options)
    offloaded = jcxl.cxl_offload(step, **options)
    ref, placed = params, jcxl.place(params, "cxl", pool=pool)
    for batch in batches():
      x1, x2 = jnp.asarray(batch["x"]), jnp.asarray(batch["x"])
      ref, ref_sum = resident(ref, x1, 0.01)
      placed, total = offloaded(placed, x2, 0.01)
      assert x1.is_deleted() and x2.is_deleted()  # its buffer reused
      np.testing.assert_allclose(total, ref_sum, rtol=RTOL)
    assert_close(placed, ref)
    with pytest.raises(TypeError, match="static argument .* hashable"):
      offloaded(placed, jnp.ones((BATCH, FEATURES)), [0.01])


# ---------------------------------------------------------- placed leaves


class PlacedLeavesTest:

  def test_python_scalars_get_jnp_asarray_dtypes(self, pool):
    tree = {"step": 0, "lr": 0.1, "flag": True, "wide": np.arange(3)}
    placed = jcxl.place(tree, "cxl", pool=pool)
    for name, value in tree.items():
      assert placed[name].dtype == jnp.asarray(value).dtype, name
    assert_close(placed, jax.tree.map(jnp.asarray, tree))

  def test_a_python_int_too_large_for_its_dtype_is_refused(self, pool):
    dtype = jnp.asarray(1).dtype
    big = int(np.iinfo(dtype).max) + 1
    with pytest.raises(OverflowError, match=r"\['big'\].* does not fit"):
      jcxl.place({"big": big}, "cxl", pool=pool)
    assert pool.handles() == []  # nothing half-placed is left

  def test_optimizer_init_over_placed_params_equals_init_over_values(
      self, pool):
    # optax maps jnp.zeros_like over the leaves: PoolArrays read as arrays.
    tx = optax.adam(1e-3)
    params = {"w": np.ones((4, 4), np.float32), "b": np.zeros(4, np.float32)}
    placed = jcxl.place(params, "cxl", pool=pool)
    opt_state = tx.init(placed)
    assert not any(is_pool_array(x) for x in jax.tree.leaves(opt_state))
    assert_close(opt_state, tx.init(params))

    def step(params, opt_state):
      grads = jax.tree.map(jnp.ones_like, params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state
    want = jax.jit(step)(params, tx.init(params))
    got = jcxl.cxl_offload(step)(placed, opt_state)
    assert_close(got, want)

  def test_typed_keys_stay_on_the_device_as_keys(self, pool):
    key = jax.random.key(7)
    placed = jcxl.place({"key": key, "w": np.ones(3, np.float32)}, "cxl",
                        pool=pool)
    assert isinstance(placed["key"], jax.Array)
    assert jax.dtypes.issubdtype(placed["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(placed["key"]),
                                  jax.random.key_data(key))
    assert is_pool_array(placed["w"])

  def test_a_helper_under_its_own_jit_fetches_placed_state(self, pool):
    params = linen_state().params
    placed = jcxl.place(params, "cxl", pool=pool)

    @jax.jit
    def head_norm(params, x):  # an eval helper, jitted on its own
      h = jnp.tanh(jnp.dot(x, params["encoder"]["kernel"]) +
                   jnp.asarray(params["encoder"]["bias"]))
      return jnp.linalg.norm(h @ params["head"]["kernel"])

    x = batches()[0]["x"]
    np.testing.assert_allclose(head_norm(placed, x), head_norm(params, x),
                               rtol=RTOL)
    assert_close(placed, params)  # read, not written

  def test_parameter_count_idiom(self, pool):
    params = linen_state().params
    placed = jcxl.place(params, "cxl", pool=pool)
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
    assert count(placed) == count(params) > 0
    assert all(is_pool_array(x) for x in jax.tree.leaves(placed))
    shapes = jax.tree.map(lambda x: x.shape, placed)
    assert shapes == jax.tree.map(lambda x: x.shape, params)


# ---------------------------------------------------------------- errors


class ErrorsTest:

  def test_structure_error_leads_with_the_first_difference(self, pool):
    state = linen_state()
    placed = jcxl.place(state, "cxl", pool=pool)

    def bad_step(state, batch):
      params = dict(state.params)
      del params["head"]
      return state.replace(params=params), batch["x"].sum()

    with pytest.raises(ValueError) as error:
      jcxl.cxl_offload(bad_step)(placed, batches()[0])
    message = str(error.value)
    first_line = message.split(". ")[0]
    assert "output 0 differs from argument 0 (state)" in first_line
    assert ".params['head']: missing" in first_line
    assert len(message) < 700, len(message)

  def test_the_same_pool_array_as_two_state_arguments(self, pool):
    w = jcxl.place(np.ones((4, 4), np.float32), "cxl", pool=pool)

    def step(a, b):
      return {"w": a["w"] + 1}, {"w": b["w"] * 2}

    with pytest.raises(ValueError, match=r"same pool array as a\['w'\] and "
                       r"as b\['w'\]"):
      jcxl.cxl_offload(step)({"w": w}, {"w": w})
    np.testing.assert_array_equal(jcxl.gather(w), np.ones((4, 4)))

  def test_a_stalled_fetch_fails_within_the_pool_timeout(self, pool):
    w = jcxl.place(np.ones((64, 64), np.float32), "cxl", pool=pool)
    step = jcxl.cxl_offload(lambda w, x: (w, jnp.sum(w * x)))
    assert float(jax.block_until_ready(step(w, 1.0)[1])) == 64 * 64
    pool._inject_fault("stall", tier="cxl")
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match="did not finish within 500 ms"):
      jax.block_until_ready(step(w, 2.0))


# ------------------------------------------------------------------ plan


class PlanTableTest:

  def test_attention_projections_are_told_apart(self, pool):
    class Attention(nn.Module):
      @nn.compact
      def __call__(self, x):
        q, k, v = (nn.Dense(8, name=n)(x) for n in ("query", "key", "value"))
        a = jax.nn.softmax(q @ k.T) @ v
        return nn.Dense(8, name="out")(a)

    class Deep(nn.Module):
      @nn.compact
      def __call__(self, x):
        return Attention(name="transformer_block_with_a_long_name_0_attn")(x)

    x = np.ones((2, 8), np.float32)
    params = Deep().init(jax.random.key(0), x)["params"]
    step = jcxl.cxl_offload(
        lambda p, x: (p, Deep().apply({"params": p}, x).sum()))
    placed = jcxl.place(params, "cxl", pool=pool)
    step(placed, x)
    _, profile = step.measured_call(placed, x)
    for table in (step.plan.table(), profile.table()):
      for name in ("query", "key", "value", "out"):
        assert (f"['transformer_block_with_a_long_name_0_attn']['{name}']"
                in table), table


# ------------------------------------- update='host': refetch by budget


def mlp_params(sizes=(FEATURES, 64, 64, CLASSES)):
  keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
  return {f"layer{i}": {"w": jax.random.normal(k, (m, n)) / m**0.5,
                        "b": jnp.zeros(n)}
          for i, (k, m, n) in enumerate(zip(keys, sizes, sizes[1:]))}


def mlp_step(params, opt_state, batch):
  def loss_fn(params):
    x = batch["x"]
    for i in range(len(params)):
      x = x @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
      x = jnp.tanh(x) if i < len(params) - 1 else x
    return optax.softmax_cross_entropy_with_integer_labels(
        x, batch["y"]).mean()
  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = optax.adamw(1e-2).update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


class RefetchTest:

  def _run(self, pool, **offload):
    """mlp_step under jax.jit and cxl_offload(update='host'): the step,
    and the bytes the last offloaded step read from the pool."""
    params = mlp_params()
    ref = (params, optax.adamw(1e-2).init(params))
    placed = tuple(jcxl.place(t, "cxl", pool=pool) for t in ref)
    step = jcxl.cxl_offload(mlp_step, update="host", **offload)
    for batch in batches():
      *ref, ref_loss = jax.jit(mlp_step)(*ref, batch)
      before = pool.stats()["cxl"].bytes_read
      *placed, loss = step(*placed, batch)
      np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
      read = pool.stats()["cxl"].bytes_read - before
    assert_close(tuple(placed), tuple(ref))
    return step, read

  def test_weights_are_kept_by_default_and_refetched_on_request(self, pool):
    kept, read_kept = self._run(pool)
    again, read_again = self._run(pool, refetch=True)
    # Each weight the backward pass reads comes in once a step, not twice
    # (the first layer's is not read there: no gradient flows to x).
    assert read_again - read_kept == 4 * (64 * 64 + 64 * CLASSES)
    assert any(line.startswith("refetch=False: each weight is kept")
               for line in kept.plan.updates), kept.plan.updates
    assert "refetch=True: as given (refetch=True)" in again.plan.updates

  def test_kept_weights_over_the_budget_are_refetched(self, pool,
                                                      monkeypatch):
    # A device where keeping the weights is over the budget: the first
    # compile (weights kept) reports a need past it.
    from jcxl._src.offload import step as step_lib
    real, calls = step_lib.device_need, []

    def need(analysis):
      calls.append(None)
      return 2**40 if len(calls) == 1 else real(analysis)
    monkeypatch.setattr(step_lib, "device_need", need)
    step, _ = self._run(pool, device_budget="64MiB")
    assert step.compiles == 2
    assert any(line.startswith("refetch=True: keeping each weight")
               and "over device_budget (64.00 MiB)" in line
               for line in step.plan.updates), step.plan.updates
