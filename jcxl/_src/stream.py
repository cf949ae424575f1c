"""Streaming ops: fetch pool objects into a jitted step and store them back.

Each transfer is a start/done pair of XLA FFI calls (see
ffi/stream_handlers.h): compute placed between the two runs while the copy
engine moves the bytes. ``fetch`` and ``store`` issue both halves;
``fetch_start`` / ``fetch_done`` let a schedule put compute in between.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jcxl._src import errors
from jcxl._src import pool_array as pool_array_lib
from jcxl._src import registry
from jcxl._src import validation
from jcxl._src.pool_array import PoolArray

P = jax.sharding.PartitionSpec


class Pending:
  """A fetch in flight: pass it to ``fetch_done`` in the same loop body."""

  def __init__(self, buffer: jax.Array, spec: P | None, mesh: Any,
               timeout_ms: np.int64):
    self.buffer = buffer
    self.spec = spec
    self.mesh = mesh
    self.timeout_ms = timeout_ms  # the pool's deadline for the copy


def _checked(x: Any, op: str) -> tuple[PoolArray, Any]:
  """Trace-time checks of a PoolArray operand; returns it and its pool."""
  if not isinstance(x, PoolArray):
    raise TypeError(f"jcxl.{op} takes a jcxl.PoolArray, but got "
                    f"{type(x).__name__}; place the value with jcxl.place")
  pool = registry.find_pool(x.pool_id, what=x._what())
  for _, handle in x.local_handles:
    try:
      info = pool.info(handle)
    except errors.UnknownHandleError:
      raise x._freed(handle) from None
    if info.shape != x.object_shard_shape or info.dtype != x.dtype:
      raise ValueError(
          f"{x._what()}: object {handle} holds {info.dtype}{list(info.shape)}"
          f" but the PoolArray expects {x.dtype}{list(x.object_shard_shape)}")
  return x, pool


def _copy_args(op: str, priority: Any, chunk_bytes: Any) -> tuple[int, int]:
  """A copy's priority (int32) and chunk size (int64 >= 0), checked before
  they become custom-call attributes."""
  return (validation.as_count(priority, name=f"jcxl.{op} priority",
                              low=validation.INT32_MIN,
                              high=validation.INT32_MAX, what="an int32"),
          validation.as_count(chunk_bytes, name=f"jcxl.{op} chunk_bytes"))


def _local_shape(x: PoolArray, stacked: bool) -> tuple[int, ...]:
  shape = x.shard_shape
  return shape[1:] if stacked else shape


def _index(index: Any, x: PoolArray) -> tuple[jax.Array, bool]:
  if index is None:
    return jnp.zeros((), jnp.int32), False
  if x.ndim == 0:
    raise ValueError(f"{x._what()} is a scalar; it has no slices to index")
  if isinstance(x.sharding, jax.sharding.NamedSharding):
    spec = tuple(x.sharding.spec) + (None,) * x.ndim
    if spec[0] is not None:
      raise ValueError(
          f"{x._what()}: slicing along axis 0 needs that axis unsharded, but "
          f"the sharding is {x.sharding.spec}")
  index = jnp.asarray(index)
  if index.shape != () or not jnp.issubdtype(index.dtype, jnp.integer):
    raise TypeError(f"index must be an integer scalar, got {index.dtype}"
                    f"{list(index.shape)}")
  return index.astype(jnp.int32), True


def _dependency(after: Any) -> jax.Array:
  """The "not before" operand: a value the transfer must wait for."""
  leaves = [jnp.asarray(a) for a in jax.tree_util.tree_leaves(after)]
  leaves = [jax.random.key_data(a) if jax.dtypes.issubdtype(
      a.dtype, jax.dtypes.prng_key) else a for a in leaves]  # typed keys
  scalars = [a.reshape(-1)[0].astype(jnp.float32) for a in leaves if a.size]
  if not scalars:
    return jnp.zeros((), jnp.int32)
  # A scalar from each value, not the values: a whole value as the call's
  # operand lives until the call runs (on XLA:CPU that cost a prefetching
  # step a quarter of its time). The barrier keeps XLA's early passes from
  # computing a scalar from its value's inputs, ahead of the value; later
  # ones may still move it an op earlier, and the device budget is checked
  # on the compiled step either way.
  _, scalars = jax.lax.optimization_barrier((leaves, scalars))
  return scalars[0] if len(scalars) == 1 else jnp.stack(scalars)


def _spec(x: PoolArray, stacked: bool) -> P:
  spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
  return P(*(spec[1:] if stacked else spec))


def _with_spec(value: jax.Array, mesh: Any, spec: P) -> jax.Array:
  """`value` laid out as `spec` (shard_map checks it on explicit meshes)."""
  sharding = jax.sharding.NamedSharding(mesh, spec)
  if jax.sharding.AxisType.Explicit in tuple(mesh.axis_types):
    return jax.sharding.reshard(value, sharding)
  return jax.lax.with_sharding_constraint(value, sharding)


def _timeout_ms(pool) -> np.int64:
  return np.int64(validation.timeout_ms(pool._timeout_s))


def _device_attrs(x: PoolArray, index: Any, pool) -> dict[str, Any]:
  """What the CUDA handlers read on the host (the CPU ones ignore it, the
  same call lowering for either platform): each local device's handle by
  its ordinal, the slice index where it is a constant (else -1: it is read
  on the device), and the deadline of a transfer staged through the pool's
  copy engine."""
  ordinal = {d.id: d.local_hardware_id for d in jax.local_devices()}
  pairs = [v for device_id, handle in x.local_handles
           for v in (ordinal.get(device_id, -1), handle)]
  static = int(index) if isinstance(index, (int, np.integer)) else -1
  return {"device_handles": np.asarray(pairs, np.int32),
          "static_index": np.int64(static), "timeout_ms": _timeout_ms(pool)}


def _start_call(handle, index, after, *into, shape, dtype, pool_id, stacked,
                block_rows, priority, chunk_bytes, device_attrs):
  name = "jcxl_fetch_start_into" if into else "jcxl_fetch_start"
  return jax.ffi.ffi_call(
      name, jax.ShapeDtypeStruct(shape, dtype), has_side_effect=True,
      input_output_aliases={3: 0} if into else None)(
          handle, index, after, *into, pool_id=np.int32(pool_id),
          stacked=stacked, block_rows=np.int64(block_rows),
          priority=np.int32(priority), chunk_bytes=np.int64(chunk_bytes),
          **device_attrs)


def _done_call(buffer, after, *, timeout_ms):
  return jax.ffi.ffi_call(
      "jcxl_fetch_done", jax.ShapeDtypeStruct(buffer.shape, buffer.dtype),
      input_output_aliases={0: 0}, has_side_effect=True)(
          buffer, after, timeout_ms=timeout_ms)


def _after_call(x, dep):
  return jax.ffi.ffi_call(
      "jcxl_after", jax.ShapeDtypeStruct(x.shape, x.dtype),
      input_output_aliases={0: 0})(x, dep)


def read_mark(value: jax.Array) -> jax.Array:
  """A scalar that exists once `value` does: a cheap dependency on it that
  does not keep it alive.

  A scalar read from `value` alone would be fused by XLA into whatever
  consumes it, however late (a host update at the end of the backward
  pass): `value` then stays live until there, which on XLA:CPU kept every
  block's fetched weights in the step's memory at once (9 GiB at 4.25B
  parameters). Passed through the identity call, the scalar is its own
  small buffer, read from `value` where the scheduler frees it.
  """
  if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
    value = jax.random.key_data(value)
  scalar = (value.reshape(-1)[0].astype(jnp.float32) if value.size
            else jnp.zeros((), jnp.float32))
  registry.register_ffi_targets()
  return _after_call(scalar, jnp.zeros((), jnp.int32))


def order_after(tree: Any, dep: Any) -> Any:
  """`tree` unchanged, but not available before `dep` exists.

  Orders work that no data orders (compute after a fetch is issued). On a
  mesh it returns `tree` as is: the identity call would be replicated.
  """
  deps = [d.buffer if isinstance(d, Pending) else d
          for d in jax.tree_util.tree_leaves(
              dep, is_leaf=lambda d: isinstance(d, Pending))]
  if not deps or any(isinstance(d, Pending) and d.mesh is not None
                     for d in jax.tree_util.tree_leaves(
                         dep, is_leaf=lambda d: isinstance(d, Pending))):
    return tree
  registry.register_ffi_targets()
  return jax.tree_util.tree_map(lambda x: _after_call(x, deps[0]), tree)


def fetch_start(x: PoolArray, index: Any = None, *, after: Any = None,
                into: jax.Array | None = None, priority: int = 0,
                chunk_bytes: int = 0) -> Pending:
  """Starts copying `x` (or its slice `index` along axis 0) into the step.

  Args:
    x: a PoolArray.
    index: optional traced integer: fetch ``x[index]`` of a stacked array.
    after: a value (or pytree) that must exist before the copy is issued.
    priority: lower values are served first by the copy engine.
    chunk_bytes: size of the copy's pieces (0: the pool's default).
    into: an array of the fetched shape whose buffer the copy reuses in
      place (a loop's carry), instead of a new one.
  """
  registry.register_ffi_targets()
  x, pool = _checked(x, "fetch")
  priority, chunk_bytes = _copy_args("fetch", priority, chunk_bytes)
  device_attrs = _device_attrs(x, index, pool)
  index, stacked = _index(index, x)
  sharded = isinstance(x.sharding, jax.sharding.NamedSharding)
  dep = _dependency(after)
  call = functools.partial(
      _start_call, shape=_local_shape(x, stacked), dtype=x.dtype,
      pool_id=x.pool_id, stacked=stacked, block_rows=x.block_rows,
      priority=priority, chunk_bytes=chunk_bytes, device_attrs=device_attrs)
  into = () if into is None else (into,)
  timeout_ms = _timeout_ms(pool)
  if not sharded:
    return Pending(call(x.handles, index, dep, *into), None, None,
                   timeout_ms)
  mesh = x.sharding.mesh
  out_spec = _spec(x, stacked)
  buffer = jax.shard_map(
      call, mesh=mesh,
      in_specs=(P(*mesh.axis_names), P(), P()) + (out_spec,) * len(into),
      out_specs=out_spec, check_vma=False)(x.handles, index, dep, *into)
  return Pending(buffer, out_spec, mesh, timeout_ms)


def fetch_done(pending: Pending, *, after: Any = None,
               timeout_s: float | None = None) -> jax.Array:
  """Waits for a fetch started by ``fetch_start``; returns the array.

  Args:
    pending: the fetch.
    after: a value to wait for before waiting on the copy (the compute the
      copy should overlap), so the scheduler cannot hoist the wait.
    timeout_s: how long the copy may take (default: the pool's
      ``timeout_s``).
  """
  timeout_ms = (pending.timeout_ms if timeout_s is None else np.int64(
      validation.timeout_ms(validation.as_timeout(timeout_s))))
  call = functools.partial(_done_call, timeout_ms=timeout_ms)
  dep = _dependency(after)
  if pending.mesh is None:
    return call(pending.buffer, dep)
  return jax.shard_map(call, mesh=pending.mesh, in_specs=(pending.spec, P()),
                       out_specs=pending.spec,
                       check_vma=False)(pending.buffer, dep)


def _fetch(x, index, after, priority, chunk_bytes):
  # fetch_start's Pending carries the pool's deadline to fetch_done.
  return fetch_done(fetch_start(x, index, after=after, priority=priority,
                                chunk_bytes=chunk_bytes))


# The PoolArray goes in without its handles, as a static argument: JAX's
# differentiation takes it as a leaf, not as the handle array it traces.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5, 6))
def _fetch_wrt(x, handles, wrt, index, after, priority, chunk_bytes):
  del wrt
  return _fetch(x.with_handles(handles), index, after, priority, chunk_bytes)


def _fetch_wrt_fwd(x, handles, wrt, index, after, priority, chunk_bytes):
  del wrt
  return (_fetch(x.with_handles(handles), index, after, priority,
                 chunk_bytes), (handles, index, after))


def _zero_cotangent(value):
  value = jnp.asarray(value)
  if jnp.issubdtype(value.dtype, jnp.inexact):
    return jnp.zeros_like(value)
  return np.zeros(value.shape, jax.dtypes.float0)


def _fetch_wrt_bwd(x, priority, chunk_bytes, residuals, g):
  del x, priority, chunk_bytes
  handles, index, after = residuals
  # The gradient goes to `wrt`; handles, index and `after` get zeros.
  return (_zero_cotangent(handles), g,
          None if index is None else _zero_cotangent(index),
          jax.tree_util.tree_map(_zero_cotangent, after))


_fetch_wrt.defvjp(_fetch_wrt_fwd, _fetch_wrt_bwd)


def fetch(x: PoolArray, index: Any = None, *, after: Any = None,
          wrt: Any = None, priority: int = 0, chunk_bytes: int = 0
          ) -> jax.Array:
  """Fetches a PoolArray (or its slice `index`) into the jitted step.

  Example:
    >>> @jax.jit
    ... def apply(w, x):
    ...   return x @ jcxl.fetch(w)
    >>> y = apply(jcxl.place(kernel, "cxl", pool=pool), x)

  Args:
    x: the PoolArray.
    index: optional traced integer: fetch ``x[index]`` (stacked layers).
    after: a value that must exist before the copy starts (bounds how many
      fetched buffers are live at once).
    wrt: optional array standing in for the weight under differentiation:
      ``jax.grad`` with respect to `wrt` gives the gradient with respect to
      the fetched value (its own value is never read).
    priority: lower values are served first by the copy engine.
    chunk_bytes: size of the copy's pieces (0: the pool's default).

  Returns:
    A ``jax.Array`` with `x`'s shape (or its slice's), dtype and sharding.
  """
  if wrt is None:
    return _fetch(x, index, after, priority, chunk_bytes)
  if not isinstance(x, PoolArray):
    _checked(x, "fetch")  # raises the TypeError naming what it got
  return _fetch_wrt(x.with_handles(None), x.handles, wrt, index, after,
                    priority, chunk_bytes)


pool_array_lib.readers.fetch = fetch  # see PoolArray.__jax_array__


def _store_start_call(handle, index, value, after, *, pool_id, stacked,
                      block_rows, priority, chunk_bytes, device_attrs):
  return jax.ffi.ffi_call(
      "jcxl_store_start", jax.ShapeDtypeStruct(value.shape, value.dtype),
      input_output_aliases={2: 0}, has_side_effect=True)(
          handle, index, value, after, pool_id=np.int32(pool_id),
          stacked=stacked, block_rows=np.int64(block_rows),
          priority=np.int32(priority), chunk_bytes=np.int64(chunk_bytes),
          **device_attrs)


def _store_done_call(buffer, *, timeout_ms):
  return jax.ffi.ffi_call(
      "jcxl_store_done", jax.ShapeDtypeStruct((1,), jnp.int32),
      has_side_effect=True)(buffer, timeout_ms=timeout_ms)


class PendingStore:
  """A store in flight: pass it to ``store_done``."""

  def __init__(self, buffer: jax.Array, mesh: Any, spec: P | None,
               timeout_ms: np.int64):
    self.buffer = buffer
    self.mesh = mesh
    self.spec = spec
    self.timeout_ms = timeout_ms


def store_start(x: PoolArray, value: jax.Array, index: Any = None, *,
                after: Any = None, priority: int = 0, chunk_bytes: int = 0
                ) -> PendingStore:
  """Starts writing `value` into PoolArray `x` (or its slice `index`)."""
  registry.register_ffi_targets()
  x, pool = _checked(x, "store")
  priority, chunk_bytes = _copy_args("store", priority, chunk_bytes)
  device_attrs = _device_attrs(x, index, pool)
  index, stacked = _index(index, x)
  expected = x.shape[1:] if stacked else x.shape
  if tuple(value.shape) != tuple(expected) or value.dtype != x.dtype:
    raise ValueError(
        f"{x._what()}: cannot store {value.dtype}{list(value.shape)} into "
        f"{x.dtype}{list(expected)}")
  sharded = isinstance(x.sharding, jax.sharding.NamedSharding)
  dep = _dependency(after)
  call = functools.partial(
      _store_start_call, pool_id=x.pool_id, stacked=stacked,
      block_rows=x.block_rows, priority=priority, chunk_bytes=chunk_bytes,
      device_attrs=device_attrs)
  timeout_ms = _timeout_ms(pool)
  if not sharded:
    return PendingStore(call(x.handles, index, value, dep), None, None,
                        timeout_ms)
  mesh = x.sharding.mesh
  spec = _spec(x, stacked)
  value = _with_spec(value, mesh, spec)
  buffer = jax.shard_map(
      call, mesh=mesh, in_specs=(P(*mesh.axis_names), P(), spec, P()),
      out_specs=spec, check_vma=False)(x.handles, index, value, dep)
  return PendingStore(buffer, mesh, spec, timeout_ms)


def store_done(pending: PendingStore) -> jax.Array:
  """Waits for a store; returns a small int32 token (one per device)."""
  call = functools.partial(_store_done_call, timeout_ms=pending.timeout_ms)
  if pending.mesh is None:
    return call(pending.buffer)
  return jax.shard_map(call, mesh=pending.mesh, in_specs=(pending.spec,),
                       out_specs=P(pending.mesh.axis_names),
                       check_vma=False)(pending.buffer)


def store(x: PoolArray, value: jax.Array, index: Any = None, *,
          after: Any = None, priority: int = 0, chunk_bytes: int = 0
          ) -> jax.Array:
  """Writes `value` into PoolArray `x` (or its slice `index`) in place.

  The write finishes before the step returns. The result is a small int32
  token; pass it as `after` to a later fetch of the same object to order
  the two.

  Example:
    >>> @jax.jit
    ... def scale(w):
    ...   return jcxl.store(w, jcxl.fetch(w) * 2)
    >>> scale(w)  # w's objects in the pool now hold the doubled values

  Raises:
    ValueError: `value`'s shape or dtype does not match `x`.
  """
  return store_done(store_start(x, value, index, after=after,
                                priority=priority, chunk_bytes=chunk_bytes))


def _update_start_call(scalars, after, *, pool_id, program):
  return jax.ffi.ffi_call(
      "jcxl_update_start", jax.ShapeDtypeStruct((2,), jnp.int32),
      has_side_effect=True)(scalars, after, pool_id=np.int32(pool_id),
                            program=np.int32(program))


def _update_done_call(token, after, *, timeout_ms):
  return jax.ffi.ffi_call(
      "jcxl_update_done", jax.ShapeDtypeStruct((1,), jnp.int32),
      has_side_effect=True)(token, after, timeout_ms=timeout_ms)


def update_start(pool_id: int, program_id: int, scalars: Any, after: Any = None
                 ) -> jax.Array:
  """Starts a run of update program `program_id` inside a jitted step.

  The run (see ``pool.updates.run``) goes on the pool's update threads while
  the step carries on; ``update_done`` waits for it. Call it once per step
  on one device (not replicated over a mesh: every replica would start a
  run).

  Args:
    pool_id: the pool's id (``Pool.id``).
    program_id: what ``pool.updates.register`` returned.
    scalars: the run's float32[num_scalars] values (learning rate, bias
      corrections...), traced.
    after: a value (or pytree) that must exist before the run starts: the
      stores of the objects the program reads (the gradients).

  Returns:
    An int32[2] token naming the run, for ``update_done``.

  Raises:
    PoolClosedError: the pool is closed.
    UnknownHandleError: the program is not registered in the pool.
    ValueError: `scalars` is not a vector of num_scalars floats.
  """
  registry.register_ffi_targets()
  pool = registry.find_pool(pool_id, what=f"update program {program_id}")
  program = pool.updates.program(program_id)
  scalars = jnp.asarray(scalars)
  if scalars.ndim != 1 or not jnp.issubdtype(scalars.dtype, jnp.floating):
    raise ValueError(f"update program {program_id}: scalars must be a "
                     f"float vector, got {scalars.dtype}{list(scalars.shape)}")
  if scalars.shape[0] != program.num_scalars:
    raise ValueError(f"update program {program_id} takes "
                     f"{program.num_scalars} scalars per run, got "
                     f"{scalars.shape[0]}")
  return _update_start_call(scalars.astype(jnp.float32), _dependency(after),
                            pool_id=pool_id, program=program_id)


def update_done(token: jax.Array, after: Any = None,
                timeout_ms: int | None = None, *, pool_id: int | None = None,
                wait: bool = True) -> jax.Array:
  """Waits for the update run `token` names; returns an int32[1] zero.

  Args:
    token: ``update_start``'s result.
    after: a value to wait for first (compute the run should overlap).
    timeout_ms: how long the run may take: past it the step fails
      (DEADLINE_EXCEEDED, naming the program; the run itself goes on).
      None: the timeout of pool `pool_id`, or without one the default
      pool timeout (``DEFAULT_TIMEOUT_S``).
    pool_id: the run's pool, for its timeout.
    wait: False: the step does not wait; the run is left to the pool,
      whose later transfers of its objects wait for it (see
      ``pool.updates.wait``).
  """
  if not wait:
    registry.register_ffi_targets()
    return _update_done_call(token, _dependency(after),
                             timeout_ms=np.int64(-1))
  if timeout_ms is None:
    if pool_id is not None:
      timeout_ms = _timeout_ms(registry.find_pool(pool_id))
    else:
      from jcxl._src import pool as pool_lib  # pylint: disable=g-import-not-at-top
      timeout_ms = validation.timeout_ms(pool_lib.DEFAULT_TIMEOUT_S)
  timeout_ms = np.int64(validation.as_count(timeout_ms, name="timeout_ms",
                                            high=2**63 - 1))
  registry.register_ffi_targets()
  return _update_done_call(token, _dependency(after), timeout_ms=timeout_ms)


def _tree_fetch_start(weights, index, after, priority, chunk_bytes=0):
  return jax.tree_util.tree_map(
      lambda w: fetch_start(w, index, after=after, priority=priority,
                            chunk_bytes=chunk_bytes),
      weights, is_leaf=lambda w: isinstance(w, PoolArray))


def _tree_fetch_done(pending, after=None):
  return jax.tree_util.tree_map(lambda p: fetch_done(p, after=after), pending,
                                is_leaf=lambda p: isinstance(p, Pending))


def streamed_scan(body, carry: Any, weights: Any, xs: Any = None, *,
                  length: int, reverse: bool = False, prefetch: int = 1,
                  chunk_bytes: int = 0) -> tuple[Any, Any]:
  """``lax.scan`` whose per-layer weights stream from the pool.

  Like ``lax.scan(lambda c, x: body(c, w[i], x), carry, xs)`` where ``w[i]``
  is slice ``i`` (the layer being run) of every stacked PoolArray in
  `weights`. Each layer's weights are fetched `prefetch` layers ahead of
  their use, issued once the carry of the layer before exists, and finished
  in the same loop iteration (a copy in flight never crosses a loop
  boundary); the last `prefetch` layers run from the fetched queue. At most
  ``prefetch + 2`` layers' weights are on the device at once.

  Args:
    body: ``body(carry, layer_weights, x) -> (carry, y)``.
    carry: the initial carry.
    weights: a pytree of PoolArrays stacked along axis 0 (`length` long).
    xs: a pytree of arrays stacked along axis 0, or None.
    length: the number of layers.
    reverse: run the layers from last to first (as a backward pass does).
    prefetch: how many layers ahead to fetch; 0: fetch each layer right
      before it runs.
    chunk_bytes: size of the copies' pieces (0: the pool's default).

  Returns:
    ``(carry, ys)`` as ``lax.scan`` returns them.
  """
  if not isinstance(prefetch, int) or prefetch < 0:
    raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
  k = min(prefetch, length)
  step = -1 if reverse else 1
  order = list(range(length))[::step]  # layer indices in iteration order
  layers = jnp.arange(length, dtype=jnp.int32)

  def fetch_layer(i, after, priority=0):
    return _tree_fetch_done(
        _tree_fetch_start(weights, i, after, priority, chunk_bytes))

  if k == 0:
    def sync_body(c, ix):
      i, x = ix
      return body(c, fetch_layer(i, c), x)
    return jax.lax.scan(sync_body, carry, (layers, xs), reverse=reverse)

  # Layers [0, n_ring) run in loop steps of k + 1 layers over a ring of
  # k + 1 buffers per weight, kept in the carry and fetched into in place
  # (no copy per layer): while layer t runs from slot t % (k+1), layer t+k
  # is fetched into slot (t-1) % (k+1), whose layer has just run. The rest
  # run unrolled.
  ring_size = k + 1
  super_steps = max(0, (length - 2 * k) // ring_size)
  n_ring = super_steps * ring_size

  def fetch_into(i, after, slot, priority=0):
    return jax.tree_util.tree_map(
        lambda w, buf: fetch_start(w, i, after=after, into=buf,
                                   chunk_bytes=chunk_bytes,
                                   priority=priority),
        weights, slot, is_leaf=lambda w: isinstance(w, PoolArray))

  def empty_slot():
    def one(w):
      slot = jnp.zeros(w.shape[1:], w.dtype)
      if isinstance(w.sharding, jax.sharding.NamedSharding):
        slot = _with_spec(slot, w.sharding.mesh, _spec(w, True))
      return slot
    return jax.tree_util.tree_map(
        one, weights, is_leaf=lambda w: isinstance(w, PoolArray))

  ring = [fetch_layer(order[j], None, j) for j in range(k)] + [empty_slot()]
  take_x = lambda i: jax.tree_util.tree_map(lambda a: a[i], xs)
  # Each layer's ys go straight into one stack per leaf, at the layer's
  # index, carried through the loop and updated in place: stacking the
  # loop's and the unrolled layers' ys, joining and reversing them held
  # up to three copies of the stack at once (a backward pass's ys are its
  # stacked weight gradients: 27 layers' worth more than at prefetch 0).
  y_shapes = jax.eval_shape(lambda c, w, x: body(c, w, x)[1], carry, ring[0],
                            take_x(order[0]))
  ys = jax.tree_util.tree_map(
      lambda y: jnp.zeros((length,) + y.shape, y.dtype), y_shapes)

  def put(ys, y, i):
    return jax.tree_util.tree_map(
        lambda stack, v: jax.lax.dynamic_update_index_in_dim(stack, v, i, 0),
        ys, y)

  def ring_body(state, base):
    c, ring, ys = state
    ring = list(ring)
    for t in range(ring_size):
      t_layer = base + t  # position in iteration order
      i = jnp.where(reverse, length - 1 - t_layer, t_layer)
      nxt = jnp.where(reverse, length - 1 - (t_layer + k), t_layer + k)
      free = (t - 1) % ring_size
      pending = fetch_into(nxt, c, ring[free])
      c, y = body(order_after(c, pending), ring[t], take_x(i))
      ring[free] = _tree_fetch_done(pending, after=c)
      ys = put(ys, y, i)
    # k + 1 layers ran: one full turn, so slot 0 holds the next layer.
    return (c, tuple(ring), ys), None

  if super_steps:
    (carry, ring, ys), _ = jax.lax.scan(
        ring_body, (carry, tuple(ring), ys),
        jnp.arange(super_steps, dtype=jnp.int32) * ring_size)
  # The rest: layers n_ring .. length-1 in iteration order, k of them already
  # in the ring's first k slots; the others fetched one layer ahead of use.
  queue = list(ring[:k])
  for t in range(n_ring, length):
    ahead = t + k
    pending = (_tree_fetch_start(weights, order[ahead], carry, 0, chunk_bytes)
               if ahead < length else None)
    w = queue.pop(0)
    carry, y = body(carry if pending is None else order_after(carry, pending),
                    w, take_x(order[t]))
    ys = put(ys, y, order[t])
    if pending is not None:
      queue.append(_tree_fetch_done(pending, after=carry))
  return carry, ys


def layer_scan(body, carry: Any, weights: Any, *, prefetch: int = 1) -> Any:
  """Runs ``carry = body(carry, w[i])`` over stacked pool-resident layers.

  A convenience form of ``streamed_scan`` (see there) for a plain chain of
  layers.

  Args:
    body: ``body(carry, layer_weights) -> carry``.
    carry: the initial carry (e.g. the activations).
    weights: a pytree of PoolArrays stacked along axis 0 (same length).
    prefetch: how many layers ahead to fetch (0: no overlap).

  Returns:
    The final carry.
  """
  leaves = jax.tree_util.tree_leaves(
      weights, is_leaf=lambda w: isinstance(w, PoolArray))
  if not leaves or not all(isinstance(w, PoolArray) for w in leaves):
    raise TypeError("layer_scan's weights must be a pytree of PoolArrays")
  lengths = {w.shape[0] if w.ndim else None for w in leaves}
  if len(lengths) != 1 or None in lengths:
    raise ValueError(f"layer_scan's weights must share their leading "
                     f"(layer) axis; got lengths {sorted(map(str, lengths))}")
  (length,) = lengths
  carry, _ = streamed_scan(lambda c, w, _: (body(c, w), None), carry, weights,
                           length=length, prefetch=prefetch)
  return carry
