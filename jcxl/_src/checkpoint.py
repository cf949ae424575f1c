"""Checkpoints of pool-resident state, in Orbax's format.

``save`` writes a pytree of PoolArrays, jax.Arrays, numpy arrays and Python
scalars as an Orbax PyTree checkpoint (OCDBT + zarr through tensorstore,
``_METADATA``, ``_CHECKPOINT_METADATA``): Orbax alone restores it, every
PoolArray as a plain ``jax.Array``. The writing is Orbax's own, but it is
fed a few arrays at a time (at most the largest leaf or 8 MiB), read from
the pool just before they are written and dropped once their bytes are
committed, so that the model is never in host memory at once.

``restore`` reads a checkpoint back; leaves bound for the pool go straight
into it, one shard at a time, in any tier and with any sharding (another
device count included).

Saves are atomic: Orbax writes into ``<path>.orbax-checkpoint-tmp`` and
renames it to `path` at the end, so a save killed midway leaves no `path`
and every earlier checkpoint intact; ``latest`` and ``restore`` ignore the
temporary directory, and the next save of the same path removes it.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
import dataclasses
import json
import logging
import os
import re
from collections.abc import Sequence
from typing import Any

from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from jcxl._src import checkpoint_checksums as checksums
from jcxl._src import dispatched
from jcxl._src import errors
from jcxl._src import orbax_compat
from jcxl._src import registry
from jcxl._src import validation
from jcxl._src.placement import _check_devices
from jcxl._src.placement import store_shards
from jcxl._src.pool import Pool
from jcxl._src.pool import Tier
from jcxl._src.pool import as_tier
from jcxl._src.pool_array import PoolArray
from jcxl._src.pool_array import device_grid
from jcxl._src.units import format_bytes

logger = logging.getLogger(__name__)

# What jcxl adds to Orbax's own metadata ('custom_metadata' in _METADATA):
# the tier each PoolArray was saved from, by Orbax parameter name.
_METADATA_KEY = "jcxl"
# 2: with per-shard checksums (checkpoint_checksums).
_FORMAT_VERSION = 2
TMP_SUFFIX = orbax_compat.TMP_DIR_SUFFIX


def _is_pool_array(x: Any) -> bool:
  return isinstance(x, PoolArray)


class _PoolLeaf:
  """A PoolArray as one checkpoint leaf (not a pytree, so that Orbax does
  not look inside it at the handles)."""

  def __init__(self, array: PoolArray):
    self.array = array
    self.shape = array.shape
    self.dtype = array.dtype
    self.nbytes = array.nbytes


@dataclasses.dataclass
class _ToPool(ocp.RestoreArgs):
  """Restore arguments of a leaf that goes into the pool."""
  pool: Pool | None = None
  tier: Tier | None = None
  sharding: jax.sharding.Sharding | None = None
  shape: tuple[int, ...] = ()
  path: str = ""
  into: PoolArray | None = None  # write into this array's objects


def _release_freed_memory(nbytes: int) -> None:
  """Gives memory freed by tensorstore's threads back to the system.

  glibc keeps what a thread frees in that thread's arena; with many I/O
  threads each holding on to an array's worth, a save's resident memory
  would grow with the number of threads instead of staying at one group of
  arrays. Trimming costs milliseconds, so it waits for _TRIM_BYTES freed.
  """
  global _freed
  _freed += nbytes
  if _LIBC is not None and _freed >= _TRIM_BYTES:
    _LIBC.malloc_trim(0)
    _freed = 0


_TRIM_BYTES = 4 << 20
_freed = 0


def _load_libc() -> Any:
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc_trim  # glibc only
    return libc
  except (OSError, AttributeError):
    return None


_LIBC = _load_libc()


def _index_key(index: tuple[slice, ...]) -> tuple:
  return tuple((s.start, s.stop, s.step) for s in index)


def _pool_array_shards(array: PoolArray) -> list[tuple[Any, np.ndarray]]:
  """This process's part of `array`, read from the pool: (index, data) for
  each distinct shard whose first holder (in device order) is local."""
  pool = array.pool
  handles = dict(array.local_handles)
  devices, _ = device_grid(array.sharding)
  index_map = array.sharding.devices_indices_map(array.shape)
  seen = set()
  out = []
  for device in devices.flat:
    index = index_map[device]
    key = _index_key(index)
    if key in seen:
      continue  # a replica: its first holder writes it
    seen.add(key)
    if device.id in handles:
      out.append((index, pool.get(handles[device.id])))
  return out


def _jax_array_shards(array: jax.Array) -> list[tuple[Any, np.ndarray]]:
  return [(s.index, np.asarray(s.data)) for s in array.addressable_shards
          if s.replica_id == 0]


def _host_array(array: PoolArray | jax.Array) -> orbax_compat.HostArray:
  """This process's shards of `array`, in host memory."""
  if isinstance(array, PoolArray):
    return orbax_compat.HostArray(_pool_array_shards(array), array.shape,
                                  array.sharding, array.dtype)
  ext = None
  if _is_key(array.dtype):
    ext = {orbax_compat.RANDOM_KEY_IMPL: str(jax.random.key_impl(array))}
    array = jax.random.key_data(array)
  return orbax_compat.HostArray(_jax_array_shards(array), array.shape,
                                array.sharding, np.dtype(array.dtype), ext)


