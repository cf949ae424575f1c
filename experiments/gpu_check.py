r"""The prepared check of the CUDA path, for a GPU lent for a few minutes.

On one GPU (under 5 minutes on an H200, the project already installed):

  (a) equality: GPT-2-tiny, unrolled and scanned, adamw: --equality_steps
      cxl_offload steps (state in the cxl tier) against plain jax.jit steps
      with everything on the GPU: the same losses and final state.
  (b) bandwidth, host to device and device to host, of each pool tier
      (host, cxl, nvme) through jcxl.fetch / jcxl.store in a jitted step,
      against cudaMemcpyAsync between page-locked memory and the GPU, and
      against jax.device_put to and from JAX's pinned_host memory.
  (c) step time of a GPT-2-medium-sized model (--width x --layers over
      bytes): resident, jax_host (JAX's own memory kinds), cxl_fixed and
      cxl_dap (experiments.compare's modes, in interleaved rounds).

It writes <run_dir>/gpu_check.json, prints a table, and checks the CUDA
path's targets (host tier at least 90% of cudaMemcpyAsync and 5x
jax.device_put where that is as slow as reported; the offloaded step within
1.1x of resident and faster than jax_host). Where the cxl tier is emulated
(no CXL memory), its transfers keep the emulated link's bandwidth and go
through the copy engine; the report says so.

--dry_run runs all of it on this machine's CPU device with small sizes;
what needs CUDA (cudaMemcpyAsync, the targets) is reported as skipped, never
made up:

  python -m experiments.gpu_check              # on the GPU machine
  python -m experiments.gpu_check --dry_run    # anywhere
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from absl import app
from absl import flags
import jax
import numpy as np
import optax

import jcxl
from experiments import common as exp_common
from experiments import compare
from experiments import flags as shared_flags
from jcxl import _jcxl
from jcxl.units import format_bytes
from jcxl.units import parse_bytes
from models import common
from models import data
from models import gpt2

FLAGS = flags.FlagValues()
_DRY_RUN = shared_flags.dry_run(
    FLAGS, help_text="Run on the CPU with small sizes (no GPU needed); what "
    "needs CUDA is reported as skipped.")
_RUN_DIR = shared_flags.run_dir(FLAGS, default="runs/gpu_check",
                                help_text="Where gpu_check.json goes.")
_TRANSFER_BYTES = flags.DEFINE_string(
    "transfer_bytes", None, "Bytes per bandwidth transfer (default 256MiB, "
    "8MiB with --dry_run).", flag_values=FLAGS)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed transfers per "
                                "measurement (the median is reported).",
                                lower_bound=1, flag_values=FLAGS)
_EQUALITY_STEPS = flags.DEFINE_integer("equality_steps", 3, "Steps of each "
                                       "equality check.", lower_bound=1,
                                       flag_values=FLAGS)
_WIDTH = flags.DEFINE_integer("width", None, "Model width for (c) (default "
                              "1024, 64 with --dry_run).", flag_values=FLAGS)
_LAYERS = flags.DEFINE_integer("layers", None, "Blocks for (c) (default 24, "
                               "2 with --dry_run).", flag_values=FLAGS)
_BATCH = shared_flags.batch(FLAGS, default=None, help_text="Sequences "
                            "per step in (c) (default 8, 2 with --dry_run).")
_SEQ_LEN = shared_flags.seq_len(FLAGS, default=None, help_text="Tokens per "
                                "sequence in (c) (default 256, 32 with "
                                "--dry_run).")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed rounds in (c).",
                               lower_bound=1, flag_values=FLAGS)
_NVME_DIR = shared_flags.nvme_dir(FLAGS, default=None, help_text="Directory "
                                  "for the nvme tier (default: the system's "
                                  "temporary one).")

TIERS = ("host", "cxl", "nvme")
STEP_MODES = ("resident", "jax_host", "cxl_fixed", "cxl_dap")
# Targets of the CUDA path (checked on a GPU only).
MEMCPY_FRACTION = 0.9
DEVICE_PUT_FACTOR = 5.0
DEVICE_PUT_SLOW = 0.2  # "as slow as reported": under 1/5 of cudaMemcpyAsync
STEP_OVER_RESIDENT = 1.1
EQUALITY_RTOL = {"cpu": 1e-5, "gpu": 1e-4}  # XLA:GPU may fuse differently
LEAF_ATOL = exp_common.STATE_LEAF_ATOL


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  dry_run: bool
  run_dir: str
  transfer_bytes: int
  repeats: int
  equality_steps: int
  width: int
  layers: int
  batch: int
  seq_len: int
  rounds: int
  nvme_dir: str

  def validate(self) -> None:
    if self.transfer_bytes < 4096 or self.transfer_bytes % 4:
      raise ValueError("--transfer_bytes must be at least 4KiB and a "
                       f"multiple of 4, got {self.transfer_bytes}")
    for name in ("width", "layers", "batch", "seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name} must be positive, got "
                         f"{getattr(self, name)}")
    if self.width % compare.HEAD_DIM:
      raise ValueError(f"--width must be a multiple of {compare.HEAD_DIM}, "
                       f"got {self.width}")
    if self.seq_len > compare.byte_gpt2(self.width, 1).n_ctx:
      raise ValueError(f"--seq_len must be at most "
                       f"{compare.byte_gpt2(self.width, 1).n_ctx}")
    exp_common.check_directory(self.nvme_dir, flag="--nvme_dir")


def config_from_flags() -> Config:
  dry = _DRY_RUN.value
  pick = lambda flag, gpu, cpu: flag.value if flag.value is not None else (
      cpu if dry else gpu)
  return Config(
      dry_run=dry, run_dir=_RUN_DIR.value,
      transfer_bytes=parse_bytes(pick(_TRANSFER_BYTES, "256MiB", "8MiB"),
                                 name="--transfer_bytes"),
      repeats=_REPEATS.value, equality_steps=_EQUALITY_STEPS.value,
      width=pick(_WIDTH, 1024, 64), layers=pick(_LAYERS, 24, 2),
      batch=pick(_BATCH, 8, 2), seq_len=pick(_SEQ_LEN, 256, 32),
      rounds=_ROUNDS.value,
      nvme_dir=_NVME_DIR.value or tempfile.gettempdir())


def _device() -> jax.Device:
  return jax.devices()[0]


def _on_gpu() -> bool:
  return _device().platform == "gpu" and jcxl.cuda_available()


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
  jax.block_until_ready(fn())  # compile, warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


# ------------------------------------------------------- (a) equality


def _leaf_rel_diff(a: Any, b: Any) -> float:
  """The largest difference in a leaf, over the leaf's largest value."""
  a, b = np.asarray(a), np.asarray(b)
  scale = float(np.abs(b).max()) if b.size else 0.0
  return float(np.abs(a - b).max()) / scale if scale else float(
      np.abs(a - b).max(initial=0.0))


