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

import dataclasses
import enum
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
from jcxl._src import update_program as update_program_lib
from jcxl._src import validation
from jcxl._src.units import format_bandwidth
from jcxl._src.units import format_bytes
from jcxl._src.units import parse_bandwidth
from jcxl._src.units import parse_bytes

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


class Tier(str, enum.Enum):
  """A pool tier (also a jcxl memory kind)."""
  HOST = "host"
  CXL = "cxl"
  NVME = "nvme"

  @property
  def index(self) -> int:
    return _TIER_INDEX[self]

  @classmethod
  def parse(cls, value: str | Tier, *, name: str = "tier") -> Tier:
    """The tier named `value`; a ValueError naming `name` if none is."""
    try:
      return cls(value)
    except ValueError:
      choices = ", ".join(repr(t.value) for t in cls)
      raise ValueError(f"{name} must be one of {choices}, but got {value!r}"
                       ) from None


_TIER_INDEX = {Tier.HOST: 0, Tier.CXL: 1, Tier.NVME: 2}
_TIERS_BY_INDEX = {i: t for t, i in _TIER_INDEX.items()}


def as_tier(value: str | Tier, *, name: str = "tier") -> Tier:
  """Validates a tier name (see Tier.parse)."""
  return Tier.parse(value, name=name)


# A link's latency is counted in int64 nanoseconds by the C++ core; no real
# link comes near an hour per transfer.
_MAX_LINK_LATENCY_S = 3600.0


@dataclasses.dataclass(frozen=True)
class LinkModel:
  """An emulated link: a bandwidth cap shared by all transfers, plus latency.

  Attributes:
    bandwidth: bytes per second (or a string such as '16GB/s').
    latency_s: fixed time added to each transfer, in [0, 3600] seconds.
  """
  bandwidth: float | str
  latency_s: float = 0.0

  def __post_init__(self):
    object.__setattr__(self, "bandwidth",
                       parse_bandwidth(self.bandwidth, name="link bandwidth"))
    object.__setattr__(self, "latency_s", validation.as_seconds(
        self.latency_s, name="link latency_s", high=_MAX_LINK_LATENCY_S))

  @property
  def latency_ns(self) -> int:
    """The latency as the C++ core takes it (int64 nanoseconds)."""
    return round(self.latency_s * 1e9)

  def __str__(self) -> str:
    return (f"{format_bandwidth(self.bandwidth)}, "
            f"{self.latency_s * 1e6:.1f} us per transfer")


# What an emulated cxl tier behaves like unless told otherwise: one CXL 2.0
# x8 link (about 16 GB/s each way) with a couple of microseconds of software
# and link latency per transfer.
DEFAULT_CXL_LINK = LinkModel(bandwidth="16GB/s", latency_s=2e-6)


# ACPI HMAT states bandwidths in "MB/s"; QEMU writes a configured
# bandwidth=10G (2**30 bytes/s) as 10240, so a megabyte here is 2**20 bytes.
_HMAT_MEGABYTE = 2**20


@dataclasses.dataclass(frozen=True)
class FirmwareLink:
  """How fast the firmware says one memory node is, from its initiators.

  Attributes:
    node: The NUMA node.
    read_bandwidth: Read bandwidth, bytes per second.
    read_latency_s: Read latency, seconds (0 where the firmware gives none).
    source: Where the figures came from ('HMAT').
  """
  node: int
  read_bandwidth: float
  read_latency_s: float
  source: str = "HMAT"

  @classmethod
  def from_node(cls, node: topology_lib.NumaNode) -> FirmwareLink | None:
    """The node's HMAT access figures, or None without a read bandwidth."""
    hmat = node.hmat
    if hmat is None or not hmat.read_bandwidth_mbps:
      return None
    return cls(node=node.id,
               read_bandwidth=float(hmat.read_bandwidth_mbps * _HMAT_MEGABYTE),
               read_latency_s=(hmat.read_latency_ns or 0) / 1e9)

  def __str__(self) -> str:
    return (f"node {self.node} {format_bandwidth(self.read_bandwidth)} "
            f"{self.read_latency_s * 1e9:.0f} ns")


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
  """Where one pool object lives."""
  handle: int
  tier: Tier
  node: int
  offset: int
  nbytes: int
  shape: tuple[int, ...]
  dtype: np.dtype
  slab: bool
  copy_of: int = 0  # a copy the pool keeps (`allocate_copy`): its source


