"""The nvme tier's private directories: made, locked, cleaned up, reclaimed.

Each pool with an nvme tier gets its own 0700 directory, ``jcxl-pool-*``, in
the user's ``nvme_dir``. Unless the pool keeps its files, the directory holds
a lock file on which the process keeps an exclusive ``flock`` for the pool's
life. The kernel drops that lock when the process ends, however it ends, so
a directory whose lock can be taken belongs to no live process: a new pool
removes such directories (left by SIGKILL, a crash, an OOM kill) from the
same ``nvme_dir``. A directory whose lock is held, or that has no lock file
(a pool that keeps its files), is never touched. The lock is taken before
the directory gets its ``jcxl-pool-*`` name (see ``_make_locked``), so no
live pool's directory is ever seen unlocked; a process killed in those few
system calls can leave an empty ``.jcxl-pool-*.tmp`` or ``jcxl-pool-*``
directory, which is never reclaimed.

SIGTERM and SIGHUP, the way schedulers stop jobs, end Python without running
``atexit``; where their handler was the default one, jcxl removes its pools'
directories and then lets the signal end the process as it would have (its
exit status still says "killed by signal"). A handler the program installed
is left to decide: jcxl's cleanup then happens at interpreter exit, if the
handler exits, or not at all if the process goes on.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import shutil
import signal
import stat
import tempfile
import threading

logger = logging.getLogger(__name__)

PREFIX = "jcxl-pool-"
LOCK_NAME = ".owner.lock"
# A directory being made: locked, not yet renamed to PREFIX*; never reclaimed.
STAGING_SUFFIX = ".tmp"
CLEANUP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@dataclasses.dataclass
class SwapDir:
  """A pool's private directory, and the lock that says its owner lives.

  Attributes:
    path: the directory.
    keep: whether its files outlive the pool (then it has no lock file).
    pid: the process that made it; a forked child never removes it.
    lock_fd: the open lock file (None once released, or when `keep`).
  """
  path: str
  keep: bool
  pid: int
  lock_fd: int | None = None
  # close() on two threads at once must not close the lock's fd twice (the
  # second close could hit a file another thread just opened).
  _mu: threading.Lock = dataclasses.field(default_factory=threading.Lock,
                                          repr=False)

  def remove(self) -> None:
    """Removes the directory (unless kept) and releases its lock.

    Only in the process that made it: a forked child shares the lock and
    the directory with its parent, which still uses them.
    """
    if os.getpid() != self.pid:
      return
    with self._mu:
      _live.pop(self.path, None)
      if not self.keep:
        remove_tree(self.path)
      if self.lock_fd is not None:
        os.close(self.lock_fd)
        self.lock_fd = None


# Directories to remove on SIGTERM/SIGHUP: path -> SwapDir. Read by a signal
# handler, which may interrupt any code of the main thread: no lock guards
# it (single dict operations are atomic under the GIL).
_live: dict[str, SwapDir] = {}
_previous_handlers: dict[int, object] = {}


def make(base: str | os.PathLike, *, keep: bool) -> SwapDir:
  """Validates the user's nvme directory and makes a pool's own in it.

  First removes the directories of pools whose process is gone.

  Raises:
    ValueError: `base` is a symbolic link, not a directory, or not writable.
  """
  base = os.fspath(base)
  if os.path.islink(base):
    raise ValueError(f"nvme_dir {base!r} is a symbolic link; pass the real "
                     f"directory ({os.path.realpath(base)!r})")
  if not os.path.isdir(base):
    raise ValueError(f"nvme_dir {base!r} does not exist or is not a directory")
  if not os.access(base, os.W_OK | os.X_OK):
    raise ValueError(f"nvme_dir {base!r} is not writable by this process")
  reclaim_abandoned(base)
  try:
    if keep:  # no lock to take: made under its own name at once
      path = tempfile.mkdtemp(prefix=PREFIX, dir=base)  # mode 0700
      os.chmod(path, stat.S_IRWXU)
      return SwapDir(path=path, keep=keep, pid=os.getpid())
    path, fd = _make_locked(base)
  except OSError as e:
    raise ValueError(f"nvme_dir {base!r} is not writable by this process: "
                     f"{e.strerror}") from e
  swap = SwapDir(path=path, keep=keep, pid=os.getpid(), lock_fd=fd)
  _live[path] = swap
  _install_signal_cleanup()
  return swap


def _make_locked(base: str) -> tuple[str, int]:
  """A new ``jcxl-pool-*`` directory in `base` whose lock this process
  holds from the moment the directory has that name.

  The lock file is made and locked in a directory reclaim ignores
  (``.jcxl-pool-*.tmp``), which then takes the place of an empty
  ``jcxl-pool-*`` (reserved by mkdtemp: a unique name, and with no lock
  file also ignored). A lock file created under the final name would be
  unlocked for a moment, and another process reclaiming then would delete
  a live pool's directory.
  """
  staging = tempfile.mkdtemp(prefix="." + PREFIX, suffix=STAGING_SUFFIX,
                             dir=base)  # mode 0700
  try:
    os.chmod(staging, stat.S_IRWXU)
    fd = os.open(os.path.join(staging, LOCK_NAME),
                 os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX)  # new and private: never contended
      path = tempfile.mkdtemp(prefix=PREFIX, dir=base)
      try:
        os.rename(staging, path)  # replaces the empty reservation
      except OSError:
        os.rmdir(path)
        raise
    except OSError:
      os.close(fd)
      raise
  except OSError:
    remove_tree(staging)
    raise
  return path, fd


def remove_tree(path: str) -> None:
  """Removes a pool's directory, even if its mode was changed."""
  if not os.path.islink(path) and os.path.isdir(path):
    try:
      os.chmod(path, stat.S_IRWXU)
    except OSError:
      pass
  shutil.rmtree(path, ignore_errors=True)


