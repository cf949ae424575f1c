"""What a step's host updates need at run time: the pool objects their
gradients are stored into and their registered programs (made once per
step and reused by each of its compiles), and `update='auto'`'s choice of
path per update from measured rates.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import weakref
from typing import Any, Callable

import numpy as np

from jcxl._src import dispatched
from jcxl._src import placement
from jcxl._src import pool_array as pool_array_lib
from jcxl._src import pool as pool_lib
from jcxl._src import registry
from jcxl._src import update_program as up
from jcxl._src.schedules import compute_estimate
from jcxl._src.schedules import costmodel
from jcxl._src.offload import host_update
from jcxl._src.offload.host_update import HostUpdateNode
from jcxl._src.offload.program import Program
from jcxl._src.errors import PoolExhaustedError
from jcxl._src.pool import Tier
from jcxl._src.pool_array import PoolArray
from jcxl._src.units import format_bytes

logger = logging.getLogger(__name__)

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


def choose(nodes: list[HostUpdateNode], update: str,
           link_of: Callable[[PoolArray], costmodel.Link],
           rates: Callable[[int], Rates]
           ) -> tuple[list[HostUpdateNode], dict[str, str]]:
  """The updates that run on the host, and per layer why its path.

  With update='auto' an update runs on the host where moving its
  gradients out and updating on the host is predicted no slower than
  moving its state in and out and updating on the device.
  """
  chosen, why = [], {}
  for node in nodes:
    if update == "host":
      chosen.append(node)
      why.setdefault(node.layer, "host: update='host'")
      continue
    link = link_of(next(iter(node.writes.values())))
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
      why.setdefault(node.layer, f"host: {detail}")
    else:
      why[node.layer] = f"device: {detail}"
  return chosen, why


class HostUpdates:
  """The gradients' pool objects and the registered programs of one
  step's host updates, by what they update (a re-plan of the same step
  reuses them), freed with the step."""

  def __init__(self):
    self._made: dict[Any, tuple[dict[int, PoolArray], int]] = {}
    # The results of the step's calls that may still run: they use the
    # objects, which are freed only once those calls are over.
    self._running: list[Any] = []
    self._finalizer = weakref.finalize(self, _release, self._made,
                                       self._running)

  def dispatched(self, results: Any) -> None:
    """Notes a call of the step, by its results: the objects outlive it."""
    self._running[:] = [r for r in self._running
                        if not dispatched.wait_for_results(r, 0)]
    self._running.append(results)

  def bind(self, node: HostUpdateNode, program: Program) -> None:
    """Gives `node` its gradients' objects, its weight copies' objects and
    its program's id. A copy the pool has no room for is left out: that
    weight comes in as float32."""
    pool = registry.find_pool(node.pool_id, what="a host update's state")
    key = _key(node, program)  # of the copies it could have
    made = self._made.get(key)
    if made is None:
      made = self._made[key] = _make(pool, node, program)
    staging, copies, programs = made
    node.program_id = programs[0][1]
    node.program_ids = programs if len(programs) > 1 or _spans(node) else ()
    node.staging = {k: staging[j] for j, k in enumerate(node.grads)}
    node.copies = [c for c in node.copies if c.source in copies]
    for c in node.copies:
      c.copy = copies[c.source]

  def close(self) -> None:
    self._finalizer()


def _key(node: HostUpdateNode, program: Program) -> Any:
  """What a host update's objects and program are made for: its pool,
  its program (with stand-ins for its objects) and its gradients."""
  return (node.pool_id, repr(host_update.compile_program(
      node, program, {k: -1 for k in node.grads},
      {c.source: -1 for c in node.copies})),
          tuple((tuple(k[1].aval.shape), str(k[1].aval.dtype))
                for k in node.grads))


def _make(pool: Any, node: HostUpdateNode, program: Program
          ) -> tuple[dict[int, PoolArray], dict[Any, PoolArray],
                     tuple[tuple[int, int], ...]]:
  """A host update's gradient objects, weight copies (by master key) and
  registered programs, one per device of this process (device id,
  program); everything made is freed if a part fails."""
  staging, copies, programs = {}, {}, []
  try:
    for j, k in enumerate(node.grads):
      staging[j] = _staging(pool, node, k)
    for c in list(node.copies):
      try:
        c.copy = copies[c.source] = _copy(pool, c)
      except PoolExhaustedError:
        node.copies.remove(c)
    for device, _ in next(iter(node.writes.values())).local_handles:
      programs.append((device, pool.updates.register(
          host_update.compile_program(
              node, program, {k: dict(staging[j].local_handles)[device]
                              for j, k in enumerate(node.grads)},
              {k: dict(x.local_handles)[device] for k, x in copies.items()},
              device=device))))
  except BaseException:
    for _, program_id in programs:
      pool.updates.release(program_id)
    for x in list(staging.values()) + list(copies.values()):
      for _, handle in x.local_handles:
        pool.free(handle)
    raise
  return staging, copies, tuple(programs)


def _spans(node: HostUpdateNode) -> bool:
  devices = next(iter(node.writes.values())).sharding.device_set
  return len({d.process_index for d in devices}) > 1


def _copy(pool: Any, c: Any) -> PoolArray:
  """A copy the pool keeps of master weight `c.target`, in `c.dtype`."""
  t = c.target
  return _handles_baked(placement.store_shards(
      None, pool=pool, tier=t.tier, sharding=t.sharding, shape=t.shape,
      dtype=c.dtype, path=f"{t.path} ({c.dtype} copy)",
      make_object=lambda device: pool.allocate_copy(
          t.local_handles[0][1], c.dtype)))


def _staging(pool: Any, node: HostUpdateNode, key: Any) -> PoolArray:
  """A pool object for one gradient, in the tier of the state it updates:
  the gradient crosses the same link the state would. (Of nvme state, in
  a memory tier: the update stages the state through memory anyway.)"""
  target = next(iter(node.writes.values()))
  tier = target.tier
  if tier == Tier.NVME:
    tier = Tier.HOST if pool.stats()[Tier.HOST].enabled else Tier.CXL
  aval = key[1].aval
  # One device's shard (the whole array but where it spans processes).
  shard = tuple(target.sharding.shard_shape(tuple(aval.shape)))
  return _handles_baked(placement.store_shards(
      None, pool=pool, tier=tier, sharding=target.sharding,
      shape=tuple(aval.shape), dtype=aval.dtype,
      path=f"{target.path} (gradient)",
      make_object=lambda device: pool.allocate(shard, aval.dtype, tier)))


def _handles_baked(x: PoolArray) -> PoolArray:
  """`x` with its handles as this process's constant where it spans
  processes: the step closes over them (they are no argument of its),
  and JAX closes over no array it does not hold whole. Other processes'
  positions hold -1: only this process's devices read theirs."""
  if x.handles.is_fully_addressable:
    return x
  local = dict(x.local_handles)
  grid, _ = pool_array_lib.device_grid(x.sharding)
  x.handles = np.array([local.get(d.id, -1) for d in grid.flat],
                       np.int32).reshape(grid.shape)
  return x


