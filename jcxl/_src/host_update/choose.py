"""The pass that chooses where each host update runs (``update='auto'``).

'auto' compares, per update, the time to move its gradients out and update
on the host with the time to move its state in and out and update on the
device, from the link's planning figures and rates measured once per pool
(`measured_rates`); 'host' takes every update it can.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jcxl._src import placement
from jcxl._src import pool as pool_lib
from jcxl._src import registry
from jcxl._src.host_update import lower
from jcxl._src.host_update.ir import HostUpdateNode
from jcxl._src.host_update.ir import UpdateChoice
from jcxl._src.host_update.ir import UpdatePath
from jcxl._src.pool_array import PoolArray
from jcxl._src.schedules import compute_estimate
from jcxl._src.schedules import costmodel
from jcxl._src.step_ir.program import Program
from jcxl._src.tier import Tier

# Elements of each array the host update's rate is measured on, and the
# pool of its own it is measured in (four arrays, and room to spare).
_CALIBRATION_ELEMENTS = 1 << 22
_CALIBRATION_POOL_BYTES = 5 * 4 * _CALIBRATION_ELEMENTS


@dataclasses.dataclass(frozen=True)
class Rates:
  """What `update='auto'` compares, in bytes per second."""
  host_update: float  # the host update's (bytes read and written)
  device_update: float  # the device's elementwise work (read + written)

  def describe(self) -> str:
    return (f"host update {self.host_update / 1e9:.1f} GB/s, device "
            f"{self.device_update / 1e9:.1f} GB/s")


def _seconds(nbytes: float, link: costmodel.Link) -> float:
  return nbytes / link.bandwidth + (link.latency_s if nbytes else 0.0)


def choose(nodes: tuple[HostUpdateNode, ...], update: str,
           link_of: Callable[[PoolArray], costmodel.Link],
           rates: Callable[[int], Rates]
           ) -> tuple[tuple[HostUpdateNode, ...], dict[str, UpdateChoice]]:
  """The updates that run on the host, and per layer where and why.

  With update='auto' an update runs on the host where moving its
  gradients out and updating on the host is predicted no slower than
  moving its state in and out and updating on the device; a layer one of
  whose updates stays on the device is reported as on the device.
  """
  chosen, why = [], {}
  for node in nodes:
    if update == "host":
      chosen.append(node)
      why.setdefault(node.layer, UpdateChoice(node.layer, UpdatePath.HOST,
                                              "update='host'"))
      continue
    link = link_of(node.target)
    r = rates(node.pool_id)
    device_s = (_seconds(node.device_link_bytes(), link) +
                (node.device_link_bytes() + node.link_bytes()) /
                r.device_update)
    host_s = (_seconds(node.link_bytes(), link) +
              node.host_bytes() / r.host_update)
    per = lambda b: f"{b / node.elements:.1f} B/param"
    detail = (f"host {per(node.link_bytes())} over the link + "
              f"{per(node.host_bytes())} on the host = "
              f"{host_s * 1e3:.3f} ms; device {per(node.device_link_bytes())}"
              f" over the link + its update = {device_s * 1e3:.3f} ms "
              f"(link {link.bandwidth / 1e9:.1f} GB/s, {r.describe()})")
    if host_s <= device_s:
      chosen.append(node)
      why.setdefault(node.layer,
                     UpdateChoice(node.layer, UpdatePath.HOST, detail))
    else:
      why[node.layer] = UpdateChoice(node.layer, UpdatePath.DEVICE, detail)
  return tuple(chosen), why


def with_device_reasons(choices: dict[str, UpdateChoice],
                        device_reasons: dict[str, str]
                        ) -> dict[str, UpdateChoice]:
  """Every layer's choice: `choices` (the layers with host updates, where
  they run), joined with why the other leaves of a layer stay on the
  device (`device_reasons`, by layer: see find.find)."""
  out = dict(choices)
  for layer, why in device_reasons.items():
    chosen = choices.get(layer)
    if chosen is None:
      out[layer] = UpdateChoice(layer, UpdatePath.DEVICE, why)
    elif chosen.path is UpdatePath.HOST:
      # Some of its leaves on the host, the others not (lamb's weights
      # take a device-computed update; its moments need a norm).
      out[layer] = UpdateChoice(
          layer, UpdatePath.MIXED,
          f"{chosen.reason}; the others on the device: {why}")
    else:  # 'auto' chose the device for the leaves it could run on the host
      out[layer] = UpdateChoice(
          layer, UpdatePath.DEVICE,
          f"{why}; the others by cost: {chosen.reason}")
  return out


def no_room(choices: dict[str, UpdateChoice]) -> dict[str, UpdateChoice]:
  """Every layer on the device: the pool had no room for the gradients'
  objects of the host updates 'auto' chose."""
  return {layer: UpdateChoice(layer, UpdatePath.DEVICE,
                              "the pool has no room for the host update's "
                              "gradients") for layer in choices}


@functools.lru_cache(maxsize=None)
def measured_rates(pool_id: int) -> Rates:
  """The host update's rate for pool `pool_id`, and the device's
  elementwise rate; measured once per pool.

  The host update's is an adam-like update's, lowered as a step's is and
  run on a pool of its own on the same memory (pool `pool_id`'s host
  tier's, else its cxl tier's) with as many update threads: the user's
  objects may fill that pool, and a step's planning must not need room in
  it.
  """
  pool = registry.find_pool(pool_id, what="a host update")
  tier = Tier.HOST if pool.stats()[Tier.HOST].enabled else Tier.CXL
  capacities = {t.value: 0 for t in Tier}
  capacities[tier.value] = _CALIBRATION_POOL_BYTES
  with pool_lib.Pool(**capacities, topology=pool.topology, node=pool.node,
                     update_threads=pool.updates.stats().threads
                     ) as scratch:
    seconds = _update_seconds(scratch, tier)
  _, elements_per_s = compute_estimate.device_rates()
  return Rates(host_update=28 * _CALIBRATION_ELEMENTS / seconds,
               device_update=8 * elements_per_s)


def _adam_like(p, m, v, g):
  """The update the host's rate is measured on: adam's arithmetic, 16
  bytes read and 12 written per element."""
  m = 0.9 * m + 0.1 * g
  v = v + 0.1 * (g * g)
  return p - 1e-3 * (m / jnp.sqrt(v)), m, v


def _update_seconds(pool: Any, tier: Tier) -> float:
  """The median of three runs of `_adam_like`, lowered as a step's host
  update is, on four arrays of `_CALIBRATION_ELEMENTS` in `pool`'s
  `tier`."""
  n = _CALIBRATION_ELEMENTS
  x = jax.ShapeDtypeStruct((n,), np.float32)
  program = Program(jax.make_jaxpr(_adam_like)(x, x, x, x), 4)
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  arrays = []
  try:
    for j in range(4):
      arrays.append(placement.store_shards(
          None, pool=pool, tier=tier, sharding=sharding, shape=(n,),
          dtype=np.float32, path=f"calibration {j}",
          make_object=lambda device: pool.allocate((n,), np.float32, tier)))
    *state, g = arrays
    node = HostUpdateNode(
        nodes=tuple(program.nodes), grads=(("in", 3),),
        reads={("in", j): a for j, a in enumerate(state)},
        writes=dict(zip(program.outputs, state)), pool_id=pool.id)
    node = dataclasses.replace(node, lowered=lower.lower(node, program))
    program_id = pool.updates.register(lower.for_device(
        node, None, {("in", 3): g.local_handles[0][1]}, {}))
    try:
      times = []
      for _ in range(3):
        started = time.perf_counter()
        pool.updates.run(program_id, []).wait()
        times.append(time.perf_counter() - started)
    finally:
      pool.updates.release(program_id)
  finally:
    for a in arrays:
      for _, handle in a.local_handles:
        pool.free(handle)
  return sorted(times)[1]
