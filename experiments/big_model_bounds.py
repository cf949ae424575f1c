"""The arithmetic of experiments.big_model: sizes, lower bounds, bytes.

Pure functions of measured figures, kept apart from the program so that
tests check them on numbers they choose:

* the model's size: the blocks of a width whose fp32 state (weights and
  adam's two moments, 12 bytes a parameter) is a given multiple of the
  machine's memory, and what its nvme tier and a checkpoint need on disk;
* a step's lower bound, max(compute alone, its disk reads at dd's read
  rate plus its disk writes at dd's write rate), and the warm steps'
  median and worst ratio to it;
* a step's bytes per parameter against the data flow's minimum (the state
  read and written once, bfloat16 weights in and gradients out once), the
  excess split by cause.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

# fp32 weights and adam's two fp32 moments.
STATE_BYTES_PER_PARAM = 12
# Beside the state, per parameter: its bfloat16 copy (the step fetches it)
# and its bfloat16 gradient (kept on nvme once the memory tier is full).
EXTRA_DISK_BYTES_PER_PARAM = 4
# The link's minimum per parameter per step: bfloat16 weights in and
# gradients out once (the state's minimum is its nvme bytes read and
# written once).
MIN_LINK_IN = 2
MIN_LINK_OUT = 2
WARM_STEPS = 10  # the bound is judged on the last this many steps


def gpt2_params(n_embd: int, n_layer: int, vocab: int, n_ctx: int) -> int:
  """Parameters of models.gpt2 (tied head): per block 12 d^2 + 13 d (qkv,
  out, fc, proj and two LayerNorms), plus the token and position tables
  and the final LayerNorm."""
  d = n_embd
  return n_layer * (12 * d * d + 13 * d) + (vocab + n_ctx) * d + 2 * d


def blocks_for_state(memory_bytes: int, multiple: float, n_embd: int,
                     vocab: int, n_ctx: int) -> int:
  """The fewest blocks of width `n_embd` whose fp32 state (12 bytes a
  parameter) is at least `multiple` x `memory_bytes`."""
  if multiple <= 0:
    raise ValueError(f"multiple must be positive, got {multiple}")
  need = multiple * memory_bytes / STATE_BYTES_PER_PARAM
  fixed = gpt2_params(n_embd, 0, vocab, n_ctx)
  per_block = gpt2_params(n_embd, 1, vocab, n_ctx) - fixed
  return max(1, math.ceil((need - fixed) / per_block))


def nvme_tier_bytes(state_bytes: int, param_bytes: int, fast_bytes: int,
                    slack: int) -> int:
  """The nvme tier a run needs: the state and, per fp32 parameter (4 of
  `param_bytes`), its bfloat16 copy and bfloat16 gradient (4 bytes), less
  the fast tier, plus 2% and `slack` for the allocator's rounding."""
  return (max(state_bytes + param_bytes - fast_bytes, 0) + state_bytes // 50
          + slack)


def checkpoint_bytes(state_bytes: int) -> int:
  """Disk a checkpoint of the state takes (its files' headers: 5%)."""
  return int(state_bytes * 1.05)


def largest_blocks_that_fit(free_bytes: int, margin: int, fast_bytes: int,
                            slack: int, n_embd: int, vocab: int, n_ctx: int,
                            with_checkpoint: bool = True) -> int:
  """The most blocks of width `n_embd` whose nvme tier (and checkpoint)
  fit in `free_bytes` with `margin` left; 0 if not even one does."""
  def need(n_layer: int) -> int:
    params = gpt2_params(n_embd, n_layer, vocab, n_ctx)
    state = STATE_BYTES_PER_PARAM * params
    return (nvme_tier_bytes(state, 4 * params, fast_bytes, slack) +
            (checkpoint_bytes(state) if with_checkpoint else 0) + margin)
  lo, hi = 0, 1
  while need(hi) <= free_bytes:
    lo, hi = hi, 2 * hi
  while hi - lo > 1:  # need(lo) fits (or lo is 0), need(hi) does not
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if need(mid) <= free_bytes else (lo, mid)
  return lo


