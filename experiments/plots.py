"""PNG plots of a training run (experiments.train), matplotlib's Agg.

Figures are built with ``matplotlib.figure.Figure`` rather than pyplot: no
global figure state and no display backend, so plotting works on a headless
machine and inside tests. Every title carries the run's label (the tier the
state lived in, and whether and how it was emulated).

matplotlib is optional (the `experiments` extra): `if_available` runs a
program's plots where it is installed and otherwise skips them with a
warning, after the program has written its results.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from absl import logging

_WIDTH = 70  # title characters per line
_T = TypeVar("_T")


def if_available(plot: Callable[..., _T], *args: Any, **kwargs: Any
                 ) -> _T | None:
  """`plot(*args, **kwargs)`, or None with a warning where matplotlib is
  not installed: a program never fails after its work for want of its
  plots."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    logging.warning("plots skipped: %s (install the `experiments` extra: "
                    "pip install -e '.[experiments]', or pip install "
                    "matplotlib)", e)
    return None
  return plot(*args, **kwargs)


def _figure(title: str, label: str) -> tuple[Any, Any]:
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  figure = Figure(figsize=(8, 5), dpi=100, layout="constrained")
  FigureCanvasAgg(figure)
  axes = figure.add_subplot()
  axes.set_title("\n".join([title] + textwrap.wrap(label, _WIDTH)),
                 fontsize=10)
  axes.grid(True, alpha=0.3)
  return figure, axes


def _save(figure: Any, path: str) -> str:
  figure.savefig(path)
  return path


def plot_loss(rows: Sequence[Mapping[str, Any]], path: str, label: str
              ) -> str:
  """Train loss (per logged step) and validation loss against the step."""
  figure, axes = _figure("loss", label)
  train = [r for r in rows if r["kind"] == "train"]
  evals = [r for r in rows if r["kind"] == "eval"]
  axes.plot([r["step"] for r in train], [r["loss"] for r in train],
            marker=".", label="train (mean since last log)")
  if evals:
    axes.plot([r["step"] for r in evals], [r["val_loss"] for r in evals],
              marker="o", label="validation")
  axes.set_xlabel("step")
  axes.set_ylabel("cross-entropy (nats per byte)")
  axes.legend()
  return _save(figure, path)


def plot_throughput(rows: Sequence[Mapping[str, Any]], path: str, label: str
                    ) -> str:
  """Tokens per second and stall share against the step.

  Rows whose time includes compilation are left out: they would dwarf the
  steady state.
  """
  figure, axes = _figure("throughput", label)
  train = [r for r in rows if r["kind"] == "train"
           and not r.get("startup")]
  steps = [r["step"] for r in train]
  axes.plot(steps, [r["tokens_per_s"] for r in train], marker=".",
            color="tab:blue")
  axes.set_xlabel("step")
  axes.set_ylabel("tokens / s", color="tab:blue")
  axes.set_ylim(bottom=0)
  stall = axes.twinx()
  stall.plot(steps, [100 * r["stall_frac"] for r in train], marker=".",
             color="tab:red", alpha=0.6)
  stall.set_ylabel("stall (% of wall time waiting for fetches)",
                   color="tab:red")
  stall.set_ylim(0, 100)
  return _save(figure, path)


def plot_layer_stall(wait_s: Mapping[str, float], path: str, label: str
                     ) -> str:
  """A bar per layer: seconds the step waited for that layer's transfers."""
  figure, axes = _figure("time waited per layer (whole run)", label)
  names = list(wait_s)
  if names:
    axes.bar(range(len(names)), [wait_s[n] for n in names])
    axes.set_xticks(range(len(names)), names, rotation=60, ha="right",
                    fontsize=8)
  else:
    axes.text(0.5, 0.5, "no transfers: the state was resident",
              ha="center", va="center", transform=axes.transAxes)
  axes.set_ylabel("seconds waited")
  return _save(figure, path)


def plot_run(run_dir: str, rows: Sequence[Mapping[str, Any]],
             layer_wait_s: Mapping[str, float], label: str) -> list[str]:
  """Writes loss.png, throughput.png and layer_stall.png into `run_dir`."""
  return [
      plot_loss(rows, os.path.join(run_dir, "loss.png"), label),
      plot_throughput(rows, os.path.join(run_dir, "throughput.png"), label),
      plot_layer_stall(layer_wait_s, os.path.join(run_dir,
                                                  "layer_stall.png"), label),
  ]
