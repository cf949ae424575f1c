"""Measurement of offloaded steps: per layer transfer, compute and stall
time, from the copy engine's records and the waits of each ``done`` call.

Every ``done`` the step runs logs when the device reached it, how long it
waited, and the copy's own record (queued, started, finished). Fetch
``done``s mark layer boundaries: the time from one boundary (once its
bytes are there) to the next is that layer's compute, the time spent
waiting in it is a stall. Logging is always on in the C++ core (a few
hundred nanoseconds a transfer); draining and analysing the log is done
only for the steps a caller measures.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jcxl._src.schedules import costmodel
from jcxl._src.pool import TransferRecord


@dataclasses.dataclass(frozen=True)
class Wait:
  """One ``done`` call: the copy's record and the device's wait for it."""
  record: TransferRecord
  started_ns: int  # when the step reached the done
  wait_ns: int

  @property
  def ended_ns(self) -> int:
    return self.started_ns + self.wait_ns


def waits_from_raw(raw: Sequence[Any]) -> list[Wait]:
  return [Wait(TransferRecord.from_engine(w.record), w.wait_started_ns,
               w.wait_ns) for w in raw]


@dataclasses.dataclass(frozen=True)
class LayerProfile:
  """One layer's share of the measured steps (per step).

  Example:
    >>> for layer in step.last_profile.layers:
    ...   print(layer.name, layer.stall_s, layer.bandwidth)
  """
  name: str
  bytes_fetched: int
  bytes_stored: int
  transfer_s: float  # copy time of its fetches, engine start to finish
  stall_s: float     # time the step waited for its transfers
  compute_s: float   # device time from its boundaries to the next ones
  transfers: int

  @property
  def bandwidth(self) -> float:
    """Bytes per second of this layer's fetches (0.0 where none were
    timed)."""
    return self.bytes_fetched / self.transfer_s if self.transfer_s else 0.0


@dataclasses.dataclass(frozen=True)
class StepProfile:
  """What one measured step did.

  Example:
    >>> (state, loss), profile = step.measured_call(state, batch)
    >>> profile.step_s, profile.stall_s, profile.bytes_by_tier

  Attributes:
    step_s: wall time of the step, call to results ready.
    layers: per layer, in the order of the step's first boundary there.
    segment_compute_s: measured compute of each segment of the step's
      timeline (None where the waits did not match it).
    bytes_by_tier: bytes moved per tier (both directions).
    bandwidth_by_tier: bytes over the time the tier's link was busy.
    segment_overlap_bytes: per segment (None likewise), the bytes the
      copy engine moved while that segment computed (each transfer's bytes
      spread evenly over its run): where copies share the device's cores
      (XLA:CPU), they slow its compute.
  """
  step_s: float
  layers: tuple[LayerProfile, ...]
  segment_compute_s: tuple[float, ...] | None
  bytes_by_tier: dict[str, int]
  bandwidth_by_tier: dict[str, float]
  segment_overlap_bytes: tuple[float, ...] | None = None

  @property
  def stall_s(self) -> float:
    """Seconds the step waited on the pool's copies (fetches and stores)."""
    return sum(l.stall_s for l in self.layers)

  @property
  def stall_fraction(self) -> float:
    """The share of the step spent waiting on the pool's copies."""
    return self.stall_s / self.step_s if self.step_s else 0.0

  def table(self) -> str:
    """One row per layer, its whole name (as `Plan.table`)."""
    width = max([len("layer")] + [len(l.name) for l in self.layers])
    rows = [f"{'layer':{width}s} {'fetched':>10s} {'stored':>10s} "
            f"{'transfer':>10s} {'compute':>10s} {'stall':>10s}"]
    for l in self.layers:
      rows.append(f"{l.name:{width}s} {l.bytes_fetched:10d} "
                  f"{l.bytes_stored:10d} {l.transfer_s * 1e3:8.2f}ms "
                  f"{l.compute_s * 1e3:8.2f}ms {l.stall_s * 1e3:8.2f}ms")
    rows.append(f"step {self.step_s * 1e3:.2f} ms, stall "
                f"{self.stall_fraction:.1%}")
    return "\n".join(rows)


def _busy_seconds(intervals: list[tuple[int, int]]) -> float:
  """Length of the union of [start, end) intervals, in seconds."""
  total, end = 0, None
  for a, b in sorted(intervals):
    if end is None or a > end:
      total += b - a
      end = b
    elif b > end:
      total += b - end
      end = b
  return total * 1e-9


def _bytes_moved_by(records: Sequence[TransferRecord],
                    times_ns: Sequence[int]) -> np.ndarray:
  """For each time, the bytes `records` had moved by then, each record's
  bytes spread evenly over its run."""
  if not records:
    return np.zeros(len(times_ns))
  start = np.array([r.started_ns for r in records], np.float64)
  run = np.maximum(np.array([r.finished_ns for r in records], np.float64)
                   - start, 1.0)
  nbytes = np.array([r.nbytes for r in records], np.float64)
  t = np.asarray(times_ns, np.float64)[:, None]
  return np.clip((t - start) / run, 0.0, 1.0) @ nbytes


