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
  state) rather than strings;
- import cycles among jcxl's modules (every import counts: those under
  `if TYPE_CHECKING:` and inside functions too);
- the same between jcxl/_src's units (a module directly in it, or a whole
  subpackage: jcxl._src.dap importing jcxl._src.offload and back is one);
- imports pointing back up: a module importing a module of a package above
  its own (jcxl._src.dap.x importing jcxl._src.y);
- the largest class by public methods, in Python (jcxl/) and in C++
  (ffi/*.h: functions declared in a class body's public part);
- the files that list the host-update operations (name at least half of
  them outside docstrings: where adding one means an edit), and the files
  that name one (its C++ enumerator, its Python member or its primitive's
  name in jcxl/ and ffi/), for the operation named in the most files;
- public methods and functions of jcxl's public face without a docstring;
- flags of experiments/ with more than one name for one concept (synonyms
  such as --n_layer and --layers, or one name defined with two kinds).

Only the source is read (with `ast`); nothing is imported or run.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import re
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


def _from_base(node: ast.ImportFrom, package: str) -> str:
  """The absolute module a `from ... import` in `package` names."""
  base = node.module or ""
  if node.level:
    anchor = package.split(".")
    anchor = anchor[:len(anchor) - (node.level - 1)]
    base = ".".join(anchor + ([base] if base else []))
  return base


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
      base = _from_base(node, package)
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


def _import_graph() -> dict[str, set[str]]:
  """jcxl's modules -> the jcxl modules each imports, anywhere in it.

  `from p import m` is an edge to p.m when that is a module, else to p; the
  packages above an imported module are not edges (their __init__ files
  are docstrings or public re-exports, not dependencies of the module), nor
  is `from jcxl import _jcxl` (the compiled extension, no Python file)."""
  modules = {}
  for path in _python_files(os.path.join(ROOT, "jcxl")):
    modules[_module_name(path)] = path
  graph = {}
  for name, path in modules.items():
    package = name if path.endswith("__init__.py") else name.rpartition(
        ".")[0]
    edges = set()
    for node in ast.walk(_tree(path)):
      if isinstance(node, ast.Import):
        edges |= {a.name for a in node.names if a.name in modules}
      elif isinstance(node, ast.ImportFrom):
        base = _from_base(node, package)
        for alias in node.names:
          if f"{base}.{alias.name}" in modules:
            edges.add(f"{base}.{alias.name}")
          elif base in modules and not alias.name.startswith("_"):
            edges.add(base)
    edges.discard(name)
    graph[name] = edges
  return graph


def _units(graph: dict[str, set[str]]) -> dict[str, set[str]]:
  """The graph between jcxl._src's units: each module directly in it, and
  each subpackage as one (jcxl._src.dap.x is jcxl._src.dap)."""
  def unit(name: str) -> str | None:
    parts = name.split(".")
    return ".".join(parts[:3]) if name.startswith("jcxl._src.") else None
  out = {}
  for name, edges in graph.items():
    if unit(name):
      out.setdefault(unit(name), set()).update(
          unit(e) for e in edges if unit(e) and unit(e) != unit(name))
  return out


def import_cycles(graph: dict[str, set[str]] | None = None) -> dict:
  """Groups of jcxl modules that import each other, directly or not
  (strongly connected components of more than one module)."""
  graph = _import_graph() if graph is None else graph
  index, low, stack, on_stack, groups = {}, {}, [], set(), []

  def visit(v: str) -> None:  # Tarjan's algorithm
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        group.append(w)
        if w == v:
          break
      if len(group) > 1:
        groups.append(sorted(group))

  sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
  for v in sorted(graph):
    if v not in index:
      visit(v)
  return {"count": len(groups), "groups": sorted(groups)}


def upward_imports() -> dict:
  """Imports of a module that lives directly in a package above the
  importer's own (jcxl._src.dap.x importing jcxl._src.y; not jcxl/*.py,
  the public surface, which re-exports from below)."""
  graph, modules = _import_graph(), set()
  for path in _python_files(os.path.join(ROOT, "jcxl")):
    if path.endswith("__init__.py"):
      modules.add(_module_name(path))
  by_file = {}
  for name, edges in graph.items():
    own = name.rpartition(".")[0]
    ups = sorted(
        e for e in edges if e not in modules
        and own.startswith(e.rpartition(".")[0] + ".")
        and e.rpartition(".")[0].startswith("jcxl._src"))
    if ups:
      by_file[name] = ups
  return {"count": sum(len(v) for v in by_file.values()),
          "by_module": by_file}


def largest_public_class() -> dict:
  """The class with the most public methods: in jcxl/ (defs in its body
  not named with a leading underscore) and in ffi/*.h (functions declared
  in the public part of a class or struct body, constructors included,
  `= delete` ones not)."""
  py = {"name": None, "file": None, "methods": 0}
  for path in _python_files(os.path.join(ROOT, "jcxl")):
    for node in ast.walk(_tree(path)):
      if isinstance(node, ast.ClassDef):
        n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))
                and not b.name.startswith("_") for b in node.body)
        if n > py["methods"]:
          py = {"name": node.name, "file": os.path.relpath(path, ROOT),
                "methods": n}
  cc = {"name": None, "file": None, "methods": 0}
  ffi = os.path.join(ROOT, "ffi")
  for f in sorted(os.listdir(ffi)):
    if f.endswith(".h"):
      for name, n in _cc_public_methods(os.path.join(ffi, f)):
        if n > cc["methods"]:
          cc = {"name": name, "file": f"ffi/{f}", "methods": n}
  return {"python": py, "cc": cc}


def undocumented_public() -> dict:
  """Public functions, classes and their public methods without a
  docstring: the names in `__all__` of jcxl's public modules (jcxl/*.py,
  jcxl/experimental/*.py), found where they are defined in jcxl/."""
  defs = {}  # module name -> {top-level name: node}
  def module_defs(module: str) -> dict:
    if module not in defs:
      path = os.path.join(ROOT, *module.split(".")) + ".py"
      if not os.path.exists(path):
        path = os.path.join(ROOT, *module.split("."), "__init__.py")
      defs[module] = ({n.name: n for n in _tree(path).body
                       if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
                      if os.path.exists(path) else {})
    return defs[module]
  public, missing = 0, []
  faces = [os.path.join(ROOT, "jcxl", f) for f in sorted(os.listdir(
      os.path.join(ROOT, "jcxl"))) if f.endswith(".py")]
  faces += [os.path.join(ROOT, "jcxl", "experimental", f) for f in sorted(
      os.listdir(os.path.join(ROOT, "jcxl", "experimental")))
            if f.endswith(".py")]
  seen = set()
  for face in faces:
    for node in _tree(face).body:
      if not (isinstance(node, ast.ImportFrom) and node.module
              and node.module.startswith("jcxl._src")):
        continue
      for alias in node.names:
        d = module_defs(node.module).get(alias.name)
        if d is None or (node.module, alias.name) in seen:
          continue
        seen.add((node.module, alias.name))
        items = [(alias.name, d)] + [
            (f"{alias.name}.{b.name}", b) for b in getattr(d, "body", ())
            if isinstance(b, ast.FunctionDef) and not b.name.startswith("_")
        ] if isinstance(d, ast.ClassDef) else [(alias.name, d)]
        for name, item in items:
          public += 1
          if not ast.get_docstring(item):
            missing.append(name)
  return {"public": public, "missing": sorted(missing)}


def _cc_public_methods(path: str) -> list[tuple[str, int]]:
  """(class, public methods) for each class or struct defined in a C++
  header, parsed simply: comments and strings dropped, statements of the
  class body's own brace level split at `;` and at function bodies."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  text = re.sub(r"//[^\n]*|/\*.*?\*/", " ", text, flags=re.S)
  text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
  out = []
  for m in re.finditer(r"\b(class|struct)\s+(\w+)[^;{()]*\{", text):
    public = m.group(1) == "struct"
    depth, i, stmt, n = 1, m.end(), "", 0
    while i < len(text) and depth:
      c = text[i]
      if c == "{":
        if depth == 1 and "(" in stmt and public and _is_method(stmt):
          n += 1
          stmt = ""
        depth += 1
      elif c == "}":
        depth -= 1
        if depth == 1:
          stmt = ""
      elif depth == 1:
        if c == ";":
          if "(" in stmt and public and _is_method(stmt):
            n += 1
          stmt = ""
        elif c == ":" and re.fullmatch(
            r"\s*(public|private|protected)\s*", stmt):
          public = stmt.strip() == "public"
          stmt = ""
        else:
          stmt += c
      i += 1
    out.append((m.group(2), n))
  return out


def _is_method(stmt: str) -> bool:
  """Whether a class-body statement declares a function (not a field with
  a parenthesized type or initializer, a friend, a using or a deleted
  one)."""
  stmt = " ".join(stmt.split())
  if re.match(r"(friend|using|typedef|static_assert|enum)\b", stmt):
    return False
  if re.search(r"=\s*delete\s*$", stmt):
    return False
  head = stmt.split("(")[0].split("=")[0]
  return bool(re.search(r"(~?\w+|operator\s*\S+)\s*$", head)) and \
      "=" not in stmt.split("(")[0] and "<" not in head.split()[-1:][0] \
      if head.split() else False


def _without_docstrings(text: str) -> str:
  """Python source with its docstrings blanked: an example in one names an
  operation without being a place that adding one edits."""
  try:
    tree = ast.parse(text)
  except SyntaxError:
    return text
  lines = text.splitlines(keepends=True)
  for node in ast.walk(tree):
    body = getattr(node, "body", None)
    if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)):
      doc = body[0]
      for k in range(doc.lineno - 1, doc.end_lineno):
        lines[k] = "\n"
  return "".join(lines)


