"""Vision Transformer: patch embedding, class token, pre-LN blocks, head.

Parameter paths: ``patch_embed`` (a strided conv), ``cls_token``,
``pos_embed``, ``blocks_{i}`` (unrolled) or ``blocks`` (scanned, leading
layer axis), ``norm``, ``head``. Blocks are ``common.TransformerBlock``s
(non-causal, exact GELU).

Example:
  >>> config = vit.tiny()
  >>> loss = vit.make_loss(config)
  >>> loss(common.init_params(config), vit.example_batch(config))
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
class ViTConfig:
  """ViT hyperparameters; the defaults are ViT-B/16 at 224x224.

  Attributes:
    image_size: height and width of the (square) input images.
    patch_size: side of a patch; must divide ``image_size``.
    in_channels: input channels (images are NHWC).
    dim: model width.
    depth: number of transformer blocks.
    num_heads: attention heads; must divide ``dim``.
    mlp_dim: MLP hidden width.
    num_classes: classifier outputs.
    layer_norm_epsilon: LayerNorm epsilon.
    scan_layers: stack the blocks and apply them with ``jax.lax.scan``.
    dtype: computation dtype.
    param_dtype: parameter dtype.
  """

  image_size: int = 224
  patch_size: int = 16
  in_channels: int = 3
  dim: int = 768
  depth: int = 12
  num_heads: int = 12
  mlp_dim: int = 3072
  num_classes: int = 1000
  layer_norm_epsilon: float = 1e-6
  scan_layers: bool = False
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    common.check_positive(self, "image_size", "patch_size", "in_channels",
                          "dim", "depth", "num_heads", "mlp_dim",
                          "num_classes")
    common.check_divisible(self, "image_size", "patch_size")
    common.check_divisible(self, "dim", "num_heads")
    common.check_dtypes(self, "dtype", "param_dtype")

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2

  def build(self, *, rngs: nnx.Rngs) -> ViT:
    return ViT(self, rngs=rngs)


def tiny(**overrides: Any) -> ViTConfig:
  """Test model: 32x32 images, patch 8, width 64, 2 blocks, 10 classes."""
  return dataclasses.replace(
      ViTConfig(image_size=32, patch_size=8, dim=64, depth=2, num_heads=4,
                mlp_dim=128, num_classes=10),
      **overrides)


def base(**overrides: Any) -> ViTConfig:
  """ViT-B/16, 224x224, 1000 classes (86,567,656 parameters)."""
  return dataclasses.replace(ViTConfig(), **overrides)


PRESETS = {"tiny": tiny, "base": base}


def preset(name: str, **overrides: Any) -> ViTConfig:
  """The preset called `name` (one of ``PRESETS``), with field overrides."""
  return common.lookup_preset(PRESETS, name, **overrides)


def make_block(config: ViTConfig, *, rngs: nnx.Rngs) -> nnx.Module:
  """One ViT encoder block."""
  return common.TransformerBlock(
      config.dim, config.num_heads, config.mlp_dim, causal=False,
      activation="gelu", epsilon=config.layer_norm_epsilon,
      kernel_init=nnx.initializers.xavier_uniform(), dtype=config.dtype,
      param_dtype=config.param_dtype, rngs=rngs)


class ViT(nnx.Module):
  """Image classifier: ``images [batch, H, W, C] -> logits [batch, classes]``.
  """

  def __init__(self, config: ViTConfig, *, rngs: nnx.Rngs):
    self.config = config
    dtypes = dict(dtype=config.dtype, param_dtype=config.param_dtype,
                  rngs=rngs)
    p = config.patch_size
    self.patch_embed = nnx.Conv(config.in_channels, config.dim, (p, p),
                                strides=(p, p), padding="VALID", **dtypes)
    self.cls_token = nnx.Param(
        jnp.zeros((1, 1, config.dim), config.param_dtype))
    self.pos_embed = nnx.Param(nnx.initializers.normal(0.02)(
        rngs.params(), (1, config.num_patches + 1, config.dim),
        config.param_dtype))
    make = lambda r: make_block(config, rngs=r)
    if config.scan_layers:
      self.blocks = common.stacked(make, config.depth, rngs=rngs)
    else:
      for i, block in enumerate(common.unrolled(make, config.depth,
                                                rngs=rngs)):
        setattr(self, f"blocks_{i}", block)
    self.norm = nnx.LayerNorm(config.dim, epsilon=config.layer_norm_epsilon,
                              **dtypes)
    self.head = nnx.Linear(config.dim, config.num_classes, **dtypes)

  def __call__(self, images: jax.Array) -> jax.Array:
    config = self.config
    expected = (config.image_size, config.image_size, config.in_channels)
    if images.ndim != 4 or tuple(images.shape[1:]) != expected:
      raise ValueError(f"images must have shape [batch, {expected[0]}, "
                       f"{expected[1]}, {expected[2]}], but got "
                       f"{tuple(images.shape)}")
    x = self.patch_embed(images)
    x = x.reshape(x.shape[0], -1, config.dim)
    cls = jnp.broadcast_to(self.cls_token[...].astype(x.dtype),
                           (x.shape[0], 1, config.dim))
    x = jnp.concatenate([cls, x], axis=1) + self.pos_embed[...].astype(x.dtype)
    if config.scan_layers:
      x = common.scan_layers(self.blocks, x)
    else:
      for block in common.blocks(self):
        x = block(x)
    return self.head(self.norm(x)[:, 0])


def make_apply(config: ViTConfig) -> common.ApplyFn:
  """``apply(params, images) -> logits``, without allocating parameters."""
  return common.make_apply(config)


def make_loss(config: ViTConfig, *, return_logits: bool = False
              ) -> Callable[[common.Params, dict], Any]:
  """Classification cross-entropy ``loss(params, batch)`` for `config`.

  ``batch['x']`` is ``[batch, H, W, C]`` images, ``batch['y']`` int32
  labels. With `return_logits` the loss returns
  ``(loss, logits)`` (for ``jax.value_and_grad(..., has_aux=True)``).
  """
  return common.make_loss(config, return_logits=return_logits)


def loss_fn(params: common.Params, batch: dict, *, config: ViTConfig
            ) -> jax.Array:
  """``make_loss(config)(params, batch)``."""
  return make_loss(config)(params, batch)


def example_batch(config: ViTConfig, *, batch_size: int = 2, seed: int = 0
                  ) -> dict:
  """Random images ``x`` and labels ``y``."""
  rng = np.random.default_rng(seed)
  shape = (batch_size, config.image_size, config.image_size,
           config.in_channels)
  return {"x": jnp.asarray(rng.standard_normal(shape, np.float32)),
          "y": jnp.asarray(rng.integers(0, config.num_classes, batch_size,
                                        dtype=np.int32))}
