r"""Train a GPT-style model whose state is twice this machine's memory.

The model's size comes from the machine: with ``--n_layer=0`` (the
default) it has the fewest blocks of ``--n_embd`` whose fp32 weights and
adamw moments (12 bytes a parameter) are at least ``--state_over_memory``
(2.0) x physical memory. The state is created straight into the pool a
leaf at a time (``jcxl.init_in_pool``), never whole in memory, in a small
fast tier (the emulated cxl tier) and an nvme tier on a real disk behind
it; ``jcxl.tiers_by_reads`` puts the leaves a step reads most often in the
fast tier.

The step is ``jcxl.cxl_offload`` of the plain train step (``jax.value_and_
grad`` of the loss, ``optax.adamw``) over unrolled blocks, with
``update='host'``: adamw runs on the host next to the state, in place on
the pool's objects (nvme state staged through memory), as ZeRO-Infinity
does, and only weights and gradients cross the device link. The model
computes in bfloat16 from the fp32 master weights (``dtype=bfloat16``), so
the host update also writes each weight's bfloat16 copy, which the step
fetches in place of the master (docs/host-update.md). ``--refetch`` (on)
fetches a block's weights for the forward pass and again for the backward
pass: on XLA:CPU the device is this machine's memory, and keeping every
block's weights between the two would hold 2 bytes a parameter in it. The
gradients of nvme state go to a memory tier while it has room, then to
nvme (the pool spills): a memory tier holding all of them would be 2
bytes a parameter too.

Per step it records the loss and a breakdown: the step's wall time, its
compute (``StepProfile``: the step less its waits on copies), its waits
on the pool's copies (reads and writes together: ``StepProfile.stall_s``
does not split them), the host update's time (``pool.updates.stats()``,
run start to end, summed), the time the disk was busy reading and
writing (the transfer records), and the bytes: this process's disk reads
and writes (/proc/self/io, O_DIRECT included), the device's fetches and
stores per tier and the update's bytes. From those, bytes per parameter
per step against the data flow's minimum (the nvme state read and written
once, bfloat16 weights in and gradients out once), the excess split by
cause (``big_model_bounds.bytes_per_param``).

The lower bound of a step is max(compute alone, disk bytes read / dd's
read rate + bytes written / dd's write rate). ``dd`` writes and reads a
file in ``--nvme_dir`` with O_DIRECT and the pool's request size before
and after training, and a smaller probe (``DiskProbe``) before the first
step and after each: a step's reference is the faster of the probes
beside it, per direction (the disk's rate drifts within a run; the ratio
against the faster of before and after is reported too). Compute
alone is the step's device work under plain ``jax.jit`` with its state
resident (with ``update='host'`` the forward and backward pass: the
optimizer runs on the host beside it, its time reported apart), timed in
a child process (its memory is not this one's) at 1 and 3 blocks of the
run's width and extrapolated linearly to the run's blocks: at full size
the resident state does not fit in memory, and the streamed step's own
compute (the profile's) includes its copies' CPU time on this machine's
shared cores. The run reports the median and worst
step / bound over the last 10 steps, peak RSS against 0.3x physical
memory, and whether anything was swapped (SwapTotal, VmSwap sampled).

Resume (``--checkpoint=auto``): where the disk holds the nvme tier and a
checkpoint of the state together, the state is saved after the timed
steps (whose disk the checkpoint's I/O would share), one more step run,
the checkpoint restored into the same PoolArrays and that step run again:
its loss must equal the uninterrupted one. Where the disk does not hold
both, the run says so and, after the big model's pool is gone, does the
same at the largest number of blocks of the same width whose tier and
checkpoint fit (3 steps, then the check).

Results: ``<run_dir>/results.json`` and ``results.md``, and the shared
results file ``docs/results/big_model/<date>-<commit>.md`` (through
``experiments.results_file``). A run smaller than the issue asks (state
under 2x memory or fewer than 20 steps) says so in its title. The pool's
nvme files and the checkpoint are deleted at the end.

Command line (on this machine: 54 blocks of 2560, 4.25B parameters, 47.5
GiB of state = 2.02x its 23.54 GiB; see docs/scale.md):

  nice -n 5 python -m experiments.big_model

which is

  python -m experiments.big_model --n_embd=2560 --n_layer=0 \
      --state_over_memory=2.0 --n_head=20 --seq_len=64 --batch=1 \
      --steps=20 --learning_rate=1e-6 --warmup_steps=0 --update=host \
      --compute_dtype=bfloat16 --refetch --fast_tier=cxl \
      --fast_capacity=3GiB --checkpoint=auto \
      --nvme_dir=runs/big_model/nvme --run_dir=runs/big_model
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
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
from experiments import big_model_bounds as bounds
from experiments import big_model_report as report
from experiments import common
from experiments import flags as shared_flags
from experiments import host_allocator
from experiments import results_file
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
# What the issue asks of the full-size run.
FULL_STATE_OVER_MEMORY = 2.0
FULL_STEPS = 20
RESUME_STEPS = 3  # of the resume check at a smaller size

FLAGS = flags.FlagValues()
_N_EMBD = shared_flags.n_embd(FLAGS, default=2560, lower_bound=8)
_N_LAYER = shared_flags.n_layer(
    FLAGS, default=0, lower_bound=0, help_text="Blocks of the model; 0: "
    "the fewest whose state is --state_over_memory x physical memory.")
_STATE_OVER_MEMORY = flags.DEFINE_float(
    "state_over_memory", FULL_STATE_OVER_MEMORY, "With --n_layer=0: the "
    "state (fp32 weights and adamw moments) over physical memory.",
    lower_bound=0.0, flag_values=FLAGS)
_N_HEAD = flags.DEFINE_integer("n_head", 20, "Attention heads.",
                               lower_bound=1, flag_values=FLAGS)
_SEQ_LEN = shared_flags.seq_len(FLAGS, default=64, lower_bound=1)
_BATCH = shared_flags.batch(FLAGS, default=1, lower_bound=1)
_STEPS = shared_flags.steps(FLAGS, default=FULL_STEPS,
                            help_text="Train steps.", lower_bound=2)
_LEARNING_RATE = flags.DEFINE_float(
    "learning_rate", LEARNING_RATE, "adamw's peak learning rate.",
    flag_values=FLAGS)
_WARMUP_STEPS = flags.DEFINE_integer(
    "warmup_steps", WARMUP_STEPS, "Linear warmup from a tenth of "
    "--learning_rate over this many steps (0: constant).", lower_bound=0,
    flag_values=FLAGS)
_SEED = shared_flags.seed(FLAGS)
_UPDATE = flags.DEFINE_enum(
    "update", "host", ["host", "device"], "Where adamw runs: next to the "
    "state on the host, or in the step (streaming the state through it).",
    flag_values=FLAGS)
_COMPUTE_DTYPE = flags.DEFINE_enum(
    "compute_dtype", "bfloat16", ["bfloat16", "float32"], "The model's "
    "compute dtype (its master weights are float32 either way).",
    flag_values=FLAGS)
_REFETCH = flags.DEFINE_boolean(
    "refetch", True, "Fetch a block's weights again for the backward pass "
    "(else they stay in memory, the device's, between the two).",
    flag_values=FLAGS)
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
    "Save after the steps, run one more, restore, run it again: at full "
    "size where the disk holds the tier and a checkpoint, else at the "
    "largest size that does (auto).", flag_values=FLAGS)
_RUN_DIR = shared_flags.run_dir(
    FLAGS, default=os.path.join("runs", "big_model"),
    help_text="Where results.json and results.md go; created if missing.")
# This machine's disk (a virtual one) reads a file just written faster for
# a few GiB than sustained: idle, six O_DIRECT reads of a 4 GiB file in a
# row gave 1.19 down to 0.85 GB/s, two of a 16 GiB file 0.68 and 0.63 GB/s.
# A step reads tens of GiB, so the reference reads 16 GiB.
_DD_BYTES = flags.DEFINE_string(
    "dd_bytes", "16GiB", "Size of the dd reference file (a step of the "
    "full-size run reads tens of GiB from nvme: the reference should be "
    "sustained, not a burst).", flag_values=FLAGS)

# The disk's rate drifts within a run (2x between the dd before and the dd
# after the 4.25B run's 20 steps): a probe next to each step measures what
# the disk gives then, not 40 minutes away.
_DD_PROBE_BYTES = flags.DEFINE_string(
    "dd_probe_bytes", "2GiB", "Before the first step and after each, dd "
    "writes this many bytes and reads as many (written by the probe before, "
    "with a step's traffic in between) with the pool's request size; each "
    "step's bound takes the faster of the probes beside it. 0: no probes "
    "(the bound takes --dd_bytes' before and after).", flag_values=FLAGS)

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
  dd_probe_bytes: int = 0
  scan_layers: bool = False
  update: str = "host"
  compute_dtype: str = "bfloat16"
  refetch: bool = True
  state_over_memory: float = FULL_STATE_OVER_MEMORY

  def validate(self) -> None:
    if os.path.exists(self.nvme_dir):
      common.check_directory(self.nvme_dir, flag="--nvme_dir")
    common.check_disk_backed(self.nvme_dir, flag="--nvme_dir")
    if self.n_layer < 1:
      raise ValueError(f"--n_layer must be at least 1, got {self.n_layer} "
                       "(0 is resolved from the machine's memory)")
    if self.n_embd % self.n_head:
      raise ValueError(f"--n_embd {self.n_embd} must be a multiple of "
                       f"--n_head {self.n_head}")
    if self.chunk_bytes % bench.PAGE_BYTES:
      raise ValueError(f"--chunk_bytes must be a multiple of "
                       f"{bench.PAGE_BYTES} (O_DIRECT), got {self.chunk_bytes}")
    if self.update == "host" and (self.fast_tier == "none" or
                                  not self.fast_capacity):
      raise ValueError(
          "--update=host needs a memory tier (--fast_tier=cxl or host with "
          "a --fast_capacity): the pool keeps nvme state's gradients there "
          f"first; got --fast_tier={self.fast_tier} --fast_capacity="
          f"{self.fast_capacity}")

  def model(self, n_layer: int | None = None) -> gpt2.GPT2Config:
    # Unrolled blocks: the step then updates each block as soon as its
    # gradient is ready. With scanned blocks the backward scan returns the
    # gradient of every block at once (11 GB at 2.8B parameters: the run
    # was killed for memory).
    return gpt2.GPT2Config(vocab_size=_VOCAB, n_ctx=max(self.seq_len, 64),
                           n_embd=self.n_embd,
                           n_layer=n_layer or self.n_layer,
                           n_head=self.n_head, scan_layers=self.scan_layers,
                           dtype=jnp.dtype(self.compute_dtype))

  def full_size(self, memory_bytes: int, state_bytes: int) -> bool:
    """Whether this run is the size the issue asks for."""
    return (state_bytes >= FULL_STATE_OVER_MEMORY * memory_bytes and
            self.steps >= FULL_STEPS)


def default_blocks(n_embd: int, seq_len: int, state_over_memory: float,
                   memory_bytes: int | None = None) -> int:
  """``--n_layer=0``'s blocks: the fewest of width `n_embd` whose state is
  `state_over_memory` x this machine's physical memory."""
  if memory_bytes is None:
    memory_bytes = bench.describe_machine().memory_bytes
  return bounds.blocks_for_state(memory_bytes, state_over_memory, n_embd,
                                 _VOCAB, max(seq_len, 64))


