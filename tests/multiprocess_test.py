"""Multi-process runs: experiments.train on 2 processes x 4 CPU devices
(jax.distributed on 127.0.0.1, gloo collectives), each process with a pool of
its own, against 1 process x 8 devices; and how a run fails when a process
dies, fails, or configures its pool differently."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from experiments import common as exp_common
from jcxl._src import distributed
from jcxl._src import errors as jcxl_errors
from tests import multiprocess_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# GPT-2-tiny, FSDP over 8 devices (each array's last axis split 8 ways where
# it divides), batch rows over the devices, state in the cxl tier.
TRAIN = ("--model=gpt2-tiny", "--steps=3", "--batch=8", "--seq_len=32",
         "--warmup_steps=1", "--eval_every=3", "--eval_batches=1",
         "--log_every=1", "--data_bytes=512KiB", "--tier=cxl",
         "--checkpoint_every=3")
# The same float32 program, partitioned the same way over 8 devices: the
# runs differ only in how the all-reduces sum (in one process, or over gloo
# between two). Losses agree to RTOL; every state leaf to RTOL plus
# LEAF_ATOL of its largest value (why: experiments.common).
RTOL, LEAF_ATOL = 1e-5, exp_common.STATE_LEAF_ATOL
HEARTBEAT_S = 10
DIM_SQ = multiprocess_worker.DIM ** 2


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def processes(run_dir, *args, per_process=((), ()), count=2, devices=4):
  """Starts experiments.train as `count` processes of one run; yields them
  (Popen, with .log: their stdout and stderr file); kills what is left."""
  address = f"127.0.0.1:{free_port()}"
  procs = []
  try:
    for i in range(count):
      log = open(os.path.join(run_dir, f"log-{i}.txt"), "w+",
                 encoding="utf-8")
      proc = subprocess.Popen(
          [sys.executable, "-m", "experiments.train", *args,
           f"--run_dir={run_dir}", f"--cpu_devices={devices}",
           f"--coordinator_address={address}", f"--num_processes={count}",
           f"--process_id={i}", f"--heartbeat_timeout_s={HEARTBEAT_S}",
           *per_process[i]],
          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=log,
          stderr=subprocess.STDOUT, text=True)
      proc.log = log
      procs.append(proc)
    yield procs
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
      proc.wait()
      proc.log.close()


def output(proc) -> str:
  """What the process printed so far (the child writes the file itself)."""
  with open(proc.log.name, encoding="utf-8") as f:
    return f.read()


def wait_all(procs, timeout_s: float) -> list[int]:
  deadline = time.monotonic() + timeout_s
  for proc in procs:
    try:
      proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pytest.fail(f"process {procs.index(proc)} still running after "
                  f"{timeout_s:.0f} s:\n{output(proc)[-3000:]}")
  return [proc.returncode for proc in procs]


def load(path) -> dict:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def checkpoint_state(run_dir) -> dict[str, np.ndarray]:
  import jcxl  # pylint: disable=g-import-not-at-top
  restored = jcxl.checkpoint.restore(
      os.path.join(run_dir, "checkpoints", "3"),
      sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  flat = jax.tree_util.tree_flatten_with_path(restored)[0]
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


def assert_same_state(got: dict[str, np.ndarray],
                      want: dict[str, np.ndarray]) -> None:
  assert got.keys() == want.keys() and len(got) > 80
  for name, value in want.items():
    np.testing.assert_allclose(
        got[name], value, rtol=RTOL,
        atol=LEAF_ATOL * float(np.abs(value).max(initial=0)), err_msg=name)
  moments = [a for a in want if "['mu']" in a]
  assert moments and any(np.abs(want[a]).max() > 0 for a in moments)


class TwoProcessesTest:

  def test_equal_to_one_process_and_each_pool_holds_its_shards(
      self, tmp_path):
    two, resumed, one = (str(tmp_path / n) for n in ("two", "resumed", "one"))
    for run_dir in (two, resumed):
      os.makedirs(run_dir)
    with processes(two, *TRAIN, "--checkpoint_every=1",
                   "--keep_checkpoints=3") as procs:
      assert wait_all(procs, 600) == [0, 0], output(procs[0])[-3000:]
    assert "process 1 of 2, 4 of 8 devices" in output(procs[1])
    # Each process restores its own shards into its own pool, and the run
    # goes on from step 1 as if it had never stopped.
    with processes(resumed, *TRAIN,
                   f"--resume={two}/checkpoints/1") as procs:
      assert wait_all(procs, 600) == [0, 0], output(procs[0])[-3000:]
    assert "resumed from" in output(procs[0])
    from tests import checkpoint_test  # pylint: disable=g-import-not-at-top
    checkpoint_test.run_train(*TRAIN, f"--run_dir={one}")  # 8 devices here

    want = load(f"{one}/summary.json")
    assert jax.device_count() == 8 and want["steps"] == 3
    for run_dir, first in ((two, 0), (resumed, 1)):
      got = load(f"{run_dir}/summary.json")
      np.testing.assert_allclose(got["train_losses"],
                                 want["train_losses"][first:], rtol=RTOL)
      np.testing.assert_allclose(got["final_val_loss"],
                                 want["final_val_loss"], rtol=RTOL)
      assert_same_state(checkpoint_state(run_dir), checkpoint_state(one))

    # Each process's pool holds the shards of its own 4 devices, no more:
    # half of what the one process's pool holds for all 8.
    ref = load(f"{one}/process-0.json")
    parts = [load(f"{two}/process-{i}.json") for i in range(2)]
    assert [len(p["local_devices"]) for p in parts] == [4, 4]
    assert not set(parts[0]["local_devices"]) & set(parts[1]["local_devices"])
    for part in parts:
      cxl = part["pool"]["cxl"]
      assert cxl["live_bytes"] == part["state_local_bytes"]
      assert 2 * cxl["live_bytes"] == ref["pool"]["cxl"]["live_bytes"]
      assert 2 * cxl["objects"] == ref["pool"]["cxl"]["objects"]
      assert cxl["bytes_read"] > 3 * cxl["live_bytes"] // 2  # streamed


  def test_place_gather_and_offload_process_local_data(self, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    worker = os.path.join(ROOT, "tests", "multiprocess_worker.py")
    procs = [subprocess.Popen(
        [sys.executable, worker, address, str(i), str(tmp_path / f"{i}.json")],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
      outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
      for p in procs:
        p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    rows = multiprocess_worker.ROWS
    total = sum(float(multiprocess_worker.local_rows(i).sum())
                for i in range(2)) + 8 * 2.0
    for i in range(2):
      got = load(tmp_path / f"{i}.json")
      assert got["global_shape"] == [2 * rows, 16]
      assert got["local_equal"] and got["b_equal"]
      assert got["total"] == pytest.approx(total, rel=1e-6)
      # Its 4 devices' rows (rows x 16 floats) and 4 copies of 'b', only.
      assert got["live_bytes"] == rows * 16 * 4 + 4 * 8 * 4
      assert got["objects"] == got["handles"] == 8


def run_workers(tmp_path, *options, timeout_s=300):
  """multiprocess_worker's train on 2 processes, process i with
  `options[i]` (one dict: both); their results and outputs."""
  address = f"127.0.0.1:{free_port()}"
  worker = os.path.join(ROOT, "tests", "multiprocess_worker.py")
  options = options * 2 if len(options) == 1 else options
  procs = [subprocess.Popen(
      [sys.executable, worker, address, str(i), str(tmp_path / f"{i}.json"),
       json.dumps(options[i])],
      cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  try:
    outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
  except subprocess.TimeoutExpired:
    pytest.fail(f"the processes still ran after {timeout_s} s (a hang)")
  finally:
    for p in procs:
      p.kill()
      p.wait()
  results = [load(tmp_path / f"{i}.json")
             if os.path.exists(tmp_path / f"{i}.json") else None
             for i in range(2)]
  return [p.returncode for p in procs], results, outs


def jit_losses(steps: int, halve_every: int | None = None) -> list[float]:
  """The workers' MLP trained by plain jax.jit, in this process on one
  device."""
  import optax  # pylint: disable=g-import-not-at-top
  w = multiprocess_worker
  tx = optax.adam(1e-2)
  params = w.mlp_init()
  state = (params, tx.init(params))
  step = jax.jit(w.mlp_step(tx))
  losses = []
  for i in range(steps):
    *state, loss = step(*state, w.mlp_batch(i, halve_every))
    losses.append(float(loss))
  return losses


class AgreementTest:
  """Every process runs the same executable at every step: DAP's plans
  are agreed, and settings that would compile the step differently are
  refused at the first step, in every process."""

  def test_dap_switches_plans_at_the_same_steps_in_both(self, tmp_path):
    steps = 300
    # 50 s here; each process ran different executables from step 3
    # or so, each waiting in its own collective, when every process tuned
    # on its own.
    # Every 60 steps the batch changes size: a new signature compiled on
    # the step's path, then the other taken from the cache, mid-tuning.
    codes, results, outs = run_workers(
        tmp_path, dict(schedule="dap", steps=steps, tune_hard=True,
                       halve_every=60), timeout_s=240)
    assert codes == [0, 0], outs
    a, b = results
    assert "error" not in a, a["error"]
    # The same decisions at the same steps, and the same plan each step.
    assert a["history"] == b["history"]
    assert a["plans"] == b["plans"]
    what = [w for _, w in a["history"]]
    assert "race" in what and "raced" in what, what
    # A link drift confirmed: re-planned on what was measured.
    drifts = [i for i, w in enumerate(what) if w == "drift"]
    assert drifts and what[drifts[0] + 1] in ("replan", "holds"), what
    assert len({json.dumps(p) for p in a["plans"]}) >= 3  # plans moved
    np.testing.assert_array_equal(a["losses"], b["losses"])
    np.testing.assert_allclose(a["losses"], jit_losses(steps, 60), rtol=RTOL)


  @pytest.mark.parametrize("theirs", [
      dict(schedule="dap", device_budget="1MiB", tier="nvme"),
      dict(schedule="fixed:2")])
  def test_steps_that_differ_fail_at_the_first_step_in_both(
      self, tmp_path, theirs):
    ours = dict(schedule=theirs["schedule"].replace("2", "1"))
    codes, results, outs = run_workers(tmp_path, ours, theirs, timeout_s=120)
    assert codes == [0, 0], outs
    for result in results:
      assert result["losses"] == []  # nothing ran
      error = result["error"]
      assert error.startswith("StepMismatchError: the offloaded step 'step' "
                              "differs between the 2 processes"), error
      if "tier" in theirs:
        assert ("device_budget: process 0 has None, process 1 has 1048576"
                in error), error
        assert ("tier of [0]['layer0']['b']: process 0 has cxl, process 1 "
                "has nvme" in error), error
        # The budget and 25 leaves (8 weights and biases, adam's count and
        # 2 x 8 moments): 12 listed.
        assert "... and 14 more" in error
      else:
        assert ("schedule: process 0 has fixed:1, process 1 has fixed:2"
                in error), error


class HostUpdateTest:
  """update='host' on state that spans processes: each process updates
  its own shards (one host program per device), equal to
  update='device'; 'auto' keeps it on the device (each process would
  choose from its own measured rates)."""

  @pytest.mark.parametrize("devices,shard", [
      (1, True), (2, True), (1, False)])  # FSDP 2x1, 2x2; replicated
  def test_each_process_updates_its_shards_on_the_host(
      self, tmp_path, devices, shard):
    steps = 4
    codes, results, outs = run_workers(
        tmp_path, dict(devices=devices, shard=shard, steps=steps,
                       update="host,device,auto"), timeout_s=120)
    assert codes == [0, 0], outs
    want = jit_losses(steps)
    for result in results:
      host, device, auto = (result[u] for u in ("host", "device", "auto"))
      assert "error" not in host, host["error"]
      assert host["updates"] == ["device", "host"]  # adam's count: device
      assert auto["updates"] == ["device"]
      assert "its state spans processes, where 'auto' would choose" in (
          auto["plan"])
      np.testing.assert_allclose(host["losses"], want, rtol=RTOL)
      assert auto["losses"] == device["losses"]
      # Every shard this process holds. Adam's divisions XLA rewrites
      # (see host_update_test): not bit for bit; 1.2e-7 measured.
      assert host["state"].keys() == device["state"].keys()
      for name, value in device["state"].items():
        np.testing.assert_allclose(host["state"][name], value, rtol=1e-5,
                                   atol=1e-6, err_msg=name)
      # A process holds its share of each FSDP-sharded leaf (all of it,
      # replicated).
      w = "[0]['layer0']['w']"
      assert len(host["state"][w]) == DIM_SQ // (2 if shard else 1)


class FailureTest:

  @pytest.mark.parametrize("victim", [0, 1])
  def test_killed_process_stops_the_other(self, tmp_path, victim):
    run_dir = str(tmp_path)
    with processes(run_dir, *TRAIN[:-1], "--steps=100000",
                   "--eval_every=100000") as procs:
      deadline = time.monotonic() + 300
      while "step     2/" not in output(procs[0]):
        assert procs[0].poll() is None and procs[1].poll() is None, \
            output(procs[0])[-3000:]
        assert time.monotonic() < deadline, output(procs[0])[-3000:]
        time.sleep(0.5)
      os.kill(procs[victim].pid, signal.SIGKILL)
      killed = time.monotonic()
      survivor = procs[1 - victim]
      code = wait_all([survivor], HEARTBEAT_S + 60)[0]
      took = time.monotonic() - killed
    text = output(survivor)
    print(f"process {victim} killed: process {1 - victim} stopped "
          f"{took:.1f} s later (heartbeat timeout {HEARTBEAT_S} s)")
    assert code != 0, text[-3000:]
    assert took < HEARTBEAT_S + 30, (took, text[-3000:])
    # Either JAX's coordination service names what happened (a task that
    # stopped sending heartbeats, or the lost leader), or, when the survivor
    # was inside a collective, the collective's lost connection fails first
    # and fail_together names it.
    by_service = ("Terminating process because the JAX distributed service"
                  in text and
                  ("stopped sending heartbeats" in text if victim == 1
                   else "leader task was preempted/died" in text))
    failed = re.search(rf"jcxl: process {1 - victim} of 2 failed \((.*?)\); "
                       "its peers stop too", text, re.DOTALL)
    lost_peer = ("Connection reset by peer", "Connection closed by peer",
                 "Broken pipe")
    by_collective = failed and any(p in failed.group(1) for p in lost_peer)
    assert by_service or by_collective, text[-3000:]

  def test_failed_process_stops_the_other_at_once(self, tmp_path):
    run_dir = str(tmp_path)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with processes(run_dir, *TRAIN,
                   per_process=((), (f"--nvme_dir={not_a_dir}",))) as procs:
      codes = wait_all(procs, 120)
    assert codes[0] != 0 and codes[1] != 0
    assert "is not a directory" in output(procs[1])
    assert ("jcxl: process 1 of 2 failed (UsageError: --nvme_dir "
            in output(procs[0])), output(procs[0])[-3000:]
    assert "stopping process 0 as well" in output(procs[0])

  def test_an_exception_in_one_stops_the_other_without_fail_together(
      self, tmp_path):
    # Process 1 raises before its step 2; process 0 would wait in that
    # step's collective for ever.
    options = dict(steps=100000)
    codes, _, outs = run_workers(tmp_path, options,
                                 dict(options, raise_at=2), timeout_s=60)
    assert codes[0] != 0 and codes[1] != 0, outs
    assert ("jcxl: process 1 of 2 failed (RuntimeError: process 1 fails "
            "before step 2); its peers stop too" in outs[1]), outs[1]
    # Process 0 hears of it, or its collective loses the peer first.
    told = ("jcxl: process 1 of 2 failed (RuntimeError: process 1 fails "
            "before step 2); stopping process 0 as well" in outs[0])
    lost = re.search(r"jcxl: process 0 of 2 failed \(.*Connection (closed|"
                     r"reset) by peer.*\); its peers stop too", outs[0])
    assert told or lost, outs[0]

  def test_pools_that_disagree_fail_at_start(self, tmp_path):
    run_dir = str(tmp_path)
    with processes(run_dir, *TRAIN,
                   per_process=((), ("--link_bandwidth=8GB/s",))) as procs:
      codes = wait_all(procs, 120)
    assert codes == [1, 1]
    for proc in procs:
      text = output(proc)
      assert "PoolMismatchError: the pools of the 2 processes differ" in text
      assert ("cxl_link: process 0 has emulated on DRAM, 16.0 GB/s, 2.0 us "
              "per transfer, process 1 has emulated on DRAM, 8.0 GB/s" in text
              ), text[-3000:]
      assert "step " not in text  # nothing ran


class DifferencesTest:

  def test_names_each_setting_that_differs(self):
    got = distributed._differences({
        0: {"cxl": "1.00 GiB", "spill": False, "copy_threads": 2},
        1: {"cxl": "2.00 GiB", "spill": False},
    })
    assert got == ["copy_threads: process 0 has 2, process 1 has (missing)",
                   "cxl: process 0 has 1.00 GiB, process 1 has 2.00 GiB"]

  def test_one_process_needs_no_peers(self):
    import jcxl  # pylint: disable=g-import-not-at-top
    with jcxl.Pool(host="1MiB", cxl="1MiB") as pool:
      distributed.check_pools_agree(pool, timeout_s=0.001)
      assert pool._peers_agree  # pylint: disable=protected-access
      with distributed.fail_together():  # a no-op: nothing to watch
        pass
      with pytest.raises(ZeroDivisionError), distributed.fail_together():
        1 / 0  # pylint: disable=pointless-statement


class AgreedValuesTest:
  """What DAP's tuners decide from in a multi-process run (schedules.agreement):
  the slowest process's times, process 0's measured step."""

  def test_a_measured_step_is_process_0s_at_the_slowest_step_time(self):
    from jcxl._src.schedules import agreement  # pylint: disable=g-import-not-at-top
    from jcxl._src.schedules import profile  # pylint: disable=g-import-not-at-top
    mine = profile.StepProfile(
        0.010, (profile.LayerProfile("a", 4, 0, 1e-3, 0.0, 2e-3, 1),),
        (2e-3,), {"cxl": 4}, {"cxl": 4e3})
    theirs = dataclasses.replace(mine, step_s=0.012, bytes_by_tier={})
    values = [agreement.encode_profile(p) for p in (mine, theirs)]
    values = json.loads(json.dumps(values))  # as exchanged
    assert agreement.agreed_profile(values) == dataclasses.replace(
        mine, step_s=0.012)
    assert agreement.agreed_profile([None, values[1]]) is None

  def test_estimates_take_the_slowest_and_refuse_other_steps(self):
    from jcxl._src.schedules import agreement  # pylint: disable=g-import-not-at-top
    from jcxl._src.schedules import costmodel  # pylint: disable=g-import-not-at-top
    segments = [costmodel.Segment("a", 8, "cxl", 1e-3),
                costmodel.Segment("b", 8, "cxl", 3e-3)]
    links = {"cxl": costmodel.Link(10e9, 1e-6)}
    slower = ([dataclasses.replace(segments[0], compute_s=2e-3),
               segments[1]], {"cxl": costmodel.Link(8e9, 2e-6)})
    values = [agreement.encode_estimates(segments, links),
              agreement.encode_estimates(*slower)]
    got = agreement.agreed_estimates(segments, links, values)
    assert [s.compute_s for s in got[0]] == [2e-3, 3e-3]
    assert got[1] == {"cxl": costmodel.Link(8e9, 2e-6)}
    other = agreement.encode_estimates(segments[:1], links)
    with pytest.raises(jcxl_errors.StepMismatchError,
                       match="the processes traced different steps"):
      agreement.agreed_estimates(segments, links, [values[0], other])


class ClusterFlagsTest:

  def test_a_process_id_past_the_count_is_refused(self):
    from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
    from experiments import cluster  # pylint: disable=g-import-not-at-top
    from experiments import train  # pylint: disable=g-import-not-at-top
    saved = flagsaver.save_flag_values(train.FLAGS)
    try:
      train.FLAGS(["train", "--num_processes=2", "--process_id=2"])
      with pytest.raises(ValueError, match=r"--process_id must be less "
                         r"than --num_processes \(2\), but got 2"):
        cluster.initialize(train.CLUSTER)
    finally:
      flagsaver.restore_flag_values(saved, train.FLAGS)
