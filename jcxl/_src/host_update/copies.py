"""bfloat16 copies of float32 master weights, written by the host update.

A step that computes in bfloat16 from float32 master weights casts each
weight as its first act (``w.astype(jnp.bfloat16)``, flax's ``dtype=``).
Where a weight's update runs on the host and every use the step makes of
the weight is that cast, the device never needs the float32 value: the
host update also writes the new weight, rounded to bfloat16, into a copy
the pool keeps beside the master (``Pool.allocate_copy``), and the step
fetches the copy in place of the master and its cast. 2 bytes a parameter
come in instead of 4, and the values are the same bits: the cast rounds to
nearest even on the device, as the copy does on the host.

A stacked weight that a ``lax.scan`` streams layer by layer counts where
the loop's body only casts its slice: the loop then streams the copy's
slices, widened back to float32 at the body's door (exact, and the body's
own cast gives the copy's bits back).

The pool keeps each copy fresh: anything else that writes the master (a
`put`, a checkpoint's restore, a step with its update on the device) makes
the next read of the copy convert the master anew.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jcxl._src import jax_compat
from jcxl._src.host_update.ir import HostUpdateNode
from jcxl._src.host_update.ir import WeightCopy
from jcxl._src.pool_array import PoolArray
from jcxl._src.step_ir.program import Node
from jcxl._src.step_ir.program import Program
from jcxl._src.step_ir.regions import Uses
from jcxl._src.units import format_bytes

# The dtypes a copy may be in (the pool's update programs write these).
_COPY_DTYPES = frozenset({"bfloat16"})


def _cast_dtype(node: Node) -> str | None:
  eqn = node.eqn
  if eqn is None or eqn.primitive.name != "convert_element_type":
    return None
  return str(np.dtype(eqn.outvars[0].aval.dtype))


def _casts_in(jaxpr: Any, var: Any) -> set[str | None]:
  """The dtypes `jaxpr` casts `var` to, or a None among them where it
  uses `var` otherwise (returns it, or computes with it)."""
  dtypes: set[str | None] = set()
  if any(v is var for v in jaxpr.outvars):
    dtypes.add(None)
  for eqn in jaxpr.eqns:
    if not any(v is var for v in eqn.invars):
      continue
    if eqn.primitive.name == "convert_element_type":
      dtypes.add(str(np.dtype(eqn.outvars[0].aval.dtype)))
    else:
      dtypes.add(None)
  return dtypes


def _uses(program: Program, node: Node, source: Any
          ) -> tuple[set[str | None], list[int]]:
  """How `node` uses `source`: the dtypes it casts it to (None: some
  other way), and the xs positions of a scan whose body only casts its
  slice there."""
  dtype = _cast_dtype(node)
  if dtype is not None:
    return {dtype}, []
  eqn = node.eqn
  positions = [p for p, a in enumerate(node.ins)
               if program.resolve(a) == source]
  if eqn is None or eqn.primitive.name != "scan":
    return {None}, []
  first_xs = sum(jax_compat.scan_counts(eqn.params))
  body = eqn.params["jaxpr"].jaxpr
  dtypes: set[str | None] = set()
  for p in positions:
    dtypes |= _casts_in(body, body.invars[p]) if p >= first_xs else {None}
  return dtypes, positions


def find(program: Program, nodes: tuple[HostUpdateNode, ...],
         resident: dict[Any, Any], returned: set[Any]
         ) -> tuple[HostUpdateNode, ...]:
  """The host updates (`nodes`, already in `program`), each with its
  candidate copies (``node.copies``): the float32 weights it writes whose
  every other use in the step is one cast to a copy dtype (`returned`:
  the values the step returns, which must stay as they are)."""
  consumers = Uses(program).consumers
  outputs = returned
  source_of = {id(v): k for k, v in resident.items()
               if isinstance(v, PoolArray)}
  found = []
  for node in nodes:
    copies = []
    for new_value, target in node.writes.items():
      source = source_of.get(id(target))
      uses = [program.nodes[n] for n in sorted(consumers.get(source, ()))]
      dtypes, casts, scans = set(), [], []
      for n in uses:
        how, positions = _uses(program, n, source)
        dtypes |= how
        if positions:
          scans += [(n, p) for p in positions]
        elif _cast_dtype(n) is not None:
          casts.append(n)
      if (source is None or str(target.dtype) != "float32" or
          source in outputs or not uses or len(dtypes) != 1 or
          not dtypes <= _COPY_DTYPES or
          any(o in outputs for n in casts for o in n.outs)):
        continue
      copies.append(WeightCopy(
          source=source, new_value=new_value, key=("copy", source),
          dtype=np.dtype(dtypes.pop()), casts=tuple(casts),
          scans=tuple(scans), target=target))
    found.append(dataclasses.replace(node, copies=tuple(copies)))
  return tuple(found)


def apply(program: Program, nodes: tuple[HostUpdateNode, ...]
          ) -> tuple[HostUpdateNode, ...]:
  """Puts the copies the host updates were given objects for into
  `program`: each cast of a master becomes a read of its copy, a
  pool-resident value the step fetches (and the host update writes).

  Returns:
    The host updates, each overwriting its copies too: their reads must
    be done before its run.
  """
  removed = set()
  out = []
  for node in nodes:
    for c in node.copies:
      for cast in c.casts:
        program.alias[cast.outs[0]] = c.key
        removed.add(id(cast))
      for scan, position in c.scans:  # widened in the loop (Interpreter)
        scan.ins[position] = c.key
    out.append(dataclasses.replace(node, overwritten=node.overwritten + tuple(
        c.key for c in node.copies)))
  program.nodes = [n for n in program.nodes if id(n) not in removed]
  return tuple(out)


def line(nodes: Sequence[HostUpdateNode]) -> str | None:
  """What the copies save, for the plan (None: there are none)."""
  copies = [c for n in nodes for c in n.copies]
  if not copies:
    return None
  saved = sum(c.target.nbytes - c.copy.nbytes for c in copies)
  return (f"weight copies: {len(copies)} float32 weights fetched as "
          f"{', '.join(sorted({str(c.dtype) for c in copies}))} copies "
          f"the host update writes ({format_bytes(saved)} less per fetch)")
