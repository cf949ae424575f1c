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

The pool keeps each copy fresh: anything else that writes the master (a
`put`, a checkpoint's restore, a step with its update on the device) makes
the next read of the copy convert the master anew.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from jcxl._src.offload.program import Lit
from jcxl._src.offload.program import Node
from jcxl._src.offload.program import Program
from jcxl._src.pool_array import PoolArray
from jcxl._src.units import format_bytes

# The dtypes a copy may be in (the pool's update programs write these).
_COPY_DTYPES = frozenset({"bfloat16"})


@dataclasses.dataclass(eq=False)
class WeightCopy:
  """A weight the step reads only through one cast, and the copy that
  stands in for that cast."""
  source: Any       # the master weight's key (a step argument)
  new_value: Any    # the key of its new value, which the host update writes
  key: Any          # the copy's key in the program
  dtype: np.dtype
  casts: list[Node]
  target: PoolArray  # the master's object
  copy: PoolArray | None = None  # made by `HostUpdates.bind`


def _cast_dtype(node: Node) -> str | None:
  eqn = node.eqn
  if eqn is None or eqn.primitive.name != "convert_element_type":
    return None
  return str(np.dtype(eqn.outvars[0].aval.dtype))


def find(program: Program, nodes: list[Any], resident: dict[Any, Any],
         returned: set[Any]) -> None:
  """Gives each host update (`nodes`, already in `program`) its
  candidate copies (``node.copies``): the float32 weights it writes whose
  every other use in the step is one cast to a copy dtype (`returned`:
  the values the step returns, which must stay as they are)."""
  consumers: dict[Any, list[Node]] = collections.defaultdict(list)
  for n in program.nodes:
    for atom in n.ins:
      key = program.resolve(atom)
      if not isinstance(key, Lit):
        consumers[key].append(n)
  outputs = returned
  source_of = {id(v): k for k, v in resident.items()
               if isinstance(v, PoolArray)}
  for node in nodes:
    node.copies = []
    for new_value, target in node.writes.items():
      source = source_of.get(id(target))
      uses = consumers.get(source, [])
      dtypes = {_cast_dtype(n) for n in uses}
      if (source is None or str(target.dtype) != "float32" or
          source in outputs or not uses or len(dtypes) != 1 or
          not dtypes <= _COPY_DTYPES or
          any(o in outputs for n in uses for o in n.outs)):
        continue
      node.copies.append(WeightCopy(
          source=source, new_value=new_value, key=("copy", source),
          dtype=np.dtype(dtypes.pop()), casts=list(uses), target=target))


def apply(program: Program, nodes: list[Any], resident: dict[Any, Any],
          values: dict[Any, Any], key_paths: dict[Any, str]) -> None:
  """Puts the copies the host updates were given objects for into
  `program`: each cast of a master becomes a read of its copy, a
  pool-resident value the step fetches (and the host update writes)."""
  removed = set()
  for node in nodes:
    for c in node.copies:
      resident[c.key] = values[c.key] = c.copy
      key_paths[c.key] = key_paths[c.source]
      for cast in c.casts:
        program.alias[cast.outs[0]] = c.key
        removed.add(id(cast))
      # Its reads must be done before the run overwrites it.
      node.overwritten.append(c.key)
  program.nodes = [n for n in program.nodes if id(n) not in removed]


def line(nodes: list[Any]) -> str | None:
  """What the copies save, for the plan (None: there are none)."""
  copies = [c for n in nodes for c in n.copies]
  if not copies:
    return None
  saved = sum(c.target.nbytes - c.copy.nbytes for c in copies)
  return (f"weight copies: {len(copies)} float32 weights fetched as "
          f"{', '.join(sorted({str(c.dtype) for c in copies}))} copies "
          f"the host update writes ({format_bytes(saved)} less per fetch)")