def equality(config: Config, pool: jcxl.Pool) -> list[dict[str, Any]]:
  """Offloaded against resident steps, per model form."""
  rtol = EQUALITY_RTOL["gpu" if _on_gpu() else "cpu"]
  out = []
  for form, scan in (("unrolled", False), ("scanned", True)):
    model = gpt2.tiny(scan_layers=scan)
    loss_fn = gpt2.make_loss(model)
    tx = optax.adamw(1e-3)
    params = common.init_params(model, seed=0)
    opt_state = tx.init(params)
    batch = gpt2.example_batch(model, batch_size=4, seq_len=32)
    step = exp_common.make_train_step(loss_fn, tx)
    resident = jax.jit(step)
    offloaded = jcxl.cxl_offload(step, schedule="fixed:1")
    ref = (params, opt_state)
    placed = (jcxl.place(params, "cxl", pool=pool),
              jcxl.place(opt_state, "cxl", pool=pool))
    want, got = [], []
    for _ in range(config.equality_steps):
      *ref, loss = resident(*ref, batch)
      want.append(float(loss))
      *placed, loss = offloaded(*placed, batch)
      got.append(float(loss))
    final = jax.tree.leaves(jcxl.gather(tuple(placed)))
    final_ref = jax.tree.leaves(tuple(ref))
    leaf_diff = max(_leaf_rel_diff(a, b) for a, b in zip(final, final_ref))
    loss_diff = float(np.max(np.abs(np.subtract(got, want)) /
                             np.abs(want)))
    passed = loss_diff <= rtol and all(
        np.allclose(np.asarray(a), np.asarray(b), rtol=rtol,
                    atol=LEAF_ATOL * float(np.abs(np.asarray(b)).max()))
        for a, b in zip(final, final_ref))
    out.append({"model": f"gpt2-tiny ({form})", "steps": config.equality_steps,
                "losses": got, "resident_losses": want,
                "max_loss_rel_diff": loss_diff,
                "max_state_leaf_rel_diff": leaf_diff, "rtol": rtol,
                "leaf_atol": LEAF_ATOL, "passed": passed})
    for x in jax.tree.leaves(tuple(placed),
                             is_leaf=lambda x: isinstance(x, jcxl.PoolArray)):
      x.delete()
  return out


# ------------------------------------------------------ (b) bandwidth


def _gbps(nbytes: int, seconds: float) -> float:
  return nbytes / seconds / 1e9


