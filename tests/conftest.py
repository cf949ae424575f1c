"""Test setup: 8 virtual CPU devices, so sharded paths run on this machine;
and a fixture for running the experiments' programs in-process."""

from absl.testing import flagsaver
import jax
import pytest

from experiments import common
from experiments import results_file

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture
def experiment():
  """``experiment(module)`` gives ``config(*args)``: the module's flags
  parsed from `args`, its config built and validated as its main does (a
  bad value raises app.UsageError). Flags are restored afterwards."""
  saved = []

  def for_module(module):
    saved.append((module, flagsaver.save_flag_values(module.FLAGS)))

    def config(*args: str):
      module.FLAGS([module.__name__, *args])
      return common.validated_config(module.config_from_flags)
    return config

  yield for_module
  for module, values in reversed(saved):
    flagsaver.restore_flag_values(values, module.FLAGS)


@pytest.fixture(autouse=True, scope="session")
def results_files_in_tmp(tmp_path_factory):
  """Programs run by the tests write their results files to a temporary
  directory, not to the checkout's docs/results (session-wide, so that
  module-scoped fixtures that run programs see it too)."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv(results_file.RESULTS_DIR_ENV,
                 str(tmp_path_factory.mktemp("results")))
    yield