def _is_key(dtype: Any) -> bool:
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _nbytes(array: Any) -> int:
  if _is_key(array.dtype):
    return 0  # a few words of key data
  return int(np.prod(array.shape, dtype=np.int64)) * np.dtype(
      array.dtype).itemsize


class _Handler(ocp.type_handlers.ArrayHandler):
  """Orbax's ArrayHandler, fed a few arrays at a time.

  It writes PoolArrays (and jax.Arrays) in ArrayHandler's format, so that
  Orbax's own handler reads them back as jax.Arrays; it reads leaves given
  ``_ToPool`` arguments straight into the pool, and any other leaf as
  ArrayHandler does.
  """

  def __init__(self, recorder: checksums.Recorder | None = None):
    self._store = orbax_compat.array_metadata_store_instance()
    self._recorder = recorder
    super().__init__(array_metadata_store=self._store)

  def _host_arrays(self, arrays: Sequence[Any],
                   infos: Sequence[ocp.type_handlers.ParamInfo]
                   ) -> list[orbax_compat.HostArray]:
    """`arrays` in host memory, their checksums recorded."""
    host = [_host_array(a) for a in arrays]
    if self._recorder is not None:
      for array, info in zip(host, infos):
        for index, data in array.shards:
          self._recorder.add(info.name, array.global_shape, index, data)
    return host

  async def serialize(self, values: Sequence[Any],
                      infos: Sequence[ocp.type_handlers.ParamInfo],
                      args: Sequence[ocp.SaveArgs] | None = None) -> list:
    args = args or [ocp.SaveArgs()] * len(values)
    arrays = [v.array if isinstance(v, _PoolLeaf) else v for v in values]
    for info in infos:
      await info.await_path_creation()
    await orbax_compat.write_shardings([a.sharding for a in arrays], infos)
    metadatas = []
    for group in checksums.groups([_nbytes(a) for a in arrays]):
      # Read from the pool, write, commit, drop: the model is never in
      # host memory at once.
      host = await asyncio.to_thread(
          self._host_arrays, [arrays[i] for i in group],
          [infos[i] for i in group])
      metadatas += await orbax_compat.write_host_arrays(
          host, [infos[i] for i in group], [args[i] for i in group])
      del host
      _release_freed_memory(sum(_nbytes(arrays[i]) for i in group))
    await orbax_compat.write_array_metadatas(self._store, infos[0].parent_dir,
                                             metadatas)
    if self._recorder is not None:
      self._recorder.write(infos[0].parent_dir, jax.process_index())
    return []  # everything is committed already

  async def deserialize(self, infos: Sequence[ocp.type_handlers.ParamInfo],
                        args: Sequence[ocp.RestoreArgs] | None = None
                        ) -> list[Any]:
    args = list(args or [None] * len(infos))
    out: list[Any] = [None] * len(infos)
    others = [i for i, a in enumerate(args) if not isinstance(a, _ToPool)]
    if others:
      restored = await super().deserialize([infos[i] for i in others],
                                           [args[i] for i in others])
      for i, value in zip(others, restored):
        out[i] = value
    to_pool = [i for i, a in enumerate(args) if isinstance(a, _ToPool)]
    stores = await asyncio.gather(*(_open(infos[i]) for i in to_pool))
    made = []
    try:
      for group in checksums.groups([_nbytes(args[i]) for i in to_pool]):
        # A group's distinct shards are read at once, then stored.
        reads = [_ShardReads(infos[to_pool[g]], args[to_pool[g]],
                             stores[g]) for g in group]
        await asyncio.gather(*(r.read() for r in reads))
        arrays = await asyncio.to_thread(_into_pool, reads, made)
        for g, array in zip(group, arrays):
          out[to_pool[g]] = array
        _release_freed_memory(sum(_nbytes(r.arg) for r in reads))
    except BaseException:
      for array in made:  # the pool keeps only what it held before
        array.delete()
      raise
    return out


def _into_pool(reads: Sequence[_ShardReads], made: list[PoolArray]
               ) -> list[PoolArray]:
  """Stores the arrays read; new ones are appended to `made` at once."""
  arrays = []
  for r in reads:
    arrays.append(r.into_pool())
    if r.arg.into is None:
      made.append(arrays[-1])
  return arrays


