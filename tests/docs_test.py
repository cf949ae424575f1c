"""The README and docs/: short, linked, free of commit hashes, their
quickstart runnable and their option tables current with the source."""

from __future__ import annotations

import ast
import dataclasses
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PAGES = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                    recursive=True))
# A commit hash: 7 to 40 hex digits with both a digit and a letter, not
# part of a longer word or number (0x addresses and handles are digits).
_HASH = re.compile(r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])"
                   r"[0-9a-f]{7,40}(?![\w])")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _tool(name: str):
  spec = importlib.util.spec_from_file_location(
      f"tools_{name}", os.path.join(ROOT, "tools", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _read(path: str) -> str:
  with open(path, encoding="utf-8") as f:
    return f.read()


@dataclasses.dataclass(frozen=True)
class Knobs:
  """Options for the table tests.

  Attributes:
    speed: how fast, a
      sentence on two lines.
    names: which | ones.
  """
  speed: int = 3
  names: tuple[str, ...] = ("a",)


@dataclasses.dataclass(frozen=True)
class Undocumented:
  """No Attributes section."""
  speed: int = 3


class ReadmeTest:

  def test_is_short_and_starts_with_the_two_commands(self):
    lines = _read(README).splitlines()
    assert len(lines) <= 250
    commands = [l.split("#")[0].strip() for l in lines[:6]
                if l.startswith("make ")]
    assert commands == ["make train", "make test"]
    makefile = _read(os.path.join(ROOT, "Makefile"))
    assert re.search(r"^train: ", makefile, re.M)
    assert re.search(r"^test: ", makefile, re.M)

  def test_quickstart_runs(self, tmp_path):
    [code] = re.findall(r"## Quickstart\n.*?```python\n(.*?)```",
                        _read(README), re.S)
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                         env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cxl (EMULATED on DRAM" in out.stdout
    assert "plan (dap)" in out.stdout
    assert os.path.isdir(tmp_path / "ckpt" / "10")


class DocsTest:

  @pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(
      p, ROOT))
  def test_relative_links_resolve(self, page):
    for target in _LINK.findall(_read(page)):
      if re.match(r"^[a-z]+:", target):
        continue
      path = os.path.normpath(os.path.join(os.path.dirname(page), target))
      assert os.path.exists(path), f"{page}: broken link {target}"

  def test_no_commit_hashes_outside_the_results(self):
    # Results files carry their commit by design; prose does not.
    for page in PAGES:
      if os.sep + os.path.join("docs", "results") + os.sep in page:
        continue
      text = re.sub(r"```.*?```", "", _read(page), flags=re.S)
      assert not _HASH.findall(text), (page, _HASH.findall(text))

  def test_the_hash_pattern_finds_hashes_only(self):
    assert _HASH.findall("at c330a8f and 4f70c50, then deadbeef1") == [
        "c330a8f", "4f70c50", "deadbeef1"]
    assert not _HASH.findall(
        "handle 4194305 at 0x110000000, 7521280 params, decade, abcdefab")


class OptionsTableTest:

  def test_the_tables_in_the_docs_are_current(self):
    assert _tool("options_table").stale_pages() == []

  def test_a_table_is_made_from_fields_defaults_and_docs(self):
    table = _tool("options_table").table(f"{__name__}.Knobs")
    assert table.splitlines() == [
        "| option | default | what it does |",
        "| --- | --- | --- |",
        "| `speed` | `3` | how fast, a sentence on two lines. |",
        "| `names` | `('a',)` | which \\| ones. |",
    ]

  def test_a_stale_table_is_regenerated(self):
    tool = _tool("options_table")
    text = (f"before\n<!-- options: {__name__}.Knobs -->\n| old |\n"
            "<!-- end options -->\nafter\n")
    new = tool.updated(text)
    assert new != text and tool.updated(new) == new
    assert "| `speed` | `3` |" in new and "| old |" not in new
    assert new.startswith("before\n") and new.endswith(
        "<!-- end options -->\nafter\n")

  def test_an_undocumented_option_is_an_error(self):
    with pytest.raises(ValueError, match=r"Undocumented: no Attributes "
                       r"entry in its docstring for speed"):
      _tool("options_table").table(f"{__name__}.Undocumented")


class MeasureTest:

  def test_measures_this_checkout(self):
    tool = _tool("measure")
    m = tool.measure()
    assert m["readme_lines"] == len(_read(README).splitlines())
    assert m["src"]["src_lines"] == sum(
        len(_read(p).splitlines())
        for p in glob.glob(os.path.join(ROOT, "jcxl", "_src", "**", "*.py"),
                           recursive=True))
    assert 0 <= m["src"]["unreached_share"] < 1
    assert m["largest_class"]["methods"] > 0
    for line in ("README.md lines", "imports of jcxl._src outside",
                 "largest class by methods", "tuner states as named types"):
      assert line in tool.table(m)

  def test_relative_and_absolute_imports_are_resolved(self):
    tool = _tool("measure")
    tree = ast.parse("from . import costmodel\nfrom .units import x\n"
                     "import jcxl._src.pool as p\nfrom jcxl import _src\n")
    got = tool._imported(tree, "jcxl._src.tuner", is_package=False)
    assert {"jcxl._src.costmodel", "jcxl._src.units", "jcxl._src.pool",
            "jcxl._src"} <= got


def _program_flags() -> dict[str, tuple[set[str], set[str]]]:
  """Per program under experiments/: the shared flags it takes (calls of
  experiments/flags.py's functions) and the flags it defines itself."""
  shared_module = os.path.join(ROOT, "experiments", "flags.py")
  programs: dict[str, tuple[set[str], set[str]]] = {}
  for path in sorted(glob.glob(os.path.join(ROOT, "experiments", "**",
                                            "*.py"), recursive=True)):
    if path == shared_module:
      continue
    rel = os.path.relpath(path, os.path.join(ROOT, "experiments"))
    program = rel.split(os.sep)[0].removesuffix(".py")
    shared, own = programs.setdefault(program, (set(), set()))
    for node in ast.walk(ast.parse(_read(path))):
      if not (isinstance(node, ast.Call) and
              isinstance(node.func, ast.Attribute)):
        continue
      owner = node.func.value
      if isinstance(owner, ast.Name) and owner.id == "shared_flags":
        shared.add(node.func.attr)
      elif (isinstance(owner, ast.Name) and owner.id == "flags" and
            node.func.attr.startswith("DEFINE_") and node.args and
            isinstance(node.args[0], ast.Constant)):
        own.add(node.args[0].value)
  return programs


def _shared_flags() -> set[str]:
  """The flags experiments/flags.py defines: each function of it is named
  after the flag it defines, but `link`, which reads two of them."""
  return {node.name for node in ast.parse(_read(os.path.join(
      ROOT, "experiments", "flags.py"))).body
          if isinstance(node, ast.FunctionDef) and
          not node.name.startswith("_") and node.name != "link"}


class SharedFlagsTest:

  def test_a_shared_flag_is_defined_in_one_place_only(self):
    shared = _shared_flags()
    for program, (_, own) in _program_flags().items():
      assert not own & shared, (
          f"experiments/{program} defines {sorted(own & shared)} itself: "
          "take them from experiments/flags.py")

  def test_the_docs_table_lists_each_flags_programs(self):
    text = _read(os.path.join(ROOT, "docs", "experiments.md"))
    table = text[text.index("## Shared flags"):]
    rows = re.findall(r"^\| `--(\w+)` \| [^|]+ \| ([^|]+) \|$", table,
                      re.MULTILINE)
    assert rows
    takers: dict[str, set[str]] = {}
    for program, (shared, _) in _program_flags().items():
      for flag in shared & _shared_flags():
        takers.setdefault(flag, set()).add(program)
    documented = {flag: {p.strip().split(" ")[0]
                         for p in programs.split(",")}
                  for flag, programs in rows}
    assert documented == takers
