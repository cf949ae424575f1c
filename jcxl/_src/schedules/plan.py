"""Per-layer streaming plans: what to fetch, how far ahead, in what pieces.

A plan is chosen per "layer": the pool-resident leaves that a step uses
together (leaves under the same module path), in the order the step first
uses them. The schedules a step accepts:

* ``'fixed:k'``: every layer fetched k layers ahead (``'sync'`` is k = 0);
* ``'bucket'`` / ``'bucket:N'``: DeepSpeed ZeRO-3's rule, fetch ahead the
  following layers that fit in N parameter elements (its default 5e7);
* ``'plan:PATH'``: a plan saved by an earlier run (``Plan.save``);
* ``'dap'`` / ``'dap:PATH'``: Dynamic Adaptive Pipelining
  (``schedules/tuner.py``), optionally starting from a saved plan.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jcxl._src.schedules import costmodel
from jcxl._src.units import format_bytes

# DeepSpeed ZeRO-3's stage3_prefetch_bucket_size default, in elements.
DEEPSPEED_PREFETCH_BUCKET = 50_000_000


@dataclasses.dataclass(frozen=True)
class MadeFor:
  """What a plan was made for: the step's pool-resident leaves.

  Attributes:
    layer_names: the layers (module paths) they make up, sorted.
    leaves: how many there are.
    digest: a SHA-256 over each leaf's path, shape and dtype (16 hex
      digits): two steps with the same digest stream the same leaves.
  """
  layer_names: tuple[str, ...]
  leaves: int
  digest: str

  @classmethod
  def of(cls, leaves: Iterable[tuple[str, str, Sequence[int], Any]]
         ) -> MadeFor:
    """From (layer, path, shape, dtype) of each pool-resident leaf."""
    rows = sorted((layer, path, tuple(int(d) for d in shape), str(dtype))
                  for layer, path, shape, dtype in leaves)
    text = json.dumps([row[1:] for row in rows])
    return cls(tuple(sorted({row[0] for row in rows})), len(rows),
               hashlib.sha256(text.encode()).hexdigest()[:16])

  def describe(self) -> str:
    return (f"{len(self.layer_names)} layers, {self.leaves} pool-resident "
            f"leaves (fingerprint {self.digest})")


@dataclasses.dataclass(frozen=True)
class LayerSchedule:
  """A resolved schedule: a prefetch distance and chunk size per layer.

  `made_for` and `source` (a saved plan's step and file) say what the
  plan is for; they are not part of the plan's identity.
  """
  prefetch: tuple[tuple[str, int], ...] = ()
  chunk_bytes: tuple[tuple[str, int], ...] = ()
  default_prefetch: int = 0
  default_chunk_bytes: int = 0  # 0: the pool's default
  name: str = "per-layer"
  made_for: MadeFor | None = dataclasses.field(default=None, compare=False)
  source: str = dataclasses.field(default="", compare=False)

  @classmethod
  def of(cls, prefetch: Mapping[str, int],
         chunk_bytes: Mapping[str, int] | None = None,
         name: str = "per-layer") -> LayerSchedule:
    """A schedule of per-layer `prefetch` distances and `chunk_bytes`, by
    layer name."""
    return cls(tuple(sorted(prefetch.items())),
               tuple(sorted((chunk_bytes or {}).items())), name=name)

  def prefetch_for(self, layer: str) -> int:
    """How many layers ahead `layer`'s fetch is issued."""
    return dict(self.prefetch).get(layer, self.default_prefetch)

  def chunk_for(self, layer: str) -> int:
    """The chunk size, in bytes, of `layer`'s fetches."""
    return dict(self.chunk_bytes).get(layer, self.default_chunk_bytes)

  def resolve(self, segments: Sequence[costmodel.Segment],
              links: Mapping[str, costmodel.Link]) -> LayerSchedule:
    """The schedule to run for a step's layer timeline (`segments`) over
    `links`: this one, which is fixed."""
    del segments, links
    return self

  def __str__(self) -> str:
    return self.name


@dataclasses.dataclass(frozen=True)
class FixedSchedule:
  """The same prefetch distance (and chunk size) for every layer."""
  prefetch: int
  chunk_bytes: int = 0

  def resolve(self, segments, links) -> LayerSchedule:
    del segments, links
    return LayerSchedule(default_prefetch=self.prefetch,
                         default_chunk_bytes=self.chunk_bytes, name=str(self))

  def __str__(self) -> str:
    return f"fixed:{self.prefetch}"


@dataclasses.dataclass(frozen=True)
class BucketSchedule:
  """Prefetch the following layers that fit in a bucket of elements."""
  elements: int = DEEPSPEED_PREFETCH_BUCKET

  def resolve(self, segments, links) -> LayerSchedule:
    del links
    return LayerSchedule.of(costmodel.bucket_prefetch(segments, self.elements),
                            name=str(self))

  def __str__(self) -> str:
    return f"bucket:{self.elements:g}"


@dataclasses.dataclass(frozen=True)
class DapSchedule:
  """Dynamic Adaptive Pipelining; `start` is a saved plan to begin from."""
  start: LayerSchedule | None = None

  def __str__(self) -> str:
    return "dap"


Schedule = FixedSchedule | BucketSchedule | LayerSchedule | DapSchedule


def check_made_for(schedule: Schedule, step: MadeFor) -> None:
  """Refuses a saved plan (``'plan:PATH'``, ``'dap:PATH'``) made for a
  step whose pool-resident leaves differ from `step`'s.

  Raises:
    ValueError: naming the plan, both steps and the layers that differ; or
      the plan's file has no record of its step (an older format).
  """
  saved = schedule.start if isinstance(schedule, DapSchedule) else schedule
  if not isinstance(saved, LayerSchedule):
    return  # not a saved plan
  if saved.made_for is None:
    if saved.source:  # a file of the format before plans said what for
      raise ValueError(
          f"plan {saved.source!r} does not say which step it was made for "
          "(it has no 'made_for': the file predates that record), so it "
          "cannot be checked against this step; re-save it from the step it"
          " was made for (step.plan.save(path)) or plan afresh "
          "(schedule='dap')")
    return  # made in this process, not loaded from a file
  made_for = saved.made_for
  if made_for == step:
    return
  plan, here = set(made_for.layer_names), set(step.layer_names)
  differ = [f"layers the plan lacks: {sorted(here - plan)}"
            if here - plan else "",
            f"layers the step lacks: {sorted(plan - here)}"
            if plan - here else ""]
  differ = "; ".join(d for d in differ if d) or (
      "the same layers, with leaves of other paths, shapes or dtypes")
  raise ValueError(
      f"plan {saved.source or saved.name!r} was made for a step with "
      f"{made_for.describe()}, but this step has {step.describe()}: "
      f"{differ}. Plan this step afresh (schedule='dap') or load a plan "
      "saved from it")


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """How one layer's pool-resident leaves stream into the step.

  `refetch` and `keep_bytes` are about its weights whose uses are far apart
  (its backward pass after its forward pass): "kept" on the device in
  between, "refetched" for the later use, or "" where it has none;
  `keep_bytes` is their size, the device memory keeping them costs.
  """
  name: str           # the module path shared by the layer's leaves
  nbytes: int         # bytes of one device's shards of the layer's leaves
  tiers: tuple[str, ...]
  prefetch: int       # how many layers ahead its fetches are issued
  chunk_bytes: int    # copy-engine piece size (0: the pool's default)
  update: str = ""    # where its optimizer update runs: "host", "device"
                      # (or "" where the step writes none of its state)
  refetch: str = ""   # "kept", "refetched" or "" (see above)
  keep_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Plan:
  """The plan a cxl_offload step was compiled with.

  Attributes:
    layers: per layer, in the order the step first uses them.
    schedule: the schedule that chose it.
    predicted_step_s: the cost model's step time for it (None if unknown).
    reasons: why it was chosen (DAP's cost model and tuner), one line per decision.
    made_for: the step it was made for; a saved plan is refused by a step
      whose pool-resident leaves differ (names, shapes, dtypes, count).
    placement: per tier, the bytes of the leaves it holds by how often the
      step fetches them (see ``placement_lines``).
    updates: per layer whose state the step writes, where its optimizer
      update runs and why (``cxl_offload``'s `update`).
  """
  layers: tuple[LayerPlan, ...]
  schedule: str
  predicted_step_s: float | None = None
  reasons: tuple[str, ...] = ()
  made_for: MadeFor | None = None
  placement: tuple[str, ...] = ()
  updates: tuple[str, ...] = ()

  def layer(self, name: str) -> LayerPlan:
    """The `LayerPlan` of the layer named `name` (KeyError if none)."""
    for layer in self.layers:
      if layer.name == name:
        return layer
    raise KeyError(f"no layer {name!r} in the plan; layers: "
                   f"{[l.name for l in self.layers]}")

  def table(self) -> str:
    """One row per layer, its whole name (names often differ only at the
    end: a block's four attention projections)."""
    width = max([len("layer")] + [len(l.name) for l in self.layers])
    rows = [f"{'layer':{width}s} {'bytes':>12s} {'tier':8s} {'prefetch':>8s} "
            f"{'chunk':>10s} {'update':>6s} {'weights':>9s}"]
    for l in self.layers:
      chunk = format_bytes(l.chunk_bytes) if l.chunk_bytes else "pool"
      rows.append(f"{l.name:{width}s} {format_bytes(l.nbytes):>12s} "
                  f"{','.join(l.tiers):8s} {l.prefetch:8d} {chunk:>10s} "
                  f"{l.update or '-':>6s} {l.refetch or '-':>9s}")
    return "\n".join(rows)

  def __str__(self) -> str:
    head = f"plan ({self.schedule})"
    if self.predicted_step_s is not None:
      head += f", predicted step {self.predicted_step_s * 1e3:.2f} ms"
    why = "".join(f"\n  {r}" for r in self.reasons)
    where = "".join(f"\n  {p}" for p in self.placement)
    updates = "".join(f"\n  {u}" for u in self.updates)
    return (f"{head}:\n{self.table()}" + (f"\nwhy:{why}" if why else "") +
            (f"\nplacement:{where}" if where else "") +
            (f"\nupdates:{updates}" if updates else ""))

  def as_schedule(self, source: str = "") -> LayerSchedule:
    """This plan's distances and chunks, to compile a step with (the
    plan's `source` file, for errors)."""
    return dataclasses.replace(
        LayerSchedule.of({l.name: l.prefetch for l in self.layers},
                         {l.name: l.chunk_bytes for l in self.layers},
                         name=f"plan({self.schedule})"),
        made_for=self.made_for, source=source)

  def to_json(self) -> dict[str, Any]:
    """The plan as a dict of JSON values (`from_json` reads it)."""
    return {"schedule": self.schedule,
            "predicted_step_s": self.predicted_step_s,
            "reasons": list(self.reasons),
            "placement": list(self.placement),
            "updates": list(self.updates),
            "layers": [dataclasses.asdict(l) for l in self.layers],
            "made_for": (dataclasses.asdict(self.made_for)
                         if self.made_for else None)}

  @classmethod
  def from_json(cls, data: Mapping[str, Any]) -> Plan:
    """A plan from the dict `to_json` made (ValueError if it is not one)."""
    try:
      layers = tuple(LayerPlan(**{**l, "tiers": tuple(l["tiers"])})
                     for l in data["layers"])
      made_for = data.get("made_for")
      if made_for is not None:
        made_for = MadeFor(tuple(made_for["layer_names"]),
                           int(made_for["leaves"]), str(made_for["digest"]))
      return cls(layers, str(data["schedule"]), data.get("predicted_step_s"),
                 tuple(data.get("reasons", ())), made_for,
                 tuple(data.get("placement", ())),
                 tuple(data.get("updates", ())))
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"not a jcxl plan: {e!r}") from None

  def save(self, path: str) -> None:
    """Writes the plan to `path` as JSON (`Plan.load` reads it back;
    ``schedule="plan:<path>"`` runs it)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(self.to_json(), f, indent=2)
    os.replace(tmp, path)  # a reader never sees half a plan

  @classmethod
  def load(cls, path: str) -> Plan:
    """Reads a plan file (``Plan.save``): a regular file of at most
    ``MAX_PLAN_BYTES``.

    Raises:
      ValueError: `path` cannot be read, is not a regular file (a FIFO or
        a device would never end), is larger than ``MAX_PLAN_BYTES``, or
        does not hold a plan.
    """
    text = _read_plan_file(path)
    try:
      data = json.loads(text.decode("utf-8"))
    except UnicodeDecodeError as e:
      raise ValueError(f"plan {path!r} is not UTF-8 text: {e}") from None
    except json.JSONDecodeError as e:
      raise ValueError(f"plan {path!r} is not JSON: {e}") from None
    return cls.from_json(data)


# A plan is a few KiB per hundred layers; anything this large is not one.
MAX_PLAN_BYTES = 64 << 20


def _read_plan_file(path: str) -> bytes:
  """The bytes of the plan file at `path`, refusing what is not one before
  reading it."""
  try:
    # O_NONBLOCK: opening a FIFO with no writer would otherwise wait forever.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
  except OSError as e:
    raise ValueError(f"cannot read plan {path!r}: {e.strerror}") from None
  try:
    info = os.fstat(fd)  # the file opened, not whatever the path is now
    if not stat.S_ISREG(info.st_mode):
      raise ValueError(
          f"plan {path!r} is not a regular file (it is a "
          f"{_file_kind(info.st_mode)}); pass the path of a file written by "
          "Plan.save")
    if info.st_size > MAX_PLAN_BYTES:
      raise ValueError(
          f"plan {path!r} is {info.st_size} bytes, larger than a plan file "
          f"may be ({format_bytes(MAX_PLAN_BYTES)}); it is not a plan "
          "written by Plan.save")
    os.set_blocking(fd, True)
    chunks, size = [], 0
    while size <= MAX_PLAN_BYTES:  # (a file still growing stops here too)
      chunk = os.read(fd, min(1 << 20, MAX_PLAN_BYTES + 1 - size))
      if not chunk:
        break
      chunks.append(chunk)
      size += len(chunk)
  except OSError as e:
    raise ValueError(f"cannot read plan {path!r}: {e.strerror}") from None
  finally:
    os.close(fd)
  if size > MAX_PLAN_BYTES:
    raise ValueError(
        f"plan {path!r} grew past {format_bytes(MAX_PLAN_BYTES)} while it "
        "was read, more than a plan file may hold")
  return b"".join(chunks)


def _file_kind(mode: int) -> str:
  for test, kind in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                     (stat.S_ISCHR, "character device"),
                     (stat.S_ISBLK, "block device"),
                     (stat.S_ISSOCK, "socket")):
    if test(mode):
      return kind
  return "special file"


def placement_lines(leaves: Sequence[tuple[str, int, int]]
                    ) -> tuple[str, ...]:
  """One line per tier: its bytes by how many times a step fetches them.

  Args:
    leaves: ``(tier, bytes, fetches per step)`` of each pool-resident leaf.
  """
  by_tier: dict[str, dict[int, int]] = {}
  for tier, nbytes, reads in leaves:
    counts = by_tier.setdefault(tier, {})
    counts[reads] = counts.get(reads, 0) + nbytes
  order = {"host": 0, "cxl": 1, "nvme": 2}
  return tuple(
      f"{tier}: " + ", ".join(
          f"{format_bytes(n)} fetched {r}x per step"
          for r, n in sorted(by_tier[tier].items(), reverse=True))
      for tier in sorted(by_tier, key=lambda t: order.get(t, 3)))


_GRAMMAR = ("schedule must be 'fixed:k' (k >= 0: prefetch distance in "
            "layers), 'sync', 'bucket' or 'bucket:N' (N parameter elements), "
            "'plan:PATH', 'dap' or 'dap:PATH'")


def parse_schedule(schedule: str | Schedule) -> Schedule:
  """Parses a schedule string (see the module docstring)."""
  if isinstance(schedule, (FixedSchedule, BucketSchedule, LayerSchedule,
                           DapSchedule)):
    return schedule
  if not isinstance(schedule, str):
    raise ValueError(f"{_GRAMMAR}, but got {schedule!r}")
  if schedule in ("sync", "bucket", "dap"):
    return {"sync": FixedSchedule(0), "bucket": BucketSchedule(),
            "dap": DapSchedule()}[schedule]
  kind, _, arg = schedule.partition(":")
  if kind == "fixed" and re.fullmatch(r"\d{1,9}", arg):
    return FixedSchedule(int(arg))
  if kind == "bucket":
    try:
      elements = float(arg)
    except ValueError:
      elements = -1
    # (inf and nan fail the comparison; 2**63 elements is past any model)
    if 1 <= elements < 2**63 and elements == int(elements):
      return BucketSchedule(int(elements))
  if kind == "plan" and arg:
    return Plan.load(arg).as_schedule(source=arg)
  if kind == "dap" and arg:
    return DapSchedule(Plan.load(arg).as_schedule(source=arg))
  raise ValueError(f"{_GRAMMAR}, but got {schedule!r}")
