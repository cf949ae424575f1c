"""Initialization straight into the pool, a leaf at a time.

``init_in_pool(fn, *args)`` traces `fn` once to a jaxpr, then computes its
outputs one at a time (the jaxpr cut down to the work that leaf needs, so
nothing else is computed or held) and stores each in the pool before the
next is made. The values are those of ``jax.jit(fn)(*args)``: the same
operations on the same inputs (a random key, PoolArray inputs read from the
pool when a leaf needs them). A leaf that is a constant fill (Adam's zero
moments, a step count) is written from a small buffer of the fill value,
a piece at a time, and never exists whole outside the pool.

A leaf stacked from pieces along its first axis (``jnp.stack`` of
per-layer values) is computed and written a piece at a time. Host memory at
the peak is then one piece (a layer's leaf) and what computing it holds;
other leaves are computed whole (a model whose layers are made by one
``nnx.vmap``, as ``models.common.stacked``, computes each stacked variable
whole), never the model.
"""

from __future__ import annotations

import bisect

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from jcxl._src import jax_compat
from jcxl._src import registry
from jcxl._src.placement import POOL_KINDS
from jcxl._src.placement import gather_one
from jcxl._src.placement import resolve_kinds
from jcxl._src.placement import store_shards
from jcxl._src.placement import to_pool
from jcxl._src.pool import Pool
from jcxl._src.pool import Tier
from jcxl._src.pool_array import PoolArray

# The piece a constant fill is written in.
_FILL_BYTES = 8 << 20
# Primitives that turn a literal into a filled array, and nothing else.
_FILL_PRIMITIVES = ("broadcast_in_dim", "convert_element_type")

_is_pool_array = lambda x: isinstance(x, PoolArray)


def _as_tree(value: Any) -> Any:
  """An nnx.Module's parameters as a nested dict; anything else as is."""
  if isinstance(value, nnx.Module):
    return nnx.to_pure_dict(nnx.state(value, nnx.Param))
  return value


def _abstract(x: Any) -> Any:
  if isinstance(x, PoolArray):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  return x


def _fill_value(jaxpr: Any, out: Any) -> np.ndarray | None:
  """The scalar `out` is filled with, if the jaxpr only broadcasts a
  literal into it; else None."""
  literal = jax_compat.literal_type()
  scalars: dict[Any, np.ndarray] = {}

  def value_of(atom):
    if isinstance(atom, literal):
      return np.asarray(atom.val)
    return scalars.get(atom)

  for eqn in jaxpr.eqns:
    if eqn.primitive.name not in _FILL_PRIMITIVES:
      return None
    (operand,) = eqn.invars
    scalar = value_of(operand)
    if scalar is None or scalar.size != 1:
      return None
    scalars[eqn.outvars[0]] = scalar.reshape(()).astype(
        eqn.outvars[0].aval.dtype)
  return value_of(out)


def _store_in_parts(parts: Callable[[], Any], *, pool: Pool, tier: Tier,
                    sharding: jax.sharding.Sharding, aval: Any,
                    path: str) -> PoolArray:
  """A PoolArray whose object per device (each of the sharding's shard
  shape) is written from the host arrays ``parts()`` yields, in order, a
  few in flight at a time (never the whole shard). If a write fails, the
  object is freed."""
  shard_shape = tuple(sharding.shard_shape(aval.shape))

  def make(device):
    del device
    handle = pool.allocate(shard_shape, aval.dtype, tier)
    try:
      pending, offset = [], 0
      for part in parts():
        pending.append(pool.put_async(handle, part, offset=offset))
        offset += part.nbytes
        if len(pending) > 2:
          pending.pop(0).wait()
      for transfer in pending:
        transfer.wait()
    except BaseException:
      pool.free(handle)
      raise
    return handle

  return store_shards(None, make_object=make, pool=pool, tier=tier,
                      sharding=sharding, shape=aval.shape, dtype=aval.dtype,
                      path=path)


