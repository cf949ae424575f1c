"""Offloaded steps dispatched from threads other than the one that reads,
frees or closes their state: every such call sees all the steps dispatched
before it, whichever thread dispatched them (JAX itself waits only for the
calling thread's side-effecting computations)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import jcxl
import numpy as np
import optax
import pytest

STEPS, LR, DIM = 40, 1e-3, 128


def _loss(p, x):
  h = x
  for name in sorted(p):
    h = jnp.tanh(h @ p[name]["w"])
  # The gradient of every weight is 1 on each element: sgd lowers each by
  # LR a step, so the final value says how many steps' stores landed.
  return jnp.sum(h) * 0.0 + sum(jnp.sum(layer["w"]) for layer in p.values())


def _setup(pool, update):
  params = {f"l{i}": {"w": np.ones((DIM, DIM), np.float32)} for i in range(4)}
  tx = optax.sgd(LR)

  def step(p, s, x):
    loss, g = jax.value_and_grad(_loss)(p, x)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  state = [jcxl.place(params, "cxl", pool=pool),
           jcxl.place(tx.init(params), "cxl", pool=pool)]
  return jcxl.cxl_offload(step, update=update), state


def _loop(step, state, x, steps):
  p, s = state
  for _ in range(steps):
    p, s, _ = step(p, s, x)
  state[:] = [p, s]


def _in_thread(fn, *args):
  errors = []

  def run():
    try:
      fn(*args)
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)
  t = threading.Thread(target=run)
  t.start()
  t.join()
  assert not errors, errors


def _expected(steps):
  # The reference: the same sgd arithmetic in float32.
  w = np.float32(1)
  for _ in range(steps):
    w = np.float32(w - np.float32(LR))
  return w


X = np.ones((64, DIM), np.float32)


class ThreadsTest:

  @pytest.mark.parametrize("update", ["device", "host"])
  def test_gather_after_a_loop_in_a_worker_thread(self, update):
    with jcxl.Pool(host=64 << 20, cxl=64 << 20) as pool:
      step, state = _setup(pool, update)
      _in_thread(_loop, step, state, X, STEPS)
      got = jcxl.gather(state[0])
    for layer in got.values():
      np.testing.assert_array_equal(np.asarray(layer["w"]),
                                    np.full((DIM, DIM), _expected(STEPS)))

  def test_a_loop_handed_from_thread_to_thread(self):
    with jcxl.Pool(host=64 << 20, cxl=64 << 20) as pool:
      step, state = _setup(pool, "device")
      for _ in range(4):  # each thread goes on where the last one stopped
        _in_thread(_loop, step, state, X, 10)
      got = jcxl.gather(state[0])
    np.testing.assert_array_equal(np.asarray(got["l0"]["w"]),
                                  np.full((DIM, DIM), _expected(40)))

  def test_close_waits_for_another_threads_steps(self):
    pool = jcxl.Pool(host=64 << 20, cxl=64 << 20)
    step, state = _setup(pool, "device")
    losses = []
    _in_thread(lambda: losses.extend(
        step(*state, X)[2] for _ in range(STEPS)))
    pool.close()  # the thread's steps ran to their end first
    assert all(np.isfinite(float(loss)) for loss in losses)

  def test_gather_after_the_caller_deleted_a_result(self):
    # A result deleted (or donated) by the caller says nothing of the step:
    # the wait for the step goes by its other outputs.
    with jcxl.Pool(host=64 << 20, cxl=64 << 20) as pool:
      step, state = _setup(pool, "device")
      p, s, loss = step(*state, X)
      loss.delete()
      got = jcxl.gather(p)
    np.testing.assert_array_equal(np.asarray(got["l0"]["w"]),
                                  np.full((DIM, DIM), _expected(1)))

  def test_save_after_a_loop_in_a_worker_thread(self, tmp_path):
    with jcxl.Pool(host=64 << 20, cxl=64 << 20) as pool:
      step, state = _setup(pool, "device")
      _in_thread(_loop, step, state, X, STEPS)
      jcxl.checkpoint.save(tmp_path / "ckpt", state[0])
      restored = jcxl.checkpoint.restore(tmp_path / "ckpt")
    np.testing.assert_array_equal(np.asarray(restored["l0"]["w"]),
                                  np.full((DIM, DIM), _expected(STEPS)))
