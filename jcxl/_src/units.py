"""Parsing and printing of byte counts and bandwidths ("2GiB", "16GB/s")."""

from __future__ import annotations

import fractions
import math
import numbers
import re

# The largest byte count jcxl accepts: the C++ core counts bytes in int64.
MAX_BYTES = 2**63 - 1

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_PATTERN = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: int | float | str, *, name: str = "size") -> int:
  """Returns a byte count from an int or a string such as '512MiB' or '2GB'.

  A fractional count is rounded down ('1.5KiB' is 1536), but one that would
  round to 0 is refused, as are nan, inf and counts past 2**63 - 1.

  Raises:
    TypeError: naming `name` if the value is not a number or a string.
    ValueError: naming `name` if the value is negative, not finite, too
      large, below one byte, or not understood.
  """
  if isinstance(value, bool) or not isinstance(value,
                                               (numbers.Real, str)):
    raise TypeError(f"{name} must be a byte count such as 1024, '512MiB' or "
                    f"'2GB', but got {value!r} ({type(value).__name__})")
  if isinstance(value, str):
    match = _PATTERN.match(value)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
      raise ValueError(
          f"{name} must be a byte count such as 1024, '512MiB' or '2GB', "
          f"but got {value!r}")
    number = fractions.Fraction(match.group(1)) * _UNITS[unit]
  elif isinstance(value, numbers.Integral):
    number = fractions.Fraction(int(value))
  elif math.isfinite(value):
    number = fractions.Fraction(float(value))
  else:
    raise ValueError(f"{name} must be a finite byte count, but got {value!r}")
  if number < 0:
    raise ValueError(f"{name} must not be negative, but got {value!r}")
  if number > MAX_BYTES:
    raise ValueError(f"{name} must be at most {MAX_BYTES} bytes (2**63 - 1),"
                     f" but got {value!r}")
  if 0 < number < 1:
    raise ValueError(f"{name} must be 0 or at least 1 byte, but got "
                     f"{value!r}")
  return int(number)


def parse_bandwidth(value: int | float | str, *, name: str = "bandwidth"
                    ) -> float:
  """Returns bytes per second from a number or a string such as '16GB/s'."""
  if isinstance(value, str):
    text = value.strip()
    if not text.endswith("/s"):
      raise ValueError(f"{name} must end in '/s' (e.g. '16GB/s'), "
                       f"but got {value!r}")
    value = text[:-2]
  rate = float(parse_bytes(value, name=name))
  if rate <= 0:
    raise ValueError(f"{name} must be positive, but got {value!r}")
  return rate


def format_bytes(count: float) -> str:
  """'1.50 GiB' style text for a byte count."""
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(count) < 1024 or unit == "GiB":
      break
    count /= 1024
  else:  # pragma: no cover
    unit = "GiB"
  return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"


def format_bandwidth(bytes_per_second: float) -> str:
  """'16.0 GB/s' style text (decimal, as link speeds are quoted)."""
  return f"{bytes_per_second / 1e9:.1f} GB/s"
