"""What cxl_offload plans before it rewrites a step: the clusters of uses
of each pool-resident value (each gets its own fetch), the units they form
in fetch order, the step's layer timeline for the cost model, when each
fetch is issued under a schedule, and which reads a store must wait for.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Container
from typing import Any

import numpy as np

from jcxl._src.schedules import compute_estimate
from jcxl._src.schedules import costmodel
from jcxl._src import jax_compat
from jcxl._src.schedules import plan as schedule_lib
from jcxl._src.pool_array import PoolArray
from jcxl._src.step_ir.program import Lit
from jcxl._src.step_ir.program import Node
from jcxl._src.step_ir.program import Program
from jcxl._src.step_ir.program import group_of
from jcxl._src.step_ir.program import layer_of
from jcxl._src.host_update.sliced import SlicedNode

# Higher-order primitives that may take a pool-resident value whole.
_WHOLE = frozenset({"cond", "while", "scan"})
# Uses of a leaf further apart than this many equations are separate
# clusters (each gets its own fetch).
_CLUSTER_GAP = 16


@dataclasses.dataclass(frozen=True)
class Refetch:
  """Whose weights a step keeps on the device between uses far apart (its
  backward pass after its forward pass) and whose it fetches again.

  Attributes:
    kept: layers (``layer_of`` their paths) whose weights are kept.
    keep: which layers are kept besides: 'all' (every one), 'host' (every
      one whose optimizer update runs on the host) or '' (no other).
  """
  kept: frozenset[str] = frozenset()
  keep: str = ""

  def keeps(self, layer: str, host_layers: Container[str] = ()) -> bool:
    return (self.keep == "all" or layer in self.kept or
            (self.keep == "host" and layer in host_layers))

  @classmethod
  def of(cls, refetch: bool | Refetch) -> Refetch:
    """`refetch` as cxl_offload's bool says it (True: none kept)."""
    if isinstance(refetch, Refetch):
      return refetch
    return cls() if refetch else cls(keep="all")


@dataclasses.dataclass
class Cluster:
  key: Any
  first: int
  last: int
  unit: int = -1
  start_at: int = -1
  after_node: int = -1  # whose output the fetch waits for (-1: none)


def _scan_streamed_positions(node: Node, program: Program,
                             resident: dict) -> dict[int, Any]:
  """xs operands of a scan (or pool operands of a sliced loop) that are
  pool-resident: position -> key."""
  if isinstance(node, SlicedNode):
    return {pos: key for pos, key in enumerate(node.ins)
            if key in node.pool_keys}
  if node.eqn is None or node.eqn.primitive.name != "scan":
    return {}  # a host update's node reads only device values
  first_xs = sum(jax_compat.scan_counts(node.eqn.params))
  out = {}
  for pos in range(first_xs, len(node.ins)):
    key = program.resolve(node.ins[pos])
    if key in resident and isinstance(resident[key], PoolArray):
      out[pos] = key
  return out


