"""A dry run of experiments/stream_overlap.py and its flag checks."""

from __future__ import annotations

import json
import re

from absl import app
from absl.testing import flagsaver
import pytest

from benchmarks import bench
from experiments import stream_overlap


@pytest.fixture
def run_program():
  """Calls the program's main with a command line; restores its flags."""
  saved = flagsaver.save_flag_values(stream_overlap.FLAGS)

  def run(*args: str) -> None:
    stream_overlap.main(stream_overlap.FLAGS(["stream_overlap", *args]))

  yield run
  flagsaver.restore_flag_values(saved, stream_overlap.FLAGS)


class BoundTest:

  def test_at_most_and_at_least(self):
    within = bench.Bound("ratio", 1.10, 1.15, at_most=True, unit="x")
    over = bench.Bound("ratio", 1.20, 1.15, at_most=True, unit="x")
    fast = bench.Bound("speed-up", 1.6, 1.6, at_most=False, unit="x",
                       detail="how")
    assert within.passed and not over.passed and fast.passed
    assert str(within) == "PASS ratio: 1.1x (target <= 1.15x)"
    assert str(over).startswith("FAIL ratio: 1.2x")
    assert str(fast) == "PASS speed-up: 1.6x (target >= 1.6x); how"
    assert over.to_json()["passed"] is False


class StreamOverlapTest:

  def test_dry_run_reports_every_variant_and_target(self, run_program,
                                                     tmp_path, capsys):
    json_out = tmp_path / "out" / "results.json"
    run_program("--dry_run", f"--json_out={json_out}", "--prefetch=1,2",
                "--link_latency_us=3")
    text = capsys.readouterr().out
    results = json.loads(json_out.read_text())
    assert results["config"]["n_layer"] == stream_overlap.DRY_RUN_SIZES[
        "n_layer"]
    names = [r["name"] for r in results["rows"]]
    assert names == ["resident", "prefetch=1", "prefetch=2",
                     "sync (prefetch=0)"]
    assert all(r["bit_identical"] for r in results["rows"])
    assert all(r["timing"]["best_s"] > 0 for r in results["rows"])
    # Every fetch of every streamed variant shows up in the trace.
    layers = results["config"]["n_layer"]
    assert [t["transfers"] for t in results["traces"]] == [layers] * 3
    # The link was set from the measured compute: one layer per layer time.
    calibration = results["calibration"]
    assert calibration["link_bytes_per_second"] * calibration[
        "compute_per_layer_s"] == pytest.approx(
            results["config"]["layer_bytes"])
    label = results["cxl"]
    assert "EMULATED" in label and "3.0 us per transfer" in label
    # Every line naming the tier says how it is emulated (the calibration
    # lines with the link of that moment), the verdicts with the final link.
    emulated = re.compile(r"cxl \(EMULATED on DRAM of nodes \[\d+\], link "
                          r"[0-9.]+ GB/s, 3\.0 us per transfer\)")
    for line in text.splitlines():
      if re.search(r"\bcxl\b", line):
        assert emulated.search(line), line
      if line.startswith(("PASS streamed", "FAIL streamed")) and (
          "resident" in line or "sync" in line) and "differs" not in line:
        assert label in line, line
    # The floor: the resident chain timed with every layer's copy running
    # beside it, plus one layer's unoverlapped fetch.
    floor = results["floor"]
    assert floor["resident_with_copies"]["best_s"] > 0
    assert floor["floor_s"] == pytest.approx(
        floor["resident_with_copies"]["best_s"] + floor["first_fetch_s"])
    best = min(r["timing"]["best_s"] for r in results["rows"]
               if r["prefetch"])
    assert floor["best_streamed_over_floor"] == pytest.approx(
        best / floor["floor_s"])
    assert "floor: resident with every layer's copy" in text
    assert results["dispatch"]["fetch_bytes"] == 4096
    assert results["dispatch"]["bit_identical"]
    assert results["dispatch"]["tier"].startswith("host")
    verdicts = [l for l in text.splitlines()
                if l.startswith(("PASS ", "FAIL "))]
    assert len(verdicts) == len(results["targets"]) == 4
    assert "DRY RUN" in text

  def test_stray_arguments_are_rejected(self, run_program):
    with pytest.raises(app.UsageError, match="unexpected arguments: extra"):
      run_program("--dry_run", "extra")

  @pytest.mark.parametrize("args, match", [
      (["--prefetch=one"], "--prefetch must be a list of integers"),
      (["--prefetch="], "--prefetch must name at least one"),
      (["--prefetch=1,1"], "--prefetch names a distance twice"),
      (["--prefetch=0"], "--prefetch distances must be >= 1 and < --n_layer"),
      (["--prefetch=16", "--n_layer=16"], "--prefetch distances must be"),
  ])
  def test_bad_flags_are_rejected(self, run_program, args, match):
    with pytest.raises(app.UsageError, match=match):
      run_program(*args)

  def test_json_out_that_is_a_directory(self, run_program, tmp_path):
    with pytest.raises(app.UsageError, match="--json_out .* is a directory"):
      run_program("--dry_run", f"--json_out={tmp_path}")

  def test_parse_flags_exits_on_a_bad_value(self, capsys):
    saved = flagsaver.save_flag_values(stream_overlap.FLAGS)
    try:
      with pytest.raises(SystemExit) as exit_info:
        stream_overlap.parse_flags(["stream_overlap", "--n_layer=1"])
    finally:
      flagsaver.restore_flag_values(saved, stream_overlap.FLAGS)
    assert exit_info.value.code == 1
    assert "--n_layer=1" in capsys.readouterr().err

  def test_imports_next_to_the_other_experiments(self):
    # They define --repeats, --batch, --dry_run, --json_out in absl's global
    # flags; this program keeps its own.
    from experiments import alloc_trace  # pylint: disable=unused-import
    from experiments import pool_bandwidth  # pylint: disable=unused-import
    assert stream_overlap.FLAGS["repeats"].default == 20
