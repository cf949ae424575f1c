"""A small run of experiments/compare.py and its flag checks."""

from __future__ import annotations

import csv

from absl import app
import pytest

from experiments import compare


@pytest.fixture
def config(experiment):
  return experiment(compare)


SMALL = ("--n_layer=2", "--n_embds=64,128", "--rounds=2", "--warmup=1",
         "--tune_steps=4", "--batch=2", "--seq_len=16")


class CompareExperimentTest:

  def test_small_run_compares_the_modes(self, config, tmp_path):
    out = tmp_path / "run"
    # Resident fits the narrow model only; the search goes to width 256.
    results = compare.run(config(*SMALL, "--device_budget=6MiB", "--max_width=256",
                  f"--run_dir={out}"))
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [(r["width"], r["mode"]) for r in rows] == [
        (w, m) for w in ("64", "128") for m in compare.MODES]
    by = {(r["width"], r["mode"]): r for r in rows}
    # Where resident fits, every mode trained through the same losses.
    for mode in compare.MODES[1:]:
      row = by[("64", mode)]
      assert float(row["step_ms"]) > 0 and int(row["steps"]) >= 3
      assert float(row["max_loss_rel_diff"]) <= compare.LOSS_RTOL, row
      assert float(row["run_loss_rel_diff"]) >= float(
          row["max_loss_rel_diff"])
    # The wider model is over the budget resident, not offloaded.
    assert by[("128", "resident")]["fits"] == "False"
    assert "> budget" in by[("128", "resident")]["skipped"]
    assert by[("128", "cxl_fixed")]["fits"] == "True"
    assert int(by[("128", "cxl_fixed")]["device_need"]) <= 6 * 2**20
    search = list(csv.DictReader(open(out / "search.csv")))
    assert {r["mode"] for r in search} == set(compare.MODES)
    largest = results["largest"]
    assert largest["cxl_fixed"]["params"] > largest["resident"]["params"]
    summary = results["summary"]
    assert set(summary["per_width"]) == {64, 128} or set(
        summary["per_width"]) == {64}
    for name in ("results.md", "throughput.png", "latency.png",
                 "largest.png", "loss.png"):
      assert (out / name).stat().st_size > 0
    text = (out / "results.md").read_text()
    # The paper's figures beside the measured ones; emulation labelled.
    assert "72.7%" in text and "62.9%" in text and "1.14x" in text
    assert "EMULATED" in text and "link 16.0 GB/s" in text
    assert "XLA:CPU" in results["title"] and "cores" in results["title"]

  @pytest.mark.parametrize("args, message", [
      (["--model=bert"], "unknown model 'bert'"),
      (["--modes=resident,zero"], "unknown mode 'zero'"),
      (["--n_embds=100"], "not a positive multiple of 64"),
      (["--n_embds=64", "--device_budget=1KiB"], "smaller than one layer"),
      (["--nvme_dir=/nonexistent/jcxl"], "does not exist"),
      (["--link_bandwidth=fast"], "--link_bandwidth"),
  ])
  def test_bad_flags(self, config, tmp_path, args, message):
    with pytest.raises(app.UsageError, match=message):
      config(f"--run_dir={tmp_path}", *args)

  def test_nvme_dir_must_be_a_directory(self, config, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(app.UsageError, match="is not a directory"):
      config(f"--run_dir={tmp_path}", f"--nvme_dir={a_file}")
