r"""The prepared check of the CUDA path, for a GPU lent for a few minutes.

On the GPU machine, one command builds jcxl's CUDA handlers for that
machine's Python and CUDA toolkit, then runs every part (about 8 minutes on
an H200):

  bash tools/gpu_check.sh [--run_dir=runs/gpu_check] [flags below]

The parts run in this order; each one's result is written to
<run_dir>/gpu_check.json (and <run_dir>/<part>.json) as soon as it ends,
so a timeout in a late part keeps the earlier ones. A part that fails
records its error and the next part still runs.

  equality     GPT-2-tiny, unrolled and scanned, adamw: cxl_offload steps
               (state in the cxl tier) against plain jax.jit steps with
               everything on the device: the same losses and final state.
  scan_exact   (a) a stacked model of 32 layers of distinct constants,
               streamed by streamed_scan at prefetch 1 and 2 with a heavy
               body, --scan_reps times, from the host tier (direct DMA
               after reading the device's index) and the emulated cxl tier
               (staged): every fetched layer bit-exact.
  reuse        (b) fetch, delete, place another object at the same
               offsets, fetch it and store into it: bit-exact (freed pages
               of page-locked chunks are never released).
  bandwidth    each tier's jcxl.fetch / jcxl.store in a jitted step,
               against cudaMemcpyAsync between page-locked memory and the
               GPU, and against jax.device_put to and from pinned_host.
  overlap      (c) the scan of (a): compute alone (resident weights),
               transfer alone (a trivial body) and both; the combined step
               should be close to the larger of the two.
  faults       (d) injected failures of staged reads and writes fail their
               step; the next step is exact.
  first_fetch  (e) first-fetch latency and the process's resident memory
               with a --first_fetch_host (64GiB) host tier: only the chunk
               the fetch touches is page-locked.
  steps        step time of a GPT-2-medium-sized model: resident (compute
               alone), jax_host, cxl_fixed, cxl_dap, and the transfer floor
               of the offloaded state (its bytes over the measured cxl
               bandwidth, each way).
  host_update  experiments.host_update on the GPU (--n_layer blocks of
               --n_embd, 32000 tokens): cxl_offload(update='host') against
               update='device' and resident: step times (paired), bytes
               per parameter each way from the pool's counters, losses.

Targets (evaluated from whatever parts ended; a missing input is reported as
such, never guessed): every equality and bit-exact check passes; the host
tier's fetch at least 90% of cudaMemcpyAsync (and 5x jax.device_put where
that is as slow as reported); overlap within 1.15x of the larger of compute
and transfer; the best offloaded step within 1.1x of the larger of compute
alone and the transfer floor, and faster than jax_host. The CUDA path's
counters (direct, direct after reading an index, staged) are reported.
jax_default_matmul_precision is 'highest', so that TF32 does not trip the
equality checks. Where the cxl tier is emulated (no CXL memory), its
transfers keep the emulated link's bandwidth and go through the copy
engine; the report says so.

--dry_run runs every part on this machine's CPU device with small sizes;
what needs CUDA (cudaMemcpyAsync, the counters) is reported as skipped,
never made up, and the targets are labelled as CPU numbers:

  python -m experiments.gpu_check --dry_run    # anywhere
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jcxl
from experiments import common as exp_common
from experiments import compare
from experiments import flags as shared_flags
from experiments import host_allocator
from experiments import host_update as host_update_exp
from experiments import results_file
from jcxl import _jcxl
from jcxl import streamed_scan
from jcxl.units import format_bytes
from jcxl.units import parse_bytes
from models import common
from models import data
from models import gpt2

PARTS = ("equality", "scan_exact", "reuse", "bandwidth", "overlap", "faults",
         "first_fetch", "steps", "host_update")

FLAGS = flags.FlagValues()
_DRY_RUN = shared_flags.dry_run(
    FLAGS, help_text="Run on the CPU with small sizes (no GPU needed); what "
    "needs CUDA is reported as skipped.")
_RUN_DIR = shared_flags.run_dir(FLAGS, default="runs/gpu_check",
                                help_text="Where gpu_check.json goes.")
_PARTS = flags.DEFINE_list("parts", list(PARTS), "The parts to run, in "
                           f"this order: any of {', '.join(PARTS)}.",
                           flag_values=FLAGS)
_TRANSFER_BYTES = flags.DEFINE_string(
    "transfer_bytes", None, "Bytes per bandwidth transfer (default 256MiB, "
    "8MiB with --dry_run).", flag_values=FLAGS)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed transfers per "
                                "measurement (the median is reported).",
                                lower_bound=1, flag_values=FLAGS)
_EQUALITY_STEPS = flags.DEFINE_integer("equality_steps", 3, "Steps of each "
                                       "equality check.", lower_bound=1,
                                       flag_values=FLAGS)
_SCAN_DIM = flags.DEFINE_integer("scan_dim", None, "Each scan layer is "
                                 "scan_dim x scan_dim float32 (default 2048, "
                                 "64 with --dry_run).", flag_values=FLAGS)
_SCAN_REPS = flags.DEFINE_integer("scan_reps", None, "Repetitions of each "
                                  "scan in scan_exact (default 20, 2 with "
                                  "--dry_run).", flag_values=FLAGS)
_SCAN_HEAVY = flags.DEFINE_integer("scan_heavy", None, "Matmuls per layer "
                                   "in the heavy body (default 8, 2 with "
                                   "--dry_run).", flag_values=FLAGS)
_FIRST_FETCH_HOST = flags.DEFINE_string(
    "first_fetch_host", None, "Host tier of first_fetch's pool (default "
    "64GiB, 1GiB with --dry_run; reserved, not committed).",
    flag_values=FLAGS)
_N_EMBD = shared_flags.n_embd(FLAGS, default=None, help_text="Model width "
                              "for steps (default 1024, 64 with --dry_run).")
_N_LAYER = shared_flags.n_layer(FLAGS, default=None, help_text="Blocks for "
                                "steps (default 24, 2 with --dry_run).")
_BATCH = shared_flags.batch(FLAGS, default=None, help_text="Sequences per "
                            "step in steps (default 8, 2 with --dry_run).")
_SEQ_LEN = shared_flags.seq_len(FLAGS, default=None, help_text="Tokens per "
                                "sequence in steps (default 256, 32 with "
                                "--dry_run).")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed rounds in steps.",
                               lower_bound=1, flag_values=FLAGS)
_NVME_DIR = shared_flags.nvme_dir(FLAGS, default=None, help_text="Directory "
                                  "for the nvme tier (default: the system's "
                                  "temporary one).")

TIERS = ("host", "cxl", "nvme")
STEP_MODES = ("resident", "jax_host", "cxl_fixed", "cxl_dap")
SCAN_LAYERS = 32
SCAN_BATCH = {"gpu": 512, "cpu": 8}
# Targets of the CUDA path.
MEMCPY_FRACTION = 0.9
DEVICE_PUT_FACTOR = 5.0
DEVICE_PUT_SLOW = 0.2  # "as slow as reported": under 1/5 of cudaMemcpyAsync
STEP_OVER_BOUND = 1.1  # over the larger of compute alone and transfer floor
OVERLAP_OVER_LARGER = 1.15
EQUALITY_RTOL = {"cpu": 1e-5, "gpu": 1e-4}  # XLA:GPU may fuse differently
LEAF_ATOL = exp_common.STATE_LEAF_ATOL
MATMUL_PRECISION = "highest"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  dry_run: bool
  run_dir: str
  parts: tuple[str, ...]
  transfer_bytes: int
  repeats: int
  equality_steps: int
  scan_dim: int
  scan_reps: int
  scan_heavy: int
  first_fetch_host: int
  n_embd: int
  n_layer: int
  batch: int
  seq_len: int
  rounds: int
  nvme_dir: str

  def validate(self) -> None:
    unknown = [p for p in self.parts if p not in PARTS]
    if unknown or not self.parts:
      raise ValueError(f"--parts must name some of {', '.join(PARTS)}, got "
                       f"{','.join(self.parts)!r}")
    if self.transfer_bytes < 4096 or self.transfer_bytes % 4:
      raise ValueError("--transfer_bytes must be at least 4KiB and a "
                       f"multiple of 4, got {self.transfer_bytes}")
    for name in ("n_embd", "n_layer", "batch", "seq_len", "scan_dim",
                 "scan_reps", "scan_heavy"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name} must be positive, got "
                         f"{getattr(self, name)}")
    if self.first_fetch_host < 2 * self.transfer_bytes:
      raise ValueError("--first_fetch_host must hold two transfers of "
                       f"--transfer_bytes, got {self.first_fetch_host}")
    if self.n_embd % compare.HEAD_DIM:
      raise ValueError(f"--n_embd must be a multiple of {compare.HEAD_DIM}, "
                       f"got {self.n_embd}")
    if self.seq_len > compare.byte_gpt2(self.n_embd, 1).n_ctx:
      raise ValueError(f"--seq_len must be at most "
                       f"{compare.byte_gpt2(self.n_embd, 1).n_ctx}")
    exp_common.check_directory(self.nvme_dir, flag="--nvme_dir")


def config_from_flags() -> Config:
  dry = _DRY_RUN.value
  pick = lambda flag, gpu, cpu: flag.value if flag.value is not None else (
      cpu if dry else gpu)
  return Config(
      dry_run=dry, run_dir=_RUN_DIR.value, parts=tuple(_PARTS.value),
      transfer_bytes=parse_bytes(pick(_TRANSFER_BYTES, "256MiB", "8MiB"),
                                 name="--transfer_bytes"),
      repeats=_REPEATS.value, equality_steps=_EQUALITY_STEPS.value,
      scan_dim=pick(_SCAN_DIM, 2048, 64), scan_reps=pick(_SCAN_REPS, 20, 2),
      scan_heavy=pick(_SCAN_HEAVY, 8, 2),
      first_fetch_host=parse_bytes(pick(_FIRST_FETCH_HOST, "64GiB", "1GiB"),
                                   name="--first_fetch_host"),
      n_embd=pick(_N_EMBD, 1024, 64), n_layer=pick(_N_LAYER, 24, 2),
      batch=pick(_BATCH, 8, 2), seq_len=pick(_SEQ_LEN, 256, 32),
      rounds=_ROUNDS.value,
      nvme_dir=_NVME_DIR.value or tempfile.gettempdir())


def _device() -> jax.Device:
  return jax.devices()[0]


def _on_gpu() -> bool:
  return _device().platform == "gpu" and jcxl.cuda_available()


def _platform() -> str:
  return "gpu" if _on_gpu() else "cpu"


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
  jax.block_until_ready(fn())  # compile, warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _cuda_counters() -> dict[str, Any]:
  """The CUDA transfers' paths so far, or why there are none."""
  if not _on_gpu():
    return {"skipped": "no CUDA GPU (or jcxl built without CUDA)"}
  return dict(_jcxl.cuda_counters())


