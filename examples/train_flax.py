r"""Train your own Flax model with its state in a jcxl pool.

The parameters and the optimizer state live in a tier of a ``jcxl.Pool``
(``cxl``: emulated on DRAM behind a link model where the machine has no CXL
memory; ``host``; or ``nvme``). ``jcxl.cxl_offload`` rewrites the train step
so that each layer's state is fetched just before the layer runs and written
back right after its update, under a device memory budget smaller than the
state. Copy this file and replace ``Model`` and ``batches`` with your own;
the train step is the plain optax one.

  python examples/train_flax.py --steps=200 --tier=cxl --device_budget=8MiB
  python examples/train_flax.py --steps=200 --noffload   # plain jax.jit

Both print the same losses: the offloaded step computes what the resident
one does.
"""

from collections.abc import Iterator

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jcxl

_STEPS = flags.DEFINE_integer("steps", 200, "Training steps.")
_BATCH = flags.DEFINE_integer("batch", 64, "Examples per step.")
_WIDTH = flags.DEFINE_integer("width", 512, "Width of the hidden layers.")
_LAYERS = flags.DEFINE_integer("layers", 4, "Hidden layers.")
_OFFLOAD = flags.DEFINE_boolean(
    "offload", True, "State in the pool, step rewritten by cxl_offload; "
    "--nooffload: plain jax.jit with everything on the device.")
_TIER = flags.DEFINE_enum("tier", "cxl", ["cxl", "host", "nvme"],
                          "Pool tier holding the state.")
_DEVICE_BUDGET = flags.DEFINE_string(
    "device_budget", "8MiB", "Device memory the offloaded step may use.")
_SCHEDULE = flags.DEFINE_string(
    "schedule", "fixed:1", "How far ahead layers are fetched: 'fixed:k', "
    "'sync' or 'dap' (planned from a cost model, tuned as it runs).")
_LOG_EVERY = flags.DEFINE_integer("log_every", 20, "Steps between losses.")


class Model(nnx.Module):
  """An MLP regressor: each hidden layer is one streamed unit (a module's
  parameters are fetched together)."""

  def __init__(self, width: int, layers: int, *, rngs: nnx.Rngs):
    self.inp = nnx.Linear(16, width, rngs=rngs)
    for i in range(layers):
      setattr(self, f"hidden_{i}", nnx.Linear(width, width, rngs=rngs))
    self.out = nnx.Linear(width, 1, rngs=rngs)
    self.layers = layers

  def __call__(self, x: jax.Array) -> jax.Array:
    x = jax.nn.relu(self.inp(x))
    for i in range(self.layers):
      x = jax.nn.relu(getattr(self, f"hidden_{i}")(x))
    return self.out(x)[:, 0]


def batches(batch: int, seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
  """A synthetic task: y = tanh(x . w / 4) for a fixed random w; `seed`
  draws the inputs (another seed: held-out data of the same task)."""
  w = np.random.default_rng(1234).normal(size=16).astype(np.float32)
  rng = np.random.default_rng(seed)
  while True:
    x = rng.normal(size=(batch, 16)).astype(np.float32)
    yield {"x": x, "y": np.tanh(x @ w / 4)}


def main(argv):
  del argv
  # A pure function of (params, batch): what cxl_offload traces.
  graphdef, params = nnx.split(
      Model(_WIDTH.value, _LAYERS.value, rngs=nnx.Rngs(0)), nnx.Param)
  params = nnx.to_pure_dict(params)

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, nnx.State(params))
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

  tx = optax.adamw(1e-3)

  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = tx.init(params)
  held_out = next(batches(256, seed=1))
  print(f"held-out loss {float(loss_fn(params, held_out)):.6f} (untrained)")
  state_bytes = sum(x.nbytes for x in jax.tree.leaves((params, opt_state)))
  fmt = jcxl.units.format_bytes
  print(f"params + adamw state: {fmt(state_bytes)}")

  # One tier holds the state (with room for the allocator's alignment).
  sizes = {"host": 0, "cxl": 0, "nvme": 0,
           _TIER.value: 2 * state_bytes + (16 << 20)}
  with jcxl.Pool(**sizes) as pool:
    if _OFFLOAD.value:
      # Place the state in the pool (it is written there now; the device
      # copies can go) and rewrite the step to stream it.
      params = jcxl.place(params, _TIER.value, pool=pool)
      opt_state = jcxl.place(opt_state, _TIER.value, pool=pool)
      step = jcxl.cxl_offload(train_step, device_budget=_DEVICE_BUDGET.value,
                              schedule=_SCHEDULE.value)
      print(f"state in {pool.stats()[_TIER.value].label()}; device budget "
            f"{_DEVICE_BUDGET.value}")
    else:
      step = jax.jit(train_step, donate_argnums=(0, 1))
      print("state on the device (plain jax.jit)")

    data = batches(_BATCH.value)
    for i in range(1, _STEPS.value + 1):
      params, opt_state, loss = step(params, opt_state, next(data))
      if i % _LOG_EVERY.value == 0 or i == 1:
        print(f"step {i:5d}  loss {float(loss):.6f}", flush=True)

    if _OFFLOAD.value:
      print(step.plan)  # per layer: its tier, how far ahead it streams
      moved = step.report()  # per layer, since the last report
      need = step.device_need(params, opt_state, next(data))
      print(f"streamed {fmt(sum(r.bytes_fetched for r in moved))} in, "
            f"{fmt(sum(r.bytes_stored for r in moved))} out; the step "
            f"needs {fmt(need)} of device memory")
      params = jcxl.gather(params)  # device arrays again
    print(f"held-out loss {float(loss_fn(params, held_out)):.6f} (trained)")


if __name__ == "__main__":
  app.run(main)
