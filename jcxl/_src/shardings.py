"""``in_shardings`` / ``out_shardings`` of a cxl_offload step, as jax.jit's.

Both are pytree prefixes whose leaves are a ``jax.sharding.Sharding`` or
None (unspecified: as the value comes). Pool-resident state keeps the
sharding it was placed with: a sharding given for it must match.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jcxl._src.pool_array import PoolArray

_is_pool_array = lambda x: isinstance(x, PoolArray)


def flat_shardings(prefix: Any, tree: Any, name: str) -> list[Any]:
  """`prefix` broadcast over the leaves of `tree` (PoolArrays are leaves).

  Raises:
    ValueError: `prefix` is not a pytree prefix of `tree`, or a leaf of it
      is neither a Sharding nor None.
  """
  if prefix is None:
    return [None] * len(jax.tree_util.tree_leaves(tree,
                                                  is_leaf=_is_pool_array))
  is_spec = lambda s: s is None or isinstance(s, jax.sharding.Sharding)
  for path, s in jax.tree_util.tree_flatten_with_path(
      prefix, is_leaf=is_spec)[0]:
    if not is_spec(s):
      raise ValueError(
          f"{name}{jax.tree_util.keystr(path)} is {type(s).__name__}; it must "
          "be a jax.sharding.Sharding or None")
  try:
    nested = jax.tree_util.tree_map(
        lambda s, sub: [s] * len(jax.tree_util.tree_leaves(
            sub, is_leaf=_is_pool_array)),
        prefix, tree, is_leaf=is_spec)
  except ValueError as e:
    raise ValueError(f"{name} must be a pytree prefix of the step's "
                     f"{'arguments' if name == 'in_shardings' else 'outputs'}"
                     f": {e}") from None
  return [s for group in jax.tree_util.tree_leaves(
      nested, is_leaf=lambda g: isinstance(g, list)) for s in group]


def _same(a: Any, b: Any, ndim: int) -> bool:
  """Whether two shardings lay an array out alike (memory kind aside)."""
  return a.with_memory_kind("device").is_equivalent_to(
      b.with_memory_kind("device"), ndim)


def check_state(sharding: Any, leaf: Any, what: str) -> None:
  """A sharding given for pool-resident (or pinned) state must be its own."""
  if sharding is not None and not _same(sharding, leaf.sharding,
                                        len(leaf.shape)):
    raise ValueError(
        f"{what} has sharding {leaf.sharding}, but the step asks for "
        f"{sharding}; pool-resident state keeps the sharding it was placed "
        "with (place it with jcxl.place(..., sharding=...) to change it)")


def place_inputs(args: tuple[Any, ...], shardings: list[Any],
                 state: set[int], paths: list[str]) -> tuple[Any, ...]:
  """The arguments laid out as `shardings` (flat, per leaf) ask, as jax.jit
  does: host values are put there; a device array must already be there."""
  leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=_is_pool_array)
  out = []
  for i, (leaf, sharding) in enumerate(zip(leaves, shardings)):
    if sharding is None:
      out.append(leaf)
    elif i in state or isinstance(leaf, PoolArray):
      check_state(sharding, leaf, f"argument leaf {paths[i]}")
      out.append(leaf)
    elif isinstance(leaf, jax.Array) and leaf.committed:
      if not _same(leaf.sharding, sharding, leaf.ndim):
        raise ValueError(
            f"argument leaf {paths[i]} is laid out as {leaf.sharding}, but "
            f"in_shardings asks for {sharding}; jax.device_put it there "
            "first (as jax.jit requires)")
      out.append(leaf)
    else:
      out.append(jax.device_put(np.asarray(leaf) if not isinstance(
          leaf, jax.Array) else leaf, sharding))
  return jax.tree_util.tree_unflatten(treedef, out)
