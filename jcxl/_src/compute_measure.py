"""Each segment's compute measured in the offloaded step itself, before a
plan is made for the real pool.

Timed alone, a segment misses what the compiler makes of the whole step:
loops it forms across layer boundaries (GPT-2's softmax gradient fused with
a transpose into one 54-75 ms loop here, which no segment forms by itself),
and the dispatch of a step cut into hundreds of pieces by its transfers.
Measured in the step, nothing is missed: the step is rewritten as
``cxl_offload`` rewrites it, every leaf fetched right before its use from a
throwaway host pool, run on zeros, and each segment's compute read from
its waits, as the adaptive schedule measures a running step. What the
links add is then the cost model's to predict, for any plan and any tiers.

It needs the step's state in host memory and a few steps' time: plan a
model larger than that from timed segments (``step_timeline``).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jcxl._src.schedules import costmodel
from jcxl._src import placement
from jcxl._src import pool as pool_lib
from jcxl._src.offload import step as offload_step

# Room beyond the state's own bytes: the pool's slabs and alignment.
_POOL_SLACK = 1.25
_POOL_EXTRA = 32 << 20


def measured_timeline(fn: Callable, state: tuple[Any, ...], *rest: Any,
                      tier_of: Callable[[str], str] = lambda path: "cxl",
                      steps: int = 10
                      ) -> tuple[list[costmodel.Segment], dict[str, int]]:
  """``step_timeline``'s segments, each one's compute measured in the step.

  Args:
    fn: the train step, as given to ``cxl_offload``.
    state: its state arguments as ``jax.ShapeDtypeStruct`` trees, each leaf
      planned as if placed in tier ``tier_of(path)``.
    rest: the other arguments (abstract, or concrete arrays).
    steps: measured steps (after one that compiles and one that warms up);
      each segment gets the median of its times.

  Returns:
    The segments, and the bytes of state each layer holds in the pool.
  """
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}")
  segments, layer_bytes = offload_step.step_timeline(fn, state, *rest,
                                                  tier_of=tier_of)
  zeros = lambda tree: jax.tree.map(
      lambda x: np.zeros(x.shape, x.dtype)
      if isinstance(x, jax.ShapeDtypeStruct) else x, tree)
  nbytes = sum(layer_bytes.values())
  with pool_lib.Pool(host=int(nbytes * _POOL_SLACK) + _POOL_EXTRA,
                     cxl=0) as pool:
    args = [placement.place(zeros(tree), "host", pool=pool)
            for tree in state] + list(zeros(rest))
    step = offload_step.cxl_offload(fn, schedule="sync")
    measured = []
    for n in range(steps + 2):  # the state is written back in place
      _, profile = step.measured_call(*args)
      if n >= 2:
        measured.append(profile.segment_compute_s)
  ran = [s.name for s in step._segments]  # pylint: disable=protected-access
  if (any(m is None or len(m) != len(segments) for m in measured)
      or ran != [s.name for s in segments]):
    raise RuntimeError(
        "the measured step's layer boundaries did not match its timeline "
        f"({len(segments)} segments): its compute could not be measured")
  compute = [statistics.median(c) for c in zip(*measured)]
  return ([dataclasses.replace(s, compute_s=c)
           for s, c in zip(segments, compute)], layer_bytes)