def config_from_flags() -> Config:
  n_layer = _N_LAYER.value or default_blocks(
      _N_EMBD.value, _SEQ_LEN.value, _STATE_OVER_MEMORY.value)
  return Config(
      n_embd=_N_EMBD.value, n_layer=n_layer, n_head=_N_HEAD.value,
      seq_len=_SEQ_LEN.value, batch=_BATCH.value, steps=_STEPS.value,
      learning_rate=_LEARNING_RATE.value, warmup_steps=_WARMUP_STEPS.value,
      seed=_SEED.value,
      fast_tier=_FAST_TIER.value,
      fast_capacity=parse_bytes(_FAST_CAPACITY.value, name="--fast_capacity"),
      nvme_dir=_NVME_DIR.value,
      chunk_bytes=parse_bytes(_CHUNK.value, name="--chunk_bytes"),
      checkpoint=_CHECKPOINT.value, run_dir=_RUN_DIR.value,
      dd_bytes=parse_bytes(_DD_BYTES.value, name="--dd_bytes"),
      dd_probe_bytes=parse_bytes(_DD_PROBE_BYTES.value,
                                 name="--dd_probe_bytes"),
      scan_layers=_SCAN_LAYERS.value, update=_UPDATE.value,
      compute_dtype=_COMPUTE_DTYPE.value, refetch=_REFETCH.value,
      state_over_memory=_STATE_OVER_MEMORY.value)


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


