"""Per-shard checksums of jcxl checkpoints: recorded as a save streams its
arrays, checked before a restore writes anything.

Orbax's zarr (v2) arrays carry no checksum, so a flipped byte in a data file
restores as a wrong value. A jcxl save records the CRC-32 of every shard it
writes (arrays, numpy arrays, scalars), computed from the host copy it
already holds, in ``jcxl_checksums.process_<i>.json`` inside the checkpoint
(written before the checkpoint is renamed into place, so a finished
checkpoint has them). ``verify`` reads every recorded shard back, a group of
at most ``group_limit`` bytes at a time, and raises
``CheckpointCorruptError`` naming the array and the file on the first
mismatch or read failure. Values are hashed in native byte order.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import re
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from jcxl._src import errors
from jcxl._src import validation

ALGORITHM = "crc32"
_FILE_PREFIX = "jcxl_checksums.process_"

# Arrays are written (and checked) in groups of up to max(largest array,
# GROUP_BYTES) bytes: no group holds more than that in host memory.
GROUP_BYTES = 8 << 20


def groups(sizes: Sequence[int]) -> list[list[int]]:
  """Consecutive indices of `sizes`, in groups of at most max(largest size,
  GROUP_BYTES) bytes."""
  limit = max([GROUP_BYTES, *sizes])
  out, size = [[]], 0
  for i, nbytes in enumerate(sizes):
    if out[-1] and size + nbytes > limit:
      out.append([])
      size = 0
    out[-1].append(i)
    size += nbytes
  return out


def checksum(data: Any) -> int:
  """CRC-32 of `data`'s values, in native byte order and C order."""
  array = np.ascontiguousarray(validation.as_native(np.asarray(data)))
  return zlib.crc32(array.reshape(-1).view(np.uint8))


def index_key(index: Sequence[slice], shape: Sequence[int]) -> str:
  """'0:4,8:16' for the region `index` of an array of `shape`."""
  return ",".join("{}:{}".format(*s.indices(d)[:2])
                  for s, d in zip(index, shape))


def _region(key: str) -> tuple[slice, ...]:
  if not key:
    return ()
  return tuple(slice(*map(int, part.split(":"))) for part in key.split(","))


