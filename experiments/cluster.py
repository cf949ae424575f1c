"""Running a program on several processes (hosts) with ``jax.distributed``.

Each process runs the same program on its own devices and its own pool; the
model's state is sharded over every device of every process (FSDP: each
array split along its last axis where the device count divides it) and the
batch over the devices along its first axis.

Where the processes come from:
  --coordinator_address, --num_processes, --process_id (or the environment
  variables JCXL_COORDINATOR_ADDRESS, JCXL_NUM_PROCESSES, JCXL_PROCESS_ID;
  JAX's own JAX_COORDINATOR_ADDRESS works too); --distributed alone lets
  JAX detect the cluster (Slurm, Open MPI, Kubernetes, TPU pods, ...).
A process that stops is noticed by the others after --heartbeat_timeout_s;
one whose program fails tells them at once (``fail_together``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from absl import flags
import jax
import numpy as np

_ENV = {"coordinator_address": "JCXL_COORDINATOR_ADDRESS",
        "num_processes": "JCXL_NUM_PROCESSES",
        "process_id": "JCXL_PROCESS_ID"}


@dataclasses.dataclass(frozen=True)
class Flags:
  """The cluster flags of one program's FlagValues."""
  cpu_devices: flags.FlagHolder
  distributed: flags.FlagHolder
  coordinator_address: flags.FlagHolder
  num_processes: flags.FlagHolder
  process_id: flags.FlagHolder
  heartbeat_timeout_s: flags.FlagHolder


def define_flags(flag_values: flags.FlagValues) -> Flags:
  def env_int(name: str) -> int | None:
    value = os.environ.get(_ENV[name])
    return int(value) if value not in (None, "") else None
  return Flags(
      cpu_devices=flags.DEFINE_integer(
          "cpu_devices", None, "CPU devices this process exposes (JAX's "
          "jax_num_cpu_devices); default JAX's own (1).", lower_bound=1,
          flag_values=flag_values),
      distributed=flags.DEFINE_boolean(
          "distributed", False, "Join a multi-process run, JAX detecting "
          "the cluster where the three flags below are not given (implied "
          "by any of them).", flag_values=flag_values),
      coordinator_address=flags.DEFINE_string(
          "coordinator_address", os.environ.get(_ENV["coordinator_address"]),
          "host:port of process 0's coordination service (env "
          "JCXL_COORDINATOR_ADDRESS).", flag_values=flag_values),
      num_processes=flags.DEFINE_integer(
          "num_processes", env_int("num_processes"), "Processes in the run "
          "(env JCXL_NUM_PROCESSES).", lower_bound=1,
          flag_values=flag_values),
      process_id=flags.DEFINE_integer(
          "process_id", env_int("process_id"), "This process's index, "
          "0 .. num_processes - 1 (env JCXL_PROCESS_ID).", lower_bound=0,
          flag_values=flag_values),
      heartbeat_timeout_s=flags.DEFINE_integer(
          "heartbeat_timeout_s", 30, "A process that stops answering is "
          "declared dead, and the others stop, after this many seconds.",
          lower_bound=1, flag_values=flag_values))


def initialize(f: Flags) -> None:
  """Sets the CPU device count and joins the multi-process run the flags
  describe (if any); before anything starts JAX's backends.

  Raises:
    ValueError: naming the flag whose value is wrong.
  """
  if f.cpu_devices.value is not None:
    jax.config.update("jax_num_cpu_devices", f.cpu_devices.value)
  given = {name: getattr(f, name).value for name in _ENV}
  if not f.distributed.value and all(v is None for v in given.values()):
    return
  count, index = given["num_processes"], given["process_id"]
  if count is not None and index is not None and index >= count:
    raise ValueError(f"--process_id must be less than --num_processes "
                     f"({count}), but got {index}")
  jax.distributed.initialize(
      given["coordinator_address"], count, index,
      heartbeat_timeout_seconds=f.heartbeat_timeout_s.value)


def is_lead() -> bool:
  """Process 0 prints and writes the run's files; the others stay quiet."""
  return jax.process_index() == 0


def describe() -> str:
  return (f"process {jax.process_index()} of {jax.process_count()}, "
          f"{jax.local_device_count()} of {jax.device_count()} devices")


def mesh() -> jax.sharding.Mesh | None:
  """Every device of every process on one 'fsdp' axis; None for one device
  (the state then stays unsharded, as in a single-device run)."""
  if jax.device_count() == 1:
    return None
  return jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))


def fsdp_sharding(mesh: jax.sharding.Mesh, shape: tuple[int, ...]
                  ) -> jax.sharding.NamedSharding:
  """Splits the last axis over the mesh where it divides; else replicates."""
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  if shape and shape[-1] % mesh.size == 0:
    return jax.sharding.NamedSharding(
        mesh, P(*([None] * (len(shape) - 1)), "fsdp"))
  return jax.sharding.NamedSharding(mesh, P())


def fsdp_shardings(mesh: jax.sharding.Mesh, tree: Any) -> Any:
  return jax.tree.map(lambda leaf: fsdp_sharding(mesh, tuple(leaf.shape)),
                      tree)


def batch_sharding(mesh: jax.sharding.Mesh, batch_size: int
                   ) -> jax.sharding.NamedSharding:
  """Rows over the devices where they divide (data parallel); else every
  device computes the whole batch."""
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  spec = P("fsdp") if batch_size % mesh.size == 0 else P()
  return jax.sharding.NamedSharding(mesh, spec)


def global_batch(batch: dict[str, np.ndarray],
                 sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
  """A global array per entry, each process supplying its devices' rows
  (every process draws the same batch from the same seed)."""
  return {k: jax.make_array_from_callback(v.shape, sharding,
                                          lambda index, v=v: v[index])
          for k, v in batch.items()}


def local_bytes(tree: Any) -> int:
  """Bytes of this process's shards of the arrays (and PoolArrays) of
  `tree`: what its pool holds of them."""
  total = 0
  is_pool = lambda x: hasattr(x, "local_handles")
  for leaf in jax.tree.leaves(tree, is_leaf=is_pool):
    sharding = leaf.sharding
    local = [d for d in sharding.device_set
             if d.process_index == jax.process_index()]
    shard = sharding.shard_shape(tuple(leaf.shape))
    total += len(local) * int(np.prod(shard)) * np.dtype(leaf.dtype).itemsize
  return total
