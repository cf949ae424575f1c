"""The pass that finds a step's host updates.

A traced train step updates each pool-resident leaf (a weight, its
optimizer moments) with elementwise work on its old value, its gradient and
a few scalars (the learning rate, bias corrections, a clipping scale). On
the device path that work runs in the step: the old state is fetched over
the device link and the new state stored back. This pass finds that work
instead (per leaf: the elementwise equations that read its old state and
feed only each other and the stores of its new state), and replaces it by
one node that stores the gradients out to the pool and runs the work on the
host CPU in place on the pool's objects (an ``UpdateProgram`` run by the
pool's C++ core: see ``ffi/update_program.h``). Only the gradients leave
the device; the weights come in when the next step fetches them.

The scalars stay on the device (they are reductions over every gradient,
as ``clip_by_global_norm``'s norm, or functions of the step count), and are
passed to each run: a run starts once its gradients are stored and its
scalars exist, and every fetch of the old state it overwrites is done.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from jcxl._src.host_update import lower as lower_lib
from jcxl._src.host_update.ir import HostUpdateNode
from jcxl._src.pool_array import PoolArray
from jcxl._src.step_ir.program import Lit
from jcxl._src.step_ir.program import Program
from jcxl._src.step_ir.program import layer_of
from jcxl._src.step_ir.regions import Uses
from jcxl._src.step_ir.regions import absorb
from jcxl._src.step_ir.regions import elementwise_shape
from jcxl._src.step_ir.regions import trim

# The dtypes a host update's state may be in.
_OBJECT_DTYPES = frozenset({"float32", "bfloat16"})


def transformation_of(program: Program, node: Any) -> str:
  """The optax transformation (or other function) a node was traced in,
  for messages: ``optax.scale_by_trust_ratio``, else ``file:line``. The
  calls it was inlined from are searched too (a jitted helper's equations
  carry only the helper's frames)."""
  eqns = [node.eqn]
  scope = node.outs[0][0] if node.outs else 0
  while scope in program.callers:
    scope, call = program.callers[scope]
    eqns.append(call)
  frames = []
  for eqn in eqns:
    traceback = getattr(getattr(eqn, "source_info", None), "traceback", None)
    if traceback is not None:
      frames += list(zip(*traceback.raw_frames()))
  for code, _ in frames:
    qualname = getattr(code, "co_qualname", code.co_name)
    if "/optax/" in code.co_filename and ".<locals>." in qualname:
      outer = qualname.split(".<locals>.")[0]
      if outer not in ("chain", "named_chain", "inject_hyperparams",
                       "masked", "with_extra_args_support"):
        return f"optax.{outer}"
  for code, _ in frames:  # a class's method (optax.MultiSteps.update)
    qualname = getattr(code, "co_qualname", code.co_name)
    if ("/optax/" in code.co_filename and "." in qualname and
        not qualname.startswith("_")):
      return f"optax.{qualname.split('.')[0]}"
  for code, _ in frames:
    if "/jax/" not in code.co_filename and "/jcxl/" not in code.co_filename:
      return f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno}"
  return "the step"


