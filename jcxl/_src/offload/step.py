"""cxl_offload: rewrite a jitted step so pool-resident state streams in.

The step is traced with its pool-resident leaves as ordinary inputs
(`analysis`); the resulting program is run by an interpreter under
``jax.jit`` that streams them in and stores what the step updates back
(`interpreter`). Each compiled step is cached by the call's signature and
the plan it runs (`compiled`); which plan that is, and when a step is
measured, is its schedule's to say (`scheduler`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import numpy as np

from jcxl import _jcxl
from jcxl._src import call_args
from jcxl._src import dispatched
from jcxl._src import distributed
from jcxl._src import registry
from jcxl._src.schedules import plan as schedule_lib
from jcxl._src import shardings as shardings_lib
from jcxl._src.schedules import agreement as agreement_lib
from jcxl._src.schedules import costmodel
from jcxl._src.schedules import profile as profile_lib
from jcxl._src.host_update import ir as host_update_ir
from jcxl._src.host_update import runtime as host_update_runtime
from jcxl._src.offload import analysis
from jcxl._src.offload import compiled as compiled_lib
from jcxl._src.offload import kept_weights
from jcxl._src.offload import reports
from jcxl._src.offload import run_order as run_order_lib
from jcxl._src.schedules import scheduler as scheduler_lib
from jcxl._src.offload.analysis import is_pinned
from jcxl._src.offload.analysis import is_pool_array
from jcxl._src.offload.clusters import Refetch
from jcxl._src.offload.compiled import CompiledStep
from jcxl._src.schedules.costmodel import device_need
from jcxl._src.offload.interpreter import Interpreter
from jcxl._src.step_ir.program import layer_of
from jcxl._src.offload.reports import LayerReport
from jcxl._src.pool import Tier
from jcxl._src.pool_array import Liveness
from jcxl._src.pool_array import PoolArray
from jcxl._src.units import parse_bytes

class OffloadedStep:
  """A step rewritten by ``cxl_offload`` (see there)."""

  def __init__(self, fn: Callable, device_budget: int | None,
               schedule: schedule_lib.Schedule, in_shardings: Any = None,
               out_shardings: Any = None,
               params: call_args.Signature | None = None,
               run_order: run_order_lib.RunOrder = run_order_lib.PROCESS,
               update: str = "device", refetch: bool | None = None,
               async_update: bool = False):
    self._fn = fn
    self._async_update = async_update
    self._name = getattr(fn, "__name__", "the step")
    self._params = params or call_args.Signature(fn)
    self._in_shardings = in_shardings
    self._out_shardings = out_shardings
    self._budget = device_budget
    self._schedule = schedule
    self._scheduler = scheduler_lib.for_schedule(schedule, device_budget,
                                                 self._compile_plan)
    self._run_order = run_order
    self._update = host_update_ir.check_mode(update)
    self._refetch = refetch  # None: chosen per call (see _refetch_of)
    self._kept = kept_weights.KeptWeights(self._update, refetch,
                                          device_budget)
    # The gradients' pool objects and programs of its host updates.
    self._host_updates = host_update_runtime.HostUpdates()
    # This step in `run_order`: a token, so the order keeps no dropped
    # step alive.
    self._run_token = object()
    # (call signature, scheduler version) -> CompiledStep
    self._compiled: dict[Any, CompiledStep] = {}
    self._groups: dict[int, str] = {}   # handle -> layer name
    self._first_device: dict[int, str] = {}  # the same, one device's
    self._segments: list[costmodel.Segment] = []
    self._plan: schedule_lib.Plan | None = None
    self.last_profile: profile_lib.StepProfile | None = None
    self.compiles = 0
    # The step that ran last, (signature, entry): it runs on while the
    # scheduler's next plans compile off the step's path.
    self._ran: tuple[Any, CompiledStep] | None = None
    # Plans compiled off the step's path, recorded as traced, until their
    # compile is done (see _compile_plan).
    self._ahead_plans: dict[schedule_lib.LayerSchedule, Any] = {}
    self._last_results: Any = None
    # Call signature -> the argument leaves of device NNX Variables the
    # step updates in place, in the order their new values follow the
    # step's outputs (set into the caller's Variables, as nnx.jit does).
    self._written: dict[Any, tuple[int, ...]] = {}
    # Whether the first call compared the step's settings with its peer
    # processes' (where its arrays span processes; see _agree).
    self._peers_checked = False
    functools.update_wrapper(self, fn)

  @property
  def tuner(self):
    """The DAP tuner (its ``history``, ``options``); None for a fixed
    schedule."""
    return self._scheduler.tuner

  def _prepare(self, bound: call_args.BoundCall) -> analysis.Prepared:
    prep = analysis.prepare(bound, self._out_shardings, self._name)
    self._written[compiled_lib.signature(bound)] = tuple(
        prep.written[j] for j in sorted(prep.written))
    return prep

  def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> call_args.BoundCall:
    """The call bound to the step's signature, laid out as `in_shardings`
    says (see jax.jit)."""
    bound = self._params.bind(args, kwargs)
    if self._in_shardings is None:
      return bound
    positional = bound.args[:-1]
    with_paths = jax.tree_util.tree_flatten_with_path(
        positional, is_leaf=is_pool_array)[0]
    state = {i for i, (_, leaf) in enumerate(with_paths)
             if isinstance(leaf, PoolArray) or is_pinned(leaf)}
    placed = shardings_lib.place_inputs(
        positional, shardings_lib.flat_shardings(self._in_shardings,
                                                 positional, "in_shardings"),
        state, [jax.tree_util.keystr(p) for p, _ in with_paths])
    return dataclasses.replace(bound,
                               args=tuple(placed) + (bound.args[-1],))

  # The traced function: args in, the outputs that are not pool state out.
  # `ahead`: a plan to compile off the step's path (see compile_ahead),
  # which must leave the scheduler and `self._plan` alone.
  def _run(self, args: tuple[Any, ...], prep: analysis.Prepared,
           ahead: schedule_lib.LayerSchedule | None = None,
           refetch: tuple[Refetch, str] = (Refetch(), "")) -> list[Any]:
    a = analysis.analyze(args, prep, update=self._update,
                         bind=self._host_updates, refetch=refetch[0])
    links = analysis.tier_links(a.resident.values())
    made_for = schedule_lib.MadeFor.of(
        (layer_of(a.key_paths[k]), a.key_paths[k], t.shape, t.dtype)
        for k, t in a.resident.items() if isinstance(t, PoolArray))
    schedule_lib.check_made_for(self._schedule, made_for)
    schedule = ahead or self._scheduler.resolve(a.segments, links)
    a.fetches.set_schedule(schedule)
    interpreter = Interpreter(a.program, a.fetches, a.values, schedule,
                              a.stores, a.store_after, self._async_update)
    interpreter.run()
    out = []
    for j, key, target in a.returned:
      value = interpreter.read_output(key)
      sharding = (prep.out_shardings[j] if j < len(prep.out_shardings)
                  else None)  # past them: Variables updated in place
      if isinstance(target, analysis.Pinned):  # back to pinned host memory
        value = jax.device_put(value, target.sharding)
      elif sharding is not None:  # as jax.jit's out_shardings
        value = jax.lax.with_sharding_constraint(value, sharding)
      out.append(value)
    # After the outputs: a call reads only those (see Interpreter).
    out.extend(interpreter.tokens())
    self._segments = a.segments
    plan = reports.record_plan(a, schedule, links, made_for,
                               str(self._schedule), self._groups,
                               self._first_device)
    if refetch[1]:
      plan = dataclasses.replace(plan, updates=plan.updates + (refetch[1],))
    if ahead:
      self._ahead_plans[ahead] = plan
    else:
      self._plan = self._scheduler.report(plan)
    return out

  def _refetch_of(self, bound: call_args.BoundCall
                  ) -> tuple[Refetch, str]:
    """Whose weights this call's step keeps on the device from their
    forward to their backward use, and its plan's line saying so (empty:
    the device update's default, not reported)."""
    return self._kept.of(compiled_lib.signature(bound))

  @property
  def plan(self) -> schedule_lib.Plan | None:
    """The per-layer plan the next step runs (None before the first
    compile). Under DAP its predicted step and reasons are the tuner's as
    they stand now: a race or a baseline learns after the plan compiled."""
    return None if self._plan is None else self._scheduler.report(
        self._plan)

  def lower(self, *args, **kwargs):
    """Lowers the rewritten step for these arguments (see jax.jit). Its
    pool arrays' handles are constants in it where this process holds
    them all."""
    bound = self._bind(args, kwargs)
    return self._lower(bound, self._prepare(bound),
                       compiled_lib.bake_handles(bound.args))

  def _lower(self, bound: call_args.BoundCall, prep: analysis.Prepared,
             baking: tuple[tuple[int, ...], Callable],
             ahead: schedule_lib.LayerSchedule | None = None) -> Any:
    passed, rebuild = baking
    with_paths = jax.tree_util.tree_flatten_with_path(
        bound.args, is_leaf=is_pool_array)[0]
    donate = tuple(k for k, i in enumerate(passed)
                   if bound.is_donated(with_paths[i][0]) and
                   not isinstance(with_paths[i][1], PoolArray))
    refetch = self._refetch_of(bound)
    return jax.jit(lambda *a: self._run(rebuild(*a), prep, ahead, refetch),
                   donate_argnums=donate).lower(
                       *(with_paths[i][1] for i in passed))

  def _compile_plan(self, bound: call_args.BoundCall,
                    schedule: schedule_lib.LayerSchedule
                    ) -> tuple[CompiledStep, int]:
    """The step compiled with plan `schedule`, and its device need (off
    the step's path, on the compiling thread: see compile_ahead)."""
    prep = self._prepare(bound)
    baking = compiled_lib.bake_handles(bound.args)
    compiled = self._lower(bound, prep, baking, schedule).compile()
    return (compiled_lib.make_entry(bound.args, prep, baking, compiled,
                                    self._ahead_plans.pop(schedule)),
            device_need(compiled.memory_analysis()))

  def _compile(self, bound: call_args.BoundCall) -> CompiledStep:
    args = bound.args
    flat_args = jax.tree_util.tree_leaves(args, is_leaf=is_pool_array)
    # A closed pool or a freed array, named, before tracing.
    Liveness([x for x in flat_args if isinstance(x, PoolArray)]).check()
    prep = self._prepare(bound)
    baking = compiled_lib.bake_handles(args)  # once: it reads every handle
    started = time.perf_counter()
    compiled = self._lower(bound, prep, baking).compile()
    self.compiles += 1
    # A plan over the budget moves (DAP): compiled again, or taken from
    # the cache where the plan it moved to is there.
    while self._scheduler.compiled(compiled, time.perf_counter() - started):
      if self._cache_key(bound) in self._compiled:
        return self._compiled[self._cache_key(bound)]
      started = time.perf_counter()
      compiled = self._lower(bound, prep, baking).compile()
      self.compiles += 1
    need = device_need(compiled.memory_analysis())
    if (self._budget is not None and need > self._budget and
        self._kept.over_budget(compiled_lib.signature(bound), self._plan,
                               need)):
      # Fewer weights kept (see kept_weights): compiled again, bounded;
      # the cost model takes the step's new fetches.
      if self.tuner is not None:
        self.tuner.model.new_timeline()
      return self._compile(bound)
    compiled_lib.check_budget(compiled, self._budget, self._name,
                              self._schedule)
    return compiled_lib.make_entry(args, prep, baking, compiled, self._plan)

  def _cache_key(self, bound: call_args.BoundCall,
                 signature: Any = None) -> Any:
    return (signature or compiled_lib.signature(bound),
            self._scheduler.version)

  def compile(self, *args, **kwargs) -> Any:
    """Compiles the step for these arguments without running it (or takes
    it from the cache) and returns the compiled executable.

    Raises:
      MemoryError: it needs more than `device_budget` (after a DAP plan has
        been re-planned within it).
      StepMismatchError: in a multi-process run, the processes' steps
        differ in a setting (see _agree).
    """
    bound = self._bind(args, kwargs)
    self._agree(bound)
    return self._entry(bound).executable

  def _agree(self, bound: call_args.BoundCall) -> None:
    """Once, where the step's arrays span processes: compares its settings
    with its peers' (two processes running differently compiled steps
    would each wait forever in a collective the other never runs), and has
    its scheduler decide with them from then on."""
    if self._peers_checked:
      return
    leaves = jax.tree_util.tree_leaves(bound.args, is_leaf=is_pool_array)
    devices = {d for x in leaves if isinstance(x, (PoolArray, jax.Array))
               for d in x.sharding.device_set}
    if distributed.spans_processes(devices):
      agreement = distributed.Agreement(f"the offloaded step '{self._name}'")
      # Raises in every process alike; a call after that checks again.
      distributed.check_steps_agree(agreement, self._settings(bound))
      self._scheduler.agreement = agreement
    self._peers_checked = True

  def _settings(self, bound: call_args.BoundCall) -> dict[str, Any]:
    """What must be the same in every process for the step to compile the
    same: its options, and the tier each pool-resident leaf is in."""
    schedule = self._schedule
    plan = (schedule if isinstance(schedule, schedule_lib.LayerSchedule)
            else getattr(schedule, "start", None))
    settings = {
        "schedule": str(schedule) + (
            f" (plan {agreement_lib.plan_key(plan)})" if plan else ""),
        "device_budget": self._budget, "update": self._update,
        "refetch": self._refetch}
    for path, leaf in jax.tree_util.tree_flatten_with_path(
        bound.args, is_leaf=is_pool_array)[0]:
      if isinstance(leaf, PoolArray):
        settings[f"tier of {jax.tree_util.keystr(path)}"] = leaf.tier.value
    return settings

  def _entry(self, bound: call_args.BoundCall,
             signature: Any = None) -> CompiledStep:
    # The key once a call: it flattens every argument (1.5 ms a call for
    # 91 pool arrays here).
    entry = self._compiled.get(self._cache_key(bound, signature))
    if entry is None:
      entry = self._compile(bound)
      # Keyed after compiling: a DAP budget re-plan moves the plan on.
      self._compiled[self._cache_key(bound)] = entry
    else:
      # Its handles are constants in it: the step would fail on a freed
      # one by number, or the pool's closing, at run time.
      entry.liveness.check()
    return entry

  def __call__(self, *args, **kwargs):
    return self._call(self._bind(args, kwargs), measure=False)

  def measured_call(self, *args, **kwargs
                    ) -> tuple[Any, profile_lib.StepProfile]:
    """Runs one step measured, whatever the schedule: its results, and
    what it did (each segment's compute, its waits; see StepProfile)."""
    results = self._call(self._bind(args, kwargs), measure=True)
    return results, self.last_profile

  def _select(self, bound: call_args.BoundCall, signature: Any
              ) -> tuple[CompiledStep, list]:
    """The entry this call runs: the scheduler's plan where it is
    compiled, else the one that ran last while it compiles (see
    compile_ahead); and the plans still compiling (empty: none)."""
    for compiled_for, version, entry in self._scheduler.harvest():
      self.compiles += 1
      self._compiled[(compiled_for, version)] = entry
    if self._ran is not None and self._ran[0] == signature:
      missing = self._scheduler.compiling(
          signature, bound, lambda v: (signature, v) in self._compiled)
      if missing:
        self._ran[1].liveness.check()
        return self._ran[1], missing
    return self._entry(bound, signature), []  # the first call compiles here

  def _call(self, bound: call_args.BoundCall, measure: bool) -> Any:
    self._agree(bound)
    args = bound.args
    signature = compiled_lib.signature(bound)
    entry, compiling = self._select(bound, signature)
    self._plan = entry.plan
    flat_args = jax.tree_util.tree_leaves(args, is_leaf=is_pool_array)
    after_other = self._run_order.runs(self._run_token)
    wanted = not compiling and self._scheduler.wants_measurement(after_other)
    measure = measure or wanted
    if measure:
      jax.block_until_ready(self._last_results)
      registry.flush_device_transfers()
      # Waits of earlier steps belong to them. Forgotten, not drained: up
      # to 65536 of them, every offloaded step's since the last measured
      # one, were handed to Python inside the measured step (41104 took
      # 77 ms here).
      _jcxl.clear_stream_waits()
      started = _jcxl.now_ns()
    handles = frozenset(h for x in flat_args if is_pool_array(x)
                        for _, h in x.local_handles)
    dispatched.wait_for_others(handles)  # a step of another thread first
    self._last_results = entry.executable(*(flat_args[i]
                                            for i in entry.passed))
    # Pool objects the call uses outlive it: what reads, frees or closes
    # them (from any thread, at exit too) waits for it.
    dispatched.note(self._last_results, handles)
    self._host_updates.dispatched(self._last_results)
    if measure:
      jax.block_until_ready(self._last_results)
      registry.flush_device_transfers()  # the step's own GPU waits
      window = (started, _jcxl.now_ns())
      self.last_profile = profile_lib.profile_step(
          self._collect(), self._first_device, window, self._segments)
    version = self._scheduler.version
    self._scheduler.step_done(self.last_profile if wanted else None,
                              compiling)
    if not compiling:
      self._ran = (signature, entry)
      # `plan` is the one the next step runs, when it is compiled already
      # (a race moving on, or settling on the plan it keeps).
      following = (self._compiled.get((signature, self._scheduler.version))
                   if self._scheduler.version != version else None)
      if following is not None:
        self._plan = following.plan
    results = iter(self._last_results)
    out = jax.tree_util.tree_unflatten(
        entry.out_tree, [next(results) if src is None else flat_args[src]
                         for src in entry.sources])
    written = self._written.get(signature, ())
    if written:
      variables = analysis.variables_of(args)
      for i in written:
        v, new = variables[i], next(results)
        if hasattr(v, "set_value"):  # flax 0.12; the .value setter before
          v.set_value(new)
        else:
          v.value = new
    return out

  def device_need(self, *args, **kwargs) -> int:
    """Device bytes the compiled step needs for these arguments."""
    return device_need(self.memory_analysis(*args, **kwargs))

  def memory_analysis(self, *args, **kwargs) -> Any:
    """The compiled step's ``memory_analysis()`` for these arguments."""
    entry = self._compiled.get(self._cache_key(self._bind(args, kwargs)))
    compiled = (entry.executable if entry else
                self.lower(*args, **kwargs).compile())
    return compiled.memory_analysis()

  def _collect(self) -> list[profile_lib.Wait]:
    """Drains the logged waits, for a step's profile. (The report's totals
    are kept apart, in the copy engine: this history of single waits is
    bounded.)"""
    return profile_lib.waits_from_raw(_jcxl.drain_stream_waits())

  def report(self) -> list[LayerReport]:
    """Per layer: bytes moved and time waited, since the last report of
    any step (the copy engine keeps one set of totals per object).

    Waits for the steps already dispatched to finish first.
    """
    jax.block_until_ready(self._last_results)
    registry.flush_device_transfers()
    return reports.layer_reports(
        self._groups, self._first_device,
        [l.name for l in (self.plan.layers if self.plan else ())])


