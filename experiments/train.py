r"""Train a byte-level GPT-2 whose weights and Adam state live in the pool.

The model's parameters and optax adamw state are placed in one tier of a
``jcxl.Pool`` (by default ``cxl``, emulated on DRAM behind a link model where
the machine has no CXL memory) and the train step is rewritten by
``jcxl.cxl_offload`` to stream them in layer by layer, under a device memory
budget smaller than the parameters and optimizer state together. The data are
bytes of the Python standard library's sources (``models/data.py``), so
nothing is downloaded. ``--mode=resident`` trains the same model with plain
``jax.jit`` and everything on the device, as the baseline: for the same
--seed the two modes compute the same losses.

Before training the program compiles the resident step (state donated) to
read its device memory need from ``memory_analysis()``, and logs it next to
the offloaded step's need and the budget. Every --log_every steps it prints
the step, the train loss (mean since the last line), tokens per second, the
stall share (time the step waited for transfers, from ``step.report()``,
over wall time) and the bytes streamed; every line names the tier the state
is in with the pool's own label (for an emulated cxl tier: EMULATED and the
link). The validation loss is computed every --eval_every steps and at the
end by an offloaded forward step (weights streamed, never all on the
device).

The run directory gets config.json (flags, emulation, machine),
metrics.jsonl and metrics.csv, plan.txt and plan.json (the streaming plan),
summary.json, and loss.png, throughput.png and layer_stall.png.

With --checkpoint_every=N it saves the params, the adamw state (with its
step count), the step and the data position every N steps into
<run_dir>/checkpoints/<step> (``jcxl.checkpoint``: Orbax's format, streamed
from the pool, written atomically; the newest --keep_checkpoints are kept).
--resume continues from the latest of them (--resume=PATH: from that
checkpoint), exactly: the training batches' random generator, seeded by
--seed, is replayed to the data position, and the resumed run computes the
losses the uninterrupted one would have:

  python -m experiments.train --checkpoint_every=50 --run_dir=runs/a
  python -m experiments.train --checkpoint_every=50 --run_dir=runs/a --resume

On several processes (hosts) every process runs the same command with
--coordinator_address, --num_processes and --process_id (or the environment
variables JCXL_COORDINATOR_ADDRESS, JCXL_NUM_PROCESSES, JCXL_PROCESS_ID, or
--distributed alone where JAX detects the cluster); see experiments/cluster.py.
With more than one device in all (--cpu_devices=N gives N CPU devices), the
state is sharded FSDP-style over every device of every process, each process
keeping its shards in its own pool, and the batch's rows over the devices;
process 0 prints and writes the run directory, and every process writes
process-<i>.json (its devices, shard bytes and pool). A process that fails
stops the others (jcxl.distributed.fail_together); one that dies is noticed
after --heartbeat_timeout_s.

  python -m experiments.train --model=gpt2-tiny --batch_size=8 \
      --cpu_devices=4 --coordinator_address=127.0.0.1:12345 \
      --num_processes=2 --process_id=0     # and --process_id=1 beside it

Command line (the defaults; about 2.5 minutes on a 2-core machine):

  python -m experiments.train --model=byte-gpt --steps=200 --batch_size=4 \
      --seq_len=64 --learning_rate=3e-3 --warmup_steps=20 --eval_every=50 \
      --eval_batches=8 --seed=0 --mode=cxl --tier=cxl --schedule=fixed:1 \
      --device_budget=72MiB --link_gbps=16 --link_latency_us=2 \
      --log_every=10 --data_bytes=4MiB --run_dir=runs/train-<timestamp> \
      --checkpoint_every=0 --keep_checkpoints=2 --heartbeat_timeout_s=30
"""

from __future__ import annotations

import collections
import contextlib
import csv
import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any

from absl import app
from absl import flags
import jax
import numpy as np
import optax

import jcxl
from experiments import cluster
from experiments import common as experiments_common
from experiments import plots
from jcxl.planning import device_need
from jcxl.units import format_bytes
from jcxl.units import parse_bytes
from benchmarks import bench
from models import common
from models import data
from models import gpt2

# Flags live in a FlagValues of their own, not absl's global one: tests
# import several experiments into one process, and names such as --seed or
# --steps are common. ``parse_flags`` reads them, then absl's own.
FLAGS = flags.FlagValues()
_MODEL = flags.DEFINE_string(
    "model", "byte-gpt", "Model preset (see MODELS); all have 256 tokens.",
    flag_values=FLAGS)
_STEPS = flags.DEFINE_integer("steps", 200, "Training steps.",
                              flag_values=FLAGS)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 4, "Sequences per step.",
                                   flag_values=FLAGS)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 64, "Bytes per sequence.",
                                flag_values=FLAGS)
_LEARNING_RATE = flags.DEFINE_float(
    "learning_rate", 3e-3, "Peak adamw learning rate (warmup, then cosine "
    "decay to a tenth of it).", flag_values=FLAGS)
_WARMUP_STEPS = flags.DEFINE_integer(
    "warmup_steps", 20, "Linear warmup steps; fewer than --steps.",
    flag_values=FLAGS)
_EVAL_EVERY = flags.DEFINE_integer(
    "eval_every", 50, "Validation loss every this many steps (and at the end).",
    flag_values=FLAGS)
_EVAL_BATCHES = flags.DEFINE_integer(
    "eval_batches", 8, "Fixed validation batches per evaluation.",
    flag_values=FLAGS)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights and the data.",
                             flag_values=FLAGS)
