"""The pass that lowers a host update to an update program, once.

A host update's equations become one
``jcxl.experimental.updates.Program`` (see ``ffi/update_program.h``) when the update is found: registers for the state
it reads, its gradients, its scalars and its constants, then one
instruction per equation. The objects of its gradients and weight copies
are made later (see runtime), and a program is registered per device of
this process over that device's shards: `for_device` puts their handles
into the lowered program by position, without lowering it again.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from jcxl._src import update_program as up
from jcxl._src.host_update.ir import HostUpdateNode
from jcxl._src.host_update.ir import LoweredUpdate
from jcxl._src.pool_array import PoolArray
from jcxl._src.step_ir.program import Lit
from jcxl._src.step_ir.program import Program

# JAX primitive -> the host program's operation: the C++ core's table's
# (ffi/update_ops.h), and jax's copy_p (its primitive is named so) as copy.
OPS = {**up.PRIMITIVE_OPS, "copy_p": up.UpdateOp.COPY}
DTYPES = {"float32": up.UpdateDType.F32, "bfloat16": up.UpdateDType.BF16,
          "bool": up.UpdateDType.BOOL}

# The handle of an object made after lowering (a gradient's, a copy's).
_STAND_IN = -1


class NotOnHost(ValueError):
  """A host update the host program cannot compute (the message says why)."""


def _first_handle(x: PoolArray) -> int:
  return x.local_handles[0][1]


def lower(node: HostUpdateNode, program: Program) -> LoweredUpdate:
  """The node's equations as a host program over its objects (this
  process's first device's shards), with stand-ins for the gradients'.

  Raises:
    NotOnHost: a new value that does not depend on the state (a constant).
    ValueError: a program the pool would refuse (too many registers...):
      'auto' then keeps the update on the device.
  """
  inputs: list[up.Input] = []
  reg: dict[Any, int] = {}
  scalar_regs: set[int] = set()

  for key, x in node.reads.items():
    reg[key] = len(inputs)
    inputs.append(up.Input.object(_first_handle(x)))
  for key in node.grads:  # objects made later (see runtime)
    reg[key] = len(inputs)
    inputs.append(up.Input.object(_STAND_IN))
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
    dtype = DTYPES[str(np.dtype(eqn.outvars[0].aval.dtype))]
    in_dtype = str(np.dtype(eqn.invars[0].aval.dtype))
    if name == "broadcast_in_dim" or name in ("copy", "copy_p") or (
        name == "convert_element_type" and
        in_dtype == str(np.dtype(eqn.outvars[0].aval.dtype))):
      reg[out_key] = args[0]  # the same value: no instruction
      continue
    a, b, c = (args + [-1, -1, -1])[:3]
    op = OPS[name]
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
      raise NotOnHost("its new value does not depend on its old value or "
                      "gradient (a constant)")
    outs.append(up.Output(reg=r, handle=_first_handle(target)))
  code = _contract(code, len(inputs), [o.reg for o in outs])
  platform = next(iter(node.target.sharding.device_set)).platform
  lowered = up.Program(num_elements=node.elements,
                       num_scalars=len(node.scalars), inputs=inputs,
                       code=code, outputs=outs,
                       # As the device computes the same work: XLA:CPU
                       # flushes subnormals to zero, XLA:GPU does not.
                       flush_denormals=platform == "cpu")
  # What the pool would refuse to register, refused here (the outputs'
  # handles numbered apart: the stand-ins and planned state repeat).
  dataclasses.replace(lowered, outputs=[
      up.Output(reg=o.reg, handle=j)
      for j, o in enumerate(lowered.outputs)]).validate()
  return LoweredUpdate(
      program=lowered, registers={k: reg[k] for k in node.writes},
      num_reads=len(node.reads), num_grads=len(node.grads),
      num_writes=len(node.writes))


def for_device(node: HostUpdateNode, device: int | None,
               grad_handles: dict[Any, int],
               copy_handles: dict[Any, int]) -> up.Program:
  """The node's lowered program over device `device`'s shards (by id; None:
  this process's first device's), its gradients read from the objects
  `grad_handles` names, and the new weights of its copies (``node.copies``)
  also written into the objects `copy_handles` names (by master key)."""
  lowered = node.lowered
  assert lowered is not None, "a host update is lowered when it is found"

  def handle(x: PoolArray) -> int:
    return (dict(x.local_handles)[device] if device is not None else
            _first_handle(x))

  inputs = list(lowered.program.inputs)
  for j, x in enumerate(node.reads.values()):
    inputs[j] = up.Input.object(handle(x))
  for j, key in enumerate(node.grads):
    inputs[lowered.num_reads + j] = up.Input.object(grad_handles[key])
  outputs = [up.Output(reg=o.reg, handle=handle(x)) for o, x in
             zip(lowered.program.outputs, node.writes.values())]
  outputs += [up.Output(reg=lowered.registers[c.new_value],
                        handle=copy_handles[c.source]) for c in node.copies]
  return dataclasses.replace(lowered.program, inputs=inputs, outputs=outputs)


def structure(node: HostUpdateNode) -> Any:
  """What a host update's objects and programs are made for, hashable: its
  pool, its lowered program, the registers its copies write and its
  gradients' shapes and dtypes (a re-plan of the same step has the same)."""
  return (node.pool_id, node.lowered.program,
          tuple((c.source, c.dtype.name, node.lowered.registers[c.new_value])
                for c in node.copies),
          tuple((tuple(k[1].aval.shape), str(k[1].aval.dtype))
                for k in node.grads))


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
