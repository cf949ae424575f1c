"""PoolArray: an array whose bytes live in a jcxl pool, one object per shard.

For ``jax.tree`` a PoolArray is a leaf that reads like an array (shape,
dtype, size, sharding; ``np.asarray`` and ``jnp.asarray`` read its
values). Where JAX traces (``jax.jit``, ``lax.scan``) it is a node whose
only child is an int32 array of handles, one per device (laid out over the
devices of its sharding, so that inside a ``shard_map`` each device sees
its own handle). Everything else (pool id, global shape, dtype, sharding,
tier, the leaf's path and the concrete handles) is static: a step compiled
for it is reused as long as it is the same objects, and errors are raised
at trace time, naming the leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
import contextlib
import copy
import dataclasses
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jcxl._src import dispatched
from jcxl._src import errors
from jcxl._src import jax_compat
from jcxl._src import registry
from jcxl._src.pool import Tier
from jcxl._src.units import format_bytes


# Set while cxl_offload traces a step: see closed_over_refused.
_in_offloaded_trace = threading.local()


@contextlib.contextmanager
def closed_over_refused() -> Iterator[None]:
  """Inside it (cxl_offload tracing a step), a PoolArray read as an array
  raises TypeError: the step gets its state as arguments, which it plans
  and writes back; one it closes over would be read behind the plan."""
  before = getattr(_in_offloaded_trace, "on", False)
  _in_offloaded_trace.on = True
  try:
    yield
  finally:
    _in_offloaded_trace.on = before


@dataclasses.dataclass
class _Readers:
  """How a PoolArray read as an array gets its values: `fetch` (jcxl.fetch,
  inside a traced function) and `gather` (outside one). stream.py and
  placement.py set them when imported; they import this module, so it
  cannot import them back."""
  fetch: Callable[["PoolArray"], jax.Array] | None = None
  gather: Callable[["PoolArray"], jax.Array] | None = None


readers = _Readers()


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

  It behaves as an array leaf wherever its metadata or its values are
  read: ``jax.tree.leaves(placed)`` lists PoolArrays, ``x.shape``,
  ``x.dtype``, ``x.size``, ``x.ndim``, ``x.nbytes`` and ``x.sharding`` are
  the array's, and ``np.asarray(x)``, ``jnp.asarray(x)``, ``x @ y`` or
  ``x * 2`` read its values (outside a trace from the pool; inside
  ``jax.jit`` with ``jcxl.fetch``, where the function uses it):

    >>> sum(x.size for x in jax.tree.leaves(params))
    922752
    >>> jax.tree.map(lambda x: x.shape, params)
    >>> jax.jit(eval_step)(params, batch)  # fetched where eval_step reads

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

  # ------------------------------------------------------------- tracing

  def static_key(self) -> tuple[Any, ...]:
    """Everything but the handle array: what a step compiled for this
    array is specific to (its handles included, as `local_handles`)."""
    return (type(self), self.pool_id, self.shape, self.dtype, self.sharding,
            self.tier, self.path, self.local_handles)

  def with_handles(self, handles: Any) -> PoolArray:
    """This array with another handle array (traced, or baked to NumPy)."""
    out = copy.copy(self)
    out.handles = handles
    return out

  # ---------------------------------------------------------- properties

  @property
  def ndim(self) -> int:
    """The number of dimensions."""
    return len(self.shape)

  @property
  def size(self) -> int:
    """The number of elements."""
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def nbytes(self) -> int:
    """The array's bytes (all shards), as numpy's `nbytes`."""
    return self.size * self.dtype.itemsize

  @property
  def memory_kind(self) -> str:
    """The tier the array lives in, as a memory kind ('cxl', 'nvme', ...)."""
    return self.tier.value

  @property
  def shard_shape(self) -> tuple[int, ...]:
    """The shape of one shard (the whole shape where it is not sharded)."""
    return shard_shape(self.shape, self.sharding)

  # The pool object's own shape per shard (a view's differs from `shape`).
  object_shard_shape = shard_shape
  block_rows = 0  # 0: slices along axis 0 are single rows (stacked layers)

  @property
  def pool(self):
    """The pool holding this array (PoolClosedError if it was closed)."""
    return registry.find_pool(self.pool_id, what=self._what())

  def aval(self) -> jax.ShapeDtypeStruct:
    """The abstract value (shape and dtype) JAX sees for the array."""
    return jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=self.sharding)

  def delete(self) -> None:
    """Frees this array's objects in the pool, once the steps this thread
    has dispatched (which may still read or write them) are done."""
    pool = self.pool
    dispatched.wait_before(f"{self._what()} was deleted")
    for _, handle in self.local_handles:
      pool.free(handle)

  # -------------------------------------------------------- array-like

  def __jax_array__(self) -> jax.Array:
    if getattr(_in_offloaded_trace, "on", False):
      raise TypeError(
          f"{self._what()} was used as an array inside a jcxl.cxl_offload "
          "step that closed over it: pass it to the step as an argument "
          "(its state), or bring it back with jcxl.gather")
    if isinstance(self.handles, jax.core.Tracer) or jax_compat.tracing():
      # In a traced function (an eval helper under jax.jit): fetched where
      # the function reads it, not baked in as a constant of today's value.
      return readers.fetch(self)
    return readers.gather(self)

  def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
    del copy  # a new array either way
    if isinstance(self.handles, jax.core.Tracer) or jax_compat.tracing():
      raise TypeError(
          f"{self._what()}: np.asarray cannot read a pool array inside a "
          "traced function; use jnp.asarray (a fetch) there")
    out = np.asarray(self.__jax_array__())
    return out if dtype is None else out.astype(dtype)

  def __len__(self) -> int:
    if not self.shape:
      raise TypeError(f"len() of unsized {self._what()} (a scalar)")
    return self.shape[0]

  def __iter__(self):
    # Without it Python would iterate through __getitem__, and JAX clamps
    # out-of-range indices instead of raising IndexError: no end.
    value = jnp.asarray(self)
    return (value[i] for i in range(len(self)))

  def __getitem__(self, index: Any) -> jax.Array:
    return jnp.asarray(self)[index]

  @property
  def T(self) -> jax.Array:  # pylint: disable=invalid-name
    """The transpose, read as a jax.Array (the data is fetched)."""
    return jnp.asarray(self).T

  @property
  def real(self) -> jax.Array:
    """The real part, read as a jax.Array (the data is fetched)."""
    return jnp.real(self)

  @property
  def imag(self) -> jax.Array:
    """The imaginary part, read as a jax.Array (the data is fetched)."""
    return jnp.imag(self)


  def check_handles(self) -> None:
    """Raises ValueError if this array's handle array does not name its own
    objects.

    A PoolArray rebuilt around another handle array (returned from a
    ``jax.jit`` function that computed new handles) would read another
    array's objects, or none. Traced handles are not checked.
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
          "it was rebuilt around other handles (returned from a jitted "
          "function that computed them?). Use the PoolArray jcxl.place "
          "or jcxl.init_in_pool made")

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


