"""A small run of experiments/dap.py and its flag checks."""

from __future__ import annotations

import csv

from absl import app
import pytest

from experiments import dap


@pytest.fixture
def run_program(experiment):
  config = experiment(dap)
  return lambda *args: dap.run(config(*args))


class DapExperimentTest:

  def test_small_run_writes_table_plots_and_slowdown(self, run_program,
                                                     tmp_path):
    out = tmp_path / "run"
    results = run_program("--models=wide_narrow", "--bandwidths=4GB/s",
                          "--schedules=sync,fixed:1,dap", "--steps=1",
                          "--tune_steps=8", "--slowdown=2",
                          f"--run_dir={out}")
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["schedule"] for r in rows] == ["dap", "sync", "fixed:1",
                                             dap.UNMEASURED]
    assert all(float(r["step_ms"]) > 0 and float(r["predicted_ms"]) > 0
               for r in rows)
    assert all(r["within_budget"] == "True" for r in rows)
    for name in ("results.md", "step_time.png", "memory.png", "stall.png"):
      assert (out / name).stat().st_size > 0
    text = (out / "results.md").read_text()
    assert "EMULATED" in text and "Link slowdown" in text
    assert results["slowdown"]["slow_gbps"] == pytest.approx(2.0)

  @pytest.mark.parametrize("args, message", [
      (["--models=nope"], "unknown model"),
      (["--schedules=fixed:x,dap"], "schedule must be"),
      (["--schedules=sync"], "must include dap"),
      (["--slowdown=0.5"], "--slowdown"),
  ])
  def test_bad_flags(self, run_program, args, message):
    with pytest.raises(app.UsageError, match=message):
      run_program(*args)

  def test_bad_bandwidth_flag(self, run_program):
    with pytest.raises(app.UsageError, match="--bandwidths"):
      run_program("--bandwidths=fast")