@dataclasses.dataclass(frozen=True)
class TierStats:
  """Occupancy and traffic of one tier (summed over its nodes)."""
  tier: Tier
  enabled: bool
  capacity: int
  reserved: int
  live: int
  free: int
  largest_free: int
  external_fragmentation: float
  slab_objects: int
  extent_objects: int
  alloc_latency_mean_ns: float
  alloc_latency_max_ns: int
  bytes_read: int
  bytes_written: int
  nodes: tuple[int, ...]
  emulated: bool
  link: LinkModel | None
  backing: tuple[str, ...]
  memory_tiers: tuple[int | None, ...] = ()
  firmware_links: tuple[FirmwareLink, ...] = ()

  @property
  def objects(self) -> int:
    return self.slab_objects + self.extent_objects

  @property
  def link_source(self) -> str | None:
    """Where the tier's link figures come from.

    'EMULATED' (the link model of an emulated tier), 'HMAT' (a real tier
    whose every node has firmware figures), or None (a real tier without
    them: `Pool.link_estimate` measures it).
    """
    if self.emulated:
      return "EMULATED"
    if self.firmware_links:
      return self.firmware_links[0].source
    return None

  @property
  def firmware_link(self) -> LinkModel | None:
    """The firmware figures of the tier's nodes as one link, or None.

    Objects are spread over the nodes by their bandwidth, so the bandwidths
    add up; the latency is the slowest node's.
    """
    if not self.firmware_links:
      return None
    return LinkModel(
        bandwidth=sum(f.read_bandwidth for f in self.firmware_links),
        latency_s=max(f.read_latency_s for f in self.firmware_links))

  def label(self) -> str:
    """The tier's name with how it is backed: 'cxl (EMULATED: ...)'."""
    if self.tier is Tier.NVME:
      return f"nvme ({', '.join(self.backing)})"
    if not self.emulated:
      text = f"{self.tier.value} (nodes {list(self.nodes)}"
      if any(t is not None for t in self.memory_tiers):
        text += f", kernel memory tiers {list(self.memory_tiers)}"
      if self.firmware_links:
        text += f"; link from {self.link_source}: " + ", ".join(
            str(f) for f in self.firmware_links)
      return text + ")"
    link = f"link {self.link}" if self.link else "no link model"
    return (f"{self.tier.value} (EMULATED on DRAM of nodes "
            f"{list(self.nodes)}, {link})")


@dataclasses.dataclass(frozen=True)
class PoolStats:
  """A snapshot of every tier of a pool."""
  pool_id: int
  tiers: dict[Tier, TierStats]

  def __getitem__(self, tier: str | Tier) -> TierStats:
    return self.tiers[as_tier(tier)]

  @property
  def emulated(self) -> tuple[Tier, ...]:
    return tuple(t for t, s in self.tiers.items() if s.enabled and s.emulated)

  def __str__(self) -> str:
    lines = [f"jcxl pool {self.pool_id}"]
    for s in self.tiers.values():
      if not s.enabled:
        continue
      lines.append(
          f"  {s.label()}: {s.objects} objects, live "
          f"{format_bytes(s.live)} / reserved {format_bytes(s.reserved)} / "
          f"capacity {format_bytes(s.capacity)}, fragmentation "
          f"{s.external_fragmentation:.1%}, read {format_bytes(s.bytes_read)},"
          f" written {format_bytes(s.bytes_written)}")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class TransferRecord:
  """One finished copy-engine request (times on the engine's clock, ns)."""
  id: int
  handle: int
  tier: Tier
  node: int
  to_pool: bool
  nbytes: int
  priority: int
  queued_ns: int
  started_ns: int
  finished_ns: int
  ok: bool

  @classmethod
  def from_engine(cls, raw: Any) -> TransferRecord:
    """From the copy engine's record (``_jcxl.TransferRecord``)."""
    return cls(raw.id, raw.handle, _TIERS_BY_INDEX[raw.tier], raw.node,
               raw.to_pool, raw.bytes, raw.priority, raw.queued_ns,
               raw.started_ns, raw.finished_ns, raw.ok)

  @property
  def seconds(self) -> float:
    return (self.finished_ns - self.started_ns) * 1e-9


