"""A small run of experiments/dap_cost.py and its flag checks."""

from __future__ import annotations

import json

from absl import app
import pytest

from experiments import dap_cost


@pytest.fixture
def config(experiment):
  return experiment(dap_cost)


class DapCostExperimentTest:

  def test_small_run_reports_the_tuning_cost(self, config, tmp_path):
    out = tmp_path / "cost.json"
    # No compile time to spend: DAP drops every plan to race and keeps its
    # first one; the limit says so.
    results = dap_cost.run(config(
        "--models=vit", "--fixed=sync", "--steps=2", "--block_steps=1",
        "--max_compile_s=0", f"--json_out={out}"))
    (r,) = results["results"]
    assert r["model"] == "vit" and "EMULATED" in r["cxl"]
    assert r["settle_limited"] == "compile"
    assert r["settle_compiles"] == 1 and r["settle_compile_s"] > 0
    assert r["settled_after_steps"] == r["settle_steps"]
    assert (r["settle_steps"] == r["settle_waited_steps"]
            + r["settle_tuning_steps"])
    assert r["timed_rounds"] == 2 and set(r["step_ms"]) == {"sync", "dap"}
    assert r["best_fixed"] == "sync"
    paired = r["dap_over_best_fixed_paired"]
    assert paired["low"] <= paired["ratio"] <= paired["high"]
    assert r["dap_slower_beyond_noise"] == (paired["low"] > 1)
    assert r["first_compile_offloaded_over_resident"] == pytest.approx(
        r["first_compile_offloaded_s"] / r["first_compile_resident_s"])
    assert any(e["what"] == "compile limit" for e in r["tuner_history"])
    json.dumps(results)  # what run_program writes to --json_out

  @pytest.mark.parametrize("args, message", [
      (["--models=bert"], "unknown model 'bert'"),
      (["--fixed=bucket"], "is not 'sync' or 'fixed:k'"),
      (["--steps=1", "--block_steps=2"], "--block_steps must be"),
      (["--max_tuning_steps=0"], "TunerOptions.max_tuning_steps"),
      (["--max_compile_s=-1"], "TunerOptions.max_compile_s"),
  ])
  def test_bad_flags_are_named(self, config, args, message):
    with pytest.raises(app.UsageError, match=message):
      config(*args)
