r"""jcxl against the other ways to train past device memory, side by side.

The paper's comparisons (cxl with adaptive pipelining against SSD-based
ZeRO-Infinity: up to 72.7% more throughput, 62.9% lower latency, 1.14x
larger trainable models), measured on this machine. Five modes:

* ``resident``: everything on the device, plain ``jax.jit`` with the state
  donated; only where its step fits --device_budget.
* ``jax_host``: JAX's own memory kinds, as MaxText offloads: parameters and
  optimizer state live in ``pinned_host`` memory and the step moves them to
  the device with ``jax.device_put`` (all at its start) and back.
* ``ssd``: ZeRO-Infinity style: the state on the pool's ``nvme`` tier (real
  O_DIRECT files on this machine's disk), streamed with DeepSpeed ZeRO-3's
  default prefetch bucket (5e7 elements), whole leaves per transfer.
* ``cxl_fixed``: the state on the ``cxl`` tier, every layer prefetched
  --fixed_prefetch layers ahead.
* ``cxl_dap``: the state on the ``cxl`` tier, Dynamic Adaptive Pipelining
  (``schedule='dap'``), tuned during the untimed warmup rounds.

Part 1, throughput and latency against model size: a byte-level GPT-2 of
--n_layer blocks at each width of --n_embds (``auto``: the widths whose
state, held once per mode, fits in a share of this machine's memory). For
each size every mode starts from the same weights and steps through the
same batches in interleaved rounds (one step of each mode per round), so a
shared machine's load falls on all alike; the first rounds (compiles, DAP's
tuning) are not timed. Step latency is the median of the timed rounds,
throughput the tokens of a step over it. Every mode's losses are compared
with resident's where resident fits: over the first LOSS_CHECK_STEPS steps
against LOSS_RTOL, and over the whole run as reported drift.

Part 2, the largest trainable model under --device_budget and
--pool_capacity (the same capacity for whichever tier holds the state): per
mode, the widest member of the same family whose step compiles within the
budget (each probe compiles; offloaded probes reserve their state in the
pool without writing it).

On this machine the "device" is XLA:CPU: device memory is host DRAM, and
the device budget is an accounting limit checked against the compiled
step's memory_analysis(). The cxl tier is EMULATED on DRAM behind a link
model; pinned_host and device memory are the same DRAM. Every table and
plot title says so, with the link parameters and the machine.

Writes results.csv, search.csv, results.md and throughput.png,
latency.png, largest.png and loss.png into --run_dir:

  python -m experiments.compare --run_dir=runs/compare
"""

from __future__ import annotations

import csv
import dataclasses
import os
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import bench
import jcxl
from experiments import common as exp_common
from experiments import flags as shared_flags
from experiments import host_allocator
from experiments import max_model
from experiments import plots as exp_plots
from jcxl.planning import device_need
from jcxl.units import format_bytes
from jcxl.units import parse_bytes
from models import common
from models import data
from models import gpt2

MODES = ("resident", "jax_host", "ssd", "cxl_fixed", "cxl_dap")
PAPER = {"throughput_gain": 0.727, "latency_reduction": 0.629,
         "max_model_ratio": 1.14}
HEAD_DIM = 64
AUTO_WIDTHS = (128, 256, 384, 512, 768, 1024, 1536, 2048)
AUTO_MEMORY_FRACTION = 0.4  # of MemAvailable, for the sweep and the pool
LOSS_RTOL = 1e-4  # losses against resident's, per step (stated tolerance)
# Steps checked against LOSS_RTOL. Past them, training amplifies float
# rounding (an offloaded step sums in another order): here a width-384
# model's losses agreed within 1.5e-7 for 35 steps, then drifted to 3e-3
# by step 70 (a whole run's drift is reported, not checked).
LOSS_CHECK_STEPS = 10