async def _open(info: ocp.type_handlers.ParamInfo) -> ts.TensorStore:
  tspec = ocp.type_handlers.get_json_tspec_read(
      info, use_ocdbt=bool(info.is_ocdbt_checkpoint))
  return await ts.open(ts.Spec(tspec), open=True, read=True,
                       context=info.ts_context)


class _ShardReads:
  """One array bound for the pool: its distinct shards, read from the
  checkpoint, then stored in new objects (or in `arg.into`'s)."""

  def __init__(self, info: ocp.type_handlers.ParamInfo, arg: _ToPool,
               store: ts.TensorStore):
    self.info, self.arg, self._store = info, arg, store
    self._devices, _ = device_grid(arg.sharding)
    _check_devices(arg.pool, self._devices, arg.path)
    index_map = arg.sharding.devices_indices_map(tuple(arg.shape))
    local_ids = {d.id for d in jax.local_devices()}
    # Shard index -> the local devices (grid positions) that hold it.
    self._holders = collections.defaultdict(list)
    for position, device in np.ndenumerate(self._devices):
      if device.id in local_ids:
        self._holders[_index_key(index_map[device])].append(
            (position, device, index_map[device]))
    self._data: list[np.ndarray] = []

  async def read(self) -> None:
    self._data = await asyncio.gather(*(
        self._store[members[0][2]].read()
        for members in self._holders.values()))

  def into_pool(self) -> PoolArray:
    arg = self.arg
    pool, dtype = arg.pool, np.dtype(arg.dtype)
    data, self._data = self._data, []
    if arg.into is not None:
      existing = dict(arg.into.local_handles)
      for members, shard in zip(self._holders.values(), data):
        for _, device, _ in members:
          pool.put_async(existing[device.id],
                         np.asarray(shard, dtype=dtype)).wait()
      return arg.into
    by_device = {device.id: shard
                 for members, shard in zip(self._holders.values(), data)
                 for _, device, _ in members}
    try:
      return store_shards(
          lambda device: np.asarray(by_device[device.id], dtype=dtype),
          pool=pool, tier=arg.tier, sharding=arg.sharding,
          shape=tuple(arg.shape), dtype=dtype, path=arg.path)
    except errors.PoolExhaustedError as e:
      shard_bytes = (int(np.prod(arg.sharding.shard_shape(tuple(arg.shape))))
                     * dtype.itemsize)
      raise errors.PoolExhaustedError(
          f"restoring {arg.path or self.info.name} "
          f"({format_bytes(shard_bytes)} per shard) into tier "
          f"{arg.tier.value!r} of pool {pool.id}: {e}; the leaves "
          "restored so far were freed, the pool holds what it held "
          "before") from e


class _Recorded:
  """Orbax's handler of numpy arrays and scalars, recording each value's
  checksum before Orbax writes it (mixed in before the handler)."""

  def __init__(self, recorder: checksums.Recorder | None):
    super().__init__()
    self._recorder = recorder

  async def serialize(self, values, infos, args=None):
    if self._recorder is not None:
      for value, info in zip(values, infos):
        self._recorder.add_whole(info.name, value)
      self._recorder.write(infos[0].parent_dir, jax.process_index())
    return await super().serialize(values, infos, args)


class _NumpyHandler(_Recorded, ocp.type_handlers.NumpyHandler):
  pass


class _ScalarHandler(_Recorded, ocp.type_handlers.ScalarHandler):
  pass


def _pytree_handler(recorder: checksums.Recorder | None = None
                    ) -> ocp.PyTreeCheckpointHandler:
  """Orbax's PyTree handler, with jcxl's handler for arrays (and checksums
  of every array and scalar recorded by `recorder`, when saving)."""
  handler = _Handler(recorder)
  types = ocp.type_handlers
  scalar = _ScalarHandler(recorder)
  # Uncompressed: weights and optimizer moments barely compress (about 8%
  # with zstd), and zstd holds two more copies of each array while it works.
  return ocp.PyTreeCheckpointHandler(
      use_compression=False,
      type_handler_registry=types.create_type_handler_registry(
          (int, scalar), (float, scalar), (bytes, scalar),
          (np.number, scalar), (np.ndarray, _NumpyHandler(recorder)),
          (str, types.StringHandler()), (jax.Array, handler),
          (_PoolLeaf, handler)))


# ------------------------------------------------------------------ save


