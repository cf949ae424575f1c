"""Shared layers and the functional interface of the model zoo.

Every family builds an ``nnx.Module``; the offload runtime wants pure
functions of pure pytrees instead. ``functional(model)`` splits a module into
an ``apply(params, *inputs)`` function and a nested dict of arrays whose key
paths name the modules (``params['blocks_3']['attn']['qkv']['kernel']``).

Deep stacks come in two forms. Unrolled: one module per layer,
``blocks_0 .. blocks_{L-1}``. Scanned: one module ``blocks`` whose parameters
carry a leading layer axis, applied by ``scan_layers`` with a plain
``jax.lax.scan`` whose xs are those stacked parameters (the runtime streams
scan xs one layer at a time, so they must not be closed-over constants).
``stack_layers`` / ``unstack_layers`` convert parameters between the forms.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

Params = dict[str, Any]
Dtype = Any
ApplyFn = Callable[..., Any]

default_kernel_init = nnx.initializers.lecun_normal()


class Buildable(Protocol):
  """A config that knows its model: ``config.build(rngs=...)``."""

  def build(self, *, rngs: nnx.Rngs) -> nnx.Module:
    ...


# ---------------------------------------------------------------------------
# Config validation.


def check_positive(config: Any, *names: str) -> None:
  """Raises unless each named field of `config` is a positive int."""
  for name in names:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int):
      raise TypeError(f"{type(config).__name__}.{name} must be an int, but "
                      f"got {value!r}")
    if value <= 0:
      raise ValueError(f"{type(config).__name__}.{name} must be positive, "
                       f"but got {value}")


def check_divisible(config: Any, name: str, by: str) -> None:
  """Raises ValueError unless field `name` is a multiple of field `by`."""
  value, divisor = getattr(config, name), getattr(config, by)
  if value % divisor:
    raise ValueError(
        f"{type(config).__name__}.{name} must be divisible by {by}, but got "
        f"{name}={value} and {by}={divisor}")


def check_dtypes(config: Any, *names: str) -> None:
  """Raises ValueError unless each named field is a floating dtype."""
  for name in names:
    value = getattr(config, name)
    try:
      dtype = jnp.dtype(value)
    except TypeError:
      dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(f"{type(config).__name__}.{name} must be a floating "
                       f"dtype such as jnp.float32, but got {value!r}")


def lookup_preset(presets: dict[str, Callable[..., Any]], name: str,
                  **overrides: Any) -> Any:
  """Returns ``presets[name](**overrides)``; ValueError naming `name`."""
  if name not in presets:
    raise ValueError(f"name must be one of {', '.join(map(repr, presets))}, "
                     f"but got {name!r}")
  return presets[name](**overrides)


# ---------------------------------------------------------------------------
# Functional interface.


def pure_params(model: nnx.Module) -> Params:
  """Returns the model's ``nnx.Param`` leaves as a nested dict of arrays."""
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def functional(model: nnx.Module) -> tuple[ApplyFn, Params]:
  """Splits `model` into a pure apply function and its parameters.

  `model` may be abstract (from ``abstract_model``); the parameters are then
  ``jax.ShapeDtypeStruct``s and nothing is allocated. Non-parameter state,
  if a model had any, is captured by `apply` as a constant.

  Returns:
    ``(apply, params)``: ``apply(params, *inputs, **kwargs)`` merges `params`
    into the module's graph definition and calls it; `params` is a nested
    dict of arrays keyed by module path.

  Example:
    >>> apply, params = functional(gpt2.GPT2(gpt2.tiny(), rngs=nnx.Rngs(0)))
    >>> loss = lambda p, b: cross_entropy(apply(p, b['x']), b['y'])
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rest = (rest,) if jax.tree.leaves(rest) else ()

  def apply(params: Params, *args: Any, **kwargs: Any) -> Any:
    return nnx.merge(graphdef, params, *rest)(*args, **kwargs)

  return apply, nnx.to_pure_dict(params)


def abstract_model(spec: Buildable | Callable[[], nnx.Module] | nnx.Module
                   ) -> nnx.Module:
  """Returns the model of `spec` with ShapeDtypeStruct leaves (no allocation).

  Args:
    spec: a config with a ``build(rngs=...)`` method, a zero-argument
      function returning a module, or a module (returned as is).
  """
  if isinstance(spec, nnx.Module):
    return spec
  if hasattr(spec, "build"):
    return nnx.eval_shape(lambda: spec.build(rngs=nnx.Rngs(0)))
  if callable(spec):
    return nnx.eval_shape(spec)
  raise TypeError("spec must be a model config, a function returning an "
                  "nnx.Module, or an nnx.Module, but got "
                  f"{type(spec).__name__}")


def count_params(spec: Buildable | Callable[[], nnx.Module] | nnx.Module
                 ) -> int:
  """Number of parameter scalars of `spec`, from abstract shapes only."""
  leaves = jax.tree.leaves(nnx.state(abstract_model(spec), nnx.Param))
  return sum(math.prod(leaf.shape) for leaf in leaves)


@functools.lru_cache(maxsize=64)
def make_apply(config: Buildable) -> ApplyFn:
  """``apply(params, *inputs)`` for `config`'s model, built abstractly."""
  return functional(abstract_model(config))[0]


