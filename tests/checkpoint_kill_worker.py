"""The process checkpoint_test's kill test SIGKILLs in the middle of a save.

  python tests/checkpoint_kill_worker.py POINT SOURCE TARGET

It waits for the checkpoint SOURCE to be complete (it is started early, so
that its imports overlap the run that writes SOURCE), loads it into a pool
and saves it again at TARGET, killing itself at POINT of that save (it
prints "killed at POINT" first). Only jax, jcxl and Orbax are imported.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import jax

POINTS = ("after_first_arrays", "after_all_arrays", "in_finalize",
          "after_rename")
WAIT_S = 600


def kill_at(point: str, target: str) -> None:
  """Makes this process SIGKILL itself at `point` of the save of `target`."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jcxl._src import checkpoint_checksums  # pylint: disable=g-import-not-at-top
  from jcxl._src import orbax_compat  # pylint: disable=g-import-not-at-top

  def die():
    print(f"killed at {point}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

  def after(name: str) -> None:
    original = getattr(orbax_compat, name)

    async def wrapper(*args, **kwargs):
      result = await original(*args, **kwargs)
      die()
      return result
    setattr(orbax_compat, name, wrapper)

  if point == "after_first_arrays":  # some arrays written, not all
    checkpoint_checksums.GROUP_BYTES = 1
    after("write_host_arrays")
  elif point == "after_all_arrays":  # arrays written, no _METADATA yet
    after("write_array_metadatas")
  elif point == "in_finalize":  # Orbax merging its files, before the rename
    ocp.PyTreeCheckpointHandler.finalize = lambda self, directory: die()
  elif point == "after_rename":  # the checkpoint is complete
    rename = os.rename

    def wrapper(src, dst, *args, **kwargs):
      rename(src, dst, *args, **kwargs)
      if os.fspath(dst) == target:
        die()
    os.rename = wrapper
  else:
    raise ValueError(f"POINT must be one of {POINTS}, got {point!r}")


def main(point: str, source: str, target: str) -> None:
  jax.config.update("jax_num_cpu_devices", 8)
  import jcxl  # pylint: disable=g-import-not-at-top
  deadline = time.monotonic() + WAIT_S
  while not jcxl.checkpoint.is_complete(source):
    if time.monotonic() > deadline:
      sys.exit(f"no checkpoint at {source} after {WAIT_S} s")
    time.sleep(0.05)
  with jcxl.Pool(host="8MiB", cxl="64MiB") as pool:
    # Without a like= tree: dicts and lists, each leaf in its saved tier
    # with its saved sharding.
    state = jcxl.checkpoint.restore(source, pool=pool)
    kill_at(point, target)
    jcxl.checkpoint.save(target, state)
  print("not killed", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
