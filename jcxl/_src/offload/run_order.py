"""Which offloaded step ran last in this process.

A step right after another offloaded program's runs slower than one right
after its own (the host's caches, buffers and copy threads are warm for the
other: by up to 40% measured on XLA:CPU), so a DAP step does not take its
timings there (see Tuner.wants_measurement). Every step shares the host,
whatever its pool: the order is the process's, kept in one `RunOrder`
(`PROCESS`) that each step is given (a test may give one its own).
"""

from __future__ import annotations


class RunOrder:
  """The order offloaded steps run in, as far as a timing cares: which
  one ran last."""

  def __init__(self):
    self._last: object | None = None

  def runs(self, step: object) -> bool:
    """Notes that `step` (any token of it) runs now; returns whether
    another step ran since it last did."""
    after_other = self._last not in (None, step)
    self._last = step
    return after_other


PROCESS = RunOrder()
