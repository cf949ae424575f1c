"""Timing helpers and baselines for jcxl's benchmarks.

A benchmark is only as honest as its baselines. This module measures the
pool's transfers next to what the machine can do without it, in the same run:

* a plain single-threaded memcpy (``np.copyto``) of the same bytes into a
  destination whose pages are already touched;
* a sequential O_DIRECT read of a file in the same directory with
  ``dd iflag=direct`` (queue depth 1, 1 MiB blocks);

and describes the machine (cores, memory, the disk under a directory, load)
for report headers.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import logging
import os
import re
import subprocess
import time
from typing import Any, Callable

import numpy as np

from jcxl.units import format_bytes

logger = logging.getLogger(__name__)

PAGE_BYTES = 4096


# ------------------------------------------------------------------ timing


@dataclasses.dataclass(frozen=True)
class Timing:
  """Seconds taken by every repetition of moving `nbytes` bytes."""
  nbytes: int
  seconds: tuple[float, ...]

  def __post_init__(self):
    if not self.seconds:
      raise ValueError("a Timing needs at least one repetition")

  @property
  def best_s(self) -> float:
    return min(self.seconds)

  @property
  def bandwidth(self) -> float:
    """Bytes per second of the best repetition."""
    return self.nbytes / max(self.best_s, 1e-12)

  @property
  def gbps(self) -> float:
    """Decimal GB/s of the best repetition."""
    return self.bandwidth / 1e9

  def to_json(self) -> dict[str, Any]:
    return {"bytes": self.nbytes, "seconds": list(self.seconds),
            "best_s": self.best_s, "gbps": self.gbps}


def wall_time(fn: Callable[[], Any]) -> float:
  """Seconds that one call of `fn` takes on the monotonic clock."""
  start = time.perf_counter_ns()
  fn()
  return (time.perf_counter_ns() - start) * 1e-9


def best_of(fn: Callable[[], Any], *, nbytes: int, repeats: int) -> Timing:
  """Times `repeats` calls of `fn`, each moving `nbytes` bytes."""
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats!r}")
  return Timing(nbytes, tuple(wall_time(fn) for _ in range(repeats)))


def interleaved(fns: collections.abc.Mapping[str, Callable[[], Any]], *,
                nbytes: int, repeats: int,
                self_timed: collections.abc.Collection[str] = ()
                ) -> dict[str, Timing]:
  """Times several ways of moving the same bytes, taking turns.

  Each repetition runs every function once, in a rotated order, so that a
  burst of load from elsewhere on the machine hits all sides alike rather
  than one side's whole series.

  Args:
    fns: what to time, by name.
    nbytes: bytes that each call moves.
    repeats: calls of each function.
    self_timed: names of functions that return their own measurement in
      seconds (e.g. the time that ``dd`` reports, which leaves out process
      start-up); the others are timed on the wall clock.

  Returns:
    one ``Timing`` per key of `fns`.
  """
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats!r}")
  unknown = set(self_timed) - set(fns)
  if unknown:
    raise ValueError(f"self_timed names {sorted(unknown)} are not in fns")
  names = list(fns)
  seconds: dict[str, list[float]] = {name: [] for name in names}
  for rep in range(repeats):
    shift = rep % len(names)
    for name in names[shift:] + names[:shift]:
      start = time.perf_counter_ns()
      own = fns[name]()
      wall = (time.perf_counter_ns() - start) * 1e-9
      seconds[name].append(float(own) if name in self_timed else wall)
  return {name: Timing(nbytes, tuple(s)) for name, s in seconds.items()}


# ----------------------------------------------------------------- buffers


def aligned_empty(nbytes: int, alignment: int = PAGE_BYTES) -> np.ndarray:
  """An uninitialised uint8 array whose data starts on an `alignment` edge."""
  if nbytes <= 0:
    raise ValueError(f"nbytes must be > 0, got {nbytes!r}")
  raw = np.empty(nbytes + alignment, np.uint8)
  start = (-raw.ctypes.data) % alignment
  return raw[start:start + nbytes]


def pretouched(nbytes: int, fill: int = 0) -> np.ndarray:
  """A page-aligned uint8 array with every page already faulted in.

  A destination that was never written costs a page fault per page on its
  first copy: timing that would measure the kernel, not the copy.
  """
  out = aligned_empty(nbytes)
  out.fill(fill)
  return out


def pattern(nbytes: int, seed: int = 0) -> np.ndarray:
  """A page-aligned uint8 array of cheap, non-repeating, non-zero data.

  Not zeros: a disk or hypervisor may store zero blocks as holes.
  """
  out = aligned_empty(nbytes)
  words = nbytes // 8
  if words:
    out[:words * 8].view(np.uint64)[:] = (
        np.arange(words, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) +
        np.uint64(seed * 2 + 1))
  out[words * 8:] = 0xA5
  return out


def memcpy(dst: np.ndarray, src: np.ndarray) -> None:
  """A plain single-threaded copy of `src` into `dst` (numpy's memcpy)."""
  np.copyto(dst, src, casting="no")


# ---------------------------------------------------------------------- dd


@dataclasses.dataclass(frozen=True)
class DdReport:
  """What ``dd`` said it did: bytes copied and seconds taken."""
  nbytes: int
  seconds: float

  @property
  def bandwidth(self) -> float:
    return self.nbytes / max(self.seconds, 1e-12)


_DD_REPORT = re.compile(
    r"^(\d+) bytes\b.*\bcopied, ([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?) s\b",
    re.MULTILINE)


def parse_dd_report(text: str) -> DdReport:
  """Parses dd's closing line ('268435456 bytes (...) copied, 0.24 s, ...').

  Raises:
    ValueError: `text` holds no such line.
  """
  match = _DD_REPORT.search(text)
  if not match:
    raise ValueError(f"no 'N bytes ... copied, S s' line in dd output: "
                     f"{text.strip()!r}")
  return DdReport(int(match.group(1)), float(match.group(2)))


def write_file(path: str | os.PathLike, data: np.ndarray, *,
               block_bytes: int = 4 << 20) -> None:
  """Writes `data` to a new file, flushed to disk and dropped from the cache.

  The file is written out in full (no holes), so that reading it back costs
  real disk reads.
  """
  flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
               0o600)
  try:
    view = memoryview(flat)
    for start in range(0, flat.nbytes, block_bytes):
      block = view[start:start + block_bytes]
      while block:
        block = block[os.write(fd, block):]
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)


