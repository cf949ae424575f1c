"""Every use of JAX internals goes through this module: those APIs move
between JAX releases, and this is the one place to adapt."""

from __future__ import annotations

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
