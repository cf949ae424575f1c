"""GPT-2: learned positions, pre-LN blocks, fused qkv, GELU MLP, tied head.

Parameter paths: ``wte``, ``wpe``, ``blocks_{i}`` (unrolled) or ``blocks``
(scanned, leading layer axis), ``ln_f``. Each block holds ``ln_1``,
``attn/{qkv,out}``, ``ln_2``, ``mlp/{fc,proj}``.

Example:
  >>> config = gpt2.tiny(scan_layers=True)
  >>> params = common.init_params(config)
  >>> loss = gpt2.make_loss(config)
  >>> batch = gpt2.example_batch(config)
  >>> value, grads = jax.value_and_grad(loss)(params, batch)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import common


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Config:
  """GPT-2 hyperparameters; the defaults are GPT-2 small (124M).

  Attributes:
    vocab_size: token vocabulary size.
    n_ctx: maximum sequence length (rows of the position table).
    n_embd: model width.
    n_layer: number of transformer blocks.
    n_head: attention heads; must divide ``n_embd``.
    layer_norm_epsilon: LayerNorm epsilon.
    scan_layers: stack the blocks on a leading axis and apply them with
      ``jax.lax.scan`` instead of unrolling ``blocks_0 ..``.
    dtype: computation dtype.
    param_dtype: parameter dtype.
  """

  vocab_size: int = 50257
  n_ctx: int = 1024
  n_embd: int = 768
  n_layer: int = 12
  n_head: int = 12
  layer_norm_epsilon: float = 1e-5
  scan_layers: bool = False
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    common.check_positive(self, "vocab_size", "n_ctx", "n_embd", "n_layer",
                          "n_head")
    common.check_divisible(self, "n_embd", "n_head")
    common.check_dtypes(self, "dtype", "param_dtype")

  def build(self, *, rngs: nnx.Rngs) -> GPT2:
    return GPT2(self, rngs=rngs)


def tiny(**overrides: Any) -> GPT2Config:
  """Byte-level test model: vocab 256, ctx 64, 2 layers, width 64, 4 heads."""
  return dataclasses.replace(
      GPT2Config(vocab_size=256, n_ctx=64, n_embd=64, n_layer=2, n_head=4),
      **overrides)


def small(**overrides: Any) -> GPT2Config:
  """GPT-2 (124,439,808 parameters)."""
  return dataclasses.replace(GPT2Config(), **overrides)


def medium(**overrides: Any) -> GPT2Config:
  """GPT-2 medium (354,823,168 parameters)."""
  return dataclasses.replace(
      GPT2Config(n_embd=1024, n_layer=24, n_head=16), **overrides)


def large(**overrides: Any) -> GPT2Config:
  """GPT-2 large (774,030,080 parameters)."""
  return dataclasses.replace(
      GPT2Config(n_embd=1280, n_layer=36, n_head=20), **overrides)


def xl(**overrides: Any) -> GPT2Config:
  """GPT-2 XL (1,557,611,200 parameters)."""
  return dataclasses.replace(
      GPT2Config(n_embd=1600, n_layer=48, n_head=25), **overrides)


PRESETS = {"tiny": tiny, "small": small, "medium": medium, "large": large,
           "xl": xl}


def preset(name: str, **overrides: Any) -> GPT2Config:
  """The preset called `name` (one of ``PRESETS``), with field overrides."""
  return common.lookup_preset(PRESETS, name, **overrides)


def make_block(config: GPT2Config, *, rngs: nnx.Rngs) -> nnx.Module:
  """One GPT-2 block (residual projections scaled by 1/sqrt(2 n_layer))."""
  return common.TransformerBlock(
      config.n_embd, config.n_head, 4 * config.n_embd, causal=True,
      activation="gelu_tanh", epsilon=config.layer_norm_epsilon,
      kernel_init=nnx.initializers.normal(0.02),
      out_kernel_init=nnx.initializers.normal(
          0.02 / math.sqrt(2 * config.n_layer)),
      dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)


class GPT2(nnx.Module):
  """GPT-2 language model: ``tokens [batch, seq] -> logits [.., vocab]``."""

  def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
    self.config = config
    embed = dict(dtype=config.dtype, param_dtype=config.param_dtype,
                 rngs=rngs)
    self.wte = nnx.Embed(config.vocab_size, config.n_embd,
                         embedding_init=nnx.initializers.normal(0.02),
                         **embed)
    self.wpe = nnx.Embed(config.n_ctx, config.n_embd,
                         embedding_init=nnx.initializers.normal(0.01),
                         **embed)
    if config.scan_layers:
      self.blocks = common.stacked(
          lambda r: make_block(config, rngs=r), config.n_layer, rngs=rngs)
    else:
      layers = common.unrolled(lambda r: make_block(config, rngs=r),
                               config.n_layer, rngs=rngs)
      for i, block in enumerate(layers):
        setattr(self, f"blocks_{i}", block)
    self.ln_f = nnx.LayerNorm(config.n_embd,
                              epsilon=config.layer_norm_epsilon, **embed)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    seq = tokens.shape[-1]
    if seq > self.config.n_ctx:
      raise ValueError(f"tokens has sequence length {seq}, more than "
                       f"n_ctx={self.config.n_ctx}")
    x = self.wte(tokens) + self.wpe(jnp.arange(seq))
    if self.config.scan_layers:
      x = common.scan_layers(self.blocks, x)
    else:
      for block in common.blocks(self):
        x = block(x)
    return self.wte.attend(self.ln_f(x))


def make_apply(config: GPT2Config) -> common.ApplyFn:
  """``apply(params, tokens) -> logits``, without allocating parameters."""
  return common.make_apply(config)


def make_loss(config: GPT2Config, *, return_logits: bool = False
              ) -> Callable[[common.Params, dict], Any]:
  """Next-token cross-entropy ``loss(params, batch)`` for `config`.

  ``batch['x']`` and ``batch['y']`` are ``[batch, seq]`` int32 tokens and
  their next tokens. With `return_logits` the loss returns
  ``(loss, logits)`` (for ``jax.value_and_grad(..., has_aux=True)``).
  """
  return common.make_loss(config, return_logits=return_logits)


def loss_fn(params: common.Params, batch: dict, *, config: GPT2Config
            ) -> jax.Array:
  """``make_loss(config)(params, batch)``."""
  return make_loss(config)(params, batch)


def example_batch(config: GPT2Config, *, batch_size: int = 2,
                  seq_len: int | None = None, seed: int = 0) -> dict:
  """Random tokens ``x`` and their shifted next tokens ``y``."""
  seq_len = seq_len or config.n_ctx
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, config.vocab_size, (batch_size, seq_len + 1),
                        dtype=np.int32)
  return {"x": jnp.asarray(tokens[:, :-1]), "y": jnp.asarray(tokens[:, 1:])}
