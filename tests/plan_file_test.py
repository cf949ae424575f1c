"""Reading saved plans (schedule='plan:PATH' and 'dap:PATH'): only a regular
file of bounded size is read."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from jcxl._src.schedules import plan as schedule_lib


@contextlib.contextmanager
def deadline(seconds: float):
  """Turns a hang (an open or a read that never returns) into a failure."""

  def expired(signum, frame):
    raise TimeoutError(f"still reading the plan after {seconds} s")

  previous = signal.signal(signal.SIGALRM, expired)
  signal.setitimer(signal.ITIMER_REAL, seconds)
  try:
    yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


def a_plan() -> schedule_lib.Plan:
  return schedule_lib.Plan(
      (schedule_lib.LayerPlan("l0", 4096, ("cxl",), 1, 0),
       schedule_lib.LayerPlan("l1", 8192, ("host",), 2, 1 << 20)),
      schedule="fixed:1")


class PlanFileTest:

  @pytest.mark.parametrize("kind", ["plan", "dap"])
  def test_a_saved_plan_loads(self, tmp_path, kind):
    path = str(tmp_path / "plan.json")
    a_plan().save(path)
    assert schedule_lib.Plan.load(path) == a_plan()
    schedule = schedule_lib.parse_schedule(f"{kind}:{path}")
    layers = (schedule.start if kind == "dap" else schedule)
    assert layers.prefetch_for("l1") == 2

  @pytest.mark.parametrize("kind", ["plan", "dap"])
  def test_a_fifo_is_refused_without_waiting_for_a_writer(self, tmp_path,
                                                          kind):
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    with deadline(10), pytest.raises(
        ValueError, match=r"is not a regular file \(it is a FIFO\)"):
      schedule_lib.parse_schedule(f"{kind}:{fifo}")

  def test_a_device_is_refused_before_it_is_read(self):
    # /dev/zero would never end; /dev/null shows the same refusal safely.
    with deadline(10), pytest.raises(
        ValueError, match=r"is not a regular file \(it is a character "
        "device\\)"):
      schedule_lib.parse_schedule("plan:/dev/null")

  def test_a_file_past_the_limit_is_refused_before_it_is_read(self,
                                                              tmp_path):
    path = tmp_path / "huge.json"
    with open(path, "wb") as f:  # sparse: no disk, no memory
      f.truncate((64 << 20) + 1)
    with pytest.raises(ValueError, match=r"is 67108865 bytes, larger than "
                       r"a plan file may be \(64\.00 MiB\)"):
      schedule_lib.parse_schedule(f"plan:{path}")

  def test_a_directory_or_binary_file_is_refused(self, tmp_path):
    with pytest.raises(ValueError, match="cannot read plan|not a regular"):
      schedule_lib.parse_schedule(f"plan:{tmp_path}")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="is not UTF-8 text"):
      schedule_lib.parse_schedule(f"plan:{tmp_path / 'bin.json'}")
