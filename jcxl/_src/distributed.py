"""Multi-process runs (``jax.distributed``): each process keeps the shards of
its own devices in a pool of its own.

Two things need the processes to talk to each other, through the key-value
store of JAX's coordination service:

* ``check_pools_agree``: the first time a pool stores an array whose
  sharding spans processes, every process publishes its pool's settings and
  compares them with the others'; a difference fails all of them at once,
  naming it, instead of surfacing later as a hang or a mismatched step.
* ``Agreement``: an offloaded step whose arrays span processes compares
  its settings at its first call (``check_steps_agree``), and every choice
  that changes its compiled program (DAP's plans, the plans it compiles
  ahead) is made from values every process exchanged, so that every
  process runs the same executable at every step.
* ``fail_together``: a process whose program raises tells the others, and
  each process stops when a peer says it failed. Without it a failed
  process waits at JAX's shutdown barrier while its peers wait for it in a
  collective, both until a timeout of minutes. The first pool check or
  step agreement ties the processes so by default (``tie_processes``); the
  context manager makes it explicit. (A process that dies outright is
  caught by JAX's heartbeat, after ``heartbeat_timeout_seconds``.)
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from jcxl._src import errors
from jcxl._src import registry
from jcxl._src import validation

if TYPE_CHECKING:
  from jcxl._src.pool import Pool

# How long a process waits for its peers' pool settings: they reach their
# first placement at about the same time, give or take their start-up.
PEER_TIMEOUT_S = 120.0
# How long a step's exchange waits for its peers: they run in lockstep (a
# step's collectives), but a first compile of a large step can take
# minutes longer on one host than another.
STEP_TIMEOUT_S = 600.0
_CHECKS = itertools.count()  # the nth pool checked, the same in every process
_AGREEMENTS = itertools.count()  # the nth step agreeing, likewise
# Most differences a mismatch error lists (one per leaf can be thousands).
_MAX_LISTED = 12
_FAILED_PREFIX = "jcxl/failed/"
_STOPPED_PREFIX = "jcxl/stopped/"
# Process 0 hosts JAX's coordination service: when it exits, every peer is
# aborted at once. On a failure it waits this long for the peers to have
# said their own errors (or stopped) first.
LEAD_GRACE_S = 5.0


def _client() -> Any:
  """JAX's coordination-service client, or None in a single-process run."""
  import jax  # pylint: disable=g-import-not-at-top
  from jcxl._src import jax_compat  # pylint: disable=g-import-not-at-top
  client = jax_compat.distributed_client()
  return client if client is not None and jax.process_count() > 1 else None


def spans_processes(devices: Any) -> bool:
  return len({d.process_index for d in devices}) > 1


def check_pools_agree(pool: Pool, *, timeout_s: float = PEER_TIMEOUT_S
                      ) -> None:
  """Raises PoolMismatchError, in every process, if the processes' pools
  differ in a setting of ``pool.settings()``. Once per pool; a collective:
  every process must place into its pools in the same order."""
  if pool._peers_agree:  # pylint: disable=protected-access
    return
  client = _client()
  if client is not None:
    import jax  # pylint: disable=g-import-not-at-top
    key = f"jcxl/pools/{next(_CHECKS)}"
    me, count = jax.process_index(), jax.process_count()
    client.key_value_set(f"{key}/{me}", json.dumps(pool.settings()))
    settings = {p: _peer_value(client, f"{key}/{p}", p, timeout_s)
                for p in range(count)}
    differences = _differences(settings)
    if differences:
      raise errors.PoolMismatchError(
          f"the pools of the {count} processes differ (pool {pool.id} in "
          f"process {me}); give every process the same pool settings:\n  "
          + "\n  ".join(differences))
  pool._peers_agree = True  # pylint: disable=protected-access
  if client is not None:
    tie_processes()


def _peer_value(client: Any, key: str, process: int, timeout_s: float
                ) -> dict[str, Any]:
  try:
    return json.loads(client.blocking_key_value_get(key,
                                                    validation.timeout_ms(timeout_s)))
  except Exception as e:  # a deadline, or the service gone
    raise errors.PoolMismatchError(
        f"process {process} did not publish its pool settings within "
        f"{timeout_s:.0f} s: it failed, is still starting, or places into "
        f"its pools in another order than this process ({e})") from None


