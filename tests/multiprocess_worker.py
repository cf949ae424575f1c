"""One process of a two-process run (driven by multiprocess_test).

  python tests/multiprocess_worker.py ADDRESS PROCESS_ID OUT_JSON [OPTIONS]

Without OPTIONS: arrays built from process-local data are placed into this
process's pool, summed by an offloaded step over all 8 devices, and
gathered back. With OPTIONS (JSON, see TrainOptions): a small MLP trained
with adam by an offloaded step, its state FSDP-sharded over every device of
both processes; the losses, the plan of each step and the DAP tuner's
history are written to OUT_JSON (or the error the step raised).
"""

import dataclasses
import json
import sys

import jax

ROWS = 12  # per process: 3 rows per device
DIM, LAYERS, BATCH = 16, 4, 8


@dataclasses.dataclass(frozen=True)
class TrainOptions:
  """What `train` runs (each process may be given its own)."""
  devices: int = 1  # per process
  steps: int = 3
  schedule: str = "fixed:1"
  device_budget: str | None = None
  update: str = "device"  # or several, "host,auto": each in turn
  tier: str = "cxl"
  shard: bool = True  # FSDP over every device; False: replicated
  # DAP's tuner made to race and re-plan within a few hundred steps: every
  # check of a settled plan looks off (see tune_hard).
  tune_hard: bool = False
  raise_at: int | None = None  # raise RuntimeError before this step
  # Every this many steps the batch switches between BATCH and BATCH / 2
  # rows (a new call signature, compiled anew); None: always BATCH.
  halve_every: int | None = None


def local_rows(process: int) -> "np.ndarray":
  import numpy as np  # pylint: disable=g-import-not-at-top
  return (np.arange(ROWS * 16, dtype=np.float32).reshape(ROWS, 16)
          + 1000 * process)


def mlp_init():
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  return {f"layer{i}": {
      "w": (rng.normal(size=(DIM, DIM)) * 0.3).astype(np.float32),
      "b": np.zeros(DIM, np.float32)} for i in range(LAYERS)}


def mlp_loss(params, x):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  h = x
  for i in range(LAYERS):
    h = jnp.tanh(h @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"])
  return jnp.mean((h - 0.5) ** 2)


def mlp_batch(step: int, halve_every: int | None = None) -> "np.ndarray":
  import numpy as np  # pylint: disable=g-import-not-at-top
  rows = BATCH // 2 if halve_every and (step // halve_every) % 2 else BATCH
  return np.random.default_rng(1000 + step).normal(
      size=(rows, DIM)).astype(np.float32)


def mlp_step(tx):
  def step(params, opt_state, x):
    loss, grads = jax.value_and_grad(mlp_loss)(params, x)
    updates, opt_state = tx.update(grads, opt_state, params)
    import optax  # pylint: disable=g-import-not-at-top
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def tune_hard(tuner) -> None:
  """Every check of a settled plan counts as a slower link (link_drift
  -1: any link counts as slowed) or a slower step (drift -0.5), confirmed
  at once: the tuner re-plans on each confirmed link drift; races are
  short, so that a few hundred steps see several of each."""
  import jcxl  # pylint: disable=g-import-not-at-top
  tuner.options = jcxl.planning.TunerOptions(
      measure_steps=2, check_every=2, check_every_max=2, confirm_every=1,
      drift=-0.5, link_drift=-1.0, race_rounds=1, race_block=1,
      race_max_rounds=2, max_replans=50, max_tuning_steps=40, explore=(0, 3))


def train(process: int, options: TrainOptions) -> dict:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import jcxl  # pylint: disable=g-import-not-at-top
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
  fsdp = lambda a: jax.sharding.NamedSharding(
      mesh, P(*[None] * (np.ndim(a) - 1), "fsdp")
      if np.ndim(a) and options.shard else P())
  replicated = jax.sharding.NamedSharding(mesh, P())
  tx = optax.adam(1e-2)
  params = mlp_init()
  state = (params, tx.init(params))
  global_state = jax.tree.map(
      lambda a: jax.make_array_from_callback(
          np.shape(a), fsdp(a), lambda i, a=np.asarray(a): a[i]), state)
  if "," in options.update:  # each in turn, from the same state
    return {update: train(process, dataclasses.replace(options,
                                                       update=update))
            for update in options.update.split(",")}
  result = {"losses": [], "plans": []}
  with jcxl.Pool(host="4MiB", cxl="16MiB", nvme="16MiB") as pool:
    params, opt_state = jcxl.place(global_state, options.tier, pool=pool)
    step = jcxl.cxl_offload(mlp_step(tx), schedule=options.schedule,
                            device_budget=options.device_budget,
                            update=options.update)
    if options.tune_hard:
      tune_hard(step.tuner)
    try:
      for i in range(options.steps):
        if options.raise_at == i:
          raise RuntimeError(f"process {process} fails before step {i}")
        batch = mlp_batch(i, options.halve_every)
        x = jax.make_array_from_callback(batch.shape, replicated,
                                         lambda j, b=batch: b[j])
        params, opt_state, loss = step(params, opt_state, x)
        result["losses"].append(float(loss.addressable_data(0)))
        result["plans"].append([l.prefetch for l in step.plan.layers])
    except ValueError as e:  # StepMismatchError is one
      result["error"] = f"{type(e).__name__}: {e}"
    if step.plan is not None:
      result["updates"] = sorted({l.update for l in step.plan.layers})
      result["plan"] = str(step.plan)
    # This process's shards of the trained weights and moments.
    result["state"] = {
        jax.tree_util.keystr(path): np.concatenate(
            [np.asarray(s.data).ravel() for s in leaf.addressable_shards]
        ).tolist()
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            jcxl.gather((params, opt_state)))[0]}
    if step.tuner is not None:
      result["history"] = [[e.step, e.what] for e in step.tuner.history]
      result["versions"] = step.tuner.version
  return result


def main(address: str, process: int, out: str, options: str = "") -> None:
  if options:
    opts = TrainOptions(**json.loads(options))
    jax.config.update("jax_num_cpu_devices", opts.devices)
    jax.distributed.initialize(address, 2, process,
                               heartbeat_timeout_seconds=10)
    result = train(process, opts)
    with open(out, "w", encoding="utf-8") as f:
      json.dump(result, f)
    return
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
  main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
