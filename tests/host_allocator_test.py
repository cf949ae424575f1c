"""experiments.host_allocator: programs re-run with malloc in huge pages."""

import os
import subprocess
import sys

import pytest

from experiments import host_allocator

TUNABLE = host_allocator.TUNABLE
# Prints GLIBC_TUNABLES as the program sees it after the call, and how
# many processes it took (the re-run keeps the pid, so a counter in the
# environment tells).
_PROGRAM = """
import os
from experiments import host_allocator
os.environ["RUNS"] = str(int(os.environ.get("RUNS", "0")) + 1)
host_allocator.start_with_huge_pages()
print(os.environ.get("GLIBC_TUNABLES"), os.environ["RUNS"],
      host_allocator.huge_pages_on())
"""
_SUPPORTED = host_allocator.environment_with_huge_pages({}) is not None


def _run(env_tunables):
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  if env_tunables is not None:
    env["GLIBC_TUNABLES"] = env_tunables
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, cwd=repo,
                       capture_output=True, text=True, check=True, timeout=120)
  return out.stdout.split()


class EnvironmentTest:

  @pytest.mark.skipif(not _SUPPORTED, reason="glibc < 2.35 or kernel THP "
                      "'never': nothing to turn on")
  def test_adds_the_tunable_beside_the_users_others(self):
    assert host_allocator.environment_with_huge_pages({"A": "1"}) == {
        "A": "1", "GLIBC_TUNABLES": f"{TUNABLE}=1"}
    assert host_allocator.environment_with_huge_pages(
        {"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})["GLIBC_TUNABLES"] == (
            f"glibc.pthread.rseq=0:{TUNABLE}=1")

  @pytest.mark.parametrize("setting", ["0", "1"])
  def test_keeps_a_setting_the_user_made(self, setting):
    assert host_allocator.environment_with_huge_pages(
        {"GLIBC_TUNABLES": f"x=2:{TUNABLE}={setting}"}) is None
    assert host_allocator.huge_pages_on(
        {"GLIBC_TUNABLES": f"{TUNABLE}={setting}"}) == (
            setting == "1" and _SUPPORTED)


class RerunTest:

  @pytest.mark.skipif(not _SUPPORTED, reason="glibc < 2.35 or kernel THP "
                      "'never': nothing to turn on")
  def test_a_program_runs_again_once_with_huge_pages(self):
    assert _run(None) == [f"{TUNABLE}=1", "2", "True"]

  def test_a_users_setting_runs_once_as_it_is(self):
    assert _run(f"{TUNABLE}=0") == [f"{TUNABLE}=0", "1", "False"]
