r"""Largest GPT-2 under a device budget: resident step vs cxl_offload, compiled.

Two parts, every number from ``compiled.memory_analysis()`` of a real step
(``jax.value_and_grad`` of the GPT-2 loss, ``optax.adamw``,
``optax.apply_updates``), lowered and compiled, never run. A step's device
need is temporaries + arguments + outputs - aliased bytes, the sum
``cxl_offload`` checks its ``device_budget`` against.

1. GPT-2 `--model` (default GPT-2 small) at `--batch` x `--seq_len`:
   the resident step (``jax.jit``, parameters and optimizer state donated)
   and the ``cxl_offload`` step once per `--schedules` ('fixed:k'), with the
   state placed in the pool's `--tier` by ``jcxl.place`` (zeros: the numbers
   depend on shapes only). Checked, PASS/FAIL:

   * offloaded need <= (k + 2) x one block's weights + activations
     + 2 x the tables. The tables are the leaves outside the blocks (token
     and position embeddings, final LayerNorm); they are used whole, so
     they are counted whole, twice: weights and gradient (the tied output
     head makes the token table's gradient dense). Activations: the
     temporaries of the compiled forward and backward pass alone
     (``jax.value_and_grad`` of the loss, weights in and gradients out, so
     neither is in them): what the backward pass keeps plus its scratch
     buffers, as XLA lays them out.
   * resident need >= parameters + optimizer state.

2. The largest model of a GPT-2 family that compiles within
   `--device_budget`, resident and offloaded. `--family=width` keeps the
   model's depth and grows its width in heads of the model's head size
   (GPT-2: 64), `--family=depth` keeps its width and adds blocks. The search
   doubles from the model itself, then bisects; each probe compiles. A
   resident probe compiles on abstract shapes (nothing allocated). An
   offloaded probe first reserves the candidate's parameters and optimizer
   state in the pool (``Pool.allocate``, full size; the bytes are not
   written, as the compile does not read them), so the pool's capacity
   (`--pool_capacity`, default 40% of MemAvailable; with `--tier=nvme`,
   80% of the disk's free space under `--nvme_dir`) bounds the search as
   the device budget does. Each search says what stopped it: the device
   budget, the pool's capacity (and where that came from), or the end of
   the family (`--max_width`, `--max_layers`). The largest model of each
   mode then runs one real train step (the offloaded one with its state
   created in the pool leaf by leaf, ``jcxl.init_in_pool``), and its loss
   is reported.

Every table names the tier the state streams from as the pool reports it;
an emulated cxl tier is labelled EMULATED, with its link model.

Command line (the defaults; about 5 minutes and 2 GiB of memory on a
shared 2-core machine):

  python -m experiments.max_model --model=small --batch=1 --seq_len=128 \
      --schedules=fixed:0,fixed:1,fixed:2 --search_schedule=fixed:1 \
      --tier=cxl --device_budget=2GiB --pool_capacity=auto --family=width \
      --max_width=4096 --json_out=runs/max_model.json
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
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
from experiments import common
from experiments import flags as shared_flags
from experiments import host_allocator
from jcxl import PoolArray
from jcxl import Tier
from jcxl.units import format_bytes
from jcxl.units import parse_bytes
from models import common as model_common
from models import gpt2

AUTO_POOL_FRACTION = 0.4
AUTO_DISK_FRACTION = 0.8  # the disk is shared: a fifth stays free
FAMILIES = ("width", "depth")
MODES = ("resident", "offloaded")
_LEARNING_RATE = 1e-3

# The program's flags live in a FlagValues of its own: tests import several
# experiments into one process, and others define --batch and --json_out.
FLAGS = flags.FlagValues()
_MODEL = flags.DEFINE_string(
    "model", "small",
    f"GPT-2 preset, one of {', '.join(gpt2.PRESETS)}; also the family's "
    "starting point.", flag_values=FLAGS)
_N_LAYER = shared_flags.n_layer(
    FLAGS, default=None, help_text="Blocks of the model; default: the "
    "preset's.", lower_bound=1)
_BATCH = shared_flags.batch(FLAGS, default=1, lower_bound=1)
_SEQ_LEN = shared_flags.seq_len(
    FLAGS, default=128, help_text="Tokens per sequence (at most the model's "
    "n_ctx).", lower_bound=1)
_SCAN_LAYERS = flags.DEFINE_boolean(
    "scan_layers", False,
    "Stack the blocks and apply them with lax.scan instead of unrolling.",
    flag_values=FLAGS)
_SCHEDULES = flags.DEFINE_list(
    "schedules", ["fixed:0", "fixed:1", "fixed:2"],
    "Offloaded schedules ('fixed:k' or 'sync') to compile the model with.",
    flag_values=FLAGS)
_SEARCH_SCHEDULE = flags.DEFINE_string(
    "search_schedule", "fixed:1",
    "The offloaded schedule of the search ('fixed:k' or 'sync').",
    flag_values=FLAGS)
_TIER = flags.DEFINE_string(
    "tier", "cxl", "Pool tier holding the offloaded state: host, cxl or nvme.",
    flag_values=FLAGS)
_NVME_DIR = shared_flags.nvme_dir(
    FLAGS, default="./build",
    help_text="An existing directory for the nvme tier's file.")
_DEVICE_BUDGET = shared_flags.device_budget(FLAGS, default="2GiB")
_POOL_CAPACITY = flags.DEFINE_string(
    "pool_capacity", "auto",
    "Bytes of the pool tier for the state, e.g. '8GiB'; 'auto': "
    f"{AUTO_POOL_FRACTION:.0%} of this machine's MemAvailable.",
    flag_values=FLAGS)
_FAMILY = flags.DEFINE_string(
    "family", "width",
    "Search family: 'width' (the model's depth, more heads) or 'depth' (the "
    "model's width, more blocks).", flag_values=FLAGS)
_MAX_WIDTH = flags.DEFINE_integer(
    "max_width", 4096, "Widest model of the width family.", lower_bound=1,
    flag_values=FLAGS)
_MAX_LAYERS = flags.DEFINE_integer(
    "max_layers", 96, "Deepest model of the depth family (compiling the "
    "offloaded step of 48 unrolled GPT-2 small blocks takes about 4 minutes "
    "on 2 cores).",
    lower_bound=1, flag_values=FLAGS)
_SEARCH = flags.DEFINE_boolean(
    "search", True, "Run part 2 (the largest-model search).",
    flag_values=FLAGS)
_JSON_OUT = shared_flags.json_out(FLAGS)


def mib(nbytes: float) -> str:
  """Bytes as MiB with two decimals: prefetch distances differ by a few."""
  return f"{nbytes / 2**20:,.2f} MiB"


def _prefetch(schedule: str, flag: str) -> int:
  """The prefetch distance k of 'fixed:k' (or 'sync', k = 0)."""
  if schedule.strip() == "sync":
    return 0
  match = re.fullmatch(r"fixed:(\d+)", schedule.strip())
  if not match:
    raise ValueError(
        f"{flag} must be 'fixed:k' (k >= 0) or 'sync', but got {schedule!r}: "
        "the bound checked depends on a fixed prefetch distance")
  return int(match.group(1))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """What one run compiles and searches."""
  model_name: str
  model: gpt2.GPT2Config
  batch: int
  seq_len: int
  prefetch: tuple[int, ...]
  search_prefetch: int
  tier: Tier
  nvme_dir: str
  device_budget: int
  pool_capacity: int
  pool_capacity_source: str
  family: str
  max_width: int
  max_layers: int
  search: bool
  json_out: str | None

  @property
  def head_dim(self) -> int:
    return self.model.n_embd // self.model.n_head

  def validate(self) -> None:
    """Raises ValueError naming the flag whose value is wrong."""
    if self.seq_len > self.model.n_ctx:
      raise ValueError(f"--seq_len must be at most the model's n_ctx "
                       f"({self.model.n_ctx}), but got {self.seq_len}")
    if not self.prefetch:
      raise ValueError("--schedules must name at least one 'fixed:k'")
    size = sizes(self.model)
    if self.device_budget < size.block_bytes:
      raise ValueError(
          f"--device_budget ({format_bytes(self.device_budget)}) is smaller "
          f"than one block's weights ({format_bytes(size.block_bytes)}) of "
          f"GPT-2 {self.model_name}: no step of this model fits it")
    state = size.param_bytes + size.opt_state_bytes
    if self.pool_capacity < state:
      raise ValueError(
          f"--pool_capacity ({format_bytes(self.pool_capacity)}) cannot hold "
          f"GPT-2 {self.model_name}'s parameters and optimizer state "
          f"({format_bytes(state)})")
    if self.tier is Tier.NVME:
      common.check_directory(self.nvme_dir, flag="--nvme_dir")
    if self.family == "width" and self.max_width < self.model.n_embd:
      raise ValueError(f"--max_width must be at least the model's width "
                       f"({self.model.n_embd}), but got {self.max_width}")
    if self.family == "depth" and self.max_layers < self.model.n_layer:
      raise ValueError(f"--max_layers must be at least the model's depth "
                       f"({self.model.n_layer}), but got {self.max_layers}")
    common.check_json_out(self.json_out, "runs/max_model.json")


def config_from_flags() -> Config:
  """Builds the run's config from the parsed flags.

  Raises:
    ValueError: naming the flag whose value cannot be parsed.
  """
  overrides = {"scan_layers": _SCAN_LAYERS.value}
  if _N_LAYER.value is not None:
    overrides["n_layer"] = _N_LAYER.value
  try:
    model = gpt2.preset(_MODEL.value, **overrides)
  except ValueError as e:
    raise ValueError(f"--model: {e}") from None
  if _FAMILY.value not in FAMILIES:
    raise ValueError(f"--family must be one of {', '.join(FAMILIES)}, but "
                     f"got {_FAMILY.value!r}")
  tier = Tier.parse(_TIER.value.strip(), name="--tier")
  if _POOL_CAPACITY.value.strip() == "auto":
    capacity, source = auto_pool_capacity(tier, _NVME_DIR.value)
  else:
    capacity = parse_bytes(_POOL_CAPACITY.value, name="--pool_capacity")
    source = "--pool_capacity"
  return Config(
      model_name=_MODEL.value, model=model, batch=_BATCH.value,
      seq_len=_SEQ_LEN.value,
      prefetch=tuple(_prefetch(s, "--schedules") for s in _SCHEDULES.value),
      search_prefetch=_prefetch(_SEARCH_SCHEDULE.value, "--search_schedule"),
      tier=tier, nvme_dir=_NVME_DIR.value,
      device_budget=parse_bytes(_DEVICE_BUDGET.value, name="--device_budget"),
      pool_capacity=capacity, pool_capacity_source=source,
      family=_FAMILY.value, max_width=_MAX_WIDTH.value,
      max_layers=_MAX_LAYERS.value, search=_SEARCH.value,
      json_out=_JSON_OUT.value)


def auto_pool_capacity(tier: Tier, nvme_dir: str) -> tuple[int, str]:
  """The pool's 'auto' capacity and where it comes from: for the nvme
  tier the disk under `nvme_dir` (its free space, less a margin), else
  memory (a share of MemAvailable)."""
  if tier is Tier.NVME:
    free = shutil.disk_usage(nvme_dir).free if os.path.isdir(nvme_dir) else 0
    capacity = max(0, int(free * AUTO_DISK_FRACTION))
    return capacity, (f"auto: {AUTO_DISK_FRACTION:.0%} of the free disk "
                      f"under {nvme_dir} ({format_bytes(free)})")
  available = common.mem_available()
  return int(available * AUTO_POOL_FRACTION), (
      f"auto: {AUTO_POOL_FRACTION:.0%} of MemAvailable "
      f"{format_bytes(available)}")


# ------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Bytes of a GPT-2's parameters, split as the checks count them."""
  params: int  # parameter scalars
  param_bytes: int
  opt_state_bytes: int
  block_bytes: int  # one block's weights
  table_bytes: int  # everything outside the blocks

  def to_json(self) -> dict[str, int]:
    return dataclasses.asdict(self)


