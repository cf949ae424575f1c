"""experiments.train's checkpoints: saved every --checkpoint_every steps
into <run_dir>/checkpoints/<step> (jcxl.checkpoint), the newest
--keep_checkpoints kept, and what a killed save left behind removed."""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import jcxl
from experiments import cluster
from experiments.train import metrics
from experiments.train.config import Config
from experiments.train.config import finished_steps


def remove_unfinished(directory: str) -> None:
  """Deletes what saves killed midway left (their temporary directories);
  this run owns the directory."""
  if not os.path.isdir(directory):
    return
  for name in os.listdir(directory):
    path = os.path.join(directory, name)
    if not jcxl.checkpoint.is_complete(path):
      metrics.say(f"removing an unfinished checkpoint: {path}")
      shutil.rmtree(path, ignore_errors=True)


def save(config: Config, runner: Any, step: int) -> tuple[str, float]:
  """Saves the run's state at `step`, then drops the oldest checkpoints."""
  start = time.perf_counter()
  path = jcxl.checkpoint.save(
      os.path.join(config.checkpoint_dir, str(step)),
      {**runner.state(), "step": step, "data_position": step},
      metadata={"train": {"run": config.identity(), "step": step}})
  if cluster.is_lead():  # every process saved its shards; one cleans up
    for old in finished_steps(
        config.checkpoint_dir)[:-config.keep_checkpoints]:
      shutil.rmtree(os.path.join(config.checkpoint_dir, str(old)))
  return path, time.perf_counter() - start
