"""examples/: each script runs as a user runs it, on a tiny configuration."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import jcxl

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ("--steps=6", "--log_every=1", "--width=256", "--layers=4",
        "--batch=8", "--device_budget=2MiB")


def run_example(*args: str) -> str:
  """Runs examples/train_flax.py in a fresh process; returns its stdout."""
  done = subprocess.run(
      [sys.executable, os.path.join(_ROOT, "examples", "train_flax.py"),
       *args], capture_output=True, text=True, timeout=600, cwd=_ROOT,
      env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def held_out_losses(stdout: str) -> list[float]:
  """The held-out loss before and after training."""
  return [float(x) for x in re.findall(r"^held-out loss (\S+) ", stdout,
                                       re.M)]


def losses(stdout: str) -> list[float]:
  return [float(x) for x in re.findall(r"^step +\d+  loss (\S+)$", stdout,
                                       re.M)]


@pytest.fixture(scope="module")
def runs():
  return {"offloaded": run_example(*TINY),
          "resident": run_example(*TINY, "--nooffload")}


class TrainFlaxExampleTest:

  def test_offloaded_losses_equal_resident(self, runs):
    got, want = losses(runs["offloaded"]), losses(runs["resident"])
    assert len(got) == 6
    np.testing.assert_allclose(got, want, rtol=1e-5)
    held_out = [held_out_losses(runs[k]) for k in ("offloaded", "resident")]
    np.testing.assert_allclose(held_out[0], held_out[1], rtol=1e-5)
    untrained, trained = held_out[0]
    assert trained < untrained  # it learns

  def test_state_streamed_under_a_budget_smaller_than_the_state(self, runs):
    out = runs["offloaded"]
    state = re.search(r"params \+ adamw state: (.+)$", out, re.M).group(1)
    need = re.search(r"the step needs (.+) of device memory", out).group(1)
    fetched = re.search(r"streamed (.+) in, (.+) out", out)
    as_bytes = jcxl.units.parse_bytes
    assert as_bytes(need) <= as_bytes("2MiB") < as_bytes(state)
    # Each step fetched every leaf of the state at least once, and stored
    # the updated ones back.
    assert as_bytes(fetched.group(1)) >= 6 * as_bytes(state)
    assert as_bytes(fetched.group(2)) > 0
    assert "state in cxl" in out
    for layer in ("['inp']", "['hidden_0']", "['hidden_3']", "['out']"):
      assert layer in out  # the printed plan streams each layer
