"""What a transfer costs a step beyond its link: the copy engine's round trip.

A fetch that the step waits for pays more than its bytes over the link and
the link's latency: the ``start`` call hands the request to a copy thread,
which wakes, copies and wakes the waiting ``done``. On this kind of host (2
shared cores in a VM) that round trip measured 36-130 us a fetch over a
day, against an emulated link latency of 2 us, which is all a plan from
the link model alone sees. It is measured once per process, in a compiled
program of fetches that each wait for the one before, against the same
program without them.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jcxl._src.schedules import compute_estimate
from jcxl._src import placement
from jcxl._src import pool as pool_lib
from jcxl._src import stream

logger = logging.getLogger(__name__)

_CHAIN = 32  # fetches in the timed program
_RUNS = 15


@functools.lru_cache(maxsize=None)
def round_trip_seconds() -> float:
  """Seconds a waited-for fetch of a tiny object takes beyond its link, on
  a pool of this process's default device (measured once)."""
  with jax.ensure_compile_time_eval(), pool_lib.Pool(host="1MiB",
                                                     cxl=0) as pool:
    seconds = measure_round_trip(pool)
  logger.info("copy engine round trip: %.1f us a fetch", seconds * 1e6)
  return seconds


def measure_round_trip(pool: pool_lib.Pool) -> float:
  """The median over a few runs of a program of `_CHAIN` fetches from
  `pool`'s host tier, each waiting for the one before, less the same
  program without them, per fetch."""
  def chain(xs, n):
    acc = jnp.zeros((4,), jnp.float32)
    for x in xs[:n]:
      acc = acc + stream.fetch(x, after=acc)
    return acc

  xs = [placement.place(np.ones((4,), np.float32), "host", pool=pool)
        for _ in range(_CHAIN)]
  try:
    times = [compute_estimate._typical_seconds(  # pylint: disable=protected-access
        jax.jit(functools.partial(chain, n=n)).lower(xs).compile(), xs,
        reps=_RUNS) for n in (0, _CHAIN)]
    jax.effects_barrier()
  finally:
    for x in xs:
      x.delete()
  return max(0.0, (times[1] - times[0]) / _CHAIN)
