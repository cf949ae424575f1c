"""Allocation traces from real model shapes, replayed against the allocator.

A trace is the sequence of allocations and frees a training loop makes on
one tier of the pool, derived from the model's shapes alone (no tensor is
ever created): step 0 allocates the parameters and the Adam moments; every
later step runs a forward pass with activation checkpointing (each block
keeps only its input; its intermediates are allocated and freed as they are
computed), a backward pass in reverse block order (recomputing the block,
allocating its gradients and freeing them after the block's optimizer
update), plus the small objects a loop keeps (token batches prefetched one
step ahead, layer-norm statistics, loss scalars kept for logging). Sequence
lengths vary from step to step, drawn from a seeded generator, so transient
buffers change size and the trace is deterministic for a given seed.

``replay`` runs a trace against ``jcxl._jcxl.ReplayAllocator`` (the hybrid
allocator or the first-fit baseline) and reports fragmentation and
live/reserved at the peak of each step and at the end, with allocation
times.

Example:

  trace = build_trace(TraceConfig(model="gpt2", steps=2))
  result = replay(trace, "hybrid")
  print(result.final.external_fragmentation)
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from jcxl import _jcxl

logger = logging.getLogger(__name__)

POLICIES = ("hybrid", "first_fit")
# Extent granularity of the hybrid allocator; the baseline is malloc-like.
DEFAULT_ALIGNMENT = {"hybrid": 4096, "first_fit": 16}
DTYPES = ("float32", "bfloat16", "float16")
CAPACITY_HEADROOM = 1.5


# ------------------------------------------------------------------ shapes


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShapes:
  """The parameter shapes of one model, grouped as the optimizer updates them.

  Attributes:
    name: the model's name (one of ``MODEL_NAMES``).
    family: ``"gpt2"`` or ``"llama"``.
    vocab: vocabulary size.
    context: the longest sequence the model takes.
    dim: residual width (``n_embd``).
    n_layer: number of blocks.
    n_head: attention heads.
    ffn: hidden width of the MLP.
    tied_head: whether the output head reuses the token embedding.
    groups: ``(group, ((param, shape), ...))`` in forward order: the
      embedding, the blocks ``h.0`` ... and the head.
  """

  name: str
  family: str
  vocab: int
  context: int
  dim: int
  n_layer: int
  n_head: int
  ffn: int
  tied_head: bool
  groups: tuple[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]], ...]

  @property
  def params(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Every ``(name, shape)``, in forward order."""
    return tuple(p for _, group in self.groups for p in group)

  @property
  def parameter_count(self) -> int:
    return sum(math.prod(shape) for _, shape in self.params)


def _gpt2(name: str, dim: int, n_layer: int, n_head: int) -> ModelShapes:
  vocab, context, ffn = 50257, 1024, 4 * dim
  groups = [("embed", (("wte", (vocab, dim)), ("wpe", (context, dim))))]
  for i in range(n_layer):
    groups.append((f"h.{i}", tuple((f"h.{i}.{p}", s) for p, s in (
        ("ln_1.scale", (dim,)),
        ("ln_1.bias", (dim,)),
        ("attn.c_attn.w", (dim, 3 * dim)),
        ("attn.c_attn.b", (3 * dim,)),
        ("attn.c_proj.w", (dim, dim)),
        ("attn.c_proj.b", (dim,)),
        ("ln_2.scale", (dim,)),
        ("ln_2.bias", (dim,)),
        ("mlp.c_fc.w", (dim, ffn)),
        ("mlp.c_fc.b", (ffn,)),
        ("mlp.c_proj.w", (ffn, dim)),
        ("mlp.c_proj.b", (dim,)),
    ))))
  groups.append(("head", (("ln_f.scale", (dim,)), ("ln_f.bias", (dim,)))))
  return ModelShapes(name=name, family="gpt2", vocab=vocab, context=context,
                     dim=dim, n_layer=n_layer, n_head=n_head, ffn=ffn,
                     tied_head=True, groups=tuple(groups))


