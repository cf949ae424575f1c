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

Another user must not be able to replace a pool's directory: ``make``
refuses an ``nvme_dir`` that others may write to without the sticky bit, or
that another user (not root) owns, and the directories are removed through
descriptors (``O_NOFOLLOW``, ``fchmod``, ``unlink``/``rmdir`` at a
directory descriptor), never by a path that a symbolic link put in its
place would redirect.

SIGTERM and SIGHUP, the way schedulers stop jobs, end Python without running
``atexit``; where their handler was the default one, jcxl removes its pools'
directories and then lets the signal end the process as it would have (its
exit status still says "killed by signal"). A handler the program installed
is left to decide: jcxl's cleanup then happens at interpreter exit, if the
handler exits, or not at all if the process goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
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
    identity: the directory's (st_dev, st_ino), so that whatever else is
      put under its name later is never removed.
  """
  path: str
  keep: bool
  pid: int
  lock_fd: int | None = None
  # (st_dev, st_ino) of the directory made: only that one is ever removed.
  identity: tuple[int, int] | None = None
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
        remove_tree(self.path, identity=self.identity)
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
    ValueError: `base` is a symbolic link, not a directory, not writable,
      owned by another user (not root), or writable by other users without
      the sticky bit.
  """
  base = os.fspath(base)
  if os.path.islink(base):
    raise ValueError(f"nvme_dir {base!r} is a symbolic link; pass the real "
                     f"directory ({os.path.realpath(base)!r})")
  if not os.path.isdir(base):
    raise ValueError(f"nvme_dir {base!r} does not exist or is not a directory")
  if not os.access(base, os.W_OK | os.X_OK):
    raise ValueError(f"nvme_dir {base!r} is not writable by this process")
  _check_others_cannot_replace(base)
  reclaim_abandoned(base)
  try:
    if keep:  # no lock to take: made under its own name at once
      path = tempfile.mkdtemp(prefix=PREFIX, dir=base)  # mode 0700
      fd = os.open(path, _DIR_FLAGS)
      try:
        os.fchmod(fd, stat.S_IRWXU)
        identity = _identity(os.fstat(fd))
      finally:
        os.close(fd)
      return SwapDir(path=path, keep=keep, pid=os.getpid(), identity=identity)
    path, fd, identity = _make_locked(base)
  except OSError as e:
    raise ValueError(f"nvme_dir {base!r} is not writable by this process: "
                     f"{e.strerror}") from e
  swap = SwapDir(path=path, keep=keep, pid=os.getpid(), lock_fd=fd,
                 identity=identity)
  _live[path] = swap
  _install_signal_cleanup()
  return swap


# A directory opened so that a symbolic link in its place fails (ELOOP or
# ENOTDIR) instead of being followed.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _identity(info: os.stat_result) -> tuple[int, int]:
  return info.st_dev, info.st_ino


def _check_others_cannot_replace(base: str) -> None:
  """Refuses an nvme_dir in which another user could rename the pool's
  directory and put a symbolic link in its place.

  Who may rename an entry: the directory's owner, and anyone who may write
  to it, unless the sticky bit (as on /tmp) limits that to the entry's
  owner.
  """
  info = os.stat(base)
  me = os.geteuid()
  if info.st_uid not in (me, 0):
    raise ValueError(
        f"nvme_dir {base!r} is owned by another user (uid {info.st_uid}), "
        "who could replace the pool's directory in it; use a directory of "
        "your own")
  sticky = bool(info.st_mode & stat.S_ISVTX)
  if info.st_mode & stat.S_IWOTH and not sticky:
    raise ValueError(
        f"nvme_dir {base!r} can be written by every user (mode "
        f"{stat.S_IMODE(info.st_mode):04o}) and has no sticky bit, so "
        "another user could replace the pool's directory in it; set the "
        f"sticky bit (chmod +t) or take the others' write permission away "
        "(chmod o-w), or use a directory of your own")
  if info.st_mode & stat.S_IWGRP and not sticky:
    logger.warning(
        "jcxl: nvme_dir %s can be written by its group (gid %d, mode %04o) "
        "and has no sticky bit: the group's other members could replace a "
        "pool's directory in it; chmod g-w or chmod +t it unless the group "
        "is yours alone", base, info.st_gid, stat.S_IMODE(info.st_mode))


