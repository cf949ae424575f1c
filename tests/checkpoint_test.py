"""jcxl.checkpoint: Orbax-format checkpoints of pool-resident state."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import optax
import pytest

import jcxl
from experiments import common as experiments_common
from models import common
from models import data
from models import gpt2

P = jax.sharding.PartitionSpec
NamedSharding = jax.sharding.NamedSharding
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TMP_SUFFIX = ".orbax-checkpoint-tmp"


def mesh_of(devices: int) -> jax.sharding.Mesh:
  return jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("fsdp",))


def single() -> jax.sharding.Sharding:
  return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def is_pool_array(x) -> bool:
  return isinstance(x, jcxl.PoolArray)


def host_value(x):
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key):
    return np.asarray(jax.random.key_data(x))
  return np.asarray(x) if isinstance(x, (jax.Array, np.ndarray)) else x


def values(tree):
  """Every leaf as a host value (PoolArrays read from their pool)."""
  return [host_value(x) for x in jax.tree.leaves(jcxl.gather(tree))]


def assert_bit_equal(got, want):
  got, want = values(got), values(want)
  assert len(got) == len(want)
  for a, b in zip(got, want):
    if isinstance(b, np.ndarray):
      assert a.dtype == b.dtype and a.shape == b.shape
      assert a.tobytes() == b.tobytes()
    else:
      assert type(a) is type(b) and a == b


def mixed_tree(pool, tier):
  """PoolArrays (sharded over 8 devices, replicated, on one device, bf16,
  int, 0-d), a device array, numpy, Python scalars, optax state."""
  rng = np.random.default_rng(0)
  mesh = mesh_of(8)
  place = lambda x, sharding=None: jcxl.place(x, tier, pool=pool,
                                              sharding=sharding)
  weights = {"w": rng.standard_normal((16, 24), dtype=np.float32)}
  return {
      "sharded": place(weights["w"], NamedSharding(mesh, P(None, "fsdp"))),
      "rows": place(rng.standard_normal((32, 4)).astype(ml_dtypes.bfloat16),
                    NamedSharding(mesh, P("fsdp", None))),
      "replicated": place(np.arange(10, dtype=np.int32),
                          NamedSharding(mesh, P())),
      "scalar": place(np.float32(np.pi)),
      "opt": place(optax.adam(0.1).init(weights)),
      "device": jax.device_put(rng.standard_normal(5).astype(np.float32)),
      "numpy": rng.integers(0, 100, 7),
      "key": jax.random.key(3),
      "step": 12,
      "lr": 0.25,
  }


@pytest.fixture
def pool(tmp_path):
  nvme_dir = tmp_path / "nvme"
  nvme_dir.mkdir()
  with jcxl.Pool(host="64MiB", cxl="64MiB", nvme="64MiB",
                 nvme_dir=nvme_dir) as p:
    yield p


class RoundTripTest:

  @pytest.mark.parametrize("tier", ["cxl", "host", "nvme"])
  def test_round_trip_is_bit_exact(self, pool, tmp_path, tier):
    tree = mixed_tree(pool, tier)
    path = jcxl.checkpoint.save(tmp_path / "ckpt", tree)
    got = jcxl.checkpoint.restore(path, like=tree)
    assert jax.tree.structure(got, is_leaf=is_pool_array) == \
        jax.tree.structure(tree, is_leaf=is_pool_array)
    assert_bit_equal(got, tree)
    for new, old in zip(jax.tree.leaves(got, is_leaf=is_pool_array),
                        jax.tree.leaves(tree, is_leaf=is_pool_array)):
      if is_pool_array(old):  # new objects, where the old ones were
        assert is_pool_array(new) and new.tier == old.tier
        assert new.sharding == old.sharding and new.path == old.path
        assert {h for _, h in new.local_handles}.isdisjoint(
            h for _, h in old.local_handles)
    assert len(got["sharded"].local_handles) == 8
    np.testing.assert_array_equal(jax.random.key_data(got["key"]),
                                  jax.random.key_data(tree["key"]))

  def test_restore_without_like_keeps_where_leaves_were(self, pool, tmp_path):
    params = {"w": np.ones((4, 8), np.float32)}
    tree = {"params": jcxl.place(params, "nvme", pool=pool),
            # (adamw's state has empty nodes before its last leaves)
            "opt": jcxl.place(optax.adamw(0.1).init(params), "host",
                              pool=pool),
            "moments": jcxl.place(np.full(8, 2, np.float32), "cxl",
                                  pool=pool),
            "device": jax.device_put(np.arange(3.0)), "step": 7}
    path = jcxl.checkpoint.save(tmp_path / "ckpt", tree, metadata={"a": 1})
    got = jcxl.checkpoint.restore(path, pool=pool)
    assert got["params"]["w"].tier.value == "nvme"
    assert {x.tier.value for x in jax.tree.leaves(
        got["opt"], is_leaf=is_pool_array)} == {"host"}
    assert got["moments"].tier.value == "cxl"
    assert isinstance(got["device"], jax.Array) and got["step"] == 7
    assert_bit_equal(got, tree)
    assert jcxl.checkpoint.read_metadata(path) == {"a": 1}
    plain = jcxl.checkpoint.restore(path)  # no pool: plain arrays
    assert not any(is_pool_array(x) for x in jax.tree.leaves(
        plain, is_leaf=is_pool_array))
    assert_bit_equal(plain, tree)

  def test_orbax_alone_restores_plain_jax_arrays(self, pool, tmp_path):
    tree = mixed_tree(pool, "cxl")
    path = jcxl.checkpoint.save(tmp_path / "ckpt", tree)
    np.savez(tmp_path / "want.npz", sharded=np.asarray(jcxl.gather(
        tree["sharded"])), mu=np.asarray(jcxl.gather(tree["opt"][0].mu["w"])))
    program = f"""