def find(program: Program, resident: dict[Any, Any],
         stores: dict[Any, PoolArray], key_paths: dict[Any, str],
         returned: set[Any], update: str
         ) -> tuple[tuple[HostUpdateNode, ...], dict[str, str]]:
  """Finds the updates of a step that can run on the host (see `insert`),
  each lowered once (see lower.lower).

  Args:
    returned: the program's outputs the step returns (not pool state).

  Returns:
    The host updates, and per layer that keeps (part of) its update on
    the device, why.

  Raises:
    ValueError: with update='host', a leaf whose update cannot run on the
      host (naming the leaf, the equation and its optax transformation).
  """
  pooled = {k: v for k, v in resident.items() if isinstance(v, PoolArray)}
  old_key = {id(v): k for k, v in pooled.items()}
  if update == "device":
    return (), {_layer(key_paths, t, old_key): "update='device'"
                for t in stores.values()}
  g = Uses(program)
  outputs = set(returned)

  def elementwise(n: int) -> bool:
    return elementwise_shape(program.nodes[n]) is not None

  # The work on pool state: elementwise equations reading it, or reading
  # such work's results.
  region: set[int] = set()
  for n in range(len(program.nodes)):
    if elementwise(n) and any(k in pooled or g.producer.get(k) in region
                              for k in g.ins(n) if not isinstance(k, Lit)):
      region.add(n)
  candidates = set(region)
  # Less what escapes: a result read by other work, or returned.
  # (A new value written back and also returned: the host update would
  # leave the step nothing to return.)
  blocked = trim(g, region, lambda n, key: key in outputs)

  # Take in the elementwise work that only feeds it and reads at most one
  # array from the device (a squared or clipped gradient, a gradient cast
  # to float32): the raw gradient then is what leaves the device.
  def one_array(n: int) -> bool:
    return len({k for k, v in zip(g.ins(n), program.nodes[n].eqn.invars)
                if not isinstance(k, Lit) and tuple(v.aval.shape)}) <= 1
  absorb(g, region, elementwise, outputs, one_array)

  components = _components(program, g, region, pooled, stores, old_key)
  nodes: list[HostUpdateNode] = []
  device_reasons: dict[str, str] = {}  # per layer
  refused: dict[Any, str] = {}  # per stored key of a refused component
  covered: set[Any] = set()  # stored keys a host update writes
  for members in components:
    node, why = _make_node(program, g, members, pooled, stores, old_key,
                           key_paths, outputs)
    if node is not None and update == "auto" and node.spans_processes():
      # Each process measures its own rates: they could choose apart,
      # and compile different steps.
      node, why = None, ("its state spans processes, where 'auto' would "
                         "choose in each from its own measured rates "
                         "(update='host' runs it on each one's shard)")
    if node is None:
      for key in _stored_by(program, members, stores):
        refused.setdefault(key, why)
      continue
    nodes.append(node)
    covered.update(node.writes)

  # Why each other written leaf stays on the device.
  for key, target in stores.items():
    layer = _layer(key_paths, target, old_key)
    if target.size <= 1:
      device_reasons.setdefault(layer, "a scalar (a step count): updated "
                                "in the step")
    if key in covered or target.size <= 1:
      continue
    why = refused.get(key) or _why_not(program, g, key, candidates, blocked)
    if key not in refused and _not_the_optimizers(program, g, key,
                                                  candidates):
      # 'host' means the optimizer's update: the rest of the state (a
      # dropout key split each step, metrics) is the step's own work.
      why = f"not an optimizer update: {why}"
      device_reasons.setdefault(layer, why)
      continue
    device_reasons[layer] = why  # (over a scalar's: this one matters)
    if update == "host":
      raise ValueError(
          f"update='host' cannot run the update of "
          f"{key_paths.get(old_key.get(id(target)), target.path)} on the "
          f"host: {why}. Use update='auto' (such layers are updated on "
          "the device) or update='device'")
  return tuple(nodes), device_reasons


def _layer(key_paths, target, old_key) -> str:
  return layer_of(key_paths.get(old_key.get(id(target)), target.path))


def _stored_by(program: Program, members: set[int],
               stores: dict[Any, PoolArray]) -> list[Any]:
  return [k for n in members for k in program.nodes[n].outs if k in stores]


def _why_not(program: Program, g: Uses, key: Any, candidates: set[int],
             blocked: dict[int, int]) -> str:
  """Why a stored value is not computed by a host update."""
  n = g.producer.get(key)
  if n is None or n not in candidates:
    eqn = program.nodes[n].eqn if n is not None else None
    name = eqn.primitive.name if eqn is not None else "an input"
    where = (f" in {transformation_of(program, program.nodes[n])}"
             if eqn is not None else "")
    return (f"its new value comes from {name}{where}, not from "
            "elementwise work on its old value")
  # Follow what left it out back to the equation outside.
  seen = set()
  while n in blocked and n not in seen:
    seen.add(n)
    c = blocked[n]
    if c < 0:
      return "a value its update computes is also returned by the step"
    if c not in candidates:
      eqn = program.nodes[c].eqn
      name = eqn.primitive.name if eqn is not None else "a loop"
      where = (f" in {transformation_of(program, program.nodes[c])}"
               if eqn is not None else "")
      return (f"its update feeds {name}{where}, which is not elementwise "
              "(it reads the whole leaf, e.g. a norm)")
    n = c
  return "its update's work is not elementwise on the leaf"


