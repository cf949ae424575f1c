"""What an offloaded step tells its user: the plan it compiled
(``step.plan``) and what each layer moved and waited for (``step.report()``).
"""

from __future__ import annotations

import collections
import dataclasses

from jcxl import _jcxl
from jcxl._src.schedules import plan as schedule_lib
from jcxl._src.schedules import costmodel
from jcxl._src.host_update import plan as host_update_plan
from jcxl._src.offload.analysis import Analysis
from jcxl._src.offload.clusters import Cluster
from jcxl._src.offload.clusters import shard_bytes
from jcxl._src.step_ir.program import layer_of
from jcxl._src.pool_array import PoolArray


@dataclasses.dataclass(frozen=True)
class LayerReport:
  """What one layer moved and waited for in the steps since the last report.

  Bytes and transfers count every shard of this process's devices; `wait_s`
  is what one device waited (the devices wait for their shards at once).
  """
  name: str
  bytes_fetched: int
  bytes_stored: int
  wait_s: float
  transfers: int


def record_plan(a: Analysis, schedule: schedule_lib.LayerSchedule,
                links: dict[str, costmodel.Link],
                made_for: schedule_lib.MadeFor, source: str,
                groups: dict[int, str], first_device: dict[int, str]
                ) -> schedule_lib.Plan:
  """The plan record of step `a` compiled with `schedule` (its prediction
  simulated; a tuner puts its own in: see Scheduler.report). Notes each
  pool handle's layer in `groups`, and one device's in `first_device`, for
  the reports."""
  layers = collections.OrderedDict()
  all_clusters = a.fetches.clusters + [
      Cluster(k, i, i) for i, s in a.fetches.streamed.items()
      for k in s.values()]
  reads = collections.Counter(c.key for c in all_clusters)
  for c in all_clusters:
    target = a.resident[c.key]
    if not isinstance(target, PoolArray):
      continue
    name = layer_of(a.key_paths[c.key])
    entry = layers.setdefault(name, {"keys": {}, "tiers": set()})
    entry["keys"][c.key] = target
    entry["tiers"].add(target.tier.value)
    for j, (_, handle) in enumerate(target.local_handles):
      groups[handle] = name
      if j == 0:
        first_device[handle] = name
  for node in a.host_updates:  # its gradients' bytes count as its layer's
    for staging in node.staging.values():
      for j, (_, handle) in enumerate(staging.local_handles):
        groups[handle] = node.layer
        if j == 0:
          first_device[handle] = node.layer
  pooled = {c.key: a.resident[c.key] for c in all_clusters
            if isinstance(a.resident[c.key], PoolArray)}
  placement = schedule_lib.placement_lines(
      [(t.tier.value, shard_bytes(t), reads[k]) for k, t in pooled.items()])
  rows = []
  for name, entry in layers.items():
    rows.append(schedule_lib.LayerPlan(
        name=name, nbytes=sum(map(shard_bytes, entry["keys"].values())),
        tiers=tuple(sorted(entry["tiers"])),
        prefetch=schedule.prefetch_for(name),
        chunk_bytes=schedule.chunk_for(name),
        update=(a.update_paths[name].path.value
                if name in a.update_paths else ""),
        refetch=("kept" if name in a.fetches.kept else "refetched"
                 if name in a.fetches.keep_bytes else ""),
        keep_bytes=a.fetches.keep_bytes.get(name, 0)))
  prediction = costmodel.simulate(
      a.segments, {l.name: l.prefetch for l in rows}, links,
      {l.name: l.chunk_bytes for l in rows})
  updates = tuple(f"{name}: {why}" for name, why in a.update_paths.items())
  updates += host_update_plan.lines(a.host_updates)
  return schedule_lib.Plan(tuple(rows), source, prediction.step_s, (),
                           made_for, placement, updates)


def layer_reports(groups: dict[int, str], first_device: dict[int, str],
                  layers: list[str]) -> list[LayerReport]:
  """Per layer of `layers`: bytes moved and time waited since the copy
  engine's totals were last drained (by any step's report)."""
  moved = collections.defaultdict(lambda: [0, 0, 0.0, 0])
  for handle, totals in _jcxl.drain_wait_totals().items():
    name = groups.get(handle)
    if name is None:
      continue
    entry = moved[name]
    entry[0] += totals.bytes_from_pool
    entry[1] += totals.bytes_to_pool
    if handle in first_device:
      # Each device waits for its own shard at the same time: the step
      # waited what one device did, not the sum.
      entry[2] += totals.wait_ns * 1e-9
    entry[3] += totals.transfers
  return [LayerReport(name, *moved[name]) for name in layers
          if name in moved]
