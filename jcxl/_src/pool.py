"""The Python face of the jcxl pool: tiers, objects, handles and stats.

A pool holds tensors outside the accelerator in up to three tiers:

* ``host``: DRAM on the NUMA node nearest the device;
* ``cxl``: CXL memory expanders (CPU-less NUMA nodes), interleaved by their
  bandwidth; where the machine has none, *emulated* on local DRAM behind a
  link model (bandwidth cap and per-transfer latency) that every report names;
* ``nvme``: a file in a private directory, read and written with O_DIRECT.

Objects are addressed by int32 handles that stay valid across ``compact()``.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import time
import weakref
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from jcxl import _jcxl
from jcxl._src import errors
from jcxl._src import dispatched
from jcxl._src import registry
from jcxl._src import swap_dir as swap_dir_lib
from jcxl._src import topology as topology_lib
from jcxl._src import validation
from jcxl._src.link_model import DEFAULT_CXL_LINK
from jcxl._src.link_model import FirmwareLink
from jcxl._src.link_model import LinkModel
from jcxl._src.pool_stats import ObjectInfo
from jcxl._src.pool_stats import PoolStats
from jcxl._src.pool_stats import TierStats
from jcxl._src.pool_updates import PoolUpdates
from jcxl._src.tier import Tier
from jcxl._src.tier import as_tier
from jcxl._src.transfers import Transfer
from jcxl._src.transfers import TransferRecord
from jcxl._src.units import format_bytes
from jcxl._src.units import parse_bytes

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


@functools.lru_cache(maxsize=None)
def _dtype_from_name(name: str) -> np.dtype:
  if hasattr(ml_dtypes, name):
    return np.dtype(getattr(ml_dtypes, name))
  return np.dtype(name)


def _as_host_array(array: Any, what: str = "array", *,
                   nonempty: bool = False) -> np.ndarray:
  """`array` as C-contiguous numpy in native byte order (see `put`)."""
  value = np.asarray(array)
  validation.object_spec(value.shape, value.dtype, what=what,
                         nonempty=nonempty)
  value = validation.as_native(value)
  # (np.ascontiguousarray would turn a 0-d array into a 1-d one.)
  return value if value.flags.c_contiguous else value.copy(order="C")


# Host buffers the pool allocates start on a huge-page boundary: O_DIRECT
# reads of the nvme tier then land in them without a bounce copy.
_BUFFER_ALIGNMENT = 2 << 20


# A tier's capacity is counted in pages (the extent allocator's alignment):
# one below a page would hold nothing.
_TIER_GRANULARITY = 4096


# More copy threads than this is a mistake, not a configuration.
_MAX_COPY_THREADS = 1024
# Likewise for update threads.
_MAX_UPDATE_THREADS = 1024


def _as_handle(handle: Any) -> int:
  return validation.as_count(handle, name="handle", low=validation.INT32_MIN,
                             high=validation.INT32_MAX,
                             what="an int32 pool handle")


def _as_priority(priority: Any) -> int:
  return validation.as_count(priority, name="priority",
                             low=validation.INT32_MIN,
                             high=validation.INT32_MAX, what="an int32")


def aligned_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
  """An uninitialized C-contiguous array whose data is 2 MiB aligned."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  if nbytes < _BUFFER_ALIGNMENT:
    return np.empty(shape, dtype)
  raw = np.empty(nbytes + _BUFFER_ALIGNMENT, np.uint8)
  start = -raw.ctypes.data % _BUFFER_ALIGNMENT
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def _check_writable(out: np.ndarray) -> None:
  """The copy engine writes `out` in place, byte for byte."""
  if not isinstance(out, np.ndarray):
    raise TypeError(f"out must be a numpy array, but got "
                    f"{type(out).__name__}")
  if not out.flags.c_contiguous or not out.flags.writeable:
    raise ValueError("out must be a writeable C-contiguous array")


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


# How long a pool closed at exit (or collected) waits for steps still
# running: at least this, or its timeout_s if longer.
_EXIT_WAIT_S = 300.0


