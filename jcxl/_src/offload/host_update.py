"""The near-memory optimizer update (``cxl_offload(update='host'|'auto')``).

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

from jcxl._src import update_program as up
from jcxl._src.offload.program import Lit
from jcxl._src.offload.program import Node
from jcxl._src.offload.program import Program
from jcxl._src.offload.program import layer_of
from jcxl._src.offload.regions import Uses
from jcxl._src.offload.regions import absorb
from jcxl._src.offload.regions import elementwise_shape
from jcxl._src.offload.regions import trim
from jcxl._src.pool import Tier
from jcxl._src.pool_array import PoolArray

UPDATE_MODES = ("device", "host", "auto")

# JAX primitive -> the host program's operation.
_OPS = {
    "add": up.UpdateOp.ADD, "sub": up.UpdateOp.SUB, "mul": up.UpdateOp.MUL,
    "div": up.UpdateOp.DIV, "max": up.UpdateOp.MAX, "min": up.UpdateOp.MIN,
    "neg": up.UpdateOp.NEG, "abs": up.UpdateOp.ABS, "sign": up.UpdateOp.SIGN,
    "sqrt": up.UpdateOp.SQRT, "rsqrt": up.UpdateOp.RSQRT,
    "square": up.UpdateOp.SQUARE, "integer_pow": up.UpdateOp.INTEGER_POW,
    "select_n": up.UpdateOp.SELECT, "clamp": up.UpdateOp.CLAMP,
    "eq": up.UpdateOp.EQ, "ne": up.UpdateOp.NE, "lt": up.UpdateOp.LT,
    "le": up.UpdateOp.LE, "gt": up.UpdateOp.GT, "ge": up.UpdateOp.GE,
    "and": up.UpdateOp.AND, "or": up.UpdateOp.OR, "not": up.UpdateOp.NOT,
    "convert_element_type": up.UpdateOp.CONVERT, "copy": up.UpdateOp.COPY,
    "copy_p": up.UpdateOp.COPY,
}
_DTYPES = {"float32": up.UpdateDType.F32, "bfloat16": up.UpdateDType.BF16,
           "bool": up.UpdateDType.BOOL}
_OBJECT_DTYPES = frozenset({"float32", "bfloat16"})


def check_mode(update: str) -> str:
  if update not in UPDATE_MODES:
    raise ValueError(
        f"update must be one of {', '.join(map(repr, UPDATE_MODES))}, "
        f"not {update!r}")
  return update


@dataclasses.dataclass(eq=False)
class HostUpdateNode(Node):
  """One host update: stores `grads` out, then runs `code` on the pool.

  `ins` are the device values it needs (gradients, then scalars); it has
  no outputs: what it computes is written into the pool in place.
  """
  nodes: list[Node] = dataclasses.field(default_factory=list)
  grads: list[Any] = dataclasses.field(default_factory=list)
  scalars: list[Any] = dataclasses.field(default_factory=list)
  reads: dict[Any, PoolArray] = dataclasses.field(default_factory=dict)
  writes: dict[Any, PoolArray] = dataclasses.field(default_factory=dict)
  overwritten: list[Any] = dataclasses.field(default_factory=list)
  layer: str = ""
  # Filled in by `HostUpdates.bind` once the gradients' objects exist.
  staging: dict[Any, PoolArray] = dataclasses.field(default_factory=dict)
  program_id: int = -1
  # Where its state spans processes: (device id, program) per device of
  # this process, each over that device's shards.
  program_ids: tuple[tuple[int, int], ...] = ()
  pool_id: int = -1
  position: int = -1  # the program node it goes after (see _insert)
  region: list[Node] = dataclasses.field(default_factory=list)  # none on
  # the device: the compute estimate charges this node nothing
  # bfloat16 copies of the weights it writes (weight_copies.WeightCopy),
  # which the step fetches in place of the masters.
  copies: list[Any] = dataclasses.field(default_factory=list)

  @property
  def elements(self) -> int:
    """Elements of the shard it updates: a process's only shard where
    the state spans processes (one device each), else the whole array."""
    return int(np.prod(next(iter(self.writes.values())).shard_shape))

  def link_bytes(self) -> int:
    """Bytes that cross the device link: the gradients out."""
    return sum(_nbytes(k) for k in self.grads)

  def host_bytes(self) -> int:
    """Bytes the host update reads and writes in the pool."""
    return (sum(x.nbytes for x in self.reads.values()) +
            sum(x.nbytes for x in self.writes.values()) +
            sum(c.copy.nbytes for c in self.copies if c.copy is not None) +
            self.link_bytes())

  def device_link_bytes(self) -> int:
    """What the device path would move for this update instead: the old
    state in, the new state out."""
    return (sum(x.nbytes for x in self.reads.values()) +
            sum(x.nbytes for x in self.writes.values()))


def _nbytes(key: Any) -> int:
  aval = key[1].aval
  return int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Choice:
  """Where one layer's update runs, and why (a line of ``step.plan``)."""
  layer: str
  path: str  # "host" or "device"
  reason: str

  def __str__(self) -> str:
    return f"{self.layer}: {self.path} ({self.reason})"


