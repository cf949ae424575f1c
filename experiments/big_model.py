r"""Train a GPT-style model whose state is larger than this machine's memory.

The parameters and adamw state (fp32: 12 bytes per parameter) are created
straight into the pool a leaf at a time (``jcxl.init_in_pool``), never
whole in memory. The pool has a small fast tier (the emulated cxl tier by
default) and an nvme tier on a real disk behind it; ``jcxl.tiers_by_reads``
puts the leaves a step reads most often (parameters: forward, backward and
update) in the fast tier first, the moments (read once) after them. The
step is ``jcxl.cxl_offload`` of the plain train step (``jax.value_and_grad``
of the loss, ``optax.adamw``) over unrolled blocks, streamed a block at a
time, each block updated as soon as its gradient is ready.

Each step prints its loss, time, stall, the bytes each tier read and wrote
and the nvme tier's achieved GB/s (read and write, over the time the copy
engine was busy with each). In the same run, ``dd`` reads and writes a file
in the nvme directory with O_DIRECT and the pool's request size (before and
after training; the faster figure is the reference): the step's lower
bound here is max(measured compute, nvme bytes read / dd's read GB/s +
bytes written / dd's write GB/s).

Checkpoint (``--checkpoint=auto``): after all but the last step the state
is saved with ``jcxl.checkpoint.save`` (peak RSS of the save measured), the
last step is run, the checkpoint is restored into the same PoolArrays, and
the last step is run again: its loss must equal the uninterrupted one. The
checkpoint needs the state's size again on disk; where the disk has no room
for it beside the nvme tier, it is skipped and the results say so (run
again with a smaller ``--n_layer`` for the largest size that fits).

Progress: a line every ``--progress_s`` during init, compile, each step and
the checkpoint (bytes written to disk, RSS, VmSwap); the results say whether
anything of the process was swapped out. Each step also reports the cxl
tier's achieved GB/s, against its link's bandwidth.

Results: ``<run_dir>/results.json`` and ``results.md`` (config, date,
machine, commit), and the shared results file
``docs/results/big_model/<date>-<commit>.md``. The pool's nvme files and
the checkpoint are deleted at the end.

Command line (2.83B parameters, 31.66 GiB of state, 1.35x this machine's
23.54 GiB; the defaults are this run's; see docs/scale.md for what has run):

  nice -n 5 python -m experiments.big_model

which is

  python -m experiments.big_model --n_embd=2560 --n_layer=36 --n_head=20 \
      --seq_len=64 --batch=1 --steps=4 --learning_rate=1e-6 \
      --warmup_steps=0 --fast_tier=cxl --fast_capacity=3GiB \
      --nvme_dir=runs/big_model/nvme --run_dir=runs/big_model
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jcxl
from benchmarks import bench
from experiments import common
from experiments import flags as shared_flags
from experiments import host_allocator
from jcxl import TransferRecord
from jcxl.units import format_bytes
from jcxl.units import parse_bytes
from models import common as model_common
from models import data
from models import gpt2

# adamw at width 2560 and 36 blocks is unstable on 64-token batches: 3e-4
# gave 5.76, 15.20, 19.00 (4 scanned blocks); 1e-5 warmed up from 1e-6
# over 4 steps gave 6.02, 4.33, 7.61, 5.59 (36 blocks: the 1e-6 update
# helped, the 3.25e-6 one did not); so the default is a constant 1e-6.
LEARNING_RATE = 1e-6
WARMUP_STEPS = 0

FLAGS = flags.FlagValues()
_N_EMBD = shared_flags.n_embd(FLAGS, default=2560, lower_bound=8)
_N_LAYER = shared_flags.n_layer(FLAGS, default=36, lower_bound=1)
_N_HEAD = flags.DEFINE_integer("n_head", 20, "Attention heads.",
                               lower_bound=1, flag_values=FLAGS)
_SEQ_LEN = shared_flags.seq_len(FLAGS, default=64, lower_bound=1)
_BATCH = shared_flags.batch(FLAGS, default=1, lower_bound=1)
_STEPS = shared_flags.steps(FLAGS, default=4, help_text="Train steps.",
                            lower_bound=2)
_LEARNING_RATE = flags.DEFINE_float(
    "learning_rate", LEARNING_RATE, "adamw's peak learning rate.",
    flag_values=FLAGS)
_WARMUP_STEPS = flags.DEFINE_integer(
    "warmup_steps", WARMUP_STEPS, "Linear warmup from a tenth of "
    "--learning_rate over this many steps (0: constant).", lower_bound=0,
    flag_values=FLAGS)
_SEED = shared_flags.seed(FLAGS)
_FAST_TIER = flags.DEFINE_enum("fast_tier", "cxl", ["cxl", "host", "none"],
                               "The tier in front of nvme.",
                               flag_values=FLAGS)
_FAST_CAPACITY = flags.DEFINE_string(
    "fast_capacity", "3GiB", "Capacity of the fast tier (DRAM: it counts "
    "in the process's RSS).", flag_values=FLAGS)
_NVME_DIR = shared_flags.nvme_dir(
    FLAGS, default=os.path.join("runs", "big_model", "nvme"),
    help_text="Directory on a real disk (not tmpfs) for the nvme tier's "
    "files, dd's reference file and the checkpoint; created if missing.")
_CHUNK = flags.DEFINE_string(
    "chunk_bytes", "4MiB", "The pool's request size (dd uses the same).",
    flag_values=FLAGS)
_CHECKPOINT = flags.DEFINE_enum(
    "checkpoint", "auto", ["auto", "off"],
    "Save before the last step, resume, repeat it (auto: where the disk has "
    "room).", flag_values=FLAGS)
_RUN_DIR = shared_flags.run_dir(
    FLAGS, default=os.path.join("runs", "big_model"),
    help_text="Where results.json and results.md go; created if missing.")
# This machine's disk (a virtual one) reads a file just written faster for
# a few GiB than sustained: idle, six O_DIRECT reads of a 4 GiB file in a
# row gave 1.19 down to 0.85 GB/s, two of a 16 GiB file 0.68 and 0.63 GB/s.
# A step reads 36 GiB, so the reference reads 16 GiB.
_DD_BYTES = flags.DEFINE_string(
    "dd_bytes", "16GiB", "Size of the dd reference file (a step of the "
    "full-size run reads 36 GiB from nvme: the reference should be "
    "sustained, not a burst).", flag_values=FLAGS)

_PROGRESS_S = flags.DEFINE_float(
    "progress_s", 60.0, "A progress line every this many seconds during "
    "init, compile, the steps and the checkpoint (0: none).",
    lower_bound=0.0, flag_values=FLAGS)
_SCAN_LAYERS = flags.DEFINE_boolean(
    "scan_layers", False, "Stack the blocks and scan them (the backward "
    "pass then holds every block's gradient at once).", flag_values=FLAGS)

_VOCAB = 256  # byte tokens: the corpus is the standard library's sources
_DISK_MARGIN = 8 << 30  # left free on the disk for everyone else
_SLACK = 256 << 20      # per tier, for the allocator's alignment


@dataclasses.dataclass(frozen=True)
class Config:
  n_embd: int
  n_layer: int
  n_head: int
  seq_len: int
  batch: int
  steps: int
  learning_rate: float
  warmup_steps: int
  seed: int
  fast_tier: str
  fast_capacity: int
  nvme_dir: str
  chunk_bytes: int
  checkpoint: str
  run_dir: str
  dd_bytes: int
  scan_layers: bool = False

  def validate(self) -> None:
    if os.path.exists(self.nvme_dir):
      common.check_directory(self.nvme_dir, flag="--nvme_dir")
    common.check_disk_backed(self.nvme_dir, flag="--nvme_dir")
    if self.n_embd % self.n_head:
      raise ValueError(f"--n_embd {self.n_embd} must be a multiple of "
                       f"--n_head {self.n_head}")
    if self.chunk_bytes % bench.PAGE_BYTES:
      raise ValueError(f"--chunk_bytes must be a multiple of "
                       f"{bench.PAGE_BYTES} (O_DIRECT), got {self.chunk_bytes}")

  def model(self) -> gpt2.GPT2Config:
    # Unrolled blocks: the step then updates each block as soon as its
    # gradient is ready. With scanned blocks the backward scan returns the
    # gradient of every block at once (11 GB at 2.8B parameters: the run
    # was killed for memory).
    return gpt2.GPT2Config(vocab_size=_VOCAB, n_ctx=max(self.seq_len, 64),
                           n_embd=self.n_embd, n_layer=self.n_layer,
                           n_head=self.n_head, scan_layers=self.scan_layers)


def config_from_flags() -> Config:
  return Config(
      n_embd=_N_EMBD.value, n_layer=_N_LAYER.value, n_head=_N_HEAD.value,
      seq_len=_SEQ_LEN.value, batch=_BATCH.value, steps=_STEPS.value,
      learning_rate=_LEARNING_RATE.value, warmup_steps=_WARMUP_STEPS.value,
      seed=_SEED.value,
      fast_tier=_FAST_TIER.value,
      fast_capacity=parse_bytes(_FAST_CAPACITY.value, name="--fast_capacity"),
      nvme_dir=_NVME_DIR.value,
      chunk_bytes=parse_bytes(_CHUNK.value, name="--chunk_bytes"),
      checkpoint=_CHECKPOINT.value, run_dir=_RUN_DIR.value,
      dd_bytes=parse_bytes(_DD_BYTES.value, name="--dd_bytes"),
      scan_layers=_SCAN_LAYERS.value)


# ------------------------------------------------------------ measuring


class PeakRss:
  """The process's peak RSS over windows; the run's peak is the largest."""

  def __init__(self):
    self.run_peak = 0

  def window(self) -> int:
    """The peak since the last call (then reset)."""
    peak = common.peak_rss_since_reset()
    self.run_peak = max(self.run_peak, peak)
    return peak


def _proc_kb(path: str, key: str) -> int | None:
  """A 'Key:  N kB' figure of a /proc file, in bytes (None if absent)."""
  try:
    with open(path, encoding="utf-8") as f:
      for line in f:
        if line.startswith(key):
          return int(line.split()[1]) << 10
  except OSError:
    return None
  return None


def swap_status() -> dict[str, int | None]:
  """The kernel's swap (SwapTotal, SwapFree) and this process's swapped
  out memory now (VmSwap), in bytes."""
  return {"swap_total_bytes": _proc_kb("/proc/meminfo", "SwapTotal:"),
          "swap_free_bytes": _proc_kb("/proc/meminfo", "SwapFree:"),
          "vm_swap_bytes": _proc_kb("/proc/self/status", "VmSwap:")}


def _disk_written() -> int:
  """Bytes this process has written to storage (/proc/self/io)."""
  try:
    with open("/proc/self/io", encoding="utf-8") as f:
      for line in f:
        if line.startswith("write_bytes:"):
          return int(line.split()[1])
  except OSError:
    pass
  return 0


class Progress:
  """A line every `interval_s` while a phase runs (init, compile, a step,
  the checkpoint): elapsed time, the bytes written to disk in the phase,
  RSS and VmSwap; it also keeps the largest VmSwap seen."""

  def __init__(self, interval_s: float):
    self.interval_s = interval_s
    self.max_vm_swap = 0
    self._phase = None
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)

  def __enter__(self) -> Progress:
    if self.interval_s > 0:
      self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join()
    self.sample()

  def phase(self, name: str, expected_disk_bytes: int | None = None) -> None:
    with self._lock:
      self._phase = (name, time.perf_counter(), _disk_written(),
                     expected_disk_bytes)

  def sample(self) -> int:
    swap = _proc_kb("/proc/self/status", "VmSwap:") or 0
    self.max_vm_swap = max(self.max_vm_swap, swap)
    return swap

  def _loop(self) -> None:
    while not self._stop.wait(self.interval_s):
      swap = self.sample()
      with self._lock:
        if self._phase is None:
          continue
        name, t0, written0, expected = self._phase
      written = _disk_written() - written0
      share = (f" of ~{format_bytes(expected)} ({written / expected:.0%})"
               if expected else "")
      rss = _proc_kb("/proc/self/status", "VmRSS:") or 0
      _say(f"  [{name}] {time.perf_counter() - t0:6.0f} s, "
           f"{format_bytes(written)} written to disk{share}, RSS "
           f"{format_bytes(rss)}, VmSwap {format_bytes(swap)}")


def _dd(args: list[str]) -> bench.DdReport:
  env = dict(os.environ, LC_ALL="C")
  done = subprocess.run(["dd", *args], capture_output=True, text=True,
                        env=env, timeout=900, check=False)
  if done.returncode != 0:
    raise RuntimeError(f"dd {' '.join(args)} failed: {done.stderr.strip()}")
  return bench.parse_dd_report(done.stderr)


def dd_reference(directory: str, nbytes: int, block: int) -> dict[str, float]:
  """O_DIRECT write then read of a file of `nbytes` in `directory`, in
  requests of `block` bytes (queue depth 1); bytes per second."""
  path = os.path.join(directory, "big_model-dd-reference")
  count = max(1, nbytes // block)
  try:
    wrote = _dd(["if=/dev/zero", f"of={path}", f"bs={block}",
                 f"count={count}", "oflag=direct", "conv=fsync"])
    read = _dd([f"if={path}", "of=/dev/null", f"bs={block}", "iflag=direct"])
  finally:
    if os.path.exists(path):
      os.remove(path)
  return {"read": read.bandwidth, "write": wrote.bandwidth}


def _busy_s(records: Sequence[TransferRecord]) -> float:
  """Length of the union of the records' runs, in seconds."""
  total, end = 0, None
  for a, b in sorted((r.started_ns, r.finished_ns) for r in records):
    if end is None or a > end:
      total, end = total + b - a, b
    elif b > end:
      total, end = total + b - end, b
  return total * 1e-9


