"""How long an equation computes, before anything has been measured.

The adaptive schedule starts from an estimate: matrix products (dot_general,
convolutions) cost their multiply-adds at the device's measured matmul rate,
everything else its output elements at the measured elementwise rate. The
rates are measured once per process on the default device (a few ms).
Measured steps replace these estimates.
"""

from __future__ import annotations

import functools
import math
import time

import jax
import numpy as np

from jcxl._src import jax_compat


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

  def best(fn, arg, reps=5):
    jax.block_until_ready(fn(arg))
    times = []
    for _ in range(reps):
      t = time.perf_counter()
      jax.block_until_ready(fn(arg))
      times.append(time.perf_counter() - t)
    return min(times)

  return 2 * n**3 / best(matmul, a), x.size / best(elementwise, x)


def _size(aval) -> int:
  return math.prod(getattr(aval, "shape", ()))


def costs(eqn) -> tuple[float, float]:
  """(matmul flops, elementwise elements) of one equation, nested
  bodies included (a scan's body counted once per iteration)."""
  name = eqn.primitive.name
  out = sum(_size(v.aval) for v in eqn.outvars)
  if name == "dot_general":
    (contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return 2.0 * out * math.prod(lhs[d] for d in contract), 0.0
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2.0 * out * math.prod(rhs) / max(1, out_features), 0.0
  if name == "cond":
    branches = [jaxpr_costs(b.jaxpr) for b in eqn.params["branches"]]
    return max(branches, key=sum) if branches else (0.0, 0.0)
  sub = jax_compat.sub_jaxpr(eqn)
  if sub is not None:
    flops, elems = jaxpr_costs(sub[0])
    times = eqn.params.get("length", 1) if name == "scan" else 1
    return flops * times, elems * times
  return 0.0, float(out)


def jaxpr_costs(jaxpr) -> tuple[float, float]:
  flops = elems = 0.0
  for eqn in jaxpr.eqns:
    f, e = costs(eqn)
    flops, elems = flops + f, elems + e
  return flops, elems


def seconds(flops: float, elements: float) -> float:
  """Estimated device time of that much work."""
  matmul_rate, elementwise_rate = device_rates()
  return flops / matmul_rate + elements / elementwise_rate
