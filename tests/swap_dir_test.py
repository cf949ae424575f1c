"""The nvme tier's directories after the process ends, however it ends.

SIGTERM and SIGHUP remove them and still end the process by the signal;
a directory a SIGKILLed process left is reclaimed by the next pool made in
the same nvme_dir; a live process's directory, or one whose pool keeps its
files, is never touched; a forked child neither removes its parent's
directory nor hangs on exit. Each process under test is a fresh interpreter.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import jcxl
import numpy as np
import pytest

from jcxl._src import swap_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 120

# A process that makes a pool (or several) in argv[1], prints their
# directories, then waits for a signal.
HOLDER = """
import signal, sys, time
# As a shell starts a program: a signal the test runner ignores (SIGHUP
# under nohup) is inherited ignored, and jcxl rightly leaves it so.
signal.signal(signal.SIGHUP, signal.SIG_DFL)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
import numpy as np, jcxl
base, keep = sys.argv[1], sys.argv[2] == "keep"
{before}
pool = jcxl.Pool(host="8MiB", cxl=0, nvme="16MiB", nvme_dir=base,
                 keep_nvme_files=keep)
pool.put(np.ones(3 << 20, np.uint8), "nvme")
{extra}
print(pool.nvme_dir, flush=True)
time.sleep(100)
print("not ended", flush=True)
"""


def start_holder(base, *, keep: bool = False, before: str = "",
                 extra: str = "") -> tuple[subprocess.Popen, str]:
  """Starts a HOLDER process; returns it and its pool's directory."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  code = textwrap.dedent(HOLDER).format(before=textwrap.dedent(before),
                                        extra=textwrap.dedent(extra))
  process = subprocess.Popen(
      [sys.executable, "-c", code, str(base), "keep" if keep else "drop"],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)
  line = process.stdout.readline().strip()
  if not line:
    process.kill()
    _, stderr = process.communicate(timeout=TIMEOUT_S)
    pytest.fail(f"the holder did not start: {stderr[-3000:]}")
  return process, line


def end(process: subprocess.Popen, signum: int) -> tuple[int, str, str]:
  process.send_signal(signum)
  stdout, stderr = process.communicate(timeout=TIMEOUT_S)
  return process.returncode, stdout, stderr


class SignalTest:

  @pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
  def test_signal_removes_the_directory_and_still_kills(self, tmp_path,
                                                        signum):
    process, private = start_holder(tmp_path)
    assert sorted(os.listdir(private)) == [swap_dir.LOCK_NAME, "tier.swap"]
    returncode, stdout, stderr = end(process, signum)
    assert returncode == -signum, stderr[-3000:]
    assert "not ended" not in stdout
    assert not os.path.exists(private)
    assert os.listdir(tmp_path) == []

  def test_the_programs_own_handler_decides(self, tmp_path):
    # A handler that exits: the pools are closed at interpreter exit.
    process, private = start_holder(tmp_path, extra="""
        import signal
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
        """)
    returncode, _, stderr = end(process, signal.SIGTERM)
    assert returncode == 7, stderr[-3000:]
    assert not os.path.exists(private)

  def test_a_handler_installed_before_the_pool_is_chained(self, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    code = textwrap.dedent("""
        import os, signal, sys
        import numpy as np, jcxl
        seen = []
        signal.signal(signal.SIGHUP, lambda s, f: seen.append(s))
        pool = jcxl.Pool(host="8MiB", cxl=0, nvme="16MiB",
                         nvme_dir=sys.argv[1])
        h = pool.put(np.arange(1000.0), "nvme")
        os.kill(os.getpid(), signal.SIGHUP)  # handled: the process goes on
        assert seen == [signal.SIGHUP], seen
        assert os.path.isdir(pool.nvme_dir)
        assert np.array_equal(pool.get(h), np.arange(1000.0))
        print(pool.nvme_dir, flush=True)
        """)
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=TIMEOUT_S, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not os.path.exists(result.stdout.strip())  # closed at exit

  def test_an_ignored_signal_stays_ignored(self, tmp_path):
    process, private = start_holder(tmp_path, before="""
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        """)
    try:
      process.send_signal(signal.SIGTERM)
      with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=1.0)
      assert os.path.isdir(private)
    finally:
      returncode, _, _ = end(process, signal.SIGKILL)
    assert returncode == -signal.SIGKILL