def _match_segments(fetches: list[Wait], layer_of: Mapping[int, str],
                    segments: Sequence[costmodel.Segment]
                    ) -> list[int] | None:
  """Assigns each fetch wait to a timeline segment: a layer's waits, in
  time order, fill that layer's segments in step order, by bytes (XLA may
  interleave different layers' work, never one layer's uses). None where
  the two disagree."""
  own: dict[str, list[int]] = {}
  for g, seg in enumerate(segments):
    if seg.nbytes:
      own.setdefault(seg.name, []).append(g)
  at = {name: [0, 0] for name in own}  # next segment, bytes filled in it
  out = []
  for w in fetches:
    name = layer_of[w.record.handle]
    if name not in own:
      return None
    mine, cursor = own[name], at[name]
    while cursor[0] < len(mine) and cursor[1] >= segments[
        mine[cursor[0]]].nbytes:
      cursor[0], cursor[1] = cursor[0] + 1, 0
    if cursor[0] == len(mine):
      return None
    out.append(mine[cursor[0]])
    cursor[1] += w.record.nbytes
  return out


def profile_step(waits: Sequence[Wait], layer_of: Mapping[int, str],
                 window_ns: tuple[int, int],
                 segments: Sequence[costmodel.Segment] = ()) -> StepProfile:
  """Measures one step from the waits logged while it ran.

  Args:
    waits: the ``done`` waits drained after the step, any order.
    layer_of: handle -> layer name, for the handles of one device (waits
      of other handles are ignored).
    window_ns: when the step was called and when its results were ready.
    segments: the step's timeline, to measure each segment's compute.
  """
  t0, t1 = window_ns
  mine = sorted((w for w in waits if w.record.handle in layer_of
                 and t0 <= w.started_ns <= t1), key=lambda w: w.started_ns)
  fetches = [w for w in mine if not w.record.to_pool]
  order = list(dict.fromkeys(layer_of[w.record.handle] for w in mine))
  stats = {n: dict(bytes_fetched=0, bytes_stored=0, transfer_s=0.0,
                   stall_s=0.0, compute_s=0.0, transfers=0) for n in order}
  tiers: dict[str, list] = {}
  covered = t0  # waits may overlap (XLA:CPU runs independent ops at once)
  for w in mine:
    s = stats[layer_of[w.record.handle]]
    r = w.record
    s["bytes_stored" if r.to_pool else "bytes_fetched"] += r.nbytes
    if not r.to_pool:
      s["transfer_s"] += r.seconds
    s["stall_s"] += max(0, w.ended_ns - max(w.started_ns, covered)) * 1e-9
    covered = max(covered, w.ended_ns)
    s["transfers"] += 1
    entry = tiers.setdefault(r.tier.value, [0, []])
    entry[0] += r.nbytes
    entry[1].append((r.started_ns, r.finished_ns))
  # A layer computes from the end of a boundary's waits to the next
  # boundary (the last one until the step is done), less the time it
  # waited for stores in between.
  ends = [w.started_ns for w in fetches[1:]] + [t1]
  busy = [max(0, end - w.ended_ns) * 1e-9 for w, end in zip(fetches, ends)]
  starts = [w.started_ns for w in fetches]
  stores = [w for w in mine if w.record.to_pool]
  # Bytes moved by each time that bounds a compute stretch or a wait.
  marks = [t0, t1] + [t for w in mine for t in (w.started_ns, w.ended_ns)]
  moved_by = dict(zip(marks, _bytes_moved_by([w.record for w in mine],
                                             marks)))
  within = lambda a, b: max(0.0, moved_by[b] - moved_by[a])
  moved = [within(w.ended_ns, end) for w, end in zip(fetches, ends)]
  for w in stores:
    at = bisect.bisect_right(starts, w.started_ns) - 1
    if at >= 0:
      busy[at] = max(0.0, busy[at] - w.wait_ns * 1e-9)
      moved[at] = max(0.0, moved[at] - within(w.started_ns, w.ended_ns))
  for w, seconds in zip(fetches, busy):
    stats[layer_of[w.record.handle]]["compute_s"] += seconds
  segment_compute = segment_overlap = None
  assigned = _match_segments(fetches, layer_of, segments) if segments else None
  if assigned is not None and fetches:
    compute = [0.0] * len(segments)
    overlap = [0.0] * len(segments)
    # Before the first boundary: the step's start (dispatch, any compute
    # that needs no pool bytes), charged to the first segment.
    compute[0] += (fetches[0].started_ns - t0) * 1e-9
    overlap[0] += within(t0, fetches[0].started_ns)
    for g, seconds, nbytes in zip(assigned, busy, moved):
      compute[g] += seconds
      overlap[g] += nbytes
    segment_compute, segment_overlap = tuple(compute), tuple(overlap)
  return StepProfile(
      step_s=(t1 - t0) * 1e-9,
      layers=tuple(LayerProfile(name=n, **stats[n]) for n in order),
      segment_compute_s=segment_compute,
      segment_overlap_bytes=segment_overlap,
      bytes_by_tier={t: v[0] for t, v in tiers.items()},
      bandwidth_by_tier={t: v[0] / max(_busy_seconds(v[1]), 1e-9)
                         for t, v in tiers.items()})