def save(path: str | os.PathLike, tree: Any, *,
         metadata: dict[str, Any] | None = None) -> str:
  """Writes `tree` as an Orbax checkpoint at `path`, streaming the pool.

  Leaves may be PoolArrays (any tier), jax.Arrays, numpy arrays and Python
  or numpy scalars (a step count). PoolArrays are read from the pool and
  written a few at a time (at most the largest leaf or 8 MiB at once), so a
  save holds about one leaf in host memory beyond what the tree already
  holds, never the model.

  The checkpoint is Orbax's own: ``orbax.checkpoint.StandardCheckpointer()
  .restore(path)`` reads it without jcxl, PoolArrays as ``jax.Array``s with
  the sharding they had. It is written into ``<path>.orbax-checkpoint-tmp``
  and renamed to `path` at the end: a save that dies midway leaves no
  `path`, and earlier checkpoints are untouched. A temporary directory left
  by such a save is removed by the next save of the same `path`.

  Example:
    >>> state = {"params": params, "opt_state": opt_state, "step": 100}
    >>> jcxl.checkpoint.save("run/ckpt/100", state)   # params in the pool
    '/abs/run/ckpt/100'

  Args:
    path: the checkpoint's directory; it must not exist yet (its parent is
      created if missing).
    tree: the pytree to write.
    metadata: a JSON-serializable dict stored with the checkpoint (Orbax's
      ``custom_metadata``), read back by ``read_metadata``.

  Returns:
    The checkpoint's absolute path.

  Raises:
    FileExistsError: `path` exists (checkpoints are never overwritten: save
      each one under a new name, e.g. its step).
    ValueError: `tree` has no leaves, two of its leaves would be saved
      under one name (``{"a.b": x}`` and ``{"a": {"b": y}}``; nothing is
      written), or `metadata` uses the key 'jcxl'.
    TypeError: `metadata` is not JSON-serializable.
    PoolClosedError: a PoolArray's pool was closed.
  """
  path = os.path.abspath(os.fspath(path))
  if os.path.exists(path):
    raise FileExistsError(
        f"checkpoint path {path!r} exists; checkpoints are never overwritten:"
        " save under a new path (e.g. one per step) or delete it first")
  if TMP_SUFFIX in os.path.basename(path):
    raise ValueError(f"checkpoint path {path!r} must not contain "
                     f"{TMP_SUFFIX!r} (the suffix of unfinished saves)")
  leaves = jax.tree.leaves(tree, is_leaf=_is_pool_array)
  if not leaves:
    raise ValueError("tree has no leaves: there is nothing to save")
  _check_saveable(tree)
  if any(_is_pool_array(x) for x in leaves):
    registry.find_pool(next(x for x in leaves if _is_pool_array(x)).pool_id,
                       what="save()")
    dispatched.barrier()  # the stores of steps already dispatched, any thread
  item = jax.tree.map(lambda x: _PoolLeaf(x) if _is_pool_array(x) else x,
                      tree, is_leaf=_is_pool_array)
  _check_unique_names(item)
  flat = ocp.tree.to_flat_dict(tree, sep=".", is_leaf=_is_pool_array)
  tiers = {name: leaf.tier.value for name, leaf in flat.items()
           if _is_pool_array(leaf)}  # by Orbax's parameter names
  metadata = dict(metadata or {})
  if _METADATA_KEY in metadata:
    raise ValueError(f"metadata key {_METADATA_KEY!r} is reserved for jcxl")
  try:  # (Orbax would find out in a background thread, after the arrays)
    json.dumps(metadata)
  except (TypeError, ValueError) as e:
    raise TypeError(f"metadata must be a JSON-serializable dict: {e}"
                    ) from None
  custom = {**metadata,
            _METADATA_KEY: {"version": _FORMAT_VERSION, "pool_tiers": tiers,
                            "checksums": checksums.ALGORITHM}}
  os.makedirs(os.path.dirname(path), exist_ok=True)
  ocp.Checkpointer(_pytree_handler(checksums.Recorder())).save(
      epath.Path(path), args=ocp.args.PyTreeSave(item,
                                                 custom_metadata=custom))
  logger.info("saved checkpoint %s (%d leaves, %d from the pool)", path,
              len(leaves), len(tiers))
  return path


def _check_saveable(tree: Any) -> None:
  """Refuses a numpy leaf the pool could not hold (object, string,
  structured dtypes) before Orbax starts, which would fail midway."""
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=_is_pool_array)[0]:
    if isinstance(leaf, (np.ndarray, np.generic)):
      validation.object_spec(leaf.shape, leaf.dtype,
                             what=f"leaf {jax.tree_util.keystr(key_path)}")


def _check_unique_names(item: Any) -> None:
  """Refuses two leaves that Orbax would store under one name.

  Orbax names a leaf by its keys joined with '.', so ``{"a.b": x}`` and
  ``{"a": {"b": y}}`` are both ``a.b``: one would overwrite the other's
  data and the checkpoint could never be restored. Changing the names
  would change the format Orbax reads, so such a tree is refused before
  anything is written.
  """
  seen: dict[str, str] = {}
  for key_path, name in jax.tree_util.tree_flatten_with_path(
      ocp.tree.get_param_names(item))[0]:
    where = jax.tree_util.keystr(key_path)
    if name in seen:
      raise ValueError(
          f"leaves {seen[name]} and {where} would both be saved as "
          f"{name!r} (a checkpoint names each leaf by its keys joined with "
          "'.'), and one would overwrite the other; rename one of them. "
          "Nothing was written")
    seen[name] = where