class Recorder:
  """The checksums one save computes, by Orbax parameter name and shard."""

  def __init__(self):
    self._sums: dict[str, dict[str, int]] = {}

  def add(self, name: str, shape: Sequence[int], index: Sequence[slice],
          data: Any) -> None:
    self._sums.setdefault(name, {})[index_key(index, shape)] = checksum(data)

  def add_whole(self, name: str, value: Any) -> None:
    value = np.asarray(value)
    self.add(name, value.shape, (slice(None),) * value.ndim, value)

  def write(self, directory: Any, process: int) -> None:
    """Writes every checksum so far into the (unfinished) checkpoint."""
    path = os.path.join(os.fspath(directory), f"{_FILE_PREFIX}{process}.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      json.dump({"algorithm": ALGORITHM, "shards": self._sums}, f)
    os.replace(path + ".tmp", path)


def has_files(path: str) -> bool:
  """Whether the checkpoint at `path` holds any checksum file."""
  return bool(glob.glob(os.path.join(glob.escape(path),
                                     f"{_FILE_PREFIX}*.json")))


def load(path: str) -> dict[str, dict[str, int]]:
  """Every process's recorded checksums in the checkpoint at `path`."""
  sums: dict[str, dict[str, int]] = {}
  files = sorted(glob.glob(os.path.join(glob.escape(path),
                                        f"{_FILE_PREFIX}*.json")))
  if not files:
    raise errors.CheckpointCorruptError(
        f"checkpoint {path!r} was saved with checksums, but its "
        f"{_FILE_PREFIX}*.json files are gone")
  for file in files:
    try:
      with open(file, encoding="utf-8") as f:
        data = json.load(f)
      if data.get("algorithm") != ALGORITHM:
        raise ValueError(f"unknown algorithm {data.get('algorithm')!r}")
      for name, shards in data["shards"].items():
        sums.setdefault(name, {}).update(
            {k: int(v) for k, v in shards.items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
      raise errors.CheckpointCorruptError(
          f"checkpoint {path!r}: its checksum file {file!r} cannot be read "
          f"({e})") from None
  return sums


def verify(path: str, sums: dict[str, dict[str, int]], names: Sequence[str],
           itemsizes: dict[str, int]) -> None:
  """Reads every shard of `sums` back and checks it; `names` must all have
  checksums.

  Raises:
    CheckpointCorruptError: a shard's checksum differs, a shard cannot be
      read, or an array of `names` has no checksum.
  """
  for name in names:
    if name not in sums:
      raise errors.CheckpointCorruptError(
          f"checkpoint {path!r}: array {name!r} has no checksum in its "
          f"{_FILE_PREFIX}*.json files; the checkpoint was altered")
  jobs = [(name, key) for name, shards in sorted(sums.items())
          for key in shards]
  sizes = [_region_bytes(key, itemsizes.get(name, 8)) for name, key in jobs]
  asyncio.run(_verify_groups(path, sums, jobs, groups(sizes)))


def _region_bytes(key: str, itemsize: int) -> int:
  return int(np.prod([s.stop - s.start for s in _region(key)],
                     dtype=np.int64)) * itemsize


async def _verify_groups(path: str, sums: dict[str, dict[str, int]],
                         jobs: list[tuple[str, str]],
                         job_groups: list[list[int]]) -> None:
  stores: dict[str, Any] = {}
  for group in job_groups:
    await asyncio.gather(*(_verify_shard(path, stores, *jobs[i], sums)
                           for i in group))


async def _verify_shard(path: str, stores: dict[str, Any], name: str,
                        key: str, sums: dict[str, dict[str, int]]) -> None:
  try:
    if name not in stores:
      stores[name] = ts.open(_spec(path, name), open=True, read=True)
    store = await stores[name]
    data = await store[_region(key)].read()
  except Exception as e:  # tensorstore raises ValueError and others
    raise errors.CheckpointCorruptError(
        f"checkpoint {path!r}: array {name!r} cannot be read{_files(path, name)}"
        f" (a data file is missing, cut short or changed): {e}") from None
  got = checksum(data)
  if got != sums[name][key]:
    raise errors.CheckpointCorruptError(
        f"checkpoint {path!r}: array {name!r} is corrupt: region [{key}] "
        f"has {ALGORITHM} {got:08x}, but the save wrote {sums[name][key]:08x}"
        f"{_files(path, name)}; nothing was restored")


def _spec(path: str, name: str) -> dict[str, Any]:
  """A jcxl checkpoint's array: zarr v2 inside the checkpoint's OCDBT."""
  return {"driver": "zarr",
          "kvstore": {"driver": "ocdbt", "base": f"file://{path}/",
                      "path": f"{name}/"}}


def _files(path: str, name: str) -> str:
  """', in file(s) X' for the files holding `name`'s chunks, or ''."""
  try:
    files = sorted(_chunk_files(path, name))
  except Exception:  # the index itself unreadable: say what we can
    return f", in {path}/ (its OCDBT index cannot be read)"
  return f", in {', '.join(files)}" if files else ""


_LOCATION = re.compile(r"^(?:btreenode|value):([^:]*):([^:]+):\d+:\d+$")
# Any reference in an OCDBT manifest or B-tree node: kind, the directory
# (relative to the checkpoint), the file in it, offset and length.
_REFERENCE = re.compile(
    r"^(?:btreenode|value|versionnode):([^:]*):([^:]+):(\d+):(\d+)$")


def missing_data(path: str) -> str | None:
  """Why the checkpoint's data files do not hold what its index says, or
  None.

  Cheap: reads the OCDBT manifest and B-tree nodes (a few KiB), never the
  arrays. Every file they point into must exist and reach the end of each
  region pointed at: a data file deleted or cut short (to 0 bytes by a
  full disk, say) is found without reading it. A checkpoint without OCDBT
  (Orbax's ``use_ocdbt=False``) is not checked.
  """
  if not (os.path.exists(os.path.join(path, "manifest.ocdbt")) or
          glob.glob(os.path.join(glob.escape(path), "ocdbt.process_*"))):
    return None
  try:
    needed = _referenced_sizes(path)
  except Exception as e:  # tensorstore raises ValueError and others
    return f"its OCDBT index cannot be read ({e})"
  for file, size in sorted(needed.items()):
    try:
      have = os.stat(file).st_size
    except OSError as e:
      return f"data file {file} cannot be read ({e.strerror})"
    if have < size:
      return (f"data file {file} holds {have} bytes, but the checkpoint's "
              f"index points at bytes up to {size}")
  return None


def _referenced_sizes(path: str) -> dict[str, int]:
  """Each file the newest OCDBT version points into: the end of the last
  region pointed at in it."""
  base = ts.KvStore.open({"driver": "file", "path": path + "/"}).result()
  versions = ts.ocdbt.dump(base).result()["versions"]
  if not versions:
    raise ValueError("the manifest holds no version")
  needed: dict[str, int] = {}

  def note(location: str) -> None:
    match = _REFERENCE.match(location)
    if match is None:
      raise ValueError(f"unknown location {location!r}")
    file = os.path.join(path, match.group(1) + match.group(2))
    end = int(match.group(3)) + int(match.group(4))
    needed[file] = max(needed.get(file, 0), end)

  pending = [versions[-1]["root"]["location"]]
  while pending:
    location = pending.pop()
    note(location)
    for entry in ts.ocdbt.dump(base, location).result().get("entries", []):
      if "location" in entry:  # a child node
        pending.append(entry["location"])
      elif "indirect_value" in entry:  # a value in a data file
        note(entry["indirect_value"])
  return needed


def _chunk_files(path: str, name: str) -> set[str]:
  """The data files of `name`'s chunks, from the OCDBT B-tree."""
  base = ts.KvStore.open(f"file://{path}/").result()
  manifest = ts.ocdbt.dump(base).result()
  root = manifest["versions"][-1]["root"]["location"]
  files, prefix = set(), f"{name}/".encode()
  pending = [root]
  while pending:
    location = pending.pop()
    node = ts.ocdbt.dump(base, location).result()
    for entry in node.get("entries", []):
      key = entry.get("key", b"")
      key = key if isinstance(key, bytes) else str(key).encode()
      if "location" in entry or "node" in entry:
        pending.append(entry.get("location") or entry["node"])
      elif key.startswith(prefix) and not key[len(prefix):].startswith(b"."):
        # a chunk (not the array's .zarray metadata)
        where = entry.get("indirect_value") or location
        match = _LOCATION.match(where)
        if match:
          files.add(os.path.join(path, match.group(1) + match.group(2)))
  return files