def dd_direct_read(path: str | os.PathLike, *, block: str = "1M",
                   timeout_s: float = 600.0) -> DdReport:
  """Reads `path` sequentially with ``dd iflag=direct`` (bypassing the cache).

  Returns:
    dd's own count and time, which leave out the process start-up.

  Raises:
    RuntimeError: dd failed, e.g. the file system has no O_DIRECT (tmpfs).
  """
  command = ["dd", f"if={os.fspath(path)}", "of=/dev/null", f"bs={block}",
             "iflag=direct"]
  env = dict(os.environ, LC_ALL="C")  # '.' decimals, English words
  done = subprocess.run(command, capture_output=True, text=True, env=env,
                        timeout=timeout_s, check=False)
  if done.returncode != 0:
    raise RuntimeError(f"{' '.join(command)} failed (exit "
                       f"{done.returncode}): {done.stderr.strip()}")
  return parse_dd_report(done.stderr)


# ------------------------------------------------------------------ checks


@dataclasses.dataclass(frozen=True)
class Target:
  """An acceptance target: `achieved` >= `threshold` x `reference`."""
  name: str
  achieved: float
  reference: float
  threshold: float
  reference_name: str

  @property
  def ratio(self) -> float:
    return self.achieved / self.reference if self.reference > 0 else 0.0

  @property
  def passed(self) -> bool:
    return self.ratio >= self.threshold

  def __str__(self) -> str:
    return (f"{'PASS' if self.passed else 'FAIL'} {self.name}: "
            f"{self.achieved / 1e9:.2f} GB/s = {self.ratio:.0%} of "
            f"{self.reference_name} {self.reference / 1e9:.2f} GB/s "
            f"(target >= {self.threshold:.0%})")

  def to_json(self) -> dict[str, Any]:
    return {"name": self.name, "passed": self.passed,
            "achieved_gbps": self.achieved / 1e9,
            "reference_gbps": self.reference / 1e9,
            "reference": self.reference_name, "ratio": self.ratio,
            "threshold": self.threshold}


# ----------------------------------------------------------------- machine


@dataclasses.dataclass(frozen=True)
class DiskInfo:
  """The file system and block device under a directory."""
  path: str
  mount_point: str
  fs_type: str
  device: str  # e.g. 'vda', or '' where no block device backs it (tmpfs)
  model: str
  rotational: bool | None
  size_bytes: int

  def __str__(self) -> str:
    if not self.device:
      return f"{self.path} on {self.fs_type} ({self.mount_point}), no disk"
    kind = {True: "rotational", False: "non-rotational",
            None: "unknown kind"}[self.rotational]
    model = f" {self.model}" if self.model else ""
    return (f"{self.path} on {self.fs_type} ({self.mount_point}), disk "
            f"{self.device}{model}, {format_bytes(self.size_bytes)}, {kind}")


