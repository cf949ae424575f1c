"""A compiled offloaded step and what a call needs to run it: the key it
is cached under, the pool handles baked into it, and its device need
(what `device_budget` is checked against)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from jcxl._src import call_args
from jcxl._src.offload.analysis import Prepared
from jcxl._src.offload.analysis import is_pool_array
from jcxl._src.pool_array import Liveness
from jcxl._src.pool_array import PoolArray
from jcxl._src.schedules.costmodel import device_need
from jcxl._src.units import format_bytes


class CompiledStep(NamedTuple):
  """A compiled step and what a call needs to run it."""
  executable: Any
  out_tree: Any
  sources: list[int | None]  # per output leaf: the state argument leaf
  plan: Any
  passed: tuple[int, ...]  # the argument leaves the executable takes
  liveness: Liveness  # that its pool arrays' objects still exist


def signature(bound: call_args.BoundCall) -> Any:
  """What a compiled step is specific to: the arguments' structure,
  shapes, dtypes and layouts, and the static arguments' values."""
  leaves, treedef = jax.tree_util.tree_flatten(bound.args,
                                               is_leaf=is_pool_array)
  parts = []
  for leaf in leaves:
    if isinstance(leaf, PoolArray):
      parts.append(leaf.static_key())
    else:
      parts.append((tuple(np.shape(leaf)), str(getattr(leaf, "dtype", "")),
                    getattr(leaf, "sharding", None)))
  return treedef, tuple(parts), bound.static_key


def bake_handles(args: tuple[Any, ...]
                 ) -> tuple[tuple[int, ...], Callable[..., tuple[Any, ...]]]:
  """Which argument leaves a compiled step is called with, and how its
  trace rebuilds `args` from them.

  A pool array's handles are in the step's cache key already (static in
  its pytree). Where this process can read them all they are baked into
  the step as constants, not passed: a step with side effects is
  dispatched by JAX in Python, argument by argument (one big block's 91
  handle arrays cost about 4 ms a call: it returned after 7.8 ms, 3.4
  without them). A process of a multi-process run holds only its own
  devices' handles: there they stay arguments.
  """
  leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_pool_array)
  baked = {i: leaf.with_handles(np.asarray(leaf.handles))
           for i, leaf in enumerate(leaves)
           if isinstance(leaf, PoolArray) and
           getattr(leaf.handles, "is_fully_addressable", True)}
  passed = tuple(i for i in range(len(leaves)) if i not in baked)

  def rebuild(*values):
    given = dict(zip(passed, values))
    return jax.tree_util.tree_unflatten(
        treedef, [baked[i] if i in baked else given[i]
                  for i in range(len(leaves))])
  return passed, rebuild


def make_entry(args: tuple[Any, ...], prep: Prepared,
                baking: tuple[tuple[int, ...], Callable], compiled: Any,
                plan: Any) -> CompiledStep:
  flat_args = jax.tree_util.tree_leaves(args, is_leaf=is_pool_array)
  # Where each output comes from: a pool-resident argument leaf (updated
  # in place) or the compiled step's results.
  sources = [prep.targets.get(j) for j in range(prep.out_tree.num_leaves)]
  sources = [i if i is not None and isinstance(flat_args[i], PoolArray)
             else None for i in sources]
  return CompiledStep(compiled, prep.out_tree, sources, plan, baking[0],
                Liveness([x for x in flat_args
                          if isinstance(x, PoolArray)]))


def check_budget(executable: Any, budget: int | None, name: str,
                 schedule: Any) -> None:
  """Raises MemoryError where `executable` needs more device memory than
  `budget` (None: no limit), saying by how much and what would help."""
  if budget is None:
    return
  need = device_need(executable.memory_analysis())
  if need > budget:
    m = executable.memory_analysis()
    raise MemoryError(
        f"{name} needs {format_bytes(need)} of device memory "
        f"(temporaries {format_bytes(m.temp_size_in_bytes)}, arguments "
        f"{format_bytes(m.argument_size_in_bytes)}, outputs "
        f"{format_bytes(m.output_size_in_bytes)}) but device_budget is "
        f"{format_bytes(budget)}: over by "
        f"{format_bytes(need - budget)}. A smaller prefetch distance "
        f"(schedule='fixed:k', now '{schedule}'), a smaller batch, "
        "or jax.checkpoint (remat) on the layers would help")
