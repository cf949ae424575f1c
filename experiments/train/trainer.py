"""experiments.train's run: the state initialised, the run directory
written, the training loop with its evaluations and checkpoints, and the
summary."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from absl import app
import jax
import numpy as np

from benchmarks import bench
import jcxl
from experiments import cluster
from experiments import common as experiments_common
from experiments import plots
from experiments.train import checkpointing
from experiments.train import metrics as metrics_lib
from experiments.train import runners
from experiments.train.config import CLUSTER
from experiments.train.config import Config
from experiments.train.config import config_from_flags
from experiments.train.config import nbytes
from experiments.train.metrics import say
from jcxl.planning import device_need
from jcxl.units import format_bytes
from models import common
from models import data
from models import gpt2


def run(config: Config) -> dict[str, Any]:
  """Trains, writes the run directory, prints a summary; returns it."""
  started = time.perf_counter()
  os.makedirs(config.run_dir, exist_ok=True)
  model = config.model_config()
  corpus = data.load_stdlib_corpus(config.data_bytes)
  eval_set = corpus.eval_batches(config.batch, config.seq_len,
                                 config.eval_batches)
  loss_fn = gpt2.make_loss(model)
  tx = runners.make_optimizer(config)
  mesh = cluster.mesh()
  params, opt_state = runners.init_state(model, tx, config.seed, mesh)
  to_devices = runners.batch_placer(mesh, config.batch)
  eval_set = [to_devices(b) for b in eval_set]
  state_bytes = nbytes((params, opt_state))
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                     sharding=getattr(x, "sharding", None)),
      (params, opt_state, eval_set[0]))
  resident = jax.jit(experiments_common.make_train_step(loss_fn, tx),
                     donate_argnums=(0, 1)).lower(*abstract).compile()
  resident_need = device_need(resident.memory_analysis())
  with contextlib.ExitStack() as stack:
    if config.mode == "cxl":
      pool = stack.enter_context(runners.pool_for(
          config, cluster.local_bytes((params, opt_state))))
      runner = runners.Offloaded(config, pool, params, opt_state, loss_fn, tx)
      # The device copies go as soon as the pool holds the state.
      runners.delete((params, opt_state))
      del resident
    else:
      runner = runners.Resident(resident, params, opt_state, loss_fn)
    del params, opt_state
    start = {"step": 0, "data_position": 0}
    if config.resume is not None:
      path = config.resume_path()
      restored = runner.load(path, {**runner.state(), **start})
      start = {k: int(restored[k]) for k in start}
      say(f"resumed from {path} at step {start['step']}")
    if config.checkpoint_every and cluster.is_lead():
      checkpointing.remove_unfinished(config.checkpoint_dir)
    info = {
        "model": {"name": config.model,
                  "parameters": common.count_params(model),
                  "config": {k: _jsonable(v) for k, v in
                             dataclasses.asdict(model).items()}},
        "state_bytes": state_bytes,
        "tokens_per_step": config.batch * config.seq_len,
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
    metrics = metrics_lib.Metrics(config.run_dir, keep_until_step=(
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
  summary = metrics_lib.summary(config, info, results, memory, metrics.rows,
                     time.perf_counter() - started)
  if not lead:
    print(f"[{cluster.describe()}] done: train loss "
          f"{summary['first_loss']:.3f} -> {summary['last_loss']:.3f}, "
          f"state shards in {info['label']}", flush=True)
    return summary
  summary["plots"] = plots.if_available(
      plots.plot_run, config.run_dir, metrics.rows, results["layer_wait_s"],
      runner.label)
  experiments_common.write_json(os.path.join(config.run_dir, "summary.json"),
                                summary)
  say(metrics_lib.summary_text(summary))
  return summary


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
  say(f"train {config.model} ({info['model']['parameters']:,} parameters),"
        f" {config.steps} steps of {config.batch} x {config.seq_len} "
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
           eval_set: Sequence[dict], metrics: metrics_lib.Metrics,
           to_devices: Callable[[dict], dict], step: int = 0,
           data_position: int = 0) -> dict[str, Any]:
  """The training loop from `step` (a checkpoint's; 0: the start); returns
  per-step losses and per-layer totals."""
  batches = corpus.batches("train", config.batch, config.seq_len,
                           seed=config.seed)
  for _ in range(data_position):  # the data stream where the run left it
    next(batches)
  start_step = step
  tokens_per_step = config.batch * config.seq_len
  per_layer: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
  window = metrics_lib.Window(start=time.perf_counter())
  pending: list[jax.Array] = []
  losses: list[float] = []
  for step in range(start_step + 1, config.steps + 1):
    pending.append(runner.train(to_devices(next(batches))))
    if step == start_step + 1 and isinstance(runner, runners.Offloaded):
      say(f"offloaded step needs {format_bytes(runner.need)} of device "
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
      say(metrics_lib.progress_line(row, config, runner.label))
      pending = []
      window = metrics_lib.Window(start=time.perf_counter())
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
      say(f"eval  step {step:>5d}  val_loss {val_loss:.4f}  "
            f"({len(eval_set)} batches, {eval_s:.1f} s, streamed "
            f"{format_bytes(row['bytes_fetched'])})  [state in "
            f"{runner.label}]")
    if config.checkpoint_every and step % config.checkpoint_every == 0:
      path, save_s = checkpointing.save(config, runner, step)
      window.start += save_s  # saving is not training time either
      say(f"checkpoint step {step}: {path} ({save_s:.1f} s)  [state in "
            f"{runner.label}]")
  return {"losses": losses,
          "layer_wait_s": {k: v[0] for k, v in per_layer.items()},
          "layer_bytes": {k: v[1] for k, v in per_layer.items()}}


def main(argv: Sequence[str]) -> None:
  """Runs the program (after ``parse_flags``): one process of the run."""
  try:
    cluster.initialize(CLUSTER)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  with jcxl.distributed.fail_together():
    experiments_common.run_program(argv, config_from_flags, run)
