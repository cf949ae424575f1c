"""Elementwise work on stacked or large state, run as a loop over slices.

In a step over scanned (stacked) layers the optimizer update is elementwise
on whole ``[L, ...]`` arrays: done as traced, it would bring every layer's
parameters and optimizer state onto the device at once. A large table (a
token embedding) has the same problem on its own. This pass finds that work
(elementwise equations reading such pool-resident state, whose results feed
only each other or are stored back into the pool) and replaces it with one
loop that fetches slice ``i`` of the state, computes slice ``i`` of every
result and stores it back. A slice is a layer of stacked state, or a block
of rows (about ``ROW_BLOCK_BYTES``) of a table of at least
``ROW_SLICE_MIN_BLOCKS`` blocks.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from jcxl._src import jax_compat
from jcxl._src.pool_array import PoolArray
from jcxl._src.step_ir.program import Lit
from jcxl._src.step_ir.program import Node
from jcxl._src.step_ir.program import Program
from jcxl._src.step_ir.regions import Uses
from jcxl._src.step_ir.regions import absorb
from jcxl._src.step_ir.regions import elementwise_shape
from jcxl._src.step_ir.regions import full_shape
from jcxl._src.step_ir.regions import trim

ROW_BLOCK_BYTES = 4 << 20  # a block of a table's rows, per shard
ROW_SLICE_MIN_BLOCKS = 4   # smaller tables are updated whole


@dataclasses.dataclass(eq=False)
class SlicedNode(Node):
  """The loop that replaces a region: reads `ins`, writes the pool."""
  region: list[Node] = dataclasses.field(default_factory=list)
  length: int = 0  # full slices
  rows: int = 0  # 0: a slice is a layer; else a block of this many rows
  tail: int = 0  # rows of a last, shorter block (0: none)
  pool_keys: list[Any] = dataclasses.field(default_factory=list)
  stacked_keys: list[Any] = dataclasses.field(default_factory=list)
  stores: dict[Any, PoolArray] = dataclasses.field(default_factory=dict)

  @property
  def iterations(self) -> int:
    return self.length + (self.tail > 0)


def _layer_axis_unsharded(x: PoolArray) -> bool:
  spec = getattr(x.sharding, "spec", None)
  return not spec or spec[0] is None


def block_rows(x: PoolArray) -> int:
  """Rows per block when slicing `x` by rows; 0 if `x` is updated whole."""
  shape = x.shard_shape
  if len(shape) < 1 or not _layer_axis_unsharded(x):
    return 0
  row_bytes = max(1, int(np.prod(shape[1:])) * x.dtype.itemsize)
  rows = max(1, ROW_BLOCK_BYTES // row_bytes)
  return rows if shape[0] >= ROW_SLICE_MIN_BLOCKS * rows else 0


def slice_state_updates(program: Program, resident: dict[Any, Any],
                        stores: dict[Any, PoolArray]) -> set[Any]:
  """Replaces elementwise work on stacked or large pool state with loops.

  Returns:
    The output keys the loops store (no longer stored by the caller).
  """
  # Stacked state: pool-resident arrays that a scan takes as its per-layer
  # xs (the scanned layers' parameters and, by shape, their moments).
  scanned_shapes = set()
  for node in program.nodes:
    if node.eqn is not None and node.eqn.primitive.name == "scan":
      first_xs = sum(jax_compat.scan_counts(node.eqn.params))
      for atom in node.ins[first_xs:]:
        key = program.resolve(atom)
        if isinstance(resident.get(key), PoolArray):
          scanned_shapes.add(resident[key].shape)
  pooled = {k: v for k, v in resident.items() if isinstance(v, PoolArray)}
  stacked = {k: v for k, v in pooled.items()
             if v.shape in scanned_shapes and _layer_axis_unsharded(v)}
  # Large tables, one loop per shape (a parameter and its moments).
  tables = collections.defaultdict(dict)
  for k, v in pooled.items():
    if k not in stacked and block_rows(v):
      tables[v.shape][k] = v
  stored = set()
  for group, rows in [(stacked, 0)] + [
      (g, block_rows(next(iter(g.values())))) for g in tables.values()]:
    if group:
      stored |= _slice_group(program, resident, stores, group, rows)
  return stored


def _slice_group(program: Program, resident: dict[Any, Any],
                 stores: dict[Any, PoolArray], stacked: dict[Any, PoolArray],
                 rows: int) -> set[Any]:
  """One loop over the slices of `stacked` (layers, or blocks of `rows`)."""
  uses = Uses(program)
  producer, consumers = uses.producer, uses.consumers
  outputs = set(k for k in program.outputs if not isinstance(k, Lit))
  def elementwise(n):
    """Whether node n is elementwise on one [L, ...] shape (and scalars)."""
    node = program.nodes[n]
    if elementwise_shape(node) is None:
      return False
    # Its arrays are computed or stacked state: not literals, not other
    # pool values.
    for atom, var in zip(node.ins, node.eqn.invars):
      key = program.resolve(atom)
      if tuple(var.aval.shape) and (isinstance(key, Lit) or (
          key in resident and key not in stacked)):
        return False
    return True

  region: set[int] = set()
  for n, node in enumerate(program.nodes):
    if elementwise(n) and any(
        program.resolve(a) in stacked or
        producer.get(program.resolve(a)) in region
        for a in node.ins if not isinstance(program.resolve(a), Lit)):
      region.add(n)
  # Keep only work whose results stay inside the region or go to the pool.
  trim(uses, region, lambda n, key: key in outputs and not (
      key in stores and stores[key].shape == full_shape(program.nodes[n])))
  # Take in the elementwise work that only feeds the region (e.g. the
  # squared gradients of a second moment): it is sliced too, instead of
  # leaving whole [L, ...] temporaries on the device.
  absorb(uses, region, elementwise, outputs)
  if not region:
    return set()
  lengths = {full_shape(program.nodes[n])[0] for n in region}
  last = max(region)
  used = {program.resolve(a) for n in region for a in program.nodes[n].ins}
  pool_keys = sorted((k for k in used if k in stacked), key=str)
  if len(lengths) != 1 or any(
      stacked[k].shape[0] not in lengths for k in pool_keys):
    return set()
  # The old state must have no use left once the loop has stored the new.
  stored = {k: stores[k] for n in region for k in program.nodes[n].outs
            if k in stores}
  for key, target in stored.items():
    old = next(k for k, v in resident.items() if v is target)
    if any(c > last and c not in region for c in consumers.get(old, ())):
      return set()
  region_outs = {k for n in region for k in program.nodes[n].outs}
  stacked_keys = sorted(
      (k for k in used if not isinstance(k, Lit) and k not in stacked and
       k not in region_outs and any(
           tuple(v.aval.shape) and tuple(v.aval.shape)[0] in lengths
           for n in region for a, v in zip(program.nodes[n].ins,
                                           program.nodes[n].eqn.invars)
           if program.resolve(a) == k)), key=str)
  scalars = [k for k in used if not isinstance(k, Lit) and
             k not in stacked and k not in region_outs and
             k not in stacked_keys]
  length = lengths.pop()
  loop = SlicedNode(eqn=None, ins=pool_keys + stacked_keys + scalars,
                    outs=[], region=[program.nodes[n] for n in sorted(region)],
                    length=length // rows if rows else length, rows=rows,
                    tail=length % rows if rows else 0, pool_keys=pool_keys,
                    stacked_keys=stacked_keys, stores=stored)
  nodes = []
  for n, node in enumerate(program.nodes):
    if n == last:
      nodes.append(loop)
    elif n not in region:
      nodes.append(node)
  program.nodes = nodes
  return set(stored)


def evaluate_slice(loop: SlicedNode, program: Program, values: dict[Any, Any],
                   layer_weights: dict[str, Any], layer_inputs: dict[str, Any],
                   rows: int = 0) -> dict[Any, Any]:
  """Runs the region on one slice (a layer, or a block of `rows` rows);
  returns the values of the stored keys."""
  env = dict(values)
  for j, key in enumerate(loop.pool_keys):
    env[key] = layer_weights[str(j)]
  for j, key in enumerate(loop.stacked_keys):
    env[key] = layer_inputs[str(j)]
  for node in loop.region:
    args = []
    for atom in node.ins:
      key = program.resolve(atom)
      args.append(key.value if isinstance(key, Lit) else env[key])
    params = {}
    if node.eqn.primitive.name == "broadcast_in_dim":
      shape = tuple(node.eqn.params["shape"][1:])
      params = {"shape": (rows,) + shape if rows else shape,
                "broadcast_dimensions": ()}
    outs = jax_compat.bind(node.eqn, args, **params)
    for key, value in zip(node.outs, outs):
      env[key] = value
  return {key: env[key] for key in loop.stores}