def _delete_all(tree: Any) -> None:
  for x in jax.tree.leaves(tree,
                           is_leaf=lambda x: isinstance(x, jcxl.PoolArray)):
    x.delete()


# ------------------------------------------------------- equality


def _leaf_rel_diff(a: Any, b: Any) -> float:
  """The largest difference in a leaf, over the leaf's largest value."""
  a, b = np.asarray(a), np.asarray(b)
  scale = float(np.abs(b).max()) if b.size else 0.0
  return float(np.abs(a - b).max()) / scale if scale else float(
      np.abs(a - b).max(initial=0.0))


def equality(config: Config, _: dict[str, Any]) -> dict[str, Any]:
  """Offloaded against resident steps, per model form."""
  rtol = EQUALITY_RTOL[_platform()]
  out = []
  with jcxl.Pool(host="256MiB", cxl="256MiB") as pool:
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
      out.append({"model": f"gpt2-tiny ({form})",
                  "steps": config.equality_steps, "losses": got,
                  "resident_losses": want, "max_loss_rel_diff": loss_diff,
                  "max_state_leaf_rel_diff": leaf_diff, "rtol": rtol,
                  "leaf_atol": LEAF_ATOL, "passed": passed})
      _delete_all(placed)
  return {"models": out, "passed": all(m["passed"] for m in out)}