def _close_at_exit(native: Any, swap: swap_dir_lib.SwapDir | None,
                   timeout_s: float, pid: int) -> None:
  """Closes a pool that was never closed (collected, or at exit).

  Not in a child the pool's process forked: the pool, its transfers and its
  nvme directory are the parent's, which still uses them.
  """
  if os.getpid() != pid:
    return
  try:
    if not native.closed:
      # A step dispatched last (no gather, no barrier) may still stream from
      # the pool: it finishes first.
      dispatched.wait_for_steps(max(timeout_s, _EXIT_WAIT_S),
                              f"pool {native.id} was closed at exit")
      native.close(timeout_s)
  except errors.JcxlError as e:
    logger.warning("jcxl: closing a pool left open: %s", e)
  finally:
    if swap is not None:
      swap.remove()


class Pool:
  """A tiered memory pool outside the accelerator.

  Example:
    >>> import numpy as np, jcxl
    >>> with jcxl.Pool(host="64MiB", cxl="256MiB") as pool:
    ...   h = pool.put(np.arange(1024, dtype=np.float32), tier="cxl")
    ...   back = pool.get(h)
    >>> back[:3]
    array([0., 1., 2.], dtype=float32)

  Args:
    host: capacity of the ``host`` tier (DRAM on the device's node); 0: off.
    cxl: capacity of the ``cxl`` tier; 0: off.
    nvme: capacity of the ``nvme`` tier; 0: off.
    nvme_dir: directory for the nvme tier; the pool makes a private (0700)
      directory inside it and removes it on close (a pool never closed: when
      it is collected, or at interpreter exit) unless `keep_nvme_files`.
    cxl_link: link model of an emulated cxl tier (default
      ``DEFAULT_CXL_LINK``); used only where no CXL node exists, unless
      `emulate_cxl` forces emulation.
    emulate_cxl: emulate the cxl tier even where CXL nodes exist.
    spill: when a tier is full, place objects in the next one
      (host -> cxl -> nvme) instead of raising ``PoolExhaustedError``.
    copy_threads: copy-engine worker threads.
    chunk_bytes: size of the pieces large copies are split into.
    update_threads: threads that run update programs (``updates.run``) on
      the pool's objects; 0: one per CPU this process may use, at most 16,
      and at least 4 in a pool with an nvme tier (a worker staging nvme
      objects waits on the disk; others keep it busy meanwhile).
      They start at the first run, each pinned to one NUMA node's CPUs on
      a machine of several.
    topology: the machine's NUMA topology (default: discovered from /sys).
    node: NUMA node of the device the pool serves (default: this process's).
    timeout_s: default deadline of each transfer (a jitted step's waits
      included: past it the step fails with DEADLINE_EXCEEDED), of ``free()``
      and ``compact()`` waiting for transfers, and of ``close()``.
  """

  def __init__(self,
               *,
               host: int | str = "1GiB",
               cxl: int | str = "4GiB",
               nvme: int | str = 0,
               nvme_dir: str | os.PathLike | None = None,
               keep_nvme_files: bool = False,
               cxl_link: LinkModel | None = None,
               emulate_cxl: bool = False,
               spill: bool = False,
               copy_threads: int = 2,
               chunk_bytes: int | str = "4MiB",
               update_threads: int = 0,
               topology: topology_lib.Topology | None = None,
               node: int | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S):
    given = {Tier.HOST: host, Tier.CXL: cxl, Tier.NVME: nvme}
    capacities = {
        Tier.HOST: parse_bytes(host, name="host"),
        Tier.CXL: parse_bytes(cxl, name="cxl"),
        Tier.NVME: parse_bytes(nvme, name="nvme"),
    }
    for tier, capacity in capacities.items():
      if 0 < capacity < _TIER_GRANULARITY:  # would round down to 0 B
        raise ValueError(
            f"{tier.value} must be 0 (off) or at least {_TIER_GRANULARITY} "
            f"bytes (the tier's allocation granularity), but got "
            f"{given[tier]!r}")
    if not any(capacities.values()):
      raise ValueError("a pool needs at least one tier with a capacity > 0")
    copy_threads = validation.as_count(copy_threads, name="copy_threads",
                                       low=1, high=_MAX_COPY_THREADS)
    update_threads = validation.as_count(update_threads,
                                         name="update_threads", low=0,
                                         high=_MAX_UPDATE_THREADS)
    chunk = parse_bytes(chunk_bytes, name="chunk_bytes")
    if chunk < 4096:
      raise ValueError(f"chunk_bytes must be at least 4096, got {chunk_bytes!r}")
    if cxl_link is not None and not isinstance(cxl_link, LinkModel):
      raise TypeError(f"cxl_link must be a jcxl.LinkModel, got {cxl_link!r}")
    self._timeout_s = validation.as_timeout(timeout_s)
    spill = validation.as_bool(spill, name="spill")
    emulate_cxl = validation.as_bool(emulate_cxl, name="emulate_cxl")
    keep_nvme_files = validation.as_bool(keep_nvme_files,
                                         name="keep_nvme_files")
    self._frees = 0  # objects freed through `free`; see pool_array.Liveness
    self.topology = topology or topology_lib.discover()
    if node is None:
      node = topology_lib.node_of_current_process(self.topology)
    else:  # (0.0 or '0' would pass the lookup below, or fail unnamed)
      node = validation.as_count(node, name="node", high=validation.INT32_MAX,
                                 what="a NUMA node id")
    self.topology.node(node)  # validates the id
    self.node = node

    config = _jcxl.PoolConfig()
    config.spill = spill
    config.copy_threads = copy_threads
    config.update_threads = update_threads
    # A transfer that follows update runs (see PoolUpdates.wait) waits for
    # them as long as for itself.
    config.run_wait_ns = int(min(self._timeout_s * 1e9, 2**60))
    config.chunk_bytes = chunk
    config.copy_cpus = list(self.topology.node(
        self.topology.nearest_memory_node(node)).cpus or
                            self.topology.node(node).cpus)
    self._links: dict[Tier, LinkModel | None] = {}
    self._measured_links: dict[Tier, LinkModel] = {}
    self._firmware_links: dict[Tier, tuple[FirmwareLink, ...]] = {}
    self._nvme_dir = None
    self._swap_dir: swap_dir_lib.SwapDir | None = None
    self._cxl_kind: dict[Tier, str] = {}
    for tier, capacity in capacities.items():
      tier_config = _jcxl.TierConfig()
      tier_config.capacity = capacity
      if capacity:
        self._configure_tier(tier, tier_config, cxl_link, emulate_cxl)
      config.set_tier(tier.index, tier_config)
      if capacity and tier is Tier.NVME:
        self._swap_dir = swap_dir_lib.make(nvme_dir or tempfile.gettempdir(),
                                           keep=keep_nvme_files)
        self._nvme_dir = self._swap_dir.path
        config.nvme_dir = self._nvme_dir
        config.keep_nvme_files = keep_nvme_files
    try:
      self._pool = _jcxl.Pool.create(config)
    except BaseException:
      self._remove_nvme_dir()
      raise
    # A pool left open is closed when it is collected or, at the latest, at
    # interpreter exit, so its nvme files never outlive the process.
    self._finalizer = weakref.finalize(
        self, _close_at_exit, self._pool, self._swap_dir, self._timeout_s,
        os.getpid())
    self.id = self._pool.id
    # Host update programs on the pool's objects (see docs/host-update.md).
    self.updates = PoolUpdates(self._pool, self.id, self._timeout_s)
    self._settings = {
        **{tier.value: format_bytes(c) for tier, c in capacities.items()},
        "cxl_link": self._cxl_backing(),
        "spill": spill, "copy_threads": copy_threads,
        "chunk_bytes": format_bytes(chunk), "timeout_s": self._timeout_s}
    self._peers_agree = False  # see distributed.check_pools_agree
    registry.add_pool(self)
    for tier_stats in self.stats().tiers.values():
      if tier_stats.enabled and tier_stats.link_source is not None:
        logger.info("jcxl pool %d: %s", self.id, tier_stats.label())

  def _configure_tier(self, tier: Tier, config: Any,
                      cxl_link: LinkModel | None, emulate_cxl: bool) -> None:
    home = self.topology.nearest_memory_node(self.node)
    if tier is Tier.HOST:
      config.nodes = [home]
    elif tier is Tier.CXL:
      cxl_nodes = self.topology.nearest_cxl_nodes(self.node)
      if cxl_nodes and not emulate_cxl:
        self._cxl_kind[tier] = "CXL memory"
        config.nodes = list(cxl_nodes)
        config.weights = [self._node_weight(n) for n in cxl_nodes]
        firmware = [FirmwareLink.from_node(self.topology.node(n))
                    for n in cxl_nodes]
        if all(firmware):  # figures for some nodes only add up to nothing
          self._firmware_links[tier] = tuple(firmware)
        if cxl_link is not None:  # an extra cap the user asked for
          self._set_link(config, tier, cxl_link)
      else:
        self._cxl_kind[tier] = "emulated on DRAM"
        config.nodes = [home]
        config.emulated = True
        self._set_link(config, tier, cxl_link or DEFAULT_CXL_LINK)

  def _cxl_backing(self) -> str:
    """The cxl tier's backing, as peers compare it: off, emulated (with its
    link) or CXL memory (with a cap the user asked for)."""
    if Tier.CXL not in self._cxl_kind:
      return "off"
    link = self._links.get(Tier.CXL)
    return self._cxl_kind[Tier.CXL] + (f", {link}" if link else "")

  def _memory_tier(self, node: int) -> int | None:
    try:
      return self.topology.node(node).memory_tier
    except ValueError:  # an unbound arena (node -1)
      return None

  def _node_weight(self, node: int) -> float:
    hmat = self.topology.node(node).hmat
    if hmat and hmat.read_bandwidth_mbps:
      return float(hmat.read_bandwidth_mbps)
    return 1.0

  def _set_link(self, config: Any, tier: Tier, link: LinkModel) -> None:
    config.link_bytes_per_second = link.bandwidth
    config.link_latency_ns = link.latency_ns
    self._links[tier] = link

  # ------------------------------------------------------------ objects

  def allocate(self, shape: Sequence[int], dtype: Any,
               tier: str | Tier = "cxl") -> int:
    """Reserves an object of `shape` and `dtype` without writing it.

    A dtype in non-native byte order (``'>f4'`` on x86) is stored as its
    native twin (``float32``): `get` returns native arrays.

    Raises:
      TypeError: `dtype` is not numeric (see ``put``), or `shape` is not a
        sequence of ints.
      ValueError: a negative dimension, an empty object, or more than
        2**63 - 1 bytes.
    """
    tier = as_tier(tier)
    shape, dtype, nbytes = validation.object_spec(shape, dtype, nonempty=True)
    return self._pool.allocate(tier.index, nbytes, list(shape),
                               dtype.name, self._timeout_s)

  def allocate_copy(self, handle: int, dtype: Any) -> int:
    """A copy of object `handle` (float32 or bfloat16) in `dtype` (float32
    or bfloat16), in its tier, that the pool keeps equal to it converted
    (round to nearest even); returns the copy's handle.

    A read of the copy after the source was written converts the source
    anew, whatever wrote it (a `put`, a restore, a step's store); an
    update program writing the source may write the copy from the same
    register, which leaves it fresh. Nothing else may write the copy. This
    is how a device fetches bfloat16 weights of float32 master weights
    (``cxl_offload(update='host')``: see docs/host-update.md).

    Raises:
      UnknownHandleError: `handle` is not this pool's (or was freed).
      ValueError: the source is not float32 or bfloat16, is itself a copy,
        or `dtype` is neither.
    """
    return self._pool.allocate_copy(_as_handle(handle),
                                    np.dtype(dtype).name, self._timeout_s)

  def put(self, array: Any, tier: str | Tier = "cxl", *,
          priority: int = 0) -> int:
    """Stores a copy of `array` in `tier`; returns its handle.

    The pool stores numbers and bools, ml_dtypes' types (bfloat16, float8,
    int4...) included. An array in non-native byte order (``'>f4'`` on x86)
    is converted to native order on the way in: `get` returns the same
    values as a native array (``float32``).

    Raises:
      PoolExhaustedError: the tier is full (and spilling is off or also full).
      TypeError: `array`'s dtype is not numeric (object, structured, string,
        bytes, datetime), or `priority` is not an int.
      ValueError: `array` is empty or `tier` is unknown.
    """
    host = _as_host_array(array, nonempty=True)
    handle = self.allocate(host.shape, host.dtype, tier)
    try:
      self.put_async(handle, host, priority=priority).wait()
    except BaseException:
      try:
        self._pool.free(handle, self._timeout_s)
      except errors.JcxlError as e:  # the first error is the one to see
        logger.warning("jcxl pool %d: could not free handle %d after a "
                       "failed put: %s", self.id, handle, e)
      raise
    return handle

  def put_async(self, handle: int, array: Any, *, offset: int = 0,
                priority: int = 0, chunk_bytes: int = 0) -> Transfer:
    """Starts writing `array`'s bytes into object `handle` at byte `offset`.

    `array` is converted to native byte order first, as in ``put``.

    Raises:
      TypeError: `array`'s dtype is not the object's (its bytes would be
        read back as other numbers).
      ValueError: `offset` is not a whole number of the object's items, or
        `array` does not fit in the object from `offset`.
      UnknownHandleError: `handle` is unknown or freed.
    """
    host = _as_host_array(array)
    handle = _as_handle(handle)
    offset = validation.as_count(offset, name="offset")
    self._check_range(handle, host, offset, "array")
    ticket = self._pool.write(
        handle, host.ctypes.data, host.nbytes, offset, _as_priority(priority),
        validation.as_count(chunk_bytes, name="chunk_bytes"), host)
    return Transfer(ticket, host, self._timeout_s)

  def _check_range(self, handle: int, buffer: np.ndarray, offset: int,
                   what: str) -> None:
    """`buffer` holds items of object `handle`'s dtype, from byte `offset`
    on, within the object."""
    info = self.info(handle)
    if buffer.dtype != info.dtype:
      raise TypeError(
          f"{what} has dtype {buffer.dtype}, but handle {handle} holds "
          f"{info.dtype} (shape {info.shape}); convert it first "
          f"(.astype({info.dtype.name!r}))")
    if offset % info.dtype.itemsize:
      raise ValueError(
          f"offset {offset} is not a whole number of {info.dtype} items "
          f"({info.dtype.itemsize} bytes each) of handle {handle}")
    if offset + buffer.nbytes > info.nbytes:
      raise ValueError(
          f"{what} of {buffer.nbytes} bytes at offset {offset} does not fit "
          f"in handle {handle}, which holds {info.nbytes} bytes (shape "
          f"{info.shape}, {info.dtype})")

  def get(self, handle: int, out: np.ndarray | None = None, *,
          priority: int = 0) -> np.ndarray:
    """Returns a copy of object `handle` as a numpy array (into `out`)."""
    return self.get_async(handle, out, priority=priority).wait()

  def get_async(self, handle: int, out: np.ndarray | None = None, *,
                priority: int = 0, chunk_bytes: int = 0) -> Transfer:
    """Starts reading object `handle` into `out` (or a new array).

    Raises:
      ValueError: `out` does not match the object's shape or dtype.
      UnknownHandleError: `handle` is unknown or freed.
    """
    info = self.info(handle)
    if out is None:
      out = aligned_empty(info.shape, info.dtype)
    else:
      if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
      if out.shape != info.shape or out.dtype != info.dtype:
        raise ValueError(
            f"out has shape {out.shape} and dtype {out.dtype}, but handle "
            f"{handle} holds shape {info.shape} and dtype {info.dtype}")
      _check_writable(out)
    ticket = self._pool.read(
        handle, out.ctypes.data, info.nbytes, 0, _as_priority(priority),
        validation.as_count(chunk_bytes, name="chunk_bytes"), out)
    return Transfer(ticket, out, self._timeout_s)

  def read_bytes_async(self, handle: int, out: np.ndarray, *, offset: int = 0,
                       priority: int = 0, chunk_bytes: int = 0) -> Transfer:
    """Starts reading `out.nbytes` bytes of the object from byte `offset`.

    Raises:
      TypeError: `out`'s dtype is not the object's.
      ValueError: `offset` is not a whole number of the object's items, or
        the range is past the object's end.
    """
    _check_writable(out)
    handle = _as_handle(handle)
    offset = validation.as_count(offset, name="offset")
    self._check_range(handle, out, offset, "out")
    ticket = self._pool.read(
        handle, out.ctypes.data, out.nbytes, offset, _as_priority(priority),
        validation.as_count(chunk_bytes, name="chunk_bytes"), out)
    return Transfer(ticket, out, self._timeout_s)

  def free(self, handle: int) -> None:
    """Frees an object, after its transfers in flight are done."""
    handle = _as_handle(handle)
    self._frees += 1  # even if it fails: a needless re-check costs little
    self._pool.free(handle, self._timeout_s)

  def info(self, handle: int) -> ObjectInfo:
    """Where the object `handle` lives and what it is (an ObjectInfo: tier,
    NUMA node, offset, bytes, shape, dtype)."""
    raw = self._pool.info(_as_handle(handle))
    return ObjectInfo(handle=raw.handle, tier=Tier.from_index(raw.tier),
                      node=raw.node, offset=raw.offset, nbytes=raw.bytes,
                      shape=tuple(raw.shape),
                      dtype=_dtype_from_name(raw.dtype), slab=raw.slab,
                      copy_of=raw.copy_of)

  def handles(self) -> list[int]:
    """The handles of the objects the pool holds now."""
    return list(self._pool.handles())

  def page_nodes(self, handle: int) -> np.ndarray:
    """The NUMA node of each page of a memory-tier object (move_pages).

    Pages not yet backed by memory report a negative errno (-2, ENOENT).
    """
    return np.asarray(self._pool.page_nodes(_as_handle(handle)),
                      dtype=np.int32)

  def compact(self) -> None:
    """Moves objects so that no holes remain; handles stay valid."""
    self._pool.compact(self._timeout_s)

  # -------------------------------------------------------------- state

  def settings(self) -> dict[str, Any]:
    """What the processes of a multi-process run must agree on: the
    constructor's arguments that change where objects go and how they move
    (not the node, the topology or the nvme directory, which are each
    host's own)."""
    return dict(self._settings)

  def stats(self) -> PoolStats:
    """The pool's counters now, per tier: objects, bytes live and reserved,
    fragmentation, bytes read and written."""
    tiers = {}
    for raw in self._pool.stats():
      tier = Tier.from_index(raw.tier)
      arenas = raw.arenas
      allocs = [a.allocator for a in arenas]
      allocations = sum(a.allocations for a in allocs)
      tiers[tier] = TierStats(
          tier=tier,
          enabled=raw.enabled,
          capacity=sum(a.capacity for a in allocs),
          reserved=sum(a.reserved for a in allocs),
          live=sum(a.live for a in allocs),
          free=sum(a.capacity - a.reserved + a.hole_bytes for a in allocs),
          largest_free=max((a.largest_free for a in allocs), default=0),
          external_fragmentation=(
              sum(a.hole_bytes for a in allocs) /
              max(1, sum(a.reserved for a in allocs))),
          slab_objects=sum(a.slab_objects for a in allocs),
          extent_objects=sum(a.extent_objects for a in allocs),
          alloc_latency_mean_ns=(
              sum(a.alloc_ns_total for a in allocs) / allocations
              if allocations else 0.0),
          alloc_latency_max_ns=max((a.alloc_ns_max for a in allocs),
                                   default=0),
          bytes_read=raw.bytes_read,
          bytes_written=raw.bytes_written,
          nodes=tuple(a.node for a in arenas),
          emulated=raw.emulated,
          link=(LinkModel(raw.link_bytes_per_second,
                          raw.link_latency_ns * 1e-9)
                if raw.link_bytes_per_second > 0 else None),
          backing=tuple(a.description for a in arenas),
          memory_tiers=(() if raw.emulated or tier is Tier.NVME else
                        tuple(self._memory_tier(a.node) for a in arenas)),
          firmware_links=self._firmware_links.get(tier, ()),
      )
    return PoolStats(pool_id=self.id, tiers=tiers)

  def transfer_records(self) -> list[TransferRecord]:
    """Copy-engine records finished since the last call, oldest first."""
    return [TransferRecord.from_engine(r) for r in self._pool.drain_records()]

  def link_estimate(self, tier: str | Tier) -> LinkModel:
    """How fast `tier` moves bytes into a step, for planning.

    An emulated tier's link model as set now; for a real tier, its nodes'
    firmware (HMAT) figures where every node has them (see
    `TierStats.firmware_link`), else the read bandwidth of a 16 MiB object
    measured once (best of three, on memory of its own: it needs no room in
    this pool) and kept.
    """
    tier = as_tier(tier)
    link = self._links.get(tier)
    if link is not None:
      return link
    firmware = self.stats()[tier].firmware_link
    if firmware is not None:
      return firmware
    if tier not in self._measured_links:
      self._measured_links[tier] = self._measure_link(tier)
    return self._measured_links[tier]

  def _measure_link(self, tier: Tier) -> LinkModel:
    """The read bandwidth of a 16 MiB object, best of three, measured on a
    pool of its own on the same memory: the user's objects may fill this
    pool's tier, and planning must not need room in it."""
    probe = np.ones(16 << 20, np.uint8)
    capacities = {t.value: 0 for t in Tier}
    capacities[tier.value] = 2 * probe.nbytes
    with Pool(**capacities, topology=self.topology, node=self.node,
              nvme_dir=self._nvme_dir if tier is Tier.NVME else None,
              copy_threads=self._settings["copy_threads"],
              chunk_bytes=self._settings["chunk_bytes"]) as own:
      handle = own.put(probe, tier)
      best = min(_timed(lambda: own.get(handle, probe)) for _ in range(3))
    return LinkModel(probe.nbytes / best, 0.0)

  def _inject_fault(self, kind: str | None, *, tier: str | Tier | None = None,
                    direction: str | None = None, skip: int = 0,
                    count: int = 1) -> None:
    """Test hook: makes chosen transfers fail or stall.

    From the next transfer on, those matching `tier` and `direction` ('read':
    pool to buffer, 'write': buffer to pool; None: any) are counted; after
    `skip` of them, the next `count` (-1: all) fail without moving a byte
    (``TierIOError``) or stall until cancelled (their wait times out), the
    next call of this method, or close. ``kind=None`` clears the fault and
    releases stalled transfers.
    """
    kinds = {None: 0, "fail": 1, "stall": 2}
    directions = {None: -1, "write": 0, "read": 1}
    if kind not in kinds:
      raise ValueError(f"kind must be None, 'fail' or 'stall', got {kind!r}")
    if direction not in directions:
      raise ValueError(
          f"direction must be None, 'read' or 'write', got {direction!r}")
    self._pool.inject_fault(kinds[kind],
                            -1 if tier is None else as_tier(tier).index,
                            directions[direction], int(skip), int(count))

  def set_link(self, tier: str | Tier, link: LinkModel) -> None:
    """Changes a tier's emulated link mid-run (e.g. a shared, slower link)."""
    tier = as_tier(tier)
    if not isinstance(link, LinkModel):
      raise TypeError(f"link must be a jcxl.LinkModel, got {link!r}")
    if self.closed:
      raise errors.PoolClosedError(
          f"pool {self.id} is closed; its links can no longer be set")
    self._pool.set_link(tier.index, link.bandwidth, link.latency_ns)
    self._links[tier] = link

  @property
  def closed(self) -> bool:
    """Whether the pool is closed (its memory freed, its handles invalid)."""
    return self._pool.closed

  @property
  def nvme_dir(self) -> str | None:
    """The pool's private nvme directory, if the tier is on."""
    return self._nvme_dir

  def close(self) -> None:
    """Releases every tier; raises ``PoolClosedError`` if already closed.

    It first waits for the steps this thread has dispatched, which may
    still use its objects (one that failed is logged; its results raise).
    Transfers in flight get the pool's `timeout_s` to finish; those still
    running then are failed (``TransferTimeoutError`` says how many waited),
    and the pool is closed all the same.
    """
    if not self.closed:
      dispatched.wait_before(f"pool {self.id} was closed")
    try:
      self._pool.close(self._timeout_s)
    finally:
      self._remove_nvme_dir()
      self._finalizer.detach()

  def _remove_nvme_dir(self) -> None:
    if self._swap_dir is not None:
      self._swap_dir.remove()

  def __enter__(self) -> Pool:
    return self

  def __exit__(self, *exc_info) -> None:
    if not self.closed:
      self.close()

  def __repr__(self) -> str:
    if self.closed:
      return f"jcxl.Pool(id={self.id}, closed)"
    stats = self.stats()
    tiers = ", ".join(s.label() + f" {format_bytes(s.capacity)}"
                      for s in stats.tiers.values() if s.enabled)
    return f"jcxl.Pool(id={self.id}, {tiers})"