def _not_the_optimizers(program: Program, g: Uses, key: Any,
                        candidates: set[int]) -> bool:
  """Whether a stored value is no optimizer's update: it is not made by
  elementwise work on pool state, and not by optax (a key split, a count
  of the step's own)."""
  n = g.producer.get(key)
  if n is None or n in candidates:
    return False
  return not transformation_of(program, program.nodes[n]).startswith(
      "optax.")


def _components(program: Program, g: Uses, region: set[int],
                pooled: dict[Any, PoolArray], stores: dict[Any, PoolArray],
                old_key: dict[int, Any]) -> list[set[int]]:
  """The region split into independent updates: nodes joined where one
  reads another's result, both read the same pool value, or one writes
  what the other reads."""
  parent = {n: n for n in region}

  def root(n):
    while parent[n] != n:
      parent[n] = parent[parent[n]]
      n = parent[n]
    return n

  def join(a, b):
    parent[root(a)] = root(b)

  by_state: dict[Any, int] = {}
  for n in sorted(region):
    for k, v in zip(g.ins(n), program.nodes[n].eqn.invars):
      if isinstance(k, Lit):
        continue
      m = g.producer.get(k)
      if m in region:
        join(n, m)
      if tuple(v.aval.shape) and (k in pooled or m not in region):
        # The same state, or the same gradient: one update reads it. (A
        # scalar, of the pool too, is an argument each update gets.)
        by_state.setdefault(k, n)
        join(n, by_state[k])
    for k in program.nodes[n].outs:
      if k in stores and id(stores[k]) in old_key:
        old = old_key[id(stores[k])]
        by_state.setdefault(old, n)
        join(n, by_state[old])
  groups = collections.defaultdict(set)
  for n in region:
    groups[root(n)].add(n)
  return sorted(groups.values(), key=min)


