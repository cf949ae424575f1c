"""A step's host updates at run time: the pool objects their gradients
are stored into, their weight copies and their registered programs, made
once per structure and reused by each of the step's compiles, and freed
with the step once its calls are over.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any

import numpy as np

from jcxl._src import dispatched
from jcxl._src import placement
from jcxl._src import pool_array as pool_array_lib
from jcxl._src import registry
from jcxl._src.errors import PoolExhaustedError
from jcxl._src.host_update import lower
from jcxl._src.host_update.ir import HostUpdateNode
from jcxl._src.tier import Tier
from jcxl._src.pool_array import PoolArray

logger = logging.getLogger(__name__)


class HostUpdates:
  """The gradients' pool objects and the registered programs of one
  step's host updates, by what they update (a re-plan of the same step
  reuses them), freed with the step."""

  def __init__(self):
    # lower.structure(node) -> (gradient objects, copies, programs)
    self._made: dict[Any, tuple[dict[int, PoolArray], dict[Any, PoolArray],
                                tuple[tuple[int, int], ...]]] = {}
    # The results of the step's calls that may still run: they use the
    # objects, which are freed only once those calls are over.
    self._running: list[Any] = []
    self._finalizer = weakref.finalize(self, _dropped.append,
                                       (self._made, self._running))
    release_dropped()

  def dispatched(self, results: Any) -> None:
    """Notes a call of the step, by its results: the objects outlive it."""
    release_dropped()
    self._running[:] = [r for r in self._running
                        if not dispatched.wait_for_results(r, 0)]
    self._running.append(results)

  def bind(self, node: HostUpdateNode) -> HostUpdateNode:
    """`node` with its gradients' objects, its weight copies' objects and
    its registered programs, made once per structure (see
    lower.structure). A copy the pool has no room for is left out: that
    weight comes in as float32."""
    pool = registry.find_pool(node.pool_id, what="a host update's state")
    key = lower.structure(node)  # of the copies it could have
    made = self._made.get(key)
    if made is None:
      made = self._made[key] = _make(pool, node)
    staging, copies, programs = made
    return dataclasses.replace(
        node, program_id=programs[0][1],
        program_ids=(programs if len(programs) > 1 or
                     node.spans_processes() else ()),
        staging={k: staging[j] for j, k in enumerate(node.grads)},
        copies=tuple(dataclasses.replace(c, copy=copies[c.source])
                     for c in node.copies if c.source in copies))

  def close(self) -> None:
    if self._finalizer.detach():
      _release(self._made, self._running)


def _make(pool: Any, node: HostUpdateNode
          ) -> tuple[dict[int, PoolArray], dict[Any, PoolArray],
                     tuple[tuple[int, int], ...]]:
  """A host update's gradient objects, weight copies (by master key) and
  registered programs, one per device of this process (device id,
  program); everything made is freed if a part fails."""
  staging, copies, programs = {}, {}, []
  try:
    for j, k in enumerate(node.grads):
      staging[j] = _staging(pool, node, k)
    for c in node.copies:
      try:
        copies[c.source] = _copy(pool, c)
      except PoolExhaustedError:
        pass  # that weight comes in as float32
    kept = dataclasses.replace(node, copies=tuple(
        c for c in node.copies if c.source in copies))
    for device, _ in node.target.local_handles:
      programs.append((device, pool.updates.register(lower.for_device(
          kept, device,
          {k: dict(staging[j].local_handles)[device]
           for j, k in enumerate(node.grads)},
          {k: dict(x.local_handles)[device] for k, x in copies.items()}))))
  except BaseException:
    for _, program_id in programs:
      pool.updates.release(program_id)
    for x in list(staging.values()) + list(copies.values()):
      for _, handle in x.local_handles:
        pool.free(handle)
    raise
  return staging, copies, tuple(programs)


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
  target = node.target
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


def bind_planned(node: HostUpdateNode) -> HostUpdateNode:
  """`node` with stand-ins for its gradients' and copies' objects, where a
  step is only planned (nothing is made)."""
  staging = {}
  for key in node.grads:
    aval = key[1].aval
    staging[key] = _virtual(node.target, aval.shape, aval.dtype, "gradient")
  return dataclasses.replace(node, staging=staging, copies=tuple(
      dataclasses.replace(c, copy=_virtual(c.target, c.target.shape, c.dtype,
                                           f"{c.dtype} copy"))
      for c in node.copies))


def _virtual(target: PoolArray, shape: Any, dtype: Any, what: str
             ) -> PoolArray:
  return PoolArray(np.full((1,), -1, np.int32), pool_id=-1, shape=shape,
                   dtype=dtype, sharding=target.sharding, tier=target.tier,
                   path=f"{target.path} ({what})", local_handles=((-1, -1),))


# How long freeing a dropped step's objects waits for its calls still
# running (each of their transfers has its pool's timeout_s).
_RELEASE_WAIT_S = 300.0


# The HostUpdates of steps that were collected, released at the next step
# made or called, not by the collector (a pool closed meanwhile took its
# objects with it): releasing waits for the step's calls still running and
# asks jax whether they are, and a finalizer may run inside any allocation
# of any thread, jax's own among them. (Releasing there later crashed the
# collector on a freed code object.)
_dropped: list[tuple[dict, list[Any]]] = []


def release_dropped() -> None:
  """Frees the objects and programs of the steps collected since the
  last call (see _dropped); safe from several threads at once."""
  while True:
    try:
      made, running = _dropped.pop()
    except IndexError:
      return
    _release(made, running)


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