def virtual_staging(node: HostUpdateNode, key: Any) -> PoolArray:
  """A stand-in for a gradient's object where a step is only planned."""
  target = next(iter(node.writes.values()))
  aval = key[1].aval
  return _virtual(target, aval.shape, aval.dtype, "gradient")


def virtual_copies(node: HostUpdateNode) -> None:
  """Stand-ins for a planned step's weight copies."""
  for c in node.copies:
    c.copy = _virtual(c.target, c.target.shape, c.dtype, f"{c.dtype} copy")


def _virtual(target: PoolArray, shape: Any, dtype: Any, what: str
             ) -> PoolArray:
  return PoolArray(np.full((1,), -1, np.int32), pool_id=-1, shape=shape,
                   dtype=dtype, sharding=target.sharding, tier=target.tier,
                   path=f"{target.path} ({what})", local_handles=((-1, -1),))


# How long freeing a dropped step's objects waits for its calls still
# running (each of their transfers has its pool's timeout_s).
_RELEASE_WAIT_S = 300.0


def _release(made: dict, running: list[Any]) -> None:
  if made and not dispatched.wait_for_results(running, _RELEASE_WAIT_S):
    logger.warning("jcxl: a dropped step's call still ran after %g s; "
                   "its host updates' objects are freed under it",
                   _RELEASE_WAIT_S)
  running.clear()
  for (pool_id, *_), (staging, copies, programs) in made.items():
    pool = next((p for p in registry.open_pools() if p.id == pool_id), None)
    if pool is None:
      continue  # closed: its objects and programs went with it
    for _, program_id in programs:
      pool.updates.release(program_id)
    for x in list(staging.values()) + list(copies.values()):
      for _, handle in x.local_handles:
        pool.free(handle)
  made.clear()


