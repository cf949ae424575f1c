"""Elementwise update programs run on the host, in place on pool objects.

An optimizer's update of one layer (adam, adamw, sgd with momentum, lion...)
as straight-line float32 code over registers (see ``Program``), registered
on a pool (``pool.updates.register``) and run by its update threads, from
Python (``pool.updates.run``) or inside a jitted step (``update_start`` then
``update_done``): only the gradients and the fresh weights need to cross the
device link.

Example:
  >>> from jcxl.experimental import updates as u
  >>> h = pool.put(np.ones(1024, np.float32), "host")
  >>> double = pool.updates.register(u.Program(
  ...     1024, 1, [u.Input.object(h), u.Input.scalar(0)],
  ...     [u.Instr(u.UpdateOp.MUL, 0, 1)], [u.Output(2, h)]))
  >>> pool.updates.run(double, [2.0]).wait()
"""

from jcxl._src.pool_updates import UpdateRun as UpdateRun
from jcxl._src.pool_updates import UpdateStats as UpdateStats
from jcxl._src.stream import update_done as update_done
from jcxl._src.stream import update_start as update_start
from jcxl._src.update_program import Input as Input
from jcxl._src.update_program import InputKind as InputKind
from jcxl._src.update_program import Instr as Instr
from jcxl._src.update_program import Output as Output
from jcxl._src.update_program import Program as Program
from jcxl._src.update_program import UpdateDType as UpdateDType
from jcxl._src.update_program import UpdateOp as UpdateOp

__all__ = ["Input", "InputKind", "Instr", "Output", "Program", "UpdateDType",
           "UpdateOp", "UpdateRun", "UpdateStats", "update_done",
           "update_start"]