# --------------------------------------------------------------- restore


def is_complete(path: str | os.PathLike) -> bool:
  """Whether `path` is a checkpoint whose save finished."""
  path = os.fspath(path)
  return (TMP_SUFFIX not in os.path.basename(os.path.normpath(path)) and
          os.path.isfile(os.path.join(path, "_METADATA")) and
          os.path.isfile(os.path.join(path, "_CHECKPOINT_METADATA")))


def latest(directory: str | os.PathLike) -> str | None:
  """The newest finished checkpoint in `directory`, or None.

  Newest is the one whose name ends in the largest number (``100``,
  ``step_000100``); unfinished saves (``*.orbax-checkpoint-tmp``) are
  ignored, and so are checkpoints ``restore`` would refuse (logged; the
  next newest is returned): metadata or checksum files that cannot be
  read, or a data file that is missing or shorter than the checkpoint's
  index says (checked from the index and the files' sizes, without
  reading the arrays).

  Example:
    >>> jcxl.checkpoint.latest("run/ckpt")
    '/abs/run/ckpt/100'
  """
  directory = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(directory):
    return None
  found = []
  for name in os.listdir(directory):
    match = re.search(r"(\d+)$", name)
    full = os.path.join(directory, name)
    if match and is_complete(full):
      found.append((int(match.group(1)), full))
  for _, full in sorted(found, reverse=True):
    problem = (_unreadable_metadata(full) or _missing_checksums(full) or
               checksums.missing_data(full))
    if problem is None:
      return full
    logger.warning("jcxl: skipping checkpoint %s: %s", full, problem)
  return None


def _unreadable_metadata(path: str) -> str | None:
  """Why the checkpoint's metadata files cannot be read, or None."""
  for name in ("_METADATA", "_CHECKPOINT_METADATA"):
    try:
      with open(os.path.join(path, name), encoding="utf-8") as f:
        if not isinstance(json.load(f), dict):
          return f"{name} does not hold a JSON object"
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError
      return f"{name} cannot be read: {e}"
  return None


def _checksummed(path: str, custom: dict[str, Any]) -> bool:
  """Whether the checkpoint must be verified: jcxl wrote it with checksums.

  Every jcxl save since format 2 records them; so either marker says so,
  and an edit of _METADATA alone cannot turn the check off. Only a format 1
  checkpoint (before checksums) without checksum files is read unchecked.
  """
  record = custom.get(_METADATA_KEY)
  if checksums.has_files(path):
    return True
  if not isinstance(record, dict):
    return False  # written by Orbax alone
  return record.get("version") != 1 or "checksums" in record


def _missing_checksums(path: str) -> str | None:
  """Why a checkpoint that must be verified cannot be, or None."""
  with open(os.path.join(path, "_METADATA"), encoding="utf-8") as f:
    custom = json.load(f).get("custom_metadata") or {}
  if not isinstance(custom, dict) or not _checksummed(path, custom):
    return None
  try:
    checksums.load(path)
  except errors.CheckpointCorruptError as e:
    return str(e)
  return None


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
  """The `metadata` dict a checkpoint was saved with (without its arrays).

  Example:
    >>> jcxl.checkpoint.save("ckpt/7", state, metadata={"step": 7})
    >>> jcxl.checkpoint.read_metadata("ckpt/7")
    {'step': 7}

  Raises:
    FileNotFoundError, ValueError: `path` is not a finished checkpoint.
  """
  path = _check_checkpoint(os.path.abspath(os.fspath(path)))
  with open(os.path.join(path, "_METADATA"), encoding="utf-8") as f:
    custom = json.load(f).get("custom_metadata") or {}
  return {k: v for k, v in custom.items() if k != _METADATA_KEY}


def _check_checkpoint(path: str) -> str:
  if not os.path.exists(path):
    raise FileNotFoundError(f"no checkpoint at {path!r}: the path does not "
                            "exist")
  if not os.path.isdir(path):
    raise ValueError(f"{path!r} is a file, not a checkpoint directory")
  if not is_complete(path):
    raise ValueError(
        f"{path!r} is not a finished checkpoint (no _METADATA and "
        "_CHECKPOINT_METADATA, or an unfinished save's temporary directory);"
        " restore an earlier one (jcxl.checkpoint.latest)")
  problem = _unreadable_metadata(path) or _missing_checksums(path)
  if problem is not None:
    raise errors.CheckpointCorruptError(
        f"checkpoint {path!r} is corrupt: {problem}; restore an earlier one "
        "(jcxl.checkpoint.latest skips it)")
  return path


