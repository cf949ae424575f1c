"""No transfer outlives what it copies into or out of.

A step that fails stops every copy it started before XLA frees its
buffers; a dropped step's pool objects outlive its last call; a process
whose last statement dispatches a step lets it finish before its pools
close. Steps fail here at random points (a copy that fails or stalls past
its deadline, an object freed or the pool closed under a running step, the
step object dropped), with `update='host'` and `update='device'`: each
failure must be a Python exception that names what failed, and the next
good step must equal the same step under ``jax.jit``. Cases that crashed
the interpreter run in a child process, whose exit status the test checks.
"""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import jcxl
import numpy as np
import optax
import pytest

from jcxl._src import stream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBPROCESS_TIMEOUT_S = 180
TIMEOUT_S = 0.5  # the pools' timeout_s here: a stalled copy's deadline
# How a failed step's error starts (XLA's code of the handler's status) and
# what every one of them names.
CODES = ("DEADLINE_EXCEEDED", "DATA_LOSS", "NOT_FOUND", "FAILED_PRECONDITION",
         "INTERNAL")


def run_python(code: str) -> subprocess.CompletedProcess:
  """Runs MODEL, then `code`, in a fresh interpreter (bounded), from the
  repository."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", MODEL + textwrap.dedent(code)],
                        cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=SUBPROCESS_TIMEOUT_S, check=False)


# A small MLP and its sgd step, shared by the child processes and the
# stress test: four 256x256 layers (256 KiB each) behind a slow emulated
# link, so that a step's copies are still running when it fails.
MODEL = """
import gc, jax, jax.numpy as jnp, numpy as np, optax, jcxl

LAYERS = 4
tx = optax.sgd(0.1)

def init():
  return {f"l{i}": jnp.full((256, 256), 0.01 * (i + 1), jnp.float32)
          for i in range(LAYERS)}

def loss_fn(p, x):
  for i in range(LAYERS):
    x = jnp.tanh(x @ p[f"l{i}"])
  return (x ** 2).mean()

def step_fn(p, o, x):
  loss, g = jax.value_and_grad(loss_fn)(p, x)
  u, o = tx.update(g, o, p)
  return optax.apply_updates(p, u), o, loss

def slow_pool(**kwargs):
  return jcxl.Pool(host="32MiB", cxl="64MiB",
                   cxl_link=jcxl.LinkModel(bandwidth="200MB/s"), **kwargs)

