"""Exceptions raised by the jcxl pool and its transfers.

Each derives from the built-in exception a user would catch for that kind of
problem (``MemoryError`` for a full tier, ``KeyError`` for an unknown handle,
``TimeoutError`` for a transfer that did not finish), so generic handlers
keep working.
"""

from __future__ import annotations


class JcxlError(Exception):
  """Base class of every jcxl error."""


class PoolExhaustedError(JcxlError, MemoryError):
  """A tier (and every tier it may spill to) has no room for an object."""


class UnknownHandleError(JcxlError, LookupError):
  """A handle that this pool never issued, or whose object was freed."""


class PoolClosedError(JcxlError, RuntimeError):
  """The pool was closed; its objects and handles are gone."""


class TransferTimeoutError(JcxlError, TimeoutError):
  """A transfer did not finish within its deadline (the pool's `timeout_s`).

  The message names the object and the time waited; the transfer is
  cancelled, so what it had not moved yet it never moves.
  """


class TierIOError(JcxlError, OSError):
  """The nvme tier failed a read or a write.

  Its file system refused it (full, over a file size limit, an I/O error),
  or its file was cut short behind the pool's back; the message names the
  object, the file and the cause.
  """


class PoolMismatchError(JcxlError, ValueError):
  """In a multi-process run, the processes' pools differ in a setting (the
  message names it and each process's value), or a process did not reach
  the check in time."""


class StepMismatchError(JcxlError, ValueError):
  """In a multi-process run, the processes' offloaded steps differ in a
  setting that changes the compiled step (schedule, device budget, update,
  refetch, the tier of a leaf; the message names each and each process's
  value), or a process did not reach one of the step's agreements in time.
  """


class CheckpointCorruptError(JcxlError, OSError):
  """A checkpoint's bytes are not what its save wrote.

  An array's checksum does not match, or its data (or the checkpoint's
  metadata) cannot be read: a file was changed, cut short or deleted. The
  message names the checkpoint, the array and, where it can tell, the file.
  Nothing was restored or overwritten.
  """


class InternalError(JcxlError, RuntimeError):
  """A jcxl bug or an unexpected system failure."""


# Indexed by the C++ core's jcxl::Code (ffi/status.h).
_BY_CODE = {
    1: ValueError,
    2: UnknownHandleError,
    3: PoolExhaustedError,
    4: PoolClosedError,
    5: TransferTimeoutError,
    6: TierIOError,
    7: InternalError,
}


def error_class(code: int) -> type[Exception]:
  """The exception class for a C++ status code (used by the extension)."""
  return _BY_CODE.get(code, InternalError)