# Python's operator -> the jax.numpy function it applies.
_BINARY = {"__add__": jnp.add, "__sub__": jnp.subtract,
           "__mul__": jnp.multiply, "__truediv__": jnp.true_divide,
           "__floordiv__": jnp.floor_divide, "__mod__": jnp.mod,
           "__pow__": jnp.power, "__matmul__": jnp.matmul}


def _binary(fn: Any, reflected: bool) -> Any:
  if reflected:
    return lambda self, other: fn(other, jnp.asarray(self))
  return lambda self, other: fn(jnp.asarray(self), other)


# Operators read the values as jnp.asarray does (`w * 2`, `x @ w`);
# comparisons and hashing stay object identity (PoolArrays are dict keys).
for _dunder, _fn in _BINARY.items():
  setattr(PoolArray, _dunder, _binary(_fn, False))
  setattr(PoolArray, "__r" + _dunder[2:], _binary(_fn, True))
# The jax.Array methods tree utilities call (optax.tree_utils, metrics).
_METHODS = ("astype", "conj", "max", "mean", "min", "ravel", "reshape",
            "squeeze", "sum", "transpose", "item")


def _method(name: str) -> Any:
  return lambda self, *args, **kwargs: getattr(jnp.asarray(self), name)(
      *args, **kwargs)


for _name in _METHODS:
  setattr(PoolArray, _name, _method(_name))
PoolArray.__neg__ = lambda self: -jnp.asarray(self)
PoolArray.__pos__ = lambda self: jnp.asarray(self)
PoolArray.__abs__ = lambda self: abs(jnp.asarray(self))


def _flatten(x: PoolArray) -> tuple[tuple[Any], tuple[Any, ...]]:
  return (x.handles,), x.static_key()


def _unflatten(static: tuple[Any, ...], children: Sequence[Any]) -> PoolArray:
  cls, pool_id, shape, dtype, sharding, tier, path, local_handles = static
  assert cls is PoolArray, cls
  return PoolArray(children[0], pool_id=pool_id, shape=shape, dtype=dtype,
                   sharding=sharding, tier=tier, path=path,
                   local_handles=local_handles)


def _not_an_aval(x: PoolArray) -> TypeError:
  return TypeError(
      f"{x._what()} was passed to a JAX transformation that takes arrays "
      "(jax.grad, jax.vmap, jax.device_put): pass jcxl.gather(tree) to "
      "read the values, or run the function inside a jcxl.cxl_offload "
      "step (or jax.jit, which fetches the array where it is read)")


# A leaf for jax.tree, a node with its handles where JAX traces.
jax_compat.register_traced_node(PoolArray, _flatten, _unflatten)
jax_compat.register_abstract_error(PoolArray, _not_an_aval)


def map_handles(tree: Any, fn: Any) -> Any:
  """`tree` with each PoolArray's handle array replaced by ``fn(handles)``
  (the rest of the tree as it is)."""
  return jax.tree_util.tree_map(
      lambda x: x.with_handles(fn(x.handles)) if isinstance(x, PoolArray)
      else x, tree)


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

  def static_key(self) -> tuple[Any, ...]:
    return super().static_key() + (self.block_rows,)
