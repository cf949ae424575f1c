"""How an offloaded step is called: keyword, static and donated arguments
with ``jax.jit``'s meaning.

A call is turned into the step's internal form: a tuple of the dynamic
positional arguments (a static one replaced by ``None``, an empty pytree,
so positions keep their meaning) followed by a dict of the dynamic keyword
arguments. ``BoundCall.fn`` takes that tuple and calls the user's step with
the static values put back.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY,
               inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _as_tuple(value: Any, name: str, kind: type) -> tuple[Any, ...]:
  if value is None:
    return ()
  values = (value,) if isinstance(value, kind) else tuple(value)
  for v in values:
    if not isinstance(v, kind) or isinstance(v, bool):
      raise TypeError(f"{name} must be {kind.__name__} or a sequence of "
                      f"them, but got {value!r}")
  return values


@dataclasses.dataclass(frozen=True)
class BoundCall:
  """One call, bound to the step's signature."""
  fn: Callable[..., Any]      # internal args -> the step's result
  args: tuple[Any, ...]       # dynamic positional args, then a kwargs dict
  static_key: Any             # hashable: the static values, by position/name
  names: tuple[str, ...]      # per internal argument, how a message names it
  donated: frozenset[int]     # positional argument indices donated
  donated_kw: frozenset[str]  # keyword arguments donated

  @property
  def num_positional(self) -> int:
    return len(self.args) - 1

  def is_donated(self, path: tuple[Any, ...]) -> bool:
    """Whether the leaf at `path` (a key path into `args`) is donated."""
    i = path[0].idx
    if i < self.num_positional:
      return i in self.donated
    return len(path) > 1 and getattr(path[1], "key", None) in self.donated_kw

  def leaf_name(self, path: tuple[Any, ...]) -> str:
    """A leaf's path as the caller wrote it: ``opt_state[0].mu['w']``."""
    i = path[0].idx
    if i < self.num_positional:
      return self.names[i] + jax.tree_util.keystr(path[1:])
    return (str(path[1].key) + jax.tree_util.keystr(path[2:])
            if len(path) > 1 else "**kwargs")


class Signature:
  """The step's signature and its static / donated arguments, resolved
  between numbers and names as ``jax.jit`` does."""

  def __init__(self, fn: Callable, static_argnums: Any = None,
               static_argnames: Any = None, donate_argnums: Any = None,
               donate_argnames: Any = None):
    self._fn = fn
    try:
      self._sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin: positions only
      self._sig = None
    params = list(self._sig.parameters.values()) if self._sig else []
    self._positional = [p.name for p in params if p.kind in _POSITIONAL]
    self._varargs = any(p.kind == inspect.Parameter.VAR_POSITIONAL
                        for p in params)
    self.static_nums, self.static_names = self._resolve(
        _as_tuple(static_argnums, "static_argnums", int),
        _as_tuple(static_argnames, "static_argnames", str), "static")
    self.donate_nums, self.donate_names = self._resolve(
        _as_tuple(donate_argnums, "donate_argnums", int),
        _as_tuple(donate_argnames, "donate_argnames", str), "donate")
    both = (set(self.static_nums) & set(self.donate_nums)) | (
        set(self.static_names) & set(self.donate_names))
    if both:
      raise ValueError(f"arguments {sorted(map(str, both))} are both static "
                       "and donated; a static argument is not an array")

  def _resolve(self, nums: tuple[int, ...], names: tuple[str, ...],
               what: str) -> tuple[frozenset[int], frozenset[str]]:
    """Numbers and names, each completed from the other where the
    signature has the parameter."""
    if self._sig is not None:
      known = set(self._sig.parameters)
      for name in names:
        if name not in known and not any(
            p.kind == inspect.Parameter.VAR_KEYWORD
            for p in self._sig.parameters.values()):
          raise ValueError(f"{what}_argnames names {name!r}, which is not a "
                           f"parameter of {self._name()}; it has "
                           f"{sorted(known)}")
    nums_out = set(nums)
    names_out = set(names)
    for name in names:
      if name in self._positional:
        nums_out.add(self._positional.index(name))
    for num in nums:
      if 0 <= num < len(self._positional):
        names_out.add(self._positional[num])
    return frozenset(nums_out), frozenset(names_out)

  def _name(self) -> str:
    return getattr(self._fn, "__name__", "the step")

  def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> BoundCall:
    """The internal form of ``step(*args, **kwargs)``."""
    if kwargs and self._sig is not None:
      try:
        bound = self._sig.bind(*args, **kwargs)
      except TypeError as e:
        raise TypeError(f"{self._name()}: {e}") from None
      args, kwargs = tuple(bound.args), dict(bound.kwargs)
    n = len(args)
    nums = {i if i >= 0 else n + i for i in self.static_nums}
    static_pos = tuple((i, args[i]) for i in sorted(nums) if i < n)
    static_kw = tuple(sorted((k, v) for k, v in kwargs.items()
                             if k in self.static_names))
    for where, value in static_pos + static_kw:
      try:
        hash(value)
      except TypeError:
        raise TypeError(
            f"{self._name()}: static argument {where!r} must be hashable "
            f"(as with jax.jit), but got {type(value).__name__}") from None
    positional = tuple(None if i in nums else a for i, a in enumerate(args))
    dynamic_kw = {k: v for k, v in kwargs.items()
                  if k not in self.static_names}
    names = tuple(self._positional[i] if i < len(self._positional) else
                  f"args[{i}]" for i in range(n)) + ("**kwargs",)
    donated = {i if i >= 0 else n + i for i in self.donate_nums}
    donated = frozenset(i for i in donated if 0 <= i < n)
    donated_kw = frozenset(k for k in dynamic_kw if k in self.donate_names)
    fn = self._fn

    def call(*internal):
      given = list(internal[:-1])
      for i, value in static_pos:
        given[i] = value
      return fn(*given, **internal[-1], **dict(static_kw))

    return BoundCall(call, positional + (dynamic_kw,),
                     (static_pos, static_kw), names, donated, donated_kw)
