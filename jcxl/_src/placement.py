"""Memory kinds per pytree leaf: ``place`` a tree into the pool, ``gather``
it back.

Memory kinds:
  ``device``       an ordinary jax.Array on the device;
  ``pinned_host``  a jax.Array in JAX's own pinned host memory kind;
  ``host``         a PoolArray in jcxl's DRAM tier;
  ``cxl``          a PoolArray in the CXL tier (emulated where absent);
  ``nvme``         a PoolArray in the NVMe file tier.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jcxl._src import dispatched
from jcxl._src import distributed
from jcxl._src import pool_array as pool_array_lib
from jcxl._src import registry
from jcxl._src import topology as topology_lib
from jcxl._src import validation
from jcxl._src.pool import Pool
from jcxl._src.pool import Tier
from jcxl._src.pool_array import PoolArray
from jcxl._src.pool_array import device_grid

MEMORY_KINDS = ("device", "pinned_host", "host", "cxl", "nvme")
POOL_KINDS = ("host", "cxl", "nvme")
Rules = Sequence[tuple[str, str]]


def check_kind(kind: Any, where: str = "") -> str:
  if kind not in MEMORY_KINDS:
    choices = ", ".join(repr(k) for k in MEMORY_KINDS)
    at = f" (for leaf {where})" if where else ""
    raise ValueError(
        f"memory_kind must be one of {choices}, but got {kind!r}{at}")
  return kind


def _is_rules(kinds: Any) -> bool:
  return (isinstance(kinds, (list, tuple)) and bool(kinds) and all(
      isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str)
      for r in kinds))


def resolve_kinds(tree: Any, kinds: str | Rules | Any) -> list[str]:
  """The memory kind of every leaf of `tree`, in flattening order.

  Args:
    kinds: one kind for all leaves; ordered ``(regex, kind)`` rules matched
      with ``re.search`` against each leaf's path (``jax.tree_util.keystr``,
      e.g. ``"['layers'][0]['kernel']"``), first match wins; or a pytree of
      kinds with the structure of `tree` (or a prefix of it).
  """
  leaves_with_paths = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, PoolArray))[0]
  paths = [jax.tree_util.keystr(p) for p, _ in leaves_with_paths]
  if isinstance(kinds, str):
    return [check_kind(kinds, path) for path in paths]
  if _is_rules(kinds):
    compiled = []
    for pattern, kind in kinds:
      try:
        compiled.append((re.compile(pattern), check_kind(kind)))
      except re.error as e:
        raise ValueError(f"bad placement rule pattern {pattern!r}: {e}"
                         ) from None
    out = []
    for path in paths:
      for regex, kind in compiled:
        if regex.search(path):
          out.append(kind)
          break
      else:
        raise ValueError(
            f"no placement rule matches leaf {path}; add a catch-all rule "
            "such as ('.*', 'device')")
    return out
  is_pool_array = lambda x: isinstance(x, PoolArray)
  kinds_def = jax.tree_util.tree_structure(kinds)
  try:
    subtrees = kinds_def.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    raise ValueError(
        "kinds must be a memory kind, a list of (regex, kind) rules, or a "
        f"pytree of kinds matching the tree's structure: {e}") from None
  flat = [kind for kind, sub in zip(jax.tree_util.tree_leaves(kinds), subtrees)
          for _ in jax.tree_util.tree_leaves(sub, is_leaf=is_pool_array)]
  return [check_kind(k, path) for k, path in zip(flat, paths)]


def _default_sharding(leaf: Any) -> jax.sharding.Sharding:
  sharding = getattr(leaf, "sharding", None)
  if isinstance(sharding, (jax.sharding.NamedSharding,
                           jax.sharding.SingleDeviceSharding)):
    return sharding.with_memory_kind("device") if isinstance(
        sharding, jax.sharding.NamedSharding) else sharding
  return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _check_devices(pool: Pool, devices: np.ndarray, path: str) -> None:
  """This process's devices of `devices` are near `pool` (another process's
  are its own pool's business)."""
  me = jax.process_index()
  for device in devices.flat:
    if device.process_index != me:
      continue
    node = topology_lib.device_node(device, pool.topology)
    if node != pool.node:
      raise ValueError(
          f"leaf {path}: device {device} is nearest NUMA node {node}, but "
          f"pool {pool.id} serves node {pool.node}; use a pool per node")


