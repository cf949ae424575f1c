"""How long an equation computes, before anything has been measured.

The adaptive schedule starts from an estimate: each matrix product
(dot_general) is timed on the default device once per shape, dtype and
contraction (a device's matmul rate varies several-fold with the shape: a
small or thin product runs far below the rate of a large square one);
convolutions cost their multiply-adds at the measured rate of a 512-square
product. Everything else is elementwise work that the compiler fuses into
loops: a run of such equations costs the elements it reads from outside
the run and writes out of it, at the measured rate of a loop that reads and
writes one element each (counting every equation's output instead
overestimated an optimizer update several-fold). Reductions, gathers,
scatters and transcendentals do more per element than a load and a store
(a CPU reduces a column, scatters an embedding's gradient or takes an exp
at a fraction of that rate): each is timed on the device once per
signature, and what it takes beyond moving its elements is added.
Measurements are made once per process (a few ms each: a large product is
timed on a slice of it); measured steps replace these estimates.

Summed equation by equation, the estimate misses what the compiler makes of
a run of them (which loops it forms, what they move, a large buffer's page
faults): `run_seconds` times a whole run, compiled as one program, where
its arrays are small enough to allocate here.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jcxl._src import jax_compat

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def device_rates() -> tuple[float, float]:
  """(matmul flop/s, elementwise elements/s) of the default device.

  Runs compiled executables on concrete arrays, so it measures the device
  even when first called while a step is being traced.
  """
  n = 512
  a = np.ones((n, n), np.float32)
  x = np.ones((1 << 22,), np.float32)
  matmul = jax.jit(lambda a: a @ a).lower(a).compile()
  elementwise = jax.jit(lambda x: x * 1.5 + 0.5).lower(x).compile()
  return 2 * n**3 / _typical_seconds(matmul, a), x.size / _typical_seconds(
      elementwise, x)


def _typical_seconds(fn, *args, reps: int = 5, once_over: float = 0.1
                     ) -> float:
  """The median of a few runs after one that warms up (a step runs at the
  device's usual speed, not its best: on a shared host the fastest of five
  ran 10-20% under it); a run that takes over `once_over` seconds is timed
  once (the noise is small beside it). The warm-up run is never the
  measurement: a fresh process's first run of a small product took 116 ms
  here, 150 times its usual time. The arguments are put on the device
  first: passed as numpy arrays, each run copied them in, and an
  elementwise loop timed 10x slower here. Arguments that are not numpy
  arrays (pool arrays, arrays already on a device) are passed as they are."""
  with jax.ensure_compile_time_eval():  # concrete, even inside a trace
    args = tuple(jax.device_put(a) if isinstance(a, np.ndarray) else a
                 for a in args)
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
    if times[0] > once_over:
      break
  return statistics.median(times)


@functools.lru_cache(maxsize=None)
def _dot_seconds(lhs: tuple[int, ...], rhs: tuple[int, ...], lhs_dtype,
                 rhs_dtype, dimension_numbers, out_dtype) -> float:
  """Measured time of one dot_general of this signature."""
  a = np.ones(lhs, lhs_dtype)
  b = np.ones(rhs, rhs_dtype)
  dot = jax.jit(lambda a, b: jax.lax.dot_general(
      a, b, dimension_numbers, preferred_element_type=out_dtype))
  return _typical_seconds(dot.lower(a, b).compile(), a, b)


def _freeze(dimension_numbers):
  return tuple(tuple(tuple(d) for d in part) for part in dimension_numbers)


# Products with more multiply-adds are timed on a slice of this size and
# scaled (past it the rate no longer grows; planning a large model on a
# small host must not run its full-size products).
_TIMED_FLOPS = 2e9


def _dot_estimate(lhs: tuple[int, ...], rhs: tuple[int, ...], lhs_dtype,
                  rhs_dtype, dimension_numbers, out_dtype) -> float:
  """A dot_general's time: measured, on its largest free dimension cut
  down to about `_TIMED_FLOPS` multiply-adds and scaled back up."""
  (lc, rc), (lb, rb) = dimension_numbers
  flops = 2.0 * math.prod(lhs) * math.prod(
      d for i, d in enumerate(rhs) if i not in rc and i not in rb)
  if flops <= _TIMED_FLOPS:
    return _dot_seconds(lhs, rhs, lhs_dtype, rhs_dtype, dimension_numbers,
                        out_dtype)
  free = [(lhs[i], 0, i) for i in range(len(lhs)) if i not in lc + lb] + [
      (rhs[i], 1, i) for i in range(len(rhs)) if i not in rc + rb]
  size, side, axis = max(free)
  cut = max(1, int(size * _TIMED_FLOPS / flops))
  shapes = [list(lhs), list(rhs)]
  shapes[side][axis] = cut
  return _dot_seconds(tuple(shapes[0]), tuple(shapes[1]), lhs_dtype,
                      rhs_dtype, dimension_numbers, out_dtype) * size / cut


def _size(aval) -> int:
  return math.prod(getattr(aval, "shape", ()))


# Fused primitives that compute more per element than they move: each is
# timed on the device (once per signature) for its time beyond that.
_COSTLY = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax",
    "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
    "gather", "scatter", "scatter-add", "scatter_add", "scatter-mul",
    "scatter_mul", "scatter-min", "scatter_min", "scatter-max",
    "scatter_max", "exp", "exp2", "log", "log1p", "expm1", "tanh",
    "logistic", "erf", "erfc", "erf_inv", "sin", "cos", "tan", "atan2",
    "pow", "lgamma", "digamma"})
# Larger equations are not timed (no extra charge): planning a large model
# on a small host must not allocate its full-size tensors.
_TIMED_ELEMENTS = 1 << 25
_eqn_seconds: dict[Any, float] = {}  # by signature, measured


def _extra_seconds(eqn) -> float:
  """A costly equation's device time beyond moving its elements."""
  if eqn.primitive.name not in _COSTLY:
    return 0.0
  literal = jax_compat.literal_type()
  operands = [v.aval for v in eqn.invars if not isinstance(v, literal)]
  moved = sum(map(_size, operands)) + sum(_size(v.aval) for v in eqn.outvars)
  if not operands or moved > _TIMED_ELEMENTS:
    return 0.0
  key = (eqn.primitive.name,
         tuple((tuple(a.shape), str(a.dtype)) for a in operands),
         tuple(repr(v.val) if isinstance(v, literal) else None
               for v in eqn.invars), repr(sorted(eqn.params.items())))
  if key not in _eqn_seconds:
    try:
      _eqn_seconds[key] = _time_eqn(eqn)
    except Exception as e:  # pylint: disable=broad-except
      # An estimate, replaced by measured steps: not worth failing a plan.
      logger.debug("not timed: %s (%s)", eqn.primitive.name, e)
      _eqn_seconds[key] = 0.0
  _, elementwise_rate = device_rates()
  return max(0.0, _eqn_seconds[key] - moved / (2 * elementwise_rate))


