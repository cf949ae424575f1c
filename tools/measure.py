#!/usr/bin/env python3
"""Measures of the project's shape that anyone can rerun.

    python tools/measure.py          # a table
    python tools/measure.py --json   # the same as JSON

- README.md's line count;
- jcxl/_src's line count, and the share of it that no library module
  reaches (imported, directly or not, from none of jcxl's public modules);
- imports of jcxl._src outside jcxl/ and tests/;
- the library's largest class by its number of methods;
- whether the tuner's states are named types (an Enum, or a class per
  state) rather than strings.

Only the source is read (with `ast`); nothing is imported or run.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Directories that are not the project's source.
_SKIP = {".git", ".venv", ".vm-venv", "build", "third_party", "runs",
         ".bazel_local", "node_modules", "__pycache__"}
_TUNER_STATES = ("warmup", "steady", "race", "confirm", "baseline",
                 "measure")


def _python_files(top: str) -> list[str]:
  out = []
  for parent, dirs, files in os.walk(top):
    dirs[:] = sorted(d for d in dirs
                     if d not in _SKIP and not d.startswith("bazel-"))
    out += [os.path.join(parent, f) for f in sorted(files)
            if f.endswith(".py")]
  return out


def _lines(path: str) -> int:
  with open(path, encoding="utf-8") as f:
    return sum(1 for _ in f)


def _tree(path: str) -> ast.Module:
  with open(path, encoding="utf-8") as f:
    return ast.parse(f.read(), filename=path)


def _module_name(path: str) -> str:
  rel = os.path.relpath(path, ROOT)[:-len(".py")].split(os.sep)
  if rel[-1] == "__init__":
    rel = rel[:-1]
  return ".".join(rel)


def _imported(tree: ast.Module, name: str, is_package: bool) -> set[str]:
  """Absolute names of the modules `tree` (module `name`) imports; for
  `from x import y` both x and x.y (y may be a module)."""
  out = set()
  package = name if is_package else name.rpartition(".")[0]
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        parts = alias.name.split(".")
        out |= {".".join(parts[:i + 1]) for i in range(len(parts))}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")
        anchor = anchor[:len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
      parts = base.split(".")
      out |= {".".join(parts[:i + 1]) for i in range(len(parts))}
      out |= {f"{base}.{alias.name}" for alias in node.names}
  return out


def src_reach() -> dict:
  """jcxl/_src's lines, and those of its modules that no public module
  (jcxl/*.py outside _src, or any jcxl package other than _src) reaches."""
  modules = {}
  for path in _python_files(os.path.join(ROOT, "jcxl")):
    name = _module_name(path)
    modules[name] = (path, _imported(_tree(path), name,
                                     path.endswith("__init__.py")))
  roots = [n for n in modules if not n.startswith("jcxl._src")]
  seen, todo = set(), list(roots)
  while todo:
    name = todo.pop()
    if name in seen or name not in modules:
      continue
    seen.add(name)
    todo += [m for m in modules[name][1] if m in modules]
  src = {n: p for n, (p, _) in modules.items() if n.startswith("jcxl._src")}
  total = sum(_lines(p) for p in src.values())
  unreached = sorted(n for n in src if n not in seen)
  unreached_lines = sum(_lines(src[n]) for n in unreached)
  return {"src_lines": total, "unreached_lines": unreached_lines,
          "unreached_share": unreached_lines / total if total else 0.0,
          "unreached_modules": unreached}


def private_imports_outside() -> dict:
  """Import statements of jcxl._src in files outside jcxl/ and tests/."""
  count, by_file = 0, {}
  for path in _python_files(ROOT):
    rel = os.path.relpath(path, ROOT)
    if rel.split(os.sep)[0] in ("jcxl", "tests"):
      continue
    n = 0
    for node in ast.walk(_tree(path)):
      if isinstance(node, ast.Import):
        n += sum(a.name == "jcxl._src" or a.name.startswith("jcxl._src.")
                 for a in node.names)
      elif isinstance(node, ast.ImportFrom) and not node.level:
        module = node.module or ""
        if module == "jcxl":
          n += sum(a.name == "_src" for a in node.names)
        elif module == "jcxl._src" or module.startswith("jcxl._src."):
          n += 1
    if n:
      by_file[rel] = n
      count += n
  return {"count": count, "by_file": by_file}


def largest_class() -> dict:
  """The class in jcxl/ with the most methods (defs in its body)."""
  best = {"name": None, "file": None, "methods": 0}
  for path in _python_files(os.path.join(ROOT, "jcxl")):
    for node in ast.walk(_tree(path)):
      if isinstance(node, ast.ClassDef):
        n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))
                for b in node.body)
        if n > best["methods"]:
          best = {"name": node.name, "file": os.path.relpath(path, ROOT),
                  "methods": n}
  return best


def tuner_states_named() -> dict:
  """Whether some module of jcxl defines the tuner's states as an Enum's
  members or as classes named after them, and how many comparisons with a
  state's name as a string literal remain."""
  named, string_compares = [], 0
  for path in _python_files(os.path.join(ROOT, "jcxl")):
    tree = _tree(path)
    for node in ast.walk(tree):
      if isinstance(node, ast.ClassDef):
        bases = {ast.unparse(b) for b in node.bases}
        if bases & {"enum.Enum", "Enum", "enum.StrEnum", "StrEnum",
                    "enum.IntEnum", "IntEnum"}:
          members = {t.id.lower() for b in node.body
                     if isinstance(b, ast.Assign) for t in b.targets
                     if isinstance(t, ast.Name)}
          if len(members & set(_TUNER_STATES)) >= 3:
            named.append(f"{os.path.relpath(path, ROOT)}:{node.name}")
        elif node.name.lower().removesuffix("phase").removesuffix(
            "state") in _TUNER_STATES and node.name.lower() not in (
                _TUNER_STATES):
          named.append(f"{os.path.relpath(path, ROOT)}:{node.name}")
      elif isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        string_compares += any(
            isinstance(o, ast.Constant) and o.value in _TUNER_STATES
            for o in operands) and any(
                "state" in ast.unparse(o) or "phase" in ast.unparse(o)
                for o in operands)
  return {"named": bool(named), "types": named,
          "string_comparisons": string_compares}


def measure() -> dict:
  return {"readme_lines": _lines(os.path.join(ROOT, "README.md")),
          "src": src_reach(),
          "private_imports_outside": private_imports_outside(),
          "largest_class": largest_class(),
          "tuner_states": tuner_states_named()}


def table(m: dict) -> str:
  src, imports = m["src"], m["private_imports_outside"]
  cls, tuner = m["largest_class"], m["tuner_states"]
  rows = [
      ("README.md lines", f"{m['readme_lines']}"),
      ("jcxl/_src lines", f"{src['src_lines']}"),
      ("jcxl/_src reached by no public module",
       f"{src['unreached_lines']} lines ({src['unreached_share']:.1%}): "
       + (", ".join(n.removeprefix("jcxl._src.")
                    for n in src["unreached_modules"]) or "none")),
      ("imports of jcxl._src outside jcxl/, tests/",
       f"{imports['count']} in {len(imports['by_file'])} files"),
      ("largest class by methods",
       f"{cls['name']} ({cls['file']}): {cls['methods']}"),
      ("tuner states as named types",
       ("yes: " + ", ".join(tuner["types"])) if tuner["named"] else
       f"no ({tuner['string_comparisons']} comparisons with a state's "
       "name as a string)"),
  ]
  width = max(len(k) for k, _ in rows)
  return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--json", action="store_true",
                      help="print the measures as JSON")
  args = parser.parse_args(argv)
  m = measure()
  print(json.dumps(m, indent=2) if args.json else table(m))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
