"""Llama-style decoder: RMSNorm, rotary positions, GQA, SwiGLU.

Parameter paths: ``embed``, ``blocks_{i}`` (unrolled) or ``blocks`` (scanned,
leading layer axis), ``norm``, and ``lm_head`` unless the embeddings are
tied. Each block holds ``attn_norm``, ``attn/{qkv,out}`` (fused q, k, v; no
biases), ``mlp_norm``, ``mlp/{gate,up,down}``.

Example:
  >>> config = llama.tiny(scan_layers=True)
  >>> loss = llama.make_loss(config)
  >>> loss(common.init_params(config), llama.example_batch(config))
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
class LlamaConfig:
  """Llama hyperparameters; the defaults are Llama-2 7B.

  Attributes:
    vocab_size: token vocabulary size.
    max_seq_len: longest sequence the model accepts.
    dim: model width.
    n_layers: number of decoder blocks.
    n_heads: query heads; must divide ``dim`` unless ``head_dim`` is set.
    n_kv_heads: key/value heads (grouped-query attention); must divide
      ``n_heads``. ``None`` means ``n_heads`` (plain multi-head attention).
    head_dim: per-head width; ``None`` means ``dim // n_heads``.
    ffn_dim: SwiGLU hidden width.
    norm_eps: RMSNorm epsilon.
    rope_theta: rotary base frequency.
    tie_embeddings: use the embedding table as the output projection.
    scan_layers: stack the blocks and apply them with ``jax.lax.scan``.
    dtype: computation dtype.
    param_dtype: parameter dtype.
  """

  vocab_size: int = 32000
  max_seq_len: int = 4096
  dim: int = 4096
  n_layers: int = 32
  n_heads: int = 32
  n_kv_heads: int | None = None
  head_dim: int | None = None
  ffn_dim: int = 11008
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  tie_embeddings: bool = False
  scan_layers: bool = False
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    common.check_positive(self, "vocab_size", "max_seq_len", "dim",
                          "n_layers", "n_heads", "ffn_dim")
    if self.n_kv_heads is not None:
      common.check_positive(self, "n_kv_heads")
      common.check_divisible(self, "n_heads", "n_kv_heads")
    if self.head_dim is None:
      common.check_divisible(self, "dim", "n_heads")
    else:
      common.check_positive(self, "head_dim")
    if self.resolved_head_dim % 2:
      raise ValueError(f"LlamaConfig.head_dim must be even for rotary "
                       f"embeddings, but got {self.resolved_head_dim}")
    if self.rope_theta <= 0:
      raise ValueError(f"LlamaConfig.rope_theta must be positive, but got "
                       f"{self.rope_theta}")
    common.check_dtypes(self, "dtype", "param_dtype")

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim or self.dim // self.n_heads

  def build(self, *, rngs: nnx.Rngs) -> Llama:
    return Llama(self, rngs=rngs)


def tiny(**overrides: Any) -> LlamaConfig:
  """Byte-level test model: width 64, 2 layers, 4 query / 2 kv heads."""
  return dataclasses.replace(
      LlamaConfig(vocab_size=256, max_seq_len=64, dim=64, n_layers=2,
                  n_heads=4, n_kv_heads=2, ffn_dim=128),
      **overrides)


def llama3_1b(**overrides: Any) -> LlamaConfig:
  """Llama 3.2 1B-shaped (1,235,814,400 parameters, tied embeddings)."""
  return dataclasses.replace(
      LlamaConfig(vocab_size=128256, max_seq_len=131072, dim=2048,
                  n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                  rope_theta=500000.0, tie_embeddings=True),
      **overrides)


def llama2_7b(**overrides: Any) -> LlamaConfig:
  """Llama-2 7B-shaped (6,738,415,616 parameters, untied head)."""
  return dataclasses.replace(LlamaConfig(), **overrides)


PRESETS = {"tiny": tiny, "llama3_1b": llama3_1b, "llama2_7b": llama2_7b}


def preset(name: str, **overrides: Any) -> LlamaConfig:
  """The preset called `name` (one of ``PRESETS``), with field overrides."""
  return common.lookup_preset(PRESETS, name, **overrides)


class Block(nnx.Module):
  """``x + attn(rms(x), rope)``, then ``x + swiglu(rms(x))``."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    dtypes = dict(dtype=config.dtype, param_dtype=config.param_dtype,
                  rngs=rngs)
    self.attn_norm = nnx.RMSNorm(config.dim, epsilon=config.norm_eps,
                                 **dtypes)
    self.attn = common.Attention(
        config.dim, config.n_heads, num_kv_heads=config.n_kv_heads,
        head_dim=config.resolved_head_dim, causal=True, use_bias=False,
        kernel_init=init, **dtypes)
    self.mlp_norm = nnx.RMSNorm(config.dim, epsilon=config.norm_eps,
                                **dtypes)
    self.mlp = common.GatedFeedForward(config.dim, config.ffn_dim,
                                       kernel_init=init, **dtypes)

  def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array]
               ) -> jax.Array:
    x = x + self.attn(self.attn_norm(x), rope)
    return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
  """Decoder-only LM: ``tokens [batch, seq] -> logits [.., vocab]``."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.config = config
    dtypes = dict(dtype=config.dtype, param_dtype=config.param_dtype,
                  rngs=rngs)
    self.embed = nnx.Embed(config.vocab_size, config.dim,
                           embedding_init=nnx.initializers.normal(0.02),
                           **dtypes)
    make = lambda r: Block(config, rngs=r)
    if config.scan_layers:
      self.blocks = common.stacked(make, config.n_layers, rngs=rngs)
    else:
      for i, block in enumerate(common.unrolled(make, config.n_layers,
                                                rngs=rngs)):
        setattr(self, f"blocks_{i}", block)
    self.norm = nnx.RMSNorm(config.dim, epsilon=config.norm_eps, **dtypes)
    if not config.tie_embeddings:
      self.lm_head = nnx.Linear(config.dim, config.vocab_size,
                                use_bias=False,
                                kernel_init=nnx.initializers.normal(0.02),
                                **dtypes)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    config = self.config
    seq = tokens.shape[-1]
    if seq > config.max_seq_len:
      raise ValueError(f"tokens has sequence length {seq}, more than "
                       f"max_seq_len={config.max_seq_len}")
    rope = common.rope_tables(seq, config.resolved_head_dim,
                              theta=config.rope_theta)
    x = self.embed(tokens)
    if config.scan_layers:
      x = common.scan_layers(self.blocks, x, rope)
    else:
      for block in common.blocks(self):
        x = block(x, rope)
    x = self.norm(x)
    return self.embed.attend(x) if config.tie_embeddings else self.lm_head(x)


def make_apply(config: LlamaConfig) -> common.ApplyFn:
  """``apply(params, tokens) -> logits``, without allocating parameters."""
  return common.make_apply(config)


def make_loss(config: LlamaConfig, *, return_logits: bool = False
              ) -> Callable[[common.Params, dict], Any]:
  """Next-token cross-entropy ``loss(params, batch)`` for `config`.

  ``batch['x']`` and ``batch['y']`` are ``[batch, seq]`` int32 tokens and
  their next tokens. With `return_logits` the loss returns
  ``(loss, logits)`` (for ``jax.value_and_grad(..., has_aux=True)``).
  """
  return common.make_loss(config, return_logits=return_logits)


def loss_fn(params: common.Params, batch: dict, *, config: LlamaConfig
            ) -> jax.Array:
  """``make_loss(config)(params, batch)``."""
  return make_loss(config)(params, batch)


def example_batch(config: LlamaConfig, *, batch_size: int = 2,
                  seq_len: int = 64, seed: int = 0) -> dict:
  """Random tokens ``x`` and their shifted next tokens ``y``."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, config.vocab_size, (batch_size, seq_len + 1),
                        dtype=np.int32)
  return {"x": jnp.asarray(tokens[:, :-1]), "y": jnp.asarray(tokens[:, 1:])}