def _keystr(path: tuple) -> str:
  return ".".join(str(p) for p in path)


def _saved_sharding(meta: Any) -> jax.sharding.Sharding | None:
  sharding = getattr(meta, "sharding", None)
  if sharding is None:
    return None
  try:
    return sharding.to_jax_sharding()
  except Exception:  # devices not present here
    return None


@dataclasses.dataclass(frozen=True)
class _Target:
  """Where one leaf is restored to."""
  kind: str  # 'pool', 'array', 'key', 'numpy', 'scalar' or 'other'
  shape: tuple[int, ...] = ()
  dtype: Any = None
  sharding: jax.sharding.Sharding | None = None
  tier: Tier | None = None
  path: str = ""
  scalar_type: type | None = None
  into: PoolArray | None = None


def _target_from_like(leaf: Any, path: str, tier: Tier | None,
                      in_place: bool) -> _Target:
  if isinstance(leaf, PoolArray):
    if in_place:
      return _Target("pool", leaf.shape, leaf.dtype, leaf.sharding,
                     leaf.tier, leaf.path, into=leaf)
    return _Target("pool", leaf.shape, leaf.dtype, leaf.sharding,
                   tier or leaf.tier, leaf.path)
  if isinstance(leaf, jax.Array):
    if _is_key(leaf.dtype):  # Orbax stores its key data; shapes differ
      return _Target("key", sharding=leaf.sharding)
    return _Target("array", tuple(leaf.shape), np.dtype(leaf.dtype),
                   leaf.sharding)
  if isinstance(leaf, jax.ShapeDtypeStruct):
    kind = "pool" if tier is not None else "array"
    return _Target(kind, tuple(leaf.shape), np.dtype(leaf.dtype),
                   getattr(leaf, "sharding", None), tier, path)
  if isinstance(leaf, np.ndarray):  # restored in native byte order
    return _Target("numpy", leaf.shape, leaf.dtype.newbyteorder("="))
  if isinstance(leaf, (bool, int, float, complex, np.number)):
    return _Target("scalar", (), np.asarray(leaf).dtype,
                   scalar_type=type(leaf))
  return _Target("other")


def _target_from_saved(meta: Any, path: str, saved_tier: str | None,
                       tier: Tier | None, pool: Pool | None) -> _Target:
  if isinstance(meta, ocp.metadata.ScalarMetadata):
    return _Target("scalar", (), np.dtype(meta.dtype))
  if isinstance(meta, ocp.metadata.ArrayMetadata):
    shape, dtype = tuple(meta.shape), np.dtype(meta.dtype)
    if saved_tier is not None and pool is not None:
      return _Target("pool", shape, dtype, _saved_sharding(meta),
                     tier or Tier(saved_tier), path)
    if getattr(meta, "sharding", None) is not None:
      return _Target("array", shape, dtype, _saved_sharding(meta))
    return _Target("numpy", shape, dtype)
  return _Target("other")


def _check_leaf(name: str, target: _Target, meta: Any) -> None:
  """Raises ValueError when the saved leaf cannot become `target`."""
  shape = getattr(meta, "shape", None)
  dtype = getattr(meta, "dtype", None)
  if target.kind in ("pool", "array", "numpy"):
    if shape is None or dtype is None:
      raise ValueError(f"leaf {name}: the checkpoint holds a "
                       f"{type(meta).__name__}, not an array")
    if tuple(shape) != tuple(target.shape) or np.dtype(dtype) != np.dtype(
        target.dtype):
      raise ValueError(
          f"leaf {name}: the checkpoint holds {np.dtype(dtype).name}"
          f"{list(shape)}, but like= asks for {np.dtype(target.dtype).name}"
          f"{list(target.shape)}")
  elif target.kind == "key" and not isinstance(meta,
                                              ocp.metadata.ArrayMetadata):
    raise ValueError(f"leaf {name}: the checkpoint holds a "
                     f"{type(meta).__name__}, not a random key")
  elif target.kind == "scalar" and shape not in (None, ()):
    raise ValueError(f"leaf {name}: the checkpoint holds an array of shape "
                     f"{tuple(shape)}, but like= has a scalar there")


