"""Tests that the C++ core's table of update ops (ffi/update_ops.h) is the one
list of them: jcxl/_src/update_program.py's UpdateOp, arities and map of JAX
primitives all come from it, and the core refuses an op it does not list.

(What each op computes is checked against jax in host_update_kernel_test.py.)
"""

from __future__ import annotations

import re

import pytest
from jax import lax
from jcxl import _jcxl
from jcxl._src import update_program as up


def _one_op(op: up.UpdateOp, operands: int) -> up.Program:
  """``op`` on its first `operands` inputs (the rest -1), written out."""
  regs = [0, 1, 2][:operands] + [-1] * (3 - operands)
  return up.Program(
      num_elements=8, num_scalars=0,
      inputs=[up.Input.object(h) for h in (1, 2, 3)],
      code=[up.Instr(op, *regs, imm=2)],
      outputs=[up.Output(3, 4)])


class UpdateOpTableTest:

  def test_every_op_of_the_table_round_trips_through_python(self):
    table = _jcxl.update_ops()
    assert [code for _, _, code, _, _ in table] == list(range(len(table)))
    assert len(up.UpdateOp) == len(table)  # aliases aside
    for enumerator, name, code, arity, _ in table:
      op = up.UpdateOp(code)
      assert op.name == re.sub(r"(?<!^)(?=[A-Z])", "_", enumerator).upper()
      assert up.OP_ARITY[op] == arity
      assert up.OP_NAMES[op] == name
      native = _one_op(op, arity).to_native()
      assert native.code[0].op == code

  def test_each_op_takes_the_operands_its_row_says(self):
    for op, arity in up.OP_ARITY.items():
      _one_op(op, arity).validate()
      with pytest.raises(
          ValueError,
          match=f"{up.OP_NAMES[op]} takes {arity} operand.*is not an earlier"):
        _one_op(op, arity - 1).validate()

  def test_an_op_not_in_the_table_is_refused_by_number(self):
    missing = len(up.UpdateOp)
    with pytest.raises(ValueError):
      up.UpdateOp(missing)
    program = up.Program(1, 0, [up.Input.object(1), up.Input.object(2)],
                         [up.Instr(missing, 0, 1)], [up.Output(2, 1)])
    with pytest.raises(ValueError,
                       match=rf"instruction 0 \(register 2\): unknown op "
                             rf"{missing} \(ops are 0..{missing - 1}\)"):
      program.validate()

  def test_traced_ops_are_jax_primitives_of_their_name(self):
    assert up.PRIMITIVE_OPS["integer_pow"] is up.UpdateOp.INT_POW
    assert up.UpdateOp.INTEGER_POW is up.UpdateOp.INT_POW
    for name, op in up.PRIMITIVE_OPS.items():
      assert getattr(lax, f"{name}_p").name == name, op
    # The fused multiply-adds are jcxl's own: no jaxpr names them.
    made = {op for op in up.UpdateOp if op not in up.PRIMITIVE_OPS.values()}
    assert made == {up.UpdateOp.FMA, up.UpdateOp.FMS, up.UpdateOp.FNMA}
