"""The interpreter of a rewritten step: the traced program evaluated under
``jax.jit`` with its pool-resident state streamed in.

It

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
import functools
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jcxl._src import jax_compat
from jcxl._src.schedules import plan as schedule_lib
from jcxl._src.schedules import costmodel
from jcxl._src.offload.clusters import Cluster
from jcxl._src.offload.clusters import FetchClusters
from jcxl._src.offload.clusters import unordered_reads
from jcxl._src.host_update.ir import HostUpdateNode
from jcxl._src.step_ir.program import Lit
from jcxl._src.step_ir.program import Node
from jcxl._src.step_ir.program import Program
from jcxl._src.step_ir.program import layer_of
from jcxl._src.host_update.sliced import SlicedNode
from jcxl._src.host_update.sliced import evaluate_slice
from jcxl._src.pool_array import PoolArray
from jcxl._src.pool_array import RowBlocks
from jcxl._src.stream import fetch
from jcxl._src.stream import fetch_done
from jcxl._src.stream import fetch_start
from jcxl._src.stream import read_mark
from jcxl._src.stream import store
from jcxl._src.stream import store_done
from jcxl._src.stream import store_start
from jcxl._src.stream import streamed_scan
from jcxl._src.stream import update_done
from jcxl._src.stream import update_start


# ------------------------------------------------------------ interpreter


class Interpreter:
  """Evaluates the flat program with streaming, under jit."""

  def __init__(self, program: Program, fetches: FetchClusters,
               values: dict[Any, Any], schedule: schedule_lib.LayerSchedule,
               stores: dict[Any, PoolArray], store_after: dict[Any, int],
               async_update: bool = False):
    self.program = program
    self.async_update = async_update  # cxl_offload's
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
    self.host_updates = [n for n in program.nodes
                         if isinstance(n, HostUpdateNode)]
    gradients = {k for n in self.host_updates for k in n.grads}
    # Reads a store must wait for that nothing else orders before it.
    self.unordered = unordered_reads(
        program, fetches,
        {k: t for k, t in stores.items() if k not in gradients})
    self.marked = {id(c) for cs in self.unordered.values() for c in cs}
    # A host update overwrites state in place: every device read of it
    # must be done first.
    overwritten = {k for n in self.host_updates for k in n.overwritten}
    self.marked |= {id(c) for c in fetches.clusters if c.key in overwritten}
    self.store_token_of: dict[Any, Any] = {}
    self.updates_in_flight: list[Any] = []
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
          self.marks[id(c)] = read_mark(self.fetched[id(c)])
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
    n_consts, n_carry = jax_compat.scan_counts(params)
    body = params["jaxpr"]
    ins = [None if pos in streamed else self._read(a, i)
           for pos, a in enumerate(node.ins)]
    consts, carry = ins[:n_consts], ins[n_consts:n_consts + n_carry]
    xs_positions = range(n_consts + n_carry, len(ins))
    weights = {str(pos): self.env[key] for pos, key in streamed.items()}
    xs = {str(pos): ins[pos] for pos in xs_positions if pos not in streamed}
    group = layer_of(self.fetches.paths[next(iter(streamed.values()))])

    def scan_body(c, w, x):
      # A weight copy's slice comes in narrower than the body takes it
      # (host_update.copies): widened, exactly.
      full = [w[str(p)].astype(body.jaxpr.invars[p].aval.dtype)
              if p in streamed else x[str(p)] for p in xs_positions]
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
      # Store tokens are a few bytes: a scalar from each is dependency enough.
      return sum((t.reshape(-1)[0] for t in tokens), jax.numpy.int32(0))

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

  def _host_update(self, node: HostUpdateNode, i: int) -> list[Any]:
    """Starts a host update once its gradients are in the pool, its
    scalars exist and the state it overwrites has been read."""
    after = []
    for key in node.grads:
      if key not in self.stored:
        self._store(key)
      while key not in self.store_token_of:
        self._store_done()
      after.append(self.store_token_of[key])
    after += [self.marks[id(c)] for c in self.fetches.clusters
              if c.key in node.overwritten and id(c) in self.marks]
    scalars = (jax.numpy.stack([
        jax.numpy.asarray(self._read(k, i), jax.numpy.float32)
        for k in node.scalars]) if node.scalars else
               jax.numpy.zeros((0,), jax.numpy.float32))
    start = lambda s, a: update_start(node.pool_id, node.program_id, s,
                                      after=a)
    mesh = _process_mesh(node)
    if mesh is not None:  # each device its own shards' run
      start = jax.shard_map(functools.partial(_start_per_device, node, mesh),
                            mesh=mesh, in_specs=(P(), P()),
                            out_specs=P(mesh.axis_names), check_vma=False)
    self.updates_in_flight.append((node.pool_id, mesh,
                                   start(scalars, after)))
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
        (key, store_start(self.stores[key], value, after=reads or None)))
    while len(self.stores_in_flight) > costmodel.STORES_IN_FLIGHT:
      self._store_done()

  def _store_done(self) -> None:
    key, pending = self.stores_in_flight.popleft()
    token = store_done(pending)
    self.store_token_of[key] = token
    self.store_tokens.append(token)

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
      elif isinstance(node, HostUpdateNode):
        outs = self._host_update(node, i)
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
    # The step ends once the pool holds its new state; or, async, once
    # the pool has its runs (what uses their objects next waits for them).
    for pool_id, mesh, pending in self.updates_in_flight:
      done = lambda t, pool_id=pool_id: update_done(
          t, pool_id=pool_id, wait=not self.async_update)
      if mesh is not None:
        done = jax.shard_map(done, mesh=mesh, in_specs=P(mesh.axis_names),
                             out_specs=P(mesh.axis_names), check_vma=False)
      self.store_tokens.append(done(pending))

  def tokens(self) -> list[jax.Array]:
    """The stores' tokens, stacked by shape and layout (a mesh's are
    stacked along a new axis: no device reads another's)."""
    groups = collections.defaultdict(list)
    for t in self.store_tokens:
      groups[(t.shape, str(getattr(t.aval, "sharding", None)))].append(t)
    return [jax.numpy.stack(g) for g in groups.values()]


def _start_per_device(node: HostUpdateNode, mesh: jax.sharding.Mesh,
                      scalars: Any, after: Any) -> jax.Array:
  """Inside shard_map: each device starts the run of its own shards'
  program. Each process traces its own step: the branches of its devices
  start theirs; the others' never run here."""
  programs = dict(node.program_ids)

  def branch(device):
    if device.id not in programs:
      return lambda s, a: jax.numpy.zeros((2,), jax.numpy.int32)
    return lambda s, a: update_start(node.pool_id, programs[device.id], s,
                                     after=a)
  position = jax.lax.axis_index(mesh.axis_names)
  return jax.lax.switch(position, [branch(d) for d in mesh.devices.flat],
                        scalars, after)


def _process_mesh(node: HostUpdateNode) -> jax.sharding.Mesh | None:
  """The mesh of a host update's state where it spans processes (a run
  per device, see _start_per_device), else None (one device: one run)."""
  sharding = next(iter(node.writes.values())).sharding
  devices = sharding.device_set
  if len({d.process_index for d in devices}) < 2:
    return None
  return sharding.mesh