@functools.lru_cache(maxsize=None)
def measured_rates(pool_id: int) -> Rates:
  """The host update's rate for pool `pool_id`, and the device's
  elementwise rate; measured once per pool.

  The host update's is an adam-like program's, run on a pool of its own
  on the same memory (pool `pool_id`'s host tier's, else its cxl tier's)
  with as many update threads: the user's objects may fill that pool, and
  a step's planning must not need room in it.
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


def _update_seconds(pool: Any, tier: Tier) -> float:
  """The median of three runs of an adam-like program on four arrays of
  `_CALIBRATION_ELEMENTS` in `pool`'s `tier`."""
  n = _CALIBRATION_ELEMENTS
  handles = []
  try:
    for _ in range(4):
      handles.append(pool.allocate((n,), np.float32, tier))
    p, m, v, g = handles
    obj = lambda h: up.Input(kind=up.InputKind.OBJECT, handle=h)
    const = lambda c: up.Input(kind=up.InputKind.CONSTANT, constant=c)
    ins = [obj(p), obj(m), obj(v), obj(g), const(0.9), const(0.1),
           const(1e-3)]
    I = lambda op, a, b: up.Instr(op=op, a=a, b=b)
    code = [I(up.UpdateOp.MUL, 4, 1), I(up.UpdateOp.MUL, 5, 3),   # 7, 8
            I(up.UpdateOp.ADD, 7, 8), I(up.UpdateOp.MUL, 3, 3),   # 9, 10
            I(up.UpdateOp.MUL, 10, 5), I(up.UpdateOp.ADD, 2, 11),  # 11, 12
            I(up.UpdateOp.SQRT, 12, -1), I(up.UpdateOp.DIV, 9, 13),  # 13, 14
            I(up.UpdateOp.MUL, 14, 6), I(up.UpdateOp.SUB, 0, 15)]  # 15, 16
    program = up.Program(num_elements=n, num_scalars=0, inputs=ins,
                         code=code, outputs=[up.Output(reg=16, handle=p),
                                             up.Output(reg=9, handle=m),
                                             up.Output(reg=12, handle=v)])
    program_id = pool.updates.register(program)
    try:
      times = []
      for _ in range(3):
        started = time.perf_counter()
        pool.updates.run(program_id, []).wait()
        times.append(time.perf_counter() - started)
    finally:
      pool.updates.release(program_id)
  finally:
    for h in handles:
      pool.free(h)
  return sorted(times)[1]


def traffic_line(nodes: list[HostUpdateNode]) -> str:
  """What the host updates move, for the plan."""
  link = sum(n.link_bytes() for n in nodes)
  host = sum(n.host_bytes() for n in nodes)
  return (f"host updates: {len(nodes)}, gradients out "
          f"{format_bytes(link)}, updated in the pool "
          f"{format_bytes(host)} a step")
