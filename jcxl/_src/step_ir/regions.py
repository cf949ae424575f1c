"""Regions of elementwise work in a flat program, as the passes that move an
optimizer's update find them: the sliced update (a loop over the layers of
stacked state) and the host update (the update run next to the memory).

Both start from the elementwise equations that read pool state, keep the
work whose results stay inside the region or go back to the pool (`trim`),
and take in the elementwise work that only feeds it (`absorb`).
"""

from __future__ import annotations

import collections
from typing import Any, Callable

from jcxl._src import update_program as up
from jcxl._src.step_ir.program import Lit
from jcxl._src.step_ir.program import Node
from jcxl._src.step_ir.program import Program

# Every op the host update runs (the C++ core's table, ffi/update_ops.h),
# and the elementwise primitives only XLA computes (the sliced update's).
ELEMENTWISE = frozenset(up.PRIMITIVE_OPS) | frozenset({
    "copy_p", "erf", "exp", "expm1", "log", "log1p", "logistic", "pow",
    "tanh", "broadcast_in_dim"})


def full_shape(node: Node) -> tuple[int, ...] | None:
  """The one shape of a node's results (None if they differ)."""
  shapes = {tuple(v.aval.shape) for v in node.eqn.outvars}
  return shapes.pop() if len(shapes) == 1 else None


def elementwise_shape(node: Node) -> tuple[int, ...] | None:
  """The one shape an elementwise node computes on (its results' and each
  of its array inputs'; a broadcast only of a scalar), or None where the
  node is not such work."""
  if node.eqn is None or node.eqn.primitive.name not in ELEMENTWISE:
    return None
  shape = full_shape(node)
  if not shape:
    return None
  if node.eqn.primitive.name == "broadcast_in_dim":
    return shape if tuple(node.eqn.invars[0].aval.shape) == () else None
  if any(tuple(v.aval.shape) not in ((), shape) for v in node.eqn.invars):
    return None
  return shape


class Uses:
  """Producers and consumers of a flat program's values."""

  def __init__(self, program: Program):
    self.program = program
    self.producer: dict[Any, int] = {}
    self.consumers: dict[Any, set[int]] = collections.defaultdict(set)
    for n, node in enumerate(program.nodes):
      for key in node.outs:
        self.producer[key] = n
      for atom in node.ins:
        key = program.resolve(atom)
        if not isinstance(key, Lit):
          self.consumers[key].add(n)

  def ins(self, n: int) -> list[Any]:
    return [self.program.resolve(a) for a in self.program.nodes[n].ins]


def trim(uses: Uses, region: set[int],
         returned: Callable[[int, Any], bool]) -> dict[int, int]:
  """Drops from `region` (in place) the nodes whose results are read by
  work outside it, or that `returned(node, key)` says leave the step, until
  none is left.

  Returns:
    Per node dropped, the consumer outside that dropped it (-1: returned).
  """
  dropped: dict[int, int] = {}
  changed = True
  while changed:
    changed = False
    for n in sorted(region):
      for key in uses.program.nodes[n].outs:
        outside = [c for c in uses.consumers.get(key, ()) if c not in region]
        if outside or returned(n, key):
          region.discard(n)
          dropped[n] = outside[0] if outside else -1
          changed = True
          break
  return dropped


def absorb(uses: Uses, region: set[int], elementwise: Callable[[int], bool],
           outputs: set[Any], allow: Callable[[int], bool] = lambda n: True
           ) -> None:
  """Takes into `region` (in place) the elementwise work, not among the
  step's `outputs`, whose results only the region reads (and that `allow`
  allows), until there is none left."""
  changed = True
  while changed:
    changed = False
    for n in range(len(uses.program.nodes) - 1, -1, -1):
      outs = uses.program.nodes[n].outs
      if n in region or not elementwise(n) or any(k in outputs for k in outs):
        continue
      users = set().union(*(uses.consumers.get(k, set()) for k in outs))
      if users and users <= region and allow(n):
        region.add(n)
        changed = True