def _restore_args(name: str, target: _Target, pool: Pool | None
                  ) -> ocp.RestoreArgs:
  if target.kind in ("pool", "array", "key") and target.sharding is None:
    raise ValueError(
        f"leaf {name}: no sharding to restore it with (it was saved over "
        "devices that are not here); pass like= with shardings or sharding=")
  if target.kind == "pool":
    if target.into is not None:
      pool = target.into.pool
    if pool is None:
      raise ValueError(f"leaf {name} goes into the pool: pass "
                       "pool=jcxl.Pool(...)")
    # what the pool can hold, checked before anything is read
    validation.object_spec(target.shape, target.dtype, what=f"leaf {name}")
    return _ToPool(restore_type=jax.Array, dtype=target.dtype, pool=pool,
                   tier=target.tier, sharding=target.sharding,
                   shape=target.shape, path=target.path, into=target.into)
  if target.kind == "array":
    return ocp.ArrayRestoreArgs(sharding=target.sharding,
                                global_shape=target.shape, dtype=target.dtype)
  if target.kind == "key":
    return ocp.ArrayRestoreArgs(sharding=target.sharding)
  if target.kind == "numpy":
    return ocp.RestoreArgs(restore_type=np.ndarray, dtype=target.dtype)
  if target.kind == "scalar" and target.scalar_type is not None:
    return ocp.RestoreArgs(restore_type=target.scalar_type)
  return ocp.RestoreArgs()


def restore(path: str | os.PathLike, like: Any = None, *,
            pool: Pool | None = None, tier: str | Tier | None = None,
            sharding: jax.sharding.Sharding | Any | None = None) -> Any:
  """Reads a checkpoint, streaming pool-bound leaves into `pool`.

  Where each leaf goes: a PoolArray in `like` (without `like`: a leaf saved
  from a PoolArray, when `pool` is given) is restored into new objects in
  `pool`, in `tier` if given, else in its own (saved) tier; a
  ``jax.ShapeDtypeStruct`` in `like` into `pool` when `tier` is given, else
  as a ``jax.Array``; jax.Arrays, numpy arrays and scalars as themselves.
  Pool-bound leaves are read one shard at a time, so the model is never in
  host memory. Shardings come from `sharding`, else from `like`, else from
  the checkpoint: a checkpoint written on 8 devices restores onto 1 (or the
  other way round) given the new sharding.

  Example:
    >>> like = {"params": params, "opt_state": opt_state, "step": 0}
    >>> state = jcxl.checkpoint.restore("run/ckpt/100", like, pool=pool,
    ...                                 tier="nvme")   # saved from cxl

  Args:
    path: a checkpoint written by ``save`` (or any Orbax PyTree checkpoint).
    like: a pytree with the checkpoint's structure whose leaves (PoolArrays,
      ShapeDtypeStructs, jax.Arrays, numpy arrays, scalars) give each leaf's
      shape, dtype, sharding and kind (only these are read from them);
      default: the checkpoint's own tree (nested dicts and lists).
    pool: the pool for pool-bound leaves; default: the pool of `like`'s
      first PoolArray.
    tier: ``'host'``, ``'cxl'`` or ``'nvme'`` for every pool-bound leaf.
    sharding: one ``jax.sharding.Sharding`` for every array leaf, or a
      pytree of them with `like`'s structure.

  Returns:
    The restored pytree (`like`'s structure when given).

  Raises:
    FileNotFoundError: `path` does not exist.
    ValueError: `path` is not a finished checkpoint; its structure, shapes
      or dtypes differ from `like`; a pool-bound leaf has no pool or no
      sharding that fits the devices here.
    PoolExhaustedError: the pool has no room; the leaves restored so far
      are freed, and nothing the pool held before is touched.
    CheckpointCorruptError: a checksum does not match, or data or metadata
      cannot be read (the message names the array and the file); raised
      before anything is restored.
  """
  if tier is not None:
    tier = as_tier(tier)
  return _restore(path, like, pool=pool, tier=tier, sharding=sharding,
                  in_place=False)


def restore_into(path: str | os.PathLike, tree: Any) -> Any:
  """Reads a checkpoint into the PoolArrays of `tree`, in place.

  Each PoolArray's objects are overwritten with the checkpoint's values,
  one shard at a time, and keep their handles: steps already compiled for
  them (``jcxl.cxl_offload``) stay valid, and the pool needs no room for a
  second copy. It is how a training loop resumes. Other leaves cannot be
  written in place; the returned tree holds their restored values.

  Example:
    >>> step = jcxl.cxl_offload(train_step)   # compiled for these objects
    >>> state = jcxl.checkpoint.restore_into(
    ...     "run/ckpt/100", {"params": params, "opt_state": opt_state,
    ...                      "step": 0})
    >>> state["step"]                          # params, opt_state: refilled
    100

  Args:
    path: a checkpoint written by ``save``.
    tree: a pytree with the checkpoint's structure, shapes and dtypes.

  Returns:
    `tree` with its PoolArrays (the same objects, new contents) and the
    other leaves restored.

  Raises:
    FileNotFoundError, ValueError, CheckpointCorruptError: as ``restore``,
      before any PoolArray is written: every array's checksum is checked
      first. An error while writing (a pool failure) leaves the PoolArrays
      partly overwritten: restore again.
  """
  if any(_is_pool_array(x) for x in jax.tree.leaves(
      tree, is_leaf=_is_pool_array)):
    dispatched.barrier()  # steps already dispatched (any thread) use them
  return _restore(path, tree, pool=None, tier=None, sharding=None,
                  in_place=True)


