"""experiments/plan.py on a tiny model, and its flag checks."""

from __future__ import annotations

from absl import app
import pytest

from experiments import plan


@pytest.fixture
def run_program(experiment):
  config = experiment(plan)
  return lambda *args: plan.run(config(*args))


class PlanExperimentTest:

  def test_tiny_model_on_two_tiers(self, run_program, capsys):
    # A fast small host tier and a slower large cxl tier: the state does
    # not fit the host tier alone, so the placement uses both.
    results = run_program("--model=gpt2:tiny", "--batch=2", "--seq_len=32",
                          "--device_memory=64MiB", "--host_dram=300KiB",
                          "--host_link=16GB/s", "--cxl=2MiB@4GB/s",
                          "--device_tflops=1", "--max_layers=16")
    out = capsys.readouterr().out
    assert set(results["placement"].values()) == {"host", "cxl"}
    assert results["predicted_step_s"] > 0
    assert results["largest"]["layers"] > 2  # the tiny preset has 2
    assert "predicted step" in out and "largest that fits" in out

  def test_compute_measured_in_the_step(self, run_program, capsys):
    results = run_program("--model=gpt2:tiny", "--batch=2", "--seq_len=32",
                          "--device_memory=64MiB", "--cxl=2MiB@4GB/s",
                          "--measure_compute", "--max_layers=4")
    out = capsys.readouterr().out
    assert "measured in the sync step" in out
    assert results["predicted_step_s"] > 0

  def test_device_too_small_is_reported(self, run_program):
    results = run_program("--model=gpt2:tiny", "--device_memory=1KiB",
                          "--cxl=1GiB@4GB/s")
    assert "does not fit" in results["error"] or "over the" in results[
        "error"]
    assert "largest" not in results

  @pytest.mark.parametrize("args, message", [
      (["--model=bert:base"], "unknown family"),
      (["--model=gpt2:huge"], "unknown gpt2 preset"),
      (["--cxl=64GiB"], "capacity@bandwidth"),
      (["--cxl=", "--host_dram=0"], "no pool tier"),
      (["--device_memory=lots"], "device_memory"),
      (["--measure_compute", "--device_tflops=100"], "not both"),
  ])
  def test_bad_flags(self, run_program, args, message):
    with pytest.raises((app.UsageError, ValueError), match=message):
      run_program(*args)