@functools.lru_cache(maxsize=16)
def _jitted_init(config: Buildable) -> Callable[[jax.Array], Params]:
  return jax.jit(lambda key: pure_params(config.build(rngs=nnx.Rngs(key))))


def init_params(config: Buildable, *, seed: int = 0) -> Params:
  """Parameters of ``config.build(rngs=nnx.Rngs(seed))``, in one jitted call.

  Equal to ``pure_params`` of the eagerly built module, but compiled once
  per config instead of dispatching every initialiser separately.
  """
  return _jitted_init(config)(jax.random.key(seed))


def make_loss(config: Buildable, *, return_logits: bool = False
              ) -> Callable[[Params, dict], Any]:
  """``loss(params, batch)``: mean cross-entropy of ``apply(batch['x'])``.

  ``batch['y']`` holds integer labels with the leading shape of the logits
  (next tokens for language models, classes for classifiers).

  Args:
    config: the model's config.
    return_logits: make the loss return ``(loss, logits)``, for
      ``jax.value_and_grad(..., has_aux=True)``.
  """
  apply = make_apply(config)

  def loss(params: Params, batch: dict) -> Any:
    logits = apply(params, batch["x"])
    value = cross_entropy(logits, batch["y"])
    return (value, logits) if return_logits else value

  return loss


def cross_entropy(logits: jax.Array, labels: jax.Array, *,
                  where: jax.Array | None = None) -> jax.Array:
  """Mean softmax cross-entropy over integer `labels`, computed in float32.

  Args:
    logits: ``[..., num_classes]``.
    labels: integer array with the shape of ``logits`` minus its last axis.
    where: optional boolean mask of that shape; masked entries are left out
      of the mean.
  """
  logits = logits.astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
  return jnp.mean(nll, where=where)


# ---------------------------------------------------------------------------
# Stacked layers.


def _layer_index(prefix: str, key: str) -> int | None:
  match = re.fullmatch(rf"{re.escape(prefix)}_(\d+)", key)
  return int(match.group(1)) if match else None


def stack_layers(params: Params, *, prefix: str = "blocks") -> Params:
  """Unrolled params (``blocks_0 .. blocks_{L-1}``) -> scanned (``blocks``).

  Raises:
    ValueError: if there are no ``{prefix}_i`` entries, the indices are not
      0..L-1, or the layers differ in structure or shape.
  """
  indexed = {i: k for k in params
             if (i := _layer_index(prefix, k)) is not None}
  if sorted(indexed) != list(range(len(indexed))) or not indexed:
    raise ValueError(f"params must hold {prefix}_0 .. {prefix}_{{L-1}}, but "
                     f"got keys {sorted(params)}")
  layers = [params[indexed[i]] for i in range(len(indexed))]
  shapes = {str(jax.tree.map(jnp.shape, layer)) for layer in layers}
  if len(shapes) != 1:
    raise ValueError(f"{prefix}_i layers differ in shape and cannot be "
                     f"stacked: {sorted(shapes)}")
  out = {k: v for k, v in params.items() if k not in indexed.values()}
  out[prefix] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  return out


