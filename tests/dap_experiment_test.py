"""A small run of experiments/dap.py and its flag checks."""

from __future__ import annotations

import csv

from absl import app
import numpy as np
import pytest

from experiments import common as exp_common
from experiments import dap


@pytest.fixture
def run_program(experiment):
  config = experiment(dap)
  return lambda *args: dap.run(config(*args))


class DapExperimentTest:

  def test_small_run_writes_table_plots_and_slowdown(self, run_program,
                                                     tmp_path):
    out = tmp_path / "run"
    results = run_program("--models=one_big", "--bandwidths=4GB/s",
                          "--schedules=sync,fixed:1,dap", "--steps=2",
                          "--tune_steps=8", "--slowdown=2",
                          "--slowdown_model=one_big",
                          "--tight_models=one_big",
                          "--tight_headroom=1MiB",
                          f"--run_dir={out}")
    rows = list(csv.DictReader(open(out / "results.csv")))
    loose = [r for r in rows if float(r["budget_mib"]) == 1024]
    assert [r["schedule"] for r in loose] == ["dap", "sync", "fixed:1",
                                              dap.UNMEASURED]
    assert all(float(r["step_ms"]) > 0 and float(r["predicted_ms"]) > 0
               and float(r["offline_predicted_ms"]) > 0 for r in loose)
    assert all(r["within_budget"] == "True" for r in loose)
    assert all(len(r["round_ms"].split()) == 2 for r in loose)
    # The tight budget: sync's need plus 1 MiB, less than the 4 MiB block
    # prefetched ahead. fixed:1 is over it and not run; DAP (and its plan)
    # stay within it.
    tight = {r["schedule"]: r for r in rows if r not in loose}
    budget = float(tight["sync"]["budget_mib"]) * 2**20
    assert float(tight["sync"]["device_need"]) == budget - 2**20
    assert tight["fixed:1"]["step_ms"] == ""
    assert tight["fixed:1"]["round_ms"] == ""
    assert tight["fixed:1"]["within_budget"] == "False"
    assert float(tight["fixed:1"]["device_need"]) > budget
    for name in ("dap", dap.UNMEASURED):
      assert float(tight[name]["step_ms"]) > 0
      assert float(tight[name]["device_need"]) <= budget
    summary = {c["case"]: c for c in results["summary"]}
    paired = summary["one_big @ 4 GB/s"]["dap_paired"]
    rounds = {r["schedule"]: [float(t) for t in r["round_ms"].split()]
              for r in loose}
    assert paired["ratio"] == pytest.approx(max(
        np.median(np.array(rounds["dap"]) / rounds[name])
        for name in ("sync", "fixed:1")), rel=1e-3)
    assert paired["low"] <= paired["ratio"] <= paired["high"]
    # Against the fixed distance with the lowest median alone, and DAP
    # against its own plan: paired the same way.
    medians = {name: np.median(rounds[name]) for name in ("sync", "fixed:1")}
    best = min(medians, key=medians.get)
    against_best = summary["one_big @ 4 GB/s"]["dap_paired_best"]
    assert against_best["against"] == best
    assert against_best["ratio"] == pytest.approx(
        np.median(np.array(rounds["dap"]) / rounds[best]), rel=1e-3)
    itself = summary["one_big @ 4 GB/s"]["dap_over_unmeasured"]
    assert itself["ratio"] == pytest.approx(np.median(
        np.array(rounds["dap"]) / rounds[dap.UNMEASURED]), rel=1e-3)
    assert summary[f"one_big @ 4 GB/s, budget {budget / 2**20:.1f} MiB"][
        "fixed_over_budget"] == ["fixed:1"]
    for name in ("results.md", "step_time.png", "memory.png", "stall.png"):
      assert (out / name).stat().st_size > 0
    text = (out / "results.md").read_text()
    assert "EMULATED" in text and "Link slowdown" in text
    assert results["slowdown"]["slow_gbps"] == pytest.approx(2.0)

  def test_rounds_run_blocks_back_to_back_and_time_the_last(self):
    calls = []

    def step_of(name):
      def step(count, batch):
        calls.append(name)
        return count + 1, 0.0
      return step

    runs = {name: [step_of(name), [0]] for name in "ab"}
    times = dap._interleaved(runs, None, 2, lambda names, n: names, block=3)
    assert calls == list("aaabbbaaabbb")
    assert [len(t) for t in times.values()] == [2, 2]
    assert [state for _, state in runs.values()] == [[6], [6]]

  @pytest.mark.parametrize("args, message", [
      (["--models=nope"], "--models: unknown model"),
      (["--tight_models=nope"], "--tight_models: unknown model"),
      (["--tight_headroom=lots"], "--tight_headroom"),
      (["--schedules=fixed:x,dap"], "schedule must be"),
      (["--schedules=sync"], "must include dap"),
      (["--slowdown=0.5"], "--slowdown"),
      (["--slowdown_model=nope"], "--slowdown_model: unknown model"),
      (["--block_steps=0"], "--block_steps"),
  ])
  def test_bad_flags(self, run_program, args, message):
    with pytest.raises(app.UsageError, match=message):
      run_program(*args)

  def test_bad_bandwidth_flag(self, run_program):
    with pytest.raises(app.UsageError, match="--bandwidths"):
      run_program("--bandwidths=fast")


class WorstPairedRatioTest:

  def test_round_load_cancels_and_the_best_other_is_named(self):
    load = np.array([1.0, 1.5, 1.0, 2.0, 1.0, 1.2])  # a changing machine
    got = exp_common.worst_paired_ratio(
        100 * load, {"slow": 110 * load, "fast": 95 * load})
    assert got["against"] == "fast"
    assert got["ratio"] == pytest.approx(100 / 95)
    # Every round says the same: no doubt left.
    assert got["low"] == pytest.approx(got["ratio"])
    assert got["high"] == pytest.approx(got["ratio"])

  def test_noise_widens_the_interval(self):
    rng = np.random.default_rng(0)
    noisy = 100 * (1 + 0.1 * rng.standard_normal(16))
    got = exp_common.worst_paired_ratio(noisy, {"other": np.full(16, 100.0)})
    assert got["low"] < got["ratio"] < got["high"]
    assert got["high"] - got["low"] > 0.02

  def test_nothing_to_compare_with(self):
    with pytest.raises(ValueError, match="at least one other"):
      exp_common.worst_paired_ratio([1.0], {})


def test_shuffled_rounds_vary_what_runs_before_each():
  items = ["dap", "sync", "fixed:1", "fixed:2", "fixed:3"]
  rounds = [exp_common.shuffled(items, n) for n in range(8)]
  assert all(sorted(r) == sorted(items) for r in rounds)
  assert rounds == [exp_common.shuffled(items, n) for n in range(8)]
  before_sync = {r[r.index("sync") - 1] for r in rounds if r[0] != "sync"}
  assert len(before_sync) > 1