def store_shards(shard_of: Callable[[Any], np.ndarray] | None, *, pool: Pool,
                 tier: Tier, sharding: jax.sharding.Sharding,
                 shape: tuple[int, ...], dtype: Any, path: str,
                 make_object: Callable[[Any], int] | None = None
                 ) -> PoolArray:
  """A PoolArray of one new object per local device of `sharding`, each
  holding ``shard_of(device)`` (or made by ``make_object(device)``, which
  returns its handle). If any fails, the objects made so far are freed and
  the error raised: the pool holds what it held before.

  A dtype in non-native byte order is stored (and recorded) as its native
  twin, as ``Pool.put`` does."""
  shape, dtype, _ = validation.object_spec(shape, dtype, what=f"leaf {path}",
                                           nonempty=True)
  if make_object is None:
    make_object = lambda device: pool.put(shard_of(device), tier)
  devices, handle_sharding = device_grid(sharding)
  _check_devices(pool, devices, path)
  if distributed.spans_processes(devices.flat):
    distributed.check_pools_agree(pool)
  handles = np.zeros(devices.shape, np.int32)
  local = []
  me = jax.process_index()
  try:
    for position, device in np.ndenumerate(devices):
      if device.process_index == me:
        handles[position] = make_object(device)
        local.append((device.id, int(handles[position])))
  except BaseException:
    for _, handle in local:
      pool.free(handle)
    raise
  handle_array = jax.make_array_from_callback(
      handles.shape, handle_sharding, lambda index: handles[index])
  return PoolArray(handle_array, pool_id=pool.id, shape=tuple(shape),
                   dtype=dtype, sharding=sharding, tier=tier, path=path,
                   local_handles=tuple(local))


def is_typed_key(leaf: Any) -> bool:
  """A typed PRNG key array (``jax.random.key``): kept on the device."""
  dtype = getattr(leaf, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype,
                                                     jax.dtypes.prng_key)


def as_jax_value(leaf: Any, path: str = "") -> Any:
  """`leaf` with the dtype ``jnp.asarray`` gives it (a Python int is int32
  with x64 off), without a copy to the device."""
  if isinstance(leaf, jax.Array):
    return leaf
  value = np.asarray(leaf)
  dtype = jax.dtypes.canonicalize_dtype(value.dtype)
  if (isinstance(leaf, int) and not isinstance(leaf, bool) and
      not np.iinfo(dtype).min <= leaf <= np.iinfo(dtype).max):
    # jnp.asarray refuses such an int too; astype would wrap it silently.
    raise OverflowError(
        f"leaf {path or '(root)'}: Python int {leaf} does not fit "
        f"{dtype}, the dtype jnp.asarray gives it"
        f"{' with x64 off' if dtype.itemsize < 8 else ''}; pass an "
        "array of the dtype you mean")
  return value.astype(dtype, copy=False)


def to_pool(leaf: Any, tier: Tier, pool: Pool,
            sharding: jax.sharding.Sharding, path: str) -> PoolArray:
  """Stores `leaf` in `pool`, one object per device of `sharding`."""
  value = as_jax_value(leaf, path)
  index_map = sharding.devices_indices_map(tuple(value.shape))
  shards = {}
  if isinstance(value, jax.Array):
    shards = {s.device.id: s.data for s in value.addressable_shards}

  def shard_of(device):
    shard = shards.get(device.id)
    if shard is None or shard.shape != sharding.shard_shape(value.shape):
      shard = np.asarray(value)[index_map[device]]
    return np.asarray(shard)
  return store_shards(shard_of, pool=pool, tier=tier, sharding=sharding,
                      shape=value.shape, dtype=value.dtype, path=path)