def unstack_layers(params: Params, *, prefix: str = "blocks") -> Params:
  """Scanned params (``blocks`` with a layer axis) -> unrolled."""
  if prefix not in params:
    raise ValueError(f"params must hold {prefix!r}, but got keys "
                     f"{sorted(params)}")
  stacked = params[prefix]
  num_layers = jax.tree.leaves(stacked)[0].shape[0]
  out = {k: v for k, v in params.items() if k != prefix}
  for i in range(num_layers):
    out[f"{prefix}_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
  return out


def stacked(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int, *,
            rngs: nnx.Rngs) -> nnx.Module:
  """One module whose variables stack `num_layers` fresh layers on axis 0."""

  @nnx.split_rngs(splits=num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs: nnx.Rngs) -> nnx.Module:
    return make_layer(rngs)

  return create(rngs)


def unrolled(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int,
             *, rngs: nnx.Rngs) -> list[nnx.Module]:
  """`num_layers` separate layers, initialised exactly as ``stacked`` would.

  The layers are created stacked (one traced constructor, so building an
  abstract 48-layer model takes well under a second) and then sliced, one
  variable at a time so that at most one stacked variable is alive next to
  the slices. The same `rngs` therefore give the same weights in the
  unrolled and the scanned form.
  """
  stack = stacked(make_layer, num_layers, rngs=rngs)
  graphdef, state = nnx.split(stack)
  del stack
  leaves, treedef = jax.tree.flatten(nnx.to_pure_dict(state))
  del state
  per_layer = [[] for _ in range(num_layers)]
  for j in range(len(leaves)):
    leaf, leaves[j] = leaves[j], None
    for i in range(num_layers):
      per_layer[i].append(leaf[i])
    del leaf
  return [nnx.merge(graphdef, jax.tree.unflatten(treedef, layer))
          for layer in per_layer]


def scan_layers(stack: nnx.Module, x: jax.Array, *args: Any) -> jax.Array:
  """Applies a ``stacked`` module layer by layer with ``jax.lax.scan``.

  The stacked state is the scan's xs; each step merges one layer's slice into
  the layer's graph definition and calls it as ``layer(h, *args)``. `args`
  (e.g. rotary tables) are the same for every layer.
  """
  graphdef, state = nnx.split(stack)
  xs = nnx.to_pure_dict(state)

  def body(h: jax.Array, layer_state: Params) -> tuple[jax.Array, None]:
    return nnx.merge(graphdef, layer_state)(h, *args), None

  h, _ = jax.lax.scan(body, x, xs)
  return h


# ---------------------------------------------------------------------------
# Layers.

_ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


def get_activation(name: str, *, field: str = "activation"
                   ) -> Callable[[jax.Array], jax.Array]:
  """The activation function called `name`; ValueError naming `field`."""
  if name not in _ACTIVATIONS:
    raise ValueError(f"{field} must be one of "
                     f"{', '.join(map(repr, _ACTIVATIONS))}, but got {name!r}")
  return _ACTIVATIONS[name]


def rope_tables(seq_len: int, head_dim: int, *, theta: float
                ) -> tuple[jax.Array, jax.Array]:
  """Rotary ``(cos, sin)``, each ``[seq_len, head_dim // 2]`` float32."""
  inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, jnp.float32)
                             / head_dim)
  angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates ``x: [batch, seq, heads, head_dim]`` (rotate-half convention)."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  cos, sin = cos[:, None, :], sin[:, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                          causal: bool) -> jax.Array:
  """Softmax attention with grouped key/value heads.

  Written with plain einsums rather than ``jax.nn.dot_product_attention``:
  the jaxpr stays easy to read and compiles faster on CPU.

  Args:
    q: ``[batch, seq, heads, head_dim]``.
    k: ``[batch, seq, kv_heads, head_dim]``; ``kv_heads`` divides ``heads``.
    v: like `k`.
    causal: mask out keys after each query.

  Returns:
    ``[batch, seq, heads, head_dim]``.
  """
  batch, seq, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)
  scores = jnp.einsum("btkgh,bskh->bkgts", q, k) / math.sqrt(head_dim)
  scores = scores.astype(jnp.float32)
  if causal:
    mask = jnp.tril(jnp.ones((seq, seq), jnp.bool_))
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
  return out.reshape(batch, seq, heads, head_dim)


