"""Tests for benchmarks.bench and a dry run of experiments/pool_bandwidth.py."""

from __future__ import annotations

import json
import os
import re
import shutil

from absl import app
from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest

from benchmarks import bench
from experiments import pool_bandwidth

FLAGS = flags.FLAGS


class TimingTest:

  def test_best_and_bandwidth(self):
    timing = bench.Timing(nbytes=2_000_000_000, seconds=(2.0, 1.0, 4.0))
    assert timing.best_s == 1.0
    assert timing.bandwidth == 2e9
    assert timing.gbps == pytest.approx(2.0)
    assert timing.to_json()["seconds"] == [2.0, 1.0, 4.0]

  def test_no_repetitions_is_rejected(self):
    with pytest.raises(ValueError, match="at least one repetition"):
      bench.Timing(nbytes=1, seconds=())

  def test_best_of_calls_repeats_times(self):
    calls = []
    timing = bench.best_of(lambda: calls.append(1), nbytes=8, repeats=4)
    assert len(calls) == 4
    assert len(timing.seconds) == 4
    assert all(s >= 0 for s in timing.seconds)

  def test_best_of_rejects_zero_repeats(self):
    with pytest.raises(ValueError, match="repeats must be >= 1"):
      bench.best_of(lambda: None, nbytes=8, repeats=0)

  def test_interleaved_takes_turns_in_rotated_order(self):
    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in "abc"}
    timings = bench.interleaved(fns, nbytes=1, repeats=3)
    assert order == list("abc" "bca" "cab")
    assert set(timings) == set("abc")
    assert all(len(t.seconds) == 3 for t in timings.values())

  def test_interleaved_self_timed_uses_returned_seconds(self):
    timings = bench.interleaved(
        {"own": lambda: 123.0, "wall": lambda: np.zeros(3)}, nbytes=1,
        repeats=2, self_timed=["own"])
    assert timings["own"].seconds == (123.0, 123.0)
    assert timings["wall"].best_s < 123.0

  def test_interleaved_rejects_unknown_self_timed(self):
    with pytest.raises(ValueError, match="not in fns"):
      bench.interleaved({"a": lambda: None}, nbytes=1, repeats=1,
                        self_timed=["dd"])


class BufferTest:

  @pytest.mark.parametrize("nbytes", [1, 4095, 4096, 1 << 20])
  def test_aligned_empty_is_page_aligned(self, nbytes):
    out = bench.aligned_empty(nbytes)
    assert out.nbytes == nbytes
    assert out.dtype == np.uint8
    assert out.ctypes.data % bench.PAGE_BYTES == 0

  def test_aligned_empty_rejects_zero(self):
    with pytest.raises(ValueError, match="nbytes must be > 0"):
      bench.aligned_empty(0)

  def test_pretouched_is_filled(self):
    out = bench.pretouched(10_000, fill=7)
    assert out.ctypes.data % bench.PAGE_BYTES == 0
    assert (out == 7).all()

  @pytest.mark.parametrize("nbytes", [5, 8, 4099, 1 << 16])
  def test_pattern_is_deterministic_and_not_constant(self, nbytes):
    a = bench.pattern(nbytes)
    np.testing.assert_array_equal(a, bench.pattern(nbytes))
    assert a.ctypes.data % bench.PAGE_BYTES == 0
    assert a.any()
    if nbytes >= 4096:
      pages = a[:nbytes // 4096 * 4096].reshape(-1, 4096)
      assert len({p.tobytes() for p in pages}) == len(pages)

  def test_memcpy_copies(self):
    src = bench.pattern(1 << 16)
    dst = bench.pretouched(1 << 16)
    bench.memcpy(dst, src)
    np.testing.assert_array_equal(dst, src)


class DdTest:

  @pytest.mark.parametrize("text, nbytes, seconds", [
      ("256+0 records in\n256+0 records out\n268435456 bytes (268 MB, 256 "
       "MiB) copied, 0.390819 s, 687 MB/s\n", 268435456, 0.390819),
      ("1048576 bytes (1.0 MB) copied, 0.00123 s, 852 MB/s", 1048576,
       0.00123),
      ("4096 bytes (4.1 kB, 4.0 KiB) copied, 5e-05 s, 82 MB/s", 4096, 5e-05),
  ])
  def test_parse_dd_report(self, text, nbytes, seconds):
    report = bench.parse_dd_report(text)
    assert report.nbytes == nbytes
    assert report.seconds == pytest.approx(seconds)
    assert report.bandwidth == pytest.approx(nbytes / seconds)

  def test_parse_dd_report_rejects_other_text(self):
    with pytest.raises(ValueError, match="no 'N bytes ... copied"):
      bench.parse_dd_report("dd: failed to open 'x': Invalid argument")

  def test_write_file_then_dd_reads_it_all(self, tmp_path):
    if shutil.which("dd") is None:
      pytest.skip("no dd on this machine")
    if bench.describe_disk(tmp_path).fs_type == "tmpfs":
      pytest.skip(f"{tmp_path} is tmpfs: no O_DIRECT")
    data = bench.pattern(3 << 20)
    path = tmp_path / "data.bin"
    bench.write_file(path, data, block_bytes=1 << 20)
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), data)
    report = bench.dd_direct_read(path)
    assert report.nbytes == data.nbytes
    assert report.seconds > 0

  def test_dd_failure_raises_with_dd_message(self, tmp_path):
    if shutil.which("dd") is None:
      pytest.skip("no dd on this machine")
    with pytest.raises(RuntimeError, match="No such file"):
      bench.dd_direct_read(tmp_path / "missing.bin")


