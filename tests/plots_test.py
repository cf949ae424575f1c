"""Plots are optional: without matplotlib a program still finishes its
work, writes its results and skips its plots with a warning."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from experiments import plots
from experiments import results_file
from tests import train_test


@pytest.fixture
def no_matplotlib(monkeypatch):
  """`import matplotlib` fails, as where the `experiments` extra is not
  installed; returns the warnings logged."""
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  warnings = []
  monkeypatch.setattr(plots.logging, "warning",
                      lambda msg, *args: warnings.append(msg % args))
  return warnings


class IfAvailableTest:

  def test_runs_the_plot_where_matplotlib_is_installed(self):
    assert plots.if_available(lambda a, b=0: a + b, 1, b=2) == 3

  def test_skips_the_plot_with_a_warning_without_matplotlib(
      self, no_matplotlib):
    called = []
    assert plots.if_available(called.append, "plot") is None
    assert not called
    assert len(no_matplotlib) == 1
    assert no_matplotlib[0].startswith("plots skipped: ")
    assert "pip install -e '.[experiments]'" in no_matplotlib[0]


class TrainWithoutMatplotlibTest:

  def test_writes_its_results_and_skips_the_plots(self, no_matplotlib,
                                                  tmp_path, monkeypatch):
    monkeypatch.setenv(results_file.RESULTS_DIR_ENV, str(tmp_path / "res"))
    run_dir = tmp_path / "run"
    train_test.run_main(*train_test.TINY, "--mode=resident",
                        f"--run_dir={run_dir}")
    with open(run_dir / "summary.json", encoding="utf-8") as f:
      summary = json.load(f)
    assert summary["plots"] is None
    assert math.isfinite(summary["last_loss"])
    assert not list(run_dir.glob("*.png"))
    assert (run_dir / "metrics.csv").stat().st_size > 0
    assert len(os.listdir(tmp_path / "res" / "train")) == 1
    assert any(w.startswith("plots skipped: ") for w in no_matplotlib)