def transformation_of(program: Program, node: Node) -> str:
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
         ) -> tuple[list[HostUpdateNode], dict[str, str]]:
  """Finds the updates of a step that can run on the host (see `apply`).

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
    return [], {_layer(key_paths, t, old_key): "update='device'"
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
    if node is not None and update == "auto" and _spans_processes(node):
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
  return nodes, device_reasons


def apply(program: Program, stores: dict[Any, PoolArray],
          nodes: list[HostUpdateNode]) -> None:
  """Puts the chosen host updates into `program`, each in place of its
  equations, and takes their stores out of `stores`."""
  _insert(program, nodes)
  for node in nodes:
    for key in node.writes:
      del stores[key]


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


def _spans_processes(node: HostUpdateNode) -> bool:
  devices = next(iter(node.writes.values())).sharding.device_set
  return len({d.process_index for d in devices}) > 1


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
    if name != "broadcast_in_dim" and name not in _OPS:
      return None, (f"its update computes {name} (in "
                    f"{transformation_of(program, program.nodes[n])}), which the host update "
                    "does not run")
    for v in list(eqn.invars) + list(eqn.outvars):
      if str(np.dtype(v.aval.dtype)) not in _DTYPES:
        return None, (f"its update computes in {v.aval.dtype} (in "
                      f"{transformation_of(program, program.nodes[n])}); the host update runs "
                      "float32, bfloat16 and bool")
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
      return None, f"its state is {t.dtype} (host updates run float32, bfloat16)"
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
      eqn=None, ins=grads + scalars, outs=[],
      nodes=[program.nodes[n] for n in sorted(members)], grads=grads,
      scalars=scalars, reads=reads, writes=writes,
      overwritten=sorted(set(overwritten) | set(reads), key=str),
      layer=layer, pool_id=pools.pop(), position=last)
  try:  # with stand-ins for the gradients' objects, made later
    stand_in = compile_program(node, program, {k: -1 for k in grads})
    # What the pool would refuse to register (too many registers, ...),
    # refused here: 'auto' then keeps the update on the device.
    dataclasses.replace(stand_in, outputs=[
        up.Output(reg=o.reg, handle=j)
        for j, o in enumerate(stand_in.outputs)]).validate()
  except _NotOnHost as e:
    return None, str(e)
  except ValueError as e:
    return None, f"the host cannot run its program ({e})"
  return node, ""


def _where(program: Program, g: Uses, key: Any) -> str:
  n = g.producer.get(key)
  return ("the step" if n is None or program.nodes[n].eqn is None else
          transformation_of(program, program.nodes[n]))


def _insert(program: Program, nodes: list[HostUpdateNode]) -> None:
  """Replaces each update's equations by the update, at the place of the
  last of them (or of the last device read of the state it overwrites)."""
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


class _NotOnHost(ValueError):
  pass


def compile_program(node: HostUpdateNode, program: Program,
                    grad_handles: dict[Any, int],
                    copy_handles: dict[Any, int] | None = None,
                    device: int | None = None) -> up.Program:
  """The node's equations as a host program over its objects, the
  gradients read from the objects `grad_handles` names, and the new
  weights also written into the copies `copy_handles` names (by master
  key; see weight_copies); over device `device`'s shards (by id), or
  this process's first."""
  inputs: list[up.Input] = []
  reg: dict[Any, int] = {}
  scalar_regs: set[int] = set()

  def handle(x: PoolArray) -> int:
    return dict(x.local_handles)[device] if device is not None else (
        x.local_handles[0][1])

  for key, x in node.reads.items():
    reg[key] = len(inputs)
    inputs.append(up.Input.object(handle(x)))
  for key in node.grads:
    reg[key] = len(inputs)
    inputs.append(up.Input.object(grad_handles[key]))
  for j, key in enumerate(node.scalars):
    reg[key] = len(inputs)
    scalar_regs.add(len(inputs))
    inputs.append(up.Input.scalar(j))
  constants: dict[float, int] = {}

  def operand(atom: Any) -> int:
    key = program.resolve(atom)
    if isinstance(key, Lit) or key in program.consts:
      value = key.value if isinstance(key, Lit) else program.consts[key]
      value = float(np.asarray(value, np.float32))
      if value not in constants:
        constants[value] = len(inputs)
        scalar_regs.add(len(inputs))
        inputs.append(up.Input.const(value))
      return constants[value]
    return reg[key]

  # Constants are inputs too: collect them before the code is numbered.
  for n in node.nodes:
    for atom in n.ins:
      key = program.resolve(atom)
      if isinstance(key, Lit) or key in program.consts:
        operand(atom)
  code: list[up.Instr] = []
  for n in node.nodes:
    eqn = n.eqn
    name = eqn.primitive.name
    args = [operand(a) for a in n.ins]
    out_key = n.outs[0]
    dtype = _DTYPES[str(np.dtype(eqn.outvars[0].aval.dtype))]
    in_dtype = str(np.dtype(eqn.invars[0].aval.dtype))
    if name == "broadcast_in_dim" or name in ("copy", "copy_p") or (
        name == "convert_element_type" and
        in_dtype == str(np.dtype(eqn.outvars[0].aval.dtype))):
      reg[out_key] = args[0]  # the same value: no instruction
      continue
    a, b, c = (args + [-1, -1, -1])[:3]
    op = _OPS[name]
    code.append(up.Instr(op=op, a=a, b=b, c=c, dtype=dtype,
                         imm=int(eqn.params.get("y", 0))
                         if name == "integer_pow" else 0))
    reg[out_key] = len(inputs) + len(code) - 1
    if all(r in scalar_regs for r in (a, b, c) if r >= 0):
      scalar_regs.add(reg[out_key])
  outs = []
  for key, target in node.writes.items():
    r = reg[key]
    if r in scalar_regs:
      raise _NotOnHost("its new value does not depend on its old value or "
                       "gradient (a constant)")
    outs.append(up.Output(reg=r, handle=handle(target)))
  for c in node.copies:
    outs.append(up.Output(reg=reg[c.new_value],
                          handle=(copy_handles or {})[c.source]))
  code = _contract(code, len(inputs), [o.reg for o in outs])
  platform = next(iter(
      next(iter(node.writes.values())).sharding.device_set)).platform
  return up.Program(num_elements=node.elements,
                    num_scalars=len(node.scalars), inputs=inputs, code=code,
                    outputs=outs,
                    # As the device computes the same work: XLA:CPU
                    # flushes subnormals to zero, XLA:GPU does not.
                    flush_denormals=platform == "cpu")