class TargetTest:

  def test_pass_and_fail(self):
    ok = bench.Target("host get", 9e9, 10e9, 0.9, "memcpy")
    bad = bench.Target("host get", 8.9e9, 10e9, 0.9, "memcpy")
    assert ok.passed and not bad.passed
    assert str(ok).startswith("PASS host get: 9.00 GB/s = 90% of memcpy")
    assert str(bad).startswith("FAIL host get")
    assert bad.to_json()["ratio"] == pytest.approx(0.89)

  def test_zero_reference_fails(self):
    assert not bench.Target("x", 1.0, 0.0, 0.9, "dd").passed


class MachineTest:

  def test_describe_machine(self, tmp_path):
    machine = bench.describe_machine(tmp_path)
    assert machine.cores >= 1
    assert 1 <= machine.usable_cores <= machine.cores
    assert machine.memory_bytes > 0
    assert machine.numa_nodes >= 1
    assert len(machine.load_average) == 3
    assert machine.disk is not None and machine.disk.fs_type
    text = str(machine)
    assert f"{machine.cores} cores" in text
    assert "disk: " in text
    json.dumps(machine.to_json())

  def test_describe_disk_finds_the_mount(self, tmp_path):
    disk = bench.describe_disk(tmp_path)
    real = os.path.realpath(tmp_path)
    assert real == disk.mount_point or real.startswith(
        disk.mount_point.rstrip("/") + "/")
    assert str(tmp_path) in str(disk)

  def test_describe_machine_without_disk(self):
    machine = bench.describe_machine()
    assert machine.disk is None
    assert "disk:" not in str(machine)


@pytest.fixture
def parsed_flags():
  if not FLAGS.is_parsed():
    FLAGS.mark_as_parsed()
  with flagsaver.flagsaver():
    yield


