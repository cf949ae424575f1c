"""Faults surface as errors, never hangs, and lose nothing they did not touch.

Each fault (the nvme tier's file system refusing writes, its swap file cut
short, removed or made unreadable, a copy that fails or never completes, a
pool closed under a running step) must raise a Python exception from the
pool call or the step within the pool's timeout, with a message naming the
object, tier or file, and leave every other stored object intact, compared
byte for byte. Every call that could hang runs on a watchdog thread.
"""

from __future__ import annotations

import functools
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import jcxl
import numpy as np
import pytest

TIERS = ("host", "cxl", "nvme")
TIMEOUT_S = 0.5  # the pools' timeout_s in these tests
MARGIN_S = 10.0  # the machine is shared and loaded: generous
SUBPROCESS_TIMEOUT_S = 120
# What the tests did, printed at the end (pytest -s shows it).
TALLY = {"errors raised": 0, "objects compared": 0, "bytes compared": 0}


@pytest.fixture(scope="module", autouse=True)
def _print_tally():
  yield
  print(f"\nfaults_test: {TALLY}")


def bounded(fn, limit_s: float = TIMEOUT_S + MARGIN_S):
  """Runs `fn` on a watchdog thread; fails the test if it is still running
  after `limit_s`. Returns (value, exception, seconds)."""
  box = {}

  def run():
    start = time.perf_counter()
    try:
      box["value"] = fn()
    except BaseException as e:  # handed to the test
      box["error"] = e
    box["seconds"] = time.perf_counter() - start

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  thread.join(limit_s)
  assert not thread.is_alive(), f"still running after {limit_s} s: a hang"
  return box.get("value"), box.get("error"), box["seconds"]


def raises(cls, fn, match: str | None = None,
           limit_s: float = TIMEOUT_S + MARGIN_S):
  """`fn` raises `cls` (message matching `match`) within `limit_s`."""
  _, error, seconds = bounded(fn, limit_s)
  assert isinstance(error, cls), f"expected {cls.__name__}, got {error!r}"
  if match is not None:
    assert match in str(error), f"{match!r} not in {str(error)!r}"
  assert seconds < limit_s
  TALLY["errors raised"] += 1
  return error, seconds


def store_some(pool, tiers=TIERS, seed=0) -> list[tuple[int, np.ndarray]]:
  """Objects of several sizes in each tier, random bytes."""
  rng = np.random.default_rng(seed)
  stored = []
  for i, tier in enumerate(tiers * 2):
    array = rng.integers(0, 256, 3000 + 70_000 * i, np.uint8)
    stored.append((pool.put(array, tier), array))
  return stored


def assert_intact(pool, stored) -> int:
  """Every stored object reads back byte for byte; returns bytes compared."""
  compared = 0
  for handle, array in stored:
    back, error, _ = bounded(lambda h=handle: pool.get(h))
    assert error is None, error
    assert back.tobytes() == array.tobytes(), f"handle {handle} changed"
    compared += array.nbytes
  TALLY["objects compared"] += len(stored)
  TALLY["bytes compared"] += compared
  return compared


def new_pool(tmp_path, **kwargs) -> jcxl.Pool:
  options = dict(host="32MiB", cxl="32MiB", nvme="64MiB", nvme_dir=tmp_path,
                 timeout_s=TIMEOUT_S)
  options.update(kwargs)
  return jcxl.Pool(**options)