def place(tree: Any, kinds: str | Rules | Any = "cxl", *,
          pool: Pool | None = None,
          sharding: jax.sharding.Sharding | Any | None = None) -> Any:
  """Puts each leaf of `tree` where its memory kind says.

  ``device`` and ``pinned_host`` leaves stay ``jax.Array``s (the latter in
  JAX's pinned host memory); ``host``, ``cxl`` and ``nvme`` leaves become
  ``PoolArray``s, stored one object per device shard. Every leaf gets the
  dtype ``jnp.asarray`` would give it (a Python ``0`` is ``int32`` with
  x64 off). Pool leaves must be numeric (as ``Pool.put``); one in
  non-native byte order (``'>f4'``) becomes a PoolArray of the native
  dtype (``float32``), same values. Typed PRNG keys (``jax.random.key``)
  stay on the device whatever their kind says: they are a few bytes, and a
  step hands them on as keys.

  Example:
    >>> pool = jcxl.Pool(host="256MiB", cxl="1GiB")
    >>> params = jcxl.place(params, [(r"embed", "host"), (r".*", "cxl")],
    ...                     pool=pool)

  Args:
    tree: a pytree of arrays.
    kinds: a memory kind for every leaf, ordered ``(regex, kind)`` rules on
      leaf paths, or a pytree of kinds (see ``resolve_kinds``).
    pool: the pool for ``host``, ``cxl`` and ``nvme`` leaves.
    sharding: a ``jax.sharding.Sharding`` for every leaf or a pytree of
      them; default: each leaf's own sharding, else the first device.

  Returns:
    A tree of the same structure with ``jax.Array`` and ``PoolArray`` leaves.

  Raises:
    ValueError: an unknown memory kind, no pool for a pool kind, or a
      sharding whose devices are not near the pool's NUMA node.
    TypeError: a pool leaf's dtype is not numeric (object, string...).
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, PoolArray))
  kinds_flat = resolve_kinds(tree, kinds)
  if sharding is None or isinstance(sharding, jax.sharding.Sharding):
    shardings = [sharding] * len(flat)
  else:
    shardings = treedef.flatten_up_to(sharding)
  if pool is None and any(k in POOL_KINDS for k in kinds_flat):
    raise ValueError("memory kinds 'host', 'cxl' and 'nvme' need a pool: "
                     "pass pool=jcxl.Pool(...)")
  if pool is not None:
    if not isinstance(pool, Pool):
      raise TypeError(f"pool must be a jcxl.Pool, but got {pool!r}")
    registry.find_pool(pool.id, what="place()")
  out = []
  placed: list[PoolArray] = []
  try:
    for (path, leaf), kind, leaf_sharding in zip(flat, kinds_flat, shardings):
      name = jax.tree_util.keystr(path)
      if isinstance(leaf, PoolArray):
        if leaf.memory_kind != kind:
          raise ValueError(
              f"leaf {name} is already in the pool ({leaf.memory_kind}); "
              f"gather it before placing it as {kind!r}")
        out.append(leaf)
        continue
      if leaf_sharding is not None and not isinstance(
          leaf_sharding, jax.sharding.Sharding):
        raise TypeError(
            f"sharding for leaf {name} must be a jax.sharding.Sharding (or "
            f"None: the leaf's own), but got {leaf_sharding!r}")
      leaf_sharding = leaf_sharding or _default_sharding(leaf)
      if kind == "device" or is_typed_key(leaf):
        out.append(jax.device_put(leaf, leaf_sharding))
      elif kind == "pinned_host":
        out.append(jax.device_put(
            leaf, leaf_sharding.with_memory_kind("pinned_host")))
      else:
        array = to_pool(leaf, Tier(kind), pool, leaf_sharding, name)
        placed.append(array)
        out.append(array)
  except BaseException:
    for array in placed:
      array.delete()
    raise
  return jax.tree_util.tree_unflatten(treedef, out)


def gather_one(array: PoolArray) -> jax.Array:
  """Reads a PoolArray's objects back into a jax.Array with its sharding."""
  array.check_handles()
  pool = array.pool
  by_device = dict(array.local_handles)
  devices, _ = device_grid(array.sharding)
  shards = []
  for device in devices.flat:
    if device.id in by_device:
      shards.append(jax.device_put(pool.get(by_device[device.id]), device))
  return jax.make_array_from_single_device_arrays(array.shape, array.sharding,
                                                  shards)


pool_array_lib.readers.gather = gather_one  # see PoolArray.__jax_array__


def gather(tree: Any) -> Any:
  """Brings every PoolArray of `tree` back as a ``jax.Array``.

  It first waits for the steps already dispatched (an offloaded step's
  stores may still be writing the objects); if one of them failed, its
  error is raised here (once).

  Example:
    >>> params = jcxl.gather(params)  # ordinary arrays again
  """
  if any(isinstance(x, PoolArray) for x in jax.tree_util.tree_leaves(
      tree, is_leaf=lambda x: isinstance(x, PoolArray))):
    dispatched.barrier()  # raises a failed step's error, once
  return jax.tree_util.tree_map(
      lambda x: gather_one(x) if isinstance(x, PoolArray) else x, tree,
      is_leaf=lambda x: isinstance(x, PoolArray))
