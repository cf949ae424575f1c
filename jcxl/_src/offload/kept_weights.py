"""Which layers' weights a step keeps on the device from their forward to
their backward use (``cxl_offload``'s `refetch`).

With the optimizer update on the host, a kept weight comes in once a step
(weights in, gradients out: 8 bytes per fp32 parameter, not 12) for the
device memory it holds in between. Without `refetch=`, a step keeps every
weight where the compiled step fits `device_budget`; where it does not, it
keeps the layers nearest the loss (their forward-to-backward interval is
the shortest) whose weights' bytes fit the overage, compiles again and
checks, and refetches every weight where that does not fit either.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jcxl._src.offload.clusters import Refetch
from jcxl._src.schedules import plan as schedule_lib
from jcxl._src.units import format_bytes

# Smaller kept sets compiled after the first, before every weight is
# refetched: each compile costs seconds.
MAX_SHRINKS = 3


@dataclasses.dataclass
class _Fitting:
  """A call signature's search for the kept layers that fit."""
  layers: list[tuple[str, int]]  # kept at first: (name, bytes), forward order
  needs: list[int]  # device need of each compile, over the budget


class KeptWeights:
  """The kept layers of one step's calls, by call signature.

  Args:
    update: the step's `update` ('device', 'host' or 'auto').
    refetch: the step's `refetch` (None: chosen here).
    budget: its `device_budget` in bytes (None: no limit).
  """

  def __init__(self, update: str, refetch: bool | None, budget: int | None):
    self._update = update
    self._given = refetch
    self._budget = budget
    # Call signature -> (the choice, the plan's line), once the budget
    # moved it off the default.
    self._chosen: dict[Any, tuple[Refetch, str]] = {}
    self._fitting: dict[Any, _Fitting] = {}

  def of(self, signature: Any) -> tuple[Refetch, str]:
    """The layers `signature`'s step keeps, and the line its plan's updates
    say it in (empty: the device update's default, not reported)."""
    if self._given is not None:
      return (Refetch.of(self._given),
              f"refetch={self._given}: as given (refetch={self._given})")
    if self._update == "device":
      return Refetch.of(True), ""
    if signature in self._chosen:
      return self._chosen[signature]
    within = (", within device_budget" if self._budget is not None
              else " (no device_budget)")
    if self._update == "host":
      return (Refetch(keep="all"),
              "refetch=False: each weight is kept on the device from its "
              f"forward to its backward use{within}")
    # 'auto': a pure traffic saving where the update runs on the host (no
    # weight comes in for it); the device update's own fetch stays.
    return (Refetch(keep="host"),
            "refetch=False where the update runs on the host: each such "
            f"weight is kept on the device from its forward to its backward "
            f"use{within}")

  def over_budget(self, signature: Any, plan: schedule_lib.Plan,
                  need: int) -> bool:
    """Takes a compile of `signature`'s step (its `plan`) that needs `need`
    bytes, over the budget; True: fewer layers are kept now, compile
    again."""
    if self._given is not None or self._budget is None:
      return False
    kept = [(l.name, l.keep_bytes) for l in plan.layers
            if l.refetch == "kept"]
    if not kept:
      return False  # every weight refetched already
    fitting = self._fitting.setdefault(signature, _Fitting(list(kept), []))
    fitting.needs.append(need)
    over = need - self._budget
    shrunk = len(fitting.needs) > 1
    if len(fitting.needs) > MAX_SHRINKS or (
        shrunk and need >= fitting.needs[-2]):
      # Out of tries, or keeping fewer did not lower the need: refetch
      # them all.
      kept = []
    # Dropped farthest from the loss first, until their bytes cover the
    # overage (at least one: each holds some).
    dropped = 0
    while kept and dropped < over:
      dropped += kept.pop(0)[1]
    first = fitting.needs[0]
    keeping_all = (f"keeping each weight from its forward to its backward "
                   f"use would need {format_bytes(first)} of device memory, "
                   f"over device_budget ({format_bytes(self._budget)})")
    if not kept:
      some = (f"; keeping only some still needed "
              f"{format_bytes(min(fitting.needs[1:]))}" if shrunk else "")
      self._chosen[signature] = (Refetch.of(True),
                                 f"refetch=True: {keeping_all}{some}")
      return True
    names = {name for name, _ in kept}
    refetched = [(n, b) for n, b in fitting.layers if n not in names]
    describe = lambda layers: (
        f"{', '.join(n for n, _ in layers)} "
        f"({format_bytes(sum(b for _, b in layers))})")
    self._chosen[signature] = (
        Refetch(frozenset(names)),
        f"refetch per layer: kept nearest the loss {describe(kept)}, "
        f"refetched {describe(refetched)}: {keeping_all}, by "
        f"{format_bytes(fitting.needs[0] - self._budget)}")
    return True
