"""Tests for the model zoo in models/: shapes, training, forms, counts.

XLA compiles are the cost here (about 0.2 s even for a trivial program on a
2-core CI box), so each family and form compiles one train step, which also
returns the first step's logits; the shape, training and unrolled-vs-scanned
checks share those results.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import common
from models import gpt2
from models import llama
from models import mlp
from models import vit

BF16 = jnp.dtype(jnp.bfloat16)
FAMILIES = {"gpt2": gpt2, "llama": llama, "vit": vit, "mlp": mlp}
STEPS = 4


# XLA:CPU options that cut compile time, most of this file's run time, by
# about 3x (the older fusion emitters, no LLVM optimisation); the programs
# are tiny, so how fast they run does not matter.
_FAST_COMPILE = {"xla_backend_optimization_level": 0,
                 "xla_llvm_disable_expensive_passes": True,
                 "xla_cpu_use_fusion_emitters": False}


def _compile(fn, *args):
  return jax.jit(fn).lower(*args).compile(_FAST_COMPILE)


def _batch(name: str, config) -> dict:
  if name in ("gpt2", "llama"):
    return FAMILIES[name].example_batch(config, batch_size=2, seq_len=16)
  return FAMILIES[name].example_batch(config)


def _numpy_init(abstract: common.Params, seed: int = 0) -> common.Params:
  """Parameters for `abstract` from numpy (no XLA compile): scales 1,
  biases and the class token 0, other leaves N(0, 1 / fan_in)."""
  rng = np.random.default_rng(seed)

  def init(path, leaf):
    name = path[-1].key
    if name == "scale":
      return jnp.ones(leaf.shape, leaf.dtype)
    if name in ("bias", "cls_token"):
      return jnp.zeros(leaf.shape, leaf.dtype)
    fan_in = math.prod(leaf.shape[:-1]) if name == "kernel" else 50
    return jnp.asarray(rng.standard_normal(leaf.shape) / math.sqrt(fan_in),
                       leaf.dtype)

  return jax.tree_util.tree_map_with_path(init, abstract)


@functools.cache
def _unrolled_params(name: str) -> common.Params:
  config = FAMILIES[name].tiny()
  _, abstract = common.functional(common.abstract_model(config))
  return _numpy_init(abstract)


@functools.cache
def _train(name: str, scan: bool) -> tuple[np.ndarray, np.ndarray]:
  """Losses of STEPS adamw steps on one batch, and the first step's logits.

  The scanned form starts from the unrolled form's weights, stacked.
  """
  family = FAMILIES[name]
  config = family.tiny(scan_layers=scan)
  params = _unrolled_params(name)
  if scan:
    params = common.stack_layers(params)
  batch = _batch(name, config)
  loss_fn = family.make_loss(config, return_logits=True)
  opt = optax.adamw(1e-2)

  def step(params, opt_state, batch):
    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, logits

  opt_state = opt.init(params)
  step = _compile(step, params, opt_state, batch)
  losses, first_logits = [], None
  for _ in range(STEPS):
    params, opt_state, loss, logits = step(params, opt_state, batch)
    losses.append(float(loss))
    first_logits = logits if first_logits is None else first_logits
  return np.asarray(losses), np.asarray(first_logits)


def _expected_logits_shape(name: str, config) -> tuple[int, ...]:
  if name in ("gpt2", "llama"):
    return (2, 16, config.vocab_size)
  if name == "vit":
    return (2, config.num_classes)
  return (8, config.out_dim)


CASES = [(name, scan) for name in FAMILIES for scan in (False, True)]
IDS = [f"{name}-{'scanned' if scan else 'unrolled'}" for name, scan in CASES]


class TrainTest:

  @pytest.mark.parametrize(("name", "scan"), CASES, ids=IDS)
  def test_forward_shape(self, name, scan):
    config = FAMILIES[name].tiny(scan_layers=scan)
    _, logits = _train(name, scan)
    assert logits.shape == _expected_logits_shape(name, config)
    assert np.isfinite(logits).all()

  @pytest.mark.parametrize(("name", "scan"), CASES, ids=IDS)
  def test_adamw_lowers_loss(self, name, scan):
    losses, _ = _train(name, scan)
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.05, losses


class FormsTest:

  @pytest.mark.parametrize("name", list(FAMILIES))
  def test_unrolled_and_scanned_compute_the_same_function(self, name):
    losses_u, logits_u = _train(name, False)
    losses_s, logits_s = _train(name, True)
    np.testing.assert_allclose(logits_s, logits_u, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(losses_s, losses_u, rtol=1e-4, atol=1e-5)

  @pytest.mark.parametrize("name", list(FAMILIES))
  def test_param_paths(self, name):
    config = FAMILIES[name].tiny()
    unrolled = _unrolled_params(name)
    num_layers = sum(k.startswith("blocks_") for k in unrolled)
    assert num_layers >= 2 and "blocks" not in unrolled
    stacked = common.stack_layers(unrolled)
    assert not any(k.startswith("blocks_") for k in stacked)
    leading = {x.shape[0] for x in jax.tree.leaves(stacked["blocks"])}
    assert leading == {num_layers}
    _, abstract = common.functional(
        common.abstract_model(FAMILIES[name].tiny(scan_layers=True)))
    assert (jax.tree.map(jnp.shape, stacked)
            == jax.tree.map(lambda x: x.shape, abstract))
    back = common.unstack_layers(stacked)
    jax.tree.map(np.testing.assert_array_equal, back, unrolled)
    assert common.count_params(config) == sum(
        x.size for x in jax.tree.leaves(unrolled))

  def test_same_seed_gives_same_weights_in_both_forms(self):
    unrolled = mlp.MLP(mlp.tiny(), rngs=nnx.Rngs(3))
    scanned = mlp.MLP(mlp.tiny(scan_layers=True), rngs=nnx.Rngs(3))
    params_u = common.pure_params(unrolled)
    params_s = common.pure_params(scanned)
    jax.tree.map(np.testing.assert_array_equal,
                 common.init_params(mlp.tiny(), seed=3), params_u)
    jax.tree.map(np.testing.assert_array_equal,
                 common.stack_layers(params_u), params_s)
    apply_u, functional_params = common.functional(unrolled)
    jax.tree.map(np.testing.assert_array_equal, functional_params, params_u)
    apply_s, _ = common.functional(scanned)
    x = mlp.example_batch(mlp.tiny())["x"]
    both = lambda pu, ps, x: (apply_u(pu, x), apply_s(ps, x))
    logits_u, logits_s = _compile(both, params_u, params_s, x)(
        params_u, params_s, x)
    np.testing.assert_allclose(logits_s, logits_u, rtol=1e-5, atol=1e-5)

  def test_layers_of_different_sizes(self):
    config = mlp.wide_narrow(narrow=8, wide=32, num_blocks=4)
    assert config.widths == (8, 32, 8, 32, 8)
    _, params = common.functional(common.abstract_model(config))
    shapes = [params[f"blocks_{i}"]["linear"]["kernel"].shape
              for i in range(4)]
    assert shapes == [(8, 32), (32, 8), (8, 32), (32, 8)]
    with pytest.raises(ValueError, match="differ in shape"):
      common.stack_layers(params)
    with pytest.raises(ValueError, match="widths"):
      mlp.wide_narrow(narrow=8, wide=32, num_blocks=4, scan_layers=True)


class ScanJaxprTest:

  @staticmethod
  def _scans(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "scan":
        yield eqn

  @pytest.mark.parametrize("name", list(FAMILIES))
  def test_stacked_params_are_scan_xs(self, name):
    family = FAMILIES[name]
    config = family.tiny(scan_layers=True)
    params = common.stack_layers(_unrolled_params(name))
    batch = _batch(name, config)
    flat, _ = jax.tree_util.tree_flatten_with_path((params, batch))
    stacked_positions = [
        i for i, (path, _) in enumerate(flat)
        if path[0].idx == 0 and path[1].key == "blocks"]
    kernel_positions = [i for i in stacked_positions
                        if flat[i][0][-1].key == "kernel"]
    assert stacked_positions and kernel_positions
    loss = family.make_loss(config)
    for fn, directions in ((loss, [False]),
                           (jax.value_and_grad(loss), [False, True])):
      closed = jax.make_jaxpr(fn)(params, batch)
      invars = closed.jaxpr.invars
      stacked_vars = {invars[i] for i in stacked_positions}
      scans = list(self._scans(closed.jaxpr))
      assert scans, "no top-level scan"
      for scan in scans:
        num_consts = scan.params["num_consts"]
        xs = set(scan.invars[num_consts + scan.params["num_carry"]:])
        assert not stacked_vars & set(scan.invars[:num_consts])
        if scan.params["reverse"]:
          # The backward pass reads the weights again: straight from the
          # stacked params too, not from copies saved by the forward scan.
          assert {invars[i] for i in kernel_positions} <= xs
        else:
          assert stacked_vars <= xs, "stacked params are not scan xs"
      assert [scan.params["reverse"] for scan in scans] == directions


PUBLISHED = {
    "gpt2-small": (gpt2.small(), 124_439_808),
    "gpt2-medium": (gpt2.medium(), 354_823_168),
    "gpt2-large": (gpt2.large(), 774_030_080),
    "gpt2-xl": (gpt2.xl(), 1_557_611_200),
    "llama3.2-1b": (llama.llama3_1b(), 1_235_814_400),
    "llama2-7b": (llama.llama2_7b(), 6_738_415_616),
    "vit-b16": (vit.base(), 86_567_656),
}


class CountParamsTest:

  @pytest.mark.parametrize(("config", "expected"), list(PUBLISHED.values()),
                           ids=list(PUBLISHED))
  def test_published_sizes(self, config, expected):
    assert common.count_params(config) == expected

  def test_scanned_form_counts_the_same(self):
    config = gpt2.xl(scan_layers=True)
    assert common.count_params(config) == 1_557_611_200

  def test_accepts_model_function_and_module(self):
    make = lambda: vit.ViT(vit.tiny(), rngs=nnx.Rngs(0))
    expected = common.count_params(vit.tiny())
    assert common.count_params(make) == expected
    assert common.count_params(common.abstract_model(make)) == expected
    with pytest.raises(TypeError, match="spec"):
      common.count_params(3)


class ConfigTest:

  @pytest.mark.parametrize(("make", "field"), [
      (lambda: gpt2.tiny(n_embd=65), "n_embd must be divisible by n_head"),
      (lambda: gpt2.tiny(n_layer=0), "n_layer must be positive"),
      (lambda: llama.tiny(n_kv_heads=3), "n_heads must be divisible by "
       "n_kv_heads"),
      (lambda: llama.tiny(dim=66), "dim must be divisible by n_heads"),
      (lambda: vit.tiny(image_size=30), "image_size must be divisible by "
       "patch_size"),
      (lambda: vit.tiny(num_heads=5), "dim must be divisible by num_heads"),
      (lambda: mlp.tiny(widths=()), "widths"),
      (lambda: mlp.tiny(activation="tanh"), "activation"),
      (lambda: gpt2.tiny(dtype=jnp.int32), "dtype"),
      (lambda: llama.tiny(head_dim=15), "head_dim must be even"),
      (lambda: llama.tiny(rope_theta=0.0), "rope_theta must be positive"),
      (lambda: common.stack_layers({"embed": {}}), "blocks_0"),
      (lambda: common.stack_layers({"blocks_1": {}}), "blocks_0"),
      (lambda: common.unstack_layers({"blocks_0": {}}), "'blocks'"),
  ])
  def test_bad_value_names_field(self, make, field):
    with pytest.raises(ValueError, match=field):
      make()

  def test_wrong_type(self):
    with pytest.raises(TypeError, match="n_head"):
      gpt2.tiny(n_head=4.0)

  @pytest.mark.parametrize("family", list(FAMILIES.values()),
                           ids=list(FAMILIES))
  def test_unknown_preset(self, family):
    with pytest.raises(ValueError, match="name must be one of 'tiny'"):
      family.preset("huge")
    assert family.preset("tiny") == family.tiny()

  def test_configs_are_frozen_and_keyword_only(self):
    config = gpt2.tiny()
    with pytest.raises(AttributeError):
      config.n_layer = 3
    with pytest.raises(TypeError):
      gpt2.GPT2Config(256)

  @pytest.mark.parametrize(("name", "shape", "dtype", "field"), [
      ("gpt2", (1, 65), jnp.int32, "n_ctx=64"),
      ("llama", (1, 65), jnp.int32, "max_seq_len=64"),
      ("vit", (1, 32, 32, 1), jnp.float32, r"images must have shape"),
  ])
  def test_bad_input_shape(self, name, shape, dtype, field):
    config = FAMILIES[name].tiny()
    apply, params = common.functional(common.abstract_model(config))
    with pytest.raises(ValueError, match=field):
      jax.eval_shape(apply, params, jax.ShapeDtypeStruct(shape, dtype))


class DtypeTest:

  @pytest.mark.parametrize("name", list(FAMILIES))
  def test_bfloat16_compute_and_params(self, name):
    family = FAMILIES[name]
    config = family.tiny(scan_layers=True, dtype=jnp.bfloat16,
                         param_dtype=jnp.bfloat16)
    apply, params = common.functional(common.abstract_model(config))
    assert {x.dtype for x in jax.tree.leaves(params)} == {BF16}
    batch = _batch(name, config)
    logits = jax.eval_shape(apply, params, batch["x"])
    assert logits.dtype == jnp.bfloat16
    loss, grads = jax.eval_shape(jax.value_and_grad(family.make_loss(config)),
                                 params, batch)
    assert loss.dtype == jnp.float32
    assert {x.dtype for x in jax.tree.leaves(grads)} == {BF16}


class LlamaTest:

  def test_tied_embeddings_have_no_head(self):
    config = llama.tiny(tie_embeddings=True)
    apply, params = common.functional(common.abstract_model(config))
    assert "lm_head" not in params and "lm_head" in _unrolled_params("llama")
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    assert jax.eval_shape(apply, params, tokens).shape == (2, 16, 256)

  def test_grouped_query_attention_shapes(self):
    params = _unrolled_params("llama")
    config = llama.tiny()
    qkv = params["blocks_0"]["attn"]["qkv"]["kernel"]
    head_dim = config.dim // config.n_heads
    assert qkv.shape == (config.dim,
                         (config.n_heads + 2 * config.n_kv_heads) * head_dim)


class CrossEntropyTest:

  def test_matches_optax(self):
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 7)),
                         jnp.float32)
    labels = jnp.asarray(np.arange(15).reshape(3, 5) % 7)
    where = jnp.asarray(np.arange(15).reshape(3, 5) % 4 != 0)

    def both(logits, labels, where):
      reference = optax.softmax_cross_entropy_with_integer_labels(
          logits, labels)
      return (common.cross_entropy(logits, labels), reference.mean(),
              common.cross_entropy(logits, labels, where=where),
              reference.sum(where=where) / where.sum())

    ours, expected, ours_masked, expected_masked = _compile(
        both, logits, labels, where)(logits, labels, where)
    np.testing.assert_allclose(ours, expected, rtol=1e-6)
    np.testing.assert_allclose(ours_masked, expected_masked, rtol=1e-6)
