"""What every experiment's main does: reject stray arguments, build and
validate its frozen config, log it, run, and write results as JSON."""

from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Callable, Sequence
from typing import Any

from absl import app
from absl import flags
from absl import logging
import jax
import optax

from benchmarks import bench
from experiments import results_file

_HELP_ARGS = ("-h", "-?", "--help", "--helpshort", "--helpfull")
# Comparing a trained state with a reference computed another way (offloaded
# vs resident, two processes vs one): each leaf may differ by this much of
# its own largest value, besides a relative tolerance. The attention's key
# bias has a zero gradient in exact arithmetic (softmax ignores a shift
# shared by all keys), so its gradient is rounding noise that depends on the
# summation order, and Adam scales that noise up (measured: 1.7e-6 to 3.6e-6
# on values of 3e-3 to 4.6e-3, against 2.4e-7 on every other leaf).
STATE_LEAF_ATOL = 2e-3


def flags_parser(flag_values: flags.FlagValues, doc: str
                 ) -> Callable[[Sequence[str]], list[str]]:
  """An ``app.run`` `flags_parser` for a program whose flags live in a
  FlagValues of its own (not absl's global one, so that programs sharing
  flag names can be imported together, as the tests do).

  It reads the program's flags from argv, then absl's own, and exits with a
  usage message when a flag is unknown or its value out of range.
  """
  def parse(argv: Sequence[str]) -> list[str]:
    if any(arg in _HELP_ARGS for arg in argv[1:]):
      print(f"{doc}\nflags:\n{flag_values.get_help()}")
      sys.exit(0)
    try:
      rest = flag_values(list(argv), known_only=True)
    except flags.Error as e:
      sys.stderr.write(f"FATAL Flags parsing error: {e}\n"
                       "Pass --help to see help on flags.\n")
      sys.exit(1)
    return app.parse_flags_with_usage(rest)
  return parse


def validated_config(config_from_flags: Callable[[], Any]) -> Any:
  """The config built from the parsed flags, validated.

  Raises:
    app.UsageError: a flag's value is bad (the message names the flag).
  """
  try:
    config = config_from_flags()
    config.validate()
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  return config