# ----------------------------------------- scans: (a) exact, (c) overlap


def _scan_weights(dim: int) -> np.ndarray:
  """SCAN_LAYERS layers, layer i filled with the constant i + 1."""
  values = np.arange(1, SCAN_LAYERS + 1, dtype=np.float32)
  return np.ascontiguousarray(
      np.broadcast_to(values[:, None, None], (SCAN_LAYERS, dim, dim)))


def _scan_fns(config: Config) -> dict[str, Callable[..., Any]]:
  """Jitted scans over the layers: each returns (carry, per-layer ok), ok
  being whether the layer it got is exactly its constant."""
  dim, heavy = config.scan_dim, config.scan_heavy
  mix = jnp.asarray(np.eye(dim, dtype=np.float32) * 0.5)
  layers = jnp.arange(SCAN_LAYERS, dtype=jnp.int32)

  def exact(w, i):
    return jnp.all(w == (i + 1).astype(jnp.float32))

  def heavy_body(h, w, i):
    for _ in range(heavy):  # compute the transfer can hide behind
      h = jnp.tanh(h @ mix + w[:1] * 1e-6)
    return h, exact(w, i)

  def light_body(h, w, i):
    return h, exact(w, i)

  def streamed(body, prefetch):
    return jax.jit(lambda pw, h: streamed_scan(
        body, h, pw, layers, length=SCAN_LAYERS, prefetch=prefetch))

  resident = jax.jit(lambda w, h: jax.lax.scan(
      lambda c, wi: heavy_body(c, *wi), h, (w, layers)))
  return {"heavy_1": streamed(heavy_body, 1),
          "heavy_2": streamed(heavy_body, 2),
          "light_2": streamed(light_body, 2), "resident": resident}


