"""How fast a tier's link is: an emulated link model, or firmware figures."""

from __future__ import annotations

import dataclasses

from jcxl._src import topology as topology_lib
from jcxl._src import validation
from jcxl._src.units import format_bandwidth
from jcxl._src.units import parse_bandwidth


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