def update_op_files() -> dict:
  """For each host-update operation (the table in ffi/update_ops.h), the
  files that name it: its C++ enumerator (kAdd) in ffi/ and elsewhere, its
  Python member (UpdateOp.ADD), or its primitive's quoted name ("add") in
  jcxl/ and ffi/; the operation named in the most files."""
  with open(os.path.join(ROOT, "ffi", "update_ops.h"), encoding="utf-8") as f:
    rows = re.findall(r'\bX\((\w+),\s*(\d+),\s*"(\w+)"', f.read())
  values = {f"k{name}": value for name, value, _ in rows}
  prims = {f"k{name}": prim for name, _, prim in rows}
  members = {value: re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()
             for name, value, _ in rows}
  files = []
  for parent, dirs, names in os.walk(ROOT):
    dirs[:] = sorted(d for d in dirs if d not in _SKIP
                     and not d.startswith((".", "bazel-")))
    files += [os.path.join(parent, f) for f in sorted(names)
              if f.endswith((".py", ".cc", ".h", ".cu"))]
  texts = {}
  for path in files:
    with open(path, encoding="utf-8", errors="replace") as f:
      text = f.read()
    if path.endswith(".py"):
      text = _without_docstrings(text)
    texts[os.path.relpath(path, ROOT)] = text
  per_op = {}
  for enumerator, value in values.items():
    member = members.get(value)
    prim = prims.get(enumerator)
    named = []
    for rel, text in texts.items():
      top = rel.split(os.sep)[0]
      if rel == os.path.join("tools", "measure.py"):
        continue  # names them only to find them
      if (re.search(rf"\b{enumerator}\b", text)
          or (member and re.search(
              rf"UpdateOp\.{member}\b|^  {member} = {value}\b", text,
              flags=re.M))
          or (prim and top in ("jcxl", "ffi")
              and re.search(rf"[\"']{prim}[\"']", text))):
        named.append(rel)
    per_op[enumerator] = named
  worst = max(per_op, key=lambda k: len(per_op[k]))
  is_test = lambda f: re.search(r"(^|/)tests?/|_test\.", f)
  # A file naming most of the ops is a list of them: adding an op edits
  # it. A file naming a few uses those ops (FMA contraction, the casts of
  # weight copies) and is untouched by a new one.
  counts = collections.Counter(f for named in per_op.values() for f in named)
  lists = sorted(f for f, n in counts.items() if 2 * n >= len(per_op))
  return {"op": worst, "files": per_op[worst],
          "outside_tests": [f for f in per_op[worst] if not is_test(f)],
          "lists": [f for f in lists if not is_test(f)],
          "test_lists": [f for f in lists if is_test(f)]}