def _scan_input(config: Config) -> jax.Array:
  rng = np.random.default_rng(0)
  return jnp.asarray(rng.standard_normal(
      (SCAN_BATCH[_platform()], config.scan_dim), dtype=np.float32))


def _counter_delta(before: dict[str, Any], after: dict[str, Any]
                   ) -> dict[str, Any]:
  if "skipped" in before or "skipped" in after:
    return after
  return {k: after[k] - before.get(k, 0) for k in after}


def scan_exact(config: Config, _: dict[str, Any]) -> dict[str, Any]:
  """(a) Every layer a streamed scan fetched, at prefetch 1 and 2."""
  weights = _scan_weights(config.scan_dim)
  fns = _scan_fns(config)
  h = _scan_input(config)
  capacity = weights.nbytes + (64 << 20)
  rows = []
  with jcxl.Pool(host=capacity, cxl=capacity) as pool:
    for tier in ("host", "cxl"):
      pw = jcxl.place(weights, tier, pool=pool)
      for prefetch in (1, 2):
        before = _cuda_counters()
        scan = fns[f"heavy_{prefetch}"]
        exact, fetched, times = 0, 0, []
        for _ in range(config.scan_reps):
          start = time.perf_counter()
          _, ok = jax.block_until_ready(scan(pw, h))
          times.append(time.perf_counter() - start)
          ok = np.asarray(ok)
          exact += int(ok.sum())
          fetched += ok.size
        rows.append({"tier": tier, "label": pool.stats()[tier].label(),
                     "prefetch": prefetch, "reps": config.scan_reps,
                     "layers_fetched": fetched, "layers_exact": exact,
                     "median_scan_ms": statistics.median(times[1:] or times)
                                       * 1e3,
                     "cuda_counters": _counter_delta(before,
                                                     _cuda_counters()),
                     "passed": fetched > 0 and exact == fetched})
      pw.delete()
  return {"layers": SCAN_LAYERS, "layer_bytes": weights[0].nbytes,
          "runs": rows, "passed": bool(rows) and all(r["passed"]
                                                     for r in rows)}


def overlap(config: Config, _: dict[str, Any]) -> dict[str, Any]:
  """(c) Compute alone, transfer alone and both, from the host tier."""
  weights = _scan_weights(config.scan_dim)
  fns = _scan_fns(config)
  h = _scan_input(config)
  with jcxl.Pool(host=weights.nbytes + (64 << 20), cxl=0) as pool:
    pw = jcxl.place(weights, "host", pool=pool)
    on_device = jax.device_put(weights, _device())
    compute = _median_seconds(lambda: fns["resident"](on_device, h),
                              config.repeats)
    transfer = _median_seconds(lambda: fns["light_2"](pw, h), config.repeats)
    both = _median_seconds(lambda: fns["heavy_2"](pw, h), config.repeats)
    pw.delete()
  larger = max(compute, transfer)
  return {"compute_ms": compute * 1e3, "transfer_ms": transfer * 1e3,
          "combined_ms": both * 1e3,
          "combined_over_larger": both / larger,
          "combined_over_sum": both / (compute + transfer),
          "transfer_gbps": weights.nbytes / transfer / 1e9}


# ------------------------------------------------- (b) reuse, (d) faults


def _offset(pool: jcxl.Pool, x: jcxl.PoolArray) -> int:
  return pool.info(x.local_handles[0][1]).offset


def reuse(config: Config, _: dict[str, Any]) -> dict[str, Any]:
  """(b) Fetch, delete, place another object where it was, fetch, store."""
  n = config.transfer_bytes // 4
  rng = np.random.default_rng(1)
  first, second, third = (rng.standard_normal(n, dtype=np.float32)
                          for _ in range(3))
  fetch, store = jax.jit(jcxl.fetch), jax.jit(jcxl.store)
  rows = []
  with jcxl.Pool(host=4 * config.transfer_bytes,
                 cxl=4 * config.transfer_bytes) as pool:
    for tier in ("host", "cxl"):
      a = jcxl.place(first, tier, pool=pool)
      first_ok = np.array_equal(np.asarray(fetch(a)), first)
      offset = _offset(pool, a)
      a.delete()
      b = jcxl.place(second, tier, pool=pool)
      same_offset = _offset(pool, b) == offset
      second_ok = np.array_equal(np.asarray(fetch(b)), second)
      jax.block_until_ready(store(b, jax.device_put(third, _device())))
      stored_ok = (np.array_equal(jcxl.gather(b), third) and
                   np.array_equal(np.asarray(fetch(b)), third))
      b.delete()
      rows.append({"tier": tier, "same_offsets": same_offset,
                   "first_exact": first_ok, "second_exact": second_ok,
                   "stored_exact": stored_ok,
                   # Only a reused offset tests reuse: another place
                   # would pass without exercising it.
                   "passed": (same_offset and first_ok and second_ok and
                              stored_ok)})
  return {"tiers": rows, "passed": bool(rows) and all(r["passed"]
                                                      for r in rows)}


