"""Checks of what users pass to the pool: dtypes, shapes, counts, handles.

Every public entry point that takes a shape and a dtype (``Pool.put``,
``Pool.allocate``, ``jcxl.place``, checkpoint restore) goes through
``object_spec``, so that they all accept and refuse the same things: an
object the pool holds is exactly the bytes its shape and dtype say.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from jcxl._src.units import MAX_BYTES

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1

_ACCEPTED_DTYPES = ("bool, int*, uint*, float*, complex* or an ml_dtypes type "
                    "such as bfloat16 or float8_e4m3fn")


def _is_ml_dtype(dtype: np.dtype) -> bool:
  scalar = getattr(ml_dtypes, dtype.name, None)
  return isinstance(scalar, type) and np.dtype(scalar).kind == dtype.kind


def storable_dtype(dtype: Any, *, name: str = "dtype") -> np.dtype:
  """The dtype the pool stores for `dtype`: the same, in native byte order.

  Raises:
    TypeError: `dtype` is not a dtype, or one whose items are not plain
      numbers (object, structured, sub-array, string, bytes, datetime).
  """
  if dtype is None:  # np.dtype(None) would quietly be float64
    raise TypeError(f"{name} must be numeric ({_ACCEPTED_DTYPES}), but got "
                    "None")
  try:
    dtype = np.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"{name} must be numeric ({_ACCEPTED_DTYPES}), but got "
                    f"{dtype!r} ({e})") from None
  plain = dtype.fields is None and dtype.subdtype is None
  numeric = dtype.kind in "biufc" or (dtype.kind == "V" and _is_ml_dtype(dtype))
  if not (plain and numeric):
    raise TypeError(
        f"{name} must be numeric ({_ACCEPTED_DTYPES}): the pool stores plain"
        f" numbers, but got {dtype}")
  return dtype if dtype.isnative else dtype.newbyteorder("=")


def as_count(value: Any, *, name: str, low: int = 0, high: int = MAX_BYTES,
             what: str = "an int") -> int:
  """`value` as a Python int in [low, high]; bools and floats are refused.

  Raises:
    TypeError: `value` is not an int (Python or numpy).
    ValueError: it is out of range.
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, numbers.Integral):
    raise TypeError(f"{name} must be {what}, but got {value!r} "
                    f"({type(value).__name__})")
  value = int(value)
  if not low <= value <= high:
    raise ValueError(f"{name} must be {what} in [{low}, {high}], but got "
                     f"{value}")
  return value


def as_shape(shape: Any, *, name: str = "shape") -> tuple[int, ...]:
  """`shape` as a tuple of non-negative Python ints (an int is 1-d)."""
  if isinstance(shape, numbers.Integral) and not isinstance(
      shape, (bool, np.bool_)):
    shape = (shape,)
  if not isinstance(shape, (Sequence, np.ndarray)) or isinstance(
      shape, (str, bytes)):
    raise TypeError(f"{name} must be a sequence of non-negative ints, but "
                    f"got {shape!r} ({type(shape).__name__})")
  return tuple(as_count(d, name=f"{name}[{i}]", what="a non-negative int")
               for i, d in enumerate(shape))


def object_spec(shape: Any, dtype: Any, *, what: str | None = None,
                nonempty: bool = False
                ) -> tuple[tuple[int, ...], np.dtype, int]:
  """Validates a shape and dtype: (shape, stored dtype, bytes).

  Args:
    shape: a sequence of non-negative ints (Python or numpy; not floats or
      bools).
    dtype: see ``storable_dtype``.
    what: what the errors are about (e.g. "leaf ['w']"), said first.
    nonempty: refuse 0 bytes (what the pool stores has at least one).

  Raises:
    TypeError: a bad dtype or a shape that is not ints.
    ValueError: a negative dimension, more bytes than int64 counts, or (with
      `nonempty`) an empty object.
  """
  try:
    shape = as_shape(shape)
    dtype = storable_dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize  # exact: Python ints
    if nbytes > MAX_BYTES:
      raise ValueError(
          f"shape {shape} of {dtype.name} is {nbytes} bytes, more than the "
          f"{MAX_BYTES} (2**63 - 1) an object can hold")
    if nonempty and nbytes == 0:
      raise ValueError(f"cannot store an empty array (shape {shape}, "
                       f"{dtype.name}): it has 0 bytes")
  except (TypeError, ValueError) as e:
    if what is None:
      raise
    raise type(e)(f"{what}: {e}") from None
  return shape, dtype, nbytes


def as_native(array: np.ndarray) -> np.ndarray:
  """`array` in native byte order (a swapped copy where it is not)."""
  if array.dtype.isnative:
    return array
  native = array.dtype.newbyteorder("=")
  return array.byteswap().view(native)


def as_timeout(value: Any, *, name: str = "timeout_s") -> float:
  """A timeout in seconds: a finite real number > 0 (a step's deadline is
  counted in int64 milliseconds)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value,
                                                           numbers.Real):
    raise TypeError(f"{name} must be a finite number of seconds > 0, but got "
                    f"{value!r} ({type(value).__name__})")
  if not (math.isfinite(value) and value > 0):  # nan included
    raise ValueError(f"{name} must be a finite number of seconds > 0, but "
                     f"got {value!r}")
  return float(value)


# A deadline past this many ms is no deadline (the C++ side saturates at
# 2**60 ns); it keeps the int64 attribute from overflowing.
_MAX_TIMEOUT_MS = 2**60 // 10**6


def timeout_ms(seconds: float) -> int:
  """A validated timeout as a step's deadline in whole milliseconds: rounded
  up, so a deadline under 1 ms is 1 ms, never 0 (which would fail every
  wait)."""
  return min(_MAX_TIMEOUT_MS, max(1, math.ceil(seconds * 1000)))


def as_seconds(value: Any, *, name: str, high: float = math.inf) -> float:
  """A finite duration in seconds in [0, high]."""
  accepts = ("a finite number of seconds >= 0" if high == math.inf else
             f"a number of seconds in [0, {high:g}]")
  if isinstance(value, (bool, np.bool_)) or not isinstance(value,
                                                           numbers.Real):
    raise TypeError(f"{name} must be {accepts}, but got {value!r} "
                    f"({type(value).__name__})")
  if not (math.isfinite(value) and 0 <= value <= high):
    raise ValueError(f"{name} must be {accepts}, but got {value!r}")
  return float(value)


def as_bool(value: Any, *, name: str) -> bool:
  """`value` as a bool; only True and False (Python or numpy) are taken:
  bool() of a string such as 'no' would be True."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be True or False, but got {value!r} "
                    f"({type(value).__name__})")
  return bool(value)