def _llama(name: str, dim: int, n_layer: int, n_head: int, ffn: int,
           vocab: int, context: int) -> ModelShapes:
  groups = [("embed", (("tok_embeddings", (vocab, dim)),))]
  for i in range(n_layer):
    groups.append((f"h.{i}", tuple((f"h.{i}.{p}", s) for p, s in (
        ("attention_norm", (dim,)),
        ("attention.wq", (dim, dim)),
        ("attention.wk", (dim, dim)),
        ("attention.wv", (dim, dim)),
        ("attention.wo", (dim, dim)),
        ("ffn_norm", (dim,)),
        ("feed_forward.w1", (dim, ffn)),
        ("feed_forward.w3", (dim, ffn)),
        ("feed_forward.w2", (ffn, dim)),
    ))))
  groups.append(("head", (("norm", (dim,)), ("output", (dim, vocab)))))
  return ModelShapes(name=name, family="llama", vocab=vocab, context=context,
                     dim=dim, n_layer=n_layer, n_head=n_head, ffn=ffn,
                     tied_head=False, groups=tuple(groups))


# n_embd, n_layer, n_head from the published GPT-2 configs (Radford et al.
# 2019; Hugging Face gpt2, gpt2-medium, gpt2-large, gpt2-xl).
_MODELS: dict[str, Callable[[], ModelShapes]] = {
    "gpt2": lambda: _gpt2("gpt2", 768, 12, 12),
    "gpt2-medium": lambda: _gpt2("gpt2-medium", 1024, 24, 16),
    "gpt2-large": lambda: _gpt2("gpt2-large", 1280, 36, 20),
    "gpt2-xl": lambda: _gpt2("gpt2-xl", 1600, 48, 25),
    "llama-7b": lambda: _llama("llama-7b", 4096, 32, 32, 11008, 32000, 2048),
}
MODEL_NAMES = tuple(_MODELS)
# Parameter counts as published (Hugging Face num_parameters(), tied head;
# LLaMA-7B: 6.74B).
PUBLISHED_PARAMETER_COUNTS = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama-7b": 6_738_415_616,
}


def model_shapes(name: str) -> ModelShapes:
  """The parameter shapes of a named model.

  Args:
    name: one of ``MODEL_NAMES``.

  Returns:
    The model's shapes.

  Raises:
    ValueError: if the name is not a known model.
  """
  if name not in _MODELS:
    raise ValueError(
        f"model must be one of {', '.join(repr(m) for m in MODEL_NAMES)}, "
        f"but got {name!r}")
  return _MODELS[name]()


def dtype_bytes(dtype: str) -> int:
  """Bytes per element of a dtype named in ``DTYPES``."""
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {', '.join(map(repr, DTYPES))}, "
                     f"but got {dtype!r}")
  return np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype).itemsize


# ------------------------------------------------------------------ traces


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceConfig:
  """What trace to build.

  Attributes:
    model: one of ``MODEL_NAMES``.
    steps: training steps after the step-0 initialisation.
    dtype: dtype of parameters, moments, gradients and activations.
    batch: sequences per step.
    seq_len: longest sequence; each step draws its length from
      ``[seq_len / 2, seq_len]`` in multiples of 64. None: the model's context.
    seed: seeds the sequence lengths.
    donate: whether the optimizer updates parameters and moments in place (a
      jitted step with donated state); if False, each update allocates new
      buffers and frees the old ones, as without ``donate_argnums``.
  """

  model: str
  steps: int = 3
  dtype: str = "float32"
  batch: int = 8
  seq_len: int | None = None
  seed: int = 0
  donate: bool = True

  def validate(self) -> None:
    """Raises ValueError naming the first bad field."""
    model_shapes(self.model)
    dtype_bytes(self.dtype)
    if self.steps < 0:
      raise ValueError(f"steps must be >= 0, but got {self.steps}")
    if self.batch < 1:
      raise ValueError(f"batch must be >= 1, but got {self.batch}")
    if self.seq_len is not None and self.seq_len < 64:
      raise ValueError(f"seq_len must be >= 64, but got {self.seq_len}")