# How long a wait that timed out gives the cancelled copy to stop (it ends
# after the chunk it is on), so that what it had not moved it never moves.
_CANCEL_GRACE_S = 2.0


def _timeout_seconds(value: Any, name: str = "timeout_s") -> float:
  """Validates a timeout in seconds: a number >= 0 (inf: no deadline)."""
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer,
                                                      np.floating)):
    raise TypeError(f"{name} must be a number of seconds, but got "
                    f"{value!r} ({type(value).__name__})")
  seconds = float(value)
  if not seconds >= 0:  # also nan
    raise ValueError(f"{name} must be >= 0 seconds (inf for no deadline), "
                     f"but got {value!r}")
  return seconds


class Transfer:
  """An asynchronous copy in flight; ``wait()`` until it is done.

  The copy engine holds its own reference to the host buffer until it is
  done with it, so a transfer may be dropped unwaited, or its wait may
  fail, at any time: the buffer is freed only once no byte of it moves.
  """

  def __init__(self, ticket: Any, buffer: np.ndarray, timeout_s: float):
    self._ticket = ticket
    self._buffer = buffer
    self._timeout_s = timeout_s

  def done(self) -> bool:
    return self._ticket.done()

  def wait(self, timeout_s: float | None = None) -> np.ndarray:
    """Waits for the copy and returns its host buffer.

    A copy that times out is cancelled: what it had not moved yet it never
    moves, so its destination (the buffer, or the object for a write) is
    left partly written, and nothing else is touched.

    Args:
      timeout_s: seconds to wait, >= 0 (``math.inf``: no deadline); None:
        the pool's `timeout_s`. A bad value raises before anything else
        happens: the transfer can still be waited for.

    Raises:
      TypeError: `timeout_s` is not a number.
      ValueError: `timeout_s` is negative or nan.
      TransferTimeoutError: the copy did not finish within `timeout_s`; the
        message names the object and the time waited.
      TierIOError: the nvme tier's file system failed the copy.
      PoolClosedError: the pool was closed before the copy ran.
    """
    timeout_s = (self._timeout_s if timeout_s is None else
                 _timeout_seconds(timeout_s))
    try:
      self._ticket.wait(timeout_s)
    except errors.TransferTimeoutError:
      self._ticket.cancel()
      try:  # a cancelled copy stops after the chunk it is on
        self._ticket.wait(_CANCEL_GRACE_S)
      except errors.JcxlError:
        pass
      raise
    return self._buffer

  @property
  def record(self) -> TransferRecord:
    return TransferRecord.from_engine(self._ticket.record())


@dataclasses.dataclass(frozen=True)
class UpdateStats:
  """What a pool's update programs did (see ``Pool.run_update``).

  Attributes:
    runs: runs finished, failed ones included.
    failed: of those, the runs that ended with an error.
    elements: elements of the runs that succeeded.
    bytes_read: object bytes the programs read (not counted in the tiers'
      bytes_read: those are what crosses the device link).
    bytes_written: object bytes the programs wrote.
    busy_ns: wall time of the runs, summed (start to end of each).
    threads: update threads started so far (0 before the first run).
  """
  runs: int
  failed: int
  elements: int
  bytes_read: int
  bytes_written: int
  busy_ns: int
  threads: int

  @property
  def bandwidth(self) -> float:
    """Object bytes read and written per second of run time."""
    return (self.bytes_read + self.bytes_written) / max(self.busy_ns * 1e-9,
                                                        1e-12)


