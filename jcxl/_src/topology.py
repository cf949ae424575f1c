"""NUMA topology of the host: nodes, distances, memory tiers and CXL memory.

Linux shows a CXL Type-3 memory expander as a NUMA node that has memory and no
CPUs. This module reads such facts from sysfs, under a root path that tests
point at a fixture tree, and maps each JAX device to its nearest node.

Only named files are read, never a recursive walk: the node `accessY/`
directories and `memory_tiering` hold symlinks that lead back up the tree.

Example:

  >>> from jcxl._src import topology
  >>> topo = topology.discover()
  >>> print(topo.summary())  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable
import dataclasses
import logging
import os
import re
from typing import Any

logger = logging.getLogger(__name__)

_NODE_DIR = os.path.join("devices", "system", "node")
_TIERS_DIR = os.path.join("devices", "virtual", "memory_tiering")
_MEMORY_DIR = os.path.join("devices", "system", "memory")
_CXL_DEVICES_DIR = os.path.join("bus", "cxl", "devices")
_PCI_DEVICES_DIR = os.path.join("bus", "pci", "devices")
_PCI_DRIVERS_DIR = os.path.join("bus", "pci", "drivers")

# SLIT distance of a node to itself (ACPI 6.5, section 5.2.17).
LOCAL_DISTANCE = 10

_TIER_RE = re.compile(r"memory_tier(\d+)")
_REGION_RE = re.compile(r"region(\d+)")
_DAX_REGION_RE = re.compile(r"dax_region(\d+)")
_MEMORY_BLOCK_RE = re.compile(r"memory(\d+)")
_DAX_DEVICE_RE = re.compile(r"dax(\d+)\.(\d+)")
_PCI_ADDRESS_RE = re.compile(
    r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])"
)
_MEMTOTAL_RE = re.compile(r"MemTotal:\s*(\d+)\s*kB")


@dataclasses.dataclass(frozen=True)
class Hmat:
  """Firmware (ACPI HMAT) access figures for a memory node.

  Read from `nodeN/access0/initiators/`: the figures seen from the node's
  nearest initiators (access class 0). A figure the kernel does not expose is
  None.

  Attributes:
    read_bandwidth_mbps: Read bandwidth in MB/s.
    write_bandwidth_mbps: Write bandwidth in MB/s.
    read_latency_ns: Read latency in nanoseconds.
    write_latency_ns: Write latency in nanoseconds.
  """

  read_bandwidth_mbps: int | None
  write_bandwidth_mbps: int | None
  read_latency_ns: int | None
  write_latency_ns: int | None


@dataclasses.dataclass(frozen=True)
class NumaNode:
  """One NUMA node as the kernel reports it.

  Attributes:
    id: The node id.
    cpus: Ids of the node's CPUs, ascending.
    memory_bytes: The node's MemTotal, in bytes.
    distances: (node id, SLIT distance) pairs to every online node, ordered by
      node id. 10 means local.
    memory_tier: The kernel memory tier holding this node (a lower number is
      faster), or None where the kernel exposes no tiers.
    hmat: Firmware access figures, or None where the kernel exposes none.
    cxl_confirmed: Whether /sys/bus/cxl shows a CXL region backing this node.
  """

  id: int
  cpus: tuple[int, ...]
  memory_bytes: int
  distances: tuple[tuple[int, int], ...]
  memory_tier: int | None = None
  hmat: Hmat | None = None
  cxl_confirmed: bool = False

  @property
  def has_cpus(self) -> bool:
    """Whether the node has CPUs (a CXL expander's node has none)."""
    return bool(self.cpus)

  @property
  def has_memory(self) -> bool:
    """Whether the node has memory of its own."""
    return self.memory_bytes > 0

  @property
  def is_cxl_candidate(self) -> bool:
    """Whether the node looks like a CXL expander: memory and no CPUs."""
    return self.has_memory and not self.has_cpus

  def distance_to(self, node_id: int) -> int:
    """Returns the SLIT distance from this node to `node_id`.

    Raises:
      ValueError: if `node_id` is not an online node.
    """
    for other, distance in self.distances:
      if other == node_id:
        return distance
    known = [other for other, _ in self.distances]
    raise ValueError(
        f"node_id must be one of the online nodes {known}, but got {node_id!r}"
    )


@dataclasses.dataclass(frozen=True)
class Topology:
  """The NUMA nodes of a machine.

  Attributes:
    nodes: The online nodes, ordered by id.
    sysfs_root: The sysfs root they were read from.
  """

  nodes: tuple[NumaNode, ...]
  sysfs_root: str

  @property
  def node_ids(self) -> tuple[int, ...]:
    """The ids of the machine's NUMA nodes, in order."""
    return tuple(n.id for n in self.nodes)

  @property
  def cpu_nodes(self) -> tuple[NumaNode, ...]:
    """Nodes with CPUs, ordered by id."""
    return tuple(n for n in self.nodes if n.has_cpus)

  @property
  def cxl_nodes(self) -> tuple[NumaNode, ...]:
    """CXL candidates (memory, no CPUs), ordered by id.

    A CPU-less memory node is not always CXL (HBM, PMEM, GPU memory also show
    up so); `cxl_confirmed` tells which ones /sys/bus/cxl vouches for.
    """
    return tuple(n for n in self.nodes if n.is_cxl_candidate)

  def node(self, node_id: int) -> NumaNode:
    """Returns the node with id `node_id`.

    Raises:
      ValueError: if there is no such online node.
    """
    for n in self.nodes:
      if n.id == node_id:
        return n
    raise ValueError(
        f"node_id must be one of the online nodes {list(self.node_ids)}, but "
        f"got {node_id!r}"
    )

  def distance(self, a: int, b: int) -> int:
    """Returns the SLIT distance from node `a` to node `b`."""
    return self.node(a).distance_to(b)

  def node_of_cpu(self, cpu: int) -> int:
    """Returns the id of the node that holds CPU `cpu`.

    Raises:
      ValueError: if no node holds `cpu`.
    """
    for n in self.nodes:
      if cpu in n.cpus:
        return n.id
    all_cpus = sorted(c for n in self.nodes for c in n.cpus)
    raise ValueError(
        f"cpu must be one of the CPUs {format_cpulist(all_cpus)}, but got "
        f"{cpu!r}"
    )

  def nearest_cxl_nodes(self, from_node: int) -> tuple[int, ...]:
    """Returns the CXL candidate ids, nearest to `from_node` first.

    Ties in distance go to the lower node id.
    """
    source = self.node(from_node)
    return tuple(
        sorted(
            (n.id for n in self.cxl_nodes),
            key=lambda i: (source.distance_to(i), i),
        )
    )

  def nearest_memory_node(self, from_node: int) -> int:
    """Returns `from_node` if it has memory, else the nearest node with memory.

    Raises:
      ValueError: if `from_node` is unknown or no node has memory.
    """
    source = self.node(from_node)
    if source.has_memory:
      return source.id
    with_memory = [n.id for n in self.nodes if n.has_memory]
    if not with_memory:
      raise ValueError(
          f"no node has memory in the topology read from {self.sysfs_root!r}"
      )
    return min(with_memory, key=lambda i: (source.distance_to(i), i))

  def summary(self) -> str:
    """Returns a short human-readable table of the nodes."""
    header = ("node", "cpus", "memory", "tier", "cxl", "hmat read", "distances")
    rows = [header]
    for n in self.nodes:
      if n.cxl_confirmed:
        cxl = "yes"
      elif n.is_cxl_candidate:
        cxl = "candidate"
      else:
        cxl = "-"
      if n.hmat is not None and n.hmat.read_bandwidth_mbps is not None:
        hmat = f"{n.hmat.read_bandwidth_mbps} MB/s"
        if n.hmat.read_latency_ns is not None:
          hmat += f" {n.hmat.read_latency_ns} ns"
      else:
        hmat = "-"
      rows.append((
          str(n.id),
          format_cpulist(n.cpus) or "-",
          f"{n.memory_bytes / 2**30:.1f} GiB",
          "-" if n.memory_tier is None else str(n.memory_tier),
          cxl,
          hmat,
          " ".join(str(d) for _, d in n.distances),
      ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"NUMA topology from {self.sysfs_root}"]
    for row in rows:
      lines.append(
          "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
      )
    return "\n".join(lines)


def parse_cpulist(text: str, *, source: str = "cpulist") -> tuple[int, ...]:
  """Parses a kernel list such as "0-3,8-11" into sorted, unique ids.

  Args:
    text: The list; empty (or only whitespace) means no ids.
    source: What the text came from, for error messages.

  Returns:
    The ids, ascending and without repeats.

  Raises:
    ValueError: if `text` is not a list of ids and ascending ranges.
  """
  ids = set()
  stripped = text.strip()
  if not stripped:
    return ()
  for part in stripped.split(","):
    bounds = part.strip().split("-")
    try:
      if len(bounds) == 1:
        low = high = int(bounds[0])
      elif len(bounds) == 2:
        low, high = int(bounds[0]), int(bounds[1])
      else:
        raise ValueError(part)
    except ValueError:
      raise ValueError(
          f"{source} must be a list like '0-3,8-11', but got {text!r}"
      ) from None
    if low < 0 or high < low:
      raise ValueError(
          f"{source} must hold ascending ranges of non-negative ids, but got "
          f"{part!r} in {text!r}"
      )
    ids.update(range(low, high + 1))
  return tuple(sorted(ids))


def format_cpulist(ids: Iterable[int]) -> str:
  """Formats ids as a kernel list, e.g. (0, 1, 2, 3, 8) -> "0-3,8"."""
  ordered = sorted(set(ids))
  parts = []
  start = prev = None
  for i in ordered:
    if start is None:
      start = prev = i
    elif i == prev + 1:
      prev = i
    else:
      parts.append(str(start) if start == prev else f"{start}-{prev}")
      start = prev = i
  if start is not None:
    parts.append(str(start) if start == prev else f"{start}-{prev}")
  return ",".join(parts)


def _read(path: str) -> str:
  """Reads a required sysfs file."""
  try:
    with open(path, encoding="ascii") as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"cannot read required sysfs file {path}: {e}") from e


def _read_optional(path: str) -> str | None:
  """Reads an optional sysfs file; None when absent or unreadable."""
  try:
    with open(path, encoding="ascii") as f:
      return f.read()
  except (OSError, UnicodeDecodeError):
    return None


def _parse_int(text: str, path: str, base: int = 10) -> int:
  try:
    return int(text.strip(), base)
  except ValueError:
    raise ValueError(
        f"{path} must hold one integer, but holds {text.strip()!r}"
    ) from None


def _listdir(path: str) -> list[str]:
  """Lists one directory (no recursion); empty when absent."""
  try:
    return sorted(os.listdir(path))
  except OSError:
    return []


def _read_meminfo_total(path: str) -> int:
  """Returns MemTotal in bytes from a (node) meminfo file."""
  text = _read(path)
  match = _MEMTOTAL_RE.search(text)
  if match is None:
    raise ValueError(f"{path} has no 'MemTotal: <n> kB' line")
  return int(match.group(1)) * 1024


def _read_distances(
    path: str, online: tuple[int, ...]
) -> tuple[tuple[int, int], ...]:
  """Reads nodeN/distance: one row ordered as the online node list."""
  text = _read(path)
  try:
    row = [int(x) for x in text.split()]
  except ValueError:
    raise ValueError(
        f"{path} must hold integer distances, but holds {text.strip()!r}"
    ) from None
  # The kernel prints node_distance(nid, i) for_each_online_node(i).
  if len(row) != len(online):
    raise ValueError(
        f"{path} must hold one distance per online node {list(online)}, but "
        f"holds {len(row)}: {text.strip()!r}"
    )
  if any(d <= 0 for d in row):
    raise ValueError(f"{path} must hold positive distances, got {row}")
  return tuple(zip(online, row))


def _read_hmat(node_dir: str) -> Hmat | None:
  """Reads access class 0 HMAT figures; None when the kernel exposes none."""
  initiators = os.path.join(node_dir, "access0", "initiators")
  values = []
  for name in (
      "read_bandwidth",
      "write_bandwidth",
      "read_latency",
      "write_latency",
  ):
    path = os.path.join(initiators, name)
    text = _read_optional(path)
    values.append(None if text is None else _parse_int(text, path))
  if all(v is None for v in values):
    return None
  return Hmat(*values)


def _read_memory_tiers(root: str) -> dict[int, int]:
  """Returns {node id: memory tier} from devices/virtual/memory_tiering."""
  tiers_dir = os.path.join(root, _TIERS_DIR)
  tier_of = {}
  for name in _listdir(tiers_dir):
    match = _TIER_RE.fullmatch(name)
    if match is None:
      continue
    tier = int(match.group(1))
    # Merged kernels name the file 'nodelist'; early patches named it 'nodes'.
    for leaf in ("nodelist", "nodes"):
      path = os.path.join(tiers_dir, name, leaf)
      text = _read_optional(path)
      if text is not None:
        for node_id in parse_cpulist(text, source=path):
          tier_of[node_id] = tier
        break
  return tier_of


def _cxl_nodes(root: str, node_ids: tuple[int, ...]) -> frozenset[int]:
  """Returns the nodes that /sys/bus/cxl shows to be backed by a CXL region.

  Two ways, both from sysfs-bus-cxl / sysfs-bus-dax:
  - A RAM region handed to the kernel through device-dax (kmem) has
    `dax_regionZ/daxZ.Y/target_node`, the node its memory went to.
  - A region spans host physical addresses [`resource`, `resource` + `size`);
    a node holding a memory block in that range lists it as `nodeN/memoryB`.
    This also covers regions that firmware onlined as ordinary RAM, with no
    dax device, and PMEM regions onlined through an NVDIMM namespace, whose
    dax device sits on the nvdimm bus: the namespace's metadata takes the
    start of the region, whose first memory block then stays offline, so
    any block in the range counts.
  """
  devices_dir = os.path.join(root, _CXL_DEVICES_DIR)
  entries = _listdir(devices_dir)
  confirmed = set()
  for name in entries:
    if _DAX_REGION_RE.fullmatch(name) is None:
      continue
    region_dir = os.path.join(devices_dir, name)
    for child in _listdir(region_dir):
      if _DAX_DEVICE_RE.fullmatch(child) is None:
        continue
      path = os.path.join(region_dir, child, "target_node")
      text = _read_optional(path)
      if text is not None:
        confirmed.add(_parse_int(text, path))

  node_blocks = None  # {node id: its memory blocks}, listed when needed
  block_text = _read_optional(
      os.path.join(root, _MEMORY_DIR, "block_size_bytes")
  )
  if block_text is not None:
    block_size = _parse_int(
        block_text, os.path.join(root, _MEMORY_DIR, "block_size_bytes"), 16
    )
    for name in entries:
      if _REGION_RE.fullmatch(name) is None or block_size <= 0:
        continue
      path = os.path.join(devices_dir, name, "resource")
      text = _read_optional(path)
      if text is None:
        continue
      # An unassigned region reads 0xffffffffffffffff: no such block exists.
      start = _parse_int(text, path, 16)
      size_path = os.path.join(devices_dir, name, "size")
      size_text = _read_optional(size_path)
      size = 1 if size_text is None else _parse_int(size_text, size_path, 16)
      first = start // block_size
      last = (start + max(size, 1) - 1) // block_size
      for node_id in node_ids:
        if node_blocks is None:
          node_blocks = {n: _memory_blocks(root, n) for n in node_ids}
        if any(first <= block <= last for block in node_blocks[node_id]):
          confirmed.add(node_id)
  return frozenset(confirmed & set(node_ids))


def _memory_blocks(root: str, node_id: int) -> tuple[int, ...]:
  """The memory blocks a node lists (`nodeN/memoryB`), by one listdir."""
  names = _listdir(os.path.join(root, _NODE_DIR, f"node{node_id}"))
  return tuple(
      int(match.group(1))
      for match in map(_MEMORY_BLOCK_RE.fullmatch, names)
      if match is not None
  )


def _single_node(root: str, proc_root: str) -> Topology:
  """The topology of a machine whose kernel shows no NUMA nodes."""
  cpu_online = _read_optional(
      os.path.join(root, "devices", "system", "cpu", "online")
  )
  if cpu_online is not None:
    cpus = parse_cpulist(cpu_online, source="devices/system/cpu/online")
  else:
    cpus = tuple(range(os.cpu_count() or 1))
  meminfo = os.path.join(proc_root, "meminfo")
  try:
    memory_bytes = _read_meminfo_total(meminfo)
  except ValueError:
    memory_bytes = 0
  logger.info(
      "%s does not exist: assuming one node 0 with CPUs %s",
      os.path.join(root, _NODE_DIR),
      format_cpulist(cpus),
  )
  node = NumaNode(
      id=0,
      cpus=cpus,
      memory_bytes=memory_bytes,
      distances=((0, LOCAL_DISTANCE),),
  )
  return Topology(nodes=(node,), sysfs_root=root)


def discover(
    sysfs_root: str | os.PathLike[str] = "/sys",
    *,
    proc_root: str | os.PathLike[str] = "/proc",
) -> Topology:
  """Reads the NUMA topology from sysfs.

  Args:
    sysfs_root: Where sysfs is mounted; tests pass a fixture tree.
    proc_root: Where procfs is mounted; only read (for MemTotal) when
      `sysfs_root` shows no NUMA nodes.

  Returns:
    The online nodes. Where `<sysfs_root>/devices/system/node` does not exist
    (containers, kernels without NUMA), a single node 0 that holds all CPUs.

  Raises:
    ValueError: if a required file (`online`, a node's `cpulist`, `meminfo`,
      `distance`) is missing or malformed; the message names the file.
      Optional files (memory tiers, HMAT, /sys/bus/cxl) are skipped when
      absent.

  Example:

    >>> topo = discover("tests/fixtures/sysfs/two_socket_two_cxl")
    >>> topo.nearest_cxl_nodes(0)
    (2, 3)
  """
  root = os.fspath(sysfs_root)
  node_dir = os.path.join(root, _NODE_DIR)
  if not os.path.isdir(node_dir):
    return _single_node(root, os.fspath(proc_root))

  online_path = os.path.join(node_dir, "online")
  online = parse_cpulist(_read(online_path), source=online_path)
  if not online:
    raise ValueError(f"{online_path} lists no online node")

  tiers = _read_memory_tiers(root)
  cxl = _cxl_nodes(root, online)
  nodes = []
  for node_id in online:
    this_dir = os.path.join(node_dir, f"node{node_id}")
    if not os.path.isdir(this_dir):
      raise ValueError(
          f"{online_path} lists node {node_id}, but {this_dir} does not exist"
      )
    cpulist_path = os.path.join(this_dir, "cpulist")
    nodes.append(
        NumaNode(
            id=node_id,
            cpus=parse_cpulist(_read(cpulist_path), source=cpulist_path),
            memory_bytes=_read_meminfo_total(
                os.path.join(this_dir, "meminfo")
            ),
            distances=_read_distances(
                os.path.join(this_dir, "distance"), online
            ),
            memory_tier=tiers.get(node_id),
            hmat=_read_hmat(this_dir),
            cxl_confirmed=node_id in cxl,
        )
    )
  return Topology(nodes=tuple(nodes), sysfs_root=root)


def node_of_current_process(topology: Topology) -> int:
  """Returns the node that holds most of the CPUs this process may run on.

  Ties go to the lower node id. Where no node holds any of them (a topology
  read from another machine's tree), the first node with CPUs.
  """
  try:
    allowed = os.sched_getaffinity(0)
  except AttributeError:  # Not Linux.
    allowed = set(range(os.cpu_count() or 1))
  best, best_count = None, 0
  for n in topology.nodes:
    count = len(allowed.intersection(n.cpus))
    if count > best_count:
      best, best_count = n.id, count
  if best is not None:
    return best
  with_cpus = topology.cpu_nodes or topology.nodes
  return with_cpus[0].id


def normalize_pci_bus_id(bus_id: str) -> str:
  """Returns a PCI address as sysfs names it: "0000:17:00.0".

  Accepts CUDA's 8-digit domain ("00000000:17:00.0"), upper case, and a
  missing domain ("17:00.0").

  Raises:
    ValueError: if `bus_id` is not a PCI address.
  """
  match = _PCI_ADDRESS_RE.fullmatch(bus_id.strip())
  if match is None:
    raise ValueError(
        f"pci_bus_id must look like '0000:17:00.0', but got {bus_id!r}"
    )
  domain, bus, slot, function = match.groups()
  return (
      f"{int(domain or '0', 16):04x}:{bus.lower()}:{slot.lower()}.{function}"
  )


def _pci_node(topology: Topology, bus_id: str) -> int | None:
  """Returns the online node of a PCI device, or None when unknown."""
  path = os.path.join(
      topology.sysfs_root, _PCI_DEVICES_DIR, bus_id, "numa_node"
  )
  text = _read_optional(path)
  if text is None:
    return None
  node_id = _parse_int(text, path)
  # -1: the firmware gave the device no proximity domain.
  if node_id not in topology.node_ids:
    return None
  return node_id


def _bound_pci_ids(topology: Topology, driver: str) -> list[str]:
  """PCI addresses bound to `driver`, in bus order."""
  names = _listdir(os.path.join(topology.sysfs_root, _PCI_DRIVERS_DIR, driver))
  return sorted(n for n in names if _PCI_ADDRESS_RE.fullmatch(n))


def _gpu_node_without_bus_id(device: Any, topology: Topology) -> int | None:
  """Finds a GPU's node when the device does not tell its PCI address.

  JAX's CUDA devices expose no PCI address (their attributes are
  compute_capability, core_count, device_vendor, ...). Two safe answers:
  every GPU sits on one node; or CUDA numbers GPUs in PCI order
  (CUDA_DEVICE_ORDER=PCI_BUS_ID), so the device's ordinal picks the address.
  """
  gpus = _bound_pci_ids(topology, "nvidia") or _bound_pci_ids(
      topology, "amdgpu"
  )
  gpu_nodes = {_pci_node(topology, g) for g in gpus}
  if len(gpu_nodes) == 1 and None not in gpu_nodes:
    return gpu_nodes.pop()
  nvidia = _bound_pci_ids(topology, "nvidia")
  ordinal = getattr(device, "local_hardware_id", None)
  if (
      not nvidia
      or not isinstance(ordinal, int)
      or os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID"
  ):
    return None
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    try:
      physical = [int(v) for v in visible.split(",") if v.strip()]
    except ValueError:  # UUIDs or MIG names: no PCI order to use.
      return None
    if ordinal >= len(physical):
      return None
    ordinal = physical[ordinal]
  if not 0 <= ordinal < len(nvidia):
    return None
  return _pci_node(topology, nvidia[ordinal])


def device_node(device: Any, topology: Topology) -> int:
  """Returns the NUMA node nearest to a JAX device.

  A CPU device is nearest to the node of this process's CPUs. An accelerator
  is nearest to the node of its PCI device: from its `pci_bus_id` attribute
  when it has one, else from the GPUs bound to the nvidia/amdgpu driver (see
  `_gpu_node_without_bus_id`). When sysfs does not say (`numa_node` is -1, or
  the device cannot be matched), the node of this process's CPUs.

  Args:
    device: A `jax.Device`, or any object with `platform` (and optionally
      `pci_bus_id`, `local_hardware_id`).
    topology: The topology to answer in; its `sysfs_root` is read.

  Returns:
    A node id of `topology`.

  Raises:
    TypeError: if `device` has no `platform`.
    ValueError: if its `pci_bus_id` is not a PCI address.
  """
  platform = getattr(device, "platform", None)
  if not isinstance(platform, str):
    raise TypeError(
        "device must be a jax.Device (with a 'platform' string), but got "
        f"{type(device).__name__}: {device!r}"
    )
  if platform == "cpu":
    return node_of_current_process(topology)
  bus_id = getattr(device, "pci_bus_id", None)
  if bus_id is not None:
    node_id = _pci_node(topology, normalize_pci_bus_id(str(bus_id)))
  else:
    node_id = _gpu_node_without_bus_id(device, topology)
  if node_id is None:
    node_id = node_of_current_process(topology)
    _log_once(
        "no NUMA node in %s for %r; using the node of this process, %d",
        topology.sysfs_root,
        device,
        node_id,
    )
  return node_id


_logged: set[tuple[Any, ...]] = set()


def _log_once(message: str, *args: Any) -> None:
  """Logs `message` the first time these arguments come: placement asks
  for a device's node at every transfer's setup (thousands of times per
  compiled step on a GPU)."""
  if args not in _logged:
    _logged.add(args)
    logger.info(message, *args)