def byte_gpt2(n_embd: int, n_layer: int) -> gpt2.GPT2Config:
  """GPT-2's shape over bytes (256 tokens), heads of 64."""
  return gpt2.GPT2Config(vocab_size=data.VOCAB_SIZE, n_ctx=256,
                         n_embd=n_embd, n_layer=n_layer,
                         n_head=max(1, n_embd // HEAD_DIM))


MODELS: dict[str, Callable[[int, int], gpt2.GPT2Config]] = {
    "gpt2": byte_gpt2}

_fmt = exp_common.format_or_dash  # a table cell, "-" for None

FLAGS = flags.FlagValues()
_MODEL = flags.DEFINE_string("model", "gpt2", "Model family: "
                             f"{', '.join(MODELS)}.", flag_values=FLAGS)
_N_LAYER = shared_flags.n_layer(FLAGS, default=4, help_text="Blocks per "
                                "model.")
_N_EMBDS = flags.DEFINE_list(
    "n_embds", ["auto"], "Model widths of the sweep (multiples of 64), or "
    "'auto': those of 128-768 whose state fits in memory once per mode.",
    flag_values=FLAGS)
_MODES = flags.DEFINE_list("modes", list(MODES), "Modes to compare.",
                           flag_values=FLAGS)
_BATCH = shared_flags.batch(FLAGS, default=2)
_SEQ_LEN = shared_flags.seq_len(FLAGS, default=64,
                                help_text="Bytes per sequence.")
_ROUNDS = flags.DEFINE_integer("rounds", 8, "Timed rounds per size.",
                               flag_values=FLAGS)
_WARMUP = flags.DEFINE_integer(
    "warmup", 4, "Untimed rounds first (compiles; DAP tunes through these "
    "and, until it converges, up to --tune_steps).", flag_values=FLAGS)
_TUNE_STEPS = flags.DEFINE_integer(
    "tune_steps", 100, "Most untimed rounds DAP may tune for.",
    flag_values=FLAGS)
_FIXED_PREFETCH = flags.DEFINE_integer(
    "fixed_prefetch", 1, "cxl_fixed's prefetch distance (layers).",
    flag_values=FLAGS)
_DEVICE_BUDGET = shared_flags.device_budget(FLAGS, default="192MiB")
_POOL_CAPACITY = flags.DEFINE_string(
    "pool_capacity", "auto", "Capacity of the tier holding the state in the "
    f"largest-model search; 'auto': {AUTO_MEMORY_FRACTION:.0%} of "
    "MemAvailable (and at most half the nvme disk's free space).",
    flag_values=FLAGS)
_LINK_BANDWIDTH = shared_flags.link_bandwidth(FLAGS)
_LINK_LATENCY_US = shared_flags.link_latency_us(FLAGS)
_NVME_DIR = shared_flags.nvme_dir(
    FLAGS, default=None, help_text="Existing, writable directory on a real "
    "disk for the ssd mode's nvme tier (default: --run_dir).")
_SEARCH = flags.DEFINE_boolean("search", True,
                               "Run part 2 (the largest-model search).",
                               flag_values=FLAGS)
_MAX_WIDTH = flags.DEFINE_integer(
    "max_width", 4096, "Widest model part 2 tries.", flag_values=FLAGS)
_SEED = shared_flags.seed(FLAGS)
_RUN_DIR = shared_flags.run_dir(FLAGS, default="runs/compare")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  model: str
  n_layer: int
  widths: tuple[int, ...]
  widths_source: str
  modes: tuple[str, ...]
  batch: int
  seq_len: int
  rounds: int
  warmup: int
  tune_steps: int
  fixed_prefetch: int
  device_budget: int
  pool_capacity: int
  pool_capacity_source: str
  cxl_link: jcxl.LinkModel
  nvme_dir: str
  search: bool
  max_width: int
  seed: int
  run_dir: str

  def family(self, width: int) -> gpt2.GPT2Config:
    return MODELS[self.model](width, self.n_layer)

  def validate(self) -> None:
    """Raises ValueError naming the flag whose value is wrong."""
    for mode in self.modes:
      if mode not in MODES:
        raise ValueError(f"--modes: unknown mode {mode!r}; known: "
                         f"{', '.join(MODES)}")
    if not self.widths:
      raise ValueError("--n_embds: no width left; pass some, or free memory")
    for w in self.widths:
      if w < HEAD_DIM or w % HEAD_DIM:
        raise ValueError(f"--n_embds: {w} is not a positive multiple of "
                         f"{HEAD_DIM} (the head size)")
    for name, value in (("--n_layer", self.n_layer), ("--batch", self.batch),
                        ("--seq_len", self.seq_len),
                        ("--rounds", self.rounds)):
      if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    if self.warmup < 1 or self.tune_steps < self.warmup:
      raise ValueError("--warmup must be >= 1 (the compiles) and "
                       "--tune_steps at least --warmup")
    if self.seq_len > MODELS[self.model](HEAD_DIM, 1).n_ctx:
      raise ValueError(f"--seq_len must be at most the model's n_ctx "
                       f"({MODELS[self.model](HEAD_DIM, 1).n_ctx})")
    smallest = max_model.sizes(self.family(min(self.widths)))
    if self.device_budget < smallest.block_bytes:
      raise ValueError(
          f"--device_budget ({format_bytes(self.device_budget)}) is smaller "
          f"than one layer of the smallest model "
          f"({format_bytes(smallest.block_bytes)}): nothing can fit")
    exp_common.check_directory(self.nvme_dir, flag="--nvme_dir")
    exp_common.check_disk_backed(self.nvme_dir, flag="--nvme_dir")


def _state_bytes(model: gpt2.GPT2Config) -> int:
  size = max_model.sizes(model)
  return size.param_bytes + size.opt_state_bytes


def _auto_widths(model: str, n_layer: int, modes: Sequence[str]
                 ) -> tuple[tuple[int, ...], str]:
  """The auto widths: each mode holds its own copy of the state in memory
  (the ssd mode's on disk), with room for a step's gradients."""
  budget = int(exp_common.mem_available() * AUTO_MEMORY_FRACTION)
  copies = sum(m != "ssd" for m in modes) + 1
  widths = tuple(w for w in AUTO_WIDTHS if w <= 768 and copies *
                 _state_bytes(MODELS[model](w, n_layer)) <= budget)
  return widths, (f"auto: widths up to 768 whose state x {copies} fits "
                  f"{AUTO_MEMORY_FRACTION:.0%} of MemAvailable "
                  f"({format_bytes(budget)})")


def config_from_flags() -> Config:
  model = _MODEL.value
  if model not in MODELS:
    raise ValueError(f"--model: unknown model {model!r}; known: "
                     f"{', '.join(MODELS)}")
  modes = tuple(m.strip() for m in _MODES.value)
  if _N_EMBDS.value == ["auto"]:
    widths, source = _auto_widths(model, _N_LAYER.value, modes)
  else:
    try:
      widths = tuple(int(w) for w in _N_EMBDS.value)
    except ValueError:
      raise ValueError(f"--n_embds must be integers or 'auto', got "
                       f"{','.join(_N_EMBDS.value)}") from None
    source = "--n_embds"
  run_dir = _RUN_DIR.value
  nvme_dir = _NVME_DIR.value or run_dir
  if not _NVME_DIR.value:
    os.makedirs(run_dir, exist_ok=True)
  if _POOL_CAPACITY.value.strip() == "auto":
    memory = int(exp_common.mem_available() * AUTO_MEMORY_FRACTION)
    disk = (shutil.disk_usage(nvme_dir).free // 2
            if os.path.isdir(nvme_dir) else memory)
    capacity = min(memory, disk)
    source_capacity = (f"auto: min({AUTO_MEMORY_FRACTION:.0%} of "
                       f"MemAvailable, half the nvme disk's free space)")
  else:
    capacity = parse_bytes(_POOL_CAPACITY.value, name="--pool_capacity")
    source_capacity = "--pool_capacity"
  return Config(
      model=model, n_layer=_N_LAYER.value, widths=widths,
      widths_source=source, modes=modes, batch=_BATCH.value,
      seq_len=_SEQ_LEN.value, rounds=_ROUNDS.value, warmup=_WARMUP.value,
      tune_steps=_TUNE_STEPS.value, fixed_prefetch=_FIXED_PREFETCH.value,
      device_budget=parse_bytes(_DEVICE_BUDGET.value,
                                name="--device_budget"),
      pool_capacity=capacity, pool_capacity_source=source_capacity,
      cxl_link=shared_flags.link(_LINK_BANDWIDTH, _LINK_LATENCY_US),
      nvme_dir=nvme_dir, search=_SEARCH.value, max_width=_MAX_WIDTH.value,
      seed=_SEED.value, run_dir=run_dir)


# ------------------------------------------------------------ the modes

_TX = lambda: optax.adamw(1e-3)


def _schedule(mode: str, config: Config) -> str:
  return {"ssd": "bucket", "cxl_fixed": f"fixed:{config.fixed_prefetch}",
          "cxl_dap": "dap"}[mode]


def _step_fn(model: gpt2.GPT2Config) -> Callable:
  return exp_common.make_train_step(gpt2.make_loss(model), _TX())


def _tier(mode: str) -> str:
  return "nvme" if mode == "ssd" else "cxl"


def _host_step(step_fn: Callable) -> Callable:
  """jax_host's step: the state comes in pinned_host memory, moves to the
  device at the step's start, and its new value goes back."""
  device = jax.devices()[0]
  on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
  def host_step(params, opt_state, batch):
    params, opt_state = jax.device_put((params, opt_state), on_device)
    return step_fn(params, opt_state, batch)
  return host_step


def _pinned() -> jax.sharding.Sharding:
  return jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                           memory_kind="pinned_host")


def _jitted(mode: str, step_fn: Callable) -> Any:
  if mode == "resident":
    return jax.jit(step_fn, donate_argnums=(0, 1))
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.jit(_host_step(step_fn), donate_argnums=(0, 1),
                 out_shardings=(_pinned(), _pinned(), device))


def _jit_need(compiled: Any) -> int:
  """Device bytes of a jitted step. For jax_host that includes its state:
  the step moves all of it onto the device, and XLA:CPU's memory_analysis
  does not tell pinned_host memory from device memory anyway."""
  return device_need(compiled.memory_analysis())


class Runner:
  """One mode's step and state; `step(batch)` returns the loss."""

  def __init__(self, mode: str, config: Config, model: gpt2.GPT2Config,
               params: Any, pool: jcxl.Pool | None, batch: dict):
    self.mode = mode
    self.skipped = ""
    step_fn = _step_fn(model)
    opt_state = _TX().init(params)
    if mode in ("resident", "jax_host"):
      self.step = _jitted(mode, step_fn)
      put = (lambda t: jax.device_put(t, _pinned())) if mode == "jax_host" \
          else (lambda t: jax.tree.map(jnp.array, t))
      self.state = (put(params), put(opt_state))
      compiled = self.step.lower(*self.state, batch).compile()
      self.need = _jit_need(compiled)
      if self.need > config.device_budget:
        self.skipped = (f"needs {format_bytes(self.need)} > budget "
                        f"{format_bytes(config.device_budget)}")
      self.plan = ""
      return
    tier = _tier(mode)
    self.state = (jcxl.place(params, tier, pool=pool),
                  jcxl.place(opt_state, tier, pool=pool))
    self.step = jcxl.cxl_offload(step_fn, schedule=_schedule(mode, config),
                                 device_budget=config.device_budget)
    try:
      self.step.compile(*self.state, batch)
      self.need = self.step.device_need(*self.state, batch)
    except MemoryError as e:
      self.need = None
      self.skipped = str(e).split(";")[0]

  def __call__(self, batch: dict) -> jax.Array:
    *self.state, loss = self.step(*self.state, batch)
    return loss

  @property
  def tuning(self) -> bool:
    tuner = getattr(self.step, "tuner", None)
    return tuner is not None and not tuner.converged

  def close(self) -> None:
    jax.block_until_ready(self.state)
    for x in jax.tree.leaves(self.state,
                             is_leaf=lambda x: isinstance(x, jcxl.PoolArray)):
      if isinstance(x, jcxl.PoolArray):
        x.delete()


def _pool(config: Config, state_bytes: int, modes: Sequence[str]
          ) -> jcxl.Pool:
  cxl = sum(m.startswith("cxl") for m in modes) * state_bytes
  return jcxl.Pool(
      host="64MiB", cxl=max(cxl, 1 << 20) + (64 << 20),
      nvme=(state_bytes + (64 << 20)) if "ssd" in modes else 0,
      nvme_dir=config.nvme_dir if "ssd" in modes else None,
      cxl_link=config.cxl_link)


def run_size(config: Config, width: int, batches: list[dict]) -> dict:
  """Every mode on one model size, in interleaved rounds."""
  model = config.family(width)
  params = common.init_params(model, seed=config.seed)
  size = max_model.sizes(model)
  state_bytes = size.param_bytes + size.opt_state_bytes
  logging.info("width %d: %.1fM parameters, state %s", width,
               size.params / 1e6, format_bytes(state_bytes))
  with _pool(config, state_bytes, config.modes) as pool:
    labels = {t: pool.stats()[t].label() for t in ("cxl", "nvme")
              if pool.stats()[t].capacity}
    runners = {m: Runner(m, config, model, params, pool, batches[0])
               for m in config.modes}
    live = {m: r for m, r in runners.items() if not r.skipped}
    losses = {m: [] for m in live}
    times = {m: [] for m in live}
    timed_rounds = 0
    for n, batch in enumerate(batches):
      if not live or timed_rounds >= config.rounds:
        break
      # Untimed: the warmup rounds, and DAP's tuning (within --tune_steps).
      timed = n >= config.warmup and (
          n >= config.tune_steps or not any(r.tuning for r in live.values()))
      timed_rounds += timed
      for mode in exp_common.rotated(list(live), n):
        runner = live[mode]
        start = time.perf_counter()
        loss = float(jax.block_until_ready(runner(batch)))
        seconds = time.perf_counter() - start
        losses[mode].append(loss)
        if timed:
          times[mode].append(seconds)
    rows = []
    tokens = config.batch * config.seq_len
    for mode, runner in runners.items():
      row = dict(width=width, params=size.params, state_bytes=state_bytes,
                 mode=mode, fits=not runner.skipped, skipped=runner.skipped,
                 device_need=runner.need, step_ms=None, tokens_per_s=None,
                 max_loss_rel_diff=None, run_loss_rel_diff=None, steps=0)
      if mode in live:
        median = statistics.median(times[mode])
        row.update(step_ms=median * 1e3, tokens_per_s=tokens / median,
                   steps=len(losses[mode]))
        if "resident" in live and mode != "resident":
          ref = np.asarray(losses["resident"])
          got = np.asarray(losses[mode][:len(ref)])
          diff = np.abs(got - ref) / np.abs(ref)
          row["max_loss_rel_diff"] = float(np.max(diff[:LOSS_CHECK_STEPS]))
          row["run_loss_rel_diff"] = float(np.max(diff))
        if mode == "cxl_dap":
          row["plan"] = str(runner.step.plan)
      rows.append(row)
      logging.info("width %d %s: %s", width, mode,
                   runner.skipped or f"{row['step_ms']:.1f} ms")
    for runner in runners.values():
      runner.close()
  return {"rows": rows, "labels": labels, "losses": losses}


# --------------------------------------------------- part 2: the largest


def _probe_need(mode: str, config: Config, model: gpt2.GPT2Config,
                pool: jcxl.Pool, batch: dict, state_bytes: int) -> int | None:
  """The step's device need at `model` (whose parameters and optimizer
  state take `state_bytes`); None if the pool can't hold it.

  Raises:
    MemoryError: an offloaded step found no plan within the budget.
  """
  params, opt_state, _ = max_model.shapes(model, 1, 1)
  if mode in ("resident", "jax_host"):
    if state_bytes > config.pool_capacity and mode == "jax_host":
      return None  # pinned host memory is bounded as the pool is
    if state_bytes > config.device_budget:
      return state_bytes  # the state alone is over: no compile
    return _jit_need(_jitted(mode, _step_fn(model)).lower(
        params, opt_state, batch).compile())
  try:
    reserved = max_model.reserve((params, opt_state), pool,
                                 jcxl.Tier(_tier(mode)))
  except jcxl.PoolExhaustedError:
    return None
  try:
    step = jcxl.cxl_offload(
        _step_fn(model), schedule=_schedule(mode, config),
        device_budget=config.device_budget)
    step.compile(*reserved, batch)
    return step.device_need(*reserved, batch)
  finally:
    max_model.free(reserved)


def search(config: Config) -> dict:
  """Per mode, the widest model whose step fits the budget and the pool."""
  batch = {k: jnp.zeros((config.batch, config.seq_len), jnp.int32)
           for k in ("x", "y")}
  out = {}
  pool = jcxl.Pool(host="64MiB", cxl=config.pool_capacity,
                   nvme=config.pool_capacity if "ssd" in config.modes else 0,
                   nvme_dir=config.nvme_dir if "ssd" in config.modes
                   else None, cxl_link=config.cxl_link)
  with pool:
    for mode in config.modes:
      def probe(index: int, mode=mode) -> max_model.Probe:
        model = config.family(index * HEAD_DIM)
        size = max_model.sizes(model)
        state_bytes = size.param_bytes + size.opt_state_bytes
        try:
          need = _probe_need(mode, config, model, pool, batch, state_bytes)
        except MemoryError:
          need = config.device_budget + 1  # no plan fits the budget
        return max_model.Probe(
            index, f"width {index * HEAD_DIM}", size.params, state_bytes,
            None if need is None else max_model.Need(need, 0, 0, 0, 0.0),
            config.device_budget)
      logging.info("largest model: %s", mode)
      best, reason, probes = max_model.largest(
          probe, min(config.widths) // HEAD_DIM,
          config.max_width // HEAD_DIM)
      out[mode] = {"largest": best, "stopped_by": reason, "probes": probes}
  return out


# ------------------------------------------------------------- reporting


def ratios(rows: list[dict], found: dict | None) -> dict[str, Any]:
  """cxl_dap against ssd: per size, and the best ('up to', as the paper)."""
  per_size = {}
  for width in sorted({r["width"] for r in rows}):
    by_mode = {r["mode"]: r for r in rows if r["width"] == width}
    dap, ssd = by_mode.get("cxl_dap"), by_mode.get("ssd")
    if dap and ssd and dap["step_ms"] and ssd["step_ms"]:
      per_size[width] = {
          "throughput_gain": dap["tokens_per_s"] / ssd["tokens_per_s"] - 1,
          "latency_reduction": 1 - dap["step_ms"] / ssd["step_ms"]}
  out: dict[str, Any] = {"per_width": per_size}
  if per_size:
    out["throughput_gain"] = max(v["throughput_gain"]
                                 for v in per_size.values())
    out["latency_reduction"] = max(v["latency_reduction"]
                                   for v in per_size.values())
  if found and found.get("cxl_dap", {}).get("largest") and found.get(
      "ssd", {}).get("largest"):
    out["max_model_ratio"] = (found["cxl_dap"]["largest"].params /
                              found["ssd"]["largest"].params)
  return out


def markdown(config: Config, title: str, rows: list[dict],
             found: dict | None, summary: dict) -> str:
  out = [f"# Offload modes compared\n\n{title}\n",
         f"Model: byte-level GPT-2, {config.n_layer} blocks, batch "
         f"{config.batch} x {config.seq_len} tokens, adamw; device budget "
         f"{format_bytes(config.device_budget)}; widths "
         f"{list(config.widths)} ({config.widths_source}); "
         f"{config.rounds} timed rounds after at least {config.warmup} "
         "untimed.\n",
         "| width | params | mode | step ms | tokens/s | device need | "
         f"loss diff vs resident, first {LOSS_CHECK_STEPS} steps | over the "
         "run |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    need = "-" if r["device_need"] is None else format_bytes(r["device_need"])
    step = r["skipped"] or _fmt(r["step_ms"], ".1f")
    out.append(f"| {r['width']} | {r['params'] / 1e6:.2f}M | {r['mode']} | "
               f"{step} | {_fmt(r['tokens_per_s'], ',.0f')} | {need} | "
               f"{_fmt(r['max_loss_rel_diff'], '.1e')} | "
               f"{_fmt(r['run_loss_rel_diff'], '.1e')} |")
  if found:
    out += ["", f"Largest trainable model (pool capacity "
            f"{format_bytes(config.pool_capacity)}, "
            f"{config.pool_capacity_source}):", "",
            "| mode | largest | params | device need | stopped by |",
            "|---|---|---|---|---|"]
    for mode, result in found.items():
      best = result["largest"]
      out.append(
          f"| {mode} | {best.model if best else 'nothing fits'} | "
          f"{f'{best.params / 1e6:.1f}M' if best else '-'} | "
          f"{format_bytes(best.need.total) if best else '-'} | "
          f"{result['stopped_by']} |")
  out += ["", "cxl_dap against ssd, measured here beside the paper's "
          "figures:", "", "| comparison | measured (best size) | per width |"
          " paper |", "|---|---|---|---|"]
  per = summary["per_width"]
  for key, name in (("throughput_gain", "throughput gain"),
                    ("latency_reduction", "latency reduction")):
    value = summary.get(key)
    widths = ", ".join(f"{w}: {v[key]:.1%}" for w, v in per.items())
    out.append(f"| {name} | {_fmt(value, '.1%')} | {widths or '-'} | "
               f"{PAPER[key]:.1%} |")
  out.append(f"| largest model ratio | "
             f"{_fmt(summary.get('max_model_ratio'), '.2f')}x | - | "
             f"{PAPER['max_model_ratio']:.2f}x |")
  fits = [r for r in rows if r["max_loss_rel_diff"] is not None]
  if fits:
    worst = max(fits, key=lambda r: r["max_loss_rel_diff"])
    verdict = "within" if worst["max_loss_rel_diff"] <= LOSS_RTOL else \
        "OUTSIDE"
    drift = max(fits, key=lambda r: r["run_loss_rel_diff"])
    out += ["", f"Losses against resident (same weights and batches), "
            f"where resident fits: largest relative difference over the "
            f"first {LOSS_CHECK_STEPS} steps {worst['max_loss_rel_diff']:.1e}"
            f" ({worst['mode']}, width {worst['width']}), {verdict} the "
            f"stated tolerance {LOSS_RTOL:g}. Over the whole run "
            f"{drift['run_loss_rel_diff']:.1e} ({drift['mode']}, width "
            f"{drift['width']}): training amplifies float rounding (the "
            "offloaded step sums in another order), so later steps are "
            "reported, not checked."]
  return "\n".join(out) + "\n"


def plots(config: Config, title: str, rows: list[dict], found: dict | None,
          losses: dict) -> list[str]:
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  import textwrap  # pylint: disable=g-import-not-at-top
  wrapped = "\n".join(textwrap.wrap(title, 100))
  paths = []

  def figure(name, heading):
    fig = Figure(figsize=(9, 5.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(f"{heading}\n{wrapped}", fontsize=7)
    ax.grid(True, alpha=0.3)
    paths.append(os.path.join(config.run_dir, name))
    return fig, ax

  for key, name, label in (("tokens_per_s", "throughput.png", "tokens / s"),
                           ("step_ms", "latency.png", "step latency (ms)")):
    fig, ax = figure(name, f"{label} against model size")
    for mode in config.modes:
      points = [(r["params"] / 1e6, r[key]) for r in rows
                if r["mode"] == mode and r[key] is not None]
      if points:
        ax.plot(*zip(*points), marker="o", label=mode)
    ax.set_xlabel("parameters (millions)")
    ax.set_ylabel(label)
    ax.legend()
    fig.savefig(paths[-1])
  if found:
    fig, ax = figure("largest.png", "largest trainable model under the "
                     f"budget ({format_bytes(config.device_budget)})")
    modes = list(found)
    ax.bar(modes, [(found[m]["largest"].params / 1e6 if found[m]["largest"]
                    else 0) for m in modes])
    ax.set_ylabel("parameters (millions)")
    fig.savefig(paths[-1])
  fig, ax = figure("loss.png", "training loss per mode, same weights and "
                   "batches (widest size where resident fits)")
  for mode, curve in losses.items():
    ax.plot(range(1, len(curve) + 1), curve, label=mode,
            linestyle="--" if mode != "resident" else "-")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats per byte)")
  ax.legend()
  fig.savefig(paths[-1])
  return paths


def _write_csv(path: str, rows: list[dict]) -> None:
  fields = list(dict.fromkeys(k for r in rows for k in r))
  with open(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)


def run(config: Config) -> dict:
  os.makedirs(config.run_dir, exist_ok=True)
  corpus = data.load_stdlib_corpus()
  stream = corpus.batches("train", config.batch, config.seq_len,
                          seed=config.seed)
  batches = [next(stream) for _ in range(config.tune_steps + config.rounds)]
  rows, labels, losses = [], {}, {}
  for width in config.widths:
    result = run_size(config, width, batches)
    rows += result["rows"]
    labels.update(result["labels"])
    if "resident" in result["losses"]:
      losses = result["losses"]
  found = search(config) if config.search else None
  machine = bench.describe_machine(config.nvme_dir)
  link = labels.get("cxl", f"cxl (EMULATED, link {config.cxl_link})")
  title = (f"{link}; {labels.get('nvme', 'nvme tier unused')}; device: "
           "XLA:CPU (device memory is host DRAM, the budget an accounting "
           "limit; pinned_host is the same DRAM); "
           f"{machine}")
  summary = ratios(rows, found)
  text = markdown(config, title, rows, found, summary)
  _write_csv(os.path.join(config.run_dir, "results.csv"),
             [{k: v for k, v in r.items() if k != "plan"} for r in rows])
  if found:
    _write_csv(os.path.join(config.run_dir, "search.csv"), [
        {"mode": m, "width": p.index * HEAD_DIM, "params": p.params,
         "state_bytes": p.state_bytes,
         "device_need": p.need.total if p.need else None, "fits": p.fits,
         "stopped_by": p.stopped_by} for m, f in found.items()
        for p in f["probes"]])
  with open(os.path.join(config.run_dir, "results.md"), "w",
            encoding="utf-8") as f:
    f.write(text)
  exp_plots.if_available(plots, config, title, rows, found, losses)
  print(text)
  return {"title": title, "rows": rows, "summary": summary,
          "largest": {m: {"params": f["largest"].params if f["largest"]
                          else 0, "stopped_by": f["stopped_by"]}
                      for m, f in (found or {}).items()}}


def main(argv: Sequence[str]) -> None:
  exp_common.run_program(argv, config_from_flags, run)


if __name__ == "__main__":
  host_allocator.start()
  app.run(main, flags_parser=exp_common.flags_parser(FLAGS, __doc__))
