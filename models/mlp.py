"""Multi-layer perceptron classifier with configurable hidden widths.

``x -> act(embed(x)) -> blocks_0 .. blocks_{L-1} -> head``, where block ``i``
maps ``widths[i]`` to ``widths[i + 1]`` and applies the activation, so
``L = len(widths) - 1``. Parameter paths: ``embed``, ``blocks_{i}/linear``
(unrolled) or ``blocks/linear`` (scanned, which needs equal widths),
``head``. ``wide_narrow()`` alternates narrow and wide layers, giving blocks
of two different sizes.

Example:
  >>> config = mlp.wide_narrow(narrow=64, wide=256, num_blocks=4)
  >>> loss = mlp.make_loss(config)
  >>> loss(common.init_params(config), mlp.example_batch(config))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import common


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPConfig:
  """MLP hyperparameters.

  Attributes:
    in_dim: input features.
    widths: hidden widths, at least one; the model has ``len(widths) - 1``
      blocks. A list is stored as a tuple.
    out_dim: number of classes.
    activation: one of 'gelu', 'gelu_tanh', 'relu', 'silu'.
    use_bias: whether the dense layers have biases.
    scan_layers: stack the blocks and apply them with ``jax.lax.scan``;
      needs all ``widths`` equal and at least two of them.
    dtype: computation dtype.
    param_dtype: parameter dtype.
  """

  in_dim: int = 1024
  widths: tuple[int, ...] = (4096,) * 9
  out_dim: int = 1024
  activation: str = "relu"
  use_bias: bool = True
  scan_layers: bool = False
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    common.check_positive(self, "in_dim", "out_dim")
    if isinstance(self.widths, list):
      object.__setattr__(self, "widths", tuple(self.widths))
    if (not isinstance(self.widths, tuple) or not self.widths or
        any(isinstance(w, bool) or not isinstance(w, int) or w <= 0
            for w in self.widths)):
      raise ValueError("MLPConfig.widths must be a non-empty tuple of "
                       f"positive ints, but got {self.widths!r}")
    common.get_activation(self.activation, field="MLPConfig.activation")
    if self.scan_layers and (len(self.widths) < 2 or
                             len(set(self.widths)) != 1):
      raise ValueError("MLPConfig.widths must hold at least two equal "
                       "widths when scan_layers=True, but got "
                       f"{self.widths!r}; use scan_layers=False")
    common.check_dtypes(self, "dtype", "param_dtype")

  @property
  def num_blocks(self) -> int:
    return len(self.widths) - 1

  def build(self, *, rngs: nnx.Rngs) -> MLP:
    return MLP(self, rngs=rngs)


def tiny(**overrides: Any) -> MLPConfig:
  """Test model: 16 inputs, three hidden layers of 32, 4 classes."""
  return dataclasses.replace(
      MLPConfig(in_dim=16, widths=(32, 32, 32), out_dim=4), **overrides)


def small(**overrides: Any) -> MLPConfig:
  """1024 -> 9 x 4096 -> 1024 (8 equal blocks of 16.8M parameters)."""
  return dataclasses.replace(MLPConfig(), **overrides)


def wide_narrow(*, narrow: int = 1024, wide: int = 8192, num_blocks: int = 8,
                **overrides: Any) -> MLPConfig:
  """Hidden widths ``narrow, wide, narrow, ..`` (``num_blocks + 1`` of them).

  Blocks alternate between ``narrow -> wide`` and ``wide -> narrow``, two
  layer sizes of the same parameter count but different activation sizes.
  """
  widths = tuple(wide if i % 2 else narrow for i in range(num_blocks + 1))
  fields = dict(in_dim=narrow, widths=widths, out_dim=narrow)
  return MLPConfig(**{**fields, **overrides})


PRESETS = {"tiny": tiny, "small": small, "wide_narrow": wide_narrow}


def preset(name: str, **overrides: Any) -> MLPConfig:
  """The preset called `name` (one of ``PRESETS``), with field overrides."""
  return common.lookup_preset(PRESETS, name, **overrides)


class Dense(nnx.Module):
  """``act(linear(x))``: one MLP block."""

  def __init__(self, in_features: int, out_features: int, *,
               activation: str, use_bias: bool, dtype: Any, param_dtype: Any,
               rngs: nnx.Rngs):
    self.act = common.get_activation(activation)
    self.linear = nnx.Linear(in_features, out_features, use_bias=use_bias,
                             dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.act(self.linear(x))


class MLP(nnx.Module):
  """``x [batch, in_dim] -> logits [batch, out_dim]``."""

  def __init__(self, config: MLPConfig, *, rngs: nnx.Rngs):
    self.config = config
    kw = dict(use_bias=config.use_bias, dtype=config.dtype,
              param_dtype=config.param_dtype, rngs=rngs)
    widths = config.widths
    self.embed = Dense(config.in_dim, widths[0],
                       activation=config.activation, **kw)
    make = lambda i, r: Dense(widths[i], widths[i + 1],
                              activation=config.activation,
                              **{**kw, "rngs": r})
    if config.scan_layers:
      self.blocks = common.stacked(lambda r: make(0, r), config.num_blocks,
                                   rngs=rngs)
    elif len(set(widths)) == 1 and config.num_blocks:
      for i, block in enumerate(common.unrolled(
          lambda r: make(0, r), config.num_blocks, rngs=rngs)):
        setattr(self, f"blocks_{i}", block)
    else:
      for i in range(config.num_blocks):
        setattr(self, f"blocks_{i}", make(i, rngs))
    self.head = nnx.Linear(widths[-1], config.out_dim, **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.embed(x)
    if self.config.scan_layers:
      x = common.scan_layers(self.blocks, x)
    else:
      for block in common.blocks(self):
        x = block(x)
    return self.head(x)


def make_apply(config: MLPConfig) -> common.ApplyFn:
  """``apply(params, x) -> logits``, without allocating parameters."""
  return common.make_apply(config)


def make_loss(config: MLPConfig, *, return_logits: bool = False
              ) -> Callable[[common.Params, dict], Any]:
  """Classification cross-entropy ``loss(params, batch)`` for `config`.

  ``batch['x']`` is ``[batch, in_dim]``, ``batch['y']`` int32 labels. With
  `return_logits` the loss returns ``(loss, logits)`` (for
  ``jax.value_and_grad(..., has_aux=True)``).
  """
  return common.make_loss(config, return_logits=return_logits)


def loss_fn(params: common.Params, batch: dict, *, config: MLPConfig
            ) -> jax.Array:
  """``make_loss(config)(params, batch)``."""
  return make_loss(config)(params, batch)


def example_batch(config: MLPConfig, *, batch_size: int = 8, seed: int = 0
                  ) -> dict:
  """Random inputs ``x`` and labels ``y``."""
  rng = np.random.default_rng(seed)
  return {"x": jnp.asarray(rng.standard_normal((batch_size, config.in_dim),
                                               np.float32)),
          "y": jnp.asarray(rng.integers(0, config.out_dim, batch_size,
                                        dtype=np.int32))}
