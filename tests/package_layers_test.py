"""jcxl's packages depend one way: no import cycles (TYPE_CHECKING and
function-level imports count), and each layer imports only those below it:
offload on host_update, host_update on schedules and step_ir."""

import importlib.util
import os

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _measure():
  spec = importlib.util.spec_from_file_location(
      "measure", os.path.join(_ROOT, "tools", "measure.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


class PackageLayersTest:

  def test_no_import_cycles_between_modules_or_packages(self):
    measure = _measure()
    assert measure.import_cycles()["groups"] == []
    graph = measure._import_graph()  # pylint: disable=protected-access
    assert measure.import_cycles(measure._units(graph))["groups"] == []  # pylint: disable=protected-access

  @pytest.mark.parametrize("lower, higher", [
      ("jcxl._src.schedules", "jcxl._src.offload"),
      ("jcxl._src.schedules", "jcxl._src.host_update"),
      ("jcxl._src.host_update", "jcxl._src.offload"),
      ("jcxl._src.step_ir", "jcxl._src.offload"),
      ("jcxl._src.step_ir", "jcxl._src.host_update"),
      ("jcxl._src.step_ir", "jcxl._src.schedules"),
  ])
  def test_a_lower_layer_does_not_import_a_higher_one(self, lower, higher):
    graph = _measure()._import_graph()  # pylint: disable=protected-access
    assert any(name.startswith(lower + ".") for name in graph)
    back = sorted((name, target) for name, targets in graph.items()
                  if name.startswith(lower + ".") for target in targets
                  if target == higher or target.startswith(higher + "."))
    assert back == []

  def test_a_cycle_is_found(self, tmp_path, monkeypatch):
    # The measure itself: two modules importing each other, one of them
    # only under TYPE_CHECKING, are one cycle.
    measure = _measure()
    package = tmp_path / "jcxl"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from jcxl import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n  from jcxl.a import x\n")
    monkeypatch.setattr(measure, "ROOT", str(tmp_path))
    assert measure.import_cycles()["groups"] == [["jcxl.a", "jcxl.b"]]
