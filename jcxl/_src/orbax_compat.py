"""Every use of Orbax internals goes through this module.

jcxl writes checkpoints with Orbax's own code, so that Orbax alone restores
them, but feeds it a few arrays at a time from the pool. The pieces that take
host shards instead of a ``jax.Array`` are not in Orbax's public API and
move between releases: this is the one place to adapt (written against
orbax-checkpoint 0.12).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from orbax.checkpoint import type_handlers
from orbax.checkpoint._src.metadata import array_metadata
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.multihost import multihost
from orbax.checkpoint._src.path import atomicity_types
from orbax.checkpoint._src.serialization import jax_array_handlers
from orbax.checkpoint._src.serialization import replica_slices

# The suffix of the directory Orbax writes a checkpoint into before it
# renames it to its final name.
TMP_DIR_SUFFIX = atomicity_types.TMP_DIR_SUFFIX
RANDOM_KEY_IMPL = array_metadata.RANDOM_KEY_IMPL


def array_metadata_store_instance() -> Any:
  """The store of per-array metadata (write shapes) Orbax's handler uses."""
  return array_metadata_store.Store()


async def write_shardings(shardings: Sequence[jax.sharding.Sharding],
                          infos: Sequence[type_handlers.ParamInfo]) -> None:
  """Writes the arrays' shardings into the checkpoint's ``_sharding`` file."""
  # pylint: disable-next=protected-access
  await jax_array_handlers._async_serialize_shardings(
      shardings=shardings, infos=infos, primary_host=0)


@dataclasses.dataclass(frozen=True)
class HostArray:
  """One array as this process's host shards ``(index, data)``."""
  shards: Sequence[tuple[Any, np.ndarray]]
  global_shape: tuple[int, ...]
  sharding: jax.sharding.Sharding
  dtype: np.dtype
  ext_metadata: dict[str, Any] | None = None


async def write_host_arrays(arrays: Sequence[HostArray],
                            infos: Sequence[type_handlers.ParamInfo],
                            args: Sequence[type_handlers.SaveArgs]
                            ) -> list[Any]:
  """Writes arrays given as host shards exactly as Orbax's ArrayHandler
  writes ``jax.Array``s; returns their array metadata (for
  ``write_array_metadatas``).

  With OCDBT the arrays are one transaction, committed before this
  returns: their shards may be dropped afterwards.
  """
  slices = [replica_slices.ReplicaSlices(
      global_shape=tuple(a.global_shape),
      local_shape=tuple(a.sharding.shard_shape(tuple(a.global_shape))),
      sharding=a.sharding, dtype=np.dtype(a.dtype), is_on_host=True,
      replica_slices=[replica_slices.ReplicaSlice(
          index=index, unsliced_data=data, slice_args=None)
                      for index, data in a.shards]) for a in arrays]
  ext = {info.name: a.ext_metadata for a, info in zip(arrays, infos)
         if a.ext_metadata}
  # pylint: disable-next=protected-access
  return list(await jax_array_handlers._async_serialize_replica_slices(
      slices, list(infos), list(args), primary_host=0, metadata_key=None,
      array_metadata_store=None,
      enable_replica_parallel_separate_folder=False,
      use_replica_parallel=False, ext_metadata=ext))


async def write_array_metadatas(store: Any, directory: Any,
                                metadatas: Sequence[Any]) -> None:
  """Records the arrays' metadata for this process (once per save)."""
  await store.write(checkpoint_dir=directory, array_metadatas=metadatas,
                    process_index=multihost.process_index())