@pytest.mark.usefixtures("parsed_flags")
class PoolBandwidthTest:

  def test_dry_run_reports_every_tier_and_target(self, tmp_path, capsys):
    json_out = tmp_path / "out" / "results.json"
    with flagsaver.flagsaver(dry_run=True, nvme_dir=str(tmp_path / "nvme"),
                             json_out=str(json_out), link_bandwidth="2GB/s",
                             link_latency_us=3.0):
      pool_bandwidth.main(["pool_bandwidth"])
    text = capsys.readouterr().out
    results = json.loads(json_out.read_text())
    assert results["config"]["size"] == pool_bandwidth.DRY_RUN_SIZE
    rows = results["rows"]
    assert [(r["tier"], r["direction"]) for r in rows] == [
        (t, d) for t in ("host", "cxl", "nvme") for d in ("put", "get")]
    assert all(r["pool"]["gbps"] > 0 and r["memcpy"]["gbps"] > 0
               for r in rows)
    cxl_label = next(r["label"] for r in rows if r["tier"] == "cxl")
    assert "2.0 GB/s, 3.0 us per transfer" in cxl_label
    for line in text.splitlines():
      if re.search(r"\bcxl\b", line):
        assert cxl_label in line, line
    nvme = next(r for r in rows if r["tier"] == "nvme" and
                r["direction"] == "get")
    assert nvme["reference"] == "dd O_DIRECT"
    assert nvme["reference_gbps"] > 0
    verdicts = [l for l in text.splitlines()
                if l.startswith(("PASS ", "FAIL ", "SKIP "))]
    assert len(verdicts) == 4
    assert len(results["targets"]) == 4
    assert "DRY RUN" in text
    assert not list((tmp_path / "nvme").iterdir())  # pool and dd files gone

  def test_one_tier_skips_the_other_targets(self, tmp_path, capsys):
    with flagsaver.flagsaver(dry_run=True, tiers=["host"],
                             nvme_dir=str(tmp_path / "never")):
      pool_bandwidth.main(["pool_bandwidth"])
    text = capsys.readouterr().out
    assert "SKIP nvme get vs dd O_DIRECT: nvme not in --tiers" in text
    assert "SKIP cxl get vs link: cxl not in --tiers" in text
    assert not (tmp_path / "never").exists()

  def test_stray_arguments_are_rejected(self):
    with pytest.raises(app.UsageError, match="unexpected arguments: extra"):
      pool_bandwidth.main(["pool_bandwidth", "extra"])

  @pytest.mark.parametrize("overrides, match", [
      ({"tiers": ["host", "gpu"]}, "--tiers must be one of .* 'gpu'"),
      ({"tiers": ["host", "host"]}, "--tiers names a tier twice"),
      ({"tiers": []}, "--tiers must name at least one"),
      ({"size": "lots"}, "--size must be a byte count"),
      ({"size": "1000"}, "--size must be a positive multiple of 4096"),
      ({"size": "0"}, "--size must be a positive multiple"),
      ({"link_bandwidth": "fast"}, "--link_bandwidth must end in '/s'"),
      ({"link_bandwidth": "0GB/s"}, "--link_bandwidth must be positive"),
  ])
  def test_bad_flags_are_rejected(self, overrides, match, tmp_path):
    with flagsaver.flagsaver(nvme_dir=str(tmp_path), **overrides):
      with pytest.raises(app.UsageError, match=match):
        pool_bandwidth.main(["pool_bandwidth"])

  def test_nvme_dir_that_cannot_be_created(self, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with flagsaver.flagsaver(nvme_dir=str(blocker / "nvme")):
      with pytest.raises(app.UsageError, match="--nvme_dir .* cannot be "
                         "created"):
        pool_bandwidth.main(["pool_bandwidth"])

  def test_nvme_dir_on_tmpfs(self):
    shm = "/dev/shm"
    if not os.path.isdir(shm) or bench.describe_disk(shm).fs_type != "tmpfs":
      pytest.skip("no tmpfs at /dev/shm")
    path = os.path.join(shm, f"jcxl-bench-test-{os.getpid()}")
    try:
      with flagsaver.flagsaver(nvme_dir=path):
        with pytest.raises(app.UsageError, match="--nvme_dir .* tmpfs"):
          pool_bandwidth.main(["pool_bandwidth"])
      assert not os.path.exists(path)
    finally:
      shutil.rmtree(path, ignore_errors=True)

  def test_json_out_that_is_a_directory(self, tmp_path):
    with flagsaver.flagsaver(nvme_dir=str(tmp_path), json_out=str(tmp_path)):
      with pytest.raises(app.UsageError, match="--json_out .* is a "
                         "directory"):
        pool_bandwidth.main(["pool_bandwidth"])