def _fails(fn: Callable[[], Any]) -> str | None:
  """The error `fn` raised (its first line), or None."""
  try:
    jax.block_until_ready(fn())
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  return None


def _gather_after_failure(x: jcxl.PoolArray, error: str | None
                          ) -> tuple[np.ndarray, str | None]:
  """jcxl.gather(x) after a step failed with `error`. Where execution is
  asynchronous (a GPU) JAX keeps the failed computation's error for the
  next barrier, so the first gather may raise that same error once (a
  failure is never lost, whether or not its result was read); any other
  error, or the error raised twice, is a failure of this check."""
  try:
    return jcxl.gather(x), None
  except Exception as e:  # pylint: disable=broad-except
    again = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if error is None or again != error:
      raise
    return jcxl.gather(x), again


def faults(config: Config, _: dict[str, Any]) -> dict[str, Any]:
  """(d) Injected failures of staged reads and writes (the emulated cxl
  tier always stages) fail their step, with what was stored kept; the
  next step is exact."""
  n = config.transfer_bytes // 4
  values = np.arange(n, dtype=np.float32)
  update = jax.device_put(values * 2, _device())
  fetch, store = jax.jit(jcxl.fetch), jax.jit(jcxl.store)
  with jcxl.Pool(host=0, cxl=4 * config.transfer_bytes) as pool:
    x = jcxl.place(values, "cxl", pool=pool)
    jax.block_until_ready((fetch(x), store(x, jax.device_put(values,
                                                               _device()))))
    pool._inject_fault("fail", tier="cxl", direction="read")
    read_error = _fails(lambda: fetch(x))
    pool._inject_fault(None)
    _, read_again = _gather_after_failure(x, read_error)
    read_next = np.array_equal(np.asarray(fetch(x)), values)
    pool._inject_fault("fail", tier="cxl", direction="write")
    write_error = _fails(lambda: store(x, update))
    pool._inject_fault(None)
    gathered, write_again = _gather_after_failure(x, write_error)
    kept = np.array_equal(gathered, values)
    write_next = _fails(lambda: store(x, update)) is None and np.array_equal(
        jcxl.gather(x), values * 2)
    x.delete()
  return {"read_error": read_error, "read_next_exact": read_next,
          "write_error": write_error, "kept_after_failed_write": kept,
          "write_next_exact": write_next,
          # Raised again, once, by the next barrier (GPU), or not (CPU).
          "raised_again_by_next_gather": {"read": read_again is not None,
                                          "write": write_again is not None},
          "passed": bool(read_error and read_next and write_error and kept
                         and write_next)}


# ------------------------------------------------- (e) first fetch


def _rss_bytes() -> int | None:
  try:
    with open("/proc/self/status", encoding="utf-8") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def first_fetch(config: Config, _: dict[str, Any]) -> dict[str, Any]:
  """(e) The first fetch from a large host tier: its latency, and the
  memory the process commits (only the chunks a fetch touches are
  page-locked, not the tier)."""
  n = config.transfer_bytes // 4
  values = np.arange(n, dtype=np.float32)
  rss_before = _rss_bytes()
  before = _cuda_counters()
  with jcxl.Pool(host=config.first_fetch_host, cxl=0) as pool:
    x = jcxl.place(values, "host", pool=pool)
    fetch = jax.jit(jcxl.fetch).lower(x).compile()
    start = time.perf_counter()
    got = jax.block_until_ready(fetch(x))
    first = time.perf_counter() - start
    exact = np.array_equal(np.asarray(got), values)
    later = _median_seconds(lambda: fetch(x), config.repeats)
    rss_after = _rss_bytes()
    x.delete()
  grown = (rss_after - rss_before if rss_before is not None and
           rss_after is not None else None)
  return {"host_tier_bytes": config.first_fetch_host,
          "object_bytes": values.nbytes, "first_fetch_ms": first * 1e3,
          "later_fetch_ms": later * 1e3, "first_over_later": first / later,
          "exact": exact, "rss_growth_bytes": grown,
          "rss_growth_over_tier": (grown / config.first_fetch_host
                                   if grown is not None else None),
          "cuda_counters": _counter_delta(before, _cuda_counters()),
          "passed": exact}


