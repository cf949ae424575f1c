"""Per-layer streaming plans: what to fetch, how far ahead, in what pieces.

A plan is chosen per "layer": the pool-resident leaves that a step uses
together (leaves under the same module path), in the order the step first
uses them.
"""

from __future__ import annotations

import dataclasses
import re

from jcxl._src.units import format_bytes


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """How one layer's pool-resident leaves stream into the step."""
  name: str           # the module path shared by the layer's leaves
  nbytes: int         # bytes of one device's shards of the layer's leaves
  tiers: tuple[str, ...]
  prefetch: int       # how many layers ahead its fetches are issued
  chunk_bytes: int    # copy-engine piece size (0: the pool's default)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The plan a cxl_offload step was compiled with."""
  layers: tuple[LayerPlan, ...]
  schedule: str

  def layer(self, name: str) -> LayerPlan:
    for layer in self.layers:
      if layer.name == name:
        return layer
    raise KeyError(f"no layer {name!r} in the plan; layers: "
                   f"{[l.name for l in self.layers]}")

  def table(self) -> str:
    rows = [f"{'layer':40s} {'bytes':>12s} {'tier':8s} {'prefetch':>8s} "
            f"{'chunk':>10s}"]
    for l in self.layers:
      rows.append(f"{l.name[:40]:40s} {format_bytes(l.nbytes):>12s} "
                  f"{','.join(l.tiers):8s} {l.prefetch:8d} "
                  f"{format_bytes(l.chunk_bytes) if l.chunk_bytes else 'pool':>10s}")
    return "\n".join(rows)

  def __str__(self) -> str:
    return f"plan ({self.schedule}):\n{self.table()}"


@dataclasses.dataclass(frozen=True)
class FixedSchedule:
  """The same prefetch distance (and chunk size) for every layer."""
  prefetch: int
  chunk_bytes: int = 0

  def prefetch_for(self, layer: str) -> int:
    del layer
    return self.prefetch

  def __str__(self) -> str:
    return f"fixed:{self.prefetch}"


_FIXED = re.compile(r"^fixed:(\d+)$")


def parse_schedule(schedule: str | FixedSchedule) -> FixedSchedule:
  """Parses 'fixed:k' (prefetch distance k for every layer)."""
  if isinstance(schedule, FixedSchedule):
    return schedule
  match = _FIXED.match(schedule) if isinstance(schedule, str) else None
  if not match:
    raise ValueError(
        "schedule must be 'fixed:k' with k >= 0 (the prefetch distance in "
        f"layers), but got {schedule!r}")
  return FixedSchedule(prefetch=int(match.group(1)))
