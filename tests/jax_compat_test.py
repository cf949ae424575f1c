"""jax_compat reads JAX's internals the same way across the releases jcxl
runs on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jcxl._src import jax_compat


def _scan_eqn():
  def f(c1, c2, xs, k):
    def body(carry, x):
      p, q, r = carry
      return (p * k + x, q + 1.0, r + p.sum()), p
    return jax.lax.scan(body, (c1, c2, jnp.float32(0)), xs)
  closed = jax.make_jaxpr(f)(jnp.ones(4), jnp.ones(2), jnp.ones((3, 4)),
                             jnp.ones(4))
  (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
  return eqn


class _FlatTree:
  """The shape of a flat tree of operands as JAX >= 0.11 keeps it in a scan's
  ``ft_in``: ``unpack()`` into sub-trees, each with ``vals``."""

  def __init__(self, *parts):
    self.parts = parts
    self.vals = [None] * sum(len(p.vals) for p in parts if
                             isinstance(p, _FlatTree))

  def unpack(self):
    return self.parts


def _leaves(n):
  tree = _FlatTree()
  tree.vals = [None] * n
  return tree


class ScanCountsTest:

  def test_this_jax(self):
    eqn = _scan_eqn()
    n_consts, n_carry = jax_compat.scan_counts(eqn.params)
    # One closed-over constant (k), three carries; the body's operands are
    # consts, then carries, then xs.
    assert (n_consts, n_carry) == (1, 3)
    assert len(eqn.invars) == n_consts + n_carry + 1

  def test_flat_tree_params(self):
    params = {"ft_in": _FlatTree(_leaves(2), _leaves(3), _leaves(1))}
    assert jax_compat.scan_counts(params) == (2, 3)
