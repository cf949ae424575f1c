"""experiments.gpu_check --dry_run: every part of the GPU check on XLA:CPU;
what needs CUDA is reported as skipped, never made up. Each part's result
is written as it ends, a failed part does not stop the others, and the
targets and the table take missing, failed or empty parts."""

import json
import os
import shutil

from absl import app
import pytest

from experiments import gpu_check
from jcxl import _jcxl


def _read(path):
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def test_dry_run_runs_every_part(experiment, tmp_path):
  config = experiment(gpu_check)(
      "--dry_run", f"--run_dir={tmp_path}", "--transfer_bytes=2MiB",
      "--repeats=2", "--rounds=1", "--equality_steps=2", "--scan_reps=2",
      f"--nvme_dir={tmp_path}")
  result = gpu_check.run(config)
  assert list(result["parts"]) == list(gpu_check.PARTS)
  for name in gpu_check.PARTS:  # each part also in a file of its own
    part = _read(os.path.join(tmp_path, f"{name}.json"))
    assert "error" not in part, (name, part)
    assert part["wall_s"] > 0
  written = _read(os.path.join(tmp_path, "gpu_check.json"))
  assert written["matmul_precision"] == "highest"
  assert list(written["parts"]) == list(gpu_check.PARTS)
  assert not result["gpu"] and "DRY RUN" in result["kind"]
  assert result["jcxl_built_with_cuda"] == _jcxl.cuda_built
  parts = result["parts"]
  assert [m["passed"] for m in parts["equality"]["models"]] == [True, True]
  # (a): 32 layers x 2 reps, per tier and prefetch, every one exact.
  runs = parts["scan_exact"]["runs"]
  assert [(r["tier"], r["prefetch"]) for r in runs] == [
      ("host", 1), ("host", 2), ("cxl", 1), ("cxl", 2)]
  assert all(r["layers_exact"] == r["layers_fetched"] == 64 for r in runs)
  assert all("skipped" in r["cuda_counters"] for r in runs)
  # (b): the second object really took the first one's place.
  assert [t["same_offsets"] for t in parts["reuse"]["tiers"]] == [True, True]
  assert parts["reuse"]["passed"]
  tiers = parts["bandwidth"]["tiers"]
  assert [t["tier"] for t in tiers] == ["host", "cxl", "nvme"]
  assert all(t["h2d_gbps"] > 0 and t["d2h_gbps"] > 0 for t in tiers)
  assert "EMULATED" in tiers[1]["label"]
  assert "skipped" in parts["bandwidth"]["cudaMemcpyAsync"]
  # (c): all three measured; their ratio is reported, not judged here.
  overlap = parts["overlap"]
  assert min(overlap["compute_ms"], overlap["transfer_ms"],
             overlap["combined_ms"]) > 0
  # (d): both injected faults failed their step, the next ones are exact.
  faults = parts["faults"]
  assert "DATA_LOSS" in faults["read_error"]
  assert "DATA_LOSS" in faults["write_error"]
  assert faults["passed"]
  # (e): the 1 GiB host tier was reserved, not committed.
  first = parts["first_fetch"]
  assert first["exact"] and first["rss_growth_bytes"] < (512 << 20)
  modes = parts["steps"]["modes"]
  assert list(modes) == list(gpu_check.STEP_MODES)
  assert all(m["step_ms"] > 0 and not m["skipped"] for m in modes.values())
  for mode in ("jax_host", "cxl_fixed", "cxl_dap"):
    assert modes[mode]["max_loss_rel_diff"] <= 1e-4
  assert parts["steps"]["transfer_floor_ms"] > 0
  targets = result["targets"]
  assert "CPU dry run" in targets["platform"]
  assert targets["offloaded_over_transfer_floor"] > 0
  assert targets["not_evaluated"] == {
      "cudaMemcpyAsync": "no CUDA GPU (or jcxl built without CUDA)"}