def tier_bandwidth(config: Config, pool: jcxl.Pool, tier: str
                   ) -> dict[str, Any]:
  """jcxl.fetch and jcxl.store of one object, in GB/s."""
  n = config.transfer_bytes
  values = np.arange(n // 4, dtype=np.float32)
  x = jcxl.place(values, tier, pool=pool,
                 sharding=jax.sharding.SingleDeviceSharding(_device()))
  try:
    fetch = jax.jit(jcxl.fetch)
    fetched = fetch(x)
    if not np.array_equal(np.asarray(fetched), values):
      raise AssertionError(f"{tier}: fetched bytes differ from the stored")
    store = jax.jit(jcxl.store)
    on_device = jax.device_put(values + 1, _device())
    h2d = _median_seconds(lambda: fetch(x), config.repeats)
    # The step returns once its store is in the pool (store_done waits).
    d2h = _median_seconds(lambda: store(x, on_device), config.repeats)
    if not np.array_equal(np.asarray(jcxl.gather(x)), values + 1):
      raise AssertionError(f"{tier}: stored bytes differ from the device's")
    return {"tier": tier, "label": pool.stats()[tier].label(),
            "h2d_gbps": _gbps(n, h2d), "d2h_gbps": _gbps(n, d2h)}
  finally:
    x.delete()


def device_put_bandwidth(config: Config) -> dict[str, Any]:
  """jax.device_put between pinned_host memory and the device, in GB/s."""
  n = config.transfer_bytes
  device = _device()
  pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  on_device = jax.sharding.SingleDeviceSharding(device)
  host = jax.device_put(np.ones(n // 4, np.float32), pinned)
  resident = jax.device_put(np.ones(n // 4, np.float32), on_device)
  h2d = _median_seconds(lambda: jax.device_put(host, on_device),
                        config.repeats)
  d2h = _median_seconds(lambda: jax.device_put(resident, pinned),
                        config.repeats)
  return {"h2d_gbps": _gbps(n, h2d), "d2h_gbps": _gbps(n, d2h)}


def memcpy_bandwidth(config: Config) -> dict[str, Any]:
  """cudaMemcpyAsync between page-locked host memory and the GPU."""
  if not _on_gpu():
    return {"skipped": "no CUDA GPU (or jcxl built without CUDA)"}
  ordinal = _device().local_hardware_id
  rate = lambda to_device: _jcxl.cuda_memcpy_bandwidth(
      ordinal, config.transfer_bytes, to_device, config.repeats) / 1e9
  return {"h2d_gbps": rate(True), "d2h_gbps": rate(False)}


# ------------------------------------------------------ (c) step time


def step_times(config: Config) -> dict[str, Any]:
  budget = 1 << 40  # no budget: (c) compares speed, every mode must run
  cfg = compare.Config(
      model="gpt2", n_layer=config.layers, widths=(config.width,),
      widths_source="gpu_check", modes=STEP_MODES, batch=config.batch,
      seq_len=config.seq_len, rounds=config.rounds,
      warmup=1 if config.dry_run else 2,
      tune_steps=3 if config.dry_run else 12,
      fixed_prefetch=1, device_budget=budget, pool_capacity=0,
      pool_capacity_source="per mode", cxl_link=jcxl.DEFAULT_CXL_LINK,
      nvme_dir=config.nvme_dir, search=False, max_width=config.width, seed=0,
      run_dir=config.run_dir)
  stream = data.load_stdlib_corpus().batches(
      "train", cfg.batch, cfg.seq_len, seed=0)
  batches = [next(stream) for _ in range(cfg.tune_steps + cfg.rounds)]
  result = compare.run_size(cfg, config.width, batches)
  rows = {r["mode"]: {k: r[k] for k in ("step_ms", "tokens_per_s",
                                         "max_loss_rel_diff", "skipped")}
          for r in result["rows"]}
  return {"model": f"byte GPT-2, {config.layers} x {config.width} "
                   f"({result['rows'][0]['params']:,} parameters)",
          "batch": config.batch, "seq_len": config.seq_len,
          "labels": result["labels"], "modes": rows}


# ------------------------------------------------------------ targets


def targets(result: dict[str, Any]) -> dict[str, Any]:
  """The CUDA path's targets, measured; evaluated on a GPU only."""
  if not result["gpu"]:
    return {"skipped": "needs a CUDA GPU"}
  memcpy = result["bandwidth"]["cudaMemcpyAsync"]
  put = result["bandwidth"]["device_put_pinned_host"]
  host = next(t for t in result["bandwidth"]["tiers"] if t["tier"] == "host")
  out = {"equality": all(e["passed"] for e in result["equality"])}
  out["host_h2d_over_memcpy"] = host["h2d_gbps"] / memcpy["h2d_gbps"]
  out["host_h2d_at_least_90pct_of_memcpy"] = (
      out["host_h2d_over_memcpy"] >= MEMCPY_FRACTION)
  out["host_h2d_over_device_put"] = host["h2d_gbps"] / put["h2d_gbps"]
  if put["h2d_gbps"] < DEVICE_PUT_SLOW * memcpy["h2d_gbps"]:
    out["host_h2d_5x_device_put"] = (
        out["host_h2d_over_device_put"] >= DEVICE_PUT_FACTOR)
  modes = result["steps"]["modes"]
  resident = modes["resident"]["step_ms"]
  best = min(m["step_ms"] for k, m in modes.items()
             if k.startswith("cxl") and m["step_ms"])
  out["offloaded_over_resident"] = best / resident
  out["offloaded_within_1.1x_resident"] = best <= STEP_OVER_RESIDENT * resident
  out["offloaded_faster_than_jax_host"] = best < modes["jax_host"]["step_ms"]
  return out


def table(result: dict[str, Any]) -> str:
  b = result["bandwidth"]
  lines = [f"gpu_check on {result['device']} ({result['kind']})", "",
           "| transfer | host -> device GB/s | device -> host GB/s |",
           "| --- | --- | --- |"]
  fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else "-"
  for t in b["tiers"]:
    lines.append(f"| jcxl {t['tier']}: {t['label']} | {fmt(t['h2d_gbps'])} "
                 f"| {fmt(t['d2h_gbps'])} |")
  m = b["cudaMemcpyAsync"]
  lines.append(f"| cudaMemcpyAsync, page-locked | "
               f"{fmt(m.get('h2d_gbps')) if 'skipped' not in m else m['skipped']}"
               f" | {fmt(m.get('d2h_gbps'))} |")
  p = b["device_put_pinned_host"]
  lines.append(f"| jax.device_put, pinned_host | {fmt(p['h2d_gbps'])} | "
               f"{fmt(p['d2h_gbps'])} |")
  lines += ["", f"step time, {result['steps']['model']}:", "",
            "| mode | step ms | tokens/s | loss vs resident |",
            "| --- | --- | --- | --- |"]
  for mode, row in result["steps"]["modes"].items():
    lines.append(f"| {mode} | {fmt(row['step_ms'])} | "
                 f"{fmt(row['tokens_per_s'])} | "
                 f"{row['max_loss_rel_diff'] if row['max_loss_rel_diff'] is not None else '-'}"
                 f"{' (' + row['skipped'] + ')' if row['skipped'] else ''} |")
  lines += ["", "equality (offloaded vs resident):"]
  for e in result["equality"]:
    lines.append(f"  {e['model']}: {'PASS' if e['passed'] else 'FAIL'} "
                 f"(losses {e['max_loss_rel_diff']:.2e}, state "
                 f"{e['max_state_leaf_rel_diff']:.2e} of a leaf's largest "
                 f"value; tolerance rtol {e['rtol']} + {e['leaf_atol']} of "
                 "it)")
  lines += ["", f"targets: {json.dumps(result['targets'])}"]
  return "\n".join(lines)


def run(config: Config) -> dict[str, Any]:
  os.makedirs(config.run_dir, exist_ok=True)
  on_gpu = _on_gpu()
  if not on_gpu and not config.dry_run:
    raise app.UsageError(
        f"no CUDA GPU with jcxl's CUDA handlers here (device: {_device()}, "
        f"built with CUDA: {_jcxl.cuda_built}); pass --dry_run")
  started = time.perf_counter()
  n = config.transfer_bytes
  with jcxl.Pool(host=2 * n + (64 << 20), cxl=2 * n + (64 << 20),
                 nvme=2 * n + (64 << 20), nvme_dir=config.nvme_dir) as pool:
    result = {
        "device": str(_device()), "gpu": on_gpu,
        "kind": ("CUDA GPU" if on_gpu else
                 "DRY RUN on XLA:CPU: no GPU, every tier is host DRAM"),
        "jcxl_built_with_cuda": bool(_jcxl.cuda_built),
        "transfer_bytes": n, "emulated": [t.value for t in
                                          pool.stats().emulated],
        "equality": equality(config, pool),
        "bandwidth": {
            "tiers": [tier_bandwidth(config, pool, t) for t in TIERS],
            "cudaMemcpyAsync": memcpy_bandwidth(config),
            "device_put_pinned_host": device_put_bandwidth(config)},
    }
  result["steps"] = step_times(config)
  result["targets"] = targets(result)
  result["wall_s"] = time.perf_counter() - started
  exp_common.write_json(os.path.join(config.run_dir, "gpu_check.json"),
                        result)
  print(table(result), flush=True)
  print(f"wrote {os.path.join(config.run_dir, 'gpu_check.json')} "
        f"({result['wall_s']:.0f} s)", flush=True)
  return result


parse_flags = exp_common.flags_parser(FLAGS, __doc__)


def main(argv: Sequence[str]) -> None:
  exp_common.run_program(argv, config_from_flags, run)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
