"""The analysis of a traced step: what `cxl_offload` learns about a step
and its arguments before it rewrites it.

`prepare` traces the step on the arguments' abstract values and finds which
outputs are written back into which pool-resident (or pinned) arguments;
`analyze` traces it again into a flat `Program` and finds each pool leaf's
fetch clusters, the stores and when each is issued, and the step's layer
timeline for the cost model.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Any, Callable

import jax
from flax import nnx

from jcxl._src import call_args
from jcxl._src import registry
from jcxl._src import shardings as shardings_lib
from jcxl._src.schedules import costmodel
from jcxl._src.errors import PoolExhaustedError
from jcxl._src.host_update import choose as host_update_choose
from jcxl._src.host_update import runtime as host_update_runtime
from jcxl._src.host_update import scan_casts
from jcxl._src.host_update.ir import UpdateChoice
from jcxl._src.host_update.plan import plan_host_updates
from jcxl._src.offload.clusters import FetchClusters
from jcxl._src.offload.clusters import Refetch
from jcxl._src.host_update.ir import HostUpdateNode
from jcxl._src.step_ir.program import Lit
from jcxl._src.step_ir.program import Node
from jcxl._src.step_ir.program import Program
from jcxl._src.step_ir.program import layer_of
from jcxl._src.step_ir.program import reorder_by_layer
from jcxl._src.host_update.sliced import slice_state_updates
from jcxl._src.pool_array import PoolArray
from jcxl._src.pool_array import closed_over_refused
from jcxl._src.tree_diff import first_difference
from jcxl._src.tree_diff import leaf_paths
from jcxl._src.tree_diff import short as short_tree

is_pool_array = lambda x: isinstance(x, PoolArray)


def is_pinned(x: Any) -> bool:
  sharding = getattr(x, "sharding", None)
  return getattr(sharding, "memory_kind", None) == "pinned_host"


@dataclasses.dataclass(frozen=True)
class Pinned:
  """A leaf in JAX's pinned_host memory kind; moved with device_put."""
  sharding: Any