def _make_node(program: Program, g: Uses, members: set[int],
               pooled: dict[Any, PoolArray], stores: dict[Any, PoolArray],
               old_key: dict[int, Any], key_paths: dict[Any, str],
               outputs: set[Any]) -> tuple[HostUpdateNode | None, str]:
  """The host update of one component, or None and why not."""
  writes = {k: stores[k] for n in members for k in program.nodes[n].outs
            if k in stores}
  if not writes:
    return None, "its update writes no pool state"
  for n in sorted(members):
    eqn = program.nodes[n].eqn
    name = eqn.primitive.name
    where = lambda n=n: transformation_of(program, program.nodes[n])
    if name != "broadcast_in_dim" and name not in lower_lib.OPS:
      return None, (f"its update computes {name} (in {where()}), which "
                    "the host update does not run")
    for v in list(eqn.invars) + list(eqn.outvars):
      if str(np.dtype(v.aval.dtype)) not in lower_lib.DTYPES:
        return None, (f"its update computes in {v.aval.dtype} (in "
                      f"{where()}); the host update runs float32, bfloat16 "
                      "and bool")
    if name == "select_n" and len(eqn.invars) != 3:
      return None, "its update selects among more than two values"
  produced = {k for n in members for k in program.nodes[n].outs}
  path = lambda t: key_paths.get(old_key.get(id(t)), t.path)
  reads, grads, scalars = {}, [], []
  for n in sorted(members):
    for k, v in zip(g.ins(n), program.nodes[n].eqn.invars):
      if isinstance(k, Lit) or k in produced or k in program.consts:
        continue
      if k in pooled and tuple(v.aval.shape):
        reads[k] = pooled[k]
      elif not tuple(v.aval.shape):  # a pool scalar too: fetched, passed
        if k not in scalars:
          scalars.append(k)
      elif k not in grads:
        if k[0] == "in":
          return None, ("its update reads a step argument of the leaf's "
                        "shape that is not in the pool")
        if k in stores:
          # The device computes it and writes it back: the update would
          # read a second copy of it, and its store would be lost.
          return None, (
              f"its update reads the new value of {path(stores[k])}, "
              f"which the device computes (in {_where(program, g, k)})")
        grads.append(k)
  written_elsewhere = {id(t) for k, t in stores.items() if k not in writes}
  for k, t in reads.items():
    if id(t) in written_elsewhere:
      # The device's store of its new value could overtake the host's read.
      return None, (f"its update reads {path(t)}, whose new value the "
                    "device computes")
  for k in program.consts:
    if any(k in g.ins(n) for n in members) and np.ndim(program.consts[k]):
      return None, "its update reads an array constant"
  targets = list(reads.values()) + list(writes.values())
  pools = {t.pool_id for t in targets}
  for t in targets:
    # Where it spans processes, each device's shards are updated by a
    # program of their own (see interpreter): its leaves' shards must
    # line up.
    devices = t.sharding.device_set
    processes = len({d.process_index for d in devices})
    if len(devices) != 1 and processes == 1:
      return None, (f"its state is sharded over {len(devices)} devices "
                    "(the host update runs unsharded state, or state "
                    "that spans processes)")
    if processes > 1 and not t.sharding.is_equivalent_to(
        targets[0].sharding, len(t.shape)):
      return None, (f"its leaves are laid out differently ({path(t)} is "
                    f"not as {path(targets[0])})")
    if tuple(t.object_shard_shape) != tuple(t.shard_shape):
      return None, "its state is a view of a larger pool object"
    if str(t.dtype) not in _OBJECT_DTYPES:
      return None, (f"its state is {t.dtype} (host updates run float32, "
                    "bfloat16)")
  if len(pools) != 1:
    return None, "its state spans pools"
  elements = targets[0].size
  for k in grads:
    if int(np.prod(k[1].aval.shape)) != elements:
      return None, "its update reads a device array of another size"
  for t in targets:
    if t.size != elements:
      return None, (f"its update reads {path(t)} ({t.size} elements) "
                    f"with a leaf of {elements}")
  # What it overwrites: the old values of what it writes.
  overwritten = [old_key[id(t)] for t in writes.values() if id(t) in old_key]
  last = max(members)
  for old in overwritten + list(reads):
    late = [c for c in g.consumers.get(old, ()) if c not in members and
            c > last]
    if old in outputs:
      return None, "its old value is also returned by the step"
    if late:
      last = max(last, max(late))
  any_write = next(iter(writes.values()))
  layer = _layer(key_paths, any_write, old_key)
  node = HostUpdateNode(
      ins=tuple(grads + scalars),
      nodes=tuple(program.nodes[n] for n in sorted(members)),
      grads=tuple(grads), scalars=tuple(scalars), reads=reads, writes=writes,
      overwritten=tuple(sorted(set(overwritten) | set(reads), key=str)),
      layer=layer, pool_id=pools.pop(), position=last)
  try:  # lowered once, with stand-ins for the objects made later
    lowered = lower_lib.lower(node, program)
  except lower_lib.NotOnHost as e:
    return None, str(e)
  except ValueError as e:
    return None, f"the host cannot run its program ({e})"
  return dataclasses.replace(node, lowered=lowered), ""


def _where(program: Program, g: Uses, key: Any) -> str:
  n = g.producer.get(key)
  return ("the step" if n is None or program.nodes[n].eqn is None else
          transformation_of(program, program.nodes[n]))


def insert(program: Program, nodes: tuple[HostUpdateNode, ...]) -> None:
  """Replaces each update's equations in `program` by the update, at the
  place of the last of them (or of the last device read of the state it
  overwrites)."""
  at = collections.defaultdict(list)
  removed = set()
  index = {id(n): i for i, n in enumerate(program.nodes)}
  for node in nodes:
    at[node.position].append(node)
    removed.update(index[id(n)] for n in node.nodes)
  out = []
  for i, n in enumerate(program.nodes):
    if i not in removed:
      out.append(n)
    out.extend(at.get(i, ()))
  program.nodes = out