def _nbytes(tree: Any) -> int:
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


def _optimizer() -> optax.GradientTransformation:
  return optax.adamw(_LEARNING_RATE)


def shapes(model: gpt2.GPT2Config, batch: int, seq_len: int
           ) -> tuple[Any, Any, dict[str, jax.ShapeDtypeStruct]]:
  """Abstract parameters, optimizer state and batch (nothing allocated)."""
  params = jax.eval_shape(lambda: model_common.init_params(model))
  opt_state = jax.eval_shape(_optimizer().init, params)
  tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  return params, opt_state, {"x": tokens, "y": tokens}


def sizes(model: gpt2.GPT2Config) -> Sizes:
  params, opt_state, _ = shapes(model, 1, 1)
  if model.scan_layers:
    blocks = _nbytes(params["blocks"])
    block = blocks // model.n_layer
  else:
    blocks = sum(_nbytes(v) for k, v in params.items()
                 if k.startswith("blocks_"))
    block = _nbytes(params["blocks_0"])
  total = _nbytes(params)
  return Sizes(
      params=sum(math.prod(x.shape) for x in jax.tree.leaves(params)),
      param_bytes=total, opt_state_bytes=_nbytes(opt_state),
      block_bytes=block, table_bytes=total - blocks)


def train_step(model: gpt2.GPT2Config) -> Callable[..., Any]:
  return common.make_train_step(gpt2.make_loss(model), _optimizer())