def nvme_bandwidth(records: Sequence[TransferRecord]) -> dict[str, float]:
  """The nvme tier's achieved GB/s while busy: reads, writes, and both."""
  return tier_bandwidth(records, "nvme")


def tier_bandwidth(records: Sequence[TransferRecord],
                   tier: str) -> dict[str, float]:
  """A tier's achieved bytes/s while its copies ran (the union of their
  times): reads, writes, and both."""
  mine = [r for r in records if r.tier.value == tier and r.ok]
  out = {}
  for name, chosen in (("read", [r for r in mine if not r.to_pool]),
                       ("write", [r for r in mine if r.to_pool]),
                       ("both", mine)):
    busy = _busy_s(chosen)
    out[name] = sum(r.nbytes for r in chosen) / busy if busy else 0.0
    out[f"{name}_busy_s"] = busy
  return out


def _tier_bytes(pool: jcxl.Pool) -> dict[str, tuple[int, int]]:
  stats = pool.stats()
  return {t.value: (s.bytes_read, s.bytes_written)
          for t, s in stats.tiers.items() if s.enabled}


def _commit() -> str:
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "jcxl",
                            "experiments", "models", "ffi"],
                           capture_output=True, text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head.strip() + (" (with uncommitted changes)" if dirty else "")


def _say(text: str) -> None:
  print(text, flush=True)


