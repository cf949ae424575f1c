"""Lifetimes across the pool's Python face and its copy engine.

A transfer's host buffer lives until the copy engine is done with it,
however the Transfer object goes away (dropped unwaited, its wait failed on
a bad argument, the pool closed under it); handles of freed objects are
never taken for others; close() racing with transfers on other threads
gives each of them its bytes or an error. Cases that crashed the
interpreter run in a child process, whose exit status the test checks.
"""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import jcxl
import numpy as np
import pytest

SUBPROCESS_TIMEOUT_S = 120
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
  """Runs `code` in a fresh interpreter (bounded), from the repository."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                        cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=SUBPROCESS_TIMEOUT_S, check=False)


def new_pool(**kwargs) -> jcxl.Pool:
  options = dict(host="32MiB", cxl="32MiB", timeout_s=30)
  options.update(kwargs)
  return jcxl.Pool(**options)


class DroppedTransferTest:

  @pytest.mark.parametrize("how", ["get", "put", "bad_wait", "timed_out"])
  def test_dropping_a_transfer_mid_copy_never_crashes(self, how):
    # A slow emulated link keeps each 16 MiB copy running for about 80 ms
    # while its Transfer is dropped and the freed memory is reused.
    result = run_python(
        """
        import gc, sys, time
        import numpy as np, jcxl
        how = sys.argv[1]
        pool = jcxl.Pool(host="64MiB", cxl="64MiB", timeout_s=30,
                         cxl_link=jcxl.LinkModel("200MB/s"))
        stored = np.arange(16 << 20, dtype=np.uint8)
        h = pool.put(stored, "cxl")
        for i in range(4):
          if how == "get":
            pool.get_async(h)
          elif how == "put":
            pool.put_async(h, stored.copy())
          elif how == "bad_wait":
            t = pool.get_async(h)
            try:
              t.wait(-1)
            except ValueError:
              pass
            del t
          elif how == "timed_out":
            try:
              pool.get_async(h).wait(0.001)
            except jcxl.TransferTimeoutError:
              pass
          gc.collect()
          junk = [np.full(1 << 20, 3, np.uint8) for _ in range(40)]
          del junk
        time.sleep(0.5)
        assert np.array_equal(pool.get(h), stored), "stored bytes changed"
        pool.close()
        print("ok")
        """, how)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert result.stdout.split() == ["ok"]

  @pytest.mark.parametrize("direction", ["read", "write"])
  def test_the_engine_holds_a_dropped_transfers_buffer_until_done(
      self, direction):
    pool = new_pool()
    try:
      stored = np.arange(1 << 20, dtype=np.float32)
      handle = pool.put(stored, "cxl")
      pool._inject_fault("stall", direction=direction)
      if direction == "read":
        buffer = np.zeros_like(stored)
        transfer = pool.get_async(handle, buffer)
      else:
        buffer = stored[::-1].copy()
        transfer = pool.put_async(handle, buffer)
      watch = weakref.ref(buffer)
      del transfer, buffer
      gc.collect()
      jcxl._jcxl.release_lent_buffers()
      assert watch() is not None, "freed while the copy is stalled on it"
      if direction == "read":
        assert np.array_equal(watch(), np.zeros_like(stored))  # not yet
      pool._inject_fault(None)  # the copy goes on, into or from the buffer
      if direction == "read":
        back = pool.get(handle)
        np.testing.assert_array_equal(back, stored)
      else:
        # The next transfer runs after the released one (one worker each).
        np.testing.assert_array_equal(pool.get(handle), stored[::-1])
    finally:
      pool.close()
    jcxl._jcxl.release_lent_buffers()
    assert watch() is None, "the engine never let the buffer go"

  def test_closing_the_pool_releases_a_stalled_transfers_buffer(self):
    pool = new_pool(timeout_s=0.2)
    handle = pool.put(np.ones(1 << 16, np.float32), "host")
    pool._inject_fault("stall", direction="read")
    buffer = np.zeros(1 << 16, np.float32)
    pool.get_async(handle, buffer)
    watch = weakref.ref(buffer)
    del buffer
    gc.collect()
    assert watch() is not None
    with pytest.raises(jcxl.TransferTimeoutError, match="pool closed"):
      pool.close()
    assert watch() is None


class WaitArgumentTest:

  @pytest.mark.parametrize("bad, error, match", [
      (-1, ValueError, "timeout_s must be >= 0 seconds.*got -1"),
      (math.nan, ValueError, "timeout_s must be >= 0 seconds.*got nan"),
      (-math.inf, ValueError, "timeout_s must be >= 0 seconds.*got -inf"),
      ("x", TypeError, "timeout_s must be a number of seconds.*'x'"),
      (True, TypeError, "timeout_s must be a number of seconds.*True"),
      ([1], TypeError, "timeout_s must be a number of seconds"),
  ])
  def test_bad_timeout_raises_and_leaves_the_transfer_waitable(
      self, bad, error, match):
    with new_pool() as pool:
      stored = np.arange(300_000, dtype=np.int32)
      handle = pool.put(stored, "cxl")
      transfer = pool.get_async(handle)
      with pytest.raises(error, match=match):
        transfer.wait(bad)
      np.testing.assert_array_equal(transfer.wait(), stored)
      write = pool.put_async(handle, stored * 2)
      with pytest.raises(error, match=match):
        write.wait(bad)
      write.wait(math.inf)
      np.testing.assert_array_equal(pool.get(handle), stored * 2)

  def test_numpy_and_integer_timeouts_are_accepted(self):
    with new_pool() as pool:
      handle = pool.put(np.ones(10), "host")
      for timeout in (5, np.float32(5.0), np.int64(5), 0.5):
        np.testing.assert_array_equal(
            pool.get_async(handle).wait(timeout), np.ones(10))


class CloseRaceTest:

  def test_close_racing_transfers_on_other_threads(self):
    # Threads put, get and drop transfers while the main thread closes the
    # pool: each call returns the right bytes or raises a jcxl error.
    result = run_python(
        """
        import gc, threading
        import numpy as np, jcxl
        pool = jcxl.Pool(host="64MiB", cxl="64MiB", timeout_s=0.5,
                         cxl_link=jcxl.LinkModel("1GB/s"))
        stored = np.arange(1 << 20, dtype=np.float32)
        handles = [pool.put(stored, t) for t in ("host", "cxl")]
        outcomes = {"bytes": 0, "errors": 0, "wrong": 0}
        lock = threading.Lock()
        go = threading.Barrier(5)

        def churn(seed):
          rng = np.random.default_rng(seed)
          go.wait()
          for _ in range(200):
            h = handles[rng.integers(2)]
            try:
              if rng.random() < 0.3:
                pool.get_async(h)  # dropped unwaited
                continue
              back = pool.get(h)
              with lock:
                key = "bytes" if np.array_equal(back, stored) else "wrong"
                outcomes[key] += 1
            except jcxl.JcxlError:
              with lock:
                outcomes["errors"] += 1
            gc.collect(0)

        threads = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
        for t in threads:
          t.start()
        go.wait()
        try:
          pool.close()
        except jcxl.TransferTimeoutError:
          pass
        for t in threads:
          t.join()
        assert outcomes["wrong"] == 0, outcomes
        assert outcomes["errors"] > 0, outcomes
        print("ok", outcomes)
        """)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert result.stdout.startswith("ok"), result.stdout


class HandleReuseTest:

  def test_a_freed_handle_is_never_taken_for_a_new_object(self):
    # In a fresh interpreter, one object freed and stored again reuses the
    # same slot (the handle's index) each time: past its last generation the
    # slot must be retired, not wrapped round to the first handle's.
    result = run_python(
        """
        import numpy as np, jcxl
        with jcxl.Pool(host="8MiB", cxl=0) as pool:
          first = pool.put(np.zeros(4, np.int32), "host")
          pool.free(first)
          seen = {first}
          for i in range(1100):
            handle = pool.put(np.full(4, i, np.int32), "host")
            assert handle not in seen, f"handle {handle} given out twice"
            seen.add(handle)
            try:
              pool.get(first)
              raise AssertionError(f"stale handle {first} read object {i}")
            except jcxl.UnknownHandleError:
              pass
            pool.free(handle)
        print("ok")
        """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ok"]

  def test_freeing_twice_raises(self):
    with new_pool() as pool:
      handle = pool.put(np.ones(8), "cxl")
      other = pool.put(np.arange(8.0), "cxl")
      pool.free(handle)
      with pytest.raises(jcxl.UnknownHandleError, match=str(handle)):
        pool.free(handle)
      np.testing.assert_array_equal(pool.get(other), np.arange(8.0))

  def test_free_racing_a_get_on_another_thread(self):
    with new_pool(timeout_s=5) as pool:
      stored = np.arange(1 << 20, dtype=np.float32)
      errors = []
      for _ in range(20):
        handle = pool.put(stored, "cxl")
        results = []

        def read(h=handle):
          try:
            results.append(pool.get(h))
          except jcxl.UnknownHandleError as e:
            errors.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        pool.free(handle)
        reader.join()
        for back in results:  # a get that started before the free
          np.testing.assert_array_equal(back, stored)
      assert pool.handles() == []