class ReclaimTest:

  def test_a_new_pool_reclaims_what_sigkill_left(self, tmp_path):
    process, private = start_holder(tmp_path)
    kept_process, kept = start_holder(tmp_path, keep=True)
    returncode, _, _ = end(process, signal.SIGKILL)
    assert returncode == -signal.SIGKILL
    end(kept_process, signal.SIGKILL)
    assert os.path.isdir(private)  # what SIGKILL leaves
    with jcxl.Pool(host="8MiB", cxl=0, nvme="16MiB",
                   nvme_dir=tmp_path) as pool:
      assert not os.path.exists(private)
      # Asked to keep its files: kept, even though its process is gone.
      assert sorted(os.listdir(tmp_path)) == sorted(
          [os.path.basename(kept), os.path.basename(pool.nvme_dir)])
      assert os.listdir(kept) == ["tier.swap"]

  def test_a_live_pools_directory_is_never_touched(self, tmp_path):
    process, private = start_holder(tmp_path)
    try:
      before = os.stat(os.path.join(private, "tier.swap"))
      for _ in range(3):
        with jcxl.Pool(host="8MiB", cxl=0, nvme="16MiB",
                       nvme_dir=tmp_path) as pool:
          pool.put(np.ones(5000, np.uint8), "nvme")
        assert swap_dir.reclaim_abandoned(str(tmp_path)) == []
      after = os.stat(os.path.join(private, "tier.swap"))
      assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
      assert sorted(os.listdir(private)) == [swap_dir.LOCK_NAME, "tier.swap"]
    finally:
      returncode, _, _ = end(process, signal.SIGTERM)
    assert returncode == -signal.SIGTERM
    assert os.listdir(tmp_path) == []

  def test_a_directory_is_locked_before_reclaim_can_see_it(
      self, tmp_path, monkeypatch):
    # Another process reclaiming between the lock file's creation and its
    # flock used to take the lock and delete the new, live directory.
    real_flock = swap_dir.fcntl.flock
    rival = []

    def reclaim_first(fd, operation):
      if not rival:
        rival.append(None)
        rival[0] = swap_dir.reclaim_abandoned(str(tmp_path))
      return real_flock(fd, operation)

    monkeypatch.setattr(swap_dir.fcntl, "flock", reclaim_first)
    made = swap_dir.make(str(tmp_path), keep=False)
    try:
      assert rival == [[]]
      assert os.listdir(made.path) == [swap_dir.LOCK_NAME]
      assert os.listdir(tmp_path) == [os.path.basename(made.path)]
    finally:
      made.remove()
    assert os.listdir(tmp_path) == []

  def test_a_directory_being_made_is_not_reclaimed(self, tmp_path):
    # What a pool being made looks like: its lock file not locked yet.
    staging = tmp_path / ".jcxl-pool-abc.tmp"
    staging.mkdir(mode=0o700)
    (staging / swap_dir.LOCK_NAME).touch()
    reserved = tmp_path / "jcxl-pool-abc"  # its name, reserved and empty
    reserved.mkdir(mode=0o700)
    assert swap_dir.reclaim_abandoned(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == [staging.name, reserved.name]

  def test_this_processs_own_pools_are_never_reclaimed(self, tmp_path):
    with jcxl.Pool(host="8MiB", cxl=0, nvme="16MiB",
                   nvme_dir=tmp_path) as first:
      h = first.put(np.arange(5000.0), "nvme")
      assert swap_dir.reclaim_abandoned(str(tmp_path)) == []
      with jcxl.Pool(host="8MiB", cxl=0, nvme="16MiB", nvme_dir=tmp_path):
        np.testing.assert_array_equal(first.get(h), np.arange(5000.0))

  def test_other_entries_are_left_alone(self, tmp_path):
    # Not a pool's directory, or one without a lock file: never removed.
    (tmp_path / "jcxl-pool-file").write_text("x")
    (tmp_path / "jcxl-pool-nolock").mkdir()
    (tmp_path / "jcxl-pool-link").symlink_to(tmp_path / "jcxl-pool-nolock")
    (tmp_path / "other").mkdir()
    with jcxl.Pool(host="8MiB", cxl=0, nvme="16MiB", nvme_dir=tmp_path):
      assert {"jcxl-pool-file", "jcxl-pool-nolock", "jcxl-pool-link",
              "other"} <= set(os.listdir(tmp_path))


class ForkTest:

  def test_a_forked_child_leaves_its_parents_pool_alone(self, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    code = textwrap.dedent("""
        import os, sys, warnings
        warnings.simplefilter("ignore")  # fork() with threads running
        import numpy as np, jcxl
        pool = jcxl.Pool(host="8MiB", cxl=0, nvme="16MiB",
                         nvme_dir=sys.argv[1])
        stored = np.arange(100_000, dtype=np.float32)
        h = pool.put(stored, "nvme")
        pid = os.fork()
        if pid == 0:
          sys.exit(0)  # runs the child's atexit handlers
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert os.path.isdir(pool.nvme_dir)
        assert np.array_equal(pool.get(h), stored)
        print(pool.nvme_dir, flush=True)
        """)
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=TIMEOUT_S, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.listdir(tmp_path) == []



class ConcurrentRemoveTest:

  def test_two_threads_removing_close_the_lock_once(self, tmp_path,
                                                    monkeypatch):
    # A second os.close of the lock's descriptor would close whatever file
    # the process opened meanwhile under the same number.
    swap = swap_dir.make(tmp_path, keep=False)
    fd = swap.lock_fd
    lock = os.fstat(fd).st_ino
    closed = []
    real_os = swap_dir.os

    class SlowClose:  # widens the window between the check and the close
      def __getattr__(self, name):
        return getattr(real_os, name)

      @staticmethod
      def close(n):
        if real_os.fstat(n).st_ino == lock:  # (removal closes others too)
          closed.append(n)
        time.sleep(0.05)
        real_os.close(n)

    monkeypatch.setattr(swap_dir, "os", SlowClose())
    threads = [threading.Thread(target=swap.remove) for _ in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert closed == [fd]
    assert swap.lock_fd is None
    assert os.listdir(tmp_path) == []


class _CountingProxy:
  """A module whose function call number `at` (counted across the module
  and its `path`) first runs `act`."""

  def __init__(self, real, at: int, act, counter=None):
    self._real, self._at, self._act = real, at, act
    self._counter = counter if counter is not None else [0]
    if hasattr(real, "path"):
      self.path = _CountingProxy(real.path, at, act, self._counter)

  def __getattr__(self, name):
    value = getattr(self._real, name)
    if not callable(value) or isinstance(value, type):
      return value

    def call(*args, **kwargs):
      if self._counter[0] == self._at:
        self._act()
      self._counter[0] += 1
      return value(*args, **kwargs)
    return call


def _remove_unreadable(base: str) -> str:
  """Makes a pool's directory in `base`, takes every permission away from
  it and from a directory in it, then removes it."""
  swap = swap_dir.make(base, keep=False)
  os.mkdir(os.path.join(swap.path, "sub"))
  os.chmod(os.path.join(swap.path, "sub"), 0)
  os.chmod(swap.path, 0)
  try:
    os.listdir(swap.path)
    return "still readable"
  except PermissionError:
    pass
  swap.remove()
  return "removed" if not os.listdir(base) else f"left {os.listdir(base)}"


class SymlinkRaceTest:
  """Another user who can rename entries in nvme_dir swaps a pool's
  directory for a symbolic link while the pool removes it."""

  def victim_and_target(self, tmp_path):
    base = tmp_path / "nvme"
    base.mkdir()
    victim = base / "jcxl-pool-victim"
    victim.mkdir(mode=0o700)
    (victim / "tier.swap").write_bytes(b"pool data")
    target = tmp_path / "theirs"  # a directory of the attacker's choice
    target.mkdir()
    (target / "precious").write_text("keep")
    os.chmod(target / "precious", 0o640)
    os.chmod(target, 0o751)
    return victim, target

  # Every point of the removal (past its last step: no race at all).
  @pytest.mark.parametrize("at", range(16))
  def test_a_link_put_in_its_place_is_never_followed(self, tmp_path,
                                                     monkeypatch, at):
    victim, target = self.victim_and_target(tmp_path)
    swapped = []

    def swap():
      if not os.path.isdir(victim):
        return  # removed already
      os.rename(victim, victim.parent / "moved")
      os.symlink(target, victim)
      swapped.append(True)

    monkeypatch.setattr(swap_dir, "os", _CountingProxy(os, at, swap))
    swap_dir.remove_tree(str(victim))
    monkeypatch.undo()
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o751
    assert stat.S_IMODE(os.stat(target / "precious").st_mode) == 0o640
    assert (target / "precious").read_text() == "keep"
    if not swapped:
      assert not os.path.lexists(victim)  # no race: removed

  def test_a_directory_put_in_its_place_is_left_alone(self, tmp_path):
    # Only the very directory the pool made is removed, not another one
    # (of this user's) renamed to its name.
    swap = swap_dir.make(tmp_path, keep=False)
    os.rename(swap.path, tmp_path / "moved")
    os.mkdir(swap.path)
    with open(os.path.join(swap.path, "mine"), "w") as f:
      f.write("keep")
    swap.remove()
    with open(os.path.join(swap.path, "mine")) as f:
      assert f.read() == "keep"

  def test_a_directory_made_unreadable_is_still_removed(self):
    # Modes bind root to nothing: as root, the check runs as another user
    # (in a forked child), in a directory of that user's.
    base = tempfile.mkdtemp()
    try:
      if os.geteuid() != 0:
        assert _remove_unreadable(base) == "removed"
      else:
        os.chown(base, 65534, 65534)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # only system calls here, then _exit
          result = "failed"
          try:
            os.setgid(65534)
            os.setuid(65534)
            result = _remove_unreadable(base)
          finally:
            os.write(write, result.encode())
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        with os.fdopen(read) as f:
          assert f.read() == "removed"
      assert os.listdir(base) == []
    finally:
      shutil.rmtree(base, ignore_errors=True)


class NvmeDirOwnershipTest:
  """An nvme_dir in which another user could rename the pool's directory
  is refused before anything is made in it."""

  def test_writable_by_everyone_without_sticky_bit_is_refused(self, tmp_path):
    base = tmp_path / "shared"
    base.mkdir()
    os.chmod(base, 0o777)
    with pytest.raises(ValueError, match=r"can be written by every user "
                       r"\(mode 0777\) and has no sticky bit"):
      jcxl.Pool(host="8MiB", cxl=0, nvme="16MiB", nvme_dir=base)
    assert os.listdir(base) == []
    os.chmod(base, 0o1777)  # as /tmp: others cannot rename our entries
    with jcxl.Pool(host="8MiB", cxl=0, nvme="16MiB", nvme_dir=base) as pool:
      pool.put(np.ones(10, np.uint8), "nvme")
    assert os.listdir(base) == []

  def test_owned_by_another_user_is_refused(self, tmp_path, monkeypatch):
    base = tmp_path / "theirs"
    base.mkdir()
    if os.geteuid() == 0:  # root can hand it to another user
      owner = 54321
      os.chown(base, owner, owner)
    else:  # or this process can pretend to be another user
      owner = os.geteuid()
      monkeypatch.setattr(swap_dir.os, "geteuid", lambda: owner + 1)
    with pytest.raises(ValueError, match=rf"is owned by another user "
                       rf"\(uid {owner}\)"):
      swap_dir.make(str(base), keep=False)
    monkeypatch.undo()
    assert os.listdir(base) == []

  def test_writable_by_its_group_is_warned_about(self, tmp_path, caplog):
    os.chmod(tmp_path, 0o770)
    with caplog.at_level("WARNING", logger="jcxl._src.swap_dir"):
      swap = swap_dir.make(str(tmp_path), keep=False)
    swap.remove()
    assert "can be written by its group" in caplog.text