class UpdateRun:
  """An update run in flight; ``wait()`` until it is done."""

  def __init__(self, run: Any, timeout_s: float):
    self._run = run
    self._timeout_s = timeout_s

  @property
  def id(self) -> int:
    return self._run.id

  @property
  def program_id(self) -> int:
    return self._run.program_id

  def done(self) -> bool:
    return self._run.done()

  def wait(self, timeout_s: float | None = None) -> None:
    """Waits for the run.

    Args:
      timeout_s: seconds to wait, >= 0 (``math.inf``: no deadline); None:
        the pool's `timeout_s`. A run that times out keeps running: its
        objects are not ready until it is done.

    Raises:
      TransferTimeoutError: the run did not finish within `timeout_s`.
      TierIOError: an nvme object could not be read or written.
      PoolClosedError: the pool was closed before the run ended.
    """
    timeout_s = (self._timeout_s if timeout_s is None else
                 _timeout_seconds(timeout_s))
    self._run.wait(timeout_s)


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
    update_threads: threads that run update programs (``run_update``) on
      the pool's objects; 0: one per CPU this process may use, at most 16.
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
    # Registered update programs by id (for trace-time checks).
    self._update_programs: dict[int, update_program_lib.Program] = {}
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
    raw = self._pool.info(_as_handle(handle))
    return ObjectInfo(handle=raw.handle, tier=_TIERS_BY_INDEX[raw.tier],
                      node=raw.node, offset=raw.offset, nbytes=raw.bytes,
                      shape=tuple(raw.shape),
                      dtype=_dtype_from_name(raw.dtype), slab=raw.slab,
                      copy_of=raw.copy_of)

  def handles(self) -> list[int]:
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

  # ------------------------------------------------------------ updates

  def register_update(self, program: update_program_lib.Program) -> int:
    """Registers an update program on this pool's objects; returns its id.

    Raises:
      TypeError: `program` is not an update_program.Program, or a field of
        it is not an int.
      ValueError: the program is malformed (an operand that names no
        earlier register, a scalar index past num_scalars, a scalar
        output...), or an object it reads or writes does not hold exactly
        `num_elements` float32 or bfloat16 elements.
      UnknownHandleError: a handle is not this pool's (or was freed).
    """
    if not isinstance(program, update_program_lib.Program):
      raise TypeError(f"register_update takes a jcxl update Program, got "
                      f"{type(program).__name__}")
    program_id = self._pool.register_update(program.to_native())
    self._update_programs[program_id] = program
    return program_id

  def release_update(self, program_id: int) -> None:
    """Forgets a program; runs of it in flight finish."""
    program_id = _as_handle(program_id)
    self._pool.release_update(program_id)
    self._update_programs.pop(program_id, None)

  def update_program(self, program_id: int) -> update_program_lib.Program:
    """The registered program `program_id` (UnknownHandleError if none)."""
    program = self._update_programs.get(program_id)
    if program is None or self.closed:
      raise errors.UnknownHandleError(
          f"update program {program_id} is unknown to pool {self.id} "
          f"(released, or never registered)")
    return program

  def run_update(self, program_id: int, scalars: Any = ()) -> UpdateRun:
    """Starts a run of program `program_id`; ``wait()`` on the result.

    Runs go one at a time, in the order started, over the pool's update
    threads. The program's objects are pinned until the run is done
    (``free`` and ``compact`` wait for it).

    Args:
      program_id: what ``register_update`` returned.
      scalars: the run's `num_scalars` floats (learning rate, bias
        corrections...), as float32.

    Raises:
      ValueError: `scalars` does not hold the program's num_scalars values.
      UnknownHandleError: the program is unknown, or an object of it was
        freed since it was registered (the message names it).
    """
    values = np.asarray(scalars, dtype=np.float32).reshape(-1)
    run = self._pool.start_update(_as_handle(program_id),
                                  [float(v) for v in values])
    return UpdateRun(run, self._timeout_s)

  def _hold_updates(self, hold: bool) -> None:
    """Test hook: while held, update runs wait (they queue up), so that a
    test can see what waits for them (``free``, ``close``, a step's
    ``update_done`` timing out)."""
    self._pool.hold_updates(bool(hold))

  def update_stats(self) -> UpdateStats:
    raw = self._pool.update_stats()
    return UpdateStats(runs=raw.runs, failed=raw.failed,
                       elements=raw.elements, bytes_read=raw.bytes_read,
                       bytes_written=raw.bytes_written, busy_ns=raw.busy_ns,
                       threads=raw.threads)

  # -------------------------------------------------------------- state

  def settings(self) -> dict[str, Any]:
    """What the processes of a multi-process run must agree on: the
    constructor's arguments that change where objects go and how they move
    (not the node, the topology or the nvme directory, which are each
    host's own)."""
    return dict(self._settings)

  def stats(self) -> PoolStats:
    tiers = {}
    for raw in self._pool.stats():
      tier = _TIERS_BY_INDEX[raw.tier]
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