_MODE = flags.DEFINE_string(
    "mode", "cxl", "cxl: state in the pool, step rewritten by cxl_offload; "
    "resident: plain jax.jit with everything on the device (the baseline).",
    flag_values=FLAGS)
_TIER = flags.DEFINE_string(
    "tier", "cxl", "Pool tier for the state: cxl, host or nvme.",
    flag_values=FLAGS)
_NVME_DIR = flags.DEFINE_string(
    "nvme_dir", None, "Existing, writable directory on a real disk for the "
    "nvme tier (default: the run directory).", flag_values=FLAGS)
_SCHEDULE = flags.DEFINE_string(
    "schedule", "fixed:1", "Streaming schedule passed to jcxl.cxl_offload.",
    flag_values=FLAGS)
_DEVICE_BUDGET = flags.DEFINE_string(
    "device_budget", "72MiB", "Device memory the offloaded step may use, "
    "e.g. '72MiB'; the default is under the byte-gpt model's parameters and "
    "adamw state together.", flag_values=FLAGS)
_LINK_GBPS = flags.DEFINE_float(
    "link_gbps", 16.0, "Bandwidth of the emulated cxl link, GB/s.",
    flag_values=FLAGS)
_LINK_LATENCY_US = flags.DEFINE_float(
    "link_latency_us", 2.0, "Per-transfer latency of the emulated cxl link.",
    flag_values=FLAGS)
_RUN_DIR = flags.DEFINE_string(
    "run_dir", None, "Where the run's files go (default "
    "runs/train-<timestamp>); created if missing.", flag_values=FLAGS)
_LOG_EVERY = flags.DEFINE_integer(
    "log_every", 10, "A progress line every this many steps.",
    flag_values=FLAGS)
_DATA_BYTES = flags.DEFINE_string(
    "data_bytes", "4MiB", "Bytes of standard-library sources to read.",
    flag_values=FLAGS)
_CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", 0, "Save a checkpoint (params, adamw state, step, "
    "data position) every this many steps into <run_dir>/checkpoints/<step>;"
    " 0: never.", flag_values=FLAGS)
_KEEP_CHECKPOINTS = flags.DEFINE_integer(
    "keep_checkpoints", 2, "Newest checkpoints kept; an older one is deleted "
    "once a newer one is complete.", flag_values=FLAGS)
_CLUSTER = cluster.define_flags(FLAGS)
RESUME_LATEST = "latest"


class _ResumeParser(flags.ArgumentParser):
  """``--resume`` alone: the run directory's latest checkpoint;
  ``--resume=PATH``: that checkpoint, or the latest in a directory of them."""

  def parse(self, argument: Any) -> str | None:
    if argument is True or argument == "true":
      return RESUME_LATEST
    if argument in (False, None, "", "false"):
      return None
    return str(argument)

  def flag_type(self) -> str:
    return "string"


_RESUME = flags.DEFINE_flag(flags.Flag(
    _ResumeParser(), flags.ArgumentSerializer(), "resume", None,
    "Continue from a checkpoint, exactly: --resume alone from the latest in "
    "--run_dir; --resume=PATH from that checkpoint (or the latest in the "
    "directory PATH). The other flags must match the run that wrote it.",
    boolean=True), flag_values=FLAGS)
# What a resumed run must share with the run that wrote its checkpoint to
# compute the same losses (the mode, tier and schedule may differ).
_RUN_IDENTITY = ("model", "steps", "batch_size", "seq_len", "learning_rate",
                 "warmup_steps", "seed", "data_bytes")


def byte_gpt(**overrides: Any) -> gpt2.GPT2Config:
  """The default: 6 blocks of width 320 over bytes (7.5M parameters).

  Wide for its batch on purpose: its weights and adamw state (86 MiB) weigh
  more than the activations of a 4 x 64 token step, the regime in which
  streaming the state lets a step run in less memory than the state.
  """
  return gpt2.GPT2Config(vocab_size=data.VOCAB_SIZE, n_ctx=128, n_embd=320,
                         n_layer=6, n_head=5, **overrides)