def reclaim_abandoned(base: str) -> list[str]:
  """Removes `base`'s pool directories whose owning process is gone.

  Returns:
    The directories removed.
  """
  removed = []
  try:
    entries = list(os.scandir(base))
  except OSError:
    return removed
  for entry in entries:
    if not entry.name.startswith(PREFIX) or entry.path in _live:
      continue
    if _take_if_abandoned(entry):
      removed.append(entry.path)
  if removed:
    logger.info("jcxl: removed %d nvme director%s of pools whose process is "
                "gone: %s", len(removed), "y" if len(removed) == 1 else "ies",
                ", ".join(removed))
  return removed


def _take_if_abandoned(entry: os.DirEntry) -> bool:
  """Removes one directory if its lock can be taken: its owner is gone."""
  try:
    if not entry.is_dir(follow_symlinks=False):
      return False
    if entry.stat(follow_symlinks=False).st_uid != os.getuid():
      return False
    fd = os.open(os.path.join(entry.path, LOCK_NAME),
                 os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
  except OSError:  # no lock file (a kept pool's files), or not ours
    return False
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    os.close(fd)
    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
      logger.warning("jcxl: cannot check %s: %s", entry.path, e)
    return False  # held: a live pool's
  try:
    remove_tree(entry.path)  # under the lock: no other pool races us
  finally:
    os.close(fd)
  return True


def _install_signal_cleanup() -> None:
  """Chains jcxl's cleanup to SIGTERM and SIGHUP (once, main thread only)."""
  if threading.current_thread() is not threading.main_thread():
    return  # signal.signal works only there; atexit cleanup still runs
  for signum in CLEANUP_SIGNALS:
    if signum in _previous_handlers:
      continue
    previous = signal.getsignal(signum)
    if previous is None or previous == signal.SIG_IGN:
      continue  # set outside Python (cannot chain), or ignored: leave it
    _previous_handlers[signum] = previous
    signal.signal(signum, _on_signal)


def _on_signal(signum: int, frame) -> None:
  previous = _previous_handlers.get(signum, signal.SIG_DFL)
  if callable(previous):
    # The program's own handler decides whether the process ends; if it
    # exits, the pools are closed at interpreter exit as usual.
    previous(signum, frame)
    return
  pid = os.getpid()
  for swap in list(_live.values()):
    if swap.pid == pid:
      remove_tree(swap.path)
  # End as the signal would have without jcxl: killed by it.
  signal.signal(signum, signal.SIG_DFL)
  os.kill(pid, signum)
