"""experiments.train's runners: the state and the steps of a run, resident
(plain jax.jit, the baseline) or offloaded (the state in a pool tier, the
steps rewritten by jcxl.cxl_offload); both train, evaluate, report their
transfers and save or load their state alike."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from absl import app
import jax
import numpy as np
import optax

import jcxl
from experiments import cluster
from experiments import common as experiments_common
from experiments.train.config import Config
from experiments.train.config import TIERS
from jcxl.planning import device_need
from jcxl.units import format_bytes
from models import common
from models import gpt2

# Room for the allocator's alignment around many small objects.
_POOL_SLACK = 32 << 20


def learning_rate(config: Config) -> optax.Schedule:
  """Linear warmup to --learning_rate, then cosine decay to a tenth of it."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate,
      warmup_steps=config.warmup_steps, decay_steps=config.steps,
      end_value=config.learning_rate / 10)


def make_optimizer(config: Config) -> optax.GradientTransformation:
  """adamw on the warmup-cosine schedule (its step count lives in the
  optimizer state, in the pool with the rest)."""
  return optax.adamw(learning_rate(config), b1=0.9, b2=0.95,
                     weight_decay=0.01)


def delete(tree: Any) -> None:
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      leaf.delete()

class Resident:
  """Plain jax.jit, state donated and kept on the device."""

  label = "device (resident baseline: no pool, nothing streamed)"

  def __init__(self, compiled: Any, params: Any, opt_state: Any,
               loss_fn: Callable):
    self._compiled = compiled
    self._params, self._opt_state = params, opt_state
    self._loss = jax.jit(loss_fn)

  def train(self, batch: dict) -> jax.Array:
    self._params, self._opt_state, loss = self._compiled(
        self._params, self._opt_state, batch)
    return loss

  def drain(self) -> list[Any]:
    return []

  def evaluate(self, batches: Sequence[dict]) -> tuple[float, list[Any]]:
    losses = [self._loss(self._params, b) for b in batches]
    return float(np.mean([float(l) for l in losses])), []

  def plan(self) -> tuple[str, dict[str, Any]]:
    text = "resident mode: every leaf stays on the device; nothing streamed"
    return text, {"mode": "resident", "layers": []}

  def state(self) -> dict[str, Any]:
    return {"params": self._params, "opt_state": self._opt_state}

  def load(self, path: str, like: dict[str, Any]) -> dict[str, Any]:
    restored = jcxl.checkpoint.restore(path, like)
    delete(self.state())
    self._params, self._opt_state = restored["params"], restored["opt_state"]
    return restored


class Offloaded:
  """State in a pool tier; train and eval steps rewritten by cxl_offload."""

  def __init__(self, config: Config, pool: jcxl.Pool, params: Any,
               opt_state: Any, loss_fn: Callable,
               tx: optax.GradientTransformation):
    self.label = pool.stats()[config.tier].label()
    self._budget_flag = f"--device_budget {format_bytes(config.device_budget)}"
    self._params = jcxl.place(params, config.tier, pool=pool)
    self._opt_state = jcxl.place(opt_state, config.tier, pool=pool)
    offload = jcxl.cxl_offload(device_budget=config.device_budget,
                               schedule=config.schedule)
    self.step = offload(experiments_common.make_train_step(loss_fn, tx))

    def eval_step(params, batch):
      return params, loss_fn(params, batch)  # unchanged: nothing stored

    self.eval_step = offload(eval_step)
    self.need: int | None = None
    self.eval_need: int | None = None

  @contextlib.contextmanager
  def _budget(self):
    try:
      yield
    except jcxl.PoolExhaustedError:
      raise
    except MemoryError as e:
      raise app.UsageError(f"{self._budget_flag} is too small: {e}") from e

  def train(self, batch: dict) -> jax.Array:
    with self._budget():
      self._params, self._opt_state, loss = self.step(
          self._params, self._opt_state, batch)
    if self.need is None:
      self.need = device_need(self.step.memory_analysis(
          self._params, self._opt_state, batch))
    return loss

  def drain(self) -> list[Any]:
    return self.step.report()

  def evaluate(self, batches: Sequence[dict]) -> tuple[float, list[Any]]:
    losses = []
    for batch in batches:
      with self._budget():
        _, loss = self.eval_step(self._params, batch)
      losses.append(loss)
    if self.eval_need is None:
      self.eval_need = device_need(self.eval_step.memory_analysis(
          self._params, batches[0]))
    value = float(np.mean([float(l) for l in losses]))
    # Drains the eval fetches, so that the train step's next report holds
    # only its own (both steps stream the same objects).
    return value, self.eval_step.report()

  def plan(self) -> tuple[str, dict[str, Any]]:
    plan = self.step.plan
    return str(plan), dataclasses.asdict(plan)

  def state(self) -> dict[str, Any]:
    return {"params": self._params, "opt_state": self._opt_state}

  def load(self, path: str, like: dict[str, Any]) -> dict[str, Any]:
    # In place: the PoolArrays keep their objects, so the steps compiled
    # for them stay valid and the pool needs no room for a second copy.
    return jcxl.checkpoint.restore_into(path, like)


def pool_for(config: Config, state_bytes: int) -> jcxl.Pool:
  capacity = int(state_bytes * 1.25) + _POOL_SLACK
  sizes = {tier: capacity if tier == config.tier else 0 for tier in TIERS}
  return jcxl.Pool(host=sizes["host"], cxl=sizes["cxl"], nvme=sizes["nvme"],
                   nvme_dir=config.nvme_dir or config.run_dir,
                   cxl_link=config.link)


def init_state(model: gpt2.GPT2Config, tx: optax.GradientTransformation,
                seed: int, mesh: jax.sharding.Mesh | None) -> tuple[Any, Any]:
  """The initial params and adamw state: on the one device, or made
  sharded (FSDP over `mesh`), each process computing only its shards."""
  init = lambda: common.init_params(model, seed=seed)
  if mesh is None:
    params = init()
    return params, tx.init(params)
  abstract = jax.eval_shape(init)
  params = jax.jit(init, out_shardings=cluster.fsdp_shardings(
      mesh, abstract))()
  opt_shardings = cluster.fsdp_shardings(mesh, jax.eval_shape(tx.init,
                                                              abstract))
  return params, jax.jit(tx.init, out_shardings=opt_shardings)(params)


def batch_placer(mesh: jax.sharding.Mesh | None, batch_size: int
                  ) -> Callable[[dict], dict]:
  """Turns a batch of host arrays into the step's input: as is for one
  device, else global arrays sharded by rows."""
  if mesh is None:
    return lambda batch: batch
  sharding = cluster.batch_sharding(mesh, batch_size)
  return lambda batch: cluster.global_batch(batch, sharding)
