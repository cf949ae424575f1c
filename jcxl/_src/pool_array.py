"""PoolArray: an array whose bytes live in a jcxl pool, one object per shard.

A PoolArray is a pytree whose only leaf is an int32 array of handles, one
per device (laid out over the devices of its sharding, so that inside a
``shard_map`` each device sees its own handle). Everything else (pool id,
global shape, dtype, sharding, tier, the leaf's path and the concrete
handles) is static: a step compiled for it is reused as long as it is the
same objects, and errors are raised at trace time, naming the leaf.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jcxl._src import errors
from jcxl._src import dispatched
from jcxl._src import registry
from jcxl._src.pool import Tier
from jcxl._src.units import format_bytes


# jcxl.fetch, set by stream.py (which imports this module, so this one
# cannot import it back): what a PoolArray under jax.jit becomes.
fetch_traced: list[Any] = []


def device_grid(sharding: jax.sharding.Sharding
                ) -> tuple[np.ndarray, jax.sharding.Sharding]:
  """The devices of `sharding` as a grid, and the sharding of a handle grid.

  Returns:
    `devices`, an object array of devices (the mesh's shape for a
    NamedSharding, shape (1,) for a single device), and the sharding that
    places element `i` of an int32 array of that shape on `devices[i]`.
  """
  if isinstance(sharding, jax.sharding.NamedSharding):
    mesh = sharding.mesh
    spec = jax.sharding.PartitionSpec(*mesh.axis_names)
    return mesh.devices, jax.sharding.NamedSharding(mesh, spec)
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    (device,) = sharding.device_set
    grid = np.empty((1,), dtype=object)
    grid[0] = device
    return grid, sharding
  raise TypeError(
      "a PoolArray's sharding must be a jax.sharding.NamedSharding or "
      f"SingleDeviceSharding, but got {type(sharding).__name__}")


def shard_shape(shape: tuple[int, ...], sharding: jax.sharding.Sharding
                ) -> tuple[int, ...]:
  return tuple(sharding.shard_shape(shape))


@jax.tree_util.register_pytree_node_class
class PoolArray:
  """An array stored in a jcxl pool (tiers ``host``, ``cxl`` or ``nvme``).

  Made by ``jcxl.place``; turned back into a ``jax.Array`` by
  ``jcxl.gather``, or streamed into a jitted step by ``jcxl.fetch`` and
  ``jcxl.cxl_offload``.

  Example:
    >>> pool = jcxl.Pool(host="64MiB", cxl="256MiB")
    >>> w = jcxl.place(jnp.ones((512, 512)), "cxl", pool=pool)
    >>> w
    PoolArray(float32[512,512], cxl (EMULATED ...), pool 1, 1 shard)

  Under ``jax.tree_util`` a PoolArray is a node, not a leaf: its one leaf
  is its handle array. It has to be: a placed tree is passed through
  ``jax.jit``, ``lax.scan`` and ``cxl_offload``, which take only arrays as
  leaves. So ``jax.tree.leaves(placed)`` lists handles; to see the
  PoolArrays themselves (their ``shape``, ``dtype``, ``size``), say so:

    >>> is_pool = lambda x: isinstance(x, jcxl.PoolArray)
    >>> sum(x.size for x in jax.tree.leaves(params, is_leaf=is_pool))
    922752
    >>> jax.tree.map(lambda x: x.shape, params, is_leaf=is_pool)

  ``jcxl.gather(tree)`` brings the values back as ``jax.Array``s.

  Attributes:
    handles: int32 array, one handle per device of `sharding`.
    shape, dtype: of the whole (global) array.
    sharding: how the array is split over devices; one object per device.
    tier: the pool tier holding the objects.
    path: the pytree path the array was placed from (for messages).
  """

  def __init__(self, handles: Any, *, pool_id: int, shape: Sequence[int],
               dtype: Any, sharding: jax.sharding.Sharding, tier: Tier,
               path: str, local_handles: tuple[tuple[int, int], ...]):
    self.handles = handles
    self.pool_id = pool_id
    self.shape = tuple(int(d) for d in shape)
    self.dtype = np.dtype(dtype)
    self.sharding = sharding
    self.tier = tier
    self.path = path
    # (device id, handle) for this process's devices: static, for checks.
    self.local_handles = local_handles

  # -------------------------------------------------------------- pytree

  def tree_flatten(self):
    return (self.handles,), (self.pool_id, self.shape, self.dtype,
                             self.sharding, self.tier, self.path,
                             self.local_handles)

  @classmethod
  def tree_unflatten(cls, aux, children):
    pool_id, shape, dtype, sharding, tier, path, local_handles = aux
    return cls(children[0], pool_id=pool_id, shape=shape, dtype=dtype,
               sharding=sharding, tier=tier, path=path,
               local_handles=local_handles)

  # ---------------------------------------------------------- properties

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def nbytes(self) -> int:
    return self.size * self.dtype.itemsize

  @property
  def memory_kind(self) -> str:
    return self.tier.value

  @property
  def shard_shape(self) -> tuple[int, ...]:
    return shard_shape(self.shape, self.sharding)

  # The pool object's own shape per shard (a view's differs from `shape`).
  object_shard_shape = shard_shape
  block_rows = 0  # 0: slices along axis 0 are single rows (stacked layers)

  @property
  def pool(self):
    """The pool holding this array (PoolClosedError if it was closed)."""
    return registry.find_pool(self.pool_id, what=self._what())

  def aval(self) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=self.sharding)

  def delete(self) -> None:
    """Frees this array's objects in the pool, once the steps this thread
    has dispatched (which may still read or write them) are done."""
    pool = self.pool
    dispatched.wait_before(f"{self._what()} was deleted")
    for _, handle in self.local_handles:
      pool.free(handle)

  def __jax_array__(self):
    if isinstance(self.handles, jax.core.Tracer) and fetch_traced:
      # Passed into a function under jax.jit (an eval helper): its value
      # is fetched where the function needs it.
      return fetch_traced[0](self)
    raise TypeError(
        f"{self._what()} was used as an array inside traced code (closed "
        "over by a step?). Pass it to a jcxl.cxl_offload step as an "
        "argument, fetch it with jcxl.fetch, or bring it back with "
        "jcxl.gather")

  def check_handles(self) -> None:
    """Raises ValueError if this array's handle leaf does not name its own
    objects.

    A placed tree mapped over as if its leaves were arrays (``tx.init(
    placed)``, ``jax.tree.map(jnp.zeros_like, placed)``) rebuilds each
    PoolArray around a new leaf computed from its handles; that array would
    read another array's objects, or none. Traced handles are not checked.
    """
    handles = self.handles
    if (self.pool_id < 0 or  # planned without a pool: no objects
        not isinstance(handles, (np.ndarray, jax.Array)) or
        isinstance(handles, jax.core.Tracer) or
        not getattr(handles, "is_fully_addressable", True)):
      return
    got = sorted(np.asarray(handles).ravel().tolist())
    want = sorted(handle for _, handle in self.local_handles)
    if got != want:
      raise ValueError(
          f"{self._what()} holds handles {got}, not its objects' {want}: "
          "the placed tree was mapped over as if its leaves were arrays "
          "(optax's tx.init(placed), jax.tree.map(f, placed)). Build new "
          "state from values, e.g. tx.init(jcxl.gather(params)) or "
          "jcxl.init_in_pool, and map over PoolArrays with "
          "is_leaf=lambda x: isinstance(x, jcxl.PoolArray)")

  def _what(self) -> str:
    return f"PoolArray {self.path or '(unnamed)'}"

  def _freed(self, handle: int) -> errors.UnknownHandleError:
    return errors.UnknownHandleError(
        f"{self._what()}: its object (handle {handle}) was freed")

  def __repr__(self) -> str:
    dims = ",".join(str(d) for d in self.shape)
    shards = len(self.local_handles)
    try:
      where = self.pool.stats()[self.tier].label()
    except Exception:  # a closed pool still prints
      where = f"{self.tier.value} (pool closed)"
    path = f", path={self.path}" if self.path else ""
    shard_bytes = int(np.prod(self.shard_shape)) * self.dtype.itemsize
    return (f"PoolArray({self.dtype.name}[{dims}], {where}, pool "
            f"{self.pool_id}, {shards} shard{'s' * (shards != 1)} of "
            f"{format_bytes(shard_bytes)}{path})")


class Liveness:
  """Checks, before each run of a compiled step, that its arrays' objects
  still exist: a freed one would otherwise fail inside the step, by
  handle, not by name. A pool's handles are listed again only after
  something in it was freed, so a repeated check costs a lookup a pool.
  """

  def __init__(self, arrays: Sequence[PoolArray]):
    self._held: dict[int, list[tuple[int, PoolArray]]] = {}
    for x in arrays:
      for _, handle in x.local_handles:
        self._held.setdefault(x.pool_id, []).append((handle, x))
    self._checked: dict[int, int] = {}  # pool id -> its frees when checked

  def check(self) -> None:
    """Raises PoolClosedError or UnknownHandleError naming the array."""
    for pool_id, held in self._held.items():
      pool = registry.find_pool(pool_id, what=held[0][1]._what())
      frees = pool._frees  # pylint: disable=protected-access
      if self._checked.get(pool_id) == frees:
        continue
      live = set(pool.handles())
      for handle, x in held:
        if handle not in live:
          raise x._freed(handle)
      self._checked[pool_id] = frees


class RowBlocks(PoolArray):
  """A PoolArray seen as blocks of rows along axis 0 (a view, not a copy).

  It looks like a stacked array of shape ``(count, rows) + shape[1:]``:
  slice ``i`` is rows ``[i * block_rows, i * block_rows + rows)`` of the
  object. `rows` is `block_rows` for the full blocks; a view of the shorter
  last block has ``rows = shape[0] % block_rows`` and is sliced at
  ``count - 1``. It lets a large table's optimizer update stream a block at
  a time, as stacked layers stream a layer at a time.
  """

  def __init__(self, base: PoolArray, block_rows: int, tail: bool = False):
    full = base.shape[0] // block_rows
    rows = base.shape[0] - full * block_rows if tail else block_rows
    if not 0 < rows <= base.shape[0]:
      raise ValueError(f"{base._what()} of {base.shape[0]} rows has no "
                       f"{'last ' * tail}block of {block_rows} rows")
    sharding = base.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
      spec = jax.sharding.PartitionSpec(None, *sharding.spec)
      sharding = jax.sharding.NamedSharding(sharding.mesh, spec)
    super().__init__(
        base.handles, pool_id=base.pool_id,
        shape=(full + tail, rows) + base.shape[1:], dtype=base.dtype,
        sharding=sharding, tier=base.tier, path=base.path,
        local_handles=base.local_handles)
    self.base = base
    self.block_rows = block_rows

  @property
  def object_shard_shape(self) -> tuple[int, ...]:
    return self.base.shard_shape