def test_parts_are_written_as_they_end_and_survive_a_kill(
    experiment, tmp_path, monkeypatch):
  """A part that fails records its error and the next one runs; a run
  killed in a later part (a deadline) keeps what ended before."""
  def broken(config, result):
    raise RuntimeError("the device fell over")

  def killed(config, result):
    # What ended so far is already on disk when the deadline hits.
    on_disk = _read(os.path.join(tmp_path, "gpu_check.json"))
    assert list(on_disk["parts"]) == ["equality", "reuse"]
    raise KeyboardInterrupt

  monkeypatch.setattr(gpu_check, "PART_FNS", {
      "equality": lambda config, result: {"models": [], "passed": True},
      "reuse": broken, "steps": killed})
  config = experiment(gpu_check)(
      "--dry_run", f"--run_dir={tmp_path}", "--parts=equality,reuse,steps",
      f"--nvme_dir={tmp_path}")
  with pytest.raises(KeyboardInterrupt):
    gpu_check.run(config)
  written = _read(os.path.join(tmp_path, "gpu_check.json"))
  assert written["parts"]["equality"]["passed"]
  assert written["parts"]["reuse"]["error"] == (
      "RuntimeError: the device fell over")
  assert written["targets"]["not_evaluated"]["reuse"].startswith("failed")
  assert not os.path.exists(os.path.join(tmp_path, "steps.json"))


def test_reuse_fails_where_the_second_object_lands_elsewhere(
    experiment, tmp_path, monkeypatch):
  """(b) tests reuse only if the second object took the first one's
  offsets: exact bytes at another offset do not pass it."""
  offsets = iter(range(100))  # every object at a new offset
  monkeypatch.setattr(gpu_check, "_offset", lambda pool, x: next(offsets))
  config = experiment(gpu_check)(
      "--dry_run", f"--run_dir={tmp_path}", "--transfer_bytes=64KiB",
      "--parts=reuse", f"--nvme_dir={tmp_path}")
  part = gpu_check.reuse(config, {})
  assert [t["same_offsets"] for t in part["tiers"]] == [False, False]
  assert all(t["second_exact"] and t["stored_exact"] for t in part["tiers"])
  assert not any(t["passed"] for t in part["tiers"])
  assert not part["passed"]


def test_targets_and_table_take_missing_failed_and_empty_parts():
  header = {"device": "cpu:0", "kind": "DRY RUN", "gpu": False}
  nothing = gpu_check.targets({**header, "parts": {}})
  assert set(nothing["not_evaluated"]) >= {"equality", "bandwidth", "steps"}
  empty = {**header, "parts": {
      "equality": {"models": [], "passed": False, "wall_s": 1.0},
      "bandwidth": {"tiers": [], "cudaMemcpyAsync": {"skipped": "no GPU"},
                    "device_put_pinned_host": {}, "wall_s": 1.0},
      "steps": {"modes": {"resident": {"step_ms": None},
                          "cxl_fixed": {"step_ms": None}},
                "transfer_floor_ms": None, "transfer_floor": "none",
                "wall_s": 1.0},
      "overlap": {"error": "ValueError: boom", "wall_s": 0.5}}}
  targets = gpu_check.targets(empty)
  assert targets["equality_passed"] is False
  assert targets["not_evaluated"]["steps"] == (
      "no offloaded or no resident step time")
  assert targets["not_evaluated"]["overlap"] == "failed: ValueError: boom"
  assert "offloaded_over_compute" not in targets
  empty["targets"] = targets
  report = gpu_check.table(empty)
  assert "overlap: FAILED (ValueError: boom)" in report
  # Step times but no bandwidth: the floor is reported as unknown.
  floor, why = gpu_check.transfer_floor_ms(1 << 20, {"parts": {}})
  assert floor is None and "bandwidth" in why


def test_without_a_gpu_it_asks_for_dry_run(experiment, tmp_path):
  config = experiment(gpu_check)(f"--run_dir={tmp_path}")
  with pytest.raises(app.UsageError, match="--dry_run"):
    gpu_check.run(config)


def test_bad_flags_are_refused(experiment):
  with pytest.raises(app.UsageError, match="--transfer_bytes"):
    experiment(gpu_check)("--dry_run", "--transfer_bytes=100")
  with pytest.raises(app.UsageError, match="--n_embd"):
    experiment(gpu_check)("--dry_run", "--transfer_bytes=1MiB", "--n_embd=100")
  with pytest.raises(app.UsageError, match="--scan_reps"):
    experiment(gpu_check)("--dry_run", "--scan_reps=0")
  with pytest.raises(app.UsageError, match="--parts"):
    experiment(gpu_check)("--dry_run", "--scan_reps=1",
                          "--parts=equality,warp_drive")


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
    assert _jcxl.cuda_counters() == {}  # no device used, nothing counted
