"""Multi-process runs under ``jax.distributed`` (public module).

Each process keeps the shards of its own devices in its own pool; the pools'
settings are compared across processes when they first store an array that
spans them (``jcxl.PoolMismatchError`` on a difference), and an offloaded
step's settings at its first call (``StepMismatchError``). Under
``schedule='dap'`` every plan change is agreed by all processes, which
switch at the same step.

Example:
  >>> jax.distributed.initialize()
  >>> with jcxl.distributed.fail_together():  # a failed process stops all
  ...   train()
"""

from jcxl._src.distributed import fail_together as fail_together
from jcxl._src.errors import StepMismatchError as StepMismatchError

__all__ = ["fail_together", "StepMismatchError"]