def model_name(model: gpt2.GPT2Config) -> str:
  for name, preset in gpt2.PRESETS.items():
    if preset(scan_layers=model.scan_layers) == model:
      return f"gpt2-{name}"
  return (f"gpt2 {model.n_layer}x{model.n_embd} ({model.n_head} heads"
          f"{', scanned' if model.scan_layers else ''})")


# ------------------------------------------------------------- compiling


@dataclasses.dataclass(frozen=True)
class Need:
  """A compiled step's memory_analysis(), and the seconds lowering and
  compiling it took."""
  temp: int
  argument: int
  output: int
  alias: int
  compile_s: float

  @property
  def total(self) -> int:
    """What cxl_offload checks its device_budget against."""
    return self.temp + self.argument + self.output - self.alias

  @classmethod
  def of(cls, lowered: Callable[[], Any]) -> Need:
    start = time.perf_counter()
    m = lowered().compile().memory_analysis()
    return cls(m.temp_size_in_bytes, m.argument_size_in_bytes,
               m.output_size_in_bytes, m.alias_size_in_bytes,
               time.perf_counter() - start)

  def to_json(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "total": self.total}


def resident_need(model: gpt2.GPT2Config, batch: int, seq_len: int) -> Need:
  """The jitted step with its state donated (updated in place)."""
  args = shapes(model, batch, seq_len)
  step = jax.jit(train_step(model), donate_argnums=(0, 1))
  return Need.of(lambda: step.lower(*args))


