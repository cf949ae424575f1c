"""What a pool reports of its objects and tiers (`Pool.info`, `Pool.stats`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jcxl._src.link_model import FirmwareLink
from jcxl._src.link_model import LinkModel
from jcxl._src.tier import Tier
from jcxl._src.tier import as_tier
from jcxl._src.units import format_bytes


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
