"""experiments.train's run configuration: its flags, the models, and the
checks that reject a bad value before anything runs (naming the flag)."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from typing import Any

from absl import flags
import jax
import numpy as np

import jcxl
from experiments import cluster
from experiments import common as experiments_common
from experiments import flags as shared_flags
from jcxl.units import format_bytes
from jcxl.units import parse_bytes
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
_STEPS = shared_flags.steps(FLAGS, default=200, help_text="Training steps.")
_BATCH = shared_flags.batch(FLAGS, default=4)
_SEQ_LEN = shared_flags.seq_len(FLAGS, default=64,
                                help_text="Bytes per sequence.")
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
_SEED = shared_flags.seed(FLAGS)
_MODE = flags.DEFINE_string(
    "mode", "cxl", "cxl: state in the pool, step rewritten by cxl_offload; "
    "resident: plain jax.jit with everything on the device (the baseline).",
    flag_values=FLAGS)
_TIER = flags.DEFINE_string(
    "tier", "cxl", "Pool tier for the state: cxl, host or nvme.",
    flag_values=FLAGS)
_NVME_DIR = shared_flags.nvme_dir(
    FLAGS, default=None, help_text="Existing, writable directory on a real "
    "disk for the nvme tier (default: the run directory).")
_SCHEDULE = flags.DEFINE_string(
    "schedule", "fixed:1", "Streaming schedule passed to jcxl.cxl_offload.",
    flag_values=FLAGS)
_DEVICE_BUDGET = shared_flags.device_budget(
    FLAGS, default="72MiB", help_text="Device memory the offloaded step may "
    "use, e.g. '72MiB'; the default is under the byte-gpt model's parameters "
    "and adamw state together.")
_LINK_BANDWIDTH = shared_flags.link_bandwidth(FLAGS)
_LINK_LATENCY_US = shared_flags.link_latency_us(FLAGS)
_RUN_DIR = shared_flags.run_dir(
    FLAGS, default=None, help_text="Where the run's files go (default "
    "runs/train-<timestamp>); created if missing.")
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
CLUSTER = cluster.define_flags(FLAGS)
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
RUN_IDENTITY = ("model", "steps", "batch", "seq_len", "learning_rate",
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


def finished_steps(directory: str) -> list[int]:
  """Steps of the finished checkpoints in `directory`, ascending."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory)
                if name.isdigit() and jcxl.checkpoint.is_complete(
                    os.path.join(directory, name)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """One training run."""
  model: str
  steps: int
  batch: int
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
    return {name: getattr(self, name) for name in RUN_IDENTITY}

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
            f"{', '.join('--' + n for n in RUN_IDENTITY)}")
    if saved["step"] >= self.steps:
      raise ValueError(f"--resume: {path!r} is at step {saved['step']}, the "
                       f"last of --steps {self.steps}; nothing is left to run")
    later = [s for s in finished_steps(self.checkpoint_dir)
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
    for flag in ("steps", "batch", "seq_len", "eval_every",
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
  run_dir = _RUN_DIR.value or os.path.join(
      "runs", time.strftime("train-%Y%m%d-%H%M%S"))
  return Config(
      model=_MODEL.value, steps=_STEPS.value, batch=_BATCH.value,
      seq_len=_SEQ_LEN.value, learning_rate=_LEARNING_RATE.value,
      warmup_steps=_WARMUP_STEPS.value, eval_every=_EVAL_EVERY.value,
      eval_batches=_EVAL_BATCHES.value, seed=_SEED.value, mode=_MODE.value,
      tier=_TIER.value, nvme_dir=_NVME_DIR.value, schedule=_SCHEDULE.value,
      device_budget=parse_bytes(_DEVICE_BUDGET.value, name="--device_budget"),
      link=shared_flags.link(_LINK_BANDWIDTH, _LINK_LATENCY_US),
      run_dir=run_dir, log_every=_LOG_EVERY.value,
      data_bytes=parse_bytes(_DATA_BYTES.value, name="--data_bytes"),
      checkpoint_every=_CHECKPOINT_EVERY.value,
      keep_checkpoints=_KEEP_CHECKPOINTS.value, resume=_RESUME.value)


def _abstract_params(model: gpt2.GPT2Config) -> common.Params:
  return common.pure_params(common.abstract_model(model))


def nbytes(tree: Any) -> int:
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


def largest_layer(model: gpt2.GPT2Config) -> tuple[str, int]:
  """The biggest top-level module of the model (a block): name, bytes."""
  sizes = {name: nbytes(sub) for name, sub in
           _abstract_params(model).items()}
  name = max(sizes, key=sizes.get)
  return name, sizes[name]