def _differences(settings: dict[int, dict[str, Any]]) -> list[str]:
  """'setting: process 0 has A, process 1 has B' for each setting that is
  not the same in every process."""
  names = sorted({name for s in settings.values() for name in s})
  out = []
  for name in names:
    values = {p: s.get(name, "(missing)") for p, s in settings.items()}
    if len({json.dumps(v) for v in values.values()}) > 1:
      out.append(f"{name}: " + ", ".join(
          f"process {p} has {v}" for p, v in sorted(values.items())))
  return out


class Agreement:
  """The exchanges of one offloaded step among the processes of a run.

  The nth exchange of each process meets the nth of every other (keyed by
  that number): each publishes a JSON value, and every process gets all
  of them, in process order, so that each takes the same decision from
  the same values. A collective: every process must make the same
  exchanges in the same order, as it runs the same steps.
  """

  def __init__(self, what: str, timeout_s: float = STEP_TIMEOUT_S):
    import jax  # pylint: disable=g-import-not-at-top
    self.what = what
    self.timeout_s = timeout_s
    self.process = jax.process_index()
    self.count = jax.process_count()
    self._client = _client()
    self._id: int | None = None  # taken at the first exchange
    self.exchanges = 0

  def exchange(self, value: Any, *, about: str = "",
               timeout_s: float | None = None) -> list[Any]:
    """Every process's `value` (JSON), in process order; this one's too,
    as its peers read it.

    Raises:
      StepMismatchError: a peer did not publish within the timeout (it
        failed, runs another step, or makes other exchanges).
    """
    if self._id is None:
      self._id = next(_AGREEMENTS)
      tie_processes()
    client, me = self._client, self.process
    key = f"jcxl/steps/{self._id}/{self.exchanges}"
    text = json.dumps(value)
    client.key_value_set(f"{key}/{me}", text)
    timeout_s = self.timeout_s if timeout_s is None else timeout_s
    values = []
    for p in range(self.count):
      if p == me:
        values.append(json.loads(text))
        continue
      try:
        values.append(json.loads(client.blocking_key_value_get(
            f"{key}/{p}", validation.timeout_ms(timeout_s))))
      except Exception as e:  # a deadline, or the service gone
        raise errors.StepMismatchError(
            f"process {p} did not reach exchange {self.exchanges} of "
            f"{self.what} ({about or 'its next step'}) within "
            f"{timeout_s:.0f} s: it failed, runs other steps than process "
            f"{me}, or runs this one with other settings ({e})") from None
    # Every peer that published this exchange has read the one before
    # last: its key can go (a long run would pile them up otherwise).
    if self.exchanges >= 2:
      with contextlib.suppress(Exception):
        client.key_value_delete(f"jcxl/steps/{self._id}/"
                                f"{self.exchanges - 2}/{me}")
    self.exchanges += 1
    return values


def check_steps_agree(agreement: Agreement, settings: dict[str, Any],
                      timeout_s: float = PEER_TIMEOUT_S) -> None:
  """Raises StepMismatchError, in every process, if the processes' steps
  differ in one of `settings` (name -> JSON value): a step compiled
  differently in two processes would wait in different collectives."""
  values = agreement.exchange(settings, about="its settings",
                              timeout_s=timeout_s)
  differences = _differences(dict(enumerate(values)))
  if differences:
    listed = differences[:_MAX_LISTED]
    if len(differences) > len(listed):
      listed.append(f"... and {len(differences) - len(listed)} more")
    raise errors.StepMismatchError(
        f"{agreement.what} differs between the {agreement.count} processes "
        f"(process {agreement.process} here); give every process the same "
        "step settings and placements:\n  " + "\n  ".join(listed))


_tied = threading.Lock()
_watching = False