def _dd_write(path: str, block: int, count: int, seek: int | None = None
              ) -> bench.DdReport:
  """`count` O_DIRECT requests of `block` zeros into `path` (from request
  `seek` on, the rest of the file kept), synced."""
  at = [] if seek is None else [f"seek={seek}"]
  conv = "conv=fsync" if seek is None else "conv=fsync,notrunc"
  return _dd(["if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}",
              *at, "oflag=direct", conv])


def _dd_read(path: str, block: int, count: int | None = None, skip: int = 0
             ) -> bench.DdReport:
  """O_DIRECT requests of `block` from `path` (`count` of them from request
  `skip` on; all of it by default)."""
  some = [] if count is None else [f"count={count}", f"skip={skip}"]
  return _dd([f"if={path}", "of=/dev/null", f"bs={block}", *some,
              "iflag=direct"])


def dd_reference(directory: str, nbytes: int, block: int) -> dict[str, float]:
  """O_DIRECT write then read of a file of `nbytes` in `directory`, in
  requests of `block` bytes (queue depth 1); bytes per second."""
  path = os.path.join(directory, "big_model-dd-reference")
  try:
    wrote = _dd_write(path, block, max(1, nbytes // block))
    read = _dd_read(path, block)
  finally:
    if os.path.exists(path):
      os.remove(path)
  return {"read": read.bandwidth, "write": wrote.bandwidth}


class DiskProbe:
  """dd O_DIRECT beside each step: a file of two halves of `nbytes`; each
  `measure` writes one half and reads the other, which the probe before
  wrote (a step's traffic in between, so not a read of what was just
  written), in requests of `block`. Bytes per second."""

  def __init__(self, directory: str, nbytes: int, block: int):
    self.path = os.path.join(directory, "big_model-dd-probe")
    self.block = block
    self.count = max(1, nbytes // block)
    self._half = 0
    try:
      _dd_write(self.path, block, 2 * self.count)
    except BaseException:
      self.__exit__()  # not entered yet: the file would stay behind
      raise

  def measure(self) -> dict[str, float]:
    write, read = self._half, 1 - self._half
    self._half = read
    wrote = _dd_write(self.path, self.block, self.count,
                      seek=write * self.count)
    got = _dd_read(self.path, self.block, self.count, skip=read * self.count)
    return {"read": got.bandwidth, "write": wrote.bandwidth}

  def __enter__(self) -> DiskProbe:
    return self

  def __exit__(self, *exc) -> None:
    if os.path.exists(self.path):
      os.remove(self.path)


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



def _io_bytes() -> tuple[int, int]:
  """Bytes this process has read from and written to storage
  (/proc/self/io's read_bytes and write_bytes: O_DIRECT I/O included)."""
  out = {"read_bytes:": 0, "write_bytes:": 0}
  try:
    with open("/proc/self/io", encoding="utf-8") as f:
      for line in f:
        key = line.split(" ", 1)[0]
        if key in out:
          out[key] = int(line.split()[1])
  except OSError:
    pass
  return out["read_bytes:"], out["write_bytes:"]


# --------------------------------------------------------- compute alone


def measure_compute(payload: dict[str, Any]) -> dict[str, float]:
  """Seconds of the run's device compute with its state resident, per
  number of blocks in ``payload['blocks']``: the fastest of 5 steps after
  one that compiles (a lower bound, so the least disturbed by whatever
  else the machine runs). With ``update='host'`` that is the forward and
  backward pass (``jax.value_and_grad`` of the loss): the optimizer runs on
  the host beside the step, and its time is reported apart; with
  ``update='device'`` the whole train step. Runs in a child process: see
  `compute_alone`."""
  config = Config(**payload["config"])
  tx = optimizer(config)
  out = {}
  for n_layer in payload["blocks"]:
    model = config.model(n_layer)
    loss_fn = gpt2.make_loss(model)
    state = [model_common.init_params(model, seed=config.seed)]
    if config.update == "device":
      state.append(tx.init(state[0]))
      train_step = jax.jit(common.make_train_step(loss_fn, tx),
                           donate_argnums=(0, 1))
      step = lambda batch: train_step(*state, batch)
    else:
      grad_step = jax.jit(jax.value_and_grad(loss_fn))
      step = lambda batch: grad_step(state[0], batch)
    rng = np.random.default_rng(config.seed)
    tokens = lambda: jnp.asarray(rng.integers(
        0, _VOCAB, (config.batch, config.seq_len), dtype=np.int32))
    times = []
    for i in range(6):
      batch = {"x": tokens(), "y": tokens()}
      t0 = time.perf_counter()
      results = jax.block_until_ready(step(batch))
      if i:
        times.append(time.perf_counter() - t0)
      if config.update == "device":
        state[:] = results[:2]
      del results
    out[str(n_layer)] = min(times)
    del state
  return out


def compute_alone(config: Config, n_layer: int) -> dict[str, Any]:
  """The step's device compute with nothing offloaded, at `n_layer`
  blocks (see `measure_compute`).

  The resident step of the full model does not fit in memory, so a child
  process (whose memory is not this one's, and is gone after) times it at
  1 and 3 blocks of the run's width; a block's compute is half the
  difference, and the model's is the 1-block step plus the other blocks'
  (the blocks are the same work). Where the model is small enough, the
  child times it whole as well, which checks the extrapolation.
  """
  blocks = [1, 3]
  params = bounds.gpt2_params(config.n_embd, n_layer, _VOCAB,
                              max(config.seq_len, 64))
  direct = n_layer > 3 and 40 * params < common.mem_available() // 4
  if direct:
    blocks.append(n_layer)
  payload = {"config": dataclasses.asdict(config), "blocks": blocks}
  code = ("import json, sys\n"
          "from experiments import big_model\n"
          "print('COMPUTE ' + json.dumps(big_model.measure_compute("
          "json.loads(sys.argv[1]))), flush=True)\n")
  done = subprocess.run([sys.executable, "-c", code, json.dumps(payload)],
                        cwd=results_file.REPO_ROOT, capture_output=True,
                        text=True, timeout=3600, check=False)
  line = next((l for l in done.stdout.splitlines()
               if l.startswith("COMPUTE ")), None)
  if done.returncode != 0 or line is None:
    raise RuntimeError("timing the resident step failed (exit "
                       f"{done.returncode}): {done.stderr.strip()[-2000:]}")
  times = json.loads(line[len("COMPUTE "):])
  per_block = max(times["3"] - times["1"], 0.0) / 2
  out = {"blocks_1_s": times["1"], "blocks_3_s": times["3"],
         "per_block_s": per_block,
         "seconds": times["1"] + (n_layer - 1) * per_block,
         "n_layer": n_layer}
  if direct:
    out["measured_whole_s"] = times[str(n_layer)]
  return out


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



def _nvme_tier(config: Config, state_bytes: int, param_bytes: int,
               probe: int = 0) -> int:
  """The nvme tier's bytes; app.UsageError where the disk lacks them (and
  `probe` bytes for DiskProbe's file beside it)."""
  fast = config.fast_capacity if config.fast_tier != "none" else 0
  nvme = bounds.nvme_tier_bytes(state_bytes, param_bytes, fast, _SLACK)
  free = shutil.disk_usage(config.nvme_dir).free
  if nvme + probe + _DISK_MARGIN > free:
    raise app.UsageError(
        f"the nvme tier needs {format_bytes(nvme)} in --nvme_dir "
        f"{config.nvme_dir!r}"
        + (f" and dd's probe {format_bytes(probe)} beside it" if probe else "")
        + f", which has {format_bytes(free)} free (and "
        f"{format_bytes(_DISK_MARGIN)} is left for others); use a smaller "
        "--n_layer" + (" or --dd_probe_bytes" if probe else ""))
  return nvme


def _probe_bytes(config: Config, probe: bool) -> int:
  """Disk DiskProbe's file takes in a run that probes."""
  return 2 * config.dd_probe_bytes if probe else 0


def _pool(config: Config, state_bytes: int, param_bytes: int,
          probe: bool) -> jcxl.Pool:
  fast = config.fast_capacity if config.fast_tier != "none" else 0
  nvme = _nvme_tier(config, state_bytes, param_bytes,
                    _probe_bytes(config, probe))
  sizes = {"host": 0, "cxl": 0}
  if fast:
    sizes[config.fast_tier] = fast
  # spill: tiers_by_reads fills the fast tier to its last bytes by the
  # allocator's rules; a leaf that does not fit there after all, and the
  # gradients and weight copies the host update makes once it is full, go
  # to nvme instead of failing.
  return jcxl.Pool(host=sizes["host"], cxl=sizes["cxl"], nvme=nvme,
                   nvme_dir=config.nvme_dir, chunk_bytes=config.chunk_bytes,
                   timeout_s=1800.0, spill=True)


def _step_line(i: int, row: dict[str, Any]) -> str:
  gb = lambda x: f"{x / 1e9:.2f}"
  dd = row.get("dd_beside")
  probe = (f"  dd after: r {gb(dd['after']['read'])} w "
           f"{gb(dd['after']['write'])} GB/s" if dd else "")
  return (f"step {i:3d}  loss {row['loss']:.4f}  {row['step_s']:7.1f} s  "
          f"compute {row['compute_in_step_s']:6.1f} s  waits "
          f"{row['waits_s']:6.1f} s  host update {row['host_update_s']:6.1f}"
          f" s  disk r {gb(row['disk_read'])} GB ({row['disk_busy_read_s']:.1f}"
          f" s busy) w {gb(row['disk_written'])} GB "
          f"({row['disk_busy_write_s']:.1f} s busy)  link in "
          f"{gb(row['link_in'])} out {gb(row['link_out'])} GB{probe}")


def _run_step(step, params, opt_state, batch, pool) -> tuple[Any, dict]:
  before = _tier_bytes(pool)
  io0 = _io_bytes()
  upd0 = pool.updates.stats()
  pool.transfer_records()  # forget earlier ones
  (params, opt_state, loss), profile = step.measured_call(params, opt_state,
                                                          batch)
  loss = float(loss)
  upd1 = pool.updates.stats()
  io1 = _io_bytes()
  records = pool.transfer_records()
  after = _tier_bytes(pool)
  moved = {t: (after[t][0] - before[t][0], after[t][1] - before[t][1])
           for t in after}
  nvme = nvme_bandwidth(records)
  # The profile's compute is the step less its waits on copies, over its
  # layers' segments (the time before the first fetch included).
  compute = (sum(profile.segment_compute_s) if profile.segment_compute_s
             else sum(l.compute_s for l in profile.layers))
  row = {"loss": loss, "step_s": profile.step_s,
         "compute_in_step_s": compute, "waits_s": profile.stall_s,
         "host_update_s": (upd1.busy_ns - upd0.busy_ns) * 1e-9,
         "host_update_runs": upd1.runs - upd0.runs,
         "host_update_bytes_read": upd1.bytes_read - upd0.bytes_read,
         "host_update_bytes_written": upd1.bytes_written - upd0.bytes_written,
         "disk_busy_read_s": nvme["read_busy_s"],
         "disk_busy_write_s": nvme["write_busy_s"],
         "disk_read": io1[0] - io0[0], "disk_written": io1[1] - io0[1],
         "link_in": sum(r for r, _ in moved.values()),
         "link_out": sum(w for _, w in moved.values()),
         "nvme_fetched": moved.get("nvme", (0, 0))[0],
         "nvme_stored": moved.get("nvme", (0, 0))[1],
         "tier_bytes": moved, "nvme_gbps": nvme,
         "tier_gbps": {t: tier_bandwidth(records, t) for t in after}}
  return (params, opt_state), row


def _checkpoint_room(config: Config, state_bytes: int, param_bytes: int,
                     free: int) -> tuple[bool, str]:
  """Whether `free` bytes of disk hold the nvme tier and a checkpoint."""
  fast = config.fast_capacity if config.fast_tier != "none" else 0
  tier = bounds.nvme_tier_bytes(state_bytes, param_bytes, fast, _SLACK)
  need = tier + bounds.checkpoint_bytes(state_bytes) + _DISK_MARGIN
  if config.checkpoint == "off":
    return False, "--checkpoint=off"
  if need > free:
    return False, (f"the disk has {format_bytes(free)} free; the nvme tier "
                   f"({format_bytes(tier)}) and a checkpoint of the state "
                   f"({format_bytes(bounds.checkpoint_bytes(state_bytes))}) "
                   f"need {format_bytes(need)} with "
                   f"{format_bytes(_DISK_MARGIN)} left for others")
  return True, f"{format_bytes(free)} free, {format_bytes(need)} needed"


def optimizer(config: Config) -> optax.GradientTransformation:
  """adamw, its learning rate warmed up linearly from a tenth of the peak
  over `warmup_steps`."""
  if not config.warmup_steps:
    return optax.adamw(config.learning_rate)
  return optax.adamw(optax.linear_schedule(
      config.learning_rate / 10, config.learning_rate, config.warmup_steps))


def _pool_leaves(tree: Any) -> list[Any]:
  return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, jcxl.PoolArray))


def _leaf_bytes(x: Any) -> int:
  return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def train(config: Config, n_layer: int, steps: int, progress: Progress,
          rss: PeakRss, resume: bool, probe: bool = False) -> dict[str, Any]:
  """Trains `n_layer` blocks for `steps` steps in a pool of their own;
  with `resume`, then saves the state, runs one more step, restores the
  checkpoint and runs that step again; with `probe`, a ``DiskProbe``
  before the first step and after each (its rates in each step's row).
  The pool and the checkpoint are gone when it returns."""
  model = config.model(n_layer)
  tx = optimizer(config)
  build, key, param_shapes, opt_shapes = _state_shapes(model, tx, config.seed)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(param_shapes))
  param_bytes = _nbytes(param_shapes)
  state_bytes = _nbytes((param_shapes, opt_shapes))
  out: dict[str, Any] = {"n_layer": n_layer, "parameters": n_params,
                         "state_bytes": state_bytes, "steps_run": steps}
  corpus = data.load_stdlib_corpus()
  batches = corpus.batches("train", config.batch, config.seq_len,
                           seed=config.seed)
  # One more batch for the resume check's step, after the timed ones.
  batches = [next(batches) for _ in range(steps + resume)]
  with _pool(config, state_bytes, param_bytes, probe) as pool:
    labels = {t.value: s.label() for t, s in pool.stats().tiers.items()
              if s.enabled}
    out["tiers"] = labels
    out["links"] = {
        t: {"bandwidth": pool.link_estimate(t).bandwidth,
            "latency_s": pool.link_estimate(t).latency_s}
        for t in labels if t != "nvme"}
    _say("pool: " + "; ".join(f"{l}, {format_bytes(pool.stats()[t].capacity)}"
                              for t, l in labels.items()))
    t0 = time.perf_counter()
    progress.phase("init in the pool", state_bytes)
    param_kinds, opt_kinds = jcxl.tiers_by_reads(
        [(param_shapes, 3), (opt_shapes, 1)], pool)
    params = jcxl.init_in_pool(build, key, pool=pool, kinds=param_kinds)
    opt_state = jcxl.init_in_pool(tx.init, params, pool=pool, kinds=opt_kinds)
    init_s = time.perf_counter() - t0
    init_peak = rss.window()
    largest_leaf = max(_nbytes(x) for x in jax.tree.leaves(
        (param_shapes, opt_shapes)))
    nvme_state = sum(_leaf_bytes(x) for x in _pool_leaves((params, opt_state))
                     if isinstance(x, jcxl.PoolArray)
                     and jcxl.Tier(x.tier).value == "nvme")
    out["nvme_state_bytes"] = nvme_state
    _say(f"init in the pool: {init_s:.1f} s, peak RSS "
         f"{format_bytes(init_peak)} (largest leaf "
         f"{format_bytes(largest_leaf)}); {format_bytes(nvme_state)} of the "
         "state on nvme")
    out["init"] = {"seconds": init_s, "peak_rss_bytes": init_peak,
                   "largest_leaf_bytes": largest_leaf}
    step = jcxl.cxl_offload(common.make_train_step(gpt2.make_loss(model), tx),
                            schedule="fixed:1", update=config.update,
                            refetch=config.refetch)
    t0 = time.perf_counter()
    progress.phase("compile")
    step.compile(params, opt_state, batches[0])
    out["compile_s"] = time.perf_counter() - t0
    _say(f"compiled in {out['compile_s']:.1f} s\n{step.plan}")
    out["plan"] = str(step.plan)
    out["weight_copies"] = next(
        (u for u in getattr(step.plan, "updates", ())
         if u.startswith("weight copies")), "")
    rows = []
    ckpt_dir = os.path.join(config.nvme_dir, "big_model-checkpoint")
    with contextlib.ExitStack() as stack:
      disk = (stack.enter_context(DiskProbe(
          config.nvme_dir, config.dd_probe_bytes, config.chunk_bytes))
              if probe and config.dd_probe_bytes else None)
      before = disk.measure() if disk else None
      for i in range(steps):
        progress.phase(f"step {i + 1}")
        (params, opt_state), row = _run_step(step, params, opt_state,
                                             batches[i], pool)
        if disk:
          after = disk.measure()
          row["dd_beside"] = {"before": before, "after": after}
          before = after
        rows.append(row)
        _say(_step_line(i + 1, row))
    out["steps"] = rows
    out["peak_rss_steps_bytes"] = rss.window()
    if resume:
      # After the timed steps, which the checkpoint's I/O would disturb:
      # save, run one more step, restore, run that step again.
      t0 = time.perf_counter()
      progress.phase("checkpoint save", state_bytes)
      saved = jcxl.checkpoint.save(
          ckpt_dir, {"params": params, "opt_state": opt_state})
      save_s = time.perf_counter() - t0
      save_peak = rss.window()
      _say(f"checkpoint saved: {format_bytes(state_bytes)} in {save_s:.1f} s"
           f", peak RSS {format_bytes(save_peak)}")
      progress.phase(f"step {steps + 1}")
      (params, opt_state), once = _run_step(step, params, opt_state,
                                            batches[-1], pool)
      t0 = time.perf_counter()
      progress.phase("checkpoint restore")
      jcxl.checkpoint.restore_into(saved, {"params": params,
                                           "opt_state": opt_state})
      restore_s = time.perf_counter() - t0
      progress.phase(f"step {steps + 1} again, from the checkpoint")
      (params, opt_state), again = _run_step(step, params, opt_state,
                                             batches[-1], pool)
      equal = again["loss"] == once["loss"]
      _say(f"resumed from the checkpoint ({restore_s:.1f} s): step "
           f"{steps + 1} loss {again['loss']:.6f} vs uninterrupted "
           f"{once['loss']:.6f}: {'EQUAL' if equal else 'DIFFERENT'}")
      out["checkpoint"] = {
          "n_layer": n_layer, "parameters": n_params, "bytes": state_bytes,
          "save_s": save_s, "save_peak_rss_bytes": save_peak,
          "restore_s": restore_s, "resumed_loss": again["loss"],
          "uninterrupted_loss": once["loss"], "equal": equal}
      shutil.rmtree(ckpt_dir, ignore_errors=True)
    del step, params, opt_state
  return out


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
    f.write(report.markdown(results))
  _say(report.markdown(results))
  return results