class Attention(nnx.Module):
  """Multi-head self-attention with a fused ``qkv`` projection.

  Grouped-query attention when ``num_kv_heads < num_heads``. Parameters:
  ``qkv`` (``[features, (heads + 2 * kv_heads) * head_dim]``) and ``out``.
  """

  def __init__(self, features: int, num_heads: int, *,
               num_kv_heads: int | None = None, head_dim: int | None = None,
               causal: bool, use_bias: bool = True,
               kernel_init: Any = default_kernel_init,
               out_kernel_init: Any = None, dtype: Dtype = jnp.float32,
               param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads or num_heads
    self.head_dim = head_dim or features // num_heads
    self.causal = causal
    width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    self.qkv = nnx.Linear(features, width, use_bias=use_bias,
                          kernel_init=kernel_init, dtype=dtype,
                          param_dtype=param_dtype, rngs=rngs)
    self.out = nnx.Linear(self.num_heads * self.head_dim, features,
                          use_bias=use_bias,
                          kernel_init=out_kernel_init or kernel_init,
                          dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array,
               rope: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    batch, seq, _ = x.shape
    n, k, h = self.num_heads, self.num_kv_heads, self.head_dim
    q, kk, v = jnp.split(self.qkv(x), [n * h, (n + k) * h], axis=-1)
    q = q.reshape(batch, seq, n, h)
    kk = kk.reshape(batch, seq, k, h)
    v = v.reshape(batch, seq, k, h)
    if rope is not None:
      q, kk = apply_rope(q, *rope), apply_rope(kk, *rope)
    y = dot_product_attention(q, kk, v, causal=self.causal)
    return self.out(y.reshape(batch, seq, n * h))


class FeedForward(nnx.Module):
  """``proj(act(fc(x)))``: the transformer MLP."""

  def __init__(self, features: int, hidden: int, *, activation: str = "gelu",
               use_bias: bool = True, kernel_init: Any = default_kernel_init,
               out_kernel_init: Any = None, dtype: Dtype = jnp.float32,
               param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs):
    self.act = get_activation(activation)
    self.fc = nnx.Linear(features, hidden, use_bias=use_bias,
                         kernel_init=kernel_init, dtype=dtype,
                         param_dtype=param_dtype, rngs=rngs)
    self.proj = nnx.Linear(hidden, features, use_bias=use_bias,
                           kernel_init=out_kernel_init or kernel_init,
                           dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.proj(self.act(self.fc(x)))


class GatedFeedForward(nnx.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``, no biases."""

  def __init__(self, features: int, hidden: int, *,
               kernel_init: Any = default_kernel_init,
               out_kernel_init: Any = None, dtype: Dtype = jnp.float32,
               param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs):
    linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)
    self.gate = linear(features, hidden, kernel_init=kernel_init)
    self.up = linear(features, hidden, kernel_init=kernel_init)
    self.down = linear(hidden, features,
                       kernel_init=out_kernel_init or kernel_init)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class TransformerBlock(nnx.Module):
  """Pre-LN block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

  def __init__(self, features: int, num_heads: int, mlp_hidden: int, *,
               causal: bool, activation: str = "gelu", epsilon: float = 1e-5,
               kernel_init: Any = default_kernel_init,
               out_kernel_init: Any = None, dtype: Dtype = jnp.float32,
               param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs):
    norm = functools.partial(nnx.LayerNorm, features, epsilon=epsilon,
                             dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    inits = dict(kernel_init=kernel_init, out_kernel_init=out_kernel_init,
                 dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.ln_1 = norm()
    self.attn = Attention(features, num_heads, causal=causal, **inits)
    self.ln_2 = norm()
    self.mlp = FeedForward(features, mlp_hidden, activation=activation,
                           **inits)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


def blocks(model: nnx.Module, prefix: str = "blocks") -> list[nnx.Module]:
  """The unrolled layers ``model.{prefix}_0 ..`` in order."""
  out = []
  while hasattr(model, f"{prefix}_{len(out)}"):
    out.append(getattr(model, f"{prefix}_{len(out)}"))
  return out
