"""One pass over a traced step for its host updates: `plan_host_updates`.

It finds the updates that can run on the host (find), lowers each to an
update program once (lower, in find), chooses where each runs (choose),
puts the chosen ones into the step's program in place of their equations,
gives them weight copies (copies) and their pool objects and registered
programs (runtime), and returns all of it as one frozen `HostUpdatePlan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any, Callable

from jcxl._src.host_update import choose as choose_lib
from jcxl._src.host_update import copies as copies_lib
from jcxl._src.host_update import find as find_lib
from jcxl._src.host_update import runtime
from jcxl._src.host_update.ir import HostUpdateNode
from jcxl._src.host_update.ir import UpdateChoice
from jcxl._src.pool_array import PoolArray
from jcxl._src.schedules import costmodel
from jcxl._src.step_ir.program import Program
from jcxl._src.units import format_bytes


@dataclasses.dataclass(frozen=True)
class HostUpdatePlan:
  """A step's host updates, as `plan_host_updates` put them in its program.

  Attributes:
    nodes: the host updates in the program, bound to their objects.
    choices: per layer with pool state the step writes: where its update
      runs, and why.
    copies: the weight copies the step now fetches, by key (pool-resident
      values of the step, as its arguments are).
    copy_paths: each copy's leaf path (its master's).
  """
  nodes: tuple[HostUpdateNode, ...] = ()
  choices: Mapping[str, UpdateChoice] = dataclasses.field(
      default_factory=dict)
  copies: Mapping[Any, PoolArray] = dataclasses.field(default_factory=dict)
  copy_paths: Mapping[Any, str] = dataclasses.field(default_factory=dict)

  @property
  def written(self) -> tuple[Any, ...]:
    """The new state values the host updates write (no store of the step
    writes them)."""
    return tuple(k for node in self.nodes for k in node.writes)

  def lines(self) -> tuple[str, ...]:
    """What the host updates move, for the plan."""
    return lines(self.nodes)


def plan_host_updates(program: Program, resident: dict[Any, Any],
                      stores: dict[Any, PoolArray], key_paths: dict[Any, str],
                      returned: set[Any], update: str,
                      link_of: Callable[[PoolArray], costmodel.Link],
                      bind: runtime.HostUpdates | None) -> HostUpdatePlan:
  """Finds, chooses, lowers and binds a traced step's host updates.

  Each chosen update replaces its equations in `program` (and the casts
  its weight copies stand in for); the caller's dicts are left alone.

  Args:
    program: the step's program (rewritten in place).
    resident: its pool-resident (and pinned) values, by key.
    stores: the new state values the step writes, by key (see find.find).
    key_paths: each resident value's leaf path.
    returned: the program's outputs the step returns (not pool state).
    update: 'device', 'host' or 'auto' (see ``cxl_offload``).
    link_of: the planning figures of the link a leaf streams over.
    bind: makes the updates' objects and programs (None: planned only,
      with stand-ins).

  Raises:
    ValueError: with update='host', an update that cannot run on the host.
    PoolExhaustedError: no room for a host update's gradients.
  """
  found, device_reasons = find_lib.find(program, resident, stores, key_paths,
                                        returned, update)
  chosen, choices = choose_lib.choose(found, update, link_of,
                                      choose_lib.measured_rates)
  choices = choose_lib.with_device_reasons(choices, device_reasons)
  find_lib.insert(program, chosen)
  nodes = copies_lib.find(program, chosen, resident, returned)
  nodes = tuple(bind.bind(n) if bind is not None else
                runtime.bind_planned(n) for n in nodes)
  nodes = copies_lib.apply(program, nodes)
  _replace(program, chosen, nodes)
  copies = {c.key: c.copy for n in nodes for c in n.copies}
  return HostUpdatePlan(
      nodes=nodes, choices=choices, copies=copies,
      copy_paths={c.key: key_paths[c.source] for n in nodes
                  for c in n.copies})


def _replace(program: Program, old: tuple[HostUpdateNode, ...],
             new: tuple[HostUpdateNode, ...]) -> None:
  """Puts the bound nodes where the found ones were inserted."""
  at = {id(o): n for o, n in zip(old, new)}
  program.nodes = [at.get(id(n), n) for n in program.nodes]


def lines(nodes: Sequence[HostUpdateNode]) -> tuple[str, ...]:
  """What host updates move, for the plan (none without any)."""
  if not nodes:
    return ()
  copies = copies_lib.line(nodes)
  return (traffic_line(nodes),) + ((copies,) if copies else ())


def traffic_line(nodes: Sequence[HostUpdateNode]) -> str:
  """What the host updates move, for the plan."""
  link = sum(n.link_bytes() for n in nodes)
  host = sum(n.host_bytes() for n in nodes)
  return (f"host updates: {len(nodes)}, gradients out "
          f"{format_bytes(link)}, updated in the pool "
          f"{format_bytes(host)} a step")
