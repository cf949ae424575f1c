"""The pool's tiers, which are also jcxl's memory kinds."""

from __future__ import annotations

import enum


class Tier(str, enum.Enum):
  """A pool tier (also a jcxl memory kind)."""
  HOST = "host"
  CXL = "cxl"
  NVME = "nvme"

  @property
  def index(self) -> int:
    """The tier's index in the C++ pool's tables."""
    return _TIER_INDEX[self]

  @classmethod
  def from_index(cls, index: int) -> Tier:
    """The tier the C++ core numbers `index`."""
    return _TIERS_BY_INDEX[index]

  @classmethod
  def parse(cls, value: str | Tier, *, name: str = "tier") -> Tier:
    """The tier named `value`; a ValueError naming `name` if none is."""
    try:
      return cls(value)
    except ValueError:
      choices = ", ".join(repr(t.value) for t in cls)
      raise ValueError(f"{name} must be one of {choices}, but got {value!r}"
                       ) from None


_TIER_INDEX = {Tier.HOST: 0, Tier.CXL: 1, Tier.NVME: 2}
_TIERS_BY_INDEX = {i: t for t, i in _TIER_INDEX.items()}


def as_tier(value: str | Tier, *, name: str = "tier") -> Tier:
  """Validates a tier name (see Tier.parse)."""
  return Tier.parse(value, name=name)