MODELS: dict[str, Callable[[], gpt2.GPT2Config]] = {
    "byte-gpt": byte_gpt,
    "gpt2-tiny": gpt2.tiny,
    **{f"gpt2-{name}": (lambda name=name: gpt2.preset(
        name, vocab_size=data.VOCAB_SIZE))
       for name in ("small", "medium", "large", "xl")},
}
MODES = ("cxl", "resident")
TIERS = ("cxl", "host", "nvme")
# Room for the allocator's alignment around many small objects.
_POOL_SLACK = 32 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """One training run."""
  model: str
  steps: int
  batch_size: int
  seq_len: int
  learning_rate: float
  warmup_steps: int
  eval_every: int
  eval_batches: int
  seed: int
  mode: str
  tier: str
  nvme_dir: str | None
  schedule: str
  device_budget: int
  link: jcxl.LinkModel
  run_dir: str
  log_every: int
  data_bytes: int
  checkpoint_every: int = 0
  keep_checkpoints: int = 2
  resume: str | None = None

  def model_config(self) -> gpt2.GPT2Config:
    return MODELS[self.model]()

  @property
  def checkpoint_dir(self) -> str:
    return os.path.join(self.run_dir, "checkpoints")

  def identity(self) -> dict[str, Any]:
    return {name: getattr(self, name) for name in _RUN_IDENTITY}

  def resume_path(self) -> str | None:
    """The checkpoint --resume names, or None if there is none."""
    if self.resume is None:
      return None
    if self.resume == RESUME_LATEST:
      return jcxl.checkpoint.latest(self.checkpoint_dir)
    if jcxl.checkpoint.is_complete(self.resume):
      return os.path.abspath(self.resume)
    return jcxl.checkpoint.latest(self.resume)

  def _validate_checkpoints(self) -> None:
    if self.checkpoint_every < 0:
      raise ValueError(f"--checkpoint_every must be >= 0 (0: no "
                       f"checkpoints), but got {self.checkpoint_every}")
    if self.keep_checkpoints < 1:
      raise ValueError(f"--keep_checkpoints must be positive, but got "
                       f"{self.keep_checkpoints}")
    if self.resume is None:
      return
    path = self.resume_path()
    if path is None:
      where = (f"--run_dir's {self.checkpoint_dir!r}"
               if self.resume == RESUME_LATEST else repr(self.resume))
      raise ValueError(f"--resume: no finished checkpoint in {where}; "
                       "pass --resume=PATH or drop --resume")
    saved = jcxl.checkpoint.read_metadata(path).get("train")
    if saved is None:
      raise ValueError(f"--resume: {path!r} was not written by "
                       "experiments.train")
    for name, value in self.identity().items():
      if saved["run"].get(name) != value:
        raise ValueError(
            f"--resume: {path!r} was written with --{name}="
            f"{saved['run'].get(name)!r}, but this run has --{name}={value!r}"
            "; a resumed run continues exactly only with the same "
            f"{', '.join('--' + n for n in _RUN_IDENTITY)}")
    if saved["step"] >= self.steps:
      raise ValueError(f"--resume: {path!r} is at step {saved['step']}, the "
                       f"last of --steps {self.steps}; nothing is left to run")
    later = [s for s in _finished_steps(self.checkpoint_dir)
             if s > saved["step"]]
    if later:
      raise ValueError(
          f"--resume: {self.checkpoint_dir!r} already holds checkpoints after"
          f" step {saved['step']} (steps {later}); resume from the latest "
          "(--resume) or pass a new --run_dir")

  def validate(self) -> None:
    """Raises ValueError naming the flag whose value is wrong."""
    if self.model not in MODELS:
      raise ValueError(f"--model must be one of "
                       f"{', '.join(map(repr, MODELS))}, but got "
                       f"{self.model!r}")
    for flag in ("steps", "batch_size", "seq_len", "eval_every",
                 "eval_batches", "log_every"):
      if getattr(self, flag) <= 0:
        raise ValueError(f"--{flag} must be positive, but got "
                         f"{getattr(self, flag)}")
    if not 0 <= self.warmup_steps < self.steps:
      raise ValueError(f"--warmup_steps must be >= 0 and less than --steps "
                       f"({self.steps}), but got {self.warmup_steps}")
    if not self.learning_rate > 0:
      raise ValueError(f"--learning_rate must be positive, but got "
                       f"{self.learning_rate}")
    if self.mode not in MODES:
      raise ValueError(f"--mode must be one of {', '.join(map(repr, MODES))}"
                       f", but got {self.mode!r}")
    if self.tier not in TIERS:
      raise ValueError(f"--tier must be one of {', '.join(map(repr, TIERS))}"
                       f", but got {self.tier!r}")
    if self.nvme_dir is not None:
      experiments_common.check_directory(self.nvme_dir, flag="--nvme_dir")
    if self.tier == "nvme" and self.mode == "cxl":
      experiments_common.check_disk_backed(self.nvme_dir or self.run_dir,
                                           flag="--nvme_dir")
    if os.path.exists(self.run_dir) and not os.path.isdir(self.run_dir):
      raise ValueError(f"--run_dir {self.run_dir!r} is a file; pass a "
                       "directory")
    self._validate_checkpoints()
    try:
      jcxl.cxl_offload(lambda x: x, schedule=self.schedule)
    except ValueError as e:
      raise ValueError(f"--schedule: {e}") from None
    model = self.model_config()
    if self.seq_len > model.n_ctx:
      raise ValueError(f"--seq_len {self.seq_len} is longer than --model "
                       f"{self.model}'s context of {model.n_ctx} tokens")
    corpus = data.load_stdlib_corpus(self.data_bytes)
    if self.seq_len + 1 > corpus.validation.size:
      raise ValueError(
          f"--seq_len {self.seq_len} is longer than the validation split "
          f"({corpus.validation.size} bytes); raise --data_bytes")
    name, nbytes = largest_layer(model)
    if self.device_budget < nbytes:
      raise ValueError(
          f"--device_budget {format_bytes(self.device_budget)} is smaller "
          f"than one layer's weights ({name}: {format_bytes(nbytes)}); the "
          "step must hold at least one layer on the device")

  def to_json(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["link"] = {"bandwidth_bytes_per_s": self.link.bandwidth,
                   "latency_s": self.link.latency_s}
    return out


def config_from_flags() -> Config:
  """Builds the run's config from the parsed flags.

  Raises:
    ValueError: naming the flag whose value cannot be parsed.
  """
  if not _LINK_GBPS.value > 0:
    raise ValueError(f"--link_gbps must be positive, but got "
                     f"{_LINK_GBPS.value}")
  if not _LINK_LATENCY_US.value >= 0:
    raise ValueError(f"--link_latency_us must be >= 0, but got "
                     f"{_LINK_LATENCY_US.value}")
  run_dir = _RUN_DIR.value or os.path.join(
      "runs", time.strftime("train-%Y%m%d-%H%M%S"))
  return Config(
      model=_MODEL.value, steps=_STEPS.value, batch_size=_BATCH_SIZE.value,
      seq_len=_SEQ_LEN.value, learning_rate=_LEARNING_RATE.value,
      warmup_steps=_WARMUP_STEPS.value, eval_every=_EVAL_EVERY.value,
      eval_batches=_EVAL_BATCHES.value, seed=_SEED.value, mode=_MODE.value,
      tier=_TIER.value, nvme_dir=_NVME_DIR.value, schedule=_SCHEDULE.value,
      device_budget=parse_bytes(_DEVICE_BUDGET.value, name="--device_budget"),
      link=jcxl.LinkModel(bandwidth=_LINK_GBPS.value * 1e9,
                          latency_s=_LINK_LATENCY_US.value * 1e-6),
      run_dir=run_dir, log_every=_LOG_EVERY.value,
      data_bytes=parse_bytes(_DATA_BYTES.value, name="--data_bytes"),
      checkpoint_every=_CHECKPOINT_EVERY.value,
      keep_checkpoints=_KEEP_CHECKPOINTS.value, resume=_RESUME.value)


# ------------------------------------------------------------- the model


def _abstract_params(model: gpt2.GPT2Config) -> common.Params:
  return common.pure_params(common.abstract_model(model))


def _nbytes(tree: Any) -> int:
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


def largest_layer(model: gpt2.GPT2Config) -> tuple[str, int]:
  """The biggest top-level module of the model (a block): name, bytes."""
  sizes = {name: _nbytes(sub) for name, sub in
           _abstract_params(model).items()}
  name = max(sizes, key=sizes.get)
  return name, sizes[name]


def learning_rate(config: Config) -> optax.Schedule:
  """Linear warmup to --learning_rate, then cosine decay to a tenth of it."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate,
      warmup_steps=config.warmup_steps, decay_steps=config.steps,
      end_value=config.learning_rate / 10)


def make_optimizer(config: Config) -> optax.GradientTransformation:
  """adamw on the warmup-cosine schedule (its step count lives in the
  optimizer state, in the pool with the rest)."""
  return optax.adamw(learning_rate(config), b1=0.9, b2=0.95,
                     weight_decay=0.01)


def _delete(tree: Any) -> None:
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      leaf.delete()


def _model_layer(name: str) -> str:
  """'[0].mu['blocks_3']['mlp']' -> 'blocks_3': the module a transfer is for
  (optimizer-state prefixes dropped)."""
  start = name.find("['")
  if start < 0:
    return name
  return name[start + 2:name.index("']", start)]


# -------------------------------------------------------------- runners


class _Resident:
  """Plain jax.jit, state donated and kept on the device."""

  label = "device (resident baseline: no pool, nothing streamed)"

  def __init__(self, compiled: Any, params: Any, opt_state: Any,
               loss_fn: Callable):
    self._compiled = compiled
    self._params, self._opt_state = params, opt_state
    self._loss = jax.jit(loss_fn)

  def train(self, batch: dict) -> jax.Array:
    self._params, self._opt_state, loss = self._compiled(
        self._params, self._opt_state, batch)
    return loss

  def drain(self) -> list[Any]:
    return []

  def evaluate(self, batches: Sequence[dict]) -> tuple[float, list[Any]]:
    losses = [self._loss(self._params, b) for b in batches]
    return float(np.mean([float(l) for l in losses])), []

  def plan(self) -> tuple[str, dict[str, Any]]:
    text = "resident mode: every leaf stays on the device; nothing streamed"
    return text, {"mode": "resident", "layers": []}

  def state(self) -> dict[str, Any]:
    return {"params": self._params, "opt_state": self._opt_state}

  def load(self, path: str, like: dict[str, Any]) -> dict[str, Any]:
    restored = jcxl.checkpoint.restore(path, like)
    _delete(self.state())
    self._params, self._opt_state = restored["params"], restored["opt_state"]
    return restored


class _Offloaded:
  """State in a pool tier; train and eval steps rewritten by cxl_offload."""

  def __init__(self, config: Config, pool: jcxl.Pool, params: Any,
               opt_state: Any, loss_fn: Callable,
               tx: optax.GradientTransformation):
    self.label = pool.stats()[config.tier].label()
    self._budget_flag = f"--device_budget {format_bytes(config.device_budget)}"
    self._params = jcxl.place(params, config.tier, pool=pool)
    self._opt_state = jcxl.place(opt_state, config.tier, pool=pool)
    offload = jcxl.cxl_offload(device_budget=config.device_budget,
                               schedule=config.schedule)
    self.step = offload(experiments_common.make_train_step(loss_fn, tx))

    def eval_step(params, batch):
      return params, loss_fn(params, batch)  # unchanged: nothing stored

    self.eval_step = offload(eval_step)
    self.need: int | None = None
    self.eval_need: int | None = None

  @contextlib.contextmanager
  def _budget(self):
    try:
      yield
    except jcxl.PoolExhaustedError:
      raise
    except MemoryError as e:
      raise app.UsageError(f"{self._budget_flag} is too small: {e}") from e

  def train(self, batch: dict) -> jax.Array:
    with self._budget():
      self._params, self._opt_state, loss = self.step(
          self._params, self._opt_state, batch)
    if self.need is None:
      self.need = device_need(self.step.memory_analysis(
          self._params, self._opt_state, batch))
    return loss

  def drain(self) -> list[Any]:
    return self.step.report()

  def evaluate(self, batches: Sequence[dict]) -> tuple[float, list[Any]]:
    losses = []
    for batch in batches:
      with self._budget():
        _, loss = self.eval_step(self._params, batch)
      losses.append(loss)
    if self.eval_need is None:
      self.eval_need = device_need(self.eval_step.memory_analysis(
          self._params, batches[0]))
    value = float(np.mean([float(l) for l in losses]))
    # Drains the eval fetches, so that the train step's next report holds
    # only its own (both steps stream the same objects).
    return value, self.eval_step.report()

  def plan(self) -> tuple[str, dict[str, Any]]:
    plan = self.step.plan
    return str(plan), dataclasses.asdict(plan)

  def state(self) -> dict[str, Any]:
    return {"params": self._params, "opt_state": self._opt_state}

  def load(self, path: str, like: dict[str, Any]) -> dict[str, Any]:
    # In place: the PoolArrays keep their objects, so the steps compiled
    # for them stay valid and the pool needs no room for a second copy.
    return jcxl.checkpoint.restore_into(path, like)


# ------------------------------------------------------------ the run


@dataclasses.dataclass
class _Window:
  """Transfers and time since the last progress line."""
  start: float
  wait_s: float = 0.0
  fetched: int = 0
  stored: int = 0

  def add(self, reports: Sequence[Any], per_layer: dict[str, list]) -> None:
    for r in reports:
      self.wait_s += r.wait_s
      self.fetched += r.bytes_fetched
      self.stored += r.bytes_stored
      totals = per_layer[_model_layer(r.name)]
      totals[0] += r.wait_s
      totals[1] += r.bytes_fetched + r.bytes_stored


class _Metrics:
  """metrics.jsonl and metrics.csv, one row per progress or eval line."""

  FIELDS = ("kind", "step", "loss", "val_loss", "tokens_per_s", "stall_frac",
            "bytes_fetched", "bytes_stored", "wall_s", "startup")

  def __init__(self, run_dir: str, keep_until_step: int | None = None,
               write: bool = True):
    """`keep_until_step`: a resumed run keeps the rows its checkpoint's run
    logged up to that step (and drops those it logged after it). `write`:
    False keeps the rows in memory only (processes other than the first)."""
    self.rows: list[dict[str, Any]] = []
    path = os.path.join(run_dir, "metrics.jsonl") if write else os.devnull
    csv_path = os.path.join(run_dir, "metrics.csv") if write else os.devnull
    kept = []
    if write and keep_until_step is not None and os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        for line in f:
          try:
            row = json.loads(line)
          except ValueError:
            continue  # a line cut short when that run was killed
          if row["step"] <= keep_until_step:
            kept.append(row)
    self._jsonl = open(path, "w", encoding="utf-8")
    self._csv_file = open(csv_path, "w", encoding="utf-8", newline="")
    self._csv = csv.DictWriter(self._csv_file, self.FIELDS, restval="")
    self._csv.writeheader()
    for row in kept:
      self.add(row)

  def add(self, row: dict[str, Any]) -> None:
    self.rows.append(row)
    self._jsonl.write(json.dumps(row) + "\n")
    self._jsonl.flush()  # a crashed run keeps what it logged
    self._csv.writerow(row)
    self._csv_file.flush()

  def close(self) -> None:
    self._jsonl.close()
    self._csv_file.close()


def _pool_for(config: Config, state_bytes: int) -> jcxl.Pool:
  capacity = int(state_bytes * 1.25) + _POOL_SLACK
  sizes = {tier: capacity if tier == config.tier else 0 for tier in TIERS}
  return jcxl.Pool(host=sizes["host"], cxl=sizes["cxl"], nvme=sizes["nvme"],
                   nvme_dir=config.nvme_dir or config.run_dir,
                   cxl_link=config.link)


def run(config: Config) -> dict[str, Any]:
  """Trains, writes the run directory, prints a summary; returns it."""
  started = time.perf_counter()
  os.makedirs(config.run_dir, exist_ok=True)
  model = config.model_config()
  corpus = data.load_stdlib_corpus(config.data_bytes)
  eval_set = corpus.eval_batches(config.batch_size, config.seq_len,
                                 config.eval_batches)
  loss_fn = gpt2.make_loss(model)
  tx = make_optimizer(config)
  mesh = cluster.mesh()
  params, opt_state = _init_state(model, tx, config.seed, mesh)
  to_devices = _batch_placer(mesh, config.batch_size)
  eval_set = [to_devices(b) for b in eval_set]
  state_bytes = _nbytes((params, opt_state))
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                     sharding=getattr(x, "sharding", None)),
      (params, opt_state, eval_set[0]))
  resident = jax.jit(experiments_common.make_train_step(loss_fn, tx),
                     donate_argnums=(0, 1)).lower(*abstract).compile()
  resident_need = device_need(resident.memory_analysis())
  with contextlib.ExitStack() as stack:
    if config.mode == "cxl":
      pool = stack.enter_context(_pool_for(
          config, cluster.local_bytes((params, opt_state))))
      runner = _Offloaded(config, pool, params, opt_state, loss_fn, tx)
      # The device copies go as soon as the pool holds the state.
      _delete((params, opt_state))
      del resident
    else:
      runner = _Resident(resident, params, opt_state, loss_fn)
    del params, opt_state
    start = {"step": 0, "data_position": 0}
    if config.resume is not None:
      path = config.resume_path()
      restored = runner.load(path, {**runner.state(), **start})
      start = {k: int(restored[k]) for k in start}
      _say(f"resumed from {path} at step {start['step']}")
    if config.checkpoint_every and cluster.is_lead():
      _remove_unfinished_checkpoints(config.checkpoint_dir)
    info = {
        "model": {"name": config.model,
                  "parameters": common.count_params(model),
                  "config": {k: _jsonable(v) for k, v in
                             dataclasses.asdict(model).items()}},
        "state_bytes": state_bytes,
        "tokens_per_step": config.batch_size * config.seq_len,
        "label": runner.label,
        "start_step": start["step"],
        "cluster": {"processes": jax.process_count(),
                    "devices": jax.device_count(),
                    "state_sharding": "fsdp" if mesh else "one device",
                    "batch_sharding": str(eval_set[0]["x"].sharding.spec)
                                      if mesh else "one device"},
    }
    lead = cluster.is_lead()
    if lead:
      _write_config(config, corpus, info)
    _print_header(config, info, resident_need)
    metrics = _Metrics(config.run_dir, keep_until_step=(
        start["step"] if config.resume is not None else None), write=lead)
    try:
      results = _train(config, runner, corpus, eval_set, metrics, to_devices,
                       **start)
    finally:
      metrics.close()
    experiments_common.write_json(
        os.path.join(config.run_dir, f"process-{jax.process_index()}.json"),
        _process_info(runner, pool if config.mode == "cxl" else None))
    if lead:
      plan_text, plan_json = runner.plan()
      with open(os.path.join(config.run_dir, "plan.txt"), "w",
                encoding="utf-8") as f:
        f.write(plan_text + "\n")
      experiments_common.write_json(
          os.path.join(config.run_dir, "plan.json"), plan_json)
    memory = {
        "params_and_optimizer_state_bytes": state_bytes,
        "resident_step_need_bytes": resident_need,
        "offloaded_step_need_bytes": getattr(runner, "need", None),
        "offloaded_eval_need_bytes": getattr(runner, "eval_need", None),
        "device_budget_bytes": config.device_budget,
    }
  summary = _summary(config, info, results, memory, metrics.rows,
                     time.perf_counter() - started)
  if not lead:
    print(f"[{cluster.describe()}] done: train loss "
          f"{summary['first_loss']:.3f} -> {summary['last_loss']:.3f}, "
          f"state shards in {info['label']}", flush=True)
    return summary
  summary["plots"] = plots.plot_run(
      config.run_dir, metrics.rows, results["layer_wait_s"], runner.label)
  experiments_common.write_json(os.path.join(config.run_dir, "summary.json"),
                                summary)
  _say(_summary_text(summary))
  return summary


def _init_state(model: gpt2.GPT2Config, tx: optax.GradientTransformation,
                seed: int, mesh: jax.sharding.Mesh | None) -> tuple[Any, Any]:
  """The initial params and adamw state: on the one device, or made
  sharded (FSDP over `mesh`), each process computing only its shards."""
  init = lambda: common.init_params(model, seed=seed)
  if mesh is None:
    params = init()
    return params, tx.init(params)
  abstract = jax.eval_shape(init)
  params = jax.jit(init, out_shardings=cluster.fsdp_shardings(
      mesh, abstract))()
  opt_shardings = cluster.fsdp_shardings(mesh, jax.eval_shape(tx.init,
                                                              abstract))
  return params, jax.jit(tx.init, out_shardings=opt_shardings)(params)


def _batch_placer(mesh: jax.sharding.Mesh | None, batch_size: int
                  ) -> Callable[[dict], dict]:
  """Turns a batch of host arrays into the step's input: as is for one
  device, else global arrays sharded by rows."""
  if mesh is None:
    return lambda batch: batch
  sharding = cluster.batch_sharding(mesh, batch_size)
  return lambda batch: cluster.global_batch(batch, sharding)


def _process_info(runner: Any, pool: jcxl.Pool | None) -> dict[str, Any]:
  """This process's part of the run: its devices, the bytes of its shards
  of the state and what its pool holds."""
  info = {"process_index": jax.process_index(),
          "process_count": jax.process_count(),
          "local_devices": [d.id for d in jax.local_devices()],
          "state_local_bytes": cluster.local_bytes(runner.state())}
  if pool is not None:
    info["pool"] = {
        t.tier.value: {"live_bytes": t.live, "objects": t.objects,
                       "bytes_written": t.bytes_written,
                       "bytes_read": t.bytes_read}
        for t in pool.stats().tiers.values() if t.enabled}
    info["pool_settings"] = pool.settings()
  return info


def _say(text: str) -> None:
  """Progress is printed by process 0 only (the others compute the same)."""
  if cluster.is_lead():
    print(text, flush=True)


def _jsonable(value: Any) -> Any:
  if isinstance(value, (bool, int, float, str)) or value is None:
    return value
  try:
    return np.dtype(value).name  # a dtype field such as param_dtype
  except TypeError:
    return str(value)


def _write_config(config: Config, corpus: data.ByteCorpus,
                  info: dict[str, Any]) -> None:
  machine = bench.describe_machine(config.run_dir)
  experiments_common.write_json(
      os.path.join(config.run_dir, "config.json"), {
          "flags": config.to_json(),
          "model": info["model"],
          "emulation": {
              "tier": config.tier if config.mode == "cxl" else "device",
              "label": info["label"],
              "emulated": "EMULATED" in info["label"],
              "link_bandwidth_bytes_per_s": config.link.bandwidth,
              "link_latency_s": config.link.latency_s,
          },
          "data": {"root": corpus.root,
                   "train_bytes": int(corpus.train.size),
                   "validation_bytes": int(corpus.validation.size),
                   "train_files": len(corpus.train_files),
                   "validation_files": len(corpus.validation_files)},
          "machine": machine.to_json(),
          "jax": {"version": jax.__version__,
                  "backend": jax.default_backend(),
                  "devices": [str(d) for d in jax.devices()]},
      })


def _print_header(config: Config, info: dict[str, Any],
                  resident_need: int) -> None:
  budget = config.device_budget
  fits = "fits" if resident_need <= budget else "does NOT fit"
  _say(f"train {config.model} ({info['model']['parameters']:,} parameters),"
        f" {config.steps} steps of {config.batch_size} x {config.seq_len} "
        f"bytes, mode {config.mode}, state in {info['label']}\n"
        f"params + adamw state {format_bytes(info['state_bytes'])}; device "
        f"budget {format_bytes(budget)}; resident step needs "
        f"{format_bytes(resident_need)} ({fits} the budget)\n"
        f"run directory: {config.run_dir}" + _cluster_line(info["cluster"]))


def _cluster_line(c: dict[str, Any]) -> str:
  if c["devices"] == 1:
    return ""
  return (f"\n{cluster.describe()}: state sharded ({c['state_sharding']}) "
          f"over all {c['devices']} devices, batch {c['batch_sharding']}")


def _train(config: Config, runner: Any, corpus: data.ByteCorpus,
           eval_set: Sequence[dict], metrics: _Metrics,
           to_devices: Callable[[dict], dict], step: int = 0,
           data_position: int = 0) -> dict[str, Any]:
  """The training loop from `step` (a checkpoint's; 0: the start); returns
  per-step losses and per-layer totals."""
  batches = corpus.batches("train", config.batch_size, config.seq_len,
                           seed=config.seed)
  for _ in range(data_position):  # the data stream where the run left it
    next(batches)
  start_step = step
  tokens_per_step = config.batch_size * config.seq_len
  per_layer: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
  window = _Window(start=time.perf_counter())
  pending: list[jax.Array] = []
  losses: list[float] = []
  for step in range(start_step + 1, config.steps + 1):
    pending.append(runner.train(to_devices(next(batches))))
    if step == start_step + 1 and isinstance(runner, _Offloaded):
      _say(f"offloaded step needs {format_bytes(runner.need)} of device "
            f"memory (budget {format_bytes(config.device_budget)})",
            )
    last = step == config.steps
    if step == 1 or step % config.log_every == 0 or last:
      window_losses = [float(l) for l in pending]  # waits for the steps
      window.add(runner.drain(), per_layer)
      wall = time.perf_counter() - window.start
      losses += window_losses
      row = {
          "kind": "train", "step": step,
          "loss": float(np.mean(window_losses)),
          "tokens_per_s": tokens_per_step * len(pending) / wall,
          "stall_frac": window.wait_s / wall,
          "bytes_fetched": window.fetched, "bytes_stored": window.stored,
          "wall_s": wall,
          "startup": step - len(pending) == start_step,  # compiled in it
      }
      metrics.add(row)
      _say(_progress_line(row, config, runner.label))
      pending = []
      window = _Window(start=time.perf_counter())
    if step % config.eval_every == 0 or last:
      window.add(runner.drain(), per_layer)  # before the eval's transfers
      eval_start = time.perf_counter()
      val_loss, reports = runner.evaluate(eval_set)
      eval_s = time.perf_counter() - eval_start
      window.start += eval_s  # evaluation is not training time
      row = {"kind": "eval", "step": step, "val_loss": val_loss,
             "bytes_fetched": sum(r.bytes_fetched for r in reports),
             "bytes_stored": sum(r.bytes_stored for r in reports),
             "wall_s": eval_s}
      metrics.add(row)
      _say(f"eval  step {step:>5d}  val_loss {val_loss:.4f}  "
            f"({len(eval_set)} batches, {eval_s:.1f} s, streamed "
            f"{format_bytes(row['bytes_fetched'])})  [state in "
            f"{runner.label}]")
    if config.checkpoint_every and step % config.checkpoint_every == 0:
      path, save_s = _save_checkpoint(config, runner, step)
      window.start += save_s  # saving is not training time either
      _say(f"checkpoint step {step}: {path} ({save_s:.1f} s)  [state in "
            f"{runner.label}]")
  return {"losses": losses,
          "layer_wait_s": {k: v[0] for k, v in per_layer.items()},
          "layer_bytes": {k: v[1] for k, v in per_layer.items()}}


def _finished_steps(directory: str) -> list[int]:
  """Steps of the finished checkpoints in `directory`, ascending."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory)
                if name.isdigit() and jcxl.checkpoint.is_complete(
                    os.path.join(directory, name)))


def _remove_unfinished_checkpoints(directory: str) -> None:
  """Deletes what saves killed midway left (their temporary directories);
  this run owns the directory."""
  if not os.path.isdir(directory):
    return
  for name in os.listdir(directory):
    path = os.path.join(directory, name)
    if not jcxl.checkpoint.is_complete(path):
      _say(f"removing an unfinished checkpoint: {path}")
      shutil.rmtree(path, ignore_errors=True)


def _save_checkpoint(config: Config, runner: Any, step: int
                     ) -> tuple[str, float]:
  """Saves the run's state at `step`, then drops the oldest checkpoints."""
  start = time.perf_counter()
  path = jcxl.checkpoint.save(
      os.path.join(config.checkpoint_dir, str(step)),
      {**runner.state(), "step": step, "data_position": step},
      metadata={"train": {"run": config.identity(), "step": step}})
  if cluster.is_lead():  # every process saved its shards; one cleans up
    for old in _finished_steps(
        config.checkpoint_dir)[:-config.keep_checkpoints]:
      shutil.rmtree(os.path.join(config.checkpoint_dir, str(old)))
  return path, time.perf_counter() - start


def _progress_line(row: dict[str, Any], config: Config, label: str) -> str:
  note = " (first step: compilation, warm-up)" if row["startup"] else ""
  return (f"step {row['step']:>5d}/{config.steps}  loss {row['loss']:.4f}  "
          f"{row['tokens_per_s']:8.0f} tokens/s  stall "
          f"{row['stall_frac']:6.1%}  streamed "
          f"{format_bytes(row['bytes_fetched'] + row['bytes_stored'])}{note}"
          f"  [state in {label}]")


def _summary(config: Config, info: dict[str, Any], results: dict[str, Any],
             memory: dict[str, Any], rows: Sequence[dict[str, Any]],
             wall_s: float) -> dict[str, Any]:
  train = [r for r in rows if r["kind"] == "train"]
  evals = [r for r in rows if r["kind"] == "eval"]
  steady = [r for r in train if not r["startup"]] or train
  steady_wall = sum(r["wall_s"] for r in steady)
  steady_tokens = sum(r["tokens_per_s"] * r["wall_s"] for r in steady)
  budget = memory["device_budget_bytes"]
  offloaded = memory["offloaded_step_need_bytes"]
  return {
      "run_dir": config.run_dir,
      "mode": config.mode,
      "label": info["label"],
      "model": info["model"]["name"],
      "parameters": info["model"]["parameters"],
      "steps": config.steps,
      "start_step": info["start_step"],
      "tokens_per_step": info["tokens_per_step"],
      "first_loss": results["losses"][0],
      "last_loss": train[-1]["loss"],
      "train_losses": results["losses"],
      "val_losses": [[r["step"], r["val_loss"]] for r in evals],
      "final_val_loss": evals[-1]["val_loss"],
      "mean_tokens_per_s": steady_tokens / steady_wall,
      "stall_frac": sum(r["stall_frac"] * r["wall_s"] for r in steady) /
                    steady_wall,
      "bytes_fetched": sum(r["bytes_fetched"] for r in train),
      "bytes_stored": sum(r["bytes_stored"] for r in train),
      "memory": memory | {
          "resident_fits_budget": memory["resident_step_need_bytes"] <= budget,
          "offloaded_fits_budget": (None if offloaded is None
                                    else offloaded <= budget),
          "budget_below_state": budget < memory[
              "params_and_optimizer_state_bytes"],
      },
      "layer_wait_s": results["layer_wait_s"],
      "layer_bytes": results["layer_bytes"],
      "first_step_s": train[0]["wall_s"],
      "wall_s": wall_s,
  }


def _summary_text(s: dict[str, Any]) -> str:
  m = s["memory"]
  offloaded = m["offloaded_step_need_bytes"]
  offloaded = ("not measured (resident mode)" if offloaded is None
               else format_bytes(offloaded))
  vals = ", ".join(f"{v:.3f} (step {k})" for k, v in s["val_losses"])
  return "\n".join([
      f"summary: {s['model']} ({s['parameters']:,} parameters), "
      f"{s['steps']} steps, mode {s['mode']}, state in {s['label']}",
      f"  train loss {s['first_loss']:.3f} (step {s['start_step'] + 1}) -> "
      f"{s['last_loss']:.3f} "
      "(mean of the last logged steps)",
      f"  validation loss {vals}",
      f"  {s['mean_tokens_per_s']:.0f} tokens/s, stall "
      f"{s['stall_frac']:.1%}, streamed "
      f"{format_bytes(s['bytes_fetched'] + s['bytes_stored'])}",
      f"  device memory: resident step "
      f"{format_bytes(m['resident_step_need_bytes'])}, offloaded step "
      f"{offloaded}, budget {format_bytes(m['device_budget_bytes'])}, params"
      f" + adamw state {format_bytes(m['params_and_optimizer_state_bytes'])}",
      f"  wall {s['wall_s']:.1f} s (first step {s['first_step_s']:.1f} s)",
      f"  run directory: {s['run_dir']}",
  ])


parse_flags = experiments_common.flags_parser(FLAGS, __doc__)


def main(argv: Sequence[str]) -> None:
  try:
    cluster.initialize(_CLUSTER)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  with jcxl.distributed.fail_together():
    experiments_common.run_program(argv, config_from_flags, run)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
