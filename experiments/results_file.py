"""One results file per benchmark run, written by the program itself.

Every experiment ends by handing the results it returns (the JSON that
`--json_out` writes) to `write`, which renders them as Markdown under a
header saying what ran where: the command, the commit (and whether the
tree had uncommitted changes), the date and the machine. The figures in
the docs come from these files, so a figure that moves shows as a new
file, not as an edit to prose.

Files go to ``docs/results/<program>/<date>-<commit>.md`` in this checkout,
or under ``$JCXL_RESULTS_DIR`` when it is set (the tests point it at a
temporary directory).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
from collections.abc import Sequence
from typing import Any

from absl import logging

from benchmarks import bench
from experiments import host_allocator

RESULTS_DIR_ENV = "JCXL_RESULTS_DIR"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Lists longer than this are summarized in the tables (the JSON at the end
# of the file keeps every value).
_LIST_CELL_MAX = 8
_MAX_HEADING = 5


def results_dir() -> str:
  """Where results files go: $JCXL_RESULTS_DIR, else docs/results."""
  return os.environ.get(RESULTS_DIR_ENV) or os.path.join(
      REPO_ROOT, "docs", "results")


def program_name(argv0: str) -> str:
  """The program's name from its argv[0]: `dap` for .../experiments/dap.py
  (as `python -m experiments.dap` sets it), `train` for a package's
  .../experiments/train/__main__.py."""
  path = argv0.removesuffix(".py")
  name = os.path.basename(path)
  return os.path.basename(os.path.dirname(path)) if name == "__main__" else (
      name)


def _git(*args: str) -> str | None:
  try:
    out = subprocess.run(["git", "-C", REPO_ROOT, *args], check=True,
                         capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip()


# The checkout as a program found it when it started (`note_start`): a long
# run's file must name the code that ran, not what the tree became.
_at_start: tuple[str, str] | None = None


# This run's results file per program: a program that writes its results
# as each part ends (so that a deadline keeps what ended) rewrites one
# file, until the next `note_start`.
_written: dict[str, str] = {}  # results folder -> file
_started: dict[str, datetime.datetime] = {}


def note_start() -> None:
  """Records the checkout's commit as the running program's; a run's
  results file is new from here on (see `write`)."""
  global _at_start
  _at_start = commit()
  _written.clear()
  _started.clear()


def _revision() -> tuple[str, str]:
  return _at_start or commit()


def commit() -> tuple[str, str]:
  """(short hash, description) of the checkout's HEAD; the description
  says when tracked files had uncommitted changes."""
  head = _git("rev-parse", "--short=12", "HEAD")
  if not head:
    return "nogit", "unknown (not a git checkout)"
  dirty = _git("status", "--porcelain", "--untracked-files=no")
  return head, head + (", with uncommitted changes" if dirty else "")


def _devices() -> str:
  import jax  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  kinds = sorted({d.device_kind for d in devices})
  return (f"{len(devices)} x {', '.join(kinds)} ({devices[0].platform}); "
          f"jax {jax.__version__}")


def header(program: str, argv: Sequence[str], when: datetime.datetime
           ) -> list[tuple[str, str]]:
  """The rows of a results file's header; `argv` is the command line as
  the process got it (sys.argv: absl's main sees it without its flags)."""
  _, described = _revision()
  machine = bench.describe_machine()
  load = ", ".join(f"{x:.2f}" for x in machine.load_average)
  return [
      ("program", "`" + " ".join([f"python -m experiments.{program}",
                                  *map(shlex.quote, argv[1:])]) + "`"),
      ("commit", described),
      ("date", when.strftime("%Y-%m-%d %H:%M UTC")),
      ("machine", f"{machine.cores} cores ({machine.usable_cores} usable), "
                  f"{machine.cpu_model}, "
                  f"{machine.memory_bytes / 2**30:.1f} GiB memory, "
                  f"{machine.numa_nodes} NUMA node(s); "
                  f"load average {load} at the end of the run"),
      ("devices", _devices()),
      ("system", f"{platform.system()} {platform.release()}, Python "
                 f"{platform.python_version()}"),
      ("host allocator", host_allocator.describe()),
  ]


def _scalar(value: Any) -> bool:
  return value is None or isinstance(value, (str, int, float, bool))


def _cell(value: Any) -> str:
  """A table cell: scalars as they are, short lists joined, long lists of
  numbers summarized, anything else as compact JSON."""
  if isinstance(value, float):
    text = "nan" if math.isnan(value) else f"{value:.6g}"
  elif isinstance(value, list) and all(_scalar(v) for v in value):
    if len(value) <= _LIST_CELL_MAX:
      text = ", ".join(_cell(v) for v in value) or "-"
    elif all(isinstance(v, (int, float)) and not isinstance(v, bool)
             for v in value):
      text = (f"{len(value)} values: median {_cell(statistics.median(value))}"
              f", {_cell(min(value))} to {_cell(max(value))}")
    else:
      text = f"{len(value)} values"
  elif _scalar(value):
    text = "-" if value is None else str(value)
  else:
    text = json.dumps(value, separators=(",", ":"), default=str)
  return text.replace("|", "\\|").replace("\n", " ")


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
  return (["| " + " | ".join(head) + " |",
           "| " + " | ".join("---" for _ in head) + " |"] +
          ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows])