def _contract(code: list[up.Instr], first: int, outputs: list[int]
              ) -> list[up.Instr]:
  """Fuses a float32 product used once into the sum or difference that
  uses it (one rounding, not two), as LLVM contracts XLA's fused loops on
  CPUs and GPUs with FMA: `p + lr * u` is an FMA there, and must be here
  for the same bits. The product stays, unused (the executor skips it)."""
  uses = collections.Counter(outputs)
  for instr in code:
    uses.update(r for r in (instr.a, instr.b, instr.c) if r >= 0)

  def product(r):
    k = r - first
    if 0 <= k < len(code) and uses[r] == 1:
      m = code[k]
      if m.op == up.UpdateOp.MUL and m.dtype == up.UpdateDType.F32:
        return m
    return None

  out = list(code)
  for k, instr in enumerate(code):
    if instr.dtype != up.UpdateDType.F32 or instr.op not in (
        up.UpdateOp.ADD, up.UpdateOp.SUB):
      continue
    left, right = product(instr.a), product(instr.b)
    if left is not None:  # a * b + c, a * b - c
      op = up.UpdateOp.FMA if instr.op == up.UpdateOp.ADD else up.UpdateOp.FMS
      out[k] = up.Instr(op=op, a=left.a, b=left.b, c=instr.b)
    elif right is not None:  # c + a * b, c - a * b
      op = (up.UpdateOp.FMA if instr.op == up.UpdateOp.ADD else
            up.UpdateOp.FNMA)
      out[k] = up.Instr(op=op, a=right.a, b=right.b, c=instr.a)
  return out
