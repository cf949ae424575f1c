#!/usr/bin/env python3
"""Option tables in the docs, generated from the dataclasses that define
the options, so that each default and its meaning are written once.

    python tools/options_table.py          # rewrite the tables in docs/
    python tools/options_table.py --check  # exit 1 if a table is stale

A table lives in its page between two markers,

    <!-- options: jcxl.planning.TunerOptions -->
    ...
    <!-- end options -->

and has a row per field: its name, its default and its entry in the
class docstring's ``Attributes:`` section (a field without one is an
error: every option is documented).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The pages that hold generated tables.
PAGES = ("docs/dap.md",)
_BLOCK = re.compile(r"(<!-- options: (?P<cls>[\w.]+) -->\n)(?P<body>.*?)"
                    r"(<!-- end options -->)", re.S)


def _resolve(path: str) -> type:
  module, _, name = path.rpartition(".")
  return getattr(importlib.import_module(module), name)


def attribute_docs(cls: type) -> dict[str, str]:
  """The ``Attributes:`` entries of `cls`'s docstring, one line each."""
  doc = inspect.cleandoc(cls.__doc__ or "")
  section = re.search(r"^Attributes:\n((?:^(?: .*)?\n?)*)", doc, re.M)
  out, name = {}, None
  for line in (section.group(1) if section else "").splitlines():
    entry = re.match(r"^  (\w+): ?(.*)$", line)
    if entry:
      name = entry.group(1)
      out[name] = entry.group(2).strip()
    elif name and line.strip():
      out[name] += " " + line.strip()
  return out


def _default(field: dataclasses.Field) -> str:
  if field.default is not dataclasses.MISSING:
    return f"`{field.default!r}`"
  if field.default_factory is not dataclasses.MISSING:
    return f"`{field.default_factory()!r}`"
  return "(required)"


def table(path: str) -> str:
  """The Markdown table of the dataclass at dotted `path`.

  Raises:
    ValueError: a field has no entry in the docstring's Attributes.
  """
  cls = _resolve(path)
  docs = attribute_docs(cls)
  fields = dataclasses.fields(cls)
  missing = [f.name for f in fields if f.name not in docs]
  if missing:
    raise ValueError(f"{path}: no Attributes entry in its docstring for "
                     f"{', '.join(missing)}; document every option")
  rows = ["| option | default | what it does |", "| --- | --- | --- |"]
  escaped = {name: text.replace("|", "\\|") for name, text in docs.items()}
  rows += [f"| `{f.name}` | {_default(f)} | {escaped[f.name]} |"
           for f in fields]
  return "\n".join(rows) + "\n"


def updated(text: str) -> str:
  """`text` with every marked table regenerated."""
  return _BLOCK.sub(lambda m: m.group(1) + table(m.group("cls")) +
                    m.group(4), text)


def stale_pages() -> list[str]:
  """The pages (of PAGES) whose tables differ from their source."""
  out = []
  for page in PAGES:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
      text = f.read()
    if updated(text) != text:
      out.append(page)
  return out


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--check", action="store_true",
                      help="exit 1 when a table is stale, writing nothing")
  args = parser.parse_args(argv)
  if args.check:
    stale = stale_pages()
    for page in stale:
      print(f"{page}: option table is stale; run python "
            "tools/options_table.py", file=sys.stderr)
    return 1 if stale else 0
  for page in PAGES:
    path = os.path.join(ROOT, page)
    with open(path, encoding="utf-8") as f:
      text = f.read()
    new = updated(text)
    if new != text:
      with open(path, "w", encoding="utf-8") as f:
        f.write(new)
      print(f"updated {page}")
  return 0


if __name__ == "__main__":
  sys.path.insert(0, ROOT)
  sys.exit(main(sys.argv[1:]))