X = jnp.ones((8, 256), jnp.float32)
"""
exec(MODEL)  # pylint: disable=exec-used


def _raises_named(fn):
  """Runs `fn`; returns the exception it raised (None if none), checking
  that it names what failed."""
  try:
    jax.block_until_ready(fn())
  except (jax.errors.JaxRuntimeError, jcxl.JcxlError) as e:
    message = str(e)
    if isinstance(e, jax.errors.JaxRuntimeError):
      assert message.startswith(CODES), message
      assert "jcxl_" in message, message
    assert "handle" in message or "pool" in message, message
    return e
  return None


class FailedStepTest:

  def _two_fetches(self):
    @jax.jit
    def step(a, b):
      pa = stream.fetch_start(a)
      pb = stream.fetch_start(b)
      return stream.fetch_done(pa) + stream.fetch_done(pb)
    return step

  def test_a_start_that_fails_stops_the_fetches_in_flight(self):
    pool = jcxl.Pool(host="16MiB", cxl="16MiB", timeout_s=TIMEOUT_S)
    a = jcxl.place(jnp.ones((256, 256)), "cxl", pool=pool)
    b = jcxl.place(jnp.ones((256, 256)), "host", pool=pool)
    (_, hb), = b.local_handles
    step = self._two_fetches()
    np.testing.assert_array_equal(step(a, b), np.full((256, 256), 2.0))
    pool.free(hb)  # behind the array's back: the step's start fails
    pool._inject_fault("stall", tier="cxl", direction="read")
    error = _raises_named(lambda: step(a, b))
    assert str(error).startswith("NOT_FOUND: jcxl_fetch_start")
    # The stalled fetch of `a` was stopped when the step failed: closing
    # finds no copy running (one would be failed after timeout_s, raising).
    pool.close()

  def test_a_done_that_times_out_stops_the_other_fetches(self):
    pool = jcxl.Pool(host="16MiB", cxl="16MiB", timeout_s=TIMEOUT_S)
    a = jcxl.place(jnp.ones((256, 256)), "cxl", pool=pool)
    b = jcxl.place(jnp.full((256, 256), 2.0), "cxl", pool=pool)
    step = self._two_fetches()
    pool._inject_fault("stall", tier="cxl", direction="read", count=-1)
    error = _raises_named(lambda: step(a, b))
    assert str(error).startswith("DEADLINE_EXCEEDED: jcxl_fetch_done")
    # The other stalled fetch was stopped with the step (the stall is
    # still armed: only a cancel ends it before close).
    pool.close()


class DroppedStepTest:

  def test_dropping_a_step_during_its_last_call_keeps_its_update(self):
    # The host update's gradient objects were freed under the running
    # call: its store failed (NOT_FOUND), the update was lost, some runs
    # died of SIGSEGV in a copy-engine thread.
    result = run_python("""
    ref_p, ref_o = init(), tx.init(init())
    for _ in range(2):
      ref_p, ref_o, _ = jax.jit(step_fn)(ref_p, ref_o, X)
    pool = slow_pool()
    p = jcxl.place(init(), "cxl", pool=pool)
    o = jcxl.place(tx.init(init()), "cxl", pool=pool)
    step = jcxl.cxl_offload(step_fn, device_budget="16MiB",
                            schedule="fixed:1", update="host")
    for _ in range(2):
      p, o, loss = step(p, o, X)
    del step
    gc.collect()
    got = jcxl.gather(p)
    print("max error", max(float(jnp.abs(got[k] - ref_p[k]).max())
                           for k in got))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max error 0.0" in result.stdout, result.stdout + result.stderr

  def test_the_collector_only_queues_a_dropped_steps_release(self):
    # Releasing inside the collector (waiting for the step's calls, asking
    # jax whether they were over) crashed the interpreter later, in the
    # collector, with a freed code object.
    from jcxl._src.host_update import runtime  # pylint: disable=g-import-not-at-top
    with jcxl.Pool(host="32MiB", cxl="64MiB") as pool:
      p = jcxl.place(init(), "cxl", pool=pool)
      o = jcxl.place(tx.init(init()), "cxl", pool=pool)
      placed = set(pool.handles())
      step = jcxl.cxl_offload(step_fn, update="host")
      p, o, _ = step(p, o, X)
      jax.block_until_ready(p)
      assert set(pool.handles()) > placed  # its gradients' objects
      queued = len(runtime._dropped)
      del step
      gc.collect()
      assert len(runtime._dropped) == queued + 1
      assert set(pool.handles()) > placed  # not freed by the collector
      # The next step made frees them (and its own come in their place).
      other = jcxl.cxl_offload(step_fn, update="host")
      assert not runtime._dropped
      assert set(pool.handles()) == placed
      p, o, _ = other(p, o, X)
      ref_p, ref_o = init(), tx.init(init())
      for _ in range(2):
        ref_p, ref_o, _ = jax.jit(step_fn)(ref_p, ref_o, X)
      got = jcxl.gather(p)
      for k in ref_p:
        np.testing.assert_array_equal(got[k], ref_p[k])


