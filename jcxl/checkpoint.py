"""Checkpoints of pool-resident state, in Orbax's format (public module).

Example:
  >>> state = {"params": params, "opt_state": opt_state, "step": 100}
  >>> jcxl.checkpoint.save("run/ckpt/100", state)  # streamed from the pool
  >>> state = jcxl.checkpoint.restore(jcxl.checkpoint.latest("run/ckpt"),
  ...                                 like=state, pool=pool)
"""

from jcxl._src.checkpoint import is_complete as is_complete
from jcxl._src.checkpoint import latest as latest
from jcxl._src.checkpoint import read_metadata as read_metadata
from jcxl._src.checkpoint import restore as restore
from jcxl._src.checkpoint import restore_into as restore_into
from jcxl._src.checkpoint import save as save

__all__ = ["is_complete", "latest", "read_metadata", "restore", "restore_into",
           "save"]
