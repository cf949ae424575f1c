"""What every experiment's main does: reject stray arguments, build and
validate its frozen config, log it, run, and write results as JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from absl import app
from absl import logging


def run_program(argv: Sequence[str], config_from_flags: Callable[[], Any],
                run: Callable[[Any], dict]) -> dict:
  """Runs one experiment; bad flags become app.UsageError (exit 1)."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    config = config_from_flags()
    config.validate()
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  logging.info("config: %s", config)
  results = run(config)
  json_out = getattr(config, "json_out", None)
  if json_out:
    parent = os.path.dirname(json_out)
    if parent:
      os.makedirs(parent, exist_ok=True)
    with open(json_out, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=2)
    logging.info("wrote %s", json_out)
  return results
