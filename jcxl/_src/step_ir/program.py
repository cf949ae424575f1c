"""The flat program cxl_offload interprets: a traced step's jaxpr with its
call-like equations inlined, and the reordering that lets each layer's
optimizer update run as soon as its gradient exists."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re
from typing import Any

from jcxl._src import jax_compat

# Call-like primitives whose bodies are inlined into the flat program (the
# step is already differentiated, so custom rules are no longer needed).
INLINE = frozenset({"jit", "pjit", "closed_call", "core_call",
                    "custom_jvp_call", "custom_vjp_call",
                    "custom_vjp_call_jaxpr"})
# Rematerialization (jax.checkpoint, nn.remat, nnx.remat), by the names its
# primitive has had across JAX releases. Inlined as JAX lowers it: the
# recomputation's inputs pass an optimization barrier, so XLA cannot merge
# it with the forward pass and keep its activations after all.
REMAT = frozenset({"remat2", "checkpoint", "remat", "remat_call"})


def group_of(path: str) -> str:
  """The module path of a leaf: its path without the last key."""
  cut = path.rfind("[")
  return path[:cut] if cut > 0 else path


@dataclasses.dataclass
class Node:
  eqn: Any
  ins: list[Any]   # keys or Lit
  outs: list[Any]  # keys
  # The rematerialized block the node recomputes (its inlined scope), or
  # 0: a pool-resident value is fetched anew for each block, not kept.
  remat: int = 0


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity
class Lit:
  value: Any


class Program:
  """A jaxpr with call-like equations inlined, variables keyed by scope."""

  def __init__(self, closed_jaxpr: Any, num_inputs: int):
    self.nodes: list[Node] = []
    self.alias: dict[Any, Any] = {}
    self.consts: dict[Any, Any] = {}
    # An inlined scope -> (its caller's scope, the call equation).
    self.callers: dict[int, tuple[int, Any]] = {}
    self._scopes = itertools.count(1)
    literal = jax_compat.literal_type()
    self._literal = literal
    inputs = [("in", i) for i in range(num_inputs)]
    self._walk(closed_jaxpr.jaxpr, 0, inputs, list(closed_jaxpr.consts), 0)
    self.outputs = [self.resolve(self._atom(0, v))
                    for v in closed_jaxpr.jaxpr.outvars]

  def _atom(self, scope, v):
    return Lit(v.val) if isinstance(v, self._literal) else (scope, v)

  def _walk(self, jaxpr, scope, in_atoms, const_values, remat):
    for v, value in zip(jaxpr.constvars, const_values):
      self.consts[(scope, v)] = value
    for v, a in zip(jaxpr.invars, in_atoms):
      self.alias[(scope, v)] = a
    for eqn in jaxpr.eqns:
      ins = [self._atom(scope, a) for a in eqn.invars]
      name = eqn.primitive.name
      sub = (jax_compat.sub_jaxpr(eqn) if name in INLINE | REMAT else None)
      if sub is not None:
        inner, inner_consts = sub
        inner_scope = next(self._scopes)
        self.callers[inner_scope] = (scope, eqn)
        inner_remat = remat
        if name in REMAT:
          inner_remat = inner_scope
          if (eqn.params.get("differentiated", True) and
              eqn.params.get("prevent_cse", True)):
            ins = self._barrier(ins, inner_scope)
        self._walk(inner, inner_scope, ins, inner_consts, inner_remat)
        for o, inner_o in zip(eqn.outvars, inner.outvars):
          self.alias[(scope, o)] = self._atom(inner_scope, inner_o)
      else:
        self.nodes.append(Node(eqn, ins, [(scope, o) for o in eqn.outvars],
                               remat))

  def _barrier(self, ins, remat):
    """`ins` through an optimization barrier (literals as they are)."""
    values = [a for a in ins if not isinstance(a, Lit)]
    if not values:
      return ins
    eqn = jax_compat.barrier_eqn([a[1].aval for a in values])
    outs = [(remat, o) for o in eqn.outvars]
    self.nodes.append(Node(eqn, values, outs, remat))
    passed = iter(outs)
    return [a if isinstance(a, Lit) else next(passed) for a in ins]

  def new_scope(self) -> int:
    """A scope no traced equation's variables are keyed by."""
    return next(self._scopes)

  def resolve(self, atom):
    while not isinstance(atom, Lit) and atom in self.alias:
      atom = self.alias[atom]
    return atom