@dataclasses.dataclass(frozen=True)
class MachineInfo:
  """What a benchmark ran on, for its report header."""
  cpu_model: str
  cores: int
  usable_cores: int
  memory_bytes: int
  numa_nodes: int
  load_average: tuple[float, float, float]
  disk: DiskInfo | None

  def __str__(self) -> str:
    usable = ("" if self.usable_cores == self.cores else
              f" ({self.usable_cores} usable)")
    load = ", ".join(f"{x:.2f}" for x in self.load_average)
    lines = [
        f"machine: {self.cores} cores{usable} {self.cpu_model}, "
        f"{format_bytes(self.memory_bytes)} memory, {self.numa_nodes} NUMA "
        f"node(s), load average {load}"
    ]
    if self.disk is not None:
      lines.append(f"disk: {self.disk}")
    return "\n".join(lines)

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def _read(path: str, default: str = "") -> str:
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      return f.read().strip()
  except OSError:
    return default


def _cpu_model() -> str:
  for line in _read("/proc/cpuinfo").splitlines():
    key, _, value = line.partition(":")
    if key.strip() in ("model name", "Processor", "cpu model"):
      return value.strip()
  return "unknown CPU"


def _memory_bytes() -> int:
  for line in _read("/proc/meminfo").splitlines():
    if line.startswith("MemTotal:"):
      return int(line.split()[1]) * 1024
  return 0


def _numa_nodes() -> int:
  try:
    names = os.listdir("/sys/devices/system/node")
  except OSError:
    return 1
  return max(1, sum(1 for n in names if re.fullmatch(r"node\d+", n)))


def _mount_of(path: str) -> tuple[str, str]:
  """(mount point, fs type) of the longest mount that holds `path`."""
  best = ("/", "unknown")
  for line in _read("/proc/self/mounts").splitlines():
    fields = line.split()
    if len(fields) < 3:
      continue
    point = fields[1].replace("\\040", " ")
    inside = path == point or path.startswith(point.rstrip("/") + "/")
    if inside and len(point) >= len(best[0]):
      best = (point, fields[2])
  return best


def describe_disk(path: str | os.PathLike) -> DiskInfo:
  """The file system and block device under `path` (an existing path)."""
  real = os.path.realpath(path)
  mount_point, fs_type = _mount_of(real)
  dev = os.stat(real).st_dev
  block = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
  device, model, rotational, size = "", "", None, 0
  if os.path.exists(block):
    sys_dir = os.path.realpath(block)
    if os.path.exists(os.path.join(sys_dir, "partition")):
      sys_dir = os.path.dirname(sys_dir)  # the whole disk holds the queue
    device = os.path.basename(sys_dir)
    model = _read(os.path.join(sys_dir, "device", "model"))
    flag = _read(os.path.join(sys_dir, "queue", "rotational"))
    rotational = {"0": False, "1": True}.get(flag)
    sectors = _read(os.path.join(sys_dir, "size"), "0")
    size = int(sectors) * 512 if sectors.isdigit() else 0
  return DiskInfo(path=os.fspath(path), mount_point=mount_point,
                  fs_type=fs_type, device=device, model=model,
                  rotational=rotational, size_bytes=size)


def describe_machine(disk_path: str | os.PathLike | None = None
                     ) -> MachineInfo:
  """Cores, memory, NUMA nodes, load and (optionally) the disk under a path."""
  try:
    usable = len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    usable = os.cpu_count() or 1
  return MachineInfo(
      cpu_model=_cpu_model(),
      cores=os.cpu_count() or 1,
      usable_cores=usable,
      memory_bytes=_memory_bytes(),
      numa_nodes=_numa_nodes(),
      load_average=tuple(os.getloadavg()),
      disk=describe_disk(disk_path) if disk_path is not None else None)


@dataclasses.dataclass(frozen=True)
class Bound:
  """An acceptance target on one measured number: at most or at least a limit.

  For targets that are not a bandwidth ratio (``Target``): a time ratio
  ("within 1.15x of resident"), a speed-up ("at least 1.6x faster") or a cost
  ("under 20 us per fetch").
  """
  name: str
  value: float
  limit: float
  at_most: bool  # True: passes when value <= limit; False: value >= limit
  unit: str = ""  # printed right after the numbers, e.g. 'x' or ' us'
  detail: str = ""  # how the value was obtained, printed after the verdict

  @property
  def passed(self) -> bool:
    return self.value <= self.limit if self.at_most else (
        self.value >= self.limit)

  def __str__(self) -> str:
    relation = "<=" if self.at_most else ">="
    detail = f"; {self.detail}" if self.detail else ""
    return (f"{'PASS' if self.passed else 'FAIL'} {self.name}: "
            f"{self.value:.3g}{self.unit} (target {relation} "
            f"{self.limit:g}{self.unit}){detail}")

  def to_json(self) -> dict[str, Any]:
    return {"name": self.name, "passed": self.passed, "value": self.value,
            "limit": self.limit, "at_most": self.at_most, "unit": self.unit,
            "detail": self.detail}