@dataclasses.dataclass(frozen=True)
class Event:
  """One allocation (``nbytes > 0``) or free (``nbytes == 0``) of ``key``."""

  step: int
  key: int
  nbytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trace:
  """A built trace.

  Attributes:
    config: what it was built from.
    events: allocations and frees in order.
    labels: the name of each key (``labels[key]``), for reading a trace.
    steps: number of steps, including step 0.
  """

  config: TraceConfig
  events: tuple[Event, ...]
  labels: tuple[str, ...]
  steps: int

  @property
  def allocations(self) -> int:
    return sum(1 for e in self.events if e.nbytes)

  @property
  def peak_live(self) -> int:
    """The most bytes live at once (as requested, before any rounding)."""
    sizes = {}
    live = peak = 0
    for e in self.events:
      if e.nbytes:
        sizes[e.key] = e.nbytes
        live += e.nbytes
        peak = max(peak, live)
      else:
        live -= sizes.pop(e.key)
    return peak


class _Builder:
  """Emits events and keeps track of what is live."""

  def __init__(self):
    self.events: list[Event] = []
    self.labels: list[str] = []
    self.live: dict[int, int] = {}
    self.step = 0

  def alloc(self, label: str, nbytes: int) -> int:
    assert nbytes > 0, label
    key = len(self.labels)
    self.labels.append(label)
    self.live[key] = nbytes
    self.events.append(Event(self.step, key, nbytes))
    return key

  def free(self, key: int) -> None:
    del self.live[key]
    self.events.append(Event(self.step, key, 0))


@dataclasses.dataclass(frozen=True)
class _Op:
  """One operation of the forward pass, for the trace's purposes.

  ``inputs`` and ``output`` name buffers; ``size`` is the output's element
  count; ``aux`` the element counts of small saved statistics (layer-norm
  mean and rstd); ``params`` the parameter names (without the group prefix).
  """

  name: str
  inputs: tuple[str, ...]
  output: str
  size: int
  params: tuple[str, ...] = ()
  aux: tuple[int, ...] = ()


def _block_ops(m: ModelShapes, b: int, s: int) -> list[_Op]:
  """The forward ops of one block on ``b`` sequences of length ``s``."""
  t, d, h, f = b * s, m.dim, m.n_head, m.ffn
  if m.family == "gpt2":
    return [
        _Op("ln_1", ("x",), "a", t * d, ("ln_1.scale", "ln_1.bias"), (t, t)),
        _Op("c_attn", ("a",), "qkv", 3 * t * d,
            ("attn.c_attn.w", "attn.c_attn.b")),
        _Op("scores", ("qkv",), "sc", b * h * s * s),
        _Op("softmax", ("sc",), "p", b * h * s * s),
        _Op("pv", ("p", "qkv"), "o", t * d),
        _Op("c_proj", ("o",), "ao", t * d, ("attn.c_proj.w", "attn.c_proj.b")),
        _Op("residual_1", ("x", "ao"), "r", t * d),
        _Op("ln_2", ("r",), "c", t * d, ("ln_2.scale", "ln_2.bias"), (t, t)),
        _Op("c_fc", ("c",), "fc", t * f, ("mlp.c_fc.w", "mlp.c_fc.b")),
        _Op("gelu", ("fc",), "g", t * f),
        _Op("mlp_proj", ("g",), "m", t * d, ("mlp.c_proj.w", "mlp.c_proj.b")),
        _Op("residual_2", ("r", "m"), "y", t * d),
    ]
  return [
      _Op("attention_norm", ("x",), "a", t * d, ("attention_norm",), (t,)),
      _Op("wq", ("a",), "q0", t * d, ("attention.wq",)),
      _Op("wk", ("a",), "k0", t * d, ("attention.wk",)),
      _Op("wv", ("a",), "v", t * d, ("attention.wv",)),
      _Op("rope_q", ("q0",), "q", t * d),
      _Op("rope_k", ("k0",), "k", t * d),
      _Op("scores", ("q", "k"), "sc", b * h * s * s),
      _Op("softmax", ("sc",), "p", b * h * s * s),
      _Op("pv", ("p", "v"), "o", t * d),
      _Op("wo", ("o",), "ao", t * d, ("attention.wo",)),
      _Op("residual_1", ("x", "ao"), "r", t * d),
      _Op("ffn_norm", ("r",), "c", t * d, ("ffn_norm",), (t,)),
      _Op("w1", ("c",), "g1", t * f, ("feed_forward.w1",)),
      _Op("w3", ("c",), "g3", t * f, ("feed_forward.w3",)),
      _Op("silu_mul", ("g1", "g3"), "gm", t * f),
      _Op("w2", ("gm",), "m", t * d, ("feed_forward.w2",)),
      _Op("residual_2", ("r", "m"), "y", t * d),
  ]