class ExitTest:

  def test_exit_waits_for_the_step_dispatched_last(self):
    # The pool was closed at exit under the running step: its fetches and
    # stores failed ('pool N is closed') and two tracebacks printed.
    result = run_python("""
    pool = slow_pool()
    p = jcxl.place(init(), "cxl", pool=pool)
    o = jcxl.place(tx.init(init()), "cxl", pool=pool)
    step = jcxl.cxl_offload(step_fn, device_budget="16MiB",
                            schedule="fixed:1")
    p, o, loss = step(p, o, X)
    p, o, loss = step(p, o, X)  # the last statement: no gather, no barrier
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Exception ignored" not in result.stderr, result.stderr[-3000:]
    assert "is closed" not in result.stderr, result.stderr[-3000:]


  def test_exit_waits_a_bounded_time_and_says_so(self):
    result = run_python("""
    import jcxl._src.pool
    jcxl._src.pool._EXIT_WAIT_S = 0.2  # the step takes longer
    pool = jcxl.Pool(host="32MiB", cxl="64MiB", timeout_s=0.1,
                     cxl_link=jcxl.LinkModel(bandwidth="4MB/s"))
    p = jcxl.place(init(), "cxl", pool=pool)
    o = jcxl.place(tx.init(init()), "cxl", pool=pool)
    step = jcxl.cxl_offload(step_fn, device_budget="16MiB",
                            schedule="fixed:1")
    p, o, loss = step(p, o, X)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("1 step(s) still running after 0.2 s when pool 1 was closed at "
            "exit") in result.stderr, result.stderr[-3000:]


  def test_results_deleted_or_donated_by_the_user(self):
    # A deleted array is never asked whether it is ready (jax 0.10 crashes
    # on one deleted by `delete()`).
    result = run_python("""
    pool = slow_pool()
    p = jcxl.place(init(), "cxl", pool=pool)
    o = jcxl.place(tx.init(init()), "cxl", pool=pool)
    step = jcxl.cxl_offload(step_fn, device_budget="16MiB",
                            schedule="fixed:1")
    p, o, loss = step(p, o, X)
    bumped = jax.jit(lambda l: l + 1, donate_argnums=0)(loss)
    assert loss.is_deleted()
    p, o, loss = step(p, o, X)
    loss.delete()
    p, o, loss = step(p, o, X)
    """)
    assert result.returncode == 0, result.stderr[-3000:]


class RandomFailureTest:

  @pytest.mark.parametrize("update", ["device", "host"])
  def test_steps_failing_at_random_points(self, update):
    rng = random.Random(f"transfer-lifetime-{update}")
    ref_p, ref_o = init(), tx.init(init())
    want_p, _, want_loss = jax.jit(step_fn)(ref_p, ref_o, X)
    pool = slow_pool(timeout_s=TIMEOUT_S)
    p = jcxl.place(ref_p, "cxl", pool=pool)
    o = jcxl.place(ref_o, "cxl", pool=pool)
    step = jcxl.cxl_offload(step_fn, device_budget="16MiB",
                            schedule="fixed:2", update=update)

    def reset():  # the state back to the reference's, in place
      is_array = lambda x: isinstance(x, jcxl.PoolArray)
      for leaf, value in zip(
          jax.tree_util.tree_leaves((p, o), is_leaf=is_array),
          jax.tree_util.tree_leaves((ref_p, ref_o))):
        (_, handle), = leaf.local_handles
        pool.put_async(handle, np.asarray(value)).wait()

    def good_step():
      reset()
      _, _, loss = step(p, o, X)
      got = jcxl.gather(p)
      assert float(loss) == float(want_loss)
      for k in got:
        np.testing.assert_array_equal(got[k], want_p[k])

    good_step()
    failures = 0
    for _ in range(8):
      kind = rng.choice(["fail", "stall"])
      direction = rng.choice(["read", "write", None])
      pool._inject_fault(kind, direction=direction, skip=rng.randrange(12))
      if _raises_named(lambda: step(p, o, X)) is not None:
        failures += 1
      pool._inject_fault(None)
      good_step()
    assert failures >= 3

    # An object freed under the running step (it fails, or had stored it
    # already); the step's objects are then gone for good.
    (_, handle), = p["l3"].local_handles
    out = step(p, o, X)
    pool.free(handle)
    _raises_named(lambda: out)
    # Dropped while its call runs: the call ends with its objects intact.
    q = jcxl.place(ref_p, "cxl", pool=pool)
    r = jcxl.place(ref_o, "cxl", pool=pool)
    dropped = jcxl.cxl_offload(step_fn, device_budget="16MiB",
                               schedule="fixed:2", update=update)
    q, r, loss = dropped(q, r, X)
    del dropped
    gc.collect()
    assert float(loss) == float(want_loss)
    for k, v in jcxl.gather(q).items():
      np.testing.assert_array_equal(v, want_p[k])
    pool.close()
