"""The library's boundary: code outside jcxl/ and tests/ uses only the
public API, and what a step hands back is exported by name."""

from __future__ import annotations

import ast
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcxl

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the library and its own tests live: the only places that may use
# jcxl._src.
_INSIDE = ("jcxl", "tests")


def _private_imports(source: str) -> list[tuple[int, str]]:
  """(line, module) of every import of jcxl._src in `source`."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    else:
      continue
    found += [(node.lineno, n) for n in names
              if n == "jcxl._src" or n.startswith("jcxl._src.")]
  return found


def _python_files_outside_library() -> list[str]:
  listed = subprocess.run(
      ["git", "ls-files", "--cached", "--others", "--exclude-standard",
       "*.py"], cwd=_ROOT, capture_output=True, text=True, check=True)
  return [p for p in listed.stdout.split()
          if p.split("/")[0] not in _INSIDE]


class BoundaryTest:

  def test_finds_private_imports(self):
    # The check itself: each spelling of a private import is caught.
    source = ("import jcxl._src.pool\nfrom jcxl._src import bench\n"
              "from jcxl._src.units import parse_bytes\nimport jcxl\n"
              "from jcxl import units\n")
    assert [line for line, _ in _private_imports(source)] == [1, 2, 2, 3, 3]

  def test_nothing_outside_the_library_imports_jcxl_src(self):
    files = _python_files_outside_library()
    assert any(p.startswith("experiments/") for p in files), files
    offenders = []
    for path in files:
      with open(os.path.join(_ROOT, path), encoding="utf-8") as f:
        offenders += [f"{path}:{line}: {name}"
                      for line, name in _private_imports(f.read())]
    assert not offenders, (
        "jcxl._src is the library's own; use the public API (jcxl, "
        "jcxl.planning, jcxl.units, ...) instead:\n" + "\n".join(offenders))


class ExportsTest:

  def test_every_name_in_all_resolves(self):
    for name in jcxl.__all__:
      assert getattr(jcxl, name) is not None, name

  def test_a_step_and_what_it_returns_are_exported_types(self):
    with jcxl.Pool(host="16MiB", cxl="16MiB") as pool:
      params = jcxl.place({"w": np.ones((4, 4), np.float32)}, "cxl",
                          pool=pool)

      @jcxl.cxl_offload(schedule="fixed:1")
      def step(params, x):
        y = x @ params["w"]
        return jax.tree.map(lambda w: w * 0.5, params), y.sum()

      assert isinstance(step, jcxl.OffloadedStep)
      params, total = step(params, jnp.ones((2, 4), jnp.float32))
      assert float(total) == 32.0
      _, profile = step.measured_call(params, jnp.ones((2, 4), jnp.float32))
      assert isinstance(profile, jcxl.planning.StepProfile)
      assert isinstance(step.plan, jcxl.Plan)
      assert all(isinstance(l, jcxl.LayerPlan) for l in step.plan.layers)
      report = step.report()
      assert report and all(isinstance(r, jcxl.LayerReport) for r in report)
      assert all(isinstance(r, jcxl.TransferRecord)
                 for r in pool.transfer_records())
      assert isinstance(step.plan.as_schedule(), jcxl.LayerSchedule)

  def test_the_dap_tuner_and_its_history_are_exported_types(self):
    with jcxl.Pool(host="16MiB", cxl="16MiB") as pool:
      params = jcxl.place({"w": np.ones((4, 4), np.float32)}, "cxl",
                          pool=pool)
      step = jcxl.cxl_offload(lambda p, x: (p, (x @ p["w"]).sum()),
                              schedule="dap")
      for _ in range(2):
        params, _ = step(params, jnp.ones((2, 4), jnp.float32))
      assert isinstance(step.tuner, jcxl.planning.Tuner)
      assert isinstance(step.tuner.options, jcxl.planning.TunerOptions)
      assert step.tuner.history
      assert all(isinstance(e, jcxl.planning.TunerEvent)
                 for e in step.tuner.history)

  @pytest.mark.parametrize("module", ["planning", "units",
                                      "experimental.updates"])
  def test_public_modules_document_each_name(self, module):
    mod = jcxl
    for part in module.split("."):
      mod = getattr(mod, part)
    for name in mod.__all__:
      assert getattr(mod, name).__doc__, f"jcxl.{module}.{name}"