def lower_bound(compute_s: float, read_bytes: int, written_bytes: int,
                dd: Mapping[str, float]) -> float:
  """max(compute alone, reads at dd's read rate + writes at its write
  rate): the disk reads and writes one request at a time, as dd does."""
  if dd["read"] <= 0 or dd["write"] <= 0:
    raise ValueError(f"dd's rates must be positive, got {dict(dd)}")
  return max(compute_s, read_bytes / dd["read"] + written_bytes / dd["write"])


def warm_ratios(ratios: Sequence[float], last: int = WARM_STEPS
                ) -> dict[str, Any]:
  """Median and worst of the last `last` steps' step / bound (all but the
  first step where there are fewer: it compiles and warms up)."""
  if not ratios:
    raise ValueError("no steps")
  warm = list(ratios[-last:]) if len(ratios) > last else (
      list(ratios[1:]) or list(ratios))
  return {"steps": len(warm), "median": statistics.median(warm),
          "worst": max(warm)}


def bytes_per_param(row: Mapping[str, Any], n_params: int,
                    nvme_state_bytes: int) -> dict[str, Any]:
  """A step's bytes per parameter against the data flow's minimum.

  Args:
    row: the step's bytes: `disk_read`, `disk_written` (this process's
      storage I/O, /proc/self/io), `link_in`, `link_out` (what the device
      fetched from and stored to the pool, every tier) and `nvme_fetched`,
      `nvme_stored` (the part of those on nvme).
    n_params: the model's parameters.
    nvme_state_bytes: the state's bytes on nvme (the host update reads and
      writes each once a step).

  Returns:
    Per flow (disk read, disk write, link in, link out): measured and
    minimum bytes per parameter and the excess split by cause (the causes
    add up to measured less minimum); and the totals.
  """
  per = lambda x: x / n_params
  # The host update reads and writes what the disk moved beyond the
  # device's own fetches and stores.
  update_read = row["disk_read"] - row["nvme_fetched"]
  update_written = row["disk_written"] - row["nvme_stored"]
  flows = {
      "disk_read": {
          "measured": per(row["disk_read"]),
          "minimum": per(nvme_state_bytes),
          "excess": {
              # The bfloat16 copies of nvme weights, fetched by the step.
              "weights fetched from nvme": per(row["nvme_fetched"]),
              # Gradients the device stored on nvme, read by the update.
              "gradients read back from nvme": per(row["nvme_stored"]),
              "other": per(update_read - row["nvme_stored"] -
                           nvme_state_bytes)}},
      "disk_write": {
          "measured": per(row["disk_written"]),
          "minimum": per(nvme_state_bytes),
          "excess": {
              "gradients stored on nvme": per(row["nvme_stored"]),
              # And anything else the update wrote: its weight copies.
              "weight copies written by the update": per(
                  update_written - nvme_state_bytes)}},
      "link_in": {
          "measured": per(row["link_in"]), "minimum": MIN_LINK_IN,
          "excess": {
              # refetch=True fetches a block's weights for the forward pass
              # and again for the backward pass; a weight without a copy
              # comes in as float32.
              "weights fetched twice or as float32": per(
                  row["link_in"] - MIN_LINK_IN * n_params)}},
      "link_out": {
          "measured": per(row["link_out"]), "minimum": MIN_LINK_OUT,
          "excess": {
              # The tied embedding's gradient is the float32 sum of two
              # bfloat16 cotangents.
              "gradients leaving as float32": per(
                  row["link_out"] - MIN_LINK_OUT * n_params)}},
  }
  for flow in flows.values():
    flow["over_minimum"] = flow["measured"] - flow["minimum"]
  measured = sum(f["measured"] for f in flows.values())
  minimum = sum(f["minimum"] for f in flows.values())
  return {"flows": flows, "measured": measured, "minimum": minimum,
          "ratio": measured / minimum if minimum else math.inf}