# ------------------------------------------------------ bandwidth


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


def bandwidth(config: Config, _: dict[str, Any]) -> dict[str, Any]:
  n = config.transfer_bytes
  with jcxl.Pool(host=2 * n + (64 << 20), cxl=2 * n + (64 << 20),
                 nvme=2 * n + (64 << 20), nvme_dir=config.nvme_dir) as pool:
    emulated = [t.value for t in pool.stats().emulated]
    tiers = [tier_bandwidth(config, pool, t) for t in TIERS]
  return {"transfer_bytes": n, "emulated": emulated, "tiers": tiers,
          "cudaMemcpyAsync": memcpy_bandwidth(config),
          "device_put_pinned_host": device_put_bandwidth(config),
          "cuda_counters": _cuda_counters()}


# ------------------------------------------------------ step time


def _tier(result: dict[str, Any], name: str) -> dict[str, Any] | None:
  tiers = result.get("parts", {}).get("bandwidth", {}).get("tiers") or []
  return next((t for t in tiers if t.get("tier") == name), None)


def transfer_floor_ms(state_bytes: int, result: dict[str, Any]
                      ) -> tuple[float | None, str]:
  """The offloaded state read and written once, over the cxl tier's
  measured bandwidth each way (a GPU copies both ways at once)."""
  cxl = _tier(result, "cxl")
  if not cxl or not cxl.get("h2d_gbps") or not cxl.get("d2h_gbps"):
    return None, "no cxl bandwidth measured (run the bandwidth part first)"
  seconds = max(state_bytes / (cxl["h2d_gbps"] * 1e9),
                state_bytes / (cxl["d2h_gbps"] * 1e9))
  return seconds * 1e3, (f"{format_bytes(state_bytes)} each way at the cxl "
                         f"tier's {cxl['h2d_gbps']:.1f} / "
                         f"{cxl['d2h_gbps']:.1f} GB/s")


def steps(config: Config, result: dict[str, Any]) -> dict[str, Any]:
  budget = 1 << 40  # no budget: steps compares speed, every mode must run
  cfg = compare.Config(
      model="gpt2", n_layer=config.n_layer, widths=(config.n_embd,),
      widths_source="gpu_check", modes=STEP_MODES, batch=config.batch,
      seq_len=config.seq_len, rounds=config.rounds,
      warmup=1 if config.dry_run else 2,
      tune_steps=3 if config.dry_run else 12,
      fixed_prefetch=1, device_budget=budget, pool_capacity=0,
      pool_capacity_source="per mode", cxl_link=jcxl.DEFAULT_CXL_LINK,
      nvme_dir=config.nvme_dir, search=False, max_width=config.n_embd, seed=0,
      run_dir=config.run_dir)
  stream = data.load_stdlib_corpus().batches(
      "train", cfg.batch, cfg.seq_len, seed=0)
  batches = [next(stream) for _ in range(cfg.tune_steps + cfg.rounds)]
  before = _cuda_counters()
  run = compare.run_size(cfg, config.n_embd, batches)
  rows = run["rows"]
  modes = {r["mode"]: {k: r[k] for k in ("step_ms", "tokens_per_s",
                                         "max_loss_rel_diff", "skipped")}
           for r in rows}
  state_bytes = rows[0]["state_bytes"] if rows else 0
  floor, floor_source = transfer_floor_ms(state_bytes, result)
  return {"model": (f"byte GPT-2, {config.n_layer} x {config.n_embd} "
                    f"({rows[0]['params']:,} parameters)" if rows else
                    "no rows"),
          "batch": config.batch, "seq_len": config.seq_len,
          "labels": run["labels"], "modes": modes,
          "state_bytes": state_bytes, "transfer_floor_ms": floor,
          "transfer_floor": floor_source,
          "cuda_counters": _counter_delta(before, _cuda_counters())}


def host_update(config: Config, _: dict[str, Any]) -> dict[str, Any]:
  """The near-memory update against the device update, on this device."""
  cfg = host_update_exp.Config(
      n_layer=config.n_layer, n_embd=config.n_embd,
      vocab_size=512 if config.dry_run else 32000, seq_len=config.seq_len,
      batch=config.batch, rounds=config.rounds, link=jcxl.DEFAULT_CXL_LINK,
      seed=0, zoo_rounds=2, zoo_larger=False)  # the zoo's test sizes, briefly
  out = host_update_exp.run(cfg)
  out.pop("host_plan", None)  # long; the part's JSON keeps the figures
  return out