def _flat(value: Any) -> bool:
  """A dict whose values are scalars or lists of scalars: one table row."""
  return isinstance(value, dict) and all(
      _scalar(v) or (isinstance(v, list) and all(_scalar(x) for x in v))
      for v in value.values())


def render(value: Any, title: str = "results", level: int = 2) -> list[str]:
  """Markdown for a JSON value: a dict's scalars as a key/value table, a
  list of flat dicts as a table with a row each, nested values as
  sections of their own."""
  heading = "#" * min(level, _MAX_HEADING) + " " + title
  if isinstance(value, dict):
    simple = [(k, v) for k, v in value.items()
              if not isinstance(v, (dict, list)) or
              (isinstance(v, list) and all(_scalar(x) for x in v))]
    out = [heading, ""]
    if simple:
      out += _table(("", "value"), simple) + [""]
    for key, v in value.items():
      if (key, v) not in simple:
        out += render(v, str(key), level + 1)
    return out
  if isinstance(value, list) and value and all(_flat(v) for v in value):
    columns = list(dict.fromkeys(k for v in value for k in v))
    return [heading, ""] + _table(
        columns, [[v.get(c) for c in columns] for v in value]) + [""]
  if isinstance(value, list):
    out = [heading, ""]
    for i, v in enumerate(value):
      out += render(v, f"{title}[{i}]", level + 1) if not _scalar(v) else [
          f"- {_cell(v)}"]
    return out + [""]
  return [heading, "", _cell(value), ""]


def text(program: str, results: Any, argv: Sequence[str],
         when: datetime.datetime) -> str:
  """The whole results file."""
  lines = [f"# experiments.{program}: one run", ""]
  lines += _table(("", ""), header(program, argv, when)) + [""]
  lines += ["Written by the program from the results it returns (what "
            "`--json_out` writes); every value is in the JSON at the end.",
            ""]
  lines += render(results)
  lines += ["<details><summary>results as JSON</summary>", "", "```json",
            json.dumps(results, indent=1), "```", "",
            "</details>", ""]
  return "\n".join(lines)


def write(program: str, results: Any, argv: Sequence[str],
          when: datetime.datetime | None = None) -> str | None:
  """Writes this run's results file and returns its path.

  A results file is a by-product: when it cannot be written (a read-only
  checkout, a full disk) this logs a warning and returns None rather than
  failing a program whose work is done. Called again for the same program
  in this run (until `note_start`), it rewrites the same file (replaced whole), so that a
  program writing its results as each part ends leaves one file.

  Args:
    program: the program's name (`dap`): the folder, and the command shown.
    results: what the program returns (JSON-able; tuples become lists).
    argv: the command line as the process got it (`sys.argv`).
    when: the run's time (UTC), now by default.
  """
  when = when or _started.get(program) or datetime.datetime.now(
      datetime.timezone.utc)
  short, _ = _revision()
  folder = os.path.join(results_dir(), program)
  stem = f"{when.strftime('%Y-%m-%d-%H%M%S')}-{short}"
  try:
    # As --json_out would write them: tuples as lists, odd types as text.
    results = json.loads(json.dumps(results, default=str))
    body = text(program, results, argv, when)
    os.makedirs(folder, exist_ok=True)
    path = _written.get(folder)
    if path is None:
      path, n = os.path.join(folder, f"{stem}.md"), 1
      while os.path.exists(path):  # two runs in one second
        n += 1
        path = os.path.join(folder, f"{stem}-{n}.md")
    # Written whole beside it, then renamed over it: a reader (or a run
    # killed mid-write) never sees half a file.
    partial = path + ".partial"
    with open(partial, "w", encoding="utf-8") as f:
      f.write(body)
    os.replace(partial, path)
    _written[folder], _started[program] = path, when
  except (OSError, TypeError, ValueError) as e:
    logging.warning("results file for %s not written: %s", program, e)
    return None
  logging.info("wrote %s", path)
  print(f"results: {path}", flush=True)
  return path