def _time_eqn(eqn) -> float:
  """One equation's device time, on zeros (indices in bounds)."""
  literal = jax_compat.literal_type()
  operands = [np.zeros(v.aval.shape, v.aval.dtype) for v in eqn.invars
              if not isinstance(v, literal)]

  def run(*values):
    it = iter(values)
    return jax_compat.bind(eqn, [v.val if isinstance(v, literal)
                                 else next(it) for v in eqn.invars])
  return _typical_seconds(jax.jit(run).lower(*operands).compile(), *operands)


def eqn_seconds(eqn) -> float:
  """Estimated device time of one equation, nested bodies included (a
  scan's body once per iteration, a cond's costliest branch)."""
  name = eqn.primitive.name
  if name == "dot_general":
    lhs, rhs = (v.aval for v in eqn.invars)
    return _dot_estimate(tuple(lhs.shape), tuple(rhs.shape), lhs.dtype,
                         rhs.dtype, _freeze(eqn.params["dimension_numbers"]),
                         eqn.outvars[0].aval.dtype)
  matmul_rate, elementwise_rate = device_rates()
  out = sum(_size(v.aval) for v in eqn.outvars)
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2.0 * out * math.prod(rhs) / max(1, out_features) / matmul_rate
  if name == "cond":
    return max((jaxpr_seconds(b.jaxpr) for b in eqn.params["branches"]),
               default=0.0)
  sub = jax_compat.sub_jaxpr(eqn)
  if sub is not None:
    times = eqn.params.get("length", 1) if name == "scan" else 1
    return jaxpr_seconds(sub[0]) * times
  return out / elementwise_rate + _extra_seconds(eqn)


@dataclasses.dataclass
class _Node:
  """An equation of a nested body, keyed as ``node_seconds`` wants."""
  eqn: Any
  ins: list[Any]
  outs: list[Any]


def jaxpr_seconds(jaxpr) -> float:
  literal = jax_compat.literal_type()
  return sum(node_seconds([_Node(
      eqn, [(0, v) for v in eqn.invars if not isinstance(v, literal)],
      [(0, v) for v in eqn.outvars]) for eqn in jaxpr.eqns]))


# Primitives the compiler does not fuse into a neighbour's loop.
_UNFUSED = frozenset({"dot_general", "conv_general_dilated", "sort",
                      "ffi_call", "custom_call", "pure_callback",
                      "io_callback", "all_gather", "all_reduce", "psum",
                      "reduce_scatter", "all_to_all", "ppermute"})


def _fused(eqn) -> bool:
  return (eqn.primitive.name not in _UNFUSED
          and jax_compat.sub_jaxpr(eqn) is None)


