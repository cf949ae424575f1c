"""A pool's copies in flight (`Transfer`) and done (`TransferRecord`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jcxl._src import errors
from jcxl._src.tier import Tier


@dataclasses.dataclass(frozen=True)
class TransferRecord:
  """One finished copy-engine request (times on the engine's clock, ns)."""
  id: int
  handle: int
  tier: Tier
  node: int
  to_pool: bool
  nbytes: int
  priority: int
  queued_ns: int
  started_ns: int
  finished_ns: int
  ok: bool

  @classmethod
  def from_engine(cls, raw: Any) -> TransferRecord:
    """From the copy engine's record (``_jcxl.TransferRecord``)."""
    return cls(raw.id, raw.handle, Tier.from_index(raw.tier), raw.node,
               raw.to_pool, raw.bytes, raw.priority, raw.queued_ns,
               raw.started_ns, raw.finished_ns, raw.ok)

  @property
  def seconds(self) -> float:
    """How long the copy took, from its start to its end."""
    return (self.finished_ns - self.started_ns) * 1e-9


# How long a wait that timed out gives the cancelled copy to stop (it ends
# after the chunk it is on), so that what it had not moved it never moves.
_CANCEL_GRACE_S = 2.0


def timeout_seconds(value: Any, name: str = "timeout_s") -> float:
  """Validates a timeout in seconds: a number >= 0 (inf: no deadline)."""
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer,
                                                      np.floating)):
    raise TypeError(f"{name} must be a number of seconds, but got "
                    f"{value!r} ({type(value).__name__})")
  seconds = float(value)
  if not seconds >= 0:  # also nan
    raise ValueError(f"{name} must be >= 0 seconds (inf for no deadline), "
                     f"but got {value!r}")
  return seconds


class Transfer:
  """An asynchronous copy in flight; ``wait()`` until it is done.

  The copy engine holds its own reference to the host buffer until it is
  done with it, so a transfer may be dropped unwaited, or its wait may
  fail, at any time: the buffer is freed only once no byte of it moves.
  """

  def __init__(self, ticket: Any, buffer: np.ndarray, timeout_s: float):
    self._ticket = ticket
    self._buffer = buffer
    self._timeout_s = timeout_s

  def done(self) -> bool:
    return self._ticket.done()

  def wait(self, timeout_s: float | None = None) -> np.ndarray:
    """Waits for the copy and returns its host buffer.

    A copy that times out is cancelled: what it had not moved yet it never
    moves, so its destination (the buffer, or the object for a write) is
    left partly written, and nothing else is touched.

    Args:
      timeout_s: seconds to wait, >= 0 (``math.inf``: no deadline); None:
        the pool's `timeout_s`. A bad value raises before anything else
        happens: the transfer can still be waited for.

    Raises:
      TypeError: `timeout_s` is not a number.
      ValueError: `timeout_s` is negative or nan.
      TransferTimeoutError: the copy did not finish within `timeout_s`; the
        message names the object and the time waited.
      TierIOError: the nvme tier's file system failed the copy.
      PoolClosedError: the pool was closed before the copy ran.
    """
    timeout_s = (self._timeout_s if timeout_s is None else
                 timeout_seconds(timeout_s))
    try:
      self._ticket.wait(timeout_s)
    except errors.TransferTimeoutError:
      self._ticket.cancel()
      try:  # a cancelled copy stops after the chunk it is on
        self._ticket.wait(_CANCEL_GRACE_S)
      except errors.JcxlError:
        pass
      raise
    return self._buffer

  @property
  def record(self) -> TransferRecord:
    return TransferRecord.from_engine(self._ticket.record())