def _make_locked(base: str) -> tuple[str, int, tuple[int, int]]:
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
  identity = None
  try:
    dir_fd = os.open(staging, _DIR_FLAGS)
    try:
      os.fchmod(dir_fd, stat.S_IRWXU)
      identity = _identity(os.fstat(dir_fd))
      fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL |
                   os.O_CLOEXEC | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    finally:
      os.close(dir_fd)
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
    remove_tree(staging, identity=identity)
    raise
  return path, fd, identity


def remove_tree(path: str, *, identity: tuple[int, int] | None = None
                ) -> None:
  """Removes a pool's directory, even if its mode was changed.

  Never follows a symbolic link: the directory is opened with O_NOFOLLOW
  and everything in it is reached from that descriptor, so a link put in
  its place at any moment is never followed (its target's mode and files
  are untouched). Only a directory of this user's, and with `identity`
  ((st_dev, st_ino)) only that very directory, is emptied. Errors are
  ignored: what cannot be removed stays.
  """
  parent, name = os.path.split(os.path.abspath(path))
  try:
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
  except OSError:
    return
  try:
    fd = _open_dir(name, parent_fd)
    if fd is None:
      return
    try:
      info = os.fstat(fd)
      if info.st_uid != os.geteuid() or (
          identity is not None and _identity(info) != identity):
        logger.warning("jcxl: not removing %s: it is not the directory "
                       "this pool made (replaced meanwhile?)", path)
        return
      _remove_contents(fd)
    finally:
      os.close(fd)
    with contextlib.suppress(OSError):
      if _identity(os.stat(name, dir_fd=parent_fd,
                           follow_symlinks=False)) == _identity(info):
        os.rmdir(name, dir_fd=parent_fd)
  finally:
    os.close(parent_fd)


def _open_dir(name: str, dir_fd: int) -> int | None:
  """`name` in `dir_fd`, opened as a directory without following a link;
  made readable first if its mode was changed (its owner may). None if it
  is not a directory or cannot be opened."""
  try:
    return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
  except PermissionError:
    pass
  except OSError:  # gone, or not a directory (a link: ELOOP or ENOTDIR)
    return None
  # Mode 0: an O_PATH descriptor needs no permission, and chmod through
  # /proc/self/fd acts on the directory it holds, never on a link.
  try:
    path_fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW |
                      os.O_CLOEXEC, dir_fd=dir_fd)
  except (OSError, AttributeError):  # AttributeError: no O_PATH (not Linux)
    return None
  try:
    os.chmod(f"/proc/self/fd/{path_fd}", stat.S_IRWXU)
    return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
  except OSError:
    return None
  finally:
    os.close(path_fd)


def _remove_contents(fd: int) -> None:
  """Empties the directory open at `fd`, reaching each entry from it."""
  with contextlib.suppress(OSError):
    os.fchmod(fd, stat.S_IRWXU)  # to list and unlink in it
  try:
    with os.scandir(fd) as entries:
      listed = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
  except OSError:
    return
  for name, is_dir in listed:
    with contextlib.suppress(OSError):
      if not is_dir:
        os.unlink(name, dir_fd=fd)  # a link is removed, never followed
        continue
      sub = _open_dir(name, fd)
      if sub is None:
        continue
      try:
        _remove_contents(sub)
      finally:
        os.close(sub)
      os.rmdir(name, dir_fd=fd)


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
    dir_fd = os.open(entry.path, _DIR_FLAGS)  # a link in its place fails
  except OSError:
    return False
  try:
    info = os.fstat(dir_fd)
    if info.st_uid != os.geteuid():
      return False
    fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW,
                 dir_fd=dir_fd)
  except OSError:  # no lock file (a kept pool's files), or not ours
    return False
  finally:
    os.close(dir_fd)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    os.close(fd)
    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
      logger.warning("jcxl: cannot check %s: %s", entry.path, e)
    return False  # held: a live pool's
  try:
    # Under the lock: no other pool races us; and only the directory
    # whose lock this is.
    remove_tree(entry.path, identity=_identity(info))
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
      remove_tree(swap.path, identity=swap.identity)
  # End as the signal would have without jcxl: killed by it.
  signal.signal(signum, signal.SIG_DFL)
  os.kill(pid, signum)
