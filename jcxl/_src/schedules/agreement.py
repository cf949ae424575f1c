"""What the processes of a multi-process run exchange so that their DAP
tuners take the same decisions (see schedules.dap, distributed.Agreement).

Every input a tuner decides from is agreed before it is used: the cost
model's first estimates (each segment's compute, each tier's link), each
measured step, each compile (its device need and seconds), and which plans
every process has compiled. A step runs as slowly as its slowest process,
so a time agreed is the largest reported, a link the slowest; a measured
step's profile is process 0's, with the slowest process's step time.
Each tuner then sees the same values in the same order, and, being
deterministic, chooses the same plans at the same steps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from jcxl._src import errors
from jcxl._src.schedules import costmodel
from jcxl._src.schedules.profile import LayerProfile
from jcxl._src.schedules.profile import StepProfile
from jcxl._src.schedules.plan import LayerSchedule


def plan_key(schedule: LayerSchedule) -> str:
  """A name of `schedule` that is the same in every process."""
  text = json.dumps([schedule.prefetch, schedule.chunk_bytes,
                     schedule.default_prefetch, schedule.default_chunk_bytes,
                     schedule.name])
  return hashlib.sha1(text.encode()).hexdigest()[:16]


def encode_profile(profile: StepProfile | None) -> Any:
  return None if profile is None else dataclasses.asdict(profile)


def decode_profile(value: Any) -> StepProfile | None:
  if value is None:
    return None
  optional = lambda v: None if v is None else tuple(v)
  return StepProfile(
      step_s=value["step_s"],
      layers=tuple(LayerProfile(**l) for l in value["layers"]),
      segment_compute_s=optional(value["segment_compute_s"]),
      bytes_by_tier=dict(value["bytes_by_tier"]),
      bandwidth_by_tier=dict(value["bandwidth_by_tier"]),
      segment_overlap_bytes=optional(value["segment_overlap_bytes"]))


def agreed_profile(values: Sequence[Any]) -> StepProfile | None:
  """Process 0's measured step (None where it measured none), with the
  step time of the slowest process that measured it."""
  lead = decode_profile(values[0])
  if lead is None:
    return None
  slowest = max(v["step_s"] for v in values if v is not None)
  return dataclasses.replace(lead, step_s=slowest)


def encode_estimates(segments: Sequence[costmodel.Segment],
                     links: Mapping[str, costmodel.Link]) -> Any:
  return {"compute_s": [s.compute_s for s in segments],
          "names": [s.name for s in segments],
          "links": {t: dataclasses.asdict(l) for t, l in links.items()}}


def agreed_estimates(segments: Sequence[costmodel.Segment],
                     links: Mapping[str, costmodel.Link],
                     values: Sequence[Any]
                     ) -> tuple[list[costmodel.Segment],
                                dict[str, costmodel.Link]]:
  """The cost model's first estimates as every process agrees them: each
  segment's compute the slowest process's, each link the slowest's (the
  compute estimates and real tiers' links are measured in each process).

  Raises:
    StepMismatchError: the processes traced different steps.
  """
  names = {json.dumps(v["names"]) for v in values}
  tiers = {json.dumps(sorted(v["links"])) for v in values}
  if len(names) > 1 or len(tiers) > 1:
    raise errors.StepMismatchError(
        "the processes traced different steps under schedule='dap': their "
        "layers or tiers differ (" + "; ".join(
            f"process {p}: {len(v['names'])} segments, tiers "
            f"{sorted(v['links'])}" for p, v in enumerate(values)) + ")")
  segments = [dataclasses.replace(s, compute_s=max(v["compute_s"][i]
                                                   for v in values))
              for i, s in enumerate(segments)]
  agreed = {}
  for tier in links:
    each = [v["links"][tier] for v in values]
    agreed[tier] = costmodel.Link(
        bandwidth=min(l["bandwidth"] for l in each),
        latency_s=max(l["latency_s"] for l in each),
        hold_s=max(l["hold_s"] for l in each))
  return segments, agreed
