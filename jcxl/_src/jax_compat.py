"""Every use of JAX internals goes through this module: those APIs move
between JAX releases, and this is the one place to adapt."""

from __future__ import annotations

import jax
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects
from jax._src import ffi as _ffi


def allow_ffi_effects_in_remat() -> None:
  """Lets side-effecting FFI calls (jcxl's fetches) run inside jax.checkpoint.

  Rematerialization then re-issues the fetch in the backward pass, which is
  what streaming wants: the weight is fetched again instead of being kept
  on the device from the forward pass to the backward pass.
  """
  _effects.remat_allowed_effects.add_type(_ffi.FfiEffect)
  _effects.custom_derivatives_allowed_effects.add_type(_ffi.FfiEffect)


def effects_barrier() -> None:
  """Waits for the computations with side effects dispatched so far.

  As ``jax.effects_barrier``, but a failed one (a step whose fetch timed
  out) is reported once: JAX keeps its error and raises it again from every
  later barrier, and at exit, until another such computation replaces it.
  """
  try:
    jax.effects_barrier()
  except Exception:
    _dispatch.runtime_tokens.clear()
    raise


def distributed_client():
  """The client of JAX's coordination service (its key-value store), or
  None before ``jax.distributed.initialize``."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client


def literal_type():
  from jax.extend import core as jex  # pylint: disable=g-import-not-at-top
  return jex.Literal


def jaxpr_types():
  """(ClosedJaxpr, Jaxpr) classes."""
  from jax.extend import core as jex  # pylint: disable=g-import-not-at-top
  return jex.ClosedJaxpr, jex.Jaxpr


def sub_jaxpr(eqn):
  """The (jaxpr, consts) called by a call-like equation, or None."""
  closed_cls, jaxpr_cls = jaxpr_types()
  for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    value = eqn.params.get(name)
    if isinstance(value, closed_cls):
      return value.jaxpr, list(value.consts)
    if isinstance(value, jaxpr_cls):
      return value, []
  return None


def barrier_eqn(avals):
  """An ``optimization_barrier`` equation over values of these avals (what
  JAX's remat lowering puts before a recomputation)."""
  structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
  closed = jax.make_jaxpr(
      lambda *xs: jax.lax.optimization_barrier(xs))(*structs)
  (eqn,) = closed.jaxpr.eqns
  return eqn


def bind(eqn, values, **overrides):
  """Evaluates one equation on concrete (or traced) values."""
  params = dict(eqn.primitive.get_bind_params(eqn.params), **overrides)
  out = eqn.primitive.bind(*values, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def eval_jaxpr(jaxpr, consts, *args):
  from jax.extend import core as jex  # pylint: disable=g-import-not-at-top
  return jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, consts))(*args)


def saved_residual_bytes(fn, *args) -> int:
  """Bytes the forward pass of `fn` saves for its backward pass (the
  activations), arguments excluded; `args` may be abstract."""
  import math  # pylint: disable=g-import-not-at-top
  from jax._src import ad_checkpoint  # pylint: disable=g-import-not-at-top
  return sum(math.prod(aval.shape) * aval.dtype.itemsize
             for aval, why in ad_checkpoint.saved_residuals(fn, *args)
             if "argument" not in why)


def dce_jaxpr(jaxpr, used_outputs):
  """`jaxpr` cut down to the work `used_outputs` need; with the inputs
  that work reads (a list of bools, one per input)."""
  from jax._src.interpreters import partial_eval  # pylint: disable=g-import-not-at-top
  return partial_eval.dce_jaxpr(jaxpr, used_outputs, instantiate=True)


def cast_eqn(aval, dtype):
  """A ``convert_element_type`` equation from values of `aval` to `dtype`
  (its input variable has `aval`)."""
  struct = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
  closed = jax.make_jaxpr(lambda x: jax.lax.convert_element_type(x, dtype))(
      struct)
  (eqn,) = closed.jaxpr.eqns
  return eqn


def scan_counts(params) -> tuple[int, int]:
  """(number of consts, number of carries) of a ``scan`` equation's params.

  JAX up to 0.10 names them (``num_consts``, ``num_carry``); later releases
  keep one flat tree of (consts, carry, xs) operands in ``ft_in``.
  """
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return _flat_count(consts), _flat_count(carry)


def _flat_count(tree) -> int:
  vals = tree.vals
  return len(list(vals() if callable(vals) else vals))


def register_traced_node(cls, flatten, unflatten) -> None:
  """Makes `cls` a pytree node where JAX traces and dispatches (``jax.jit``,
  ``lax.scan``, ``jax.checkpoint``) and leaves it a leaf for ``jax.tree``.

  JAX keeps separate pytree registries for its users' tree functions and
  for tracing; a type registered in the latter only reaches a jitted
  function whole, its children traced. JAX releases without them get a
  node everywhere (``jax.tree.leaves`` then lists the children).
  """
  from jax._src import tree_util  # pylint: disable=g-import-not-at-top
  registries = [getattr(tree_util, name, None)
                for name in ("tracing_registry", "dispatch_registry")]
  if None in registries:
    jax.tree_util.register_pytree_node(cls, flatten, unflatten)
    return
  for registry in registries:
    registry.register_node(cls, flatten, unflatten)


def register_abstract_error(cls, error) -> None:
  """Has JAX raise ``error(x)`` where it needs an abstract value (an aval)
  for an object of type `cls` passed to a transformation as a leaf
  (``jax.grad``, ``jax.vmap``, ``jax.device_put``)."""
  from jax._src import core  # pylint: disable=g-import-not-at-top

  def aval(x):
    raise error(x)
  core.pytype_aval_mappings[cls] = aval


def tracing() -> bool:
  """Whether a JAX trace (``jax.jit``, ``jax.grad``...) is running."""
  from jax._src import core  # pylint: disable=g-import-not-at-top
  return not core.trace_state_clean()
