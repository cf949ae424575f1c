"""A small run of experiments/dap.py and its flag checks."""

from __future__ import annotations

import csv
import time

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
    results = run_program("--models=one_big", "--link_bandwidths=4GB/s",
                          "--schedules=sync,fixed:1,dap", "--steps=2",
                          "--confirm_rounds=0", "--solo_steps=3",
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
    # DAP's plan also ran by itself; the offline prediction is checked
    # against that step too.
    assert [r["schedule"] for r in loose if r["solo_ms"]] == [dap.UNMEASURED]
    solo = float(loose[-1]["solo_ms"])
    assert solo > 0
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
    case = summary["one_big @ 4 GB/s"]
    assert case["plan_solo_ms"] == pytest.approx(solo, rel=1e-3)
    assert case["dap_offline_over_solo"] == pytest.approx(
        float(loose[0]["offline_predicted_ms"]) / solo, rel=1e-3)
    assert case["dap_predicted_over_solo"] == pytest.approx(
        float(loose[0]["predicted_ms"]) / solo, rel=1e-3)
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
      (["--confirm_rounds=-1"], "--confirm_rounds"),
      (["--solo_steps=-1"], "--solo_steps"),
  ])
  def test_bad_flags(self, run_program, args, message):
    with pytest.raises(app.UsageError, match=message):
      run_program(*args)

  def test_bad_bandwidth_flag(self, run_program):
    with pytest.raises(app.UsageError, match="--link_bandwidths"):
      run_program("--link_bandwidths=fast")


def _sleeper(seconds):
  def step(count, batch):
    time.sleep(seconds)
    return count + 1, 0.0
  return step


class ConfirmTest:
  """The confirming rounds: more rounds for the close fixed distances
  alone, until the verdict on the 3% target is clear."""

  def _runs(self):
    return {name: [_sleeper(0.002), [0]]
            for name in ("dap", dap.UNMEASURED, "fixed:1", "fixed:2")}

  def _config(self, experiment, rounds):
    return experiment(dap)(f"--confirm_rounds={rounds}", "--block_steps=1")

  def test_close_ones_run_until_the_verdict_is_clear(self, experiment):
    # First rounds that cannot tell DAP from fixed:1 (DAP 0.9x to 1.15x of
    # it, round by round); fixed:2 is twice DAP's step.
    noisy = [0.9, 1.15, 0.95, 1.1]
    times = {"dap": [2e-3 * r for r in noisy],
             dap.UNMEASURED: [2e-3] * 4, "fixed:1": [2e-3] * 4,
             "fixed:2": [4e-3] * 4}
    added = dap._confirm(self._runs(), times, None,
                         self._config(experiment, 48))
    assert added % dap.CONFIRM_BATCH == 0 and 0 < added <= 48
    for name in ("dap", dap.UNMEASURED, "fixed:1"):
      assert len(times[name]) == 4 + added
    assert len(times["fixed:2"]) == 4  # settled: not run again
    verdict = exp_common.worst_paired_ratio(
        times["dap"], {"fixed:1": times["fixed:1"]})
    if added < 48:  # it stopped because the interval cleared the target
      assert (verdict["high"] < dap.TARGET_RATIO
              or verdict["low"] > dap.TARGET_RATIO)

  def test_limit_and_clear_verdicts(self, experiment):
    noisy = {"dap": [2e-3, 2.4e-3, 1.6e-3, 2.6e-3],
             dap.UNMEASURED: [2e-3] * 4, "fixed:1": [2e-3] * 4}
    assert dap._confirm(self._runs(), noisy, None,
                        self._config(experiment, 3)) == 3
    assert len(noisy["dap"]) == 7
    # DAP 10% slower in every round: clearly over the target, no rounds.
    slow = {"dap": [2.2e-3] * 4, "fixed:1": [2e-3] * 4}
    assert dap._confirm(self._runs(), slow, None,
                        self._config(experiment, 48)) == 0
    assert dap._confirm(self._runs(), dict(noisy), None,
                        self._config(experiment, 0)) == 0

  def test_paired_over_uses_the_rounds_each_shares(self):
    # fixed:1 ran 2 confirming rounds more than fixed:2; each is paired
    # with DAP's rounds it shares.
    got = dap._paired_over([1.0, 1.0, 1.0, 3.0, 3.0],
                           {"fixed:1": [1.0, 1.0, 1.0, 3.0, 3.0],
                            "fixed:2": [0.5, 0.5, 0.5]})
    assert got["against"] == "fixed:2" and got["ratio"] == pytest.approx(2)
    got = dap._paired_over([1.0, 1.0, 1.0, 1.1, 1.1],
                           {"fixed:1": [1.0, 1.0, 1.0, 1.0, 1.0],
                            "fixed:2": [2.0, 2.0, 2.0]})
    assert got["against"] == "fixed:1" and got["ratio"] == pytest.approx(1)


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