def _verify(path: str, saved: dict[tuple, Any]) -> None:
  """Checks every array and scalar of the checkpoint against its save's
  checksums (see checkpoint_checksums)."""
  arrays = {_keystr(p): np.dtype(meta.dtype).itemsize
            for p, meta in saved.items()
            if isinstance(meta, (ocp.metadata.ArrayMetadata,
                                 ocp.metadata.ScalarMetadata))
            and getattr(meta, "dtype", None) is not None}
  checksums.verify(path, checksums.load(path), sorted(arrays), arrays)


def _restore(path: str | os.PathLike, like: Any, *, pool: Pool | None,
             tier: Tier | None, sharding: Any, in_place: bool) -> Any:
  path = _check_checkpoint(os.path.abspath(os.fspath(path)))
  like_leaves = jax.tree.leaves(like, is_leaf=_is_pool_array)
  if pool is None:
    pool = next((x.pool for x in like_leaves if _is_pool_array(x)), None)
  if pool is not None:
    if not isinstance(pool, Pool):
      raise TypeError(f"pool must be a jcxl.Pool, got {type(pool).__name__}")
    registry.find_pool(pool.id, what="restore()")
  if tier is not None and pool is None:
    raise ValueError(f"tier={tier.value!r} needs a pool: pass "
                     "pool=jcxl.Pool(...)")

  handler = _pytree_handler()
  metadata = handler.metadata(epath.Path(path))
  custom = metadata.custom_metadata or {}
  saved_tiers = custom.get(_METADATA_KEY, {}).get("pool_tiers", {})
  saved = ocp.tree.to_flat_dict(metadata.tree)

  if like is None:
    item = None
    flat_paths = list(saved)
    keystrs = [jax.tree_util.keystr(kp) for kp, _ in
               jax.tree_util.tree_flatten_with_path(metadata.tree)[0]]
    targets = [_target_from_saved(saved[p], name, saved_tiers.get(_keystr(p)),
                                  tier, pool)
               for p, name in zip(flat_paths, keystrs)]
    treedef = jax.tree.structure(metadata.tree)
  else:
    item = jax.tree.map(
        lambda x: x.aval() if _is_pool_array(x) else x, like,
        is_leaf=_is_pool_array)
    wanted = ocp.tree.to_flat_dict(like, is_leaf=_is_pool_array)
    missing = [_keystr(p) for p in wanted if p not in saved]
    extra = [_keystr(p) for p in saved if p not in wanted]
    if missing or extra:
      raise ValueError(
          f"the checkpoint at {path!r} does not have like='s structure: "
          f"missing from the checkpoint: {missing[:5] or 'none'}; in the "
          f"checkpoint but not in like: {extra[:5] or 'none'}")
    flat_paths = list(wanted)
    keystrs = [jax.tree_util.keystr(kp) for kp, _ in
               jax.tree_util.tree_flatten_with_path(
                   like, is_leaf=_is_pool_array)[0]]
    targets = [_target_from_like(wanted[p], name, tier, in_place)
               for p, name in zip(flat_paths, keystrs)]
    treedef = jax.tree.structure(like, is_leaf=_is_pool_array)

  if sharding is not None:
    if isinstance(sharding, jax.sharding.Sharding):
      shardings = [sharding] * len(targets)
    else:
      try:
        shardings = treedef.flatten_up_to(sharding)
      except (ValueError, TypeError) as e:
        raise ValueError("sharding must be a jax.sharding.Sharding or a "
                         f"pytree of them with like='s structure: {e}"
                         ) from None
    targets = [dataclasses.replace(t, sharding=s)
               if t.kind in ("pool", "array") and s is not None else t
               for t, s in zip(targets, shardings)]

  args = {}
  for p, target in zip(flat_paths, targets):
    name = _keystr(p)
    if target.kind in ("pool", "array") and target.sharding is None:
      target = dataclasses.replace(target, sharding=_saved_sharding(saved[p]))
    _check_leaf(name, target, saved[p])
    args[p] = _restore_args(name, target, pool)
  if _checksummed(path, custom):  # every byte checked before any is written
    _verify(path, saved)
  restore_args = ocp.tree.from_flat_dict(
      args, target=item if item is not None else metadata.tree)
  restored = ocp.Checkpointer(handler).restore(
      epath.Path(path),
      args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args))
  logger.info("restored checkpoint %s", path)
  return restored
