"""One flag name per concept across the experiment programs: depth is
--n_layer, width --n_embd (--n_embds where a program sweeps it), a list of
schedules --schedules; the old names fail as unknown flags."""

import importlib.util
import os

from absl import flags
from absl.testing import flagsaver
import pytest

from experiments import compare
from experiments import dap
from experiments import gpu_check
from experiments import max_model
from experiments import stream_overlap

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ExperimentFlagsTest:

  def test_no_concept_has_two_names(self):
    spec = importlib.util.spec_from_file_location(
        "measure", os.path.join(_ROOT, "tools", "measure.py"))
    measure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(measure)
    assert measure.experiment_flag_names()["concepts"] == {}

  @pytest.mark.parametrize("program, old, new", [
      (gpu_check, "--layers=4", "--n_layer=4"),
      (gpu_check, "--width=64", "--n_embd=64"),
      (stream_overlap, "--layers=4", "--n_layer=4"),
      (compare, "--widths=64", "--n_embds=64"),
      (max_model, "--schedule=fixed:0", "--schedules=fixed:0"),
      (dap, "--schedule=fixed:0", "--schedules=fixed:0"),
  ])
  def test_an_old_name_is_an_unknown_flag(self, program, old, new):
    saved = flagsaver.save_flag_values(program.FLAGS)
    try:
      program.FLAGS([program.__name__, new])  # the new name parses
      with pytest.raises(flags.UnrecognizedFlagError,
                         match=old.split("=")[0].lstrip("-")):
        program.FLAGS([program.__name__, old])
    finally:
      flagsaver.restore_flag_values(saved, program.FLAGS)
