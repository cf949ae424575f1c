"""The host update's records: what each pass returns, frozen.

A `HostUpdateNode` stands in a step's program for one leaf's (or one
layer's) elementwise optimizer update, which runs on the host; a
`WeightCopy` is a bfloat16 copy of a master weight it also writes; an
`UpdateChoice` is where one layer's update runs, and why. The passes
(``find``, ``lower``, ``choose``, ``runtime``) return new records instead of
changing the ones they are given.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

import numpy as np

from jcxl._src import update_program as up
from jcxl._src.pool_array import PoolArray
from jcxl._src.step_ir.program import Node

UPDATE_MODES = ("device", "host", "auto")


def check_mode(update: str) -> str:
  """Validates ``cxl_offload``'s `update` argument."""
  if update not in UPDATE_MODES:
    raise ValueError(
        f"update must be one of {', '.join(map(repr, UPDATE_MODES))}, "
        f"not {update!r}")
  return update


class UpdatePath(str, enum.Enum):
  """Where a layer's optimizer update runs."""
  HOST = "host"
  DEVICE = "device"
  MIXED = "mixed"  # some of its leaves on the host, the others not


@dataclasses.dataclass(frozen=True)
class UpdateChoice:
  """Where one layer's update runs, and why (a line of ``step.plan``)."""
  layer: str
  path: UpdatePath
  reason: str

  def __str__(self) -> str:
    return f"{self.path.value}: {self.reason}"


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity
class WeightCopy:
  """A weight the step reads only through casts to one dtype (its own, or
  in a loop's body), and the copy that stands in for them (see copies)."""
  source: Any       # the master weight's key (a step argument)
  new_value: Any    # the key of its new value, which the host update writes
  key: Any          # the copy's key in the program
  dtype: np.dtype
  casts: tuple[Node, ...]
  scans: tuple[tuple[Node, int], ...]  # loops streaming it, and where
  target: PoolArray  # the master's object
  copy: PoolArray | None = None  # its object (see runtime.HostUpdates.bind)


@dataclasses.dataclass(frozen=True)
class LoweredUpdate:
  """A host update's program, lowered once (see lower.lower).

  `program` reads the state from the first device's objects and, in place
  of the gradients' objects and the copies' (made later), stand-in handles
  (-1); `lower.for_device` puts real ones in by position: inputs are the
  state read, then the gradients, then scalars and constants; outputs the
  state written, then the copies.
  """
  program: up.Program
  # Register of each written key's new value (a copy's output reads it).
  registers: Mapping[Any, int]
  num_reads: int
  num_grads: int
  num_writes: int


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity
class HostUpdateNode:
  """One host update in a step's program: stores `grads` out, then runs
  its lowered program on the pool, in place.

  It has a program node's fields (`eqn`, `ins`, `outs`, `remat`): `ins`
  are the device values it needs (gradients, then scalars); it has no
  outputs: what it computes is written into the pool in place. The fields
  past `position` are filled by later passes, each returning a new node
  (``dataclasses.replace``).
  """
  eqn: None = None
  ins: tuple[Any, ...] = ()
  outs: tuple[Any, ...] = ()
  remat: int = 0
  nodes: tuple[Node, ...] = ()
  grads: tuple[Any, ...] = ()
  scalars: tuple[Any, ...] = ()
  reads: Mapping[Any, PoolArray] = dataclasses.field(default_factory=dict)
  writes: Mapping[Any, PoolArray] = dataclasses.field(default_factory=dict)
  # What it overwrites in place, whose device reads come first.
  overwritten: tuple[Any, ...] = ()
  layer: str = ""
  pool_id: int = -1
  position: int = -1  # the program node it goes after (see find.insert)
  # None on the device: the compute estimate charges this node nothing.
  region: tuple[Node, ...] = ()
  lowered: LoweredUpdate | None = None
  # bfloat16 copies of the weights it writes, which the step fetches in
  # place of the masters (see copies.find).
  copies: tuple[WeightCopy, ...] = ()
  # Its gradients' objects, by key, and its registered program (see
  # runtime.HostUpdates.bind).
  staging: Mapping[Any, PoolArray] = dataclasses.field(default_factory=dict)
  program_id: int = -1
  # Where its state spans processes: (device id, program) per device of
  # this process, each over that device's shards.
  program_ids: tuple[tuple[int, int], ...] = ()

  @property
  def elements(self) -> int:
    """Elements of the shard it updates: a process's only shard where
    the state spans processes (one device each), else the whole array."""
    return int(np.prod(self.target.shard_shape))

  @property
  def target(self) -> PoolArray:
    """One leaf it writes (they are all alike: see find)."""
    return next(iter(self.writes.values()))

  def link_bytes(self) -> int:
    """Bytes that cross the device link: the gradients out."""
    return sum(_nbytes(k) for k in self.grads)

  def host_bytes(self) -> int:
    """Bytes the host update reads and writes in the pool."""
    return (sum(x.nbytes for x in self.reads.values()) +
            sum(x.nbytes for x in self.writes.values()) +
            sum(c.copy.nbytes for c in self.copies if c.copy is not None) +
            self.link_bytes())

  def device_link_bytes(self) -> int:
    """What the device path would move for this update instead: the old
    state in, the new state out."""
    return (sum(x.nbytes for x in self.reads.values()) +
            sum(x.nbytes for x in self.writes.values()))

  def spans_processes(self) -> bool:
    devices = self.target.sharding.device_set
    return len({d.process_index for d in devices}) > 1


def _nbytes(key: Any) -> int:
  aval = key[1].aval
  return int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