def forward_backward_need(model: gpt2.GPT2Config, batch: int, seq_len: int
                     ) -> Need:
  """Forward and backward alone: weights in, gradients out, temp between."""
  params, _, tokens = shapes(model, batch, seq_len)
  fn = jax.jit(jax.value_and_grad(gpt2.make_loss(model)))
  return Need.of(lambda: fn.lower(params, tokens))


def offloaded_need(model: gpt2.GPT2Config, params: Any, opt_state: Any,
                   batch: dict[str, jax.Array], prefetch: int) -> Need:
  step = jcxl.cxl_offload(train_step(model), schedule=f"fixed:{prefetch}")
  return Need.of(lambda: step.lower(params, opt_state, batch))


def _zeros(tree: Any) -> Any:
  return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), tree)


def _tokens(batch: int, seq_len: int) -> dict[str, jax.Array]:
  zeros = jnp.zeros((batch, seq_len), jnp.int32)
  return {"x": zeros, "y": zeros}


def reserve(tree: Any, pool: jcxl.Pool, tier: Tier) -> Any:
  """PoolArrays for a tree of shapes: objects allocated, bytes not written.

  What ``jcxl.place`` makes for one device, without copying data in: enough
  for a compile, which reads shapes only, and it leaves the pool's memory
  untouched.

  Raises:
    PoolExhaustedError: the tier has no room (nothing stays allocated).
  """
  device = jax.devices()[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  made: list[PoolArray] = []

  def one(path, leaf):
    handle = pool.allocate(leaf.shape, leaf.dtype, tier)
    array = PoolArray(
        jax.device_put(np.array([handle], np.int32), sharding),
        pool_id=pool.id, shape=leaf.shape, dtype=leaf.dtype,
        sharding=sharding, tier=tier, path=jax.tree_util.keystr(path),
        local_handles=((device.id, handle),))
    made.append(array)
    return array

  try:
    return jax.tree_util.tree_map_with_path(one, tree)
  except BaseException:
    free(made)
    raise


def free(trees: Any) -> None:
  """Frees every PoolArray of `trees` in its pool."""
  for x in jax.tree.leaves(trees, is_leaf=lambda x: isinstance(x, PoolArray)):
    if isinstance(x, PoolArray):
      x.delete()


# ---------------------------------------------------------- part 1: GPT-2


@dataclasses.dataclass(frozen=True)
class Check:
  """One acceptance check on a device need, in bytes."""
  name: str
  need: int
  limit: int
  at_most: bool
  detail: str

  @property
  def passed(self) -> bool:
    return self.need <= self.limit if self.at_most else self.need >= self.limit

  def __str__(self) -> str:
    return (f"{'PASS' if self.passed else 'FAIL'} {self.name}: "
            f"{mib(self.need)} {'<=' if self.at_most else '>='} "
            f"{mib(self.limit)} ({self.detail})")

  def to_json(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "passed": self.passed}


def check_model(config: Config, pool: jcxl.Pool, label: str
                ) -> dict[str, Any]:
  """Part 1: the model's resident and offloaded needs, and their checks."""
  model = config.model
  size = sizes(model)
  logging.info("compiling the resident step of %s", model_name(model))
  resident = resident_need(model, config.batch, config.seq_len)
  activations = forward_backward_need(model, config.batch, config.seq_len)
  params, opt_state, _ = shapes(model, config.batch, config.seq_len)
  placed = []
  offloaded = {}
  try:
    for tree in (params, opt_state):
      placed.append(jcxl.place(_zeros(tree), config.tier.value, pool=pool))
    for k in config.prefetch:
      logging.info("compiling the offloaded step, fixed:%d", k)
      offloaded[k] = offloaded_need(model, *placed,
                                    _tokens(config.batch, config.seq_len), k)
  finally:
    free(placed)
  checks = [Check(
      f"resident {model_name(model)}", resident.total,
      size.param_bytes + size.opt_state_bytes, at_most=False,
      detail=f"parameters {mib(size.param_bytes)} + optimizer state "
             f"{mib(size.opt_state_bytes)}")]
  for k, need in offloaded.items():
    checks.append(Check(
        f"offloaded {model_name(model)} fixed:{k} from {label}", need.total,
        (k + 2) * size.block_bytes + activations.temp + 2 * size.table_bytes,
        at_most=True,
        detail=f"({k} + 2) x block {mib(size.block_bytes)} + "
               f"activations {mib(activations.temp)} + 2 x tables "
               f"{mib(size.table_bytes)}"))
  return {"model": model_name(model), "sizes": size,
          "resident": resident, "activations": activations,
          "offloaded": offloaded, "checks": checks}


def _model_table(part: dict[str, Any], config: Config, label: str
                 ) -> list[str]:
  size = part["sizes"]
  lines = [
      f"| {part['model']}, batch {config.batch} x {config.seq_len} tokens | "
      "device need | temp | arguments | outputs | aliased | / block | "
      "/ tables | compile s |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  rows = [("resident (jax.jit, state donated)", part["resident"])]
  rows += [(f"offloaded fixed:{k}, state in {label}", need)
           for k, need in part["offloaded"].items()]
  rows.append(("forward + backward only (activations = its temp)",
               part["activations"]))
  for name, need in rows:
    lines.append(
        f"| {name} | {mib(need.total)} | {mib(need.temp)} "
        f"| {mib(need.argument)} | {mib(need.output)} | "
        f"{mib(need.alias)} | {need.total / size.block_bytes:.1f} | "
        f"{need.total / size.table_bytes:.2f} | {need.compile_s:.1f} |")
  lines.append(
      f"\n{size.params:,} parameters: {mib(size.param_bytes)}, adamw "
      f"state {mib(size.opt_state_bytes)}, one block "
      f"{mib(size.block_bytes)}, tables (wte, wpe, ln_f) "
      f"{mib(size.table_bytes)}")
  return lines


# ------------------------------------------------------- part 2: search


@dataclasses.dataclass(frozen=True)
class Probe:
  """One compiled (or not placeable) member of the family."""
  index: int
  model: str
  params: int
  state_bytes: int  # parameters + optimizer state
  need: Need | None  # None: the pool could not hold the state
  budget: int

  @property
  def fits(self) -> bool:
    return self.need is not None and self.need.total <= self.budget

  @property
  def stopped_by(self) -> str:
    return ("pool capacity" if self.need is None else
            "device budget" if not self.fits else "")

  def to_json(self) -> dict[str, Any]:
    return {"index": self.index, "model": self.model, "params": self.params,
            "state_bytes": self.state_bytes,
            "need": self.need.to_json() if self.need else None,
            "budget": self.budget, "fits": self.fits,
            "stopped_by": self.stopped_by}


def family_member(config: Config, index: int) -> gpt2.GPT2Config:
  """Member `index` (>= 1): `index` heads wide, or `index` blocks deep."""
  if config.family == "width":
    return dataclasses.replace(config.model, n_head=index,
                               n_embd=index * config.head_dim)
  return dataclasses.replace(config.model, n_layer=index)


def _family_start_and_limit(config: Config) -> tuple[int, int]:
  if config.family == "width":
    return config.model.n_head, config.max_width // config.head_dim
  return config.model.n_layer, config.max_layers


def largest(probe: Callable[[int], Probe], start: int, limit: int
            ) -> tuple[Probe | None, str, list[Probe]]:
  """The largest fitting index in [1, limit], fits assumed monotone.

  Doubles from `start` while members fit, then bisects.

  Returns:
    The largest fitting probe (None if even index 1 fails), what stopped the
    search, and every probe in the order taken.
  """
  probes: dict[int, Probe] = {}

  def fits(i: int) -> bool:
    if i not in probes:
      probes[i] = probe(i)
      p = probes[i]
      logging.info("  %s: %s", p.model, "fits" if p.fits else p.stopped_by)
    return probes[i].fits

  lo, hi = 0, None  # largest known to fit (0: none), smallest known not to
  i = min(start, limit)
  if fits(i):
    lo = i
    while hi is None and lo < limit:
      i = min(2 * lo, limit)
      if fits(i):
        lo = i
      else:
        hi = i
  else:
    hi = i
  while hi is not None and hi - lo > 1:
    mid = (lo + hi) // 2
    if fits(mid):
      lo = mid
    else:
      hi = mid
  if hi is None:
    reason = "the family's end (--max_width / --max_layers)"
  else:
    reason = probes[hi].stopped_by
  return probes.get(lo), reason, list(probes.values())


def search(config: Config, pool: jcxl.Pool, part: dict[str, Any]
           ) -> dict[str, Any]:
  """Part 2: the largest resident and offloaded members within budget.

  The model itself is compiled again offloaded, on reserved state: the same
  need as on part 1's placed state shows that reserving is a fair stand-in.
  """
  start, limit = _family_start_and_limit(config)
  batch = _tokens(config.batch, config.seq_len)

  def describe(index: int) -> tuple[gpt2.GPT2Config, Sizes]:
    model = family_member(config, index)
    return model, sizes(model)

  def resident(index: int) -> Probe:
    model, size = describe(index)
    need = (part["resident"] if model == config.model else
            resident_need(model, config.batch, config.seq_len))
    return Probe(index, model_name(model), size.params,
                 size.param_bytes + size.opt_state_bytes, need,
                 config.device_budget)

  def offloaded(index: int) -> Probe:
    model, size = describe(index)
    state = size.param_bytes + size.opt_state_bytes
    params, opt_state, _ = shapes(model, 1, 1)
    try:
      reserved = reserve((params, opt_state), pool, config.tier)
    except jcxl.PoolExhaustedError:
      return Probe(index, model_name(model), size.params, state, None,
                   config.device_budget)
    try:
      need = offloaded_need(model, *reserved, batch, config.search_prefetch)
    finally:
      free(reserved)
    return Probe(index, model_name(model), size.params, state, need,
                 config.device_budget)

  out = {}
  for mode, probe in zip(MODES, (resident, offloaded)):
    logging.info("searching the %s family for %s", config.family, mode)
    best, reason, probes = largest(probe, start, limit)
    ran = (train_one_step(config, family_member(config, best.index), mode,
                          pool) if best else None)
    out[mode] = {"largest": best, "stopped_by": reason, "probes": probes,
                 "step": ran}
  placed = part["offloaded"].get(config.search_prefetch)
  again = next((p for p in out["offloaded"]["probes"] if p.index == start),
               None)
  out["reserved_vs_placed"] = None
  if placed is not None and again is not None and again.need is not None:
    out["reserved_vs_placed"] = (again.need.total, placed.total)
  return out


def _random_init(shapes_tree: Any) -> Callable[[jax.Array], Any]:
  """``init(key)``: every leaf normal * 0.02 from its own key, so that
  ``jcxl.init_in_pool`` computes one leaf at a time."""
  def init(key):
    leaves, treedef = jax.tree.flatten(shapes_tree)
    return jax.tree.unflatten(treedef, [
        0.02 * jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype)
        for i, x in enumerate(leaves)])
  return init


def train_one_step(config: Config, model: gpt2.GPT2Config, mode: str,
                   pool: jcxl.Pool) -> dict[str, Any]:
  """Runs one real train step of `model` (random weights, random tokens):
  resident under jax.jit, or offloaded with its state created in the pool
  leaf by leaf (``jcxl.init_in_pool``) and freed after."""
  params_shape, _, _ = shapes(model, 1, 1)
  tx = _optimizer()
  init = _random_init(params_shape)
  batch = gpt2.example_batch(model, batch_size=config.batch,
                             seq_len=config.seq_len)
  key = jax.random.key(0)
  started = time.perf_counter()
  if mode == "resident":
    params = jax.jit(init)(key)
    state = (params, tx.init(params))
    step = jax.jit(train_step(model), donate_argnums=(0, 1))
  else:
    params = jcxl.init_in_pool(init, key, pool=pool, kinds=config.tier.value)
    state = (params, jcxl.init_in_pool(tx.init, params, pool=pool,
                                       kinds=config.tier.value))
    step = jcxl.cxl_offload(train_step(model),
                            schedule=f"fixed:{config.search_prefetch}",
                            device_budget=config.device_budget)
  try:
    _, _, loss = step(*state, batch)
    loss = float(loss)
  finally:
    if mode != "resident":
      free(state)
  seconds = time.perf_counter() - started
  logging.info("%s %s: one step, loss %.4f, %.1f s with init and compile",
               mode, model_name(model), loss, seconds)
  return {"model": model_name(model), "loss": loss,
          "finite": bool(np.isfinite(loss)), "seconds": seconds}


def _search_table(found: dict[str, Any], config: Config, label: str
                  ) -> list[str]:
  modes = {"resident": "resident (jax.jit)",
           "offloaded": f"offloaded fixed:{config.search_prefetch}, state in "
                        f"{label}"}
  lines = ["| mode | model | params | device need | budget | fits |",
           "| --- | --- | --- | --- | --- | --- |"]
  for mode in MODES:
    for p in sorted(found[mode]["probes"], key=lambda p: p.index):
      need = (mib(p.need.total) if p.need else
              f"not compiled: its state ({mib(p.state_bytes)}) does not fit "
              "the pool")
      lines.append(f"| {modes[mode]} | {p.model} | {p.params / 1e6:.1f}M | "
                   f"{need} | {mib(p.budget)} | "
                   f"{'yes' if p.fits else 'no'} |")
  lines.append("")
  for mode in MODES:
    result = found[mode]
    best = result["largest"]
    what = (f"{best.model}, {best.params / 1e6:.1f}M parameters, needs "
            f"{mib(best.need.total)}" if best else "nothing fits")
    stopped = result["stopped_by"]
    if stopped == "pool capacity":
      stopped += f" ({config.pool_capacity_source})"
    lines.append(f"largest {modes[mode]}: {what}; search stopped by "
                 f"{stopped}")
    ran = result.get("step")
    if ran:
      lines.append(f"  ran one real step: loss {ran['loss']:.4f} "
                   f"({'finite' if ran['finite'] else 'NOT FINITE'}), "
                   f"{ran['seconds']:.1f} s with init and compile")
  if found["reserved_vs_placed"]:
    reserved, placed = found["reserved_vs_placed"]
    lines.append(
        f"{'PASS' if reserved == placed else 'FAIL'} offloaded "
        f"{model_name(config.model)} on reserved state (Pool.allocate, bytes "
        f"not written) needs what it needs on placed state (jcxl.place): "
        f"{mib(reserved)} == {mib(placed)}")
  return lines


# ------------------------------------------------------------------ run


def _pool(config: Config) -> jcxl.Pool:
  capacity = {t: (config.pool_capacity if t is config.tier else 0)
              for t in Tier}
  pool = jcxl.Pool(
      host=capacity[Tier.HOST], cxl=capacity[Tier.CXL],
      nvme=capacity[Tier.NVME],
      nvme_dir=config.nvme_dir if config.tier is Tier.NVME else None)
  # A tier without a link model is timed (with a 16 MiB object) the first
  # time a step is planned on it: now, while the pool is empty.
  pool.link_estimate(config.tier)
  return pool


def run(config: Config) -> dict[str, Any]:
  """Compiles and searches; prints the report, returns the results."""
  started = time.perf_counter()
  with _pool(config) as pool:
    label = pool.stats()[config.tier].label()
    print("\n".join([
        f"max model: GPT-2 {config.model_name} "
        f"({'scanned' if config.model.scan_layers else 'unrolled'} blocks), "
        f"batch {config.batch} x {config.seq_len} tokens, adamw, float32; "
        "device need = temp + arguments + outputs - aliased "
        "(memory_analysis of the compiled step)",
        str(bench.describe_machine()),
        f"pool: {label}, {format_bytes(config.pool_capacity)} for the state "
        f"({config.pool_capacity_source})"]), flush=True)
    part = check_model(config, pool, label)
    print("\n".join([""] + _model_table(part, config, label) + [""] +
                    [str(c) for c in part["checks"]]), flush=True)
    found = None
    if config.search:
      found = search(config, pool, part)
      grow = ("width in heads of "
              f"{config.head_dim}, {config.model.n_layer} blocks"
              if config.family == "width" else
              f"blocks, width {config.model.n_embd}")
      print("\n".join(
          ["", f"largest GPT-2 ({config.family} family: {grow}) within "
           f"{format_bytes(config.device_budget)} of device memory; pool "
           f"{format_bytes(config.pool_capacity)} of {label}", ""] +
          _search_table(found, config, label)), flush=True)
  seconds = time.perf_counter() - started
  print(f"\n{seconds:.0f} s", flush=True)
  return _to_json(config, label, part, found, seconds)


def _to_json(config: Config, label: str, part: dict[str, Any],
             found: dict[str, Any] | None, seconds: float) -> dict[str, Any]:
  result = {
      "config": {
          "model": config.model_name, "n_layer": config.model.n_layer,
          "scan_layers": config.model.scan_layers, "batch": config.batch,
          "seq_len": config.seq_len, "prefetch": list(config.prefetch),
          "search_prefetch": config.search_prefetch,
          "tier": config.tier.value, "device_budget": config.device_budget,
          "pool_capacity": config.pool_capacity,
          "pool_capacity_source": config.pool_capacity_source,
          "family": config.family, "max_width": config.max_width,
          "max_layers": config.max_layers},
      "machine": bench.describe_machine().to_json(),
      "tier": label,
      "model": {
          "name": part["model"], "sizes": part["sizes"].to_json(),
          "resident": part["resident"].to_json(),
          "activations": part["activations"].to_json(),
          "offloaded": {str(k): n.to_json()
                        for k, n in part["offloaded"].items()},
          "checks": [c.to_json() for c in part["checks"]]},
      "seconds": seconds,
  }
  if found is not None:
    result["search"] = {mode: {
        "largest": (found[mode]["largest"].to_json()
                    if found[mode]["largest"] else None),
        "stopped_by": found[mode]["stopped_by"],
        "step": found[mode]["step"],
        "probes": [p.to_json() for p in found[mode]["probes"]]}
                        for mode in MODES}
    pair = found["reserved_vs_placed"]
    result["search"]["reserved_vs_placed"] = (
        {"reserved": pair[0], "placed": pair[1], "equal": pair[0] == pair[1]}
        if pair else None)
  return result


def main(argv: Sequence[str]) -> None:
  common.run_program(argv, config_from_flags, run)


if __name__ == "__main__":
  host_allocator.start()
  app.run(main, flags_parser=common.flags_parser(FLAGS, __doc__))
