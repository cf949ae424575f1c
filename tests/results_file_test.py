"""The results file every experiment writes at the end of a run."""

import datetime
import json
import os
import re
import subprocess

from absl import flags
from absl.testing import flagsaver
import pytest

from experiments import alloc_trace
from experiments import common
from experiments import results_file

WHEN = datetime.datetime(2026, 12, 2, 21, 5, 9, tzinfo=datetime.timezone.utc)
RESULTS = {
    "title": "cxl EMULATED (link 2 GB/s, 2 us per transfer)",
    "config": {"steps": 24, "bandwidths": (0.5e9, 2e9)},
    "rows": [{"case": "mlp @ 2 GB/s", "schedule": "sync", "median_ms": 85.4,
              "round_ms": [80.0 + i for i in range(24)]},
             {"case": "mlp @ 2 GB/s", "schedule": "dap", "median_ms": 62.625,
              "round_ms": [60.5, 61.5], "note": "a|b"}],
    "summary": [{"case": "mlp", "paired": {"ratio": 0.951, "low": 0.919}}],
}


def _json_block(text: str):
  return json.loads(re.search(r"```json\n(.*)\n```", text, re.S).group(1))


class ResultsFileTest:

  def test_writes_header_tables_and_every_value(self, tmp_path,
                                                monkeypatch):
    monkeypatch.setenv(results_file.RESULTS_DIR_ENV, str(tmp_path))
    path = results_file.write("dap", RESULTS, ["dap", "--steps=24"], WHEN)
    head, _ = results_file.commit()
    assert path == os.path.join(tmp_path, "dap",
                                f"2026-12-02-210509-{head}.md")
    with open(path, encoding="utf-8") as f:
      text = f.read()
    assert "| program | `python -m experiments.dap --steps=24` |" in text
    assert re.search(rf"\| commit \| ({head}|unknown \(not a git checkout\))"
                     r"(, with uncommitted changes)? \|", text)
    assert "| date | 2026-12-02 21:05 UTC |" in text
    assert re.search(r"\| machine \| \d+ cores \(\d+ usable\), .* GiB "
                     r"memory, \d+ NUMA node\(s\)", text)
    assert re.search(r"\| devices \| \d+ x .*\(cpu\); jax ", text)
    assert re.search(r"\| host allocator \| .*malloc", text)
    # A list of flat dicts is one table, its long lists summarized and a
    # cell's "|" escaped; the tuple in the config reads as a list.
    assert ("| case | schedule | median_ms | round_ms | note |" in text)
    assert ("| mlp @ 2 GB/s | sync | 85.4 | 24 values: median 91.5, 80 to "
            "103 | - |") in text
    assert "| mlp @ 2 GB/s | dap | 62.625 | 60.5, 61.5 | a\\|b |" in text
    assert "| bandwidths | 5e+08, 2e+09 |" in text
    assert _json_block(text) == json.loads(json.dumps(RESULTS))

  def test_commit_is_the_checkouts_head(self):
    try:
      head = subprocess.run(["git", "-C", results_file.REPO_ROOT, "rev-parse",
                             "--short=12", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
      pytest.skip("not a git checkout")
    short, described = results_file.commit()
    assert short == head and described.startswith(head)

  def test_a_run_names_the_commit_it_started_on(self, tmp_path,
                                                monkeypatch):
    monkeypatch.setenv(results_file.RESULTS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(results_file, "_at_start", None)
    monkeypatch.setattr(results_file, "commit", lambda: ("a1", "a1"))
    results_file.note_start()
    # Committed to while it ran.
    monkeypatch.setattr(results_file, "commit", lambda: ("b2", "b2"))
    path = results_file.write("dap", {"a": 1}, ["dap"], WHEN)
    assert path.endswith("-a1.md")
    with open(path, encoding="utf-8") as f:
      assert "| commit | a1 |" in f.read()

  def test_two_runs_in_one_second_get_two_files(self, tmp_path, monkeypatch):
    monkeypatch.setenv(results_file.RESULTS_DIR_ENV, str(tmp_path))
    results_file.note_start()
    first = results_file.write("max_model", {"a": 1}, ["max_model"], WHEN)
    results_file.note_start()
    second = results_file.write("max_model", {"a": 2}, ["max_model"], WHEN)
    assert first != second and second.endswith("-2.md")
    with open(first, encoding="utf-8") as f:
      assert _json_block(f.read()) == {"a": 1}

  def test_one_run_writing_as_it_goes_leaves_one_whole_file(
      self, tmp_path, monkeypatch):
    # gpu_check writes its results as each part ends: one file, the last.
    monkeypatch.setenv(results_file.RESULTS_DIR_ENV, str(tmp_path))
    results_file.note_start()
    first = results_file.write("gpu_check", {"parts": 1}, ["gpu_check"])
    second = results_file.write("gpu_check", {"parts": 2}, ["gpu_check"])
    assert first == second
    assert sorted(os.listdir(tmp_path / "gpu_check")) == [
        os.path.basename(first)]
    with open(first, encoding="utf-8") as f:
      assert _json_block(f.read()) == {"parts": 2}

  def test_an_unwritable_folder_warns_instead_of_failing(self, tmp_path,
                                                        monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(results_file.RESULTS_DIR_ENV, str(blocker))
    warnings = []
    monkeypatch.setattr(results_file.logging, "warning",
                        lambda msg, *args: warnings.append(msg % args))
    assert results_file.write("dap", RESULTS, ["dap"], WHEN) is None
    assert len(warnings) == 1
    assert warnings[0].startswith("results file for dap not written:")

  @pytest.mark.parametrize("argv0, name", [
      ("/repo/experiments/dap.py", "dap"),
      ("/repo/experiments/train/__main__.py", "train"),
      ("max_model", "max_model"),
  ])
  def test_program_name(self, argv0, name):
    assert results_file.program_name(argv0) == name

  def test_run_program_writes_one_file_per_run(self, tmp_path, monkeypatch):
    monkeypatch.setenv(results_file.RESULTS_DIR_ENV, str(tmp_path))

    class Config:
      json_out = None

      def validate(self):
        pass

    out = common.run_program(["/x/experiments/pool_bandwidth.py"], Config,
                             lambda config: {"rows": [{"tier": "host"}]})
    assert out == {"rows": [{"tier": "host"}]}
    [name] = os.listdir(tmp_path / "pool_bandwidth")
    with open(tmp_path / "pool_bandwidth" / name, encoding="utf-8") as f:
      assert _json_block(f.read()) == out

  def test_the_default_folder_is_the_checkouts_docs_results(self,
                                                            monkeypatch):
    monkeypatch.delenv(results_file.RESULTS_DIR_ENV)
    assert results_file.results_dir() == os.path.join(
        results_file.REPO_ROOT, "docs", "results")


class AllocTraceResultsTest:

  def test_its_main_writes_a_results_file(self, tmp_path, monkeypatch):
    monkeypatch.setenv(results_file.RESULTS_DIR_ENV, str(tmp_path))
    with flagsaver.flagsaver():
      flags.FLAGS(["alloc_trace", "--models=gpt2", "--steps=1"])
      alloc_trace.main(["alloc_trace"])
    [name] = os.listdir(tmp_path / "alloc_trace")
    with open(tmp_path / "alloc_trace" / name, encoding="utf-8") as f:
      results = _json_block(f.read())
    assert results["config"]["models"] == ["gpt2"]
    assert [(r["model"], r["allocator"]) for r in results["rows"]] == [
        ("gpt2", "hybrid"), ("gpt2", "first_fit")]