import sys, numpy as np, jax
jax.config.update("jax_num_cpu_devices", 8)
import orbax.checkpoint as ocp
got = ocp.StandardCheckpointer().restore({str(path)!r})
want = np.load({str(tmp_path / "want.npz")!r})
arrays = [x for x in jax.tree.leaves(got) if isinstance(x, jax.Array)]
assert len(arrays) == 9, len(arrays)  # 7 pool leaves, device, key
assert got["sharded"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
assert len(got["sharded"].sharding.device_set) == 8
assert (np.asarray(got["sharded"]) == want["sharded"]).all()
assert (np.asarray(got["opt"][0]["mu"]["w"]) == want["mu"]).all()
assert got["rows"].dtype.name == "bfloat16" and got["step"] == 12
assert not any(m.startswith("jcxl") for m in sys.modules)
print("orbax ok")
"""
    out = subprocess.run([sys.executable, "-c", program], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "orbax ok" in out.stdout

  def test_restore_into_another_tier(self, pool, tmp_path):
    tree = mixed_tree(pool, "cxl")
    path = jcxl.checkpoint.save(tmp_path / "ckpt", tree)
    with jcxl.Pool(host="1MiB", cxl=0, nvme="32MiB",
                   nvme_dir=tmp_path) as nvme_pool:
      got = jcxl.checkpoint.restore(path, like=tree, pool=nvme_pool,
                                    tier="nvme")
      pool_arrays = [x for x in jax.tree.leaves(got, is_leaf=is_pool_array)
                     if is_pool_array(x)]
      assert len(pool_arrays) == 7
      assert all(x.tier.value == "nvme" and x.pool_id == nvme_pool.id
                 for x in pool_arrays)
      assert_bit_equal(got, tree)

  @pytest.mark.parametrize("saved, restored", [(8, 1), (1, 8), (8, 4)])
  def test_restore_onto_another_device_count(self, pool, tmp_path, saved,
                                             restored):
    rng = np.random.default_rng(1)
    values_ = {"w": rng.standard_normal((8, 16), dtype=np.float32),
               "b": rng.standard_normal(16, dtype=np.float32)}
    shard = lambda n: NamedSharding(mesh_of(n), P(None, "fsdp"))
    tree = jcxl.place(values_, "cxl", pool=pool, sharding={
        "w": shard(saved), "b": NamedSharding(mesh_of(saved), P("fsdp"))})
    path = jcxl.checkpoint.save(tmp_path / "ckpt", tree)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=shard(restored) if x.ndim == 2 else
        NamedSharding(mesh_of(restored), P("fsdp"))), values_)
    got = jcxl.checkpoint.restore(path, like=like, pool=pool, tier="cxl")
    assert all(len(x.local_handles) == restored
               for x in jax.tree.leaves(got, is_leaf=is_pool_array))
    assert got["w"].sharding == shard(restored)
    assert got["w"].path == "['w']"
    assert_bit_equal(got, values_)
    # A sharding tree instead of like's: here, everything on one device.
    got = jcxl.checkpoint.restore(path, like=like, pool=pool, tier="host",
                                  sharding={"w": single(), "b": single()})
    assert all(len(x.local_handles) == 1 and x.tier.value == "host"
               for x in jax.tree.leaves(got, is_leaf=is_pool_array))
    assert_bit_equal(got, values_)

  def test_restore_into_overwrites_in_place(self, pool, tmp_path):
    tree = {"w": jcxl.place(np.arange(16.0, dtype=np.float32), "cxl",
                            pool=pool, sharding=NamedSharding(
                                mesh_of(8), P("fsdp"))), "step": 3}
    want = values(tree)
    path = jcxl.checkpoint.save(tmp_path / "ckpt", tree)
    handles = tree["w"].local_handles
    for _, h in handles:
      pool.put_async(h, np.zeros(2, np.float32)).wait()
    got = jcxl.checkpoint.restore_into(path, {"w": tree["w"], "step": 0})
    assert got["w"] is tree["w"] and got["w"].local_handles == handles
    assert got["step"] == 3
    np.testing.assert_array_equal(values(got)[1], want[1])


class AtomicityTest:

  def test_unfinished_save_is_ignored_then_replaced(self, pool, tmp_path):
    tree = {"w": jcxl.place(np.ones(4, np.float32), "cxl", pool=pool)}
    directory = tmp_path / "ckpts"
    first = jcxl.checkpoint.save(directory / "1", tree)
    # What a save killed midway leaves: Orbax's temporary directory.
    leftover = directory / ("2" + TMP_SUFFIX)
    leftover.mkdir()
    (leftover / "_CHECKPOINT_METADATA").write_text("{}")
    assert jcxl.checkpoint.latest(directory) == first
    assert not jcxl.checkpoint.is_complete(leftover)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
      jcxl.checkpoint.restore(directory / "2", like=tree)
    with pytest.raises(ValueError, match="not a finished checkpoint"):
      jcxl.checkpoint.restore(leftover, like=tree)
    second = jcxl.checkpoint.save(directory / "2", tree)
    assert sorted(os.listdir(directory)) == ["1", "2"]  # leftover removed
    assert jcxl.checkpoint.latest(directory) == second

  def test_checkpoints_are_never_overwritten(self, pool, tmp_path):
    tree = {"w": jcxl.place(np.ones(4, np.float32), "cxl", pool=pool)}
    path = jcxl.checkpoint.save(tmp_path / "ckpt", tree)
    with pytest.raises(FileExistsError, match="never overwritten"):
      jcxl.checkpoint.save(path, tree)
    assert_bit_equal(jcxl.checkpoint.restore(path, like=tree), tree)


class ErrorsTest:

  @pytest.fixture
  def saved(self, pool, tmp_path):
    tree = {**jcxl.place({"a": np.arange(40960, dtype=np.float32),
                          "b": np.ones(40960, np.float32)}, "cxl", pool=pool),
            "step": 3}
    return jcxl.checkpoint.save(tmp_path / "ckpt", tree), tree

  def test_missing_path(self, tmp_path):
    with pytest.raises(FileNotFoundError, match="path does not exist"):
      jcxl.checkpoint.restore(tmp_path / "nothing")

  def test_structure_mismatch(self, saved):
    path, tree = saved
    with pytest.raises(ValueError, match=r"not in like: \['b'\]"):
      jcxl.checkpoint.restore(path, like={"a": tree["a"], "step": 0})
    with pytest.raises(ValueError, match=r"missing from the checkpoint: "
                       r"\['c'\]"):
      jcxl.checkpoint.restore(path, like={**tree, "c": 1})

  @pytest.mark.parametrize("shape, dtype, match", [
      ((40959,), np.float32, r"holds float32\[40960\], but like= asks for "
       r"float32\[40959\]"),
      ((40960,), np.int32, r"holds float32\[40960\], but like= asks for "
       r"int32\[40960\]"),
  ])
  def test_shape_or_dtype_mismatch(self, saved, shape, dtype, match):
    path, tree = saved
    like = {**tree, "a": jax.ShapeDtypeStruct(shape, dtype,
                                              sharding=single())}
    with pytest.raises(ValueError, match=match):
      jcxl.checkpoint.restore(path, like=like)

  def test_scalar_where_an_array_was(self, saved):
    path, tree = saved
    with pytest.raises(ValueError, match="has a scalar there"):
      jcxl.checkpoint.restore(path, like={**tree, "a": 0})

  def test_pool_too_small_loses_nothing(self, saved, tmp_path):
    path, tree = saved
    with jcxl.Pool(host="64KiB", cxl="512KiB") as small:
      # Room for the first leaf (160 KiB) but not the second one.
      kept = jcxl.place(np.full(65536, 7, np.float32), "cxl", pool=small)
      before = small.handles()
      with pytest.raises(jcxl.PoolExhaustedError,
                         match=r"restoring \['b'\].*restored so far were "
                         "freed"):
        jcxl.checkpoint.restore(path, like=tree, pool=small)
      assert small.handles() == before
      assert (np.asarray(jcxl.gather(kept)) == 7).all()

  def test_pool_bound_leaves_need_a_pool(self, saved):
    path, _ = saved
    with pytest.raises(ValueError, match="tier='nvme' needs a pool"):
      jcxl.checkpoint.restore(path, tier="nvme")
    like = {"a": jax.ShapeDtypeStruct((40960,), np.float32,
                                      sharding=single()),
            "b": jax.ShapeDtypeStruct((40960,), np.float32,
                                      sharding=single()),
            "step": 0}
    with pytest.raises(ValueError, match="unknown tier|must be one of"):
      jcxl.checkpoint.restore(path, like=like, tier="ssd")

  def test_bad_save_arguments(self, pool, tmp_path):
    with pytest.raises(ValueError, match="no leaves"):
      jcxl.checkpoint.save(tmp_path / "empty", {})
    with pytest.raises(ValueError, match="reserved"):
      jcxl.checkpoint.save(tmp_path / "m", {"a": 1}, metadata={"jcxl": 1})
    with pytest.raises(ValueError, match="must not contain"):
      jcxl.checkpoint.save(tmp_path / ("x" + TMP_SUFFIX), {"a": 1})
    assert os.listdir(tmp_path) == ["nvme"]  # nothing written


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs Linux's resettable peak RSS")
class MemoryTest:
  """A save streams the pool: its peak host memory stays near one leaf
  whatever the model's size; a restore never holds the model either."""

  LEAF = 8 << 20
  LEAVES = 24  # a 192 MiB model

  def test_save_and_restore_stream_the_pool(self, tmp_path):
    rng = np.random.default_rng(0)
    rows = self.LEAF // 4 // 1024
    with jcxl.Pool(host="1MiB", cxl="224MiB") as cxl, jcxl.Pool(
        host="1MiB", cxl=0, nvme="224MiB", nvme_dir=tmp_path) as nvme:
      tree = {f"layer_{i}": jcxl.place(
          rng.standard_normal((rows, 1024), dtype=np.float32), "cxl",
          pool=cxl) for i in range(self.LEAVES)}
      warm = {"w": jcxl.place(np.ones(4, np.float32), "cxl", pool=cxl)}
      jcxl.checkpoint.restore(jcxl.checkpoint.save(tmp_path / "warm", warm),
                              like=warm, pool=nvme, tier="nvme")
      path = tmp_path / "ckpt"
      saved = experiments_common.peak_rss_above(
          lambda: jcxl.checkpoint.save(path, tree))
      model = self.LEAF * self.LEAVES
      print(f"save: peak {saved / 2**20:.1f} MiB above baseline for a "
            f"{model / 2**20:.0f} MiB model of {self.LEAF / 2**20:.0f} MiB "
            "leaves")
      assert saved < 2 * self.LEAF
      restored = experiments_common.peak_rss_above(
          lambda: jcxl.checkpoint.restore(path, like=tree, pool=nvme,
                                          tier="nvme"))
      print(f"restore into nvme: peak {restored / 2**20:.1f} MiB above "
            "baseline")
      assert restored < model / 2
      assert nvme.stats()["nvme"].live >= model


# ---------------------------------------------------------------- kill test
#
# A run of GPT-2 tiny with its params and adamw state in the cxl tier,
# offloaded by cxl_offload, saves at steps 2 and 4. Another process then
# repeats the step-4 save into a directory holding only the step-2
# checkpoint and is SIGKILLed at one of KILL_POINTS; the run restarts from
# what the directory then holds (into its own PoolArrays, overwritten with
# garbage first) and must compute the uninterrupted run's losses, bit for
# bit.

STEPS = 6
BATCH, SEQ = 2, 16
KILL_POINTS = {
    # point (see checkpoint_kill_worker.py): the checkpoint the run resumes
    # from
    "after_first_arrays": 2,   # some arrays written, no _METADATA
    "in_finalize": 2,          # Orbax merging the OCDBT files, no rename
    "after_rename": 4,         # the save is complete; killed just after
}


def tiny_problem(devices: int):
  """GPT-2 tiny, adamw on a warmup-cosine schedule (its step count
  matters), FSDP over `devices` (last axis sharded where it divides)."""
  model = gpt2.tiny()
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, STEPS))
  mesh = mesh_of(devices)

  def sharding(leaf):
    shape = np.shape(leaf)
    if devices > 1 and shape and shape[-1] % devices == 0:
      return NamedSharding(mesh, P(*[None] * (len(shape) - 1), "fsdp"))
    return NamedSharding(mesh, P())
  return model, tx, sharding