def run_program(argv: Sequence[str], config_from_flags: Callable[[], Any],
                run: Callable[[Any], dict]) -> dict:
  """Runs one experiment; bad flags become app.UsageError (exit 1)."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = validated_config(config_from_flags)
  logging.info("config: %s", config)
  results_file.note_start()
  results = run(config)
  json_out = getattr(config, "json_out", None)
  if json_out:
    parent = os.path.dirname(json_out)
    if parent:
      os.makedirs(parent, exist_ok=True)
    with open(json_out, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=2)
    logging.info("wrote %s", json_out)
  if jax.process_index() == 0:  # one file per run, not per process
    results_file.write(results_file.program_name(argv[0]), results, sys.argv)
  return results


def check_directory(path: str, *, flag: str, writable: bool = True) -> str:
  """Returns `path` if it is an existing (writable) directory.

  Raises:
    ValueError: naming `flag`, when it does not exist, is not a directory or
      cannot be written.
  """
  if not os.path.exists(path):
    raise ValueError(f"{flag} {path!r} does not exist; create it or pass an "
                     "existing directory")
  if not os.path.isdir(path):
    raise ValueError(f"{flag} {path!r} is not a directory")
  if writable and not os.access(path, os.W_OK | os.X_OK):
    raise ValueError(f"{flag} {path!r} is not writable by this process")
  return path


def write_json(path: str, value: Any) -> None:
  """Writes `value` as indented JSON, replacing `path` in one step."""
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=2)
    f.write("\n")
  os.replace(tmp, path)  # a reader never sees half a file


def check_disk_backed(path: str, *, flag: str) -> None:
  """Raises ValueError (naming `flag`) when `path`, or the directory it
  would be created in, is on a memory filesystem: no O_DIRECT there, and an
  nvme tier on it would measure DRAM."""
  existing = os.path.abspath(path)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  fs_type = bench.describe_disk(existing).fs_type
  if fs_type in ("tmpfs", "ramfs"):
    raise ValueError(
        f"{flag} {path!r} is on {fs_type}, which is memory and has no "
        "O_DIRECT; pass a directory on a real disk")


def format_or_dash(value: Any, spec: str) -> str:
  """`value` formatted by `spec` for a table cell; "-" where it is None."""
  return "-" if value is None else format(value, spec)


def rotated(items: Sequence[Any], round_index: int) -> list[Any]:
  """`items` rotated by `round_index`: over interleaved rounds each item
  runs in each position of a round equally often, so whatever favours a
  position (the first step after the others' work, say) favours none."""
  shift = round_index % len(items) if items else 0
  return list(items[shift:]) + list(items[:shift])


def shuffled(items: Sequence[Any], round_index: int) -> list[Any]:
  """`items` in a random order of its own for each round (seeded by the
  round, so runs repeat). Unlike `rotated`, whose cyclic order gives every
  item the same predecessor each round, this varies what ran just before
  each item (a step can pay for the one before it: caches, copies)."""
  out = list(items)
  random.Random(round_index).shuffle(out)
  return out


def worst_paired_ratio(times: Sequence[float],
                       others: dict[str, Sequence[float]],
                       confidence: float = 0.9, resamples: int = 2000,
                       seed: int = 0) -> dict[str, Any]:
  """How `times` compares with the best of `others`, timed in the same
  interleaved rounds (entry r of every list from round r).

  Each round's ratio times[r] / other[r] cancels the load the machine had
  in that round; per other schedule the median of those ratios is taken,
  and the largest of them (the other that did best against `times`) is
  returned with a bootstrap interval over rounds. Picking the best of
  several noisy medians favours the others; pairing and the interval say
  how much of a gap is noise.

  Returns:
    {"ratio", "low", "high", "against"}: the ratio, its `confidence`
    interval, and which other it is against.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  names = list(others)
  if not names:
    raise ValueError("worst_paired_ratio needs at least one other schedule")
  t = np.asarray(times, dtype=float)
  ratios = np.stack([t / np.asarray(others[n], dtype=float) for n in names])
  medians = np.median(ratios, axis=1)
  rounds = np.random.default_rng(seed).integers(
      0, t.size, size=(resamples, t.size))
  worst = np.median(ratios[:, rounds], axis=2).max(axis=0)
  tail = (1 - confidence) / 2
  return {"ratio": float(medians.max()),
          "low": float(np.quantile(worst, tail)),
          "high": float(np.quantile(worst, 1 - tail)),
          "against": names[int(medians.argmax())]}


def mem_available() -> int:
  """This machine's MemAvailable (bytes), for sizes that adapt to it.

  Raises:
    ValueError: /proc/meminfo has no MemAvailable (pass sizes explicitly).
  """
  with open("/proc/meminfo", encoding="utf-8") as f:
    for line in f:
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) * 1024
  raise ValueError("sizes chosen from memory need MemAvailable in "
                   "/proc/meminfo; pass them explicitly (e.g. '8GiB')")


def check_json_out(path: str | None, example: str) -> None:
  """Raises ValueError when --json_out names a directory."""
  if path is not None and os.path.isdir(path):
    raise ValueError(f"--json_out {path!r} is a directory; pass a file path "
                     f"such as {example}")


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation
                    ) -> Callable:
  """``step(params, opt_state, batch) -> (params, opt_state, loss)``: the
  plain train step every experiment offloads (or runs resident)."""
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return train_step


def _proc_status(key: str) -> int:
  """A /proc/self/status figure in kB ('VmRSS:', 'VmHWM:'), as bytes."""
  with open("/proc/self/status", encoding="utf-8") as f:
    return next(int(l.split()[1]) << 10 for l in f if l.startswith(key))


def peak_rss_since_reset() -> int:
  """The process's peak RSS (VmHWM) since the last reset, then resets it
  (Linux's /proc/self/clear_refs; where it cannot be reset, the peak of
  the whole run)."""
  peak = _proc_status("VmHWM:")
  try:
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
      f.write("5")
  except OSError:
    pass
  return peak


def peak_rss_above(fn: Callable[[], Any]) -> int:
  """Bytes of resident memory `fn` adds at its peak."""
  base = _proc_status("VmRSS:")
  peak_rss_since_reset()
  fn()
  return peak_rss_since_reset() - base