def _head_ops(m: ModelShapes, b: int, s: int) -> list[_Op]:
  t, d = b * s, m.dim
  if m.family == "gpt2":
    norm = _Op("ln_f", ("x",), "a", t * d, ("ln_f.scale", "ln_f.bias"), (t, t))
    proj = _Op("logits", ("a",), "z", t * m.vocab, ("wte",))
  else:
    norm = _Op("norm", ("x",), "a", t * d, ("norm",), (t,))
    proj = _Op("logits", ("a",), "z", t * m.vocab, ("output",))
  # Cross entropy keeps the log-sum-exp per token and returns a scalar.
  return [norm, proj, _Op("loss", ("z",), "loss", 1, (), (t,))]


class _Run:
  """Forward and backward of ops against a builder, with real lifetimes."""

  def __init__(self, builder: _Builder, elem: int, param_bytes: dict[str, int],
               grads: dict[str, int]):
    self.b = builder
    self.elem = elem
    self.param_bytes = param_bytes
    self.grads = grads  # param -> key of its gradient, while it is live

  def forward(self, prefix: str, ops: Sequence[_Op], bufs: dict[str, int],
              keep: bool) -> dict[str, list[int]]:
    """Runs ops forward; ``bufs`` holds their inputs (name -> key).

    With ``keep``, every intermediate and statistic stays live for the
    backward pass (returned per op); otherwise each buffer is freed after its
    last use, statistics as soon as their op is done, and only ``x`` and the
    last output stay (in ``bufs``).
    """
    last_use = {}
    for i, op in enumerate(ops):
      for name in op.inputs:
        last_use[name] = i
    saved = {}
    for i, op in enumerate(ops):
      bufs[op.output] = self.b.alloc(f"{prefix}.{op.output}",
                                     op.size * self.elem)
      aux = [self.b.alloc(f"{prefix}.{op.name}.stat{j}", n * 4)
             for j, n in enumerate(op.aux)]
      saved[op.name] = aux
      if keep:
        continue
      for key in aux:
        self.b.free(key)
      for name in op.inputs:
        if last_use[name] == i and name != "x":
          self.b.free(bufs.pop(name))
    return saved

  def backward(self, prefix: str, ops: Sequence[_Op], bufs: dict[str, int],
               saved: dict[str, list[int]], grad_out: int,
               param_prefix: str) -> int:
    """Runs ops backward from the gradient of the last output.

    Allocates each parameter's gradient (or accumulates into it, through a
    temporary, when it is live already), the gradients of the inputs, and
    frees every intermediate once its op is done. Returns the key of the
    gradient of ``x``; ``x`` itself stays live (the caller owns it).
    Parameter names are ``param_prefix`` followed by the op's names.
    """
    dbufs = {ops[-1].output: grad_out}
    for op in reversed(ops):
      for param in op.params:
        name = param_prefix + param
        nbytes = self.param_bytes[name]
        if name in self.grads:
          self.b.free(self.b.alloc(f"grad_acc.{name}", nbytes))
        else:
          self.grads[name] = self.b.alloc(f"grad.{name}", nbytes)
      for name in op.inputs:
        # An input's gradient has the input's size: its producer's output
        # size, or (for ``x``) the live buffer's.
        nbytes = self._size(ops, name, bufs)
        if name in dbufs:
          self.b.free(self.b.alloc(f"{prefix}.dacc.{name}", nbytes))
        else:
          dbufs[name] = self.b.alloc(f"{prefix}.d{name}", nbytes)
      self.b.free(dbufs.pop(op.output))
      self.b.free(bufs.pop(op.output))
      for key in saved.pop(op.name):
        self.b.free(key)
    return dbufs.pop("x")

  def _size(self, ops: Sequence[_Op], name: str, bufs: dict[str, int]) -> int:
    for op in ops:
      if op.output == name:
        return op.size * self.elem
    return self.b.live[bufs[name]]