def _run(config: Config, progress: Progress) -> dict[str, Any]:
  os.makedirs(config.run_dir, exist_ok=True)
  os.makedirs(config.nvme_dir, exist_ok=True)
  common.check_directory(config.nvme_dir, flag="--nvme_dir")
  started = time.time()
  machine = bench.describe_machine(config.nvme_dir)
  model = config.model()
  _, _, param_shapes, opt_shapes = _state_shapes(model, optimizer(config),
                                                 config.seed)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(param_shapes))
  param_bytes = _nbytes(param_shapes)
  state_bytes = _nbytes((param_shapes, opt_shapes))
  physical = machine.memory_bytes
  full = config.full_size(physical, state_bytes)
  rss = PeakRss()
  rss.window()
  _say(f"{machine}\nmodel: GPT-2 style, {n_params / 1e9:.3f}B parameters "
       f"(width {config.n_embd}, {config.n_layer} blocks, byte vocab, "
       f"{config.compute_dtype} compute), state (fp32 weights + adamw) "
       f"{format_bytes(state_bytes)} = {state_bytes / physical:.2f}x "
       f"physical memory ({format_bytes(physical)}); update={config.update}"
       + ("" if full else "; SMALLER than the issue's run (state under "
          f"{FULL_STATE_OVER_MEMORY}x memory or under {FULL_STEPS} steps)"))
  _nvme_tier(config, state_bytes, param_bytes,  # before dd and the rest
             _probe_bytes(config, probe=True))
  free = shutil.disk_usage(config.nvme_dir).free
  room, why = _checkpoint_room(config, state_bytes, param_bytes, free)
  results: dict[str, Any] = {
      "full_size": full,
      "config": dataclasses.asdict(config), "machine": machine.to_json(),
      "commit": results_file.commit()[1],
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "parameters": n_params, "state_bytes": state_bytes,
      "param_bytes": param_bytes, "physical_memory_bytes": physical,
      "state_over_physical": state_bytes / physical,
      "disk_free_bytes": free,
      "load_average": {"start": list(machine.load_average)}}
  progress.phase("dd before training")
  dd_before = dd_reference(config.nvme_dir, config.dd_bytes,
                           config.chunk_bytes)
  _say(f"dd O_DIRECT, {format_bytes(config.chunk_bytes)} requests: read "
       f"{dd_before['read'] / 1e9:.2f} GB/s, write "
       f"{dd_before['write'] / 1e9:.2f} GB/s")
  progress.phase("compute alone (resident jax.jit, a child process)")
  results["compute_alone"] = compute_alone(config, config.n_layer)
  _say("compute alone (resident jax.jit step, extrapolated from 1 and 3 "
       f"blocks): {results['compute_alone']['seconds']:.2f} s")
  big = train(config, config.n_layer, config.steps, progress, rss, room,
              probe=True)
  results.update({k: v for k, v in big.items()
                  if k not in ("parameters", "state_bytes")})
  if room:
    results["checkpoint"] = dict(big["checkpoint"], size="full",
                                 why=why)
  elif config.checkpoint == "off":
    results["checkpoint"] = {"skipped": why}
  else:
    results["checkpoint"] = _resume_smaller(config, progress, rss, why)
  progress.phase("dd after training")
  dd_after = dd_reference(config.nvme_dir, config.dd_bytes,
                          config.chunk_bytes)
  results["dd"] = {"before": dd_before, "after": dd_after}
  results["load_average"]["end"] = list(os.getloadavg())
  results["peak_rss_bytes"] = max(rss.run_peak, rss.window())
  results["wall_s"] = time.time() - started
  report.summarize(results)
  return results