# Flag names that mean the same thing (a plural is the same concept: a
# list flag of a program that sweeps it).
_FLAG_CONCEPTS = {
    "n_layer": "depth", "layer": "depth", "n_layers": "depth",
    "num_layers": "depth", "depth": "depth",
    "n_embd": "width", "width": "width", "d_model": "width",
    "hidden": "width",
    "schedule": "schedule",
}


def experiment_flag_names() -> dict:
  """Concepts whose flags in experiments/ go by more than one name (plural
  aside), or whose one name is defined with different kinds (a list in one
  program, a string in another)."""
  shared = {}
  with open(os.path.join(ROOT, "experiments", "flags.py"),
            encoding="utf-8") as f:
    for fn in ast.parse(f.read()).body:
      if isinstance(fn, ast.FunctionDef):
        for call in ast.walk(fn):
          if (isinstance(call, ast.Call) and ast.unparse(call.func)
              == "_define" and len(call.args) >= 2
              and all(isinstance(a, ast.Constant) for a in call.args[:2])):
            shared[fn.name] = (call.args[0].value, call.args[1].value)
  defined = {}  # name -> {kind: [files]}
  for path in _python_files(os.path.join(ROOT, "experiments")):
    rel = os.path.relpath(path, ROOT)
    for node in ast.walk(_tree(path)):
      if not isinstance(node, ast.Call):
        continue
      func = ast.unparse(node.func)
      m = re.search(r"DEFINE_(\w+)$", func)
      name = kind = None
      if m and node.args and isinstance(node.args[0], ast.Constant):
        kind, name = m.group(1), node.args[0].value
      elif m:
        for k in node.keywords:
          if k.arg == "name" and isinstance(k.value, ast.Constant):
            kind, name = m.group(1), k.value.value
      elif func.startswith("shared_flags.") and (
          func.split(".")[-1] in shared):
        kind, name = shared[func.split(".")[-1]]
      if name:
        kind = {"bool": "boolean"}.get(kind, kind)
        defined.setdefault(name, {}).setdefault(kind, set()).add(rel)
  concepts = {}
  for name in defined:
    stem = name[:-1] if name.endswith("s") and (
        name[:-1] in _FLAG_CONCEPTS or name[:-1] in defined) else name
    concepts.setdefault(_FLAG_CONCEPTS.get(stem, stem), set()).add(name)
  bad = {}
  for concept, names in sorted(concepts.items()):
    stems = {n[:-1] if n.endswith("s") and (n[:-1] in names or
             n[:-1] in _FLAG_CONCEPTS) else n for n in names}
    kinds = [n for n in names if len(defined[n]) > 1]
    if len(stems) > 1 or kinds:
      bad[concept] = sorted(
          f"--{n} ({', '.join(sorted(defined[n]))})" for n in names)
  return {"count": len(bad), "concepts": bad}


