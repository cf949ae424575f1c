"""experiments.gpu_check --dry_run: the GPU check's every part that needs no
GPU, on XLA:CPU; what needs CUDA is reported as skipped, never made up."""

import json
import os
import shutil

from absl import app
import pytest

from experiments import gpu_check
from jcxl import _jcxl


def test_dry_run_measures_everything_but_cuda(experiment, tmp_path):
  config = experiment(gpu_check)(
      "--dry_run", f"--run_dir={tmp_path}", "--transfer_bytes=2MiB",
      "--repeats=2", "--rounds=1", "--equality_steps=2",
      f"--nvme_dir={tmp_path}")
  result = gpu_check.run(config)
  with open(os.path.join(tmp_path, "gpu_check.json"), encoding="utf-8") as f:
    assert json.load(f)["transfer_bytes"] == result["transfer_bytes"]
  assert not result["gpu"] and "DRY RUN" in result["kind"]
  assert result["jcxl_built_with_cuda"] == _jcxl.cuda_built
  assert [e["passed"] for e in result["equality"]] == [True, True]
  tiers = result["bandwidth"]["tiers"]
  assert [t["tier"] for t in tiers] == ["host", "cxl", "nvme"]
  assert all(t["h2d_gbps"] > 0 and t["d2h_gbps"] > 0 for t in tiers)
  assert "EMULATED" in tiers[1]["label"]
  assert "skipped" in result["bandwidth"]["cudaMemcpyAsync"]
  assert result["bandwidth"]["device_put_pinned_host"]["h2d_gbps"] > 0
  modes = result["steps"]["modes"]
  assert list(modes) == list(gpu_check.STEP_MODES)
  assert all(m["step_ms"] > 0 and not m["skipped"] for m in modes.values())
  for mode in ("jax_host", "cxl_fixed", "cxl_dap"):
    assert modes[mode]["max_loss_rel_diff"] <= 1e-4
  assert result["targets"] == {"skipped": "needs a CUDA GPU"}


def test_without_a_gpu_it_asks_for_dry_run(experiment, tmp_path):
  config = experiment(gpu_check)(f"--run_dir={tmp_path}")
  with pytest.raises(app.UsageError, match="--dry_run"):
    gpu_check.run(config)


def test_bad_sizes_are_refused(experiment):
  with pytest.raises(app.UsageError, match="--transfer_bytes"):
    experiment(gpu_check)("--dry_run", "--transfer_bytes=100")
  with pytest.raises(app.UsageError, match="--width"):
    experiment(gpu_check)("--dry_run", "--transfer_bytes=1MiB", "--width=100")


def test_cuda_handlers_are_built_where_a_toolkit_is():
  """CI compiles the CUDA path: where CMake finds a CUDA toolkit, the
  extension carries the CUDA handlers, one per CPU handler."""
  toolkit = shutil.which("nvcc") or os.path.isdir("/usr/local/cuda")
  if not toolkit:
    pytest.skip("no CUDA toolkit on this machine")
  assert _jcxl.cuda_built
  assert sorted(_jcxl.cuda_registrations()) == sorted(_jcxl.registrations())
  if not _jcxl.cuda_device_count():  # no driver or no GPU: a clear error
    with pytest.raises(RuntimeError, match="CUDA error"):
      _jcxl.cuda_memcpy_bandwidth(0, 1 << 20, True, 1)