def tiny_params(model) -> dict:
  """Random weights of the model's shapes (no init to compile)."""
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(lambda: common.init_params(model, seed=0))
  return jax.tree.map(lambda x: (0.02 * rng.standard_normal(
      x.shape)).astype(x.dtype), shapes)


def train_batches(position: int):
  batches = data.load_stdlib_corpus(256 << 10).batches("train", BATCH, SEQ,
                                                       seed=0)
  for _ in range(position):
    next(batches)
  return batches


def spawn_kill_worker(point, source, target) -> subprocess.Popen:
  worker = os.path.join(ROOT, "tests", "checkpoint_kill_worker.py")
  return subprocess.Popen(
      [sys.executable, worker, point, str(source), str(target)], cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)


class KillTest:

  @pytest.mark.parametrize("devices", [1, 8])
  def test_resume_after_kill_equals_uninterrupted_run(self, tmp_path,
                                                      devices):
    model, tx, sharding = tiny_problem(devices)
    params = tiny_params(model)
    opt_state = tx.init(params)
    reference = tmp_path / "reference"
    # The workers start now and wait for the step-4 checkpoint.
    workers = {point: spawn_kill_worker(point, reference / "4",
                                        tmp_path / point / "4")
               for point in KILL_POINTS}
    try:
      with jcxl.Pool(host="8MiB", cxl="64MiB") as pool:
        state = {
            "params": jcxl.place(params, "cxl", pool=pool,
                                 sharding=jax.tree.map(sharding, params)),
            "opt_state": jcxl.place(opt_state, "cxl", pool=pool,
                                    sharding=jax.tree.map(sharding, opt_state)),
        }
        train_step = jcxl.cxl_offload(_train_step(model, tx),
                                      schedule="fixed:1")

        def train(state, start):
          losses = []
          batches = train_batches(start)
          for step in range(start + 1, STEPS + 1):
            _, _, loss = train_step(state["params"], state["opt_state"],
                                    next(batches))
            losses.append(float(loss))
            if step in (2, 4) and start == 0:
              jcxl.checkpoint.save(reference / str(step), {
                  **state, "step": step, "data_position": step})
            if step == 2 and start == 0:  # each worker's directory
              for point in KILL_POINTS:
                shutil.copytree(reference / "2", tmp_path / point / "2")
          return losses

        want = train(state, 0)  # the uninterrupted run
        for point, worker in workers.items():
          stdout, stderr = worker.communicate(timeout=120)
          assert worker.returncode == -signal.SIGKILL, stderr[-3000:]
          assert f"killed at {point}" in stdout

          directory = tmp_path / point
          resume_step = KILL_POINTS[point]
          latest = jcxl.checkpoint.latest(directory)
          assert latest == str(directory / str(resume_step))
          leftover = directory / ("4" + TMP_SUFFIX)
          assert leftover.exists() == (resume_step == 2)
          # The restarted run: its state garbage until the checkpoint's.
          for leaf in jax.tree.leaves(state, is_leaf=is_pool_array):
            for _, handle in leaf.local_handles:
              pool.put_async(handle, np.full(
                  leaf.shard_shape, 99, leaf.dtype)).wait()
          restored = jcxl.checkpoint.restore_into(
              latest, {**state, "step": 0, "data_position": 0})
          assert restored["step"] == resume_step
          assert all(a is b for a, b in zip(  # the objects step compiled for
              jax.tree.leaves([restored["params"], restored["opt_state"]],
                              is_leaf=is_pool_array),
              jax.tree.leaves([state["params"], state["opt_state"]],
                              is_leaf=is_pool_array)))
          got = train(state, restored["data_position"])
          assert got == want[resume_step:], (point, got, want)
          if resume_step == 2:  # the next save replaces what the kill left
            jcxl.checkpoint.save(directory / "4", {**state, "step": 4,
                                                   "data_position": 4})
          assert sorted(os.listdir(directory)) == ["2", "4"]
    finally:
      for worker in workers.values():  # none left waiting if this failed
        if worker.poll() is None:
          worker.kill()
          worker.communicate()