def step_timeline(fn: Callable, state: tuple[Any, ...], *rest: Any,
                  tier_of: Callable[[str], str] = lambda path: "cxl",
                  timed: bool = False
                  ) -> tuple[list[costmodel.Segment], dict[str, int]]:
  """The layer timeline of a step, planned without a pool or any memory.

  `state` holds the step's state arguments as ``jax.ShapeDtypeStruct``
  trees (e.g. ``jax.eval_shape`` of an init): each leaf is planned as if
  placed in tier ``tier_of(path)``. `rest` are the other arguments
  (abstract too). Compute times are estimates (see compute_estimate);
  with `timed`, each segment's work is compiled and timed on the default
  device, on zeros, where its arrays are small enough to allocate.

  Returns:
    The segments, and the bytes of state each layer holds in the pool.
  """
  device = jax.devices()[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  layer_bytes: dict[str, int] = collections.defaultdict(int)

  def virtual(path, leaf):
    path = jax.tree_util.keystr(path)
    layer_bytes[layer_of(path)] += int(np.prod(leaf.shape)) * np.dtype(
        leaf.dtype).itemsize
    return PoolArray(jax.ShapeDtypeStruct((1,), np.int32), pool_id=-1,
                     shape=leaf.shape, dtype=leaf.dtype, sharding=sharding,
                     tier=Tier(tier_of(path)), path=path,
                     local_handles=((device.id, -1),))

  args = tuple(jax.tree_util.tree_map_with_path(virtual, tree)
               for tree in state) + rest
  step = OffloadedStep(fn, None, schedule_lib.FixedSchedule(0))
  bound = step._bind(args, {})
  return (analysis.analyze(bound.args, step._prepare(bound),
                           timed).segments,
          dict(layer_bytes))


def cxl_offload(fn: Callable | None = None, *,
                device_budget: int | str | None = None,
                schedule: str = "fixed:1", in_shardings: Any = None,
                out_shardings: Any = None, static_argnums: Any = None,
                static_argnames: Any = None, donate_argnums: Any = None,
                donate_argnames: Any = None, update: str = "device",
                refetch: bool | None = None,
                async_update: bool = False) -> Any:
  """Rewrites a step so that its pool-resident state streams from the pool.

  Arguments holding ``PoolArray`` leaves (placed with ``jcxl.place``) are
  state. Where the step returns, at the same position, a value of the same
  kind (the same dict keys, dataclass or module; for a single array, the
  same shape and dtype), that value must have the argument's tree
  structure and is written back into the same pool objects (in place). A
  state argument the step returns nothing of that kind for is read-only
  (an eval step returning metrics). Pool-resident leaves a step updates in
  place (an NNX module, with the step returning None) are written back
  too, and so are NNX Variables off the pool (metrics), into the caller's
  Variables, as under ``nnx.jit``; the step gets containers of its own, as
  under ``jax.jit``, so what it pops from or adds to a plain container is
  not handed back. ``pinned_host`` leaves move with JAX's own memory-kind
  transfers; other leaves are passed as they are.

  Example:
    >>> params = jcxl.place(params, "cxl", pool=pool)
    >>> opt_state = jcxl.place(opt_state, "cxl", pool=pool)
    >>> @jcxl.cxl_offload(device_budget="2GiB", schedule="fixed:1")
    ... def train_step(params, opt_state, batch):
    ...   loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    ...   updates, opt_state = tx.update(grads, opt_state, params)
    ...   return optax.apply_updates(params, updates), opt_state, loss
    >>> params, opt_state, loss = train_step(params, opt_state, batch)

  Args:
    fn: the step.
    device_budget: device memory the compiled step may use (bytes or e.g.
      '2GiB'); checked at compile time against ``memory_analysis()``.
    schedule: how far ahead each layer's leaves are fetched:
      'fixed:k' (k layers ahead), 'sync' (k = 0), 'bucket[:N]' (DeepSpeed
      ZeRO-3's prefetch bucket of N elements, default 5e7), 'plan:PATH' (a
      saved ``step.plan``), or 'dap[:PATH]' (Dynamic Adaptive Pipelining:
      planned from a cost model within `device_budget`, then re-planned
      from measured steps, optionally starting from a saved plan).
    in_shardings, out_shardings: as ``jax.jit``'s: a pytree prefix of the
      arguments (outputs) with ``jax.sharding.Sharding`` or None leaves.
      Host values are put where `in_shardings` says; a device array must
      already be laid out so. Returned values are laid out as
      `out_shardings` says. Pool-resident state keeps the sharding it was
      placed with: one given for it must match.
    static_argnums, static_argnames, donate_argnums, donate_argnames: as
      ``jax.jit``'s. Static arguments must be hashable; each new value
      compiles the step anew. Donated device arrays are consumed by the
      call; pool-resident state is updated in place either way. Keyword
      arguments are accepted as ``jax.jit`` accepts them.
    update: where each layer's optimizer update runs. 'device' (the
      default): in the step, its state streamed in and the new state
      stored back. 'host': next to the memory, in place on the pool's
      objects (nvme state through staging), by the host CPU's kernels
      while the device goes on; only the gradients leave the device, and
      the new weights come in when they are next needed. It runs
      elementwise updates (adam, adamw, sgd with momentum, lion, ... with
      schedules, masks and clip_by_global_norm, whose scalars the device
      computes); a leaf whose update is not elementwise (a norm of the
      leaf, as in lamb) is refused with ValueError naming it. 'auto': per
      layer, the path predicted faster from measured rates (the link's,
      the host update's and the device's); other layers on the device.
      ``step.plan`` says where each layer's update ran, and why.
    refetch: True: fetch a weight again for each later use far from the
      last (its backward pass after its forward pass): the device holds a
      layer's weights only while it computes with them. False: each
      weight comes in once a step and stays from its first use to its
      last, 4 bytes per parameter less traffic (with update='host',
      weights in and gradients out: 8 bytes per fp32 parameter) for the
      device memory of every weight in between. None (the default): with
      update='host', per layer: every weight kept where the compiled step
      then fits `device_budget`, else the layers nearest the loss whose
      weights fit kept and the others refetched (all where none fit);
      with update='auto' the same for the layers updated on the host;
      True otherwise. ``step.plan`` says which per layer (its ``refetch``)
      and why (a line of its ``updates``).
    async_update: for the layers updated on the host: False (the
      default): the step returns once their new state is in the pool.
      True: once their updates are started; what uses an object next (the
      next step's fetch of a weight, its store of a gradient, ``get``, a
      checkpoint) waits for that object's update alone, and the updates
      the next step waits for go first, so its forward pass overlaps the
      tail of the updates. The values are the same. A failed update fails
      the next read of what it writes, naming it. ``pool.updates.wait()``
      waits for them all (before timing a step).

  Returns:
    The rewritten step; ``step.plan`` is the per-layer plan it compiled
    (``print`` it; ``step.plan.save(path)`` keeps it), ``step.report()``
    the bytes moved and time waited per layer, ``step.tuner`` the DAP
    tuner (its ``history``) and ``step.last_profile`` the last measured
    step (per layer transfer, compute and stall time).

  Example with the adaptive schedule:
    >>> @jcxl.cxl_offload(device_budget="2GiB", schedule="dap")
    ... def train_step(params, opt_state, batch): ...
    >>> for batch in batches:
    ...   params, opt_state, loss = train_step(params, opt_state, batch)
    >>> print(train_step.plan)   # per layer: prefetch, chunk; and why
    >>> train_step.plan.save("plan.json")  # schedule="dap:plan.json" later
  """
  budget = (None if device_budget is None else
            parse_bytes(device_budget, name="device_budget"))
  parsed = schedule_lib.parse_schedule(schedule)
  host_update_ir.check_mode(update)
  if not isinstance(async_update, bool):
    raise TypeError(f"async_update must be True or False, not "
                    f"{async_update!r}")
  if refetch is not None and not isinstance(refetch, bool):
    raise TypeError(f"refetch must be True or False (or None: chosen), "
                    f"not {refetch!r}")

  def wrap(f):
    if not callable(f):
      raise TypeError(f"cxl_offload decorates a function, but got {f!r}")
    return OffloadedStep(f, budget, parsed, in_shardings, out_shardings,
                         call_args.Signature(f, static_argnums,
                                             static_argnames, donate_argnums,
                                             donate_argnames),
                         update=update, refetch=refetch,
                         async_update=async_update)

  return wrap if fn is None else wrap(fn)
