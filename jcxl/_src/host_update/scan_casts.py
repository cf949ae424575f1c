"""Widening casts moved out of a loop's stacked outputs.

A model computing in bfloat16 from float32 weights, its layers under one
``lax.scan``, gets each layer's weight gradient in bfloat16 inside the
loop's backward pass, cast there to float32 (the weight's dtype) and
stacked as a float32 output. The same cast applied after the loop, to the
stacked bfloat16 output, gives the same values; there it is elementwise
work on one device array, which the host update takes in (see
host_update.find): the gradients then leave the device in bfloat16, and
the loop keeps half the bytes.
"""

from __future__ import annotations

import collections
from typing import Any

import jax.numpy as jnp
import numpy as np

from jcxl._src import jax_compat
from jcxl._src.step_ir.program import Node
from jcxl._src.step_ir.program import Program


def _widens(src: Any, dst: Any) -> bool:
  a, b = np.dtype(src.aval.dtype), np.dtype(dst.aval.dtype)
  return (jnp.issubdtype(a, jnp.floating) and
          jnp.issubdtype(b, jnp.floating) and a.itemsize < b.itemsize)


def hoist(program: Program) -> None:
  """Moves each widening cast that only makes a scan's stacked output
  (``ys``) out of the loop, after it."""
  out: list[Node] = []
  for node in program.nodes:
    out.append(node)
    eqn = node.eqn
    if eqn is None or eqn.primitive.name != "scan":
      continue
    closed = eqn.params["jaxpr"]
    body = closed.jaxpr
    _, n_carry = jax_compat.scan_counts(eqn.params)
    producer = {id(v): e for e in body.eqns for v in e.outvars}
    uses = collections.Counter(id(v) for e in body.eqns for v in e.invars)
    uses.update(id(v) for v in body.outvars)
    hoisted = {}
    for k in range(n_carry, len(body.outvars)):
      var = body.outvars[k]
      cast = producer.get(id(var))
      if (cast is None or cast.primitive.name != "convert_element_type" or
          uses[id(var)] != 1 or not hasattr(cast.invars[0], "aval") or
          not _widens(cast.invars[0], var)):
        continue
      hoisted[k] = cast.invars[0]
    if not hoisted:
      continue
    outvars = list(eqn.outvars)
    outs = list(node.outs)
    scope = node.outs[0][0]
    for k, narrow in hoisted.items():
      stacked = eqn.outvars[k].aval
      after = jax_compat.cast_eqn(
          stacked.update(dtype=narrow.aval.dtype), stacked.dtype)
      outvars[k] = after.invars[0]
      outs[k] = (scope, after.invars[0])
      out.append(Node(after, [outs[k]], [node.outs[k]], node.remat))
    new_body = body.replace(outvars=[hoisted.get(k, v) for k, v in
                                     enumerate(body.outvars)])
    node.eqn = eqn.replace(
        outvars=outvars,
        params=dict(eqn.params, jaxpr=closed.replace(jaxpr=new_body)))
    node.outs = outs
  program.nodes = out