def _train_step(model, tx):
  return experiments_common.make_train_step(gpt2.make_loss(model), tx)


# ------------------------------------------------- experiments.train resume


TRAIN = ("--model=gpt2-tiny", "--steps=6", "--batch=2", "--seq_len=16",
         "--warmup_steps=2", "--eval_every=3", "--eval_batches=2",
         "--log_every=1", "--data_bytes=256KiB", "--device_budget=8MiB",
         "--seed=3", "--checkpoint_every=2", "--keep_checkpoints=3",
         "--mode=resident")


@contextlib.contextmanager
def flagsaver_for(program):
  """Restores the program's flags afterwards."""
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  saved = flagsaver.save_flag_values(program.FLAGS)
  try:
    yield
  finally:
    flagsaver.restore_flag_values(saved, program.FLAGS)


def run_train(*args: str) -> str:
  """Runs experiments.train's main; returns what it printed."""
  from experiments import train  # pylint: disable=g-import-not-at-top
  stdout = io.StringIO()
  with flagsaver_for(train), contextlib.redirect_stdout(stdout):
    train.main(train.FLAGS(["train", *args]))
  return stdout.getvalue()


def summary(run_dir) -> dict:
  return json.loads((run_dir / "summary.json").read_text())


class TrainResumeTest:

  def test_resumed_run_continues_exactly(self, tmp_path):
    first = tmp_path / "first"
    text = run_train(*TRAIN, f"--run_dir={first}")
    assert "checkpoint step 4:" in text
    assert sorted(os.listdir(first / "checkpoints")) == ["2", "4", "6"]
    want = summary(first)["train_losses"]
    # Killed after step 5: the step-6 checkpoint never happened, and a
    # save killed midway left its temporary directory.
    resumed = tmp_path / "resumed"
    shutil.copytree(first, resumed)
    shutil.rmtree(resumed / "checkpoints" / "6")
    (resumed / "checkpoints" / ("6" + TMP_SUFFIX)).mkdir()
    rows = (resumed / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("\n".join(rows[:-3]) + "\n{\"ki")
    text = run_train(*TRAIN, f"--run_dir={resumed}", "--resume")
    assert f"resumed from {resumed / 'checkpoints' / '4'} at step 4" in text
    assert "removing an unfinished checkpoint" in text
    got = summary(resumed)
    assert got["start_step"] == 4
    assert got["train_losses"] == want[4:]  # bit for bit
    assert sorted(os.listdir(resumed / "checkpoints")) == ["2", "4", "6"]
    metrics = [json.loads(l) for l in
               (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in metrics] == [
        (r["kind"], r["step"]) for r in map(json.loads, rows)]

  def test_resume_path_names_a_checkpoint_or_a_directory(self, tmp_path):
    from experiments import train  # pylint: disable=g-import-not-at-top
    for step in (2, 10):
      jcxl.checkpoint.save(tmp_path / "a" / "checkpoints" / str(step),
                           {"step": step})
    (tmp_path / "a" / "checkpoints" / ("12" + TMP_SUFFIX)).mkdir()
    config = lambda resume, run_dir=tmp_path / "b": dataclasses.replace(
        train.config_from_flags(), resume=resume, run_dir=str(run_dir))
    with flagsaver_for(train):
      train.FLAGS(["train", *TRAIN])
      checkpoints = tmp_path / "a" / "checkpoints"
      assert config(str(checkpoints / "2")).resume_path() == str(
          checkpoints / "2")
      assert config(str(checkpoints)).resume_path() == str(checkpoints / "10")
      assert config(train.RESUME_LATEST, tmp_path / "a").resume_path() == \
          str(checkpoints / "10")
      assert config(train.RESUME_LATEST).resume_path() is None
      train.FLAGS(["train", "--resume"])
      assert train.FLAGS.resume == train.RESUME_LATEST
      train.FLAGS(["train", f"--resume={checkpoints}"])
      assert train.FLAGS.resume == str(checkpoints)
      train.FLAGS(["train", "--noresume"])
      assert train.FLAGS.resume is None

  @pytest.mark.parametrize("args, match", [
      (["--checkpoint_every=-1"], r"--checkpoint_every must be >= 0"),
      (["--keep_checkpoints=0"], r"--keep_checkpoints must be positive"),
      (["--resume"], r"--resume: no finished checkpoint in --run_dir's"),
      (["--resume=/nonexistent/ckpt"], r"--resume: no finished checkpoint "
       r"in '/nonexistent/ckpt'"),
  ])
  def test_bad_flags_are_usage_errors(self, tmp_path, args, match):
    from absl import app  # pylint: disable=g-import-not-at-top
    with pytest.raises(app.UsageError, match=match):
      run_train(*TRAIN, f"--run_dir={tmp_path / 'run'}", *args)
    assert not (tmp_path / "run").exists()

  def test_resume_with_other_settings_is_rejected(self, tmp_path):
    from absl import app  # pylint: disable=g-import-not-at-top
    config = {"model": "gpt2-tiny", "steps": 6, "batch": 2,
              "seq_len": 16, "learning_rate": 3e-3, "warmup_steps": 2,
              "seed": 3, "data_bytes": 256 << 10}
    checkpoints = tmp_path / "run" / "checkpoints"
    for step in (2, 6):
      jcxl.checkpoint.save(checkpoints / str(step), {"step": step}, metadata={
          "train": {"run": config, "step": step}})
    with pytest.raises(app.UsageError, match=r"written with --seed=3, but "
                       r"this run has --seed=4"):
      run_train(*TRAIN, f"--run_dir={tmp_path / 'run'}", "--resume",
                "--seed=4")
    with pytest.raises(app.UsageError, match="at step 6, the last of"):
      run_train(*TRAIN, f"--run_dir={tmp_path / 'run'}", "--resume")
    with pytest.raises(app.UsageError, match=r"already holds checkpoints "
                       r"after step 2 \(steps \[6\]\)"):
      run_train(*TRAIN, f"--run_dir={tmp_path / 'run'}",
                f"--resume={checkpoints / '2'}")
    with pytest.raises(app.UsageError, match="not written by "
                       "experiments.train"):
      jcxl.checkpoint.save(tmp_path / "x" / "1", {"step": 1})
      run_train(*TRAIN, f"--run_dir={tmp_path / 'y'}",
                f"--resume={tmp_path / 'x'}")




def data_files(path: str) -> list[str]:
  """The checkpoint's OCDBT data files, largest first."""
  files = [os.path.join(root, name) for root, _, names in os.walk(path)
           for name in names if os.path.basename(root) == "d"]
  return sorted(files, key=os.path.getsize, reverse=True)


class IntegrityTest:
  """A checkpoint's bytes are checked when it is read: a changed, cut or
  missing data file is an error naming the array, raised before anything
  is restored or overwritten."""

  @pytest.fixture
  def saved(self, pool, tmp_path):
    # 'big' is the one array large enough to live in its own data file.
    tree = {"big": jcxl.place(np.arange(65536, dtype=np.float32), "cxl",
                              pool=pool),
            "small": jcxl.place(np.ones(8, np.int32), "host", pool=pool),
            "numpy": np.arange(6, dtype=np.int64),
            "step": 3}
    path = jcxl.checkpoint.save(tmp_path / "ckpt", tree)
    return path, tree

  def flip_a_byte(self, path: str) -> str:
    file = data_files(path)[0]
    with open(file, "r+b") as f:
      f.seek(os.path.getsize(file) // 2)
      byte = f.read(1)
      f.seek(-1, os.SEEK_CUR)
      f.write(bytes([byte[0] ^ 0x10]))
    return file

  def test_intact_checkpoint_restores(self, saved):
    path, tree = saved
    assert_bit_equal(jcxl.checkpoint.restore(path, like=tree), tree)

  def test_flipped_byte_is_named_before_restore(self, saved, pool):
    path, tree = saved
    file = self.flip_a_byte(path)
    before = pool.handles()
    with pytest.raises(jcxl.CheckpointCorruptError,
                       match=rf"array 'big' is corrupt.*{re.escape(file)}"):
      jcxl.checkpoint.restore(path, like=tree)
    assert pool.handles() == before  # nothing was made

  def test_flipped_byte_leaves_restore_into_targets_untouched(self, saved):
    path, tree = saved
    live = {**tree, "big": jcxl.place(np.full(65536, 5, np.float32), "cxl",
                                      pool=tree["big"].pool),
            "small": jcxl.place(np.full(8, 9, np.int32), "host",
                                pool=tree["big"].pool)}
    self.flip_a_byte(path)
    with pytest.raises(jcxl.CheckpointCorruptError, match="'big' is corrupt"):
      jcxl.checkpoint.restore_into(path, live)
    assert (np.asarray(jcxl.gather(live["big"])) == 5).all()
    assert (np.asarray(jcxl.gather(live["small"])) == 9).all()

  @pytest.mark.parametrize("damage", ["truncate", "delete"])
  def test_cut_or_missing_data_file_names_the_array(self, saved, damage):
    path, tree = saved
    file = data_files(path)[0]
    if damage == "truncate":
      open(file, "wb").close()
    else:
      os.remove(file)
    with pytest.raises(jcxl.CheckpointCorruptError,
                       match=r"array 'big' cannot be read"):
      jcxl.checkpoint.restore(path, like=tree)

  def test_changed_checksum_file_is_refused(self, saved):
    path, tree = saved
    (checksums,) = [n for n in os.listdir(path) if n.startswith("jcxl_")]
    os.remove(os.path.join(path, checksums))
    with pytest.raises(jcxl.CheckpointCorruptError, match="files are gone"):
      jcxl.checkpoint.restore(path, like=tree)

  @pytest.mark.parametrize("edit", ["drop checksums", "drop jcxl record",
                                    "claim format 1"])
  def test_editing_metadata_does_not_turn_verification_off(self, saved, edit):
    path, tree = saved
    file = os.path.join(path, "_METADATA")
    with open(file, encoding="utf-8") as f:
      metadata = json.load(f)
    record = metadata["custom_metadata"]["jcxl"]
    if edit == "drop checksums":
      del record["checksums"]
    elif edit == "drop jcxl record":
      del metadata["custom_metadata"]["jcxl"]
    else:
      del record["checksums"]
      record["version"] = 1
    with open(file, "w", encoding="utf-8") as f:
      json.dump(metadata, f)
    self.flip_a_byte(path)
    with pytest.raises(jcxl.CheckpointCorruptError, match="'big' is corrupt"):
      jcxl.checkpoint.restore(path, like=tree)

  def test_latest_skips_what_restore_refuses(self, pool, tmp_path):
    tree = {"w": jcxl.place(np.ones(4, np.float32), "cxl", pool=pool)}
    first = jcxl.checkpoint.save(tmp_path / "ckpts" / "1", tree)
    second = jcxl.checkpoint.save(tmp_path / "ckpts" / "2", tree)
    for name in os.listdir(second):
      if name.startswith("jcxl_checksums"):
        os.remove(os.path.join(second, name))
    assert jcxl.checkpoint.latest(tmp_path / "ckpts") == first
    with pytest.raises(jcxl.CheckpointCorruptError, match="files are gone"):
      jcxl.checkpoint.restore(second, like=tree)

  @pytest.mark.parametrize("damage", ["truncate", "delete"])
  def test_latest_skips_a_checkpoint_whose_data_file_is_cut_or_gone(
      self, pool, tmp_path, damage):
    tree = {"big": jcxl.place(np.arange(65536, dtype=np.float32), "cxl",
                              pool=pool), "step": 1}
    first = jcxl.checkpoint.save(tmp_path / "ckpts" / "1", tree)
    second = jcxl.checkpoint.save(tmp_path / "ckpts" / "2", tree)
    file = data_files(second)[0]
    if damage == "truncate":
      open(file, "wb").close()  # a full disk, say
    else:
      os.remove(file)
    path = jcxl.checkpoint.latest(tmp_path / "ckpts")
    assert path == first
    assert_bit_equal(jcxl.checkpoint.restore(path, like=tree), tree)

  def test_leaves_saved_under_one_name_are_refused_before_writing(
      self, pool, tmp_path):
    kept = jcxl.checkpoint.save(tmp_path / "ckpts" / "1", {"a.b": 1})
    tree = {"a.b": jcxl.place(np.ones(4, np.float32), "cxl", pool=pool),
            "a": {"b": jcxl.place(np.zeros(4, np.float32), "cxl",
                                  pool=pool)}}
    with pytest.raises(ValueError, match=r"leaves \['a'\]\['b'\] and "
                       r"\['a.b'\] would both be saved as 'a.b'"):
      jcxl.checkpoint.save(tmp_path / "ckpts" / "2", tree)
    assert os.listdir(tmp_path / "ckpts") == ["1"]  # no temporary either
    assert jcxl.checkpoint.latest(tmp_path / "ckpts") == kept
    assert jcxl.checkpoint.restore(kept) == {"a.b": 1}

  def test_object_leaf_is_refused_before_anything_is_written(self, pool,
                                                             tmp_path):
    tree = {"w": jcxl.place(np.ones(4, np.float32), "cxl", pool=pool),
            "bad": np.array([1, "a"], dtype=object)}
    with pytest.raises(TypeError, match=r"leaf \['bad'\]: dtype must be "
                       r"numeric .* but got object"):
      jcxl.checkpoint.save(tmp_path / "ckpts" / "1", tree)
    assert not (tmp_path / "ckpts").exists()  # no .orbax-checkpoint-tmp

  def test_latest_skips_unreadable_metadata(self, pool, tmp_path):
    tree = {"w": jcxl.place(np.ones(4, np.float32), "cxl", pool=pool)}
    first = jcxl.checkpoint.save(tmp_path / "ckpts" / "1", tree)
    second = jcxl.checkpoint.save(tmp_path / "ckpts" / "2", tree)
    with open(os.path.join(second, "_METADATA"), "r+b") as f:
      f.truncate(10)
    assert jcxl.checkpoint.latest(tmp_path / "ckpts") == first
    with pytest.raises(jcxl.CheckpointCorruptError,
                       match="_METADATA cannot be read"):
      jcxl.checkpoint.restore(second, like=tree)

  def test_non_native_byte_order_round_trips(self, pool, tmp_path):
    values = (np.arange(5) * 1.5).astype(">f4")
    tree = {"pool": jcxl.place(values, "cxl", pool=pool), "numpy": values}
    assert tree["pool"].dtype == np.float32
    path = jcxl.checkpoint.save(tmp_path / "ckpt", tree)
    got = jcxl.checkpoint.restore(path, like=tree)
    np.testing.assert_array_equal(np.asarray(jcxl.gather(got["pool"])),
                                  values)
    np.testing.assert_array_equal(got["numpy"], values)
