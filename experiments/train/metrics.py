"""experiments.train's metrics: the transfers and time of each logging
window, metrics.jsonl and metrics.csv, the progress lines (printed by
process 0 only) and the run's summary."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from experiments import cluster
from experiments.train.config import Config
from jcxl.units import format_bytes


def model_layer(name: str) -> str:
  """'[0].mu['blocks_3']['mlp']' -> 'blocks_3': the module a transfer is for
  (optimizer-state prefixes dropped)."""
  start = name.find("['")
  if start < 0:
    return name
  return name[start + 2:name.index("']", start)]


@dataclasses.dataclass
class Window:
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
      totals = per_layer[model_layer(r.name)]
      totals[0] += r.wait_s
      totals[1] += r.bytes_fetched + r.bytes_stored


class Metrics:
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


def say(text: str) -> None:
  """Progress is printed by process 0 only (the others compute the same)."""
  if cluster.is_lead():
    print(text, flush=True)


def progress_line(row: dict[str, Any], config: Config, label: str) -> str:
  note = " (first step: compilation, warm-up)" if row["startup"] else ""
  return (f"step {row['step']:>5d}/{config.steps}  loss {row['loss']:.4f}  "
          f"{row['tokens_per_s']:8.0f} tokens/s  stall "
          f"{row['stall_frac']:6.1%}  streamed "
          f"{format_bytes(row['bytes_fetched'] + row['bytes_stored'])}{note}"
          f"  [state in {label}]")


def summary(config: Config, info: dict[str, Any], results: dict[str, Any],
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


def summary_text(s: dict[str, Any]) -> str:
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