# ------------------------------------------------------------------ run


def layered_init(model: gpt2.GPT2Config) -> Callable[[jax.Array], Any]:
  """``init(key)``: the model's parameters with its blocks made one at a
  time (block i from ``fold_in(blocks_key, i)``): ``blocks_{i}`` unrolled,
  or stacked into ``blocks`` (scanned), so that ``jcxl.init_in_pool``
  creates each block's leaves by themselves. The tables (embeddings, final
  LayerNorm) are the model's own initializers.
  """
  def init(key: jax.Array) -> Any:
    tables_key, blocks_key = jax.random.split(key)
    # One block, to build the tables: its values go unused (and uncomputed).
    one = dataclasses.replace(model, n_layer=1, scan_layers=True)
    params = model_common.pure_params(one.build(rngs=nnx.Rngs(tables_key)))
    del params["blocks"]
    blocks = [model_common.pure_params(gpt2.make_block(
        model, rngs=nnx.Rngs(jax.random.fold_in(blocks_key, i))))
              for i in range(model.n_layer)]
    if model.scan_layers:
      params["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
    else:
      params.update({f"blocks_{i}": b for i, b in enumerate(blocks)})
    return params

  return init


def _state_shapes(model: gpt2.GPT2Config, tx: Any, seed: int):
  init = layered_init(model)
  key = jax.random.key(seed)
  params = jax.eval_shape(init, key)
  model_shapes = jax.eval_shape(
      lambda: model_common.pure_params(model.build(rngs=nnx.Rngs(0))))
  if jax.tree.structure(params) != jax.tree.structure(model_shapes):
    raise AssertionError("layered_init's tree differs from the model's")
  return init, key, params, jax.eval_shape(tx.init, params)


def _nbytes(tree: Any) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


def _pool(config: Config, state_bytes: int) -> jcxl.Pool:
  fast = 0 if config.fast_tier == "none" else config.fast_capacity
  nvme = max(state_bytes - fast, 0) + state_bytes // 50 + _SLACK
  free = shutil.disk_usage(config.nvme_dir).free
  if nvme + _DISK_MARGIN > free:
    raise app.UsageError(
        f"the nvme tier needs {format_bytes(nvme)} in --nvme_dir "
        f"{config.nvme_dir!r}, which has {format_bytes(free)} free (and "
        f"{format_bytes(_DISK_MARGIN)} is left for others); use a smaller "
        "--n_layer")
  sizes = {"host": 0, "cxl": 0}
  if fast:
    sizes[config.fast_tier] = fast
  # spill: tiers_by_reads fills the fast tier to its last bytes by the
  # allocator's rules (slab spans, page-rounded extents); should a leaf it
  # counted in not fit there after all, it goes to nvme instead of failing
  # a run of half an hour.
  return jcxl.Pool(host=sizes["host"], cxl=sizes["cxl"], nvme=nvme,
                   nvme_dir=config.nvme_dir, chunk_bytes=config.chunk_bytes,
                   timeout_s=1800.0, spill=True)


def _step_line(i: int, row: dict[str, Any]) -> str:
  tiers = "  ".join(
      f"{t} r {format_bytes(r)} w {format_bytes(w)}"
      for t, (r, w) in row["tier_bytes"].items())
  rates = "  ".join(
      f"{t} GB/s r {bw['read'] / 1e9:.2f} w {bw['write'] / 1e9:.2f}"
      for t, bw in row["tier_gbps"].items())
  return (f"step {i:3d}  loss {row['loss']:.4f}  {row['step_s']:7.1f} s  "
          f"stall {row['stall_s']:6.1f} s  compute {row['compute_s']:6.1f} s"
          f"  {tiers}  {rates}")


def _run_step(step, params, opt_state, batch, pool) -> tuple[Any, dict]:
  before = _tier_bytes(pool)
  pool.transfer_records()  # forget earlier ones
  (params, opt_state, loss), profile = step.measured_call(params, opt_state,
                                                          batch)
  loss = float(loss)
  records = pool.transfer_records()
  after = _tier_bytes(pool)
  compute = (sum(profile.segment_compute_s) if profile.segment_compute_s
             else sum(l.compute_s for l in profile.layers))
  row = {"loss": loss, "step_s": profile.step_s, "stall_s": profile.stall_s,
         "compute_s": compute,
         "tier_bytes": {t: (after[t][0] - before[t][0],
                            after[t][1] - before[t][1]) for t in after},
         "nvme_gbps": nvme_bandwidth(records),
         "tier_gbps": {t: tier_bandwidth(records, t) for t in after}}
  return (params, opt_state), row


def _lower_bound(row: dict[str, Any], dd: dict[str, float]) -> float:
  read, written = row["tier_bytes"].get("nvme", (0, 0))
  return max(row["compute_s"], read / dd["read"] + written / dd["write"])


def _checkpoint_room(config: Config, state_bytes: int) -> tuple[bool, str]:
  free = shutil.disk_usage(config.nvme_dir).free
  need = int(state_bytes * 1.05) + _DISK_MARGIN
  if config.checkpoint == "off":
    return False, "--checkpoint=off"
  if need > free:
    return False, (f"the disk has {format_bytes(free)} free beside the nvme "
                   f"tier; a checkpoint of this state needs "
                   f"{format_bytes(need)} (with {format_bytes(_DISK_MARGIN)} "
                   "left for others)")
  return True, f"{format_bytes(free)} free beside the nvme tier"


def optimizer(config: Config) -> optax.GradientTransformation:
  """adamw, its learning rate warmed up linearly from a tenth of the peak
  over `warmup_steps`."""
  if not config.warmup_steps:
    return optax.adamw(config.learning_rate)
  return optax.adamw(optax.linear_schedule(
      config.learning_rate / 10, config.learning_rate, config.warmup_steps))


def run(config: Config) -> dict[str, Any]:
  with Progress(_PROGRESS_S.value if FLAGS.is_parsed() else 0) as progress:
    results = _run(config, progress)
  results["swap"] = dict(swap_status(),
                         max_vm_swap_bytes=progress.max_vm_swap)
  results["swap"]["none_swapped"] = progress.max_vm_swap == 0
  _say(f"swap: SwapTotal {format_bytes(results['swap']['swap_total_bytes'] or 0)}"
       f", largest VmSwap of this process {format_bytes(progress.max_vm_swap)}"
       f": {'nothing swapped' if progress.max_vm_swap == 0 else 'SWAPPED'}")
  common.write_json(os.path.join(config.run_dir, "results.json"), results)
  with open(os.path.join(config.run_dir, "results.md"), "w",
            encoding="utf-8") as f:
    f.write(markdown(results))
  _say(markdown(results))
  return results


def _run(config: Config, progress: Progress) -> dict[str, Any]:
  os.makedirs(config.run_dir, exist_ok=True)
  os.makedirs(config.nvme_dir, exist_ok=True)
  common.check_directory(config.nvme_dir, flag="--nvme_dir")
  started = time.time()
  machine = bench.describe_machine(config.nvme_dir)
  model = config.model()
  tx = optimizer(config)
  build, key, param_shapes, opt_shapes = _state_shapes(model, tx, config.seed)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(param_shapes))
  state_bytes = _nbytes((param_shapes, opt_shapes))
  physical = machine.memory_bytes
  rss = PeakRss()
  rss.window()
  _say(f"{machine}\nmodel: GPT-2 style, {n_params / 1e9:.3f}B parameters "
       f"(width {config.n_embd}, {config.n_layer} blocks, byte vocab), "
       f"state (fp32 params + adamw) {format_bytes(state_bytes)} = "
       f"{state_bytes / physical:.2f}x physical memory "
       f"({format_bytes(physical)})")
  progress.phase("dd before training")
  dd_before = dd_reference(config.nvme_dir, config.dd_bytes,
                           config.chunk_bytes)
  _say(f"dd O_DIRECT, {format_bytes(config.chunk_bytes)} requests: read "
       f"{dd_before['read'] / 1e9:.2f} GB/s, write "
       f"{dd_before['write'] / 1e9:.2f} GB/s")
  results: dict[str, Any] = {
      "config": dataclasses.asdict(config), "machine": machine.to_json(),
      "commit": _commit(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "parameters": n_params, "state_bytes": state_bytes,
      "physical_memory_bytes": physical,
      "state_over_physical": state_bytes / physical}
  with _pool(config, state_bytes) as pool:
    labels = {t.value: s.label() for t, s in pool.stats().tiers.items()
              if s.enabled}
    results["tiers"] = labels
    results["links"] = {
        t: {"bandwidth": pool.link_estimate(t).bandwidth,
            "latency_s": pool.link_estimate(t).latency_s}
        for t in labels if t != "nvme"}
    _say("pool: " + "; ".join(f"{l}, {format_bytes(pool.stats()[t].capacity)}"
                              for t, l in labels.items()))
    t0 = time.perf_counter()
    nvme_share = max(state_bytes - sum(
        pool.stats()[t].capacity for t in labels if t != "nvme"), 0)
    progress.phase("init in the pool", nvme_share)
    param_kinds, opt_kinds = jcxl.tiers_by_reads(
        [(param_shapes, 3), (opt_shapes, 1)], pool)
    params = jcxl.init_in_pool(build, key, pool=pool, kinds=param_kinds)
    opt_state = jcxl.init_in_pool(tx.init, params, pool=pool, kinds=opt_kinds)
    init_s = time.perf_counter() - t0
    init_peak = rss.window()
    largest_leaf = max(_nbytes(x) for x in jax.tree.leaves(
        (param_shapes, opt_shapes)))
    _say(f"init in the pool: {init_s:.1f} s, peak RSS "
         f"{format_bytes(init_peak)} (largest leaf "
         f"{format_bytes(largest_leaf)})")
    results["init"] = {"seconds": init_s, "peak_rss_bytes": init_peak,
                       "largest_leaf_bytes": largest_leaf}
    corpus = data.load_stdlib_corpus()
    batches = corpus.batches("train", config.batch, config.seq_len,
                             seed=config.seed)
    batches = [next(batches) for _ in range(config.steps)]
    step = jcxl.cxl_offload(common.make_train_step(gpt2.make_loss(model), tx),
                            schedule="fixed:1")
    t0 = time.perf_counter()
    progress.phase("compile")
    step.compile(params, opt_state, batches[0])
    results["compile_s"] = time.perf_counter() - t0
    _say(f"compiled in {results['compile_s']:.1f} s\n{step.plan}")
    results["plan"] = str(step.plan)
    room, why = _checkpoint_room(config, state_bytes)
    rows = []
    saved = None
    ckpt_dir = os.path.join(config.nvme_dir, "big_model-checkpoint")
    for i in range(config.steps):
      if i == config.steps - 1 and room:
        rss.window()
        t0 = time.perf_counter()
        progress.phase("checkpoint save", state_bytes)
        saved = jcxl.checkpoint.save(
            ckpt_dir, {"params": params, "opt_state": opt_state})
        save_s = time.perf_counter() - t0
        save_peak = rss.window()
        _say(f"checkpoint saved: {format_bytes(state_bytes)} in {save_s:.1f} s"
             f", peak RSS {format_bytes(save_peak)}")
      progress.phase(f"step {i + 1}")
      (params, opt_state), row = _run_step(step, params, opt_state,
                                           batches[i], pool)
      row["lower_bound_s"] = _lower_bound(row, dd_before)  # for now
      rows.append(row)
      _say(_step_line(i + 1, row))
    results["steps"] = rows
    results["peak_rss_steps_bytes"] = rss.window()
    if saved is not None:
      t0 = time.perf_counter()
      progress.phase("checkpoint restore")
      jcxl.checkpoint.restore_into(saved, {"params": params,
                                           "opt_state": opt_state})
      restore_s = time.perf_counter() - t0
      progress.phase(f"step {config.steps} again, from the checkpoint")
      (params, opt_state), again = _run_step(step, params, opt_state,
                                             batches[-1], pool)
      equal = again["loss"] == rows[-1]["loss"]
      _say(f"resumed from the checkpoint ({restore_s:.1f} s): step "
           f"{config.steps} loss {again['loss']:.6f} vs uninterrupted "
           f"{rows[-1]['loss']:.6f}: {'EQUAL' if equal else 'DIFFERENT'}")
      results["checkpoint"] = {
          "size": "big", "bytes": state_bytes, "save_s": save_s,
          "save_peak_rss_bytes": save_peak, "restore_s": restore_s,
          "resumed_loss": again["loss"],
          "uninterrupted_loss": rows[-1]["loss"], "equal": equal}
      shutil.rmtree(ckpt_dir, ignore_errors=True)
    else:
      _say(f"checkpoint skipped: {why}")
      results["checkpoint"] = {"skipped": why}
  progress.phase("dd after training")
  dd_after = dd_reference(config.nvme_dir, config.dd_bytes,
                          config.chunk_bytes)
  results["dd"] = {"before": dd_before, "after": dd_after}
  results["peak_rss_bytes"] = max(rss.run_peak, rss.window())
  results["wall_s"] = time.time() - started
  _summarize(results)
  return results


def _summarize(results: dict[str, Any]) -> None:
  """Ratios against the reference measured in the same run."""
  dd = {d: max(results["dd"]["before"][d], results["dd"]["after"][d])
        for d in ("read", "write")}
  timed = results["steps"][1:] or results["steps"]  # the first warms up
  nvme = {d: float(np.mean([r["nvme_gbps"][d] for r in timed]))
          for d in ("read", "write")}
  results["nvme_vs_dd"] = {
      "dd_read": dd["read"], "dd_write": dd["write"],
      "read": nvme["read"], "write": nvme["write"],
      "read_ratio": nvme["read"] / dd["read"],
      "write_ratio": nvme["write"] / dd["write"]}
  for row in results["steps"]:
    row["lower_bound_s"] = _lower_bound(row, dd)
  for tier, link in results.get("links", {}).items():
    rates = {d: float(np.mean([r["tier_gbps"][tier][d] for r in timed]))
             for d in ("read", "write")}
    results[f"{tier}_vs_link"] = {
        "link": link["bandwidth"], "read": rates["read"],
        "write": rates["write"], "read_ratio": rates["read"] / link["bandwidth"],
        "write_ratio": rates["write"] / link["bandwidth"]}
  results["step_vs_bound"] = [
      r["step_s"] / r["lower_bound_s"] for r in results["steps"]]
  results["peak_rss_over_physical"] = (results["peak_rss_bytes"] /
                                       results["physical_memory_bytes"])
  results["peak_rss_over_state"] = (results["peak_rss_bytes"] /
                                    results["state_bytes"])


def markdown(r: dict[str, Any]) -> str:
  c = r["config"]
  gb = lambda x: f"{x / 1e9:.2f}"
  lines = [
      f"# big_model: {r['parameters'] / 1e9:.3f}B parameters, state "
      f"{r['state_over_physical']:.2f}x physical memory",
      "",
      f"- date: {r['date']}; commit: {r['commit']}",
      f"- machine: {r['machine']['usable_cores']} cores "
      f"{r['machine']['cpu_model']}, {format_bytes(r['physical_memory_bytes'])}"
      f" memory; disk: {r['machine']['disk']['device']} "
      f"({r['machine']['disk']['fs_type']})",
      f"- config: width {c['n_embd']}, {c['n_layer']} blocks, {c['n_head']} "
      f"heads, byte vocab, batch {c['batch']} x {c['seq_len']} tokens, "
      f"{c['steps']} steps, adamw lr {c['learning_rate']} (linear warmup "
      f"from a tenth over {c['warmup_steps']} steps), fast tier "
      f"{c['fast_tier']} {format_bytes(c['fast_capacity'])}, request "
      f"{format_bytes(c['chunk_bytes'])}",
      "- tiers: " + "; ".join(r["tiers"].values()),
      "",
      f"state {format_bytes(r['state_bytes'])}; peak RSS "
      f"{format_bytes(r['peak_rss_bytes'])} = "
      f"{r['peak_rss_over_physical']:.2f}x physical memory, "
      f"{r['peak_rss_over_state']:.2f}x the state; init in the pool "
      f"{r['init']['seconds']:.0f} s (peak RSS "
      f"{format_bytes(r['init']['peak_rss_bytes'])}, largest leaf "
      f"{format_bytes(r['init']['largest_leaf_bytes'])}); compile "
      f"{r['compile_s']:.0f} s",
      "",
      "| step | loss | step s | stall s | compute s | lower bound s | "
      "step / bound | nvme read GB | nvme written GB | nvme read GB/s | "
      "nvme write GB/s | other tiers r/w GB | other tiers r/w GB/s |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | "
      "--- | --- |"]
  for i, (row, ratio) in enumerate(zip(r["steps"], r["step_vs_bound"])):
    nr, nw = row["tier_bytes"].get("nvme", (0, 0))
    other = ", ".join(f"{t} {gb(a)}/{gb(b)}" for t, (a, b) in
                      row["tier_bytes"].items() if t != "nvme") or "-"
    rates = ", ".join(f"{t} {gb(v['read'])}/{gb(v['write'])}" for t, v in
                      row.get("tier_gbps", {}).items() if t != "nvme") or "-"
    lines.append(
        f"| {i + 1} | {row['loss']:.4f} | {row['step_s']:.1f} | "
        f"{row['stall_s']:.1f} | {row['compute_s']:.1f} | "
        f"{row['lower_bound_s']:.1f} | "
        f"{ratio:.2f} | {gb(nr)} | {gb(nw)} | "
        f"{gb(row['nvme_gbps']['read'])} | {gb(row['nvme_gbps']['write'])} | "
        f"{other} | {rates} |")
  v = r["nvme_vs_dd"]
  lines += [
      "",
      f"nvme tier during training (steps 2 on, busy time) vs dd O_DIRECT "
      f"with the same request size, same run (best of before/after): read "
      f"{gb(v['read'])} / {gb(v['dd_read'])} GB/s = {v['read_ratio']:.2f}, "
      f"write {gb(v['write'])} / {gb(v['dd_write'])} GB/s = "
      f"{v['write_ratio']:.2f} (target >= 0.90 each). dd before: read "
      f"{gb(r['dd']['before']['read'])}, write "
      f"{gb(r['dd']['before']['write'])}; after: read "
      f"{gb(r['dd']['after']['read'])}, write "
      f"{gb(r['dd']['after']['write'])} GB/s.",
      ""]
  for tier in r.get("links", {}):
    v = r[f"{tier}_vs_link"]
    lines += [
        f"{tier} tier during training (steps 2 on, busy time) vs its link's "
        f"{gb(v['link'])} GB/s: read {gb(v['read'])} GB/s = "
        f"{v['read_ratio']:.2f}, write {gb(v['write'])} GB/s = "
        f"{v['write_ratio']:.2f}.", ""]
  sw = r.get("swap")
  if sw:
    lines += [
        f"swap: SwapTotal {format_bytes(sw['swap_total_bytes'] or 0)}; this "
        f"process's VmSwap at most {format_bytes(sw['max_vm_swap_bytes'])} "
        f"(sampled every progress line and at the end): "
        f"{'nothing swapped' if sw['none_swapped'] else 'SWAPPED'}.", ""]
  ck = r["checkpoint"]
  if "skipped" in ck:
    lines.append(f"checkpoint: skipped at this size: {ck['skipped']}.")
  else:
    lines.append(
        f"checkpoint of the full state ({format_bytes(ck['bytes'])}): save "
        f"{ck['save_s']:.0f} s, peak RSS "
        f"{format_bytes(ck['save_peak_rss_bytes'])}"
        f"; restore {ck['restore_s']:.0f} s; resumed step loss "
        f"{ck['resumed_loss']:.6f} vs uninterrupted "
        f"{ck['uninterrupted_loss']:.6f}: "
        f"{'equal' if ck['equal'] else 'DIFFERENT'}.")
  lines += ["", "plan:", "```", r["plan"], "```", ""]
  return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
  common.run_program(argv, config_from_flags, run)


if __name__ == "__main__":
  host_allocator.start()
  app.run(main, flags_parser=common.flags_parser(FLAGS, __doc__))
