r"""Replays model allocation traces on jcxl's allocator and a first-fit one.

Builds, for each model, the allocation trace of training it with Adam
(parameters, moments, gradients, checkpointed activations and transient
buffers; see benchmarks/alloc_trace.py), replays it on the hybrid allocator
(size-class slabs plus best-fit extents, 4 KiB granularity) and on a plain
first-fit allocator with 16-byte alignment (malloc-like), and prints their
fragmentation and allocation times side by side.

  python -m experiments.alloc_trace --models=gpt2,llama-7b --steps=3 \
      --dtype=float32 --run_dir=/tmp/alloc_trace
"""

from __future__ import annotations

import dataclasses
import sys

from absl import app
from absl import flags
from absl import logging

from benchmarks import alloc_trace
from experiments import flags as shared_flags
from experiments import host_allocator
from experiments import results_file

_MODELS = flags.DEFINE_list(
    "models", list(alloc_trace.MODEL_NAMES),
    f"Models to trace, from {', '.join(alloc_trace.MODEL_NAMES)}.")
_STEPS = shared_flags.steps(default=3,
                            help_text="Training steps after step 0.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", alloc_trace.DTYPES,
                           "Dtype of parameters, moments and activations.")
_BATCH = shared_flags.batch(default=8)
_SEED = shared_flags.seed(help_text="Seeds the per-step sequence lengths.")
_DONATE = flags.DEFINE_bool(
    "donate", True,
    "Update parameters and moments in place (donated state); with "
    "--nodonate every update allocates new buffers and frees the old.")
_RUN_DIR = shared_flags.run_dir(
    default=None,
    help_text="Run directory for alloc_trace.csv and alloc_trace.md.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """One run of the experiment."""

  models: tuple[str, ...]
  steps: int
  dtype: str
  batch: int
  seed: int
  donate: bool
  run_dir: str | None

  def traces(self) -> list[alloc_trace.TraceConfig]:
    return [alloc_trace.TraceConfig(model=m, steps=self.steps,
                                    dtype=self.dtype, batch=self.batch,
                                    seed=self.seed, donate=self.donate)
            for m in self.models]

  def validate(self) -> None:
    """Raises ValueError naming the first bad setting."""
    if not self.models:
      raise ValueError("--models must name at least one model")
    for trace in self.traces():
      trace.validate()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  config = Config(models=tuple(_MODELS.value), steps=_STEPS.value,
                  dtype=_DTYPE.value, batch=_BATCH.value, seed=_SEED.value,
                  donate=_DONATE.value, run_dir=_RUN_DIR.value)
  try:
    config.validate()
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  logging.info("config: %s", config)

  comparisons = []
  for trace in config.traces():
    logging.info("replaying %s", trace.model)
    comparisons.append(alloc_trace.compare(trace))
  rows = alloc_trace.table_rows(comparisons)
  print(alloc_trace.format_table(rows))
  if config.run_dir:
    for path in alloc_trace.write_results(comparisons, config.run_dir):
      logging.info("wrote %s", path)
  results_file.write("alloc_trace", {"config": dataclasses.asdict(config),
                                     "rows": rows}, sys.argv)


if __name__ == "__main__":
  host_allocator.start()
  app.run(main)