def swap_file(pool) -> str:
  return os.path.join(pool.nvme_dir, "tier.swap")


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
  """Runs `code` in a fresh interpreter (bounded), from the repository."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                        cwd=root, env=env, capture_output=True, text=True,
                        timeout=SUBPROCESS_TIMEOUT_S, check=False)


@functools.lru_cache(maxsize=None)
def _sum_step():
  return jax.jit(lambda w: jnp.sum(jcxl.fetch(w)))


@functools.lru_cache(maxsize=None)
def _double_step():
  return jax.jit(lambda w: jcxl.store(w, jcxl.fetch(w) * 2))


def run_step(step, *args):
  """A jitted step, run to completion (its errors surface here)."""
  return jax.block_until_ready(step(*args))


class StalledOrFailedCopyTest:
  """A copy that never completes, or fails: injected with Pool._inject_fault."""

  def test_stalled_read_times_out_naming_the_object(self, tmp_path):
    with new_pool(tmp_path) as pool:
      stored = store_some(pool)
      handle, array = stored[1]  # cxl
      pool._inject_fault("stall", tier="cxl", direction="read")
      error, seconds = raises(jcxl.TransferTimeoutError,
                              lambda: pool.get(handle))
      assert isinstance(error, TimeoutError)
      message = str(error)
      assert f"handle {handle} (cxl tier, shape ({array.size},), uint8)" in (
          message)
      assert "did not finish within 500 ms" in message
      assert TIMEOUT_S * 0.9 <= seconds < TIMEOUT_S + MARGIN_S
      # The stalled read was cancelled and changed nothing: the object and
      # every other one read back whole (the fault hit one transfer).
      assert_intact(pool, stored)

  def test_stalled_write_times_out_and_frees_the_new_object(self, tmp_path):
    with new_pool(tmp_path) as pool:
      stored = store_some(pool)
      pool._inject_fault("stall", tier="nvme", direction="write")
      error, seconds = raises(
          jcxl.TransferTimeoutError,
          lambda: pool.put(np.ones(1 << 20, np.uint8), "nvme"),
          match="(nvme tier, shape (1048576,), uint8)")
      assert "within 500 ms" in str(error)
      assert seconds < TIMEOUT_S + MARGIN_S
      assert sorted(pool.handles()) == sorted(h for h, _ in stored)
      assert_intact(pool, stored)

  def test_failed_copy_moves_no_byte(self, tmp_path):
    with new_pool(tmp_path) as pool:
      stored = store_some(pool)
      handle, array = stored[2]  # nvme
      pool._inject_fault("fail", tier="nvme", direction="write")
      raises(jcxl.TierIOError,
             lambda: pool.put_async(handle, np.zeros_like(array)).wait(),
             match=f"handle {handle} (nvme tier")
      pool._inject_fault("fail", tier="host", direction="read")
      error, _ = raises(jcxl.TierIOError, lambda: pool.get(stored[0][0]),
                        match="injected fault")
      assert isinstance(error, OSError)
      assert_intact(pool, stored)  # the failed write wrote nothing

  def test_free_compact_and_close_wait_in_bounded_time(self, tmp_path):
    pool = new_pool(tmp_path)
    stored = store_some(pool)
    handle = stored[3][0]  # host
    pool._inject_fault("stall", tier="host")
    pending = pool.get_async(handle)  # never finishes on its own
    raises(jcxl.TransferTimeoutError, lambda: pool.free(handle),
           match=f"cannot free handle {handle} (host tier")
    raises(jcxl.TransferTimeoutError, pool.compact, match="in flight")
    assert_intact(pool, [s for s in stored if s[0] != handle])
    raises(jcxl.TransferTimeoutError, pool.close, match="pool closed")
    assert pool.closed
    raises(jcxl.PoolClosedError, pending.wait, match="closed")
    assert os.listdir(tmp_path) == []

  def test_stalled_fetch_fails_the_step(self, tmp_path):
    with new_pool(tmp_path) as pool:
      stored = store_some(pool)
      value = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
      w = jcxl.place(jnp.asarray(value), "cxl", pool=pool)
      (_, handle), = w.local_handles
      assert float(run_step(_sum_step(), w)) == value.sum()
      pool._inject_fault("stall", tier="cxl")
      error, seconds = raises(jax.errors.JaxRuntimeError,
                              lambda: run_step(_sum_step(), w))
      message = str(error)
      assert message.startswith("DEADLINE_EXCEEDED")
      assert f"handle {handle} (cxl tier, shape (64, 64), float32)" in message
      assert "did not finish within 500 ms" in message
      assert TIMEOUT_S * 0.9 <= seconds < TIMEOUT_S + MARGIN_S
      # One transfer was hit: the next step runs, on intact data.
      assert float(run_step(_sum_step(), w)) == value.sum()
      assert_intact(pool, stored)

  def test_failed_store_fails_the_step(self, tmp_path):
    with new_pool(tmp_path) as pool:
      stored = store_some(pool)
      w = jcxl.place(jnp.ones((32, 32)), "nvme", pool=pool)
      (_, handle), = w.local_handles
      pool._inject_fault("fail", tier="nvme", direction="write")
      error, _ = raises(jax.errors.JaxRuntimeError,
                        lambda: run_step(_double_step(), w))
      message = str(error)
      assert message.startswith("DATA_LOSS")
      assert "jcxl_store_done: transfer" in message
      assert f"handle {handle} (nvme tier, shape (32, 32), float32)" in message
      np.testing.assert_array_equal(pool.get(handle), np.ones((32, 32)))
      assert_intact(pool, stored)


class SwapFileTest:
  """The nvme tier's file, changed behind the pool's back while it is open."""

  def test_truncated_file_fails_reads_of_what_was_cut(self, tmp_path):
    with new_pool(tmp_path) as pool:
      stored = store_some(pool)
      on_disk = [(h, a) for h, a in stored if pool.info(h).tier.value == "nvme"]
      in_memory = [s for s in stored if s not in on_disk]
      first, second = sorted(on_disk, key=lambda s: pool.info(s[0]).offset)
      cut = pool.info(second[0]).offset + 4096
      os.truncate(swap_file(pool), cut)
      # Below the cut: intact. Above it: an error naming the file, in
      # bounded time (no SIGBUS: the file is read with pread, never mapped).
      assert_intact(pool, [first])
      error, _ = raises(jcxl.TierIOError, lambda: pool.get(second[0]),
                        match=swap_file(pool))
      assert "behind the pool's back" in str(error)
      assert f"handle {second[0]} (nvme tier" in str(error)
      assert "lost" in pool.stats()["nvme"].label()
      # A step reading the lost object fails as well.
      w = jcxl.place(jnp.ones((16, 16)), "nvme", pool=pool)
      assert float(run_step(_sum_step(), w)) == 256
      os.truncate(swap_file(pool), 0)
      error, _ = raises(jax.errors.JaxRuntimeError,
                        lambda: run_step(_sum_step(), w))
      assert str(error).startswith("DATA_LOSS") and swap_file(pool) in str(
          error)
      assert assert_intact(pool, in_memory) > 0
      # The tier keeps working for what is written anew.
      fresh = np.arange(300_000, dtype=np.uint8)
      handle = pool.put(fresh, "nvme")
      assert_intact(pool, [(handle, fresh)])
      pool.put_async(second[0], second[1]).wait()  # rewritten: whole again
      assert_intact(pool, [second])
    assert os.listdir(tmp_path) == []

  def test_removed_file_keeps_working_and_close_cleans_up(self, tmp_path):
    # An unlinked file stays readable through the open descriptor: no fault.
    with new_pool(tmp_path) as pool:
      stored = store_some(pool)
      os.unlink(swap_file(pool))
      assert_intact(pool, stored)
      array = np.arange(500_000, dtype=np.uint8)
      stored.append((pool.put(array, "nvme"), array))
      assert_intact(pool, stored)
      # A stranger's file in its place is not ours to read or write.
      with open(swap_file(pool), "wb") as f:
        f.write(b"not the pool's")
      assert_intact(pool, stored)
      with open(swap_file(pool), "rb") as f:
        assert f.read() == b"not the pool's"
    assert os.listdir(tmp_path) == []

  def test_unreadable_file_keeps_working_and_close_cleans_up(self, tmp_path):
    # Permissions are checked when a file is opened; the pool opened its own.
    with new_pool(tmp_path) as pool:
      stored = store_some(pool)
      os.chmod(swap_file(pool), 0)
      os.chmod(pool.nvme_dir, 0)
      assert_intact(pool, stored)
      array = np.arange(500_000, dtype=np.uint8)
      stored.append((pool.put(array, "nvme"), array))
      assert_intact(pool, stored)
    assert os.listdir(tmp_path) == []


class FileSystemFullTest:

  def test_write_refused_by_the_file_system(self, tmp_path):
    # A tiny file system needs root to mount; the file size limit makes
    # write() fail the same way (EFBIG instead of ENOSPC), unprivileged. It
    # is set in a child process (Python ignores SIGXFSZ there, as here).
    result = run_python(
        """
        import json, resource, sys, time
        import jax, jax.numpy as jnp, numpy as np, jcxl

        pool = jcxl.Pool(host="16MiB", cxl="16MiB", nvme="64MiB",
                         nvme_dir=sys.argv[1], timeout_s=%r)
        rng = np.random.default_rng(0)
        stored = []
        for i, tier in enumerate(["host", "cxl", "nvme"] * 2):
          array = rng.integers(0, 256, 100_000 * (i + 1), np.uint8)
          stored.append((pool.put(array, tier), array))
        w = jcxl.place(jnp.ones((512, 512)), "nvme", pool=pool)
        (_, handle), = w.local_handles
        limit = pool.info(handle).offset + 4096
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        out = {}
        start = time.perf_counter()
        try:
          pool.put(np.ones(4 << 20, np.uint8), "nvme")
        except Exception as e:
          out["put"] = [type(e).__name__, isinstance(e, OSError), str(e),
                        time.perf_counter() - start]
        step = jax.jit(lambda w: jcxl.store(w, jcxl.fetch(w) * 2))
        start = time.perf_counter()
        try:
          jax.block_until_ready(step(w))
        except Exception as e:
          out["step"] = [type(e).__name__, str(e), time.perf_counter() - start]
        out["intact"] = all(pool.get(h).tobytes() == a.tobytes()
                            for h, a in stored)
        out["compared"] = sum(a.nbytes for _, a in stored)
        out["swap"] = pool.nvme_dir + "/tier.swap"
        pool.close()
        print(json.dumps(out))
        """ % TIMEOUT_S, str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    name, is_os_error, message, seconds = out["put"]
    assert name == "TierIOError" and is_os_error
    assert "(nvme tier, shape (4194304,), uint8)" in message
    assert out["swap"] in message and "File too large" in message
    assert seconds < TIMEOUT_S + MARGIN_S
    name, message, seconds = out["step"]
    assert name == "JaxRuntimeError" and message.startswith("DATA_LOSS")
    assert "jcxl_store_done" in message and "(nvme tier, shape (512, 512)" in (
        message)
    assert out["swap"] in message and "File too large" in message
    assert seconds < TIMEOUT_S + MARGIN_S
    assert out["intact"] and out["compared"] == 2_100_000
    TALLY["errors raised"] += 2
    TALLY["objects compared"] += 6
    TALLY["bytes compared"] += out["compared"]
    assert os.listdir(tmp_path) == []


class CloseDuringStepTest:

  def test_close_while_a_step_streams_from_the_pool(self, tmp_path):
    # A 20 MB/s link: each 1 MiB layer takes about 50 ms to fetch, and each
    # fetch starts only after the layer before it (after=).
    link = jcxl.LinkModel(bandwidth="20MB/s")
    pool = jcxl.Pool(host=0, cxl="64MiB", nvme="16MiB", nvme_dir=tmp_path,
                     cxl_link=link, timeout_s=5.0)
    layers = [jcxl.place(jnp.eye(512) * (1 + i / 64), "cxl", pool=pool)
              for i in range(12)]

    @jax.jit
    def step(layers, x):
      for w in layers:
        x = x @ jcxl.fetch(w, after=x)
      return x

    x = jnp.ones((4, 512))
    run_step(step, layers, x)  # compiled, and runs to completion
    result = step(layers, x)  # dispatched: streams for about 600 ms
    time.sleep(0.15)
    _, error, seconds = bounded(pool.close, 5.0 + MARGIN_S)
    assert error is None, error  # the fetch under way was let finish
    assert seconds < 5.0 + MARGIN_S
    error, _ = raises(jax.errors.JaxRuntimeError,
                      lambda: jax.block_until_ready(result),
                      limit_s=5.0 + MARGIN_S)
    assert "is closed" in str(error) and f"pool {pool.id}" in str(error)
    result = step(layers, x)
    raises(jax.errors.JaxRuntimeError, lambda: jax.block_until_ready(result),
           match="is closed")
    # gather waits for the steps this thread dispatched (they have ended):
    # it reports the failed one, once.
    with pytest.raises(jax.errors.JaxRuntimeError, match="is closed"):
      jcxl.gather(layers[0])
    with pytest.raises(jcxl.PoolClosedError,
                       match=f"pool {pool.id}, which is closed"):
      jcxl.gather(layers[0])
    assert os.listdir(tmp_path) == []
    # The process is healthy: a new pool streams as before.
    with jcxl.Pool(host="8MiB", cxl="8MiB") as other:
      w = jcxl.place(jnp.ones((8, 8)), "cxl", pool=other)
      assert float(run_step(_sum_step(), w)) == 64


class ForeignHandleTest:

  def test_handles_of_one_pool_are_rejected_by_another(self, tmp_path):
    a = new_pool(tmp_path)
    with jcxl.Pool(host="32MiB", cxl="32MiB") as b:
      stored_a = store_some(a, seed=1)
      stored_b = store_some(b, tiers=("host", "cxl"), seed=2)
      assert not set(a.handles()) & set(b.handles())
      for handle, array in stored_a:
        for call in (lambda: b.get(handle), lambda: b.info(handle),
                     lambda: b.free(handle),
                     lambda: b.put_async(handle, array).wait(),
                     lambda: b.read_bytes_async(handle,
                                                np.empty(1, np.uint8))):
          raises(jcxl.UnknownHandleError, call, match="another pool's")
      assert_intact(a, stored_a)
      a.close()
      for handle, _ in stored_a:
        raises(jcxl.UnknownHandleError, lambda h=handle: b.get(h))
      assert_intact(b, stored_b)


class ExitTest:

  def test_close_leaves_no_files(self, tmp_path):
    pool = new_pool(tmp_path)
    store_some(pool)
    private = pool.nvme_dir
    assert os.listdir(tmp_path) == [os.path.basename(private)]
    pool.close()
    assert os.listdir(tmp_path) == []

  @pytest.mark.parametrize("how", ["left_open", "dropped", "uncaught_error"])
  def test_swap_files_removed_when_the_interpreter_exits(self, tmp_path, how):
    result = run_python(
        """
        import gc, sys
        import numpy as np, jcxl
        base, how = sys.argv[1], sys.argv[2]
        pool = jcxl.Pool(host="8MiB", cxl="8MiB", nvme="16MiB",
                         nvme_dir=base)
        pool.put(np.ones(3 << 20, np.uint8), "nvme")
        kept = jcxl.Pool(host=0, cxl=0, nvme="8MiB", nvme_dir=base,
                         keep_nvme_files=True)
        kept.put(np.ones(5000, np.uint8), "nvme")
        print(pool.nvme_dir, kept.nvme_dir, flush=True)
        if how == "dropped":
          del pool
          gc.collect()
        elif how == "uncaught_error":
          raise RuntimeError("the program fails with the pool open")
        """, str(tmp_path), how)
    assert result.returncode == (1 if how == "uncaught_error" else 0), (
        result.stderr[-3000:])
    assert "leaked" not in result.stderr  # nothing of the pools outlives it
    private, kept = result.stdout.split()
    assert not os.path.exists(private)
    # Asked to keep: kept.
    assert os.listdir(kept) == ["tier.swap"]
    assert os.listdir(tmp_path) == [os.path.basename(kept)]


class NvmeDirectoryTest:

  def test_private_directory_and_file_modes(self, tmp_path):
    old = os.umask(0)  # even with a permissive umask
    try:
      pool = new_pool(tmp_path)
    finally:
      os.umask(old)
    with pool:
      pool.put(np.ones(10), "nvme")
      private = pool.nvme_dir
      assert os.path.dirname(private) == str(tmp_path)
      assert stat.S_IMODE(os.lstat(private).st_mode) == 0o700
      assert stat.S_IMODE(os.lstat(swap_file(pool)).st_mode) == 0o600
      assert stat.S_ISREG(os.lstat(swap_file(pool)).st_mode)
      with new_pool(tmp_path) as other:  # pools never share a directory
        assert other.nvme_dir != private

  def test_unusable_directories_are_rejected(self, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ValueError, match="not a directory"):
      new_pool(a_file)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(ValueError, match="symbolic link"):
      new_pool(link)
    assert sorted(os.listdir(tmp_path)) == ["file", "link"]