PART_FNS: dict[str, Callable[[Config, dict[str, Any]], dict[str, Any]]] = {
    "equality": equality, "scan_exact": scan_exact, "reuse": reuse,
    "bandwidth": bandwidth, "overlap": overlap, "faults": faults,
    "first_fetch": first_fetch, "steps": steps, "host_update": host_update}


# ------------------------------------------------------------ targets


def targets(result: dict[str, Any]) -> dict[str, Any]:
  """The targets, from whatever parts ended: each one measured, or the
  reason it could not be (a part missing, failed, or empty)."""
  parts = result.get("parts", {})
  out: dict[str, Any] = {
      "platform": ("CUDA GPU" if result.get("gpu") else
                   "CPU dry run: these are CPU numbers; the targets are "
                   "the GPU's")}
  missing: dict[str, str] = {}

  def part(name: str) -> dict[str, Any] | None:
    value = parts.get(name)
    if value is None:
      missing[name] = "not run"
    elif "error" in value:
      missing[name] = f"failed: {value['error']}"
    else:
      return value
    return None

  for name in ("equality", "scan_exact", "reuse", "faults", "first_fetch"):
    value = part(name)
    if value is not None:
      out[f"{name}_passed"] = bool(value.get("passed"))
  bw = part("bandwidth")
  host = _tier(result, "host")
  if bw is not None and host is not None:
    memcpy = bw.get("cudaMemcpyAsync", {})
    put = bw.get("device_put_pinned_host", {})
    if memcpy.get("h2d_gbps"):
      out["host_h2d_over_memcpy"] = host["h2d_gbps"] / memcpy["h2d_gbps"]
      out["host_h2d_at_least_90pct_of_memcpy"] = (
          out["host_h2d_over_memcpy"] >= MEMCPY_FRACTION)
      if put.get("h2d_gbps") and (
          put["h2d_gbps"] < DEVICE_PUT_SLOW * memcpy["h2d_gbps"]):
        out["host_h2d_5x_device_put"] = (
            host["h2d_gbps"] / put["h2d_gbps"] >= DEVICE_PUT_FACTOR)
    else:
      missing["cudaMemcpyAsync"] = memcpy.get("skipped", "not measured")
    if put.get("h2d_gbps"):
      out["host_h2d_over_device_put"] = host["h2d_gbps"] / put["h2d_gbps"]
  ov = part("overlap")
  if ov is not None:
    out["overlap_over_larger"] = ov["combined_over_larger"]
    out["overlap_within_1.15x_larger"] = (
        ov["combined_over_larger"] <= OVERLAP_OVER_LARGER)
  st = part("steps")
  if st is not None:
    modes = st.get("modes", {})
    offloaded = [m["step_ms"] for k, m in modes.items()
                 if k.startswith("cxl") and m.get("step_ms")]
    resident = (modes.get("resident") or {}).get("step_ms")
    if not offloaded or not resident:
      missing["steps"] = "no offloaded or no resident step time"
    else:
      best = min(offloaded)
      floor = st.get("transfer_floor_ms")
      bound = max(resident, floor or 0.0)
      out["offloaded_over_compute"] = best / resident
      if floor:
        out["offloaded_over_transfer_floor"] = best / floor
      else:
        missing["transfer_floor"] = st.get("transfer_floor", "unknown")
      out["offloaded_within_1.1x_of_bound"] = best <= STEP_OVER_BOUND * bound
      jax_host = (modes.get("jax_host") or {}).get("step_ms")
      if jax_host:
        out["offloaded_faster_than_jax_host"] = best < jax_host
  hu = part("host_update")
  if hu is not None:
    out["host_update_over_device_update"] = hu["paired"]["host/device"]
    out["host_update_bytes_per_param"] = (
        hu["traffic"]["host"]["total_per_param"])
    out["device_update_bytes_per_param"] = (
        hu["traffic"]["device"]["total_per_param"])
    out["host_update_losses_match"] = (
        hu["loss_max_relative_difference_host_vs_device"] <= 1e-6)
  if missing:
    out["not_evaluated"] = missing
  return out


def _fmt(value: Any) -> str:
  """A table cell: a number to 4 digits, a reason as it is, None as "-"."""
  if isinstance(value, str):
    return value
  return exp_common.format_or_dash(value, ".4g")


