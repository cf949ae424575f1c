"""cxl_offload: rewrite a jitted step so pool-resident state streams in.

The step is traced with its pool-resident leaves as ordinary inputs; the
resulting jaxpr is then run by an interpreter under ``jax.jit`` that

* fetches each pool-resident input shortly before each cluster of its uses
  (a weight is fetched for the forward pass, again for the backward pass and
  again for its optimizer update), issuing the fetch `prefetch` layers ahead
  and dropping the buffer after the cluster's last use;
* streams ``lax.scan``s over stacked pool-resident layers one layer at a
  time (``streamed_scan``), forward and reverse;
* stores each output that belongs in the pool back into the same objects
  as soon as it is produced and the old value has no uses left.

Everything else in the step is evaluated as traced.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import functools
import logging
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from jcxl import _jcxl
from jcxl._src import call_args
from jcxl._src.dap import compile_ahead
from jcxl._src.dap import costmodel
from jcxl._src import jax_compat
from jcxl._src.offload.program import Lit
from jcxl._src.offload.program import Node
from jcxl._src.offload.program import Program
from jcxl._src.offload.program import layer_of
from jcxl._src.offload.program import reorder_by_layer
from jcxl._src.dap import profile as profile_lib
from jcxl._src import registry
from jcxl._src import schedule as schedule_lib
from jcxl._src import shardings as shardings_lib
from jcxl._src.dap import tuner as tuner_lib
from jcxl._src.pool import Tier
from jcxl._src.offload.clusters import Cluster
from jcxl._src.offload.clusters import FetchClusters
from jcxl._src.offload.clusters import shard_bytes
from jcxl._src.offload.clusters import unordered_reads
from jcxl._src.pool_array import Liveness
from jcxl._src.pool_array import PoolArray
from jcxl._src.pool_array import RowBlocks
from jcxl._src.offload.sliced_update import SlicedNode
from jcxl._src.offload.sliced_update import evaluate_slice
from jcxl._src.offload.sliced_update import slice_state_updates
from jcxl._src.stream import fetch
from jcxl._src.stream import fetch_done
from jcxl._src.stream import fetch_start
from jcxl._src.stream import store_done
from jcxl._src.stream import store
from jcxl._src.stream import store_start
from jcxl._src.stream import streamed_scan
from jcxl._src.tree_diff import first_difference
from jcxl._src.tree_diff import short as short_tree
from jcxl._src.units import format_bytes
from jcxl._src.units import parse_bytes

logger = logging.getLogger(__name__)

_is_pool_array = lambda x: isinstance(x, PoolArray)


def _is_pinned(x: Any) -> bool:
  sharding = getattr(x, "sharding", None)
  return getattr(sharding, "memory_kind", None) == "pinned_host"


def _mark(value: jax.Array) -> jax.Array:
  """A scalar that exists once `value` does (a cheap dependency on it)."""
  if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
    value = jax.random.key_data(value)
  return value.reshape(-1)[0] if value.size else jax.numpy.zeros(())


# ------------------------------------------------------------ interpreter


class _Interpreter:
  """Evaluates the flat program with streaming, under jit."""

  def __init__(self, program: Program, fetches: FetchClusters,
               values: dict[Any, Any], schedule: schedule_lib.LayerSchedule,
               stores: dict[Any, PoolArray], store_after: dict[Any, int]):
    self.program = program
    self.fetches = fetches
    self.env = dict(values)
    self.env.update(program.consts)
    self.schedule = schedule
    self.pending: dict[int, Any] = {}
    self.fetched: dict[int, Any] = {}
    self.stores = stores            # output key -> target PoolArray
    self.store_after = store_after  # output key -> node index
    self.stores_in_flight: collections.deque = collections.deque()
    self.stored: set = set()
    self.last: Any = None  # the latest output: where the step has got to
    # Reads a store must wait for that nothing else orders before it.
    self.unordered = unordered_reads(program, fetches, stores)
    self.marked = {id(c) for cs in self.unordered.values() for c in cs}
    self.marks: dict[int, Any] = {}
    # What the stores hand back, returned from the step: work whose only
    # consumer is a store is then no longer invisible from the step's
    # result, where XLA:CPU's cost analysis starts, and it is spread over
    # the cores like the rest (it ran on one: GPT-2's step took 1.3x as long).
    self.store_tokens: list[Any] = []

  def _start(self, c: Cluster, after: Any) -> None:
    target = self.fetches.resident[c.key]
    if c.after_node >= 0:
      outs = [self.env[k] for k in self.program.nodes[c.after_node].outs
              if k in self.env]
      after = outs[0] if outs else after
    if isinstance(target, PoolArray):
      self.pending[id(c)] = fetch_start(
          self.env[c.key], after=after, priority=c.unit,
          chunk_bytes=self.schedule.chunk_for(
              layer_of(self.fetches.paths[c.key])))
    # pinned_host leaves move with JAX's own transfer, when used.

  def _value_for(self, key: Any, i: int) -> Any:
    c = self.fetches.cluster_at[(key, i)]
    if id(c) not in self.fetched:
      target = self.fetches.resident[key]
      if isinstance(target, PoolArray):
        pending = self.pending.pop(id(c), None)
        if pending is None:  # not started ahead (e.g. schedule fixed:0)
          pending = fetch_start(self.env[key], priority=c.unit)
        # Waited for where the step needs it (after what came before), so
        # XLA cannot hoist the wait onto another thread ahead of time.
        self.fetched[id(c)] = fetch_done(pending, after=self.last)
        if id(c) in self.marked:  # a store must wait for this read
          self.marks[id(c)] = _mark(self.fetched[id(c)])
      else:
        sharding = target.sharding.with_memory_kind("device")
        self.fetched[id(c)] = jax.device_put(self.env[key], sharding)
    return self.fetched[id(c)]

  def _read(self, atom: Any, i: int) -> Any:
    if isinstance(atom, Lit):
      return atom.value
    key = self.program.resolve(atom)
    if isinstance(key, Lit):
      return key.value
    if key in self.fetches.resident:
      return self._value_for(key, i)
    return self.env[key]

  def _streamed_scan(self, node: Node, streamed: dict[int, Any],
                     i: int) -> list[Any]:
    params = node.eqn.params
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    body = params["jaxpr"]
    ins = [None if pos in streamed else self._read(a, i)
           for pos, a in enumerate(node.ins)]
    consts, carry = ins[:n_consts], ins[n_consts:n_consts + n_carry]
    xs_positions = range(n_consts + n_carry, len(ins))
    weights = {str(pos): self.env[key] for pos, key in streamed.items()}
    xs = {str(pos): ins[pos] for pos in xs_positions if pos not in streamed}
    group = layer_of(self.fetches.paths[next(iter(streamed.values()))])

    def scan_body(c, w, x):
      full = [w[str(p)] if p in streamed else x[str(p)]
              for p in xs_positions]
      out = jax_compat.eval_jaxpr(body.jaxpr, body.consts, *consts, *c,
                                  *full)
      return list(out[:n_carry]), list(out[n_carry:])

    carry, ys = streamed_scan(
        scan_body, carry, weights, xs, length=params["length"],
        reverse=params["reverse"],
        prefetch=self.schedule.prefetch_for(group),
        chunk_bytes=self.schedule.chunk_for(group))
    return list(carry) + list(ys)

  def _sliced_loop(self, loop: SlicedNode, i: int) -> list[Any]:
    """Runs a sliced update: one layer of the stacked state (or one block
    of a table's rows) at a time."""
    n_direct = len(loop.pool_keys) + len(loop.stacked_keys)
    scalars = {k: self._read(k, i) for k in loop.ins[n_direct:]}
    group = layer_of(self.fetches.paths[loop.pool_keys[0]])
    inputs = [self.env[k] for k in loop.stacked_keys]
    targets = loop.stores

    def views(tail=False):
      return ({str(j): RowBlocks(self.env[k], loop.rows, tail)
               for j, k in enumerate(loop.pool_keys)},
              {key: RowBlocks(t, loop.rows, tail)
               for key, t in loop.stores.items()})

    def run_slice(w, index, rows=0):
      if loop.rows:  # the same rows of the device inputs, sliced here
        x = {str(j): jax.lax.dynamic_slice_in_dim(
                 a, index * loop.rows, rows or loop.rows)
             for j, a in enumerate(inputs)}
      else:
        x = {str(j): a[index] for j, a in enumerate(inputs)}
      values = evaluate_slice(loop, self.program, scalars, w, x,
                              rows=rows or loop.rows)
      tokens = [store(target, values[key], index)
                for key, target in targets.items()]
      return sum((_mark(t) for t in tokens), jax.numpy.int32(0))

    weights = {str(j): self.env[k] for j, k in enumerate(loop.pool_keys)}
    if loop.rows:
      weights, targets = views()
    def body(c, w, index):
      # The carry is the slice's stores: the next fetches wait for them
      # (nothing else orders the unrolled layers past the loop's, and XLA
      # ran their fetches and updates all ahead of their stores).
      return run_slice(w, index), None

    token, _ = streamed_scan(
        body, jax.numpy.int32(0), weights,
        jax.numpy.arange(loop.length, dtype=jax.numpy.int32),
        length=loop.length, prefetch=self.schedule.prefetch_for(group),
        chunk_bytes=self.schedule.chunk_for(group))
    if loop.tail:  # the last, shorter block of rows
      weights, targets = views(tail=True)
      last = jax.numpy.int32(loop.length)
      token = token + run_slice({j: fetch(w, last) for j, w in
                                 weights.items()}, last, rows=loop.tail)
    self.store_tokens.append(token)
    return []

  def _issue_stores(self, i: int) -> None:
    for key, at in self.store_after.items():
      if at == i and key not in self.stored:
        self._store(key)

  def _store(self, key: Any) -> None:
    self.stored.add(key)
    value = self.read_output(key)
    # Not before every read of the value it overwrites (XLA would
    # otherwise be free to run the store first).
    reads = [self.marks[id(c)] for c in self.unordered.get(key, ())
             if id(c) in self.marks]
    self.stores_in_flight.append(
        store_start(self.stores[key], value, after=reads or None))
    while len(self.stores_in_flight) > costmodel.STORES_IN_FLIGHT:
      self._store_done()

  def _store_done(self) -> None:
    self.store_tokens.append(store_done(self.stores_in_flight.popleft()))

  def read_output(self, key: Any) -> Any:
    """The value of one of the program's outputs."""
    if isinstance(key, Lit):
      return key.value
    if key in self.fetches.resident:  # an input returned elsewhere
      target = self.fetches.resident[key]
      if isinstance(target, PoolArray):
        return fetch_done(fetch_start(self.env[key]))
      return jax.device_put(self.env[key],
                            target.sharding.with_memory_kind("device"))
    return self.env[key]

  def run(self) -> None:
    self._issue_stores(-1)
    for i, node in enumerate(self.program.nodes):
      for c in self.fetches.starts_at.get(i, ()):
        self._start(c, self.last)
      streamed = self.fetches.streamed.get(i)
      if isinstance(node, SlicedNode):
        outs = self._sliced_loop(node, i)
      elif streamed:
        outs = self._streamed_scan(node, streamed, i)
      else:
        outs = jax_compat.bind(node.eqn, [self._read(a, i) for a in node.ins])
      for key, value in zip(node.outs, outs):
        self.env[key] = value
      if outs:
        self.last = outs[0]
      for c in [c for c in self.fetches.clusters if c.last == i]:
        self.fetched.pop(id(c), None)  # the buffer dies after its cluster
      self._issue_stores(i)
    for key in self.stores:
      if key not in self.stored:
        self._store(key)
    while self.stores_in_flight:
      self._store_done()

  def tokens(self) -> list[jax.Array]:
    """The stores' tokens, stacked by shape and layout (a mesh's are
    stacked along a new axis: no device reads another's)."""
    groups = collections.defaultdict(list)
    for t in self.store_tokens:
      groups[(t.shape, str(getattr(t.aval, "sharding", None)))].append(t)
    return [jax.numpy.stack(g) for g in groups.values()]


# ------------------------------------------------------------------ step


@dataclasses.dataclass(frozen=True)
class _Pinned:
  """A leaf in JAX's pinned_host memory kind; moved with device_put."""
  sharding: Any


@dataclasses.dataclass(frozen=True)
class _Prepared:
  fn: Callable[..., Any]  # the traced function: the step, then its arguments
  avals: Any
  pinned: dict[int, _Pinned]
  # Output leaf -> the state argument leaf it is written into. The traced
  # function's outputs are the step's, then every argument leaf as the step
  # left it (an NNX module updated in place): leaf i at num_out + i.
  targets: dict[int, int]
  out_tree: Any
  out_shardings: list[Any]  # per output leaf: a Sharding, or None


class _Entry(NamedTuple):
  """A compiled step and what a call needs to run it."""
  executable: Any
  out_tree: Any
  sources: list[int | None]  # per output leaf: the state argument leaf
  plan: Any
  passed: tuple[int, ...]  # the argument leaves the executable takes
  liveness: Liveness  # that its pool arrays' objects still exist


def _with_arguments_after(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn`, also returning its arguments as it left them: a mutable pytree
  (an NNX module) updated in place shows its new leaves there."""
  def traced(*args):
    return fn(*args), args
  return traced


def _is_update(out: Any, arg: Any) -> bool:
  """Whether output `out` is meant as argument `arg`'s new value: of the
  same type at the top (a dict sharing a key with it; the same dataclass,
  module or sequence type), or, for a single array, of the same shape and
  dtype. An output of another kind (an eval step's metrics) leaves the
  argument read-only."""
  if isinstance(arg, jax.ShapeDtypeStruct):
    return (isinstance(out, jax.ShapeDtypeStruct) and
            tuple(out.shape) == tuple(arg.shape) and out.dtype == arg.dtype)
  if isinstance(arg, collections.abc.Mapping):
    return (isinstance(out, collections.abc.Mapping) and
            bool(set(out) & set(arg)))
  return type(out) is type(arg)


def _bake_handles(args: tuple[Any, ...]
                  ) -> tuple[tuple[int, ...], Callable[..., tuple[Any, ...]]]:
  """Which argument leaves a compiled step is called with, and how its
  trace rebuilds `args` from them.

  A pool array's handles are in the step's cache key already (static in
  its pytree). Where this process can read them all they are baked into
  the step as constants, not passed: a step with side effects is
  dispatched by JAX in Python, argument by argument (one big block's 91
  handle arrays cost about 4 ms a call: it returned after 7.8 ms, 3.4
  without them). A process of a multi-process run holds only its own
  devices' handles: there they stay arguments.
  """
  leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=_is_pool_array)
  baked = {i: jax.tree_util.tree_map(np.asarray, leaf)
           for i, leaf in enumerate(leaves)
           if isinstance(leaf, PoolArray) and
           getattr(leaf.handles, "is_fully_addressable", True)}
  passed = tuple(i for i in range(len(leaves)) if i not in baked)

  def rebuild(*values):
    given = dict(zip(passed, values))
    return jax.tree_util.tree_unflatten(
        treedef, [baked[i] if i in baked else given[i]
                  for i in range(len(leaves))])
  return passed, rebuild


@dataclasses.dataclass(frozen=True)
class _Analysis:
  """A traced step as the rewrite sees it."""
  program: Program
  fetches: FetchClusters
  resident: dict[Any, Any]
  key_paths: dict[Any, str]
  values: dict[Any, Any]
  stores: dict[Any, PoolArray]
  store_after: dict[Any, int]
  returned: list[tuple[int, Any, Any]]  # (output leaf, key, state target)
  segments: list[costmodel.Segment]


@dataclasses.dataclass(frozen=True)
class LayerReport:
  """What one layer moved and waited for in the steps since the last report.

  Bytes and transfers count every shard of this process's devices; `wait_s`
  is what one device waited (the devices wait for their shards at once).
  """
  name: str
  bytes_fetched: int
  bytes_stored: int
  wait_s: float
  transfers: int


def _avals(tree: Any) -> Any:
  def aval(x):
    if isinstance(x, PoolArray):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    x = jax.numpy.asarray(x) if not hasattr(x, "shape") else x
    sharding = getattr(x, "sharding", None)
    if _is_pinned(x):
      sharding = sharding.with_memory_kind("device")
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return jax.tree_util.tree_map(aval, tree, is_leaf=_is_pool_array)


class OffloadedStep:
  """A step rewritten by ``cxl_offload`` (see there)."""

  # The identity of the offloaded step that ran last in this process: a
  # DAP step does not measure itself right after another one's (see
  # Tuner.wants_measurement).
  _ran_last: object | None = None

  def __init__(self, fn: Callable, device_budget: int | None,
               schedule: schedule_lib.Schedule, in_shardings: Any = None,
               out_shardings: Any = None,
               params: call_args.Signature | None = None):
    self._fn = fn
    self._params = params or call_args.Signature(fn)
    self._in_shardings = in_shardings
    self._out_shardings = out_shardings
    self._budget = device_budget
    self._schedule = schedule
    self.tuner = (tuner_lib.Tuner(schedule.start, device_budget)
                  if isinstance(schedule, schedule_lib.DapSchedule) else None)
    self._compiled: dict[Any, Any] = {}
    self._groups: dict[int, str] = {}   # handle -> layer name
    self._first_device: dict[int, str] = {}  # the same, one device's
    self._segments: list[costmodel.Segment] = []
    self._plan: schedule_lib.Plan | None = None
    self.last_profile: profile_lib.StepProfile | None = None
    self.compiles = 0
    # DAP: plans to come compile on a thread of their own while the step
    # runs the one that ran last, (signature, entry).
    self._ahead = (compile_ahead.CompileAhead(self.tuner, self._compile_plan)
                   if self.tuner else None)
    self._ran: tuple[Any, _Entry] | None = None
    self._ahead_plans: dict[schedule_lib.LayerSchedule, Any] = {}
    self._last_results: Any = None
    self._identity = object()
    functools.update_wrapper(self, fn)

  def _prepare(self, bound: call_args.BoundCall) -> "_Prepared":
    """What the traced step needs to know about the concrete arguments."""
    args = bound.args
    with_paths = jax.tree_util.tree_flatten_with_path(
        args, is_leaf=_is_pool_array)[0]
    flat = [leaf for _, leaf in with_paths]
    names = [bound.leaf_name(path) for path, _ in with_paths]
    avals = _avals(args)
    fn = _with_arguments_after(bound.fn)
    closed, (out_shape, after) = jax.make_jaxpr(fn, return_shape=True)(
        *avals)
    targets = self._state_targets(bound, out_shape)
    position = {id(leaf): i for i, leaf in enumerate(flat)}
    targets = {j: position[id(t)] for j, t in targets.items()}
    num_out = len(jax.tree_util.tree_leaves(out_shape))
    targets.update(self._updated_in_place(
        closed.jaxpr, avals, after, num_out, flat, names,
        set(targets.values())))
    self._check_aliases(flat, names, set(targets.values()))
    out_shardings = shardings_lib.flat_shardings(
        self._out_shardings, out_shape, "out_shardings")
    for j, i in targets.items():  # state is written back where it lives
      if j < num_out:
        t = flat[i]
        shardings_lib.check_state(
            out_shardings[j], t, t._what() if isinstance(t, PoolArray) else
            f"pinned_host state (output leaf {j})")
    return _Prepared(
        fn=fn,
        avals=avals,
        pinned={i: _Pinned(leaf.sharding) for i, leaf in enumerate(flat)
                if _is_pinned(leaf)},
        targets=targets,
        out_tree=jax.tree_util.tree_structure(out_shape),
        out_shardings=out_shardings)

  def _updated_in_place(self, jaxpr: Any, avals: Any, after: Any,
                        num_out: int, flat: list[Any], names: list[str],
                        returned: set[int]) -> dict[int, int]:
    """Output index -> argument leaf, for the pool arrays the step updated
    in place (an NNX module's, a step returning None) and did not return.

    Raises:
      TypeError: an in-place update cxl_offload cannot write back.
    """
    name = self.__name__
    if jax.tree_util.tree_structure(after) != jax.tree_util.tree_structure(
        avals):
      raise TypeError(
          f"{name} changes the structure of its arguments in place "
          f"({first_difference(after, avals)}); return the new value "
          "instead")
    outvars = jaxpr.outvars[num_out:]
    targets = {}
    for i, (var, invar) in enumerate(zip(outvars, jaxpr.invars)):
      if var is invar or i in returned:
        continue
      if not isinstance(flat[i], PoolArray):
        raise TypeError(
            f"{name} updates {names[i]} in place but it is not in the pool, "
            "so the update cannot be handed back (as with jax.jit); place "
            "it in the pool, or return the new value: `return model, loss`")
      targets[num_out + i] = i
    return targets

  def _check_aliases(self, flat: list[Any], names: list[str],
                     written: set[int]) -> None:
    """Refuses one pool object passed as two argument leaves, where either
    is written: the step writes each back, and the last write would win."""
    seen: dict[tuple[int, int], int] = {}
    for i, leaf in enumerate(flat):
      if not isinstance(leaf, PoolArray) or leaf.pool_id < 0:
        continue  # not an array, or planned without a pool (no objects)
      for _, handle in leaf.local_handles:
        first = seen.setdefault((leaf.pool_id, handle), i)
        if first != i and (first in written or i in written):
          raise ValueError(
              f"{self.__name__} gets the same pool array as {names[first]} "
              f"and as {names[i]} ({leaf._what()}); each is written back in "
              "place, so one update would be lost: pass it once, or place a "
              "copy for the second")

  def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> call_args.BoundCall:
    """The call bound to the step's signature, laid out as `in_shardings`
    says (see jax.jit)."""
    bound = self._params.bind(args, kwargs)
    if self._in_shardings is None:
      return bound
    positional = bound.args[:-1]
    with_paths = jax.tree_util.tree_flatten_with_path(
        positional, is_leaf=_is_pool_array)[0]
    state = {i for i, (_, leaf) in enumerate(with_paths)
             if isinstance(leaf, PoolArray) or _is_pinned(leaf)}
    placed = shardings_lib.place_inputs(
        positional, shardings_lib.flat_shardings(self._in_shardings,
                                                 positional, "in_shardings"),
        state, [jax.tree_util.keystr(p) for p, _ in with_paths])
    return dataclasses.replace(bound,
                               args=tuple(placed) + (bound.args[-1],))

  def _analyze(self, args: tuple[Any, ...], prep: "_Prepared",
               timed: bool = False) -> _Analysis:
    """Traces the step and finds its clusters, stores and timeline
    (`timed`: see ``FetchClusters.timeline``)."""
    flat = jax.tree_util.tree_leaves(args, is_leaf=_is_pool_array)
    closed = jax.make_jaxpr(prep.fn)(*prep.avals)
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(
                 args, is_leaf=_is_pool_array)[0]]
    program = Program(closed, len(flat))
    resident, key_paths, values = {}, {}, {}
    for i, leaf in enumerate(flat):
      key = ("in", i)
      values[key] = leaf
      if isinstance(leaf, PoolArray) or i in prep.pinned:
        resident[key] = prep.pinned.get(i, leaf)
        key_paths[key] = getattr(leaf, "path", "") or paths[i]
    output_layers = [
        layer_of(key_paths[("in", prep.targets[j])])
        if j in prep.targets and ("in", prep.targets[j]) in key_paths
        else None for j in range(len(program.outputs))]
    reorder_by_layer(program, output_layers, set(resident))
    stores, returned = {}, []
    num_out = prep.out_tree.num_leaves
    for j, key in enumerate(program.outputs):
      old = ("in", prep.targets[j]) if j in prep.targets else None
      target = resident.get(old)
      if isinstance(target, PoolArray):
        if key != old:  # unchanged state: nothing to write
          stores[key] = target
      elif j < num_out:  # the arguments as left: written, never returned
        returned.append((j, key, target))
    for key in slice_state_updates(program, resident, stores):
      del stores[key]  # the sliced loop stores these, layer by layer
    fetches = FetchClusters(program, resident, key_paths)
    producer = {key: n for n, node in enumerate(program.nodes)
                for key in node.outs}
    old_key = {id(v): k for k, v in resident.items()}
    # Written once produced and once the old value has no uses left.
    store_after = {key: max(producer.get(key, -1),
                            fetches.last_use.get(old_key[id(t)], -1))
                   for key, t in stores.items()}
    return _Analysis(program, fetches, resident, key_paths, values, stores,
                     store_after, returned,
                     fetches.timeline(stores, store_after, timed))

  # The traced function: args in, the outputs that are not pool state out.
  # `ahead`: a DAP plan to compile on the compiling thread (see
  # compile_ahead), which must leave the tuner and `self._plan` alone.
  def _run(self, args: tuple[Any, ...], prep: "_Prepared",
           ahead: schedule_lib.LayerSchedule | None = None) -> list[Any]:
    a = self._analyze(args, prep)
    links = _tier_links(a.resident.values())
    made_for = schedule_lib.MadeFor.of(
        (layer_of(a.key_paths[k]), a.key_paths[k], t.shape, t.dtype)
        for k, t in a.resident.items() if isinstance(t, PoolArray))
    schedule_lib.check_made_for(self._schedule, made_for)
    schedule = ahead or (self.tuner.resolve(a.segments, links) if self.tuner
                         else self._schedule.resolve(a.segments, links))
    a.fetches.set_schedule(schedule)
    interpreter = _Interpreter(a.program, a.fetches, a.values, schedule,
                               a.stores, a.store_after)
    interpreter.run()
    out = []
    for j, key, target in a.returned:
      value = interpreter.read_output(key)
      if isinstance(target, _Pinned):  # back to JAX's pinned host memory
        value = jax.device_put(value, target.sharding)
      elif prep.out_shardings[j] is not None:  # as jax.jit's out_shardings
        value = jax.lax.with_sharding_constraint(value,
                                                prep.out_shardings[j])
      out.append(value)
    # After the outputs: a call reads only those (see _Interpreter).
    out.extend(interpreter.tokens())
    self._segments = a.segments
    plan = self._record_plan(a.fetches, a.key_paths, a.resident, schedule,
                             a.segments, links, made_for, tuned=not ahead)
    if ahead:
      self._ahead_plans[ahead] = plan
    else:
      self._plan = plan
    return out

  def _state_targets(self, bound: call_args.BoundCall, out_shape: Any
                     ) -> dict[int, Any]:
    """Output leaf index -> the pool-resident (or pinned) input it updates.

    Positional argument ``a`` holding pool-resident or pinned leaves is
    state: an output ``a`` of its kind (see ``_is_update``) must have the
    same tree structure, and is written back into it; an output of another
    kind (or none) leaves it read-only.
    """
    args = bound.args[:bound.num_positional]
    name = getattr(self._fn, "__name__", "the step")
    for path, leaf in jax.tree_util.tree_flatten_with_path(
        out_shape, is_leaf=_is_pool_array)[0]:
      if isinstance(leaf, PoolArray):
        raise TypeError(
            f"{name} returns {leaf._what()} at output "
            f"{jax.tree_util.keystr(path)}, a PoolArray it did not receive "
            "as an argument (a closed-over one?); pass it in as state and "
            "return its new value instead")
    outs = out_shape if isinstance(out_shape, (tuple, list)) else (out_shape,)
    targets = {}
    offset = 0
    for a, out in enumerate(outs):
      out_leaves, out_def = jax.tree_util.tree_flatten(out)
      arg = args[a] if a < len(args) else None
      arg_leaves = jax.tree_util.tree_leaves(arg, is_leaf=_is_pool_array)
      if any(isinstance(l, PoolArray) or _is_pinned(l) for l in arg_leaves):
        arg_avals = _avals(arg)
        if not _is_update(out, arg_avals):
          offset += len(out_leaves)
          continue  # read-only state: the output is returned as it is
        in_def = jax.tree_util.tree_structure(arg_avals)
        if out_def != in_def:
          raise ValueError(
              f"{name}: output {a} differs from argument {a} "
              f"({bound.names[a]}) {first_difference(out, arg_avals)}. "
              f"cxl_offload writes output {a} back into argument {a}'s pool "
              "objects, so it must keep the argument's structure (output: "
              f"{short_tree(out_def)}; argument: {short_tree(in_def)})")
        for j, (leaf_in, leaf_out) in enumerate(zip(arg_leaves, out_leaves)):
          if isinstance(leaf_in, PoolArray) and (
              tuple(leaf_out.shape) != leaf_in.shape or
              leaf_out.dtype != leaf_in.dtype):
            raise ValueError(
                f"{name}: output {a} changes {leaf_in._what()} from "
                f"{leaf_in.dtype}{list(leaf_in.shape)} to "
                f"{leaf_out.dtype}{list(leaf_out.shape)}")
          targets[offset + j] = leaf_in
      offset += len(out_leaves)
    return targets

  def _record_plan(self, fetches: FetchClusters, paths: dict, resident: dict,
                   schedule: schedule_lib.LayerSchedule,
                   segments: list[costmodel.Segment],
                   links: dict[str, costmodel.Link],
                   made_for: schedule_lib.MadeFor,
                   tuned: bool = True) -> schedule_lib.Plan:
    layers = collections.OrderedDict()
    all_clusters = fetches.clusters + [
        Cluster(k, i, i) for i, s in fetches.streamed.items()
        for k in s.values()]
    reads = collections.Counter(c.key for c in all_clusters)
    for c in all_clusters:
      target = resident[c.key]
      if not isinstance(target, PoolArray):
        continue
      name = layer_of(paths[c.key])
      entry = layers.setdefault(name, {"keys": {}, "tiers": set()})
      entry["keys"][c.key] = target
      entry["tiers"].add(target.tier.value)
      for j, (_, handle) in enumerate(target.local_handles):
        self._groups[handle] = name
        if j == 0:
          self._first_device[handle] = name
    pooled = {c.key: resident[c.key] for c in all_clusters
              if isinstance(resident[c.key], PoolArray)}
    placement = schedule_lib.placement_lines(
        [(t.tier.value, shard_bytes(t), reads[k]) for k, t in pooled.items()])
    rows = []
    for name, entry in layers.items():
      rows.append(schedule_lib.LayerPlan(
          name=name, nbytes=sum(map(shard_bytes, entry["keys"].values())),
          tiers=tuple(sorted(entry["tiers"])),
          prefetch=schedule.prefetch_for(name),
          chunk_bytes=schedule.chunk_for(name)))
    if self.tuner and tuned:
      prediction, reasons = self.tuner.prediction, self.tuner.reasons
    else:
      prediction = costmodel.simulate(
          segments, {l.name: l.prefetch for l in rows}, links,
          {l.name: l.chunk_bytes for l in rows})
      reasons = ()
    return schedule_lib.Plan(tuple(rows), str(self._schedule),
                             prediction.step_s, reasons, made_for,
                             placement)

  @property
  def plan(self) -> schedule_lib.Plan | None:
    """The per-layer plan the next step runs (None before the first
    compile). Under DAP its predicted step and reasons are the tuner's as
    they stand now: a race or a baseline learns after the plan compiled."""
    plan, tuner = self._plan, self.tuner
    if plan is None or tuner is None or tuner.prediction is None or any(
        (l.prefetch, l.chunk_bytes) != (tuner.schedule.prefetch_for(l.name),
                                       tuner.schedule.chunk_for(l.name))
        for l in plan.layers):
      return plan  # the tuner has moved on to a plan not compiled yet
    return dataclasses.replace(plan, predicted_step_s=tuner.prediction.step_s,
                               reasons=tuner.reasons)

  def _signature(self, bound: call_args.BoundCall) -> Any:
    """What a compiled step is specific to: the arguments' structure,
    shapes, dtypes and layouts, and the static arguments' values."""
    leaves, treedef = jax.tree_util.tree_flatten(bound.args,
                                                 is_leaf=_is_pool_array)
    parts = []
    for leaf in leaves:
      if isinstance(leaf, PoolArray):
        parts.append(jax.tree_util.tree_structure(leaf))
      else:
        parts.append((tuple(np.shape(leaf)), str(getattr(leaf, "dtype", "")),
                      getattr(leaf, "sharding", None)))
    return treedef, tuple(parts), bound.static_key

  def lower(self, *args, **kwargs):
    """Lowers the rewritten step for these arguments (see jax.jit). Its
    pool arrays' handles are constants in it where this process holds
    them all."""
    bound = self._bind(args, kwargs)
    return self._lower(bound, self._prepare(bound),
                       _bake_handles(bound.args))

  def _lower(self, bound: call_args.BoundCall, prep: _Prepared,
             baking: tuple[tuple[int, ...], Callable],
             ahead: schedule_lib.LayerSchedule | None = None) -> Any:
    passed, rebuild = baking
    with_paths = jax.tree_util.tree_flatten_with_path(
        bound.args, is_leaf=_is_pool_array)[0]
    donate = tuple(k for k, i in enumerate(passed)
                   if bound.is_donated(with_paths[i][0]) and
                   not isinstance(with_paths[i][1], PoolArray))
    return jax.jit(lambda *a: self._run(rebuild(*a), prep, ahead),
                   donate_argnums=donate).lower(
                       *(with_paths[i][1] for i in passed))

  def _compile_plan(self, bound: call_args.BoundCall,
                    schedule: schedule_lib.LayerSchedule) -> tuple[Any, int]:
    """The step compiled with DAP plan `schedule`, and its device need (on
    the compiling thread: see compile_ahead)."""
    prep, baking = self._prepare(bound), _bake_handles(bound.args)
    compiled = self._lower(bound, prep, baking, schedule).compile()
    return (self._make_entry(bound.args, prep, baking, compiled,
                             self._ahead_plans.pop(schedule)),
            device_need(compiled.memory_analysis()))

  def _compile(self, bound: call_args.BoundCall) -> _Entry:
    args = bound.args
    flat_args = jax.tree_util.tree_leaves(args, is_leaf=_is_pool_array)
    # A closed pool or a freed array, named, before tracing.
    Liveness([x for x in flat_args if isinstance(x, PoolArray)]).check()
    prep = self._prepare(bound)
    baking = _bake_handles(args)  # once: it reads every handle back
    started = time.perf_counter()
    compiled = self._lower(bound, prep, baking).compile()
    self.compiles += 1
    if self.tuner:
      self.tuner.add_compile(time.perf_counter() - started)
    # A DAP plan learns the step's memory without prefetch from its
    # compiles; a plan over the budget is re-planned within it, with less
    # prefetch each time (so this ends), or leaves a race for a plan
    # compiled already.
    while self.tuner and self.tuner.calibrate(
        device_need(compiled.memory_analysis())):
      if self._cache_key(bound) in self._compiled:
        return self._compiled[self._cache_key(bound)]
      started = time.perf_counter()
      compiled = self._lower(bound, prep, baking).compile()
      self.compiles += 1
      self.tuner.add_compile(time.perf_counter() - started)
    self._check_budget(compiled)
    return self._make_entry(args, prep, baking, compiled, self._plan)

  def _make_entry(self, args: tuple[Any, ...], prep: _Prepared,
                  baking: tuple[tuple[int, ...], Callable], compiled: Any,
                  plan: Any) -> _Entry:
    flat_args = jax.tree_util.tree_leaves(args, is_leaf=_is_pool_array)
    # Where each output comes from: a pool-resident argument leaf (updated
    # in place) or the compiled step's results.
    sources = [prep.targets.get(j) for j in range(prep.out_tree.num_leaves)]
    sources = [i if i is not None and isinstance(flat_args[i], PoolArray)
               else None for i in sources]
    return _Entry(compiled, prep.out_tree, sources, plan, baking[0],
                  Liveness([x for x in flat_args
                            if isinstance(x, PoolArray)]))

  def _cache_key(self, bound: call_args.BoundCall,
                 signature: Any = None) -> Any:
    return (signature or self._signature(bound),
            self.tuner.version if self.tuner else 0)

  def compile(self, *args, **kwargs) -> Any:
    """Compiles the step for these arguments without running it (or takes
    it from the cache) and returns the compiled executable.

    Raises:
      MemoryError: it needs more than `device_budget` (after a DAP plan has
        been re-planned within it).
    """
    return self._entry(self._bind(args, kwargs)).executable

  def _entry(self, bound: call_args.BoundCall,
             signature: Any = None) -> _Entry:
    # The key once a call: it flattens every argument (1.5 ms a call for
    # 91 pool arrays here).
    entry = self._compiled.get(self._cache_key(bound, signature))
    if entry is None:
      entry = self._compile(bound)
      # Keyed after compiling: a DAP budget re-plan moves the plan on.
      self._compiled[self._cache_key(bound)] = entry
    else:
      # Its handles are constants in it: the step would fail on a freed
      # one by number, or the pool's closing, at run time.
      entry.liveness.check()
    return entry

  def __call__(self, *args, **kwargs):
    return self._call(self._bind(args, kwargs), measure=False)

  def measured_call(self, *args, **kwargs
                    ) -> tuple[Any, profile_lib.StepProfile]:
    """Runs one step measured, whatever the schedule: its results, and
    what it did (each segment's compute, its waits; see StepProfile)."""
    results = self._call(self._bind(args, kwargs), measure=True)
    return results, self.last_profile

  def _tuned_entry(self, bound: call_args.BoundCall, signature: Any
                   ) -> tuple[_Entry, list]:
    """Under DAP, the entry this call runs: the tuner's plan where it is
    compiled, else the one that ran last while it compiles (see
    compile_ahead); and the plans still compiling (empty: none)."""
    for compiled_for, schedule, entry in self._ahead.harvest():
      self.compiles += 1
      self._compiled[(compiled_for, self.tuner.version_of(schedule))] = entry
    if self._ran is not None and self._ran[0] == signature:
      missing = self._ahead.missing(
          signature, bound,
          lambda s: (signature, self.tuner.version_of(s)) in self._compiled)
      if missing:
        self._ran[1].liveness.check()
        return self._ran[1], missing
    return self._entry(bound, signature), []  # the first call compiles here

  def _call(self, bound: call_args.BoundCall, measure: bool) -> Any:
    args = bound.args
    signature = self._signature(bound) if self.tuner else None
    entry, compiling = (self._tuned_entry(bound, signature) if self.tuner
                        else (self._entry(bound), []))
    self._plan = entry.plan
    flat_args = jax.tree_util.tree_leaves(args, is_leaf=_is_pool_array)
    after_other = OffloadedStep._ran_last not in (None, self._identity)
    OffloadedStep._ran_last = self._identity
    wanted = (self.tuner is not None and not compiling and
              self.tuner.wants_measurement(after_other))
    measure = measure or wanted
    if measure:
      jax.block_until_ready(self._last_results)
      registry.flush_device_transfers()
      # Waits of earlier steps belong to them. Forgotten, not drained: up
      # to 65536 of them, every offloaded step's since the last measured
      # one, were handed to Python inside the measured step (41104 took
      # 77 ms here).
      _jcxl.clear_stream_waits()
      started = _jcxl.now_ns()
    self._last_results = entry.executable(*(flat_args[i]
                                            for i in entry.passed))
    if measure:
      jax.block_until_ready(self._last_results)
      registry.flush_device_transfers()  # the step's own GPU waits
      window = (started, _jcxl.now_ns())
      self.last_profile = profile_lib.profile_step(
          self._collect(), self._first_device, window, self._segments)
    if compiling:
      self.tuner.waited(compiling, self._ahead.compiling_s())
    elif self.tuner:
      self._ran = (signature, entry)
      version = self.tuner.version
      self.tuner.step_done(self.last_profile if wanted else None)
      # `plan` is the one the next step runs, when it is compiled already
      # (a race moving on, or settling on the plan it keeps).
      following = (self._compiled.get(self._cache_key(bound, signature))
                   if self.tuner.version != version else None)
      if following is not None:
        self._plan = following.plan
    results = iter(self._last_results)
    return jax.tree_util.tree_unflatten(
        entry.out_tree, [next(results) if src is None else flat_args[src]
                         for src in entry.sources])

  def _check_budget(self, compiled: Any) -> None:
    if self._budget is None:
      return
    need = device_need(compiled.memory_analysis())
    if need > self._budget:
      m = compiled.memory_analysis()
      raise MemoryError(
          f"{self.__name__} needs {format_bytes(need)} of device memory "
          f"(temporaries {format_bytes(m.temp_size_in_bytes)}, arguments "
          f"{format_bytes(m.argument_size_in_bytes)}, outputs "
          f"{format_bytes(m.output_size_in_bytes)}) but device_budget is "
          f"{format_bytes(self._budget)}: over by "
          f"{format_bytes(need - self._budget)}. A smaller prefetch distance "
          f"(schedule='fixed:k', now '{self._schedule}'), a smaller batch, "
          "or jax.checkpoint (remat) on the layers would help")

  def device_need(self, *args, **kwargs) -> int:
    """Device bytes the compiled step needs for these arguments."""
    return device_need(self.memory_analysis(*args, **kwargs))

  def memory_analysis(self, *args, **kwargs) -> Any:
    """The compiled step's ``memory_analysis()`` for these arguments."""
    entry = self._compiled.get(self._cache_key(self._bind(args, kwargs)))
    compiled = (entry.executable if entry else
                self.lower(*args, **kwargs).compile())
    return compiled.memory_analysis()

  def _collect(self) -> list[profile_lib.Wait]:
    """Drains the logged waits, for a step's profile. (The report's totals
    are kept apart, in the copy engine: this history of single waits is
    bounded.)"""
    return profile_lib.waits_from_raw(_jcxl.drain_stream_waits())

  def report(self) -> list[LayerReport]:
    """Per layer: bytes moved and time waited, since the last report of
    any step (the copy engine keeps one set of totals per object).

    Waits for the steps already dispatched to finish first.
    """
    jax.block_until_ready(self._last_results)
    registry.flush_device_transfers()
    moved = collections.defaultdict(lambda: [0, 0, 0.0, 0])
    for handle, totals in _jcxl.drain_wait_totals().items():
      name = self._groups.get(handle)
      if name is None:
        continue
      entry = moved[name]
      entry[0] += totals.bytes_from_pool
      entry[1] += totals.bytes_to_pool
      if handle in self._first_device:
        # Each device waits for its own shard at the same time: the step
        # waited what one device did, not the sum.
        entry[2] += totals.wait_ns * 1e-9
      entry[3] += totals.transfers
    return [LayerReport(name, *moved[name]) for name in
            (l.name for l in (self.plan.layers if self.plan else ()))
            if name in moved]


def device_need(analysis: Any) -> int:
  """Device bytes a compiled step needs, from its ``memory_analysis()``:
  temporaries, arguments and outputs, less what outputs alias (what
  `device_budget` is checked against)."""
  m = analysis
  return int(m.temp_size_in_bytes + m.argument_size_in_bytes +
             m.output_size_in_bytes - m.alias_size_in_bytes)


def _tier_links(resident: Any) -> dict[str, costmodel.Link]:
  """The planning view of the links of every tier the step streams from."""
  links = {}
  for x in resident:
    if isinstance(x, PoolArray) and x.tier.value not in links:
      model = registry.find_pool(x.pool_id, what=x._what()).link_estimate(
          x.tier)
      links[x.tier.value] = costmodel.Link(model.bandwidth, model.latency_s)
  return links


def step_timeline(fn: Callable, state: tuple[Any, ...], *rest: Any,
                  tier_of: Callable[[str], str] = lambda path: "cxl",
                  timed: bool = False
                  ) -> tuple[list[costmodel.Segment], dict[str, int]]:
  """The layer timeline of a step, planned without a pool or any memory.

  `state` holds the step's state arguments as ``jax.ShapeDtypeStruct``
  trees (e.g. ``jax.eval_shape`` of an init): each leaf is planned as if
  placed in tier ``tier_of(path)``. `rest` are the other arguments
  (abstract too). Compute times are estimates (see compute_estimate);
  with `timed`, each segment's work is compiled and timed on the default
  device, on zeros, where its arrays are small enough to allocate.

  Returns:
    The segments, and the bytes of state each layer holds in the pool.
  """
  device = jax.devices()[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  layer_bytes: dict[str, int] = collections.defaultdict(int)

  def virtual(path, leaf):
    path = jax.tree_util.keystr(path)
    layer_bytes[layer_of(path)] += int(np.prod(leaf.shape)) * np.dtype(
        leaf.dtype).itemsize
    return PoolArray(jax.ShapeDtypeStruct((1,), np.int32), pool_id=-1,
                     shape=leaf.shape, dtype=leaf.dtype, sharding=sharding,
                     tier=Tier(tier_of(path)), path=path,
                     local_handles=((device.id, -1),))

  args = tuple(jax.tree_util.tree_map_with_path(virtual, tree)
               for tree in state) + rest
  step = OffloadedStep(fn, None, schedule_lib.FixedSchedule(0))
  bound = step._bind(args, {})
  return (step._analyze(bound.args, step._prepare(bound), timed).segments,
          dict(layer_bytes))


def cxl_offload(fn: Callable | None = None, *,
                device_budget: int | str | None = None,
                schedule: str = "fixed:1", in_shardings: Any = None,
                out_shardings: Any = None, static_argnums: Any = None,
                static_argnames: Any = None, donate_argnums: Any = None,
                donate_argnames: Any = None) -> Any:
  """Rewrites a step so that its pool-resident state streams from the pool.

  Arguments holding ``PoolArray`` leaves (placed with ``jcxl.place``) are
  state. Where the step returns, at the same position, a value of the same
  kind (the same dict keys, dataclass or module; for a single array, the
  same shape and dtype), that value must have the argument's tree
  structure and is written back into the same pool objects (in place). A
  state argument the step returns nothing of that kind for is read-only
  (an eval step returning metrics). Pool-resident leaves a step updates in
  place (an NNX module, with the step returning None) are written back
  too. ``pinned_host`` leaves move with JAX's own memory-kind transfers;
  other leaves are passed as they are.

  Example:
    >>> params = jcxl.place(params, "cxl", pool=pool)
    >>> opt_state = jcxl.place(opt_state, "cxl", pool=pool)
    >>> @jcxl.cxl_offload(device_budget="2GiB", schedule="fixed:1")
    ... def train_step(params, opt_state, batch):
    ...   loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    ...   updates, opt_state = tx.update(grads, opt_state, params)
    ...   return optax.apply_updates(params, updates), opt_state, loss
    >>> params, opt_state, loss = train_step(params, opt_state, batch)

  Args:
    fn: the step.
    device_budget: device memory the compiled step may use (bytes or e.g.
      '2GiB'); checked at compile time against ``memory_analysis()``.
    schedule: how far ahead each layer's leaves are fetched:
      'fixed:k' (k layers ahead), 'sync' (k = 0), 'bucket[:N]' (DeepSpeed
      ZeRO-3's prefetch bucket of N elements, default 5e7), 'plan:PATH' (a
      saved ``step.plan``), or 'dap[:PATH]' (Dynamic Adaptive Pipelining:
      planned from a cost model within `device_budget`, then re-planned
      from measured steps, optionally starting from a saved plan).
    in_shardings, out_shardings: as ``jax.jit``'s: a pytree prefix of the
      arguments (outputs) with ``jax.sharding.Sharding`` or None leaves.
      Host values are put where `in_shardings` says; a device array must
      already be laid out so. Returned values are laid out as
      `out_shardings` says. Pool-resident state keeps the sharding it was
      placed with: one given for it must match.
    static_argnums, static_argnames, donate_argnums, donate_argnames: as
      ``jax.jit``'s. Static arguments must be hashable; each new value
      compiles the step anew. Donated device arrays are consumed by the
      call; pool-resident state is updated in place either way. Keyword
      arguments are accepted as ``jax.jit`` accepts them.

  Returns:
    The rewritten step; ``step.plan`` is the per-layer plan it compiled
    (``print`` it; ``step.plan.save(path)`` keeps it), ``step.report()``
    the bytes moved and time waited per layer, ``step.tuner`` the DAP
    tuner (its ``history``) and ``step.last_profile`` the last measured
    step (per layer transfer, compute and stall time).

  Example with the adaptive schedule:
    >>> @jcxl.cxl_offload(device_budget="2GiB", schedule="dap")
    ... def train_step(params, opt_state, batch): ...
    >>> for batch in batches:
    ...   params, opt_state, loss = train_step(params, opt_state, batch)
    >>> print(train_step.plan)   # per layer: prefetch, chunk; and why
    >>> train_step.plan.save("plan.json")  # schedule="dap:plan.json" later
  """
  budget = (None if device_budget is None else
            parse_bytes(device_budget, name="device_budget"))
  parsed = schedule_lib.parse_schedule(schedule)

  def wrap(f):
    if not callable(f):
      raise TypeError(f"cxl_offload decorates a function, but got {f!r}")
    return OffloadedStep(f, budget, parsed, in_shardings, out_shardings,
                         call_args.Signature(f, static_argnums,
                                             static_argnames, donate_argnums,
                                             donate_argnames))

  return wrap if fn is None else wrap(fn)