class FetchClusters:
  """Finds the clusters of uses, the step's layer timeline, and (given a
  schedule) when each cluster's fetch is issued.

  Attributes (besides those the fetches run by):
    keep_bytes: per layer whose pool-resident weights have uses far apart
      (in order of first use), their bytes: the device memory keeping
      them in between costs.
    kept: those of the layers whose weights are kept (`refetch`); the
      others' are fetched again for each use far from the last.
  """

  def __init__(self, program: Program, resident: dict[Any, Any],
               paths: dict[Any, str], refetch: bool | Refetch = True,
               host_layers: Container[str] = ()):
    self.program = program
    self.resident = resident
    self.paths = paths
    uses = collections.defaultdict(list)
    self.streamed: dict[int, dict[int, Any]] = {}
    self.last_use: dict[Any, int] = {}
    for i, node in enumerate(program.nodes):
      streamed = _scan_streamed_positions(node, program, resident)
      if streamed:
        self.streamed[i] = streamed
      for pos, atom in enumerate(node.ins):
        key = program.resolve(atom)
        if key not in resident:
          continue
        self.last_use[key] = i
        if pos in streamed:
          continue
        if (isinstance(resident[key], PoolArray) and node.eqn is not None
            and node.eqn.params.get("jaxpr") is not None
            and node.eqn.primitive.name not in _WHOLE):
          raise NotImplementedError(
              f"cxl_offload cannot stream {resident[key]._what()} into a "
              f"'{node.eqn.primitive.name}' primitive; fetch it inside with "
              "jcxl.fetch, or place that leaf on 'device'")
        if not uses[key] or uses[key][-1] != i:
          uses[key].append(i)
    clusters = []
    remat = lambda i: getattr(program.nodes[i], "remat", 0)
    refetch = Refetch.of(refetch)
    self.keep_bytes: dict[str, int] = {}
    self.kept: set[str] = set()
    for key, idx in uses.items():
      layer = layer_of(paths[key])
      far = any(i - prev > _CLUSTER_GAP and remat(i) == remat(prev)
                for prev, i in zip(idx, idx[1:]))
      keep = refetch.keeps(layer, host_layers)
      if far and isinstance(resident[key], PoolArray):
        self.keep_bytes[layer] = (self.keep_bytes.get(layer, 0) +
                                  shard_bytes(resident[key]))
        if keep:
          self.kept.add(layer)
      start = prev = idx[0]
      for i in idx[1:]:
        # A rematerialized block fetches what it recomputes with: keeping
        # the forward pass's copy would undo remat's saving.
        if (not keep and i - prev > _CLUSTER_GAP) or remat(i) != remat(prev):
          clusters.append(Cluster(key, start, prev))
          start = i
        prev = i
      clusters.append(Cluster(key, start, prev))
    clusters.sort(key=lambda c: (c.first, str(paths[c.key])))
    # Units (steps of the fetch order): consecutive clusters of one module
    # path; a parameter and each of its optimizer moments are units of
    # their own (so their fetches go one after another), of one layer.
    self.unit_first: list[int] = []
    self.unit_group: list[str] = []
    self.unit_layer: list[str] = []  # what the schedule plans by
    for c in clusters:
      group = group_of(paths[c.key])
      if (not self.unit_first or self.unit_group[-1] != group
          or c.first - self.unit_first[-1] > _CLUSTER_GAP):
        self.unit_first.append(c.first)
        self.unit_group.append(group)
        self.unit_layer.append(layer_of(paths[c.key]))
      c.unit = len(self.unit_first) - 1
    self.unit_last = [0] * len(self.unit_first)
    for c in clusters:
      self.unit_last[c.unit] = max(self.unit_last[c.unit], c.last)
    self.clusters = clusters
    self.cluster_at: dict[tuple[Any, int], Cluster] = {}
    for c in clusters:
      for i in uses[c.key]:
        if c.first <= i <= c.last:
          self.cluster_at[(c.key, i)] = c
    self.starts_at: dict[int, list[Cluster]] = collections.defaultdict(list)

  def set_schedule(self, schedule: schedule_lib.LayerSchedule) -> None:
    """Sets when each cluster's fetch is issued under `schedule`."""
    self.starts_at.clear()
    for c in self.clusters:
      k = schedule.prefetch_for(layer_of(self.paths[c.key]))
      # Issued k units ahead, once the unit before those is done with its
      # buffers (its last use has produced its output): at most k + 1
      # units' buffers are then live, even where nothing else orders the
      # step's work (an optimizer update over independent leaves).
      c.start_at = c.first if k == 0 else self.unit_first[max(0, c.unit - k)]
      c.after_node = -1
      if c.unit - k - 1 >= 0:
        c.after_node = self.unit_last[c.unit - k - 1]
        c.start_at = min(c.first, max(c.start_at, c.after_node + 1))
      self.starts_at[c.start_at].append(c)

  def timeline(self, stores: dict[Any, PoolArray],
               store_after: dict[Any, int], timed: bool = False
               ) -> list[costmodel.Segment]:
    """The step cut at its layer boundaries, compute estimated (`timed`:
    each segment's work compiled and timed whole where it is small
    enough to run here; see ``_compute_seconds``)."""
    pooled = lambda key: isinstance(self.resident.get(key), PoolArray)
    # Boundaries: (node, order, segments that start there).
    starts: list[tuple[int, int, list[costmodel.Segment]]] = []
    unit_bytes = collections.defaultdict(int)
    unit_elems = collections.defaultdict(int)
    unit_tier = {}
    for c in self.clusters:
      if pooled(c.key):
        x = self.resident[c.key]
        unit_bytes[c.unit] += shard_bytes(x)
        unit_elems[c.unit] += int(np.prod(x.shard_shape))
        unit_tier.setdefault(c.unit, x.tier.value)
    for u, first in enumerate(self.unit_first):
      if u in unit_bytes:
        starts.append((first, 0, [costmodel.Segment(
            self.unit_layer[u], unit_bytes[u], unit_tier[u], 0.0,
            sequence=0, priority=u, elements=unit_elems[u])]))
    for i, node in enumerate(self.program.nodes):
      loop = self._loop_weights(i, node)
      if loop is None:
        continue
      keys, length, stored = loop
      weights = [self.resident[k] for k in keys]
      per_layer = sum(shard_bytes(w) for w in weights) // length
      elems = sum(int(np.prod(w.shard_shape)) for w in weights) // length
      starts.append((i, 1, [costmodel.Segment(
          layer_of(self.paths[keys[0]]), per_layer, weights[0].tier.value,
          0.0, sequence=1 + i, priority=0,
          stores=tuple(shard_bytes(t) // length for t in stored),
          stores_wait=True, elements=elems) for _ in range(length)]))
    starts.sort(key=lambda s: (s[0], s[1]))
    segments = [costmodel.Segment("(step start)", 0, "", 0.0)]
    owner = []  # per node: index of the segment it computes in
    cursor = 0
    for i, node in enumerate(self.program.nodes):
      while cursor < len(starts) and starts[cursor][0] <= i:
        segments.extend(starts[cursor][2])
        cursor += 1
      owner.append(len(segments) - 1)
    compute = self._compute_seconds(owner, len(segments), timed)
    written = collections.defaultdict(list)
    for key, target in stores.items():
      at = store_after.get(key, -1)
      written[owner[at] if at >= 0 else 0].append(shard_bytes(target))
    return [dataclasses.replace(
        s, compute_s=c, stores=s.stores + tuple(written.get(g, ())),
        tier=s.tier or next((t.tier for t in segments if t.tier), ""))
            for g, (s, c) in enumerate(zip(segments, compute))]

  def _compute_seconds(self, owner: list[int], num_segments: int,
                       timed: bool) -> list[float]:
    """Device time of each segment: the sum of its nodes' estimates, or
    (`timed`) its nodes compiled and timed as one program, which sees the
    loops the compiler forms from them (the offloaded step is cut at the
    same boundaries by its transfers); a streamed loop's time is spread
    over the loop's own segments."""
    nodes = self.program.nodes
    runs: dict[Any, list[int]] = collections.defaultdict(list)
    spread: dict[Any, int] = {}  # a loop's run -> its length
    for i, node in enumerate(nodes):
      loop = self._loop_weights(i, node)
      runs[owner[i] if loop is None else ("loop", i)].append(i)
      if loop is not None:
        spread[("loop", i)] = loop[1]
    timed_runs = self._timed_runs(runs) if timed else {}
    estimates = None  # equation by equation, only where a run is not timed
    compute = [0.0] * num_segments
    for run, members in runs.items():
      seconds = timed_runs.get(run)
      if seconds is None:
        if estimates is None:
          estimates = compute_estimate.node_seconds(nodes,
                                                    self.program.resolve)
        seconds = sum(estimates[i] for i in members)
      if run in spread:
        last = owner[run[1]]
        for g in range(last - spread[run] + 1, last + 1):
          compute[g] += seconds / spread[run]
      else:
        compute[run] += seconds
    return compute

  def _timed_runs(self, runs: dict[Any, list[int]]
                  ) -> dict[Any, float | None]:
    """Each run's nodes compiled and timed as one program that returns
    what other runs (or the step) read; None where it cannot be timed."""
    nodes = self.program.nodes
    # A sliced update's equations are its region's, run whole here.
    flat = lambda members: [n for i in members for n in
                            getattr(nodes[i], "region", None) or [nodes[i]]]
    readers = collections.defaultdict(set)
    for run, members in runs.items():
      for n in flat(members):
        for atom in n.ins:
          readers[self.program.resolve(atom)].add(run)
    outputs = set(self.program.outputs)
    return {run: compute_estimate.run_seconds(
        flat(members), self.program.resolve, self.program.consts,
        lambda key, run=run: key in outputs or bool(readers[key] - {run}))
            for run, members in runs.items()}

  def _loop_weights(self, i: int, node: Node
                    ) -> tuple[list[Any], int, list[PoolArray]] | None:
    """A streamed loop's stacked pool keys, length and what it stores."""
    if isinstance(node, SlicedNode):
      return node.pool_keys, node.iterations, list(node.stores.values())
    if i in self.streamed:
      return list(self.streamed[i].values()), node.eqn.params["length"], []
    return None


def unordered_reads(program: Program, fetches: FetchClusters,
                     stores: dict[Any, PoolArray]) -> dict[Any, list]:
  """Per stored output: the fetches of the value it overwrites that its
  own computation does not depend on (an optimizer schedule reading the
  step count, say). Only those need an explicit order: the others are
  done before the new value exists."""
  old = {id(v): k for k, v in fetches.resident.items()}
  overwritten = {old[id(t)] for t in stores.values()}
  clusters = [c for c in fetches.clusters if c.key in overwritten]
  bit = {id(c): 1 << j for j, c in enumerate(clusters)}
  depends: dict[Any, int] = {}  # value -> bits of the reads it needs
  for i, node in enumerate(program.nodes):
    needs = 0
    for atom in node.ins:
      key = program.resolve(atom)
      if isinstance(key, Lit):
        continue
      needs |= depends.get(key, 0)
      c = fetches.cluster_at.get((key, i))
      if c is not None:
        needs |= bit.get(id(c), 0)
    for key in node.outs:
      depends[key] = needs
  out = {}
  for key, target in stores.items():
    missing = [c for c in clusters if c.key == old[id(target)]
               and not depends.get(key, 0) & bit[id(c)]]
    if missing:
      out[key] = missing
  return out


def shard_bytes(x: PoolArray) -> int:
  return int(np.prod(x.shard_shape)) * x.dtype.itemsize

