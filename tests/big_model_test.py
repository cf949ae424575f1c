"""experiments/big_model.py: its size default, its bound and byte
arithmetic, and one tiny run end to end (its resume at a smaller size)."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from benchmarks import bench
from experiments import big_model
from experiments import big_model_bounds as bounds
from models import common as model_common
from models import gpt2

GiB = 1 << 30


def _param_count(config: gpt2.GPT2Config) -> int:
  shapes = jax.eval_shape(
      lambda: model_common.init_params(config, seed=0))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


class SizeTest:

  @pytest.mark.parametrize("n_embd,n_layer,n_ctx", [(64, 2, 64), (256, 3, 128)])
  def test_gpt2_params_counts_the_model(self, n_embd, n_layer, n_ctx):
    config = gpt2.tiny(n_embd=n_embd, n_layer=n_layer, n_ctx=n_ctx)
    assert bounds.gpt2_params(n_embd, n_layer, 256, n_ctx) == _param_count(
        config)

  def test_blocks_for_state_is_the_fewest_that_reach_the_multiple(self):
    memory = 23 * GiB
    n = bounds.blocks_for_state(memory, 2.0, 2560, 256, 64)
    state = lambda blocks: 12 * bounds.gpt2_params(2560, blocks, 256, 64)
    assert state(n) >= 2.0 * memory > state(n - 1)
    with pytest.raises(ValueError, match="multiple must be positive"):
      bounds.blocks_for_state(memory, 0.0, 2560, 256, 64)

  def test_default_is_twice_this_machines_memory(self, experiment):
    config = experiment(big_model)("--nvme_dir=/var/tmp")
    memory = bench.describe_machine().memory_bytes
    _, _, params, opt_state = big_model._state_shapes(
        config.model(), big_model.optimizer(config), 0)
    fp32 = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(
        (params, opt_state)) if x.dtype == np.float32)
    assert fp32 >= 2.0 * memory
    assert big_model._nbytes(params) * 3 == fp32  # weights, mu, nu
    assert config.steps >= 20
    assert (config.update, config.compute_dtype) == ("host", "bfloat16")
    assert config.full_size(memory, big_model._nbytes((params, opt_state)))

  def test_largest_blocks_that_fit(self):
    args = dict(margin=GiB, fast_bytes=GiB, slack=1 << 20, n_embd=512,
                vocab=256, n_ctx=64)
    free = 40 * GiB
    n = bounds.largest_blocks_that_fit(free, **args)

    def need(blocks):
      p = bounds.gpt2_params(512, blocks, 256, 64)
      return (bounds.nvme_tier_bytes(12 * p, 4 * p, GiB, 1 << 20) +
              bounds.checkpoint_bytes(12 * p) + GiB)
    assert need(n) <= free < need(n + 1)
    assert bounds.largest_blocks_that_fit(GiB, **args) == 0
    assert bounds.largest_blocks_that_fit(
        free, with_checkpoint=False, **args) > n

  @pytest.mark.parametrize("value,message", [
      ("lots", "must be a byte count"), ("-1", "must not be negative")])
  def test_bad_dd_probe_bytes_are_refused(self, experiment, value, message):
    with pytest.raises(big_model.app.UsageError,
                       match=f"--dd_probe_bytes {message}"):
      experiment(big_model)("--nvme_dir=/var/tmp",
                            f"--dd_probe_bytes={value}")

  def test_host_update_needs_a_memory_tier(self, experiment):
    with pytest.raises(Exception, match="--update=host needs a memory tier"):
      experiment(big_model)("--nvme_dir=/var/tmp", "--fast_tier=none")


class BoundTest:

  def test_lower_bound_is_the_slower_of_compute_and_the_disk(self):
    dd = {"read": 1e9, "write": 2e9}
    assert bounds.lower_bound(1.0, 4e9, 2e9, dd) == pytest.approx(5.0)
    assert bounds.lower_bound(9.0, 4e9, 2e9, dd) == 9.0
    with pytest.raises(ValueError, match="dd's rates must be positive"):
      bounds.lower_bound(1.0, 1, 1, {"read": 0.0, "write": 1.0})

  def test_warm_ratios_take_the_last_ten(self):
    ratios = [5.0] * 10 + [1.0, 1.1, 1.3] + [1.05] * 7
    assert bounds.warm_ratios(ratios) == {"steps": 10, "median": 1.05,
                                          "worst": 1.3}
    # Fewer steps: all but the first, which compiles and warms up.
    assert bounds.warm_ratios([9.0, 1.1, 1.2]) == {
        "steps": 2, "median": pytest.approx(1.15), "worst": 1.2}

  def test_bytes_per_param_splits_the_excess_by_cause(self):
    n = 1000
    # 8 bytes a parameter of state on nvme; the step fetched bfloat16
    # copies twice from nvme, stored bfloat16 gradients there, and the
    # update read the state and the gradients and wrote the state and
    # the copies.
    row = {"disk_read": (8 + 4 + 2) * n + 50, "disk_written": (2 + 8 + 2) * n,
           "link_in": 4 * n, "link_out": 2 * n + 100,
           "nvme_fetched": 4 * n, "nvme_stored": 2 * n}
    b = bounds.bytes_per_param(row, n, 8 * n)
    read, write = b["flows"]["disk_read"], b["flows"]["disk_write"]
    assert read["measured"] == pytest.approx(14.05)
    assert read["minimum"] == 8
    assert read["excess"] == pytest.approx({
        "weights fetched from nvme": 4, "gradients read back from nvme": 2,
        "other": 0.05})
    assert write["excess"] == pytest.approx({
        "gradients stored on nvme": 2,
        "weight copies written by the update": 2})
    assert b["flows"]["link_in"]["excess"] == pytest.approx(
        {"weights fetched twice or as float32": 2})
    assert b["flows"]["link_out"]["excess"] == pytest.approx(
        {"gradients leaving as float32": 0.1})
    for flow in b["flows"].values():
      assert sum(flow["excess"].values()) == pytest.approx(
          flow["over_minimum"])
    assert b["minimum"] == pytest.approx(8 + 8 + 2 + 2)
    assert b["measured"] == pytest.approx(14.05 + 12 + 4 + 2.1)


class RunTest:

  def test_tiny_run_trains_and_resumes_at_a_smaller_size(
      self, experiment, tmp_path, monkeypatch):
    # As on a disk without room for the checkpoint at full size: the
    # resume check runs at the largest size that fits, here 1 block.
    monkeypatch.setattr(big_model, "_checkpoint_room",
                        lambda *a: (False, "no room (test)"))
    monkeypatch.setattr(bounds, "largest_blocks_that_fit", lambda *a, **k: 1)
    config = experiment(big_model)(
        "--n_embd=64", "--n_head=4", "--n_layer=2", "--seq_len=16",
        "--steps=4", "--fast_capacity=256KiB", "--dd_bytes=8MiB",
        "--learning_rate=3e-3", "--dd_probe_bytes=4MiB",
        f"--nvme_dir={tmp_path / 'nvme'}", f"--run_dir={tmp_path / 'run'}")
    results = big_model.run(config)
    assert not results["full_size"]
    assert len(results["steps"]) == 4
    # A dd probe between steps: each step's bound takes the faster of the
    # two beside it, per direction.
    rows = results["steps"]
    assert results["dd_beside_steps"]
    for row, after in zip(rows, rows[1:]):
      assert row["dd_beside"]["after"] == after["dd_beside"]["before"]
    compute = results["compute_alone"]["seconds"]
    for row in rows:
      beside = row["dd_beside"]
      assert min(beside["before"].values()) > 0
      dd = {d: max(beside["before"][d], beside["after"][d])
            for d in ("read", "write")}
      assert row["lower_bound_s"] == pytest.approx(bounds.lower_bound(
          compute, row["disk_read"], row["disk_written"], dd))
    # Part of the state is on nvme and the host update ran every step.
    assert 0 < results["nvme_state_bytes"] < results["state_bytes"]
    for row in results["steps"]:
      assert row["host_update_runs"] > 0
      assert row["disk_read"] > 0 and row["disk_written"] > 0
      assert row["lower_bound_s"] > 0
    assert results["weight_copies"].startswith("weight copies")
    ck = results["checkpoint"]
    assert (ck["size"], ck["n_layer"], ck["equal"]) == ("smaller", 1, True)
    assert ck["why"] == "no room (test)"
    assert results["compute_alone"]["n_layer"] == 2
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["checkpoint"]["equal"]
    text = (tmp_path / "run" / "results.md").read_text()
    assert "SMALLER than the issue's run" in text
    assert "NOT at full size (no room (test))" in text
    # The run's nvme files and the checkpoint are gone.
    assert not any(p.name.startswith("big_model")
                   for p in (tmp_path / "nvme").iterdir())

  def test_disk_probe_reads_the_half_the_probe_before_wrote(
      self, tmp_path, monkeypatch):
    calls = []
    real = big_model._dd
    monkeypatch.setattr(big_model, "_dd",
                        lambda args: calls.append(args) or real(args))
    with big_model.DiskProbe(str(tmp_path), 1 << 20, 1 << 18) as probe:
      assert (tmp_path / "big_model-dd-probe").stat().st_size == 2 << 20
      rates = [probe.measure() for _ in range(3)]
    assert all(r["read"] > 0 and r["write"] > 0 for r in rates)
    # Writes go to halves 0, 1, 0 and reads to 1, 0, 1 (4 requests each).
    writes = [a for a in calls[1:] if "if=/dev/zero" in a]
    reads = [a for a in calls[1:] if "of=/dev/null" in a]
    assert [a[4] for a in writes] == ["seek=0", "seek=4", "seek=0"]
    assert [a[4] for a in reads] == ["skip=4", "skip=0", "skip=4"]
    assert not (tmp_path / "big_model-dd-probe").exists()

  def test_a_probe_whose_first_dd_fails_leaves_no_file(self, tmp_path,
                                                       monkeypatch):
    def failing(args):
      (tmp_path / "big_model-dd-probe").write_bytes(b"partly")
      raise RuntimeError("dd: No space left on device")
    monkeypatch.setattr(big_model, "_dd", failing)
    with pytest.raises(RuntimeError, match="No space left"):
      big_model.DiskProbe(str(tmp_path), 1 << 20, 1 << 18)
    assert not (tmp_path / "big_model-dd-probe").exists()

  def test_a_disk_without_room_for_the_tier_and_the_probe_is_refused(
      self, experiment, tmp_path, monkeypatch):
    config = experiment(big_model)(f"--nvme_dir={tmp_path}", "--n_layer=2",
                                   "--dd_probe_bytes=1GiB")
    state, params = 100 << 20, 30 << 20
    tier = big_model._nvme_tier(config, state, params)  # room enough
    free = tier + big_model._DISK_MARGIN + GiB  # not for 2 GiB of probe
    usage = big_model.shutil.disk_usage(tmp_path)._replace(free=free)
    monkeypatch.setattr(big_model.shutil, "disk_usage", lambda _: usage)
    assert big_model._nvme_tier(config, state, params) == tier
    with pytest.raises(big_model.app.UsageError,
                       match=r"and dd's probe 2\.00 GiB beside it.*"
                       r"or --dd_probe_bytes"):
      big_model._nvme_tier(config, state, params,
                           big_model._probe_bytes(config, probe=True))

  def test_config_is_frozen(self, experiment):
    config = experiment(big_model)("--nvme_dir=/var/tmp", "--n_layer=2")
    with pytest.raises(dataclasses.FrozenInstanceError):
      config.steps = 3