def _sequence_lengths(config: TraceConfig, context: int) -> list[int]:
  longest = config.seq_len or context
  choices = np.arange(max(64, longest // 2 // 64 * 64), longest + 1, 64)
  rng = np.random.default_rng(config.seed)
  # One more than the steps: the loader prefetches the next batch.
  return [int(x) for x in rng.choice(choices, size=config.steps + 1)]


def build_trace(config: TraceConfig) -> Trace:
  """Builds the allocation trace of training a model with Adam.

  Args:
    config: the model, steps, dtype, batch and seed.

  Returns:
    The trace; building it twice from one config gives equal traces.

  Raises:
    ValueError: if the config names an unknown model or dtype, or a bad
      count.
  """
  config.validate()
  m = model_shapes(config.model)
  elem = dtype_bytes(config.dtype)
  b = _Builder()
  param_bytes = {n: math.prod(s) * elem for n, s in m.params}
  state = {}  # (kind, param) -> key

  # Step 0: initialise the parameters, then the optimizer's moments (optax
  # builds mu's tree, then nu's), plus the step count.
  for name, nbytes in param_bytes.items():
    state["param", name] = b.alloc(f"param.{name}", nbytes)
  for kind in ("mu", "nu"):
    for name, nbytes in param_bytes.items():
      state[kind, name] = b.alloc(f"{kind}.{name}", nbytes)
  b.alloc("adam.count", 4)

  lengths = _sequence_lengths(config, m.context)
  tokens = b.alloc("tokens.1", config.batch * lengths[0] * 4)
  logged_loss = None
  for step in range(1, config.steps + 1):
    b.step = step
    s = lengths[step - 1]
    # The loader prefetches the next batch while this step runs.
    next_tokens = b.alloc(f"tokens.{step + 1}",
                          config.batch * lengths[step] * 4)
    grads: dict[str, int] = {}
    run = _Run(b, elem, param_bytes, grads)
    block = _block_ops(m, config.batch, s)
    head = _head_ops(m, config.batch, s)
    t = config.batch * s

    # Forward: embed, then each block keeps only its input (checkpoint).
    checkpoints = [b.alloc("x.0", t * m.dim * elem)]
    for i in range(m.n_layer):
      bufs = {"x": checkpoints[-1]}
      run.forward(f"h.{i}", block, bufs, keep=False)
      checkpoints.append(bufs["y"])
    head_bufs = {"x": checkpoints[-1]}
    head_saved = run.forward("head", head, head_bufs, keep=True)

    # Backward: the head, then the blocks in reverse, each recomputed from its
    # checkpoint; after a group's gradients are complete, Adam updates it.
    dloss = b.alloc("dloss", 4)
    dx = run.backward("head", head, head_bufs, head_saved, dloss, "")
    _update(b, state, grads, [n for n, _ in m.groups[-1][1]], param_bytes,
            config.donate)
    loss = b.alloc(f"loss.{step}", 4)  # kept for logging until next step
    for i in reversed(range(m.n_layer)):
      bufs = {"x": checkpoints[i]}
      saved = run.forward(f"h.{i}", block, bufs, keep=True)
      dx_in = run.backward(f"h.{i}", block, bufs, saved, dx,
                           f"h.{i}.")
      b.free(checkpoints.pop())  # block i's output, block i + 1's input
      dx = dx_in
      _update(b, state, grads, [n for n, _ in m.groups[i + 1][1]], param_bytes,
              config.donate)
    # The embedding: token rows and positions scatter-add into their grads.
    for name, _ in m.groups[0][1]:
      if name in grads:
        b.free(b.alloc(f"grad_acc.{name}", param_bytes[name]))
      else:
        grads[name] = b.alloc(f"grad.{name}", param_bytes[name])
    b.free(dx)
    b.free(checkpoints.pop())
    _update(b, state, grads, [n for n, _ in m.groups[0][1]], param_bytes,
            config.donate)
    assert not grads and not checkpoints, (grads, checkpoints)
    b.free(tokens)
    tokens = next_tokens
    if logged_loss is not None:
      b.free(logged_loss)
    logged_loss = loss

  return Trace(config=config, events=tuple(b.events), labels=tuple(b.labels),
               steps=config.steps + 1)


def _update(b: _Builder, state: dict[tuple[str, str], int],
            grads: dict[str, int], names: Sequence[str],
            param_bytes: dict[str, int], donate: bool) -> None:
  """Adam on some parameters: a temporary update each, then frees the grad."""
  for name in names:
    nbytes = param_bytes[name]
    update = b.alloc(f"update.{name}", nbytes)
    if not donate:
      for kind in ("mu", "nu", "param"):
        new = b.alloc(f"{kind}.{name}", nbytes)
        b.free(state[kind, name])
        state[kind, name] = new
    b.free(update)
    b.free(grads.pop(name))


# ------------------------------------------------------------------ replay


@dataclasses.dataclass(frozen=True, kw_only=True)
class Snapshot:
  """The allocator's state at one point of a replay."""

  step: int
  live: int
  reserved: int
  hole_bytes: int
  largest_free: int
  external_fragmentation: float

  @property
  def live_over_reserved(self) -> float:
    return self.live / self.reserved if self.reserved else 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayResult:
  """What a replay measured.

  Attributes:
    policy: ``"hybrid"`` or ``"first_fit"``.
    alignment: the allocator's alignment.
    capacity: the arena size replayed into.
    allocations: allocations replayed.
    peak_live: the most bytes live at once.
    peak_reserved: the highest reserved mark seen.
    peaks: the state when live bytes peaked, one per step (step 0 included).
    final: the state at the end of the trace.
    mean_alloc_ns: mean time of one allocation.
    p99_alloc_ns: 99th percentile of allocation times.
    max_alloc_ns: slowest allocation (one sample: often a preemption).
    slab_objects_peak: most objects in slabs at once (hybrid only).
  """

  policy: str
  alignment: int
  capacity: int
  allocations: int
  peak_live: int
  peak_reserved: int
  peaks: tuple[Snapshot, ...]
  final: Snapshot
  mean_alloc_ns: float
  p99_alloc_ns: float
  max_alloc_ns: int
  slab_objects_peak: int

  @property
  def worst_peak(self) -> Snapshot:
    """The step peak with the highest external fragmentation."""
    return max(self.peaks, key=lambda p: p.external_fragmentation)

  @property
  def peak_live_over_reserved(self) -> float:
    """Peak live bytes over the highest reserved mark (footprint efficiency)."""
    return self.peak_live / self.peak_reserved if self.peak_reserved else 1.0


def default_capacity(trace: Trace) -> int:
  """An arena for a trace: its peak live bytes times 1.5, whole MiB."""
  return math.ceil(trace.peak_live * CAPACITY_HEADROOM / 2**20) * 2**20


def _snapshot(step: int, stats: Any) -> Snapshot:
  """From the allocator's ``_jcxl.AllocatorStats``."""
  return Snapshot(step=step, live=stats.live, reserved=stats.reserved,
                  hole_bytes=stats.hole_bytes,
                  largest_free=stats.largest_free,
                  external_fragmentation=stats.external_fragmentation)


def replay(trace: Trace, policy: str, *, capacity: int | None = None,
           alignment: int | None = None) -> ReplayResult:
  """Replays a trace against a memory-less allocator.

  Args:
    trace: from ``build_trace``.
    policy: ``"hybrid"`` or ``"first_fit"``.
    capacity: arena bytes; None: ``default_capacity(trace)``.
    alignment: None: 4 KiB for the hybrid allocator (its extent granularity),
      16 bytes for first fit (malloc-like).

  Returns:
    The measurements. Byte counts and fragmentation depend only on the trace
    and the allocator; allocation times vary from run to run.

  Raises:
    ValueError: if the policy is unknown.
    PoolExhaustedError: if the arena is too small for the trace.
  """
  if policy not in POLICIES:
    raise ValueError(f"policy must be one of {', '.join(map(repr, POLICIES))}"
                     f", but got {policy!r}")
  alignment = alignment or DEFAULT_ALIGNMENT[policy]
  capacity = capacity or default_capacity(trace)
  allocator = _jcxl.ReplayAllocator(capacity, policy, alignment)
  tokens = {}
  sizes = {}
  live = 0
  step = 0
  step_peak = -1
  peak_live = peak_reserved = slab_peak = 0
  peaks = []
  peak_here = None
  alloc_ns = []
  ns_total = 0
  for event in trace.events:
    if event.step != step:
      peaks.append(peak_here)
      step, step_peak, peak_here = event.step, -1, None
    if event.nbytes:
      tokens[event.key] = allocator.allocate(event.nbytes)
      sizes[event.key] = event.nbytes
      live += event.nbytes
      # Only allocations can raise the live or the reserved mark.
      stats = allocator.stats()
      alloc_ns.append(stats.alloc_ns_total - ns_total)
      ns_total = stats.alloc_ns_total
      peak_reserved = max(peak_reserved, stats.reserved)
      slab_peak = max(slab_peak, stats.slab_objects)
      peak_live = max(peak_live, live)
      if live > step_peak:
        step_peak = live
        peak_here = _snapshot(step, stats)
    else:
      allocator.free(tokens.pop(event.key))
      live -= sizes.pop(event.key)
  peaks.append(peak_here)
  stats = allocator.stats()
  final = _snapshot(step, stats)
  result = ReplayResult(
      policy=policy, alignment=alignment, capacity=capacity,
      allocations=stats.allocations, peak_live=peak_live,
      peak_reserved=peak_reserved, peaks=tuple(peaks), final=final,
      mean_alloc_ns=stats.alloc_ns_total / max(1, stats.allocations),
      p99_alloc_ns=float(np.percentile(alloc_ns, 99)) if alloc_ns else 0.0,
      max_alloc_ns=stats.alloc_ns_max, slab_objects_peak=slab_peak)
  logger.debug("replayed %s on %s: %s", trace.config.model, policy, result)
  return result


# -------------------------------------------------------------- comparison


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
  """One model's trace replayed on each allocator.

  Attributes:
    model: the model's name.
    trace_events: allocations plus frees in the trace.
    results: policy -> its replay, or the message of the PoolExhaustedError
      that stopped it.
  """

  model: str
  trace_events: int
  results: dict[str, ReplayResult | str]


def compare(config: TraceConfig,
            policies: Sequence[str] = POLICIES) -> Comparison:
  """Builds a model's trace and replays it on each allocator policy.

  Args:
    config: the trace to build.
    policies: allocators to replay it on, from ``POLICIES``.

  Returns:
    The replays, in the order of ``policies``.
  """
  trace = build_trace(config)
  results = {}
  for policy in policies:
    try:
      results[policy] = replay(trace, policy)
    except MemoryError as e:  # PoolExhaustedError: report, don't stop.
      results[policy] = str(e)
  return Comparison(model=config.model, trace_events=len(trace.events),
                    results=results)


TABLE_COLUMNS = (
    "model", "allocator", "objects", "peak live", "peak reserved",
    "live/res peaks", "live/res end", "ext frag peaks", "ext frag end",
    "largest free", "alloc ns mean", "alloc ns p99", "alloc ns max")


def table_rows(comparisons: Sequence[Comparison]) -> list[dict[str, str]]:
  """One row of text per model and allocator, keyed by ``TABLE_COLUMNS``.

  ``live/res peaks`` is the lowest live/reserved at a step's peak,
  ``ext frag peaks`` the highest external fragmentation at one, and
  ``largest free`` the largest free extent at that worst peak.
  """
  rows = []
  for c in comparisons:
    for policy, r in c.results.items():
      row = dict.fromkeys(TABLE_COLUMNS, "")
      row["model"], row["allocator"] = c.model, policy
      if isinstance(r, str):
        row["objects"] = "exhausted: " + r
        rows.append(row)
        continue
      worst = r.worst_peak
      row.update({
          "objects": f"{r.allocations:,}",
          "peak live": _gib(r.peak_live),
          "peak reserved": _gib(r.peak_reserved),
          "live/res peaks":
              f"{min(p.live_over_reserved for p in r.peaks):.2%}",
          "live/res end": f"{r.final.live_over_reserved:.2%}",
          "ext frag peaks": f"{worst.external_fragmentation:.2%}",
          "ext frag end": f"{r.final.external_fragmentation:.2%}",
          "largest free": _gib(worst.largest_free),
          "alloc ns mean": f"{r.mean_alloc_ns:,.0f}",
          "alloc ns p99": f"{r.p99_alloc_ns:,.0f}",
          "alloc ns max": f"{r.max_alloc_ns:,}",
      })
      rows.append(row)
  return rows


def _gib(nbytes: int) -> str:
  return f"{nbytes / 2**30:.3f} GiB"


def format_table(rows: Sequence[dict[str, str]], *,
                 markdown: bool = False) -> str:
  """Aligned text (or a markdown table) of ``table_rows``."""
  widths = {c: max([len(c)] + [len(r[c]) for r in rows])
            for c in TABLE_COLUMNS}
  def line(cells: dict[str, str]) -> str:
    parts = [cells[c].ljust(widths[c]) if i < 2 else cells[c].rjust(widths[c])
             for i, c in enumerate(TABLE_COLUMNS)]
    return ("| " + " | ".join(parts) + " |") if markdown else "  ".join(parts)
  header = line({c: c for c in TABLE_COLUMNS})
  if markdown:
    rule = "|" + "|".join(
        "-" * (widths[c] + 1) + (":" if i >= 2 else "-")
        for i, c in enumerate(TABLE_COLUMNS)) + "|"
  else:
    rule = "  ".join("-" * widths[c] for c in TABLE_COLUMNS)
  return "\n".join([header, rule] + [line(r) for r in rows])


CSV_COLUMNS = ("model", "allocator", "point", "live", "reserved", "hole_bytes",
               "external_fragmentation", "live_over_reserved", "largest_free",
               "allocations", "alloc_ns_mean", "alloc_ns_p99",
               "alloc_ns_max")


def write_results(comparisons: Sequence[Comparison], out_dir: str) -> list[str]:
  """Writes ``alloc_trace.csv`` (every step peak and the end, in bytes) and
  ``alloc_trace.md`` (the table) into ``out_dir``; returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  csv_path = os.path.join(out_dir, "alloc_trace.csv")
  with open(csv_path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(CSV_COLUMNS)
    for c in comparisons:
      for policy, r in c.results.items():
        if isinstance(r, str):
          continue
        points = [(f"peak.{p.step}", p) for p in r.peaks] + [("end", r.final)]
        for point, p in points:
          writer.writerow([
              c.model, policy, point, p.live, p.reserved, p.hole_bytes,
              f"{p.external_fragmentation:.6f}",
              f"{p.live_over_reserved:.6f}", p.largest_free, r.allocations,
              f"{r.mean_alloc_ns:.1f}", f"{r.p99_alloc_ns:.1f}",
              r.max_alloc_ns])
  md_path = os.path.join(out_dir, "alloc_trace.md")
  with open(md_path, "w") as f:
    f.write(format_table(table_rows(comparisons), markdown=True) + "\n")
  return [csv_path, md_path]