def _resume_smaller(config: Config, progress: Progress, rss: PeakRss,
                    why: str) -> dict[str, Any]:
  """The resume check at the largest size whose tier and checkpoint fit
  the disk now (the big model's tier is gone)."""
  fast = config.fast_capacity if config.fast_tier != "none" else 0
  free = shutil.disk_usage(config.nvme_dir).free
  n_layer = min(config.n_layer, bounds.largest_blocks_that_fit(
      free, _DISK_MARGIN, fast, _SLACK, config.n_embd, _VOCAB,
      max(config.seq_len, 64)))
  if n_layer < 1:
    _say(f"checkpoint skipped: {why}; not even one block fits with one")
    return {"skipped": f"{why}; not even one block of width "
                       f"{config.n_embd} fits with a checkpoint"}
  _say(f"checkpoint: not at full size ({why}); resuming at the largest "
       f"size that fits: {n_layer} blocks")
  small = train(config, n_layer, RESUME_STEPS, progress, rss, True)
  return dict(small["checkpoint"], size="smaller", why=why,
              state_bytes=small["state_bytes"],
              disk_free_bytes=free)


def main(argv: Sequence[str]) -> None:
  common.run_program(argv, config_from_flags, run)


if __name__ == "__main__":
  host_allocator.start()
  app.run(main, flags_parser=common.flags_parser(FLAGS, __doc__))