def layer_of(path: str) -> str:
  """The parameter layer a state leaf belongs to: optimizer-state prefixes
  (``[0].mu``) dropped, then the module path.

  An NNX module's attribute path (``.blocks[0].attn.kernel.value``) is
  read as the dict path its optimizer state has
  (``['blocks'][0]['attn']['kernel']``), so the two share a layer.
  """
  cut = path.find("['")
  if cut < 0 and path.endswith(".value"):  # an NNX Variable's
    path = re.sub(r"\.([A-Za-z_]\w*)", r"['\1']", path[:-len(".value")])
    cut = path.find("['")
  return group_of(path[cut:] if cut >= 0 else path)


def reorder_by_layer(program: Program, output_layers: list[str | None],
                     state_inputs: set[Any]) -> None:
  """Reorders the program so each layer's update runs as soon as it can.

  In a traced train step an optimizer's work comes in stages over all
  leaves (every first moment, then every second moment, ...), so every
  leaf's new state would be live at once. A depth-first emission from the
  outputs, each layer's outputs taken in the order in which the work they
  share with other layers (the forward and backward passes) completes,
  finishes one layer's update before the next layer's starts.
  """
  producer = {}
  for n, node in enumerate(program.nodes):
    for key in node.outs:
      producer[key] = n

  inputs = []
  for node in program.nodes:
    keys = (program.resolve(a) for a in node.ins)
    inputs.append([producer[k] for k in keys
                   if not isinstance(k, Lit) and k in producer])

  # Work on the batch (forward, backward, a global gradient norm) orders the
  # layers; work on state alone (a step count, a schedule) can run anytime.
  on_data = []
  for n, node in enumerate(program.nodes):
    keys = [program.resolve(a) for a in node.ins]
    on_data.append(any(
        not isinstance(k, Lit) and (
            (k in producer and on_data[producer[k]]) or
            (k not in producer and k not in state_inputs and k[0] == "in"))
        for k in keys))

  # Which layers' outputs each node feeds, as a bitset: one pass from the
  # outputs back (nodes are in topological order).
  bit_of = {}
  feeds = [0] * len(program.nodes)
  final = {}  # output index -> its producer
  for j, key in enumerate(program.outputs):
    if isinstance(key, Lit) or key not in producer:
      continue
    final[j] = producer[key]
    layer = bit_of.setdefault(output_layers[j], 1 << len(bit_of))
    feeds[producer[key]] |= layer
  for n in range(len(program.nodes) - 1, -1, -1):
    if feeds[n]:
      for m in inputs[n]:
        feeds[m] |= feeds[n]

  # A layer's outputs go together, once all the work they share with other
  # layers is done.
  ready = collections.defaultdict(lambda: -1)
  for n in range(len(program.nodes)):
    if on_data[n] and feeds[n] and feeds[n] & (feeds[n] - 1):  # shared
      for layer, bit in bit_of.items():
        if feeds[n] & bit:
          ready[layer] = n
  rank = lambda j: (ready[output_layers[j]], j)

  order, emitted = [], set()
  for j in sorted(final, key=rank):
    stack = [(final[j], False)]
    while stack:  # iterative post-order, inputs in program order
      n, expanded = stack.pop()
      if n in emitted:
        continue
      if expanded:
        emitted.add(n)
        order.append(n)
        continue
      stack.append((n, True))
      for m in sorted(set(inputs[n]), reverse=True):
        if m not in emitted:
          stack.append((m, False))
  order += [n for n in range(len(program.nodes)) if n not in emitted]
  program.nodes = [program.nodes[n] for n in order]