def table(result: dict[str, Any]) -> str:
  """The report, from whatever parts ended."""
  parts = result.get("parts", {})
  lines = [f"gpu_check on {result['device']} ({result['kind']})"]
  for name in PARTS:
    if name not in parts:
      continue
    value = parts[name]
    lines.append("")
    if "error" in value:
      lines.append(f"{name}: FAILED ({value['error']})")
      continue
    lines.append(f"{name} ({value.get('wall_s', 0):.0f} s):")
    if name == "bandwidth":
      lines += ["  | transfer | host -> device GB/s | device -> host GB/s |",
                "  | --- | --- | --- |"]
      for t in value.get("tiers", []):
        lines.append(f"  | jcxl {t['tier']}: {t['label']} | "
                     f"{_fmt(t['h2d_gbps'])} | {_fmt(t['d2h_gbps'])} |")
      for key, what in (("cudaMemcpyAsync", "cudaMemcpyAsync, page-locked"),
                        ("device_put_pinned_host",
                         "jax.device_put, pinned_host")):
        m = value.get(key, {})
        lines.append(f"  | {what} | "
                     f"{_fmt(m.get('h2d_gbps', m.get('skipped')))} | "
                     f"{_fmt(m.get('d2h_gbps'))} |")
    elif name == "host_update":
      lines += ["  | mode | median step ms | B/param a step |",
                "  | --- | --- | --- |"]
      for mode, seconds in value.get("median_step_s", {}).items():
        moved = value.get("traffic", {}).get(mode, {})
        lines.append(f"  | {mode} | {_fmt(seconds * 1e3)} | "
                     f"{_fmt(moved.get('total_per_param'))} |")
      lines.append(f"  paired: {value.get('paired')}")
    elif name == "steps":
      lines += ["  | mode | step ms | tokens/s | loss vs resident |",
                "  | --- | --- | --- | --- |"]
      for mode, row in value.get("modes", {}).items():
        skipped = row.get("skipped")
        lines.append(f"  | {mode} | {_fmt(row.get('step_ms'))} | "
                     f"{_fmt(row.get('tokens_per_s'))} | "
                     f"{_fmt(row.get('max_loss_rel_diff'))}"
                     f"{' (' + skipped + ')' if skipped else ''} |")
      lines.append(f"  transfer floor: "
                   f"{_fmt(value.get('transfer_floor_ms'))} ms "
                   f"({value.get('transfer_floor')})")
    else:
      shown = {k: v for k, v in value.items() if k != "wall_s"}
      lines.append("  " + json.dumps(shown, default=str)[:2000])
  lines += ["", f"targets: {json.dumps(result.get('targets', {}))}"]
  return "\n".join(lines)


def run(config: Config) -> dict[str, Any]:
  os.makedirs(config.run_dir, exist_ok=True)
  on_gpu = _on_gpu()
  if not on_gpu and not config.dry_run:
    raise app.UsageError(
        f"no CUDA GPU with jcxl's CUDA handlers here (device: {_device()}, "
        f"built with CUDA: {_jcxl.cuda_built}); pass --dry_run")
  # TF32 (XLA:GPU's default for float32 matmuls) would trip the equality
  # checks against the resident reference.
  jax.config.update("jax_default_matmul_precision", MATMUL_PRECISION)
  started = time.perf_counter()
  path = os.path.join(config.run_dir, "gpu_check.json")
  result: dict[str, Any] = {
      "device": str(_device()), "gpu": on_gpu,
      "kind": ("CUDA GPU" if on_gpu else
               "DRY RUN on XLA:CPU: no GPU, every tier is host DRAM"),
      "jcxl_built_with_cuda": bool(_jcxl.cuda_built),
      "matmul_precision": MATMUL_PRECISION,
      "config": dataclasses.asdict(config), "parts": {}}
  for name in config.parts:
    part_started = time.perf_counter()
    try:
      value = PART_FNS[name](config, result)
    except Exception as e:  # pylint: disable=broad-except
      # A part's failure is its result: the parts after it still run.
      value = {"error": f"{type(e).__name__}: {e}"}
    value["wall_s"] = time.perf_counter() - part_started
    result["parts"][name] = value
    result["targets"] = targets(result)
    result["wall_s"] = time.perf_counter() - started
    # Written as each part ends: a timeout later keeps what ended.
    exp_common.write_json(os.path.join(config.run_dir, f"{name}.json"), value)
    exp_common.write_json(path, result)
    if jax.process_index() == 0:  # the results file too, rewritten
      results_file.write("gpu_check", result, sys.argv)
    print(f"gpu_check: {name} done in {value['wall_s']:.1f} s"
          f"{' (FAILED: ' + value['error'] + ')' if 'error' in value else ''}",
          flush=True)
  print(table(result), flush=True)
  print(f"wrote {path} ({result['wall_s']:.0f} s)", flush=True)
  return result


parse_flags = exp_common.flags_parser(FLAGS, __doc__)


def main(argv: Sequence[str]) -> None:
  exp_common.run_program(argv, config_from_flags, run)


if __name__ == "__main__":
  host_allocator.start()
  app.run(main, flags_parser=parse_flags)