def node_seconds(nodes: Sequence[Any],
                 resolve: Callable[[Any], Any] = lambda key: key
                 ) -> list[float]:
  """Estimated time of each node of a flat program (``eqn``, ``ins``,
  ``outs`` keys; `resolve` maps an input key to the key its producer
  wrote): fused elementwise nodes are charged what they read from outside
  the fused work and what they write out of it (an output no node here
  reads leaves it; a node's ``region``, if it has one, is a program of its
  own)."""
  fused = [not hasattr(n, "region") and _fused(n.eqn) for n in nodes]
  produced_by_fused = {k for n, f in zip(nodes, fused) if f for k in n.outs}
  read_by = {}  # key -> read by some unfused node (True) or only fused ones
  for n, f in zip(nodes, fused):
    for atom in n.ins:
      key = resolve(atom)
      read_by[key] = read_by.get(key, False) or not f
  _, elementwise_rate = device_rates()
  out = []
  for n, f in zip(nodes, fused):
    if hasattr(n, "region"):
      out.append(sum(node_seconds(n.region, resolve)))
    elif not f:
      out.append(eqn_seconds(n.eqn))
    else:
      reads = sum(_size(atom[1].aval) for atom in n.ins
                  if isinstance(atom, tuple)
                  and resolve(atom) not in produced_by_fused)
      writes = sum(_size(key[1].aval) for key in n.outs
                   if read_by.get(key, True))
      out.append((reads + writes) / (2 * elementwise_rate)
                 + _extra_seconds(n.eqn))
  return out


# Runs whose arrays (arguments, results and the compiled program's
# temporaries) need more than this are not timed whole (planning a large
# model on a small host must not allocate its full-size tensors).
_TIMED_RUN_BYTES = 1 << 30
_run_seconds: dict[str, float | None] = {}  # by the run's lowered text


def run_seconds(nodes: Sequence[Any], resolve: Callable[[Any], Any],
                consts: Mapping[Any, Any], needed: Callable[[Any], bool]
                ) -> float | None:
  """The measured device time of a run of a flat program's nodes
  (``eqn``, ``ins``, ``outs``), compiled as one program that returns the
  values `needed` says are read after it; its inputs are zeros. None where
  it is too large to run here, has side effects or does not compile."""
  is_lit = lambda atom: not isinstance(atom, tuple)  # else a key
  produced = {k for n in nodes for k in n.outs}
  inputs: dict[Any, Any] = {}  # key -> aval, in first-read order
  for n in nodes:
    if n.eqn is None or n.eqn.effects:
      return None
    for atom in n.ins:
      key = atom if is_lit(atom) else resolve(atom)
      if (not is_lit(key) and key not in produced
          and key not in consts):
        inputs.setdefault(key, atom[1].aval)
  outputs = [k for n in nodes for k in n.outs if needed(k)]

  def value(env, atom):
    if is_lit(atom):
      return atom.value
    key = resolve(atom)
    if is_lit(key):
      return key.value
    return env[key] if key in env else consts[key]

  def run(*args):
    env = dict(zip(inputs, args))
    for n in nodes:
      env.update(zip(n.outs, jax_compat.bind(
          n.eqn, [value(env, a) for a in n.ins])))
    return [env[k] for k in outputs]

  avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in inputs.values()]
  nbytes = lambda avals: sum(_size(a) * np.dtype(a.dtype).itemsize
                             for a in avals)
  try:
    lowered = jax.jit(run).lower(*avals)
    results = jax.tree.leaves(lowered.out_info)
    if nbytes(avals) + nbytes(results) > _TIMED_RUN_BYTES:
      return None
    text = lowered.as_text()
    if text not in _run_seconds:
      compiled = lowered.compile()
      temp = compiled.memory_analysis().temp_size_in_bytes
      _run_seconds[text] = (
          None if nbytes(avals) + nbytes(results) + temp
          > _TIMED_RUN_BYTES else _device_seconds(compiled, avals))
  except Exception as e:  # pylint: disable=broad-except
    # An estimate, replaced by measured steps: not worth failing a plan.
    logger.debug("run of %d nodes not timed: %s", len(nodes), e)
    return None
  return _run_seconds[text]


def _device_seconds(compiled, avals) -> float:
  """A compiled run's time on zeros, less what calling it costs (the same
  arguments into a program that does nothing): summed over the many small
  runs of a step, the calls' own cost came to a fifth of an MLP's
  estimate here, which the step, one call, does not pay."""
  args = [np.zeros(a.shape, a.dtype) for a in avals]
  empty = jax.jit(lambda *a: np.int32(0)).lower(*avals).compile()
  # Runs up to a second are timed five times: timed once after its
  # warm-up, a 0.2 s GPT-2 step came out at 0.34 s.
  return max(0.0, _typical_seconds(compiled, *args, once_over=1.0)
             - _typical_seconds(empty, *args))
