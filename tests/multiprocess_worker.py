"""One process of a two-process run (driven by multiprocess_test): arrays
built from process-local data are placed into this process's pool, summed
by an offloaded step over all 8 devices, and gathered back.

  python tests/multiprocess_worker.py ADDRESS PROCESS_ID OUT_JSON
"""

import json
import sys

import jax

ROWS = 12  # per process: 3 rows per device


def local_rows(process: int) -> "np.ndarray":
  import numpy as np  # pylint: disable=g-import-not-at-top
  return (np.arange(ROWS * 16, dtype=np.float32).reshape(ROWS, 16)
          + 1000 * process)


def main(address: str, process: int, out: str) -> None:
  jax.config.update("jax_num_cpu_devices", 4)
  jax.distributed.initialize(address, 2, process, heartbeat_timeout_seconds=10)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jcxl  # pylint: disable=g-import-not-at-top
  from jcxl._src import distributed  # pylint: disable=g-import-not-at-top

  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
  rows = jax.sharding.NamedSharding(mesh, P("fsdp", None))
  replicated = jax.sharding.NamedSharding(mesh, P())
  mine = local_rows(process)
  tree = {"w": jax.make_array_from_process_local_data(rows, mine),
          "b": jax.make_array_from_process_local_data(
              replicated, np.full((8,), 2.0, np.float32))}
  with distributed.fail_together(), jcxl.Pool(host="4MiB",
                                               cxl="16MiB") as pool:
    placed = jcxl.place(tree, "cxl", pool=pool)
    stats = pool.stats()["cxl"]
    step = jcxl.cxl_offload(
        lambda p: (p, jnp.sum(p["w"]) + jnp.sum(p["b"])))
    _, total = step(placed)
    back = jcxl.gather(placed)
    shards = sorted(back["w"].addressable_shards,
                    key=lambda s: s.index[0].start)
    result = {
        "global_shape": list(back["w"].shape),
        "local_equal": bool(np.array_equal(
            np.concatenate([np.asarray(s.data) for s in shards]), mine)),
        "b_equal": all(np.array_equal(np.asarray(s.data), np.full(8, 2.0))
                       for s in back["b"].addressable_shards),
        "total": float(total),
        "live_bytes": stats.live, "objects": stats.objects,
        "handles": len(pool.handles()),
    }
  with open(out, "w", encoding="utf-8") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
