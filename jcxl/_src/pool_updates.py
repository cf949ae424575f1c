"""A pool's update service: host update programs run on its objects.

``pool.updates`` registers an update program
(``jcxl.experimental.updates.Program``) on the pool's objects, runs it on the pool's update threads and counts what
the runs did; ``update_start`` runs a registered program inside a jitted
step (see docs/host-update.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jcxl._src import dispatched
from jcxl._src import errors
from jcxl._src import update_program as update_program_lib
from jcxl._src import validation
from jcxl._src.transfers import timeout_seconds


@dataclasses.dataclass(frozen=True)
class UpdateStats:
  """What a pool's update programs did (see ``pool.updates.run``).

  Attributes:
    runs: runs finished, failed ones included.
    failed: of those, the runs that ended with an error.
    elements: elements of the runs that succeeded.
    bytes_read: object bytes the programs read (not counted in the tiers'
      bytes_read: those are what crosses the device link).
    bytes_written: object bytes the programs wrote.
    busy_ns: wall time while any run was under way.
    threads: update threads started so far (0 before the first run).
  """
  runs: int
  failed: int
  elements: int
  bytes_read: int
  bytes_written: int
  busy_ns: int
  threads: int

  @property
  def bandwidth(self) -> float:
    """Object bytes read and written per second of run time."""
    return (self.bytes_read + self.bytes_written) / max(self.busy_ns * 1e-9,
                                                        1e-12)


class UpdateRun:
  """An update run in flight; ``wait()`` until it is done."""

  def __init__(self, run: Any, timeout_s: float):
    self._run = run
    self._timeout_s = timeout_s

  @property
  def id(self) -> int:
    """The run's id in the pool's update service."""
    return self._run.id

  @property
  def program_id(self) -> int:
    """The id of the registered program this run executes."""
    return self._run.program_id

  def done(self) -> bool:
    """Whether the run has finished (`wait` blocks until it has)."""
    return self._run.done()

  def wait(self, timeout_s: float | None = None) -> None:
    """Waits for the run.

    Args:
      timeout_s: seconds to wait, >= 0 (``math.inf``: no deadline); None:
        the pool's `timeout_s`. A run that times out keeps running: its
        objects are not ready until it is done.

    Raises:
      TransferTimeoutError: the run did not finish within `timeout_s`.
      TierIOError: an nvme object could not be read or written.
      PoolClosedError: the pool was closed before the run ended.
    """
    timeout_s = (self._timeout_s if timeout_s is None else
                 timeout_seconds(timeout_s))
    self._run.wait(timeout_s)



def _as_program_id(program_id: Any) -> int:
  return validation.as_count(program_id, name="program_id",
                             low=validation.INT32_MIN,
                             high=validation.INT32_MAX,
                             what="an int32 update program id")


class PoolUpdates:
  """A pool's update programs (``pool.updates``): register, run, release.

  The programs are ``jcxl.experimental.updates.Program``s; that module's
  docstring has an example of one registered and run.
  """

  def __init__(self, native: Any, pool_id: int, timeout_s: float):
    self._native = native  # the C++ pool, which runs the programs
    self._pool_id = pool_id
    self._timeout_s = timeout_s
    # Registered programs by id (for trace-time checks: update_start).
    self._programs: dict[int, update_program_lib.Program] = {}

  def register(self, program: update_program_lib.Program) -> int:
    """Registers an update program on the pool's objects; returns its id.

    Raises:
      TypeError: `program` is not an update_program.Program, or a field of
        it is not an int.
      ValueError: the program is malformed (an operand that names no
        earlier register, a scalar index past num_scalars, a scalar
        output...), or an object it reads or writes does not hold exactly
        `num_elements` float32 or bfloat16 elements.
      UnknownHandleError: a handle is not this pool's (or was freed).
    """
    if not isinstance(program, update_program_lib.Program):
      raise TypeError(f"pool.updates.register takes a jcxl update Program, "
                      f"got {type(program).__name__}")
    program_id = self._native.register_update(program.to_native())
    self._programs[program_id] = program
    return program_id

  def release(self, program_id: int) -> None:
    """Forgets a program; runs of it in flight finish."""
    program_id = _as_program_id(program_id)
    self._native.release_update(program_id)
    self._programs.pop(program_id, None)

  def program(self, program_id: int) -> update_program_lib.Program:
    """The registered program `program_id` (UnknownHandleError if none)."""
    program = self._programs.get(program_id)
    if program is None or self._native.closed:
      raise errors.UnknownHandleError(
          f"update program {program_id} is unknown to pool {self._pool_id} "
          f"(released, or never registered)")
    return program

  def run(self, program_id: int, scalars: Any = ()) -> UpdateRun:
    """Starts a run of program `program_id`; ``wait()`` on the result.

    Runs are split in blocks over the pool's update threads. Runs that
    share an object run in the order started (a run reading what an
    earlier one wrote sees all of it); a run sharing none with the runs
    under way starts as their last blocks are taken. The program's
    objects are pinned until the run is done (``free`` and ``compact``
    wait for it).

    Args:
      program_id: what ``register`` returned.
      scalars: the run's `num_scalars` floats (learning rate, bias
        corrections...), as float32.

    Raises:
      ValueError: `scalars` does not hold the program's num_scalars values.
      UnknownHandleError: the program is unknown, or an object of it was
        freed since it was registered (the message names it).
    """
    values = np.asarray(scalars, dtype=np.float32).reshape(-1)
    run = self._native.start_update(_as_program_id(program_id),
                                    [float(v) for v in values])
    return UpdateRun(run, self._timeout_s)

  def wait(self, timeout_s: float | None = None) -> None:
    """Waits for the steps dispatched so far (from any thread), then until
    every update run started on the pool is done.

    Nothing needs it for the right values: a transfer of an object (a
    step's fetch or store, ``get``, ``put``, a checkpoint) waits for the
    runs not yet done that write it (or, for a write, that use it), so a
    step made with ``cxl_offload(..., async_update=True)`` may return
    before its host updates are done. A run that failed leaves the objects
    it writes unreadable (ValueError naming the run) until they are
    written whole, and the runs queued after it on them are not run.

    Example:
      >>> params, opt_state, loss = step(params, opt_state, batch)
      >>> pool.updates.wait()   # before timing the step, or a report

    Args:
      timeout_s: seconds to wait, >= 0 (``math.inf``: no deadline); None:
        the pool's `timeout_s`.

    Raises:
      TransferTimeoutError: runs were still under way after `timeout_s`.
      Exception: a dispatched step's error (as ``jcxl.gather`` raises it).
    """
    timeout_s = (self._timeout_s if timeout_s is None else
                 timeout_seconds(timeout_s))
    dispatched.barrier()  # steps not yet run start none of their runs
    self._native.wait_for_updates(timeout_s)

  def stats(self) -> UpdateStats:
    """What the pool's update programs did so far."""
    raw = self._native.update_stats()
    return UpdateStats(runs=raw.runs, failed=raw.failed,
                       elements=raw.elements, bytes_read=raw.bytes_read,
                       bytes_written=raw.bytes_written, busy_ns=raw.busy_ns,
                       threads=raw.threads)

  def _hold(self, hold: bool) -> None:
    """Test hook: while held, update runs wait (they queue up), so that a
    test can see what waits for them (``free``, ``close``, a step's
    ``update_done`` timing out)."""
    self._native.hold_updates(bool(hold))
