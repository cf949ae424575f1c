"""The cost model behind adaptive schedules: a step as a timeline of layer
segments, a simulator of the device and the links, and the search for a
schedule (`choose_schedule`).

A step is cut at its layer boundaries (where a layer's pool-resident leaves
are needed) into ``Segment``s: the fetch that must finish before the
segment starts and the compute that follows until the next boundary. The
simulator replays the step the way the runtime runs it: fetches are issued
``prefetch`` segments of their sequence ahead, each link moves one chunk at
a time, most urgent request first (the copy engine's rule), and the device
stalls when it reaches a segment whose bytes are not there yet. It also
counts the prefetched bytes live at every point, which is what a deeper
prefetch costs in device memory.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jcxl._src.units import format_bytes

# What `choose_schedule` may choose per layer. Chunks below the pool's default
# (4 MiB) measured slower here (per-chunk costs the model does not have).
MAX_PREFETCH = 8
MIN_CHUNK = 4 << 20
MAX_CHUNK = 64 << 20
# A deeper prefetch must buy at least this fraction of the step time.
_MIN_GAIN = 0.002
# Stores a step keeps in flight before it waits for the oldest (the
# runtime's rule, simulated as such).
STORES_IN_FLIGHT = 2


@dataclasses.dataclass(frozen=True)
class Segment:
  """The stretch of a step from one layer boundary to the next.

  Attributes:
    name: the layer (module path) whose leaves are fetched at its start.
    nbytes: bytes fetched (one device's shards); 0 for a segment that only
      computes (the step's start).
    tier: the pool tier the bytes come from.
    compute_s: device time from this boundary to the next.
    sequence: segments of one sequence prefetch each other: 0 is the step's
      own layer order, other values one streamed loop over stacked layers.
    priority: the copy engine's priority of its fetch (lower: sooner).
    stores: sizes of the objects written back at the segment's end.
    stores_wait: whether the step waits for those stores right away (a
      loop over stacked layers does); otherwise up to STORES_IN_FLIGHT
      stay in flight.
    elements: array elements fetched (for element-counted buckets).
  """
  name: str
  nbytes: int
  tier: str
  compute_s: float
  sequence: int = 0
  priority: int = 0
  stores: tuple[int, ...] = ()
  stores_wait: bool = False
  elements: int = 0


@dataclasses.dataclass(frozen=True)
class Link:
  """A tier's link as the cost model sees it.

  Attributes:
    bandwidth: bytes per second.
    latency_s: delay of each transfer that does not hold the link (the
      next transfer moves meanwhile).
    hold_s: time each chunk holds the link beyond its bytes: the copy
      engine's own work per transfer (waking a copy thread, handing the
      bytes over), where its threads share the host's cores with the
      compute (XLA:CPU) and so cannot overlap it with the next one.
  """
  bandwidth: float
  latency_s: float = 0.0
  hold_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Prediction:
  """What the simulator expects of one plan."""
  step_s: float
  stall_s: tuple[float, ...]     # per segment: device waiting for its bytes
  peak_prefetch_bytes: int       # most prefetched bytes live at once

  @property
  def total_stall_s(self) -> float:
    """Seconds the step is predicted to wait on fetches in all."""
    return sum(self.stall_s)

  def stall_by_layer(self, segments: Sequence[Segment]) -> dict[str, float]:
    """Seconds the step is predicted to wait on each layer's fetches, by layer
    name."""
    out: dict[str, float] = {}
    for seg, stall in zip(segments, self.stall_s):
      out[seg.name] = out.get(seg.name, 0.0) + stall
    return out


def issue_points(segments: Sequence[Segment],
                 prefetch: Mapping[str, int]) -> list[int]:
  """For each segment, the segment at whose start its fetch is issued."""
  positions: dict[int, list[int]] = {}
  out = []
  for g, seg in enumerate(segments):
    seen = positions.setdefault(seg.sequence, [])
    seen.append(g)
    k = prefetch.get(seg.name, 0)
    out.append(seen[max(0, len(seen) - 1 - k)])
  return out


def peak_prefetch_bytes(segments: Sequence[Segment],
                        prefetch: Mapping[str, int]) -> int:
  """The most bytes fetched ahead of their segment that are live at once."""
  delta = [0] * (len(segments) + 1)
  for g, at in enumerate(issue_points(segments, prefetch)):
    if at < g:  # live from its issue point until its own segment starts
      delta[at] += segments[g].nbytes
      delta[g] -= segments[g].nbytes
  live = peak = 0
  for d in delta:
    live += d
    peak = max(peak, live)
  return peak


class _LinkQueue:
  """One tier's link: moves queued requests a chunk at a time, most urgent
  (lowest priority, then oldest) first."""

  def __init__(self, link: Link):
    self.link = link
    self.time = 0.0
    self.queue: list[tuple[int, int, int]] = []  # (priority, order, id)
    self.left: dict[int, int] = {}
    self.chunk: dict[int, int] = {}
    self.done: dict[int, float] = {}

  def add(self, rid: int, nbytes: int, priority: int, chunk: int,
          now: float) -> None:
    self.run(until=now)
    self.time = max(self.time, now)
    self.left[rid] = nbytes
    self.chunk[rid] = chunk if chunk > 0 else nbytes
    heapq.heappush(self.queue, (priority, rid, rid))

  def run(self, until: float = math.inf, target: int | None = None) -> None:
    """Moves chunks that start before `until`, or until `target` is done."""
    while self.queue and (target is None or target not in self.done):
      if self.time >= until:
        return
      _, _, rid = self.queue[0]
      piece = min(self.left[rid], max(1, self.chunk[rid]))
      self.time += piece / self.link.bandwidth + self.link.hold_s
      self.left[rid] -= piece
      if self.left[rid] == 0:
        heapq.heappop(self.queue)
        self.done[rid] = self.time + self.link.latency_s


def simulate(segments: Sequence[Segment], prefetch: Mapping[str, int],
             links: Mapping[str, Link],
             chunk_bytes: Mapping[str, int] | None = None) -> Prediction:
  """Replays one step under a plan; see the module docstring."""
  chunk_bytes = chunk_bytes or {}
  issue_at = issue_points(segments, prefetch)
  issued_by: dict[int, list[int]] = {}
  for g, at in enumerate(issue_at):
    if segments[g].nbytes:
      issued_by.setdefault(at, []).append(g)
  queues = {tier: _LinkQueue(link) for tier, link in links.items()}

  def queue(tier: str) -> _LinkQueue:
    if tier not in queues:
      raise KeyError(f"no link for tier {tier!r}; links: {sorted(links)}")
    return queues[tier]

  t = 0.0
  stalls = []
  stores: list[tuple[str, int]] = []  # in flight, oldest first
  next_store = len(segments)

  def wait_store(tier: str, rid: int) -> float:
    queues[tier].run(target=rid)
    return queues[tier].done[rid]

  for s, seg in enumerate(segments):
    for g in issued_by.get(s, ()):
      other = segments[g]
      queue(other.tier).add(g, other.nbytes, other.priority,
                            chunk_bytes.get(other.name, 0), t)
    stall = 0.0
    if seg.nbytes:
      q = queue(seg.tier)
      q.run(target=s)
      stall = max(0.0, q.done[s] - t)
      t = max(t, q.done[s])
    t += seg.compute_s
    for nbytes in seg.stores:
      queue(seg.tier).add(next_store, nbytes, 0, 0, t)
      stores.append((seg.tier, next_store))
      next_store += 1
      limit = 0 if seg.stores_wait else STORES_IN_FLIGHT
      while len(stores) > limit:
        done = wait_store(*stores.pop(0))
        stall += max(0.0, done - t)
        t = max(t, done)
    stalls.append(stall)
  end = t
  for tier, rid in stores:
    end = max(end, wait_store(tier, rid))
  return Prediction(step_s=end, stall_s=tuple(stalls),
                    peak_prefetch_bytes=peak_prefetch_bytes(segments, prefetch))


@dataclasses.dataclass(frozen=True)
class Choice:
  """`choose_schedule`'s answer: per-layer distances and chunks, and why."""
  prefetch: dict[str, int]
  chunk_bytes: dict[str, int]
  prediction: Prediction
  reasons: tuple[str, ...]


def choose_chunks(segments: Sequence[Segment],
                  links: Mapping[str, Link]) -> dict[str, int]:
  """Per layer, the largest chunk (at least MIN_CHUNK) behind which an
  urgent fetch waits at most a quarter of the shortest compute segment
  (chunks are never preempted); 0 (the pool's default) where the whole
  fetch is that short already."""
  computes = [s.compute_s for s in segments if s.compute_s > 0]
  if not computes:
    return {}
  budget_s = 0.25 * min(computes)
  out = {}
  for seg in segments:
    if not seg.nbytes:
      continue
    limit = links[seg.tier].bandwidth * budget_s
    if seg.nbytes <= max(limit, MIN_CHUNK):
      out.setdefault(seg.name, 0)
      continue
    chunk = 1 << int(math.log2(max(limit, 1)))
    chunk = min(MAX_CHUNK, max(MIN_CHUNK, chunk))
    out[seg.name] = min(out.get(seg.name) or MAX_CHUNK, chunk)
  return out


def choose_schedule(segments: Sequence[Segment], links: Mapping[str, Link],
                    *, prefetch_budget: int | None = None,
                    max_prefetch: int = MAX_PREFETCH,
                    start: Mapping[str, int] | None = None) -> Choice:
  """Chooses a prefetch distance per layer that minimizes the simulated
  step time while the prefetched bytes live at once stay within
  `prefetch_budget` (None: no limit).

  Greedy: from `start` (default 0 everywhere), repeatedly deepen the layer
  whose deeper prefetch shortens the step most, while that fits; then
  shallow each layer back as far as the step time does not grow, so no
  layer holds device memory it does not need. The same from every layer k
  ahead (k = 1, 2, 4, .. `max_prefetch`): one layer deeper at a time finds no
  gain where only deepening many together pays (a link-bound step whose
  link idles at its start). The fastest wins; `start`'s unless another is
  faster by more than a rounding.
  """
  names = list(dict.fromkeys(s.name for s in segments if s.nbytes))
  best = _greedy(segments, links, prefetch_budget, max_prefetch, start)
  for k in _uniform_starts(max_prefetch):
    choice = _greedy(segments, links, prefetch_budget, max_prefetch,
                     {n: k for n in names})
    if choice.prediction.step_s < best.prediction.step_s * (1 - _MIN_GAIN):
      best = dataclasses.replace(choice, reasons=(
          f"from every layer {k} ahead",) + choice.reasons)
  return best


def _uniform_starts(max_prefetch: int) -> list[int]:
  """1, 2, 4, ... up to `max_prefetch` (and it): the greedy search goes on
  from there, and each start costs a whole search (about 0.15 s on
  GPT-2's 186 segments)."""
  ks = []
  k = 1
  while k < max_prefetch:
    ks.append(k)
    k *= 2
  return ks + [max_prefetch] if max_prefetch > 0 else []


def _greedy(segments: Sequence[Segment], links: Mapping[str, Link],
            prefetch_budget: int | None, max_prefetch: int,
            start: Mapping[str, int] | None) -> Choice:
  """`choose_schedule`'s greedy search from one start."""
  names = list(dict.fromkeys(s.name for s in segments if s.nbytes))
  # A fetch cannot be issued before the first segment of its sequence
  # (the step's start, or a streamed loop's first iteration).
  sequence_length: dict[int, int] = {}
  for s in segments:
    sequence_length[s.sequence] = sequence_length.get(s.sequence, 0) + 1
  lengths: dict[str, int] = {}
  for s in segments:
    if s.nbytes:
      lengths[s.name] = max(lengths.get(s.name, 0),
                            sequence_length[s.sequence] - 1)
  chunks = choose_chunks(segments, links)
  prefetch = {n: min((start or {}).get(n, 0), max_prefetch) for n in names}

  def fits(p):
    return (prefetch_budget is None or
            peak_prefetch_bytes(segments, p) <= prefetch_budget)

  while not fits(prefetch):  # a start that no longer fits: shallow it
    deepest = max(prefetch, key=prefetch.get)
    if prefetch[deepest] == 0:
      break
    prefetch[deepest] -= 1
  best = simulate(segments, prefetch, links, chunks)
  reasons = []
  while True:
    stall = best.stall_by_layer(segments)
    trial = None
    for name in sorted(names, key=lambda n: -stall.get(n, 0.0)):
      if stall.get(name, 0.0) <= 0 or prefetch[name] >= min(
          max_prefetch, lengths[name]):
        continue
      p = dict(prefetch, **{name: prefetch[name] + 1})
      if not fits(p):
        continue
      pred = simulate(segments, p, links, chunks)
      if trial is None or pred.step_s < trial[1].step_s:
        trial = (p, pred, name)
    if trial is None or trial[1].step_s > best.step_s * (1 - _MIN_GAIN):
      break
    prefetch, best = trial[0], trial[1]
    reasons.append(
        f"{trial[2]}: prefetch {prefetch[trial[2]]} (stall "
        f"{stall[trial[2]] * 1e3:.2f} ms -> "
        f"{best.stall_by_layer(segments).get(trial[2], 0) * 1e3:.2f} ms)")
  for name in names:
    while prefetch[name] > 0:
      p = dict(prefetch, **{name: prefetch[name] - 1})
      pred = simulate(segments, p, links, chunks)
      if pred.step_s > best.step_s * (1 + _MIN_GAIN / 4):
        break
      prefetch, best = p, pred
  if not reasons:
    reasons.append("no deeper prefetch shortens the step "
                   + ("within the budget" if prefetch_budget is not None
                      else "(transfers already hidden)"))
  if prefetch_budget is not None:
    reasons.append(f"prefetched bytes live at once: "
                   f"{format_bytes(best.peak_prefetch_bytes)} of "
                   f"{format_bytes(prefetch_budget)} allowed")
  return Choice(prefetch, chunks, best, tuple(reasons))


def bucket_prefetch(segments: Sequence[Segment],
                    bucket_elements: int) -> dict[str, int]:
  """DeepSpeed ZeRO-3's rule: fetch ahead as many following layers as fit
  in a bucket of `bucket_elements` parameter elements."""
  out: dict[str, int] = {}
  by_sequence: dict[int, list[Segment]] = {}
  for s in segments:
    if s.nbytes:
      by_sequence.setdefault(s.sequence, []).append(s)
  for seq in by_sequence.values():
    for p, seg in enumerate(seq):
      if seg.name in out:
        continue
      k, total = 0, 0
      for later in seq[p + 1:]:
        total += later.elements
        if total > bucket_elements:
          break
        k += 1
      out[seg.name] = k
  # A layer is fetched k ahead of itself: turn "what follows me" into
  # "how far ahead am I fetched" by taking, for each layer, the distance
  # of the bucket that covers it.
  covered: dict[str, int] = {}
  for seq in by_sequence.values():
    for p, seg in enumerate(seq):
      for q in range(p + 1, min(len(seq), p + 1 + out[seg.name])):
        name = seq[q].name
        covered[name] = max(covered.get(name, 0), q - p)
  return {name: covered.get(name, 0) for name in out}


def choose_tiers(layer_bytes: Mapping[str, int],
                 hide_s: Mapping[str, float],
                 tiers: Sequence[tuple[str, Link, int]]) -> dict[str, str]:
  """Which tier each layer's objects should sit in.

  `tiers` is (name, link, capacity in bytes), fastest first. Layers with
  the least compute to hide their transfer behind (per byte) go to the
  fastest tier while it has room; the rest follow in order.
  """
  order = sorted(layer_bytes, key=lambda n: hide_s.get(n, 0.0) /
                 max(1, layer_bytes[n]))
  room = [cap for _, _, cap in tiers]
  out = {}
  for name in order:
    for i, (tier, _, _) in enumerate(tiers):
      if layer_bytes[name] <= room[i]:
        room[i] -= layer_bytes[name]
        out[name] = tier
        break
    else:
      raise MemoryError(
          f"layer {name} ({format_bytes(layer_bytes[name])}) fits in no "
          f"tier; room left: " + ", ".join(
              f"{t} {format_bytes(r)}" for (t, _, _), r in zip(tiers, room)))
  return out


def device_need(analysis: Any) -> int:
  """Device bytes a compiled step needs, from its ``memory_analysis()``:
  temporaries, arguments and outputs, less what outputs alias (what
  `device_budget` is checked against)."""
  m = analysis
  return int(m.temp_size_in_bytes + m.argument_size_in_bytes +
             m.output_size_in_bytes - m.alias_size_in_bytes)
