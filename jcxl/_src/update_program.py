"""Elementwise update programs, as the C++ core runs them (ffi/update_program.h).

A program is straight-line code over registers: registers
``[0, len(inputs))`` are its inputs in order (pool objects read element by
element, scalars given at each run, constants), and instruction ``i`` writes
register ``len(inputs) + i``. Every value is computed in float32; an
instruction whose `dtype` is ``BF16`` rounds its result to bfloat16, as
XLA:CPU computes bfloat16 arithmetic; booleans are 0.0 / 1.0. Outputs write
vector registers into pool objects, converted to each object's dtype.

These dataclasses mirror the C++ structs field for field (the enums keep the
C++ values; `UpdateOp` and its maps are built from the C++ core's table of
ops, ffi/update_ops.h); ``Pool.register_update`` checks a program and its
objects and returns its id, ``Pool.run_update`` runs it.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import types
from collections.abc import Mapping
from collections.abc import Sequence

from jcxl import _jcxl


def _enum_name(enumerator: str) -> str:
  """``IntPow`` -> ``INT_POW``."""
  return re.sub(r"(?<!^)(?=[A-Z])", "_", enumerator).upper()


# The C++ core's table of ops (ffi/update_ops.h): (enumerator, name, code,
# arity, traced) per op. It is the only list of them; everything below
# derives from it.
_OP_TABLE = tuple(tuple(row) for row in _jcxl.update_ops())


def _op_members() -> dict[str, int]:
  members = {_enum_name(enumerator): code
             for enumerator, _, code, _, _ in _OP_TABLE}
  # The primitive's own name too, where it differs (INTEGER_POW = INT_POW).
  for _, name, code, _, _ in _OP_TABLE:
    members.setdefault(name.upper(), code)
  return members


UpdateOp = enum.IntEnum("UpdateOp", _op_members(), module=__name__,
                        qualname="UpdateOp")
UpdateOp.__doc__ = (
    "An instruction's operation (the C++ enumerator without its k, words "
    "split by '_'; also under its JAX primitive's name, as INTEGER_POW), as "
    "ffi/update_ops.h lists them with what each computes.")

# How many operands (a, b, c) each op reads.
OP_ARITY: Mapping[UpdateOp, int] = types.MappingProxyType(
    {UpdateOp(code): arity for _, _, code, arity, _ in _OP_TABLE})
# The op's name in the C++ core's messages (the JAX primitive's).
OP_NAMES: Mapping[UpdateOp, str] = types.MappingProxyType(
    {UpdateOp(code): name for _, name, code, _, _ in _OP_TABLE})
# JAX primitive -> the op that computes it, for the ops a jaxpr's equation
# maps to (the fused multiply-adds are made by jcxl, not traced).
PRIMITIVE_OPS: Mapping[str, UpdateOp] = types.MappingProxyType(
    {name: UpdateOp(code) for _, name, code, _, traced in _OP_TABLE
     if traced})


class UpdateDType(enum.IntEnum):
  """The dtype of an instruction's result."""
  F32 = 0
  BF16 = 1
  BOOL = 2


class InputKind(enum.IntEnum):
  """Where an input register's value comes from."""
  OBJECT = 0  # a pool object (float32 or bfloat16), element by element
  SCALAR = 1  # scalars[scalar_index] of each run
  CONSTANT = 2  # a constant of the program


@dataclasses.dataclass(frozen=True)
class Instr:
  """One instruction: ``op(a, b, c)`` (unused operands -1), result in `dtype`.

  `imm` is INTEGER_POW's exponent.
  """
  op: UpdateOp
  a: int = -1
  b: int = -1
  c: int = -1
  dtype: UpdateDType = UpdateDType.F32
  imm: int = 0


@dataclasses.dataclass(frozen=True)
class Input:
  """An input register (see InputKind)."""
  kind: InputKind
  handle: int = 0
  scalar_index: int = 0
  constant: float = 0.0

  @classmethod
  def object(cls, handle: int) -> Input:
    """An input read from the pool object `handle`, element by element."""
    return cls(InputKind.OBJECT, handle=handle)

  @classmethod
  def scalar(cls, index: int) -> Input:
    """An input that is scalar `index` of a run's scalars (a learning rate, a
    step count)."""
    return cls(InputKind.SCALAR, scalar_index=index)

  @classmethod
  def const(cls, value: float) -> Input:
    """An input that is the constant `value` in every element."""
    return cls(InputKind.CONSTANT, constant=value)


@dataclasses.dataclass(frozen=True)
class Output:
  """Register `reg` written into object `handle` (in its dtype)."""
  reg: int
  handle: int


@dataclasses.dataclass(frozen=True)
class Program:
  """An update program over objects of `num_elements` elements each.

  Attributes:
    num_elements: elements of every object the program reads or writes.
    num_scalars: floats each run passes (``Pool.run_update``'s `scalars`).
    inputs: the input registers.
    code: the instructions.
    outputs: what is written where.
    flush_denormals: compute with subnormals flushed to zero (operands and
      results, not conversions), as XLA:CPU does; False: IEEE subnormals,
      as numpy and XLA:GPU compute.
  """
  num_elements: int
  num_scalars: int
  inputs: Sequence[Input]
  code: Sequence[Instr]
  outputs: Sequence[Output]
  flush_denormals: bool = False

  def __post_init__(self):
    for name in ("inputs", "code", "outputs"):
      object.__setattr__(self, name, tuple(getattr(self, name)))

  def to_native(self) -> _jcxl.UpdateProgram:
    """The C++ core's UpdateProgram (ValueError for a field out of range)."""
    def checked(value, what, low=-2**31, high=2**31 - 1):
      if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"update program: {what} must be an int, got "
                        f"{value!r}")
      if not low <= value <= high:
        raise ValueError(f"update program: {what} = {value} is out of range")
      return int(value)
    try:
      return _jcxl.UpdateProgram(
          checked(self.num_elements, "num_elements", 0, 2**63 - 1),
          checked(self.num_scalars, "num_scalars", 0),
          [_jcxl.UpdateInput(checked(int(i.kind), f"input {n} kind"),
                             checked(i.handle, f"input {n} handle"),
                             checked(i.scalar_index,
                                     f"input {n} scalar_index"),
                             float(i.constant))
           for n, i in enumerate(self.inputs)],
          [_jcxl.UpdateInstr(checked(int(c.op), f"instruction {n} op"),
                             checked(c.a, f"instruction {n} a"),
                             checked(c.b, f"instruction {n} b"),
                             checked(c.c, f"instruction {n} c"),
                             checked(int(c.dtype), f"instruction {n} dtype"),
                             checked(c.imm, f"instruction {n} imm"))
           for n, c in enumerate(self.code)],
          [_jcxl.UpdateOutput(checked(o.reg, f"output {n} reg"),
                              checked(o.handle, f"output {n} handle"))
           for n, o in enumerate(self.outputs)],
          bool(self.flush_denormals))
    except (AttributeError, TypeError) as e:
      if isinstance(e, TypeError) and str(e).startswith("update program"):
        raise
      raise TypeError(f"update program: malformed field ({e}); inputs, code "
                      f"and outputs hold Input, Instr and Output") from None

  def validate(self) -> None:
    """Checks the program's structure (operands, ops, dtypes, scalar
    indices; not its handles): ValueError naming what is wrong."""
    _jcxl.validate_update_program(self.to_native())
