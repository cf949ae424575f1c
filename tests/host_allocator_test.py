"""experiments.host_allocator: programs re-run with malloc keeping its
memory."""

import os
import platform
import subprocess
import sys

import pytest

from experiments import host_allocator

# Prints GLIBC_TUNABLES as the program sees it after the call, how many
# times it started (the re-run keeps the pid and the environment, so a
# counter there tells) and whether it runs tuned.
_PROGRAM = """
import os
from experiments import host_allocator
os.environ["STARTS"] = str(int(os.environ.get("STARTS", "0")) + 1)
host_allocator.start()
print(os.environ.get("GLIBC_TUNABLES"), os.environ["STARTS"],
      host_allocator.tuned())
"""
_GLIBC = platform.libc_ver()[0] == "glibc"
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ALL = ":".join(f"{k}={v}" for k, v in host_allocator.TUNABLES.items())


# Faults taken by four rounds of a 64 MiB buffer allocated, written and
# freed, after one such round: what a step's buffers cost it.
_FAULTS = """
import resource
import numpy as np
from experiments import host_allocator
host_allocator.start()
np.ones(8 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
  np.ones(8 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(tunables, program=_PROGRAM):
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  if tunables is not None:
    env["GLIBC_TUNABLES"] = tunables
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-c", program], env=env, cwd=repo,
                       capture_output=True, text=True, check=True,
                       timeout=120)
  return out.stdout.split()


@pytest.mark.skipif(not _GLIBC, reason="the tunables are glibc's")
class EnvironmentTest:

  def test_adds_the_tunables_beside_the_users_others(self):
    assert host_allocator.environment_with_tunables({"A": "1"}) == {
        "A": "1", "GLIBC_TUNABLES": _ALL}
    assert host_allocator.environment_with_tunables(
        {"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})["GLIBC_TUNABLES"] == (
            f"glibc.pthread.rseq=0:{_ALL}")

  def test_keeps_a_malloc_setting_the_user_made(self):
    environ = {"GLIBC_TUNABLES": "x=2:glibc.malloc.arena_max=4"}
    assert host_allocator.environment_with_tunables(environ) is None
    assert not host_allocator.tuned(environ)

  def test_tuned_only_with_every_tunable(self):
    assert host_allocator.tuned({"GLIBC_TUNABLES": _ALL})
    assert not host_allocator.tuned(
        {"GLIBC_TUNABLES": _ALL.replace("mmap_max=0", "mmap_max=1")})


@pytest.mark.skipif(not _GLIBC, reason="the tunables are glibc's")
class RerunTest:

  def test_a_program_starts_again_once_tuned(self):
    assert _run(None) == [_ALL, "2", "True"]

  def test_a_users_malloc_setting_starts_once_as_it_is(self):
    assert _run("glibc.malloc.arena_max=4") == [
        "glibc.malloc.arena_max=4", "1", "False"]

  def test_a_program_from_stdin_runs_once_untuned_and_says_so(self):
    # Run again, it would find its program (stdin) used up and do nothing.
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-", "arg"], input=_PROGRAM,
                         env=env, cwd=_REPO, capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.split() == ["None", "1", "False"]
    assert "read from standard input" in out.stderr
    assert "running on with glibc malloc's defaults" in out.stderr

  def test_an_interpreter_of_unknown_path_runs_once_untuned(self):
    # argv[0] not on PATH, as some supervisors start processes: Python
    # cannot tell its own path (sys.executable is '').
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run(["no-such-interpreter-name", "-c", _PROGRAM],
                         executable=sys.executable, env=env, cwd=_REPO,
                         capture_output=True, text=True, check=True,
                         timeout=120)
    assert out.stdout.split() == ["None", "1", "False"]
    assert "sys.executable is empty" in out.stderr

  def test_a_tuned_program_reuses_freed_memory(self):
    # Untuned, each round maps its 64 MiB afresh and faults it in again
    # (over 2000 faults for the four here, in 4 KiB pages or larger ones).
    [faults] = _run(None, _FAULTS)
    assert int(faults) < 100


def test_the_docs_give_the_tunables_the_programs_use():
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(repo, "docs", "experiments.md"),
            encoding="utf-8") as f:
    assert f"GLIBC_TUNABLES={_ALL} python my_train.py" in f.read()
