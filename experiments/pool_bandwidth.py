r"""Pool bandwidth: every tier and direction next to memcpy and dd, one run.

Fills a jcxl pool, streams a tensor through each tier (put = into the pool,
get = out of it) and prints the achieved GB/s next to a plain single-threaded
memcpy of the same bytes measured in the same run, with their ratio. The nvme
tier's reads are also held against ``dd iflag=direct`` on a file in the same
directory, and an emulated cxl tier against its configured link bandwidth.
Each side is the best of --repeats repetitions, taken in turns. Every line
that names the cxl tier says whether it was emulated and with which link.

Acceptance targets, printed as PASS/FAIL lines:
  * host get >= 90% of memcpy of the same bytes;
  * nvme get >= 90% of dd with O_DIRECT on the same directory;
  * emulated cxl put and get >= 90% of the link bandwidth.

Command line (the defaults; about 15 s on a 2-core machine):

  python experiments/pool_bandwidth.py --size=256MiB --repeats=3 \
      --tiers=host,cxl,nvme --link_bandwidth=4GB/s --link_latency_us=2 \
      --nvme_dir=./build/nvme-bench --json_out=runs/pool_bandwidth.json
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Sequence
from typing import Any

from absl import app
from absl import flags
import numpy as np

from benchmarks import bench
import jcxl
from experiments import common
from experiments import flags as shared_flags
from experiments import host_allocator
from jcxl import Tier
from jcxl.units import format_bytes
from jcxl.units import parse_bytes

_SIZE = flags.DEFINE_string(
    "size", "256MiB", "Bytes per transfer, e.g. '256MiB' (a multiple of 4096).")
_REPEATS = flags.DEFINE_integer(
    "repeats", 3, "Repetitions per measurement; the best one is reported.",
    lower_bound=1)
_TIERS = flags.DEFINE_list(
    "tiers", ["host", "cxl", "nvme"], "Pool tiers to measure, in order.")
_LINK_BANDWIDTH = shared_flags.link_bandwidth(
    default="4GB/s", help_text="Bandwidth of the emulated cxl link; keep it "
    "below memcpy speed so that the link, not the copy, is what binds.")
_LINK_LATENCY_US = shared_flags.link_latency_us(lower_bound=0.0)
_NVME_DIR = shared_flags.nvme_dir(
    default="./build/nvme-bench", help_text="Directory on a real disk for "
    "the nvme tier and the dd baseline; created if missing. Not tmpfs: it "
    "has no O_DIRECT.")
_JSON_OUT = shared_flags.json_out()
_DRY_RUN = shared_flags.dry_run(
    help_text=f"Tiny sizes ({format_bytes(1 << 20)}, one repetition): checks "
    "that the program runs; its PASS/FAIL lines mean nothing.")

DRY_RUN_SIZE = 1 << 20
TARGET_RATIO = 0.9
# The copy engine is measured as users get it: the pool's default threads and
# chunking.
_POOL_DEFAULTS = inspect.signature(jcxl.Pool).parameters
ENGINE_THREADS = _POOL_DEFAULTS["copy_threads"].default
ENGINE_CHUNK = parse_bytes(_POOL_DEFAULTS["chunk_bytes"].default)
# Room for the allocator's alignment around the one object of each tier.
_TIER_SLACK = 4 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """What one run measures."""
  size: int
  repeats: int
  tiers: tuple[Tier, ...]
  cxl_link: jcxl.LinkModel
  nvme_dir: str
  json_out: str | None
  dry_run: bool

  def validate(self) -> None:
    """Checks the values; creates `nvme_dir` if the nvme tier needs it.

    Raises:
      ValueError: naming the flag whose value is wrong.
    """
    if self.size <= 0 or self.size % bench.PAGE_BYTES:
      raise ValueError(f"--size must be a positive multiple of "
                       f"{bench.PAGE_BYTES} bytes (O_DIRECT blocks), but got "
                       f"{self.size} bytes")
    if not self.tiers:
      raise ValueError("--tiers must name at least one of host, cxl, nvme")
    if len(set(self.tiers)) != len(self.tiers):
      raise ValueError(f"--tiers names a tier twice: "
                       f"{','.join(t.value for t in self.tiers)}")
    if Tier.NVME in self.tiers:
      _check_nvme_dir(self.nvme_dir)
    common.check_json_out(self.json_out, "runs/pool_bandwidth.json")


def _check_nvme_dir(path: str) -> None:
  common.check_disk_backed(path, flag="--nvme_dir")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"--nvme_dir {path!r} cannot be created: {e.strerror}"
                     ) from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise ValueError(f"--nvme_dir {path!r} is not writable by this process")


def config_from_flags() -> Config:
  """Builds the run's config from the parsed flags.

  Raises:
    ValueError: naming the flag whose value cannot be parsed.
  """
  tiers = tuple(Tier.parse(t.strip(), name="--tiers") for t in _TIERS.value)
  link = shared_flags.link(_LINK_BANDWIDTH, _LINK_LATENCY_US)
  dry_run = _DRY_RUN.value
  return Config(
      size=DRY_RUN_SIZE if dry_run else parse_bytes(_SIZE.value,
                                                    name="--size"),
      repeats=1 if dry_run else _REPEATS.value,
      tiers=tiers,
      cxl_link=link,
      nvme_dir=_NVME_DIR.value,
      json_out=_JSON_OUT.value,
      dry_run=dry_run)


# ------------------------------------------------------------- measuring


@dataclasses.dataclass(frozen=True)
class Row:
  """One tier and direction: the pool, memcpy, and a second reference."""
  tier: Tier
  label: str
  direction: str  # 'put' (into the pool) or 'get' (out of it)
  pool: bench.Timing
  memcpy: bench.Timing
  reference_name: str = ""
  reference: float = 0.0  # bytes per second

  def to_json(self) -> dict[str, Any]:
    return {"tier": self.tier.value, "label": self.label,
            "direction": self.direction, "pool": self.pool.to_json(),
            "memcpy": self.memcpy.to_json(),
            "ratio_to_memcpy": self.pool.bandwidth / self.memcpy.bandwidth,
            "reference": self.reference_name,
            "reference_gbps": self.reference / 1e9}


def _measure_tier(pool: jcxl.Pool, tier: Tier, config: Config,
                  src: np.ndarray, dd_file: str | None) -> list[Row]:
  """Puts `src` into `tier` and gets it back, each next to memcpy."""
  label = pool.stats()[tier].label()
  link = pool.stats()[tier].link
  dst = bench.pretouched(src.nbytes, fill=1)
  dst_memcpy = bench.pretouched(src.nbytes, fill=1)

  def copy():
    bench.memcpy(dst_memcpy, src)

  handle = pool.allocate(src.shape, src.dtype, tier)
  try:
    put = bench.interleaved(
        {"pool": lambda: pool.put_async(handle, src).wait(), "memcpy": copy},
        nbytes=src.nbytes, repeats=config.repeats)
    dst.fill(0)
    pool.get(handle, out=dst)
    if not np.array_equal(dst, src):
      raise RuntimeError(f"{label}: the bytes read back differ from those "
                         "written")
    get_fns = {"pool": lambda: pool.get(handle, out=dst), "memcpy": copy}
    if dd_file is not None:
      get_fns["dd"] = lambda: bench.dd_direct_read(dd_file).seconds
    get = bench.interleaved(get_fns, nbytes=src.nbytes,
                            repeats=config.repeats,
                            self_timed=[n for n in get_fns if n == "dd"])
  finally:
    pool.free(handle)
  link_ref = ("link", link.bandwidth) if link else ("", 0.0)
  get_ref = ("dd O_DIRECT", get["dd"].bandwidth) if "dd" in get else link_ref
  return [
      Row(tier, label, "put", put["pool"], put["memcpy"], *link_ref),
      Row(tier, label, "get", get["pool"], get["memcpy"], *get_ref),
  ]


def _targets(rows: Sequence[Row], config: Config) -> list[bench.Target | str]:
  """The acceptance targets; a string where a target could not be checked."""
  by_key = {(r.tier, r.direction): r for r in rows}
  size = format_bytes(config.size)
  out: list[bench.Target | str] = []
  host = by_key.get((Tier.HOST, "get"))
  if host is None:
    out.append("SKIP host get vs memcpy: host not in --tiers")
  else:
    out.append(bench.Target(f"{host.label} get {size}", host.pool.bandwidth,
                            host.memcpy.bandwidth, TARGET_RATIO, "memcpy"))
  nvme = by_key.get((Tier.NVME, "get"))
  if nvme is None:
    out.append("SKIP nvme get vs dd O_DIRECT: nvme not in --tiers")
  else:
    out.append(bench.Target(f"{nvme.label} get {size}", nvme.pool.bandwidth,
                            nvme.reference, TARGET_RATIO, "dd O_DIRECT"))
  for direction in ("put", "get"):
    cxl = by_key.get((Tier.CXL, direction))
    if cxl is None:
      out.append(f"SKIP cxl {direction} vs link: cxl not in --tiers")
    elif not cxl.reference:
      out.append(f"SKIP {cxl.label} {direction} vs link: no link model")
    else:
      out.append(bench.Target(f"{cxl.label} {direction} {size}",
                              cxl.pool.bandwidth, cxl.reference, TARGET_RATIO,
                              "link"))
  return out


def _table(rows: Sequence[Row]) -> list[str]:
  lines = [f"{'dir':<4}{'pool GB/s':>10}{'memcpy GB/s':>13}{'ratio':>7}"
           f"  {'reference GB/s':<20}{'ratio':>6}  tier"]
  for r in rows:
    ratio = r.pool.bandwidth / r.memcpy.bandwidth
    if r.reference:
      ref = f"{r.reference_name} {r.reference / 1e9:.2f}"
      ref_ratio = f"{r.pool.bandwidth / r.reference:.2f}"
    else:
      ref, ref_ratio = "-", "-"
    lines.append(f"{r.direction:<4}{r.pool.gbps:>10.2f}{r.memcpy.gbps:>13.2f}"
                 f"{ratio:>7.2f}  {ref:<20}{ref_ratio:>6}  {r.label}")
  return lines


def run(config: Config) -> dict[str, Any]:
  """Measures every tier of `config`; prints the report, returns results."""
  machine = bench.describe_machine(
      config.nvme_dir if Tier.NVME in config.tiers else None)
  capacity = config.size + _TIER_SLACK
  src = bench.pattern(config.size)
  dd_file = None
  with jcxl.Pool(
      host=capacity if Tier.HOST in config.tiers else 0,
      cxl=capacity if Tier.CXL in config.tiers else 0,
      nvme=capacity if Tier.NVME in config.tiers else 0,
      nvme_dir=config.nvme_dir if Tier.NVME in config.tiers else None,
      cxl_link=config.cxl_link) as pool:
    stats = pool.stats()
    emulated = [stats[t].label() for t in stats.emulated]
    header = [
        f"jcxl pool bandwidth: {format_bytes(config.size)} per transfer, best"
        f" of {config.repeats}, copy engine {ENGINE_THREADS} threads, "
        f"{format_bytes(ENGINE_CHUNK)} chunks (defaults); memcpy = numpy "
        "copyto, 1 thread, pre-touched destination",
        str(machine),
        "emulated: " + ("; ".join(emulated) if emulated else "nothing"),
    ]
    if config.dry_run:
      header.append("DRY RUN: tiny sizes, one repetition; PASS/FAIL below "
                    "mean nothing")
    print("\n".join(header), flush=True)
    rows: list[Row] = []
    try:
      if Tier.NVME in config.tiers:
        dd_file = os.path.join(config.nvme_dir,
                               f"jcxl-dd-baseline-{os.getpid()}.bin")
        bench.write_file(dd_file, src)
      for tier in config.tiers:
        rows += _measure_tier(pool, tier, config, src,
                              dd_file if tier is Tier.NVME else None)
    finally:
      if dd_file is not None and os.path.exists(dd_file):
        os.remove(dd_file)
  targets = _targets(rows, config)
  print("\n".join(_table(rows) + [str(t) for t in targets]), flush=True)
  return {
      "config": {"size": config.size, "repeats": config.repeats,
                 "tiers": [t.value for t in config.tiers],
                 "cxl_link_gbps": config.cxl_link.bandwidth / 1e9,
                 "cxl_latency_s": config.cxl_link.latency_s,
                 "nvme_dir": config.nvme_dir, "dry_run": config.dry_run,
                 "copy_threads": ENGINE_THREADS, "chunk_bytes": ENGINE_CHUNK},
      "machine": machine.to_json(),
      "emulated": emulated,
      "rows": [r.to_json() for r in rows],
      "targets": [t.to_json() if isinstance(t, bench.Target) else
                  {"name": t, "passed": None} for t in targets],
  }


def main(argv: Sequence[str]) -> None:
  common.run_program(argv, config_from_flags, run)

if __name__ == "__main__":
  host_allocator.start()
  app.run(main)