def measure() -> dict:
  return {"readme_lines": _lines(os.path.join(ROOT, "README.md")),
          "src": src_reach(),
          "private_imports_outside": private_imports_outside(),
          "largest_class": largest_class(),
          "tuner_states": tuner_states_named(),
          "import_cycles": import_cycles(),
          "package_cycles": import_cycles(_units(_import_graph())),
          "upward_imports": upward_imports(),
          "largest_public_class": largest_public_class(),
          "update_op_files": update_op_files(),
          "undocumented_public": undocumented_public(),
          "experiment_flag_names": experiment_flag_names()}


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
      ("import cycles in jcxl/ (TYPE_CHECKING included)",
       f"{m['import_cycles']['count']}" + "".join(
           f"; {' <-> '.join(n.removeprefix('jcxl._src.') for n in g)}"
           for g in m["import_cycles"]["groups"])),
      ("cycles between jcxl/_src's packages and modules",
       f"{m['package_cycles']['count']}" + "".join(
           f"; {' <-> '.join(n.removeprefix('jcxl._src.') for n in g)}"
           for g in m["package_cycles"]["groups"])),
      ("imports pointing back up (jcxl/_src)",
       f"{m['upward_imports']['count']} in "
       f"{len(m['upward_imports']['by_module'])} modules"),
      ("largest Python class by public methods",
       "{name} ({file}): {methods}".format(
           **m["largest_public_class"]["python"])),
      ("largest C++ class by public methods",
       "{name} ({file}): {methods}".format(
           **m["largest_public_class"]["cc"])),
      ("files listing the host-update operations (a new one edits)",
       f"{len(m['update_op_files']['lists'])}: "
       + ", ".join(m["update_op_files"]["lists"])
       + f" (and tests: {', '.join(m['update_op_files']['test_lists'])})"),
      ("files naming one host-update operation",
       f"{len(m['update_op_files']['files'])} "
       f"({len(m['update_op_files']['outside_tests'])} outside tests), "
       f"for {m['update_op_files']['op']}: "
       + ", ".join(m["update_op_files"]["files"])),
      ("public functions and methods without a docstring",
       f"{len(m['undocumented_public']['missing'])} of "
       f"{m['undocumented_public']['public']}"
       + (": " + ", ".join(m["undocumented_public"]["missing"][:12])
          if m["undocumented_public"]["missing"] else "")),
      ("experiment flags with several names for one concept",
       f"{m['experiment_flag_names']['count']}" + "".join(
           f"; {c}: {' '.join(n)}"
           for c, n in m["experiment_flag_names"]["concepts"].items())),
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
