"""experiments.train: a tiny run in each mode, its files, its flag checks."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import re

from absl import app
from absl.testing import flagsaver
import numpy as np
import pytest

from experiments import train

TINY = ("--model=gpt2-tiny", "--steps=6", "--batch=2", "--seq_len=16",
        "--warmup_steps=2", "--eval_every=3", "--eval_batches=2",
        "--log_every=1", "--data_bytes=256KiB", "--device_budget=8MiB",
        "--seed=3")
FILES = ("config.json", "metrics.jsonl", "metrics.csv", "plan.txt",
         "plan.json", "summary.json", "loss.png", "throughput.png",
         "layer_stall.png")


def run_main(*args: str) -> None:
  """Calls the program's main with a command line; restores its flags."""
  saved = flagsaver.save_flag_values(train.FLAGS)
  try:
    train.main(train.FLAGS(["train", *args]))
  finally:
    flagsaver.restore_flag_values(saved, train.FLAGS)


def read_jsonl(path) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """One tiny run per mode, same seed: {mode: (run_dir, stdout)}."""
  out = {}
  for mode in ("cxl", "resident"):
    run_dir = tmp_path_factory.mktemp(mode)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
      run_main(*TINY, f"--mode={mode}", f"--run_dir={run_dir}")
    out[mode] = (run_dir, stdout.getvalue())
  return out


class TrainRunTest:

  def test_writes_every_file(self, runs):
    for run_dir, _ in runs.values():
      for name in FILES:
        assert (run_dir / name).stat().st_size > 0, name
      for name in FILES:
        if name.endswith(".png"):
          assert (run_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

  def test_metrics_are_well_formed(self, runs):
    run_dir, _ = runs["cxl"]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if r["kind"] == "train"]
    eval_rows = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train_rows] == list(range(1, 7))
    assert [r["step"] for r in eval_rows] == [3, 6]
    for r in train_rows:
      assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0
      assert 0 <= r["stall_frac"] <= 1 and r["wall_s"] > 0
      assert r["bytes_fetched"] > 0 and r["bytes_stored"] > 0
    assert all(math.isfinite(r["val_loss"]) for r in eval_rows)
    with open(run_dir / "metrics.csv", encoding="utf-8") as f:
      table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    assert float(table[0]["loss"]) == pytest.approx(rows[0]["loss"])
    assert {"step", "loss", "tokens_per_s", "stall_frac", "bytes_fetched",
            "bytes_stored", "wall_s", "val_loss"} <= set(table[0])

  def test_offloaded_losses_equal_resident(self, runs):
    # The same model trained: every logged train and validation loss.
    got = read_jsonl(runs["cxl"][0] / "metrics.jsonl")
    want = read_jsonl(runs["resident"][0] / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in got] == [
        (r["kind"], r["step"]) for r in want]
    key = lambda r: r["loss"] if r["kind"] == "train" else r["val_loss"]
    np.testing.assert_allclose([key(r) for r in got],
                               [key(r) for r in want], rtol=1e-5)
    assert key(got[-2]) < key(got[0])  # it learns

  def test_summary_and_memory(self, runs):
    run_dir, _ = runs["cxl"]
    summary = json.loads((run_dir / "summary.json").read_text())
    memory = summary["memory"]
    assert summary["first_loss"] > summary["last_loss"]
    assert [s for s, _ in summary["val_losses"]] == [3, 6]
    assert memory["resident_step_need_bytes"] > memory[
        "offloaded_step_need_bytes"] > 0
    assert memory["offloaded_fits_budget"]
    assert memory["device_budget_bytes"] == 8 << 20
    assert summary["mean_tokens_per_s"] > 0
    assert set(summary["layer_wait_s"]) >= {"blocks_0", "blocks_1", "wte"}
    resident = json.loads((runs["resident"][0] / "summary.json").read_text())
    assert resident["memory"]["offloaded_step_need_bytes"] is None
    assert resident["bytes_fetched"] == 0

  def test_config_records_flags_emulation_and_machine(self, runs):
    run_dir, _ = runs["cxl"]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["flags"]["steps"] == 6
    assert config["flags"]["link"]["bandwidth_bytes_per_s"] == 16e9
    assert config["emulation"]["tier"] == "cxl"
    assert config["machine"]["cores"] >= 1
    assert config["machine"]["memory_bytes"] > 0
    assert config["machine"]["disk"]["path"] == str(run_dir)
    assert config["model"]["config"]["param_dtype"] == "float32"

  def test_plan_names_the_layers(self, runs):
    run_dir, _ = runs["cxl"]
    assert "['blocks_1']" in (run_dir / "plan.txt").read_text()
    plan = json.loads((run_dir / "plan.json").read_text())
    assert any("blocks_0" in layer["name"] for layer in plan["layers"])

  def test_every_line_names_the_emulated_tier(self, runs):
    run_dir, text = runs["cxl"]
    label = json.loads((run_dir / "config.json").read_text())[
        "emulation"]["label"]
    if label.startswith("cxl (EMULATED"):  # no CXL memory here
      assert re.search(r"link 16\.0 GB/s, 2\.0 us per transfer", label)
    progress = [l for l in text.splitlines()
                if l.startswith(("step ", "eval "))]
    assert len(progress) == 8
    assert all(label in line for line in progress)
    summary = text[text.index("summary:"):]
    assert label in summary and str(run_dir) in summary
    assert "resident step" in summary and "budget 8.00 MiB" in summary


class TrainFlagsTest:

  @pytest.mark.parametrize("args, match", [
      (["--model=gpt5"], r"--model must be one of 'byte-gpt'.*'gpt5'"),
      (["--tier=nvme", "--nvme_dir=/nonexistent/jcxl"],
       r"--nvme_dir '/nonexistent/jcxl' does not exist"),
      (["--device_budget=16KiB"],
       r"--device_budget 16.00 KiB is smaller than one layer's weights "
       r"\(blocks_0"),
      (["--device_budget=lots"], r"--device_budget must be a byte count"),
      (["--schedule=eventually"], r"--schedule: schedule must be"),
      (["--mode=gpu"], r"--mode must be one of 'cxl', 'resident'"),
      (["--tier=ssd"], r"--tier must be one of"),
      (["--seq_len=65"], r"--seq_len 65 is longer than --model gpt2-tiny"),
      (["--warmup_steps=6"], r"--warmup_steps must be >= 0 and less than"),
      (["--batch=0"], r"--batch must be positive"),
      (["--link_bandwidth=0GB/s"], r"--link_bandwidth must be positive"),
      (["--link_latency_us=-1"], r"--link_latency_us must be >= 0"),
  ])
  def test_bad_flags_are_usage_errors(self, tmp_path, args, match):
    with pytest.raises(app.UsageError, match=match):
      run_main(*TINY, f"--run_dir={tmp_path / 'run'}", *args)
    assert not (tmp_path / "run").exists()  # rejected before running

  def test_stray_arguments_are_rejected(self):
    with pytest.raises(app.UsageError, match="unexpected arguments: extra"):
      run_main(*TINY, "extra")