def _fill_parts(value: np.ndarray, dtype: Any,
                shape: tuple[int, ...]) -> Callable[[], Any]:
  """Pieces of one small buffer of `value` (in `dtype`, as the object's
  writes must be) that add up to `shape`'s items."""
  items = int(np.prod(shape, dtype=np.int64))
  piece = np.full(max(1, min(items, _FILL_BYTES // np.dtype(dtype).itemsize)),
                  value.astype(dtype))

  def parts():
    for start in range(0, items, piece.size):
      yield piece[:min(piece.size, items - start)]
  return parts


def _stacked_pieces(jaxpr: Any, out: Any) -> list[Any] | None:
  """The operands `out` is stacked or concatenated from along axis 0
  (each computed by itself, they are its rows in order), or None."""
  literal = jax_compat.literal_type()
  for eqn in jaxpr.eqns:
    if not any(v is out for v in eqn.outvars):
      continue
    name, params = eqn.primitive.name, eqn.params
    along_rows = ((name == "stack" and params.get("axis") == 0) or
                  (name == "concatenate" and params.get("dimension") == 0))
    if along_rows and len(eqn.invars) > 1 and not any(
        isinstance(v, literal) for v in eqn.invars):
      return list(eqn.invars)
    return None
  return None


def _cut(closed: Any, out: Any) -> tuple[Any, list[bool]]:
  """`closed`'s jaxpr reduced to the work variable `out` needs, and which
  inputs that work reads."""
  return jax_compat.dce_jaxpr(closed.jaxpr.replace(outvars=[out]), [True])


def _compute(closed: Any, out: Any, flat_args: list[Any],
             compiled: dict[Any, Any]) -> np.ndarray:
  """Variable `out` of `closed` on the host, computing only its work (a
  constant fill is made with numpy). `compiled` keeps the jitted
  evaluators of this `closed` by their work's shape (see ``_signature``)."""
  cut, used_inputs = _cut(closed, out)
  fill = _fill_value(cut, cut.outvars[0])
  if fill is not None:
    return np.full(out.aval.shape, fill, out.aval.dtype)
  inputs = [gather_one(a) if isinstance(a, PoolArray) else a
            for a, u in zip(flat_args, used_inputs) if u]
  signature, lifted = _signature(cut)
  run = compiled.get(signature)
  if run is None:
    run = compiled[signature] = jax.jit(functools.partial(_evaluate, cut))
  return np.asarray(run(closed.consts, lifted, *inputs))


def _is_int_literal(atom: Any) -> bool:
  return (isinstance(atom, jax_compat.literal_type()) and
          np.issubdtype(np.asarray(atom.val).dtype, np.integer) and
          np.ndim(atom.val) == 0)


def _signature(jaxpr: Any) -> tuple[Any, list[np.ndarray]]:
  """A key equal for jaxprs that differ only in their top-level integer
  literals, and those literals' values in order.

  A layer's piece differs from the other layers' only in such literals
  (the index its key is folded with): passed as arguments, one compile
  serves every layer. (Evaluated op by op instead, the values would not
  be those of the whole init jitted: XLA fuses differently.) Sub-jaxprs
  are keyed by identity, valid while the traced init they belong to is.
  """
  ids: dict[Any, int] = {}
  def param(value):
    if hasattr(value, "eqns") or hasattr(value, "jaxpr"):
      return ("jaxpr", id(value))  # traced once, shared by every layer
    return repr(value)
  key, lifted = [], []
  for v in jaxpr.invars:
    ids[v] = len(ids)
  for eqn in jaxpr.eqns:
    operands = []
    for atom in eqn.invars:
      if _is_int_literal(atom):
        operands.append(("int", str(np.asarray(atom.val).dtype)))
        lifted.append(np.asarray(atom.val))
      elif isinstance(atom, jax_compat.literal_type()):
        operands.append(("literal", repr(atom.val), str(atom.aval)))
      else:
        operands.append(ids[atom])
    for v in eqn.outvars:
      ids[v] = len(ids)
    key.append((eqn.primitive.name, operands, tuple(
        (k, param(v)) for k, v in sorted(eqn.params.items()))))
  key.append(tuple(ids.get(v, repr(v)) for v in jaxpr.outvars))
  return (len(jaxpr.invars), str(key)), lifted


def _evaluate(jaxpr: Any, consts: list[Any], lifted: list[Any],
              *inputs: Any) -> Any:
  """`jaxpr` evaluated with its top-level integer literals from `lifted`."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, inputs))
  lifted = iter(lifted)
  def read(atom):
    if _is_int_literal(atom):
      return next(lifted)
    if isinstance(atom, jax_compat.literal_type()):
      return atom.val
    return env[atom]
  for eqn in jaxpr.eqns:
    outs = jax_compat.bind(eqn, [read(a) for a in eqn.invars])
    env.update(zip(eqn.outvars, outs))
  return read(jaxpr.outvars[0])


def init_in_pool(fn: Callable[..., Any], *args: Any, pool: Pool,
                 kinds: Any = "cxl",
                 sharding: jax.sharding.Sharding | None = None) -> Any:
  """Creates ``fn(*args)`` in the pool, one leaf at a time.

  Equal, bit for bit, to ``jcxl.place(jax.jit(fn)(*args), kinds, pool=pool)``
  but without ever holding the whole result: each leaf is computed by
  itself and stored before the next. Leaves that are a constant fill (the
  zeros of Adam's moments) are written into the pool from a small buffer.

  Example:
    >>> pool = jcxl.Pool(host=0, cxl="4GiB", nvme="64GiB", nvme_dir="/data",
    ...                  spill=True)
    >>> build = lambda key: config.build(rngs=nnx.Rngs(key))  # nnx model
    >>> params = jcxl.init_in_pool(build, jax.random.key(0), pool=pool,
    ...                            kinds="cxl")
    >>> opt_state = jcxl.init_in_pool(optax.adamw(1e-3).init, params,
    ...                               pool=pool, kinds="nvme")

  Args:
    fn: a function of `args` returning a pytree of arrays or an
      ``nnx.Module`` (its ``nnx.Param`` leaves, as a nested dict).
    *args: its arguments: arrays, random keys, or trees holding PoolArrays
      (a leaf's computation reads from the pool only those it uses).
    pool: the pool to create the leaves in.
    kinds: the pool tier of every leaf ('host', 'cxl' or 'nvme'), ordered
      ``(regex, kind)`` rules on leaf paths, or a pytree of kinds (as
      ``jcxl.place``'s).
    sharding: a ``jax.sharding.Sharding`` for every leaf; default: the
      first device.

  Returns:
    The tree ``fn`` returns, with PoolArray leaves.

  Raises:
    ValueError: a kind that is not a pool tier.
    TypeError: `fn` is not callable.
  """
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {type(fn).__name__}")
  registry.find_pool(pool.id, what="init_in_pool()")
  flat_args, in_tree = jax.tree_util.tree_flatten(args, is_leaf=_is_pool_array)

  def flat_fn(*xs):
    out = _as_tree(fn(*jax.tree_util.tree_unflatten(in_tree, xs)))
    return jax.tree_util.tree_leaves(out)

  closed = jax.make_jaxpr(flat_fn)(*map(_abstract, flat_args))
  out_shape = jax.eval_shape(
      lambda *xs: _as_tree(fn(*jax.tree_util.tree_unflatten(in_tree, xs))),
      *map(_abstract, flat_args))
  flat_out, out_def = jax.tree_util.tree_flatten_with_path(out_shape)
  kinds_flat = resolve_kinds(out_shape, kinds)
  for (path, _), kind in zip(flat_out, kinds_flat):
    if kind not in POOL_KINDS:
      raise ValueError(
          f"init_in_pool creates leaves in the pool: kinds must be one of "
          f"{', '.join(map(repr, POOL_KINDS))}, but leaf "
          f"{jax.tree_util.keystr(path)} got {kind!r}")
  sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
  made: list[PoolArray] = []
  compiled: dict[Any, Any] = {}
  try:
    for index, ((path, aval), kind) in enumerate(zip(flat_out, kinds_flat)):
      name = jax.tree_util.keystr(path)
      where = dict(pool=pool, tier=Tier(kind), sharding=sharding, path=name)
      out = closed.jaxpr.outvars[index]
      if isinstance(out, jax_compat.literal_type()):
        fill = np.asarray(out.val)
      else:
        cut, _ = _cut(closed, out)
        fill = _fill_value(cut, cut.outvars[0])
      if fill is not None:
        shard = tuple(sharding.shard_shape(aval.shape))
        made.append(_store_in_parts(_fill_parts(fill, aval.dtype, shard),
                                    aval=aval, **where))
        continue
      pieces = _stacked_pieces(closed.jaxpr, out)
      if pieces is not None and len(sharding.device_set) == 1:
        made.append(_store_in_parts(
            lambda pieces=pieces: (_compute(closed, p, flat_args, compiled)
                                   for p in pieces), aval=aval, **where))
        continue
      value = _compute(closed, out, flat_args, compiled)
      made.append(to_pool(value, **where))
      del value
  except BaseException:
    for array in made:
      array.delete()
    raise
  return jax.tree_util.tree_unflatten(out_def, made)



# The allocator's (ffi/allocator.cc, HybridAllocator) rules: extents are
# page aligned; objects up to 64 KiB take a slot of their size class in a
# slab span of 256 KiB, one class to a span, a span holding
# 256 KiB // class-size slots; a new span is taken when the class's spans
# are full. The classes: 16-byte steps to 128, then 2^k x {5, 6, 7, 8} / 4.
_PAGE = 4096
_SLAB_MAX = 64 << 10
_SPAN = 256 << 10


def _class_sizes() -> list[int]:
  sizes = list(range(16, 129, 16))
  power = 128
  while power < _SLAB_MAX:
    for quarter in (5, 6, 7, 8):
      size = min(power * quarter // 4, _SLAB_MAX)
      if size > sizes[-1]:
        sizes.append(size)
    power *= 2
  return sizes


_CLASS_SIZES = _class_sizes()


def _slab_class(nbytes: int) -> int:
  """The allocator's slot size for an object of `nbytes` <= 64 KiB."""
  return _CLASS_SIZES[bisect.bisect_left(_CLASS_SIZES, nbytes)]


def _charge(nbytes: int, slots: dict[int, int]) -> int:
  """Bytes of a tier one more object of `nbytes` takes: its page-rounded
  extent, or for a slab object a new span when its class's spans are full
  (`slots`: objects of each class the tier has so far), else nothing."""
  if nbytes > _SLAB_MAX:
    return -(-nbytes // _PAGE) * _PAGE
  size = _slab_class(max(nbytes, 1))
  return _SPAN if slots.get(size, 0) % (_SPAN // size) == 0 else 0
_TIER_SPEED = ("host", "cxl", "nvme")  # fastest first


def _leaf_bytes(leaf: Any) -> int:
  return int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(
      leaf.dtype).itemsize


def tiers_by_reads(groups: Any, pool: Pool) -> list[Any]:
  """Chooses a pool tier for every leaf: the most read ahead in the fastest.

  Leaves read more often per step (parameters: for the forward pass, the
  backward pass and their update) are placed before those read less often
  (optimizer moments: for their update only), the larger first among
  leaves read as often, each in the fastest tier of `pool` with room for
  it: host, then cxl, then nvme. Room a more-read leaf was too large for
  goes to the next leaves that fit, so a fast tier is left as full as it
  can be.

  Example:
    >>> shapes = jax.eval_shape(init, key)
    >>> param_kinds, opt_kinds = jcxl.tiers_by_reads(
    ...     [(shapes, 3), (jax.eval_shape(tx.init, shapes), 1)], pool)
    >>> params = jcxl.init_in_pool(init, key, pool=pool, kinds=param_kinds)

  Args:
    groups: ``(tree, reads_per_step)`` pairs; a tree's leaves are arrays,
      ShapeDtypeStructs or PoolArrays (their shapes and dtypes are used).
    pool: the pool whose free room is shared out.

  Returns:
    For each group, a tree of the group's structure holding each leaf's
    tier (what ``init_in_pool`` and ``place`` take as `kinds`).

  Raises:
    ValueError: `reads_per_step` is not a positive int, or the leaves do
      not fit in the pool's tiers.
  """
  stats = pool.stats()
  room = {t: stats[t].free for t in _TIER_SPEED if stats[t].enabled}
  slots: dict[str, dict[int, int]] = {t: {} for t in room}
  order = []
  kinds: list[list[str]] = []
  treedefs = []
  for g, (tree, reads) in enumerate(groups):
    if not isinstance(reads, int) or reads < 1:
      raise ValueError(f"reads_per_step must be an int >= 1, but group {g} "
                       f"has {reads!r}")
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_pool_array)
    treedefs.append(treedef)
    kinds.append([""] * len(leaves))
    order += [(-reads, -_leaf_bytes(leaf), g, i, leaf)
              for i, leaf in enumerate(leaves)]
  for _, minus_bytes, g, i, leaf in sorted(order, key=lambda x: x[:4]):
    nbytes = -minus_bytes
    tier = next((t for t, free in room.items()
                 if free >= _charge(nbytes, slots[t])), None)
    if tier is None:
      raise ValueError(
          f"a leaf of {nbytes} bytes (group {g}, leaf {i}) "
          f"fits in no tier of pool {pool.id}: free bytes per tier {room}")
    room[tier] -= _charge(nbytes, slots[tier])
    if nbytes <= _SLAB_MAX:
      size = _slab_class(max(nbytes, 1))
      slots[tier][size] = slots[tier].get(size, 0) + 1
    kinds[g][i] = tier
  return [jax.tree_util.tree_unflatten(d, k) for d, k in zip(treedefs, kinds)]