def tie_processes(poll_s: float = 1.0) -> None:
  """Makes a multi-process run fail together without ``fail_together``: a
  process whose program ends in an uncaught exception tells its peers and
  exits, and a peer's failure stops this process (see fail_together).
  Once per process; nothing in a single-process run."""
  global _watching  # pylint: disable=global-statement
  client = _client()
  if client is None:
    return
  with _tied:
    if _watching:
      return
    _watching = True
  import jax  # pylint: disable=g-import-not-at-top
  me, count = jax.process_index(), jax.process_count()
  threading.Thread(target=_watch_peers,
                   args=(client, me, count, threading.Event(), poll_s),
                   name="jcxl-peer-watch", daemon=True).start()
  previous = sys.excepthook

  def hook(kind, value, tb):
    previous(kind, value, tb)
    _tell_peers_and_exit(client, me, count, f"{kind.__name__}: {value}")
  sys.excepthook = hook


@contextlib.contextmanager
def fail_together(poll_s: float = 1.0) -> Iterator[None]:
  """Ties the processes of a multi-process run: if the body raises, this
  process prints the error, tells its peers and exits at once (status 1);
  if a peer says it failed, this process prints which and why, and exits
  within about `poll_s`, even while waiting in a collective. Open pools are
  closed first. Outside a multi-process run it does nothing. (jcxl ties
  the processes so anyway once they share a pool check or a step, see
  tie_processes; this makes it explicit, and covers what runs before.)

  Example:
    >>> jax.distributed.initialize(...)
    >>> with fail_together():
    ...   train()
  """
  client = _client()
  if client is None:
    yield
    return
  import jax  # pylint: disable=g-import-not-at-top
  me, count = jax.process_index(), jax.process_count()
  tie_processes(poll_s)  # the peers' watch (for the process's lifetime)
  try:
    yield
  except SystemExit as e:
    if e.code in (None, 0):
      raise
    _tell_peers_and_exit(client, me, count, f"exited with status {e.code}")
  except BaseException as e:  # pylint: disable=broad-except
    traceback.print_exc()
    _tell_peers_and_exit(client, me, count, f"{type(e).__name__}: {e}")


def _tell_peers_and_exit(client: Any, me: int, count: int, why: str) -> None:
  _stop(client, me, count, f"{_FAILED_PREFIX}{me}", why[:4000],
        f"jcxl: process {me} of {count} failed ({why}); its peers stop too")


def _publish(client: Any, key: str, value: str) -> None:
  try:
    client.key_value_set(key, value)
  except Exception:  # pylint: disable=broad-except
    pass  # the service is gone: the peers' heartbeats will notice


def _wait_for_peers(client: Any, me: int, count: int) -> None:
  """In process 0: until every process failed or stopped (at most
  LEAD_GRACE_S), so that each prints its own error before the service
  goes."""
  if me != 0:
    return
  deadline = time.monotonic() + LEAD_GRACE_S
  while time.monotonic() < deadline:
    try:
      ended = {key.rsplit("/", 1)[-1]
               for prefix in (_FAILED_PREFIX, _STOPPED_PREFIX)
               for key, _ in client.key_value_dir_get(prefix)}
    except Exception:  # pylint: disable=broad-except
      return
    if len(ended) >= count:
      return
    time.sleep(0.1)


def _watch_peers(client: Any, me: int, count: int, stop: threading.Event,
                 poll_s: float) -> None:
  while not stop.wait(poll_s):
    try:
      failed = client.key_value_dir_get(_FAILED_PREFIX)
    except Exception:  # pylint: disable=broad-except
      return  # the service is gone: JAX's own error polling stops us
    for key, why in failed:
      process = key.rsplit("/", 1)[-1]
      if process != str(me):
        _stop(client, me, count, f"{_STOPPED_PREFIX}{me}", "stopped",
              f"jcxl: process {process} of {count} failed ({why}); "
              f"stopping process {me} as well")


def _stop(client: Any, me: int, count: int, key: str, value: str,
          message: str) -> None:
  """Closes the open pools (their nvme files go), says why, tells the peers
  (`key`), and exits without JAX's shutdown barrier, which would wait for
  the failed peer. The peers learn of it only once this process has said
  its piece: process 0's exit aborts them."""
  for pool in registry.open_pools():
    with contextlib.suppress(Exception):
      pool.close()
  print(message, file=sys.stderr, flush=True)
  sys.stdout.flush()
  _publish(client, key, value)
  _wait_for_peers(client, me, count)
  os._exit(1)