@dataclasses.dataclass(frozen=True)
class Prepared:
  """What the traced step knows of the concrete arguments."""
  fn: Callable[..., Any]  # the traced function: the step, then its arguments
  avals: Any
  pinned: dict[int, Pinned]
  # Output leaf -> the state argument leaf it is written into. The traced
  # function's outputs are the step's, then every argument leaf as the step
  # left it (an NNX module updated in place), matched to the arguments by
  # key path.
  targets: dict[int, int]
  out_tree: Any
  out_shardings: list[Any]  # per output leaf: a Sharding, or None
  # Output leaf -> the argument leaf, for device (and pinned) NNX Variables
  # the step updated in place: returned after the step's outputs, in this
  # order, and set into the caller's Variables (as nnx.jit does).
  written: dict[int, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Analysis:
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
  host_updates: list[HostUpdateNode] = dataclasses.field(default_factory=list)
  # Per layer with pool state it writes: where its update runs, and why.
  update_paths: dict[str, UpdateChoice] = dataclasses.field(
      default_factory=dict)


def _with_arguments_after(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn`, also returning its arguments as it left them: a mutable pytree
  (an NNX module) updated in place shows its new leaves there."""
  def traced(*args):
    return fn(*args), args
  return traced


def _is_update(out: Any, arg: Any, donated: bool) -> bool:
  """Whether output `out` is meant as argument `arg`'s new value: of the
  same type at the top (a dict sharing a key with it; the same dataclass,
  module or sequence type), or, for a single array, of the same shape and
  dtype where the argument is donated. An output of another kind (an eval
  step's metrics) leaves the argument read-only.

  A single array's kind says nothing of intent (`predict(w, x) -> x @ w`
  with a square `w` returns one of its shape), so only donation, which
  gives the argument's buffer up as under jax.jit, lets it be rewritten.
  """
  if isinstance(arg, jax.ShapeDtypeStruct):
    return (donated and isinstance(out, jax.ShapeDtypeStruct) and
            tuple(out.shape) == tuple(arg.shape) and out.dtype == arg.dtype)
  if isinstance(arg, collections.abc.Mapping):
    return (isinstance(out, collections.abc.Mapping) and
            bool(set(out) & set(arg)))
  return type(out) is type(arg)


def avals_of(tree: Any) -> Any:
  def aval(x):
    if isinstance(x, PoolArray):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    x = jax.numpy.asarray(x) if not hasattr(x, "shape") else x
    sharding = getattr(x, "sharding", None)
    if is_pinned(x):
      sharding = sharding.with_memory_kind("device")
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return jax.tree_util.tree_map(aval, tree, is_leaf=is_pool_array)


def prepare(bound: call_args.BoundCall, out_shardings: Any, name: str
            ) -> Prepared:
  """What the traced step needs to know about the concrete arguments
  (`out_shardings` as ``cxl_offload``'s; `name`: the step's, for errors)."""
  args = bound.args
  with_paths = jax.tree_util.tree_flatten_with_path(
      args, is_leaf=is_pool_array)[0]
  flat = [leaf for _, leaf in with_paths]
  for leaf in flat:
    if isinstance(leaf, PoolArray):
      leaf.check_handles()
  names = [bound.leaf_name(path) for path, _ in with_paths]
  avals = avals_of(args)
  fn = _with_arguments_after(bound.fn)
  with closed_over_refused():
    closed, (out_shape, after) = jax.make_jaxpr(fn, return_shape=True)(
        *avals)
  targets = _state_targets(bound, out_shape, name)
  position = {id(leaf): i for i, leaf in enumerate(flat)}
  targets = {j: position[id(t)] for j, t in targets.items()}
  num_out = len(jax.tree_util.tree_leaves(out_shape))
  in_place, written = _updated_in_place(
      closed.jaxpr, avals, after, num_out, flat, set(targets.values()),
      variables_of(args))
  targets.update(in_place)
  _check_aliases(name, flat, names, set(targets.values()))
  out_shardings = shardings_lib.flat_shardings(
      out_shardings, out_shape, "out_shardings")
  for j, i in targets.items():  # state is written back where it lives
    if j < num_out:
      t = flat[i]
      shardings_lib.check_state(
          out_shardings[j], t, t._what() if isinstance(t, PoolArray) else
          f"pinned_host state (output leaf {j})")
  return Prepared(
      fn=fn,
      avals=avals,
      pinned={i: Pinned(leaf.sharding) for i, leaf in enumerate(flat)
              if is_pinned(leaf)},
      targets=targets,
      out_tree=jax.tree_util.tree_structure(out_shape),
      out_shardings=out_shardings,
      written=written)


def variables_of(args: Any) -> list[Any]:
  """Per argument leaf (pool arrays as leaves), the NNX Variable holding
  it as its one leaf, else None."""
  is_leaf = lambda x: isinstance(x, (PoolArray, nnx.Variable))
  owners = []
  for x in jax.tree_util.tree_leaves(args, is_leaf=is_leaf):
    if not isinstance(x, nnx.Variable):
      owners.append(None)
      continue
    n = len(jax.tree_util.tree_leaves(x, is_leaf=is_pool_array))
    owners.extend([x] if n == 1 else [None] * n)
  return owners


def _updated_in_place(jaxpr: Any, avals: Any, after: Any, num_out: int,
                      flat: list[Any], returned: set[int],
                      variables: list[Any]
                      ) -> tuple[dict[int, int], dict[int, int]]:
  """Output index -> argument leaf, for the pool arrays the step updated
  in place (an NNX module's, a step returning None) and did not return;
  and the same for the NNX Variables off the pool it updated in place.

  The traced function gets containers of its own, as under jax.jit: the
  arguments as it left them are matched to the arguments by key path, and
  a leaf it moved or dropped (`batch.pop("labels")`), or another container
  leaf off the pool it changed, is not written back, as jax.jit ignores
  it.
  """
  after_at = {path: k for k, path in enumerate(leaf_paths(after))}
  targets, written = {}, {}
  for i, (path, invar) in enumerate(zip(leaf_paths(avals), jaxpr.invars)):
    k = after_at.get(path)
    if k is None or i in returned:
      continue
    if jaxpr.outvars[num_out + k] is invar:
      continue
    if isinstance(flat[i], PoolArray):
      targets[num_out + k] = i
    elif variables[i] is not None:
      written[num_out + k] = i
  return targets, written


def _check_aliases(name: str, flat: list[Any], names: list[str],
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
            f"{name} gets the same pool array as {names[first]} "
            f"and as {names[i]} ({leaf._what()}); each is written back in "
            "place, so one update would be lost: pass it once, or place a "
            "copy for the second")


def analyze(args: tuple[Any, ...], prep: Prepared,
            timed: bool = False, update: str = "device",
            bind: host_update_runtime.HostUpdates | None = None,
            refetch: bool | Refetch = True) -> Analysis:
  """Traces the step and finds its clusters, stores and timeline
  (`timed`: see ``FetchClusters.timeline``), with each layer's optimizer
  update where `update` says (see ``cxl_offload``); `bind` makes the host
  updates' objects (None: planned only, nothing made); `refetch`: whose
  weights are kept between uses far apart (a bool: see ``cxl_offload``)."""
  flat = jax.tree_util.tree_leaves(args, is_leaf=is_pool_array)
  closed = jax.make_jaxpr(prep.fn)(*prep.avals)
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(
               args, is_leaf=is_pool_array)[0]]
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
  if update != "device":  # the gradients may then leave narrower
    scan_casts.hoist(program)
  reorder_by_layer(program, output_layers, set(resident))
  stores, returned = {}, []
  num_out = prep.out_tree.num_leaves
  for j, key in enumerate(program.outputs):
    old = ("in", prep.targets[j]) if j in prep.targets else None
    target = resident.get(old)
    if isinstance(target, PoolArray):
      if key in stores and stores[key] is not target:
        # One value written into two leaves: each store needs its own key.
        key = _copy_of(program, key, target)
      if key != old:  # unchanged state: nothing to write
        stores[key] = target
    elif j < num_out or j in prep.written:  # the step's, then Variables'
      returned.append((j, key, target))
  returned_keys = {key for _, key, _ in returned if not isinstance(key, Lit)}
  state_writes = dict(stores)
  try:
    hosted = plan_host_updates(
        program, resident, stores, key_paths, returned_keys, update,
        lambda t: tier_links([t])[t.tier.value], bind)
  except PoolExhaustedError:
    if update != "auto":
      raise
    # No room for its gradients' objects: 'auto' runs where 'device' does.
    a = analyze(args, prep, timed, "device", None, refetch)
    return dataclasses.replace(
        a, update_paths=host_update_choose.no_room(a.update_paths))
  chosen, update_paths = list(hosted.nodes), dict(hosted.choices)
  for key in hosted.written:
    del stores[key]  # the host updates write these
  resident.update(hosted.copies)
  values.update(hosted.copies)
  key_paths.update(hosted.copy_paths)
  sliced = slice_state_updates(program, resident, stores)
  for key in sliced:
    del stores[key]  # the sliced loop stores these, layer by layer
  fetches = FetchClusters(program, resident, key_paths, refetch,
                          {node.layer for node in chosen})
  producer = {key: n for n, node in enumerate(program.nodes)
              for key in node.outs}
  old_key = {id(v): k for k, v in resident.items()}
  # Written once produced and once the old value has no uses left.
  store_after = {key: max(producer.get(key, -1),
                          fetches.last_use.get(old_key[id(t)], -1))
                 for key, t in stores.items()}
  _check_every_write(state_writes, stores, chosen, sliced, key_paths,
                     old_key)
  for node in chosen:  # gradients go out as soon as they exist
    for key, staging in node.staging.items():
      stores[key] = staging
      store_after[key] = producer.get(key, -1)
  return Analysis(program, fetches, resident, key_paths, values, stores,
                  store_after, returned,
                  fetches.timeline(stores, store_after, timed), chosen,
                  update_paths)


def _copy_of(program: Program, key: Any, like: PoolArray) -> Any:
  """A new key holding a copy of `key` (of `like`'s shape and dtype),
  made by a node right after the one that produces `key`."""
  eqn = jax.make_jaxpr(jax.numpy.copy)(
      jax.ShapeDtypeStruct(like.shape, like.dtype)).jaxpr.eqns[0]
  copied = (program.new_scope(), eqn.outvars[0])
  at = next((n + 1 for n, node in enumerate(program.nodes)
             if key in node.outs), 0)
  program.nodes.insert(at, Node(eqn, [key], [copied]))
  return copied


def _check_every_write(state_writes: dict[Any, PoolArray],
                       stores: dict[Any, PoolArray],
                       chosen: list[HostUpdateNode], sliced: Any,
                       key_paths: dict[Any, str], old_key: dict[int, Any]
                       ) -> None:
  """Every new state value the step makes is written back exactly once:
  by a store of the step, a host update or a sliced loop; a gradient that
  leaves for a host update is none of them (its store would take the
  state's place).

  Raises:
    RuntimeError: a write would be lost (a bug of the rewrite: refused
      rather than run with stale state).
  """
  host = {k: t for node in chosen for k, t in node.writes.items()}
  for key, target in state_writes.items():
    writers = [stores.get(key) is target, host.get(key) is target,
               key in sliced]
    gradient = any(key in node.grads for node in chosen)
    if sum(writers) != 1 or gradient:
      raise RuntimeError(
          "cxl_offload would not write back the new value of "
          f"{key_paths.get(old_key.get(id(target)), target.path)} "
          f"(store {writers[0]}, host update {writers[1]}, sliced loop "
          f"{writers[2]}, also a host update's gradient {gradient}); "
          "run this step with update='device'")


def _state_targets(bound: call_args.BoundCall, out_shape: Any, name: str
                   ) -> dict[int, Any]:
  """Output leaf index -> the pool-resident (or pinned) input it updates.

  Positional argument ``a`` holding pool-resident or pinned leaves is
  state: an output ``a`` of its kind (see ``_is_update``) must have the
  same tree structure, and is written back into it; an output of another
  kind (or none) leaves it read-only.
  """
  args = bound.args[:bound.num_positional]
  for path, leaf in jax.tree_util.tree_flatten_with_path(
      out_shape, is_leaf=is_pool_array)[0]:
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
    arg_leaves = jax.tree_util.tree_leaves(arg, is_leaf=is_pool_array)
    if any(isinstance(l, PoolArray) or is_pinned(l) for l in arg_leaves):
      arg_avals = avals_of(arg)
      if not _is_update(out, arg_avals, a in bound.donated):
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


def tier_links(resident: Any) -> dict[str, costmodel.Link]:
  """The planning view of the links of every tier the step streams from."""
  links = {}
  for x in resident:
    if isinstance(x, PoolArray) and x.tier.value not in links:
      model = registry.find_pool(x.pool_id, what=x._what()).link_estimate(
          x.tier)
      links[x.tier.value] = costmodel.Link(model.bandwidth, model.latency_s)
  return links
