"""Tests of jcxl.Pool: round trips, placement, errors, compaction, threads."""

from __future__ import annotations

import os
import shutil
import threading

import jcxl
import ml_dtypes
import numpy as np
import pytest
from jcxl._src import pool as pool_lib
from jcxl._src import topology as topology_lib

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "sysfs")
DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, np.int8]
TIERS = ["host", "cxl", "nvme"]


def random_array(nbytes: int, dtype, seed: int = 0) -> np.ndarray:
  """Random bytes (NaN patterns included) viewed as `dtype`."""
  raw = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
  return raw.view(np.dtype(dtype))


@pytest.fixture
def pool(tmp_path):
  with jcxl.Pool(host="256MiB", cxl="256MiB", nvme="256MiB",
                 nvme_dir=tmp_path) as p:
    yield p


class RoundTripTest:

  @pytest.mark.parametrize("tier", TIERS)
  @pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
  @pytest.mark.parametrize("elements", [1, 3, 4097, (1 << 18) + 5, 8 << 20])
  def test_bit_exact(self, pool, tier, dtype, elements):
    array = random_array(elements * np.dtype(dtype).itemsize, dtype,
                         seed=elements)
    handle = pool.put(array, tier)
    back = pool.get(handle)
    assert back.dtype == array.dtype and back.shape == array.shape
    assert back.tobytes() == array.tobytes()
    assert pool.info(handle).tier.value == tier

  @pytest.mark.parametrize("tier", TIERS)
  def test_one_gib_bit_exact(self, tmp_path, tier):
    array = random_array(1 << 30, np.float32, seed=7)
    capacities = {t: ("1GiB" if t == tier else 0) for t in TIERS}
    with jcxl.Pool(**capacities, nvme_dir=tmp_path) as pool:
      handle = pool.put(array, tier)
      back = pool.get(handle)
      np.testing.assert_array_equal(back.view(np.uint32),
                                    array.view(np.uint32))
      stats = pool.stats()[tier]
      assert stats.bytes_written == stats.bytes_read == 1 << 30

  def test_multidimensional_shape_and_slices(self, pool):
    array = np.arange(4 * 3 * 5, dtype=np.float32).reshape(4, 3, 5)
    handle = pool.put(array, "cxl")
    layer = np.empty((3, 5), np.float32)
    pool.read_bytes_async(handle, layer, offset=2 * layer.nbytes).wait()
    np.testing.assert_array_equal(layer, array[2])
    pool.put_async(handle, np.full((3, 5), -1, np.float32),
                   offset=layer.nbytes).wait()
    expected = array.copy()
    expected[1] = -1
    np.testing.assert_array_equal(pool.get(handle), expected)

  def test_into_out_buffer(self, pool):
    array = np.arange(1000, dtype=np.int8)
    handle = pool.put(array, "host")
    out = np.zeros_like(array)
    result = pool.get(handle, out=out)
    assert result is out
    np.testing.assert_array_equal(out, array)


class PlacementTest:

  @pytest.mark.parametrize("tier", ["host", "cxl"])
  def test_pages_on_chosen_node(self, pool, tier):
    handle = pool.put(np.ones(4 << 20, np.uint8), tier)
    info = pool.info(handle)
    expected = pool.topology.nearest_memory_node(pool.node)
    assert info.node == expected
    nodes = pool.page_nodes(handle)
    assert nodes.size == (4 << 20) // os.sysconf("SC_PAGESIZE")
    assert np.all(nodes == expected), np.unique(nodes)

  def test_nvme_objects_have_no_pages(self, pool):
    handle = pool.put(np.ones(10, np.float32), "nvme")
    with pytest.raises(ValueError, match="nvme tier's file"):
      pool.page_nodes(handle)

  def test_cxl_is_emulated_without_cxl_nodes(self, pool):
    stats = pool.stats()
    assert stats.emulated == (jcxl.Tier.CXL,)
    assert "EMULATED" in stats["cxl"].label()
    assert "16.0 GB/s" in stats["cxl"].label()
    assert "EMULATED" in str(stats)

  def test_fixture_two_sockets_picks_nearest_nodes(self):
    topo = topology_lib.discover(os.path.join(FIXTURES, "two_socket_two_cxl"))
    for device_node, host, cxl in [(0, 0, (2, 3)), (1, 1, (3, 2))]:
      with jcxl.Pool(host="8MiB", cxl="8MiB", topology=topo,
                     node=device_node) as pool:
        stats = pool.stats()
        assert stats["host"].nodes == (host,)
        assert stats["cxl"].nodes == cxl
        assert not stats["cxl"].emulated
        distances = [topo.distance(device_node, n) for n in cxl]
        assert distances == sorted(distances)

  def test_fixture_cxl_weights_follow_hmat_bandwidth(self):
    topo = topology_lib.discover(os.path.join(FIXTURES, "two_socket_two_cxl"))
    with jcxl.Pool(host="8MiB", cxl="64MiB", topology=topo, node=0) as pool:
      handles = [pool.put(np.ones(1 << 20, np.uint8), "cxl") for _ in range(8)]
      nodes = [pool.info(h).node for h in handles]
      # Equal HMAT bandwidth on both expanders: objects alternate.
      assert nodes.count(2) == nodes.count(3) == 4

  def test_fixture_one_node_emulates(self):
    topo = topology_lib.discover(os.path.join(FIXTURES, "one_node"))
    with jcxl.Pool(host="8MiB", cxl="8MiB", topology=topo, node=0) as pool:
      assert pool.stats()["cxl"].emulated
      assert pool.stats()["cxl"].nodes == (0,)

  def test_unknown_node_rejected(self):
    with pytest.raises(ValueError, match="7"):
      jcxl.Pool(host="8MiB", cxl=0, node=7)


class FirmwareLinkTest:
  """The cxl tier's link from HMAT, on sysfs trees saved from VM guests."""

  def test_one_hmat_node_is_a_real_tier_with_its_figures(self):
    topo = topology_lib.discover(os.path.join(FIXTURES, "vm_hmat1"))
    with jcxl.Pool(host="8MiB", cxl="8MiB", topology=topo, node=0) as pool:
      stats = pool.stats()["cxl"]
      assert not stats.emulated and stats.nodes == (1,)
      assert stats.link_source == "HMAT"
      assert stats.firmware_links == (
          pool_lib.FirmwareLink(node=1, read_bandwidth=10 * 2**30,
                                read_latency_s=250e-9),)
      assert stats.label() == (
          "cxl (nodes [1], kernel memory tiers [4]; link from HMAT: node 1 "
          "10.7 GB/s 250 ns)")
      assert "EMULATED" not in str(pool.stats())
      assert pool.link_estimate("cxl") == jcxl.LinkModel(10 * 2**30, 250e-9)
      assert pool.stats()["host"].link_source is None

  def test_two_hmat_nodes_add_up_and_share_by_bandwidth(self):
    topo = topology_lib.discover(os.path.join(FIXTURES, "vm_hmat2"))
    with jcxl.Pool(host="8MiB", cxl="96MiB", topology=topo, node=0) as pool:
      stats = pool.stats()["cxl"]
      assert stats.nodes == (1, 2) and stats.link_source == "HMAT"
      assert stats.firmware_link == jcxl.LinkModel(30 * 2**30, 350e-9)
      assert "node 1 21.5 GB/s 250 ns, node 2 10.7 GB/s 350 ns" in (
          stats.label())
      handles = [pool.put(np.ones(1 << 20, np.uint8), "cxl")
                 for _ in range(24)]
      nodes = [pool.info(h).node for h in handles]
      assert nodes.count(1) == 16 and nodes.count(2) == 8

  def test_cxl_region_without_hmat_is_measured(self):
    topo = topology_lib.discover(os.path.join(FIXTURES, "vm_cxl_region"))
    (node,) = topo.cxl_nodes
    with jcxl.Pool(host="8MiB", cxl="8MiB", topology=topo, node=0) as pool:
      stats = pool.stats()["cxl"]
      assert not stats.emulated and stats.nodes == (node.id,)
      assert stats.link_source is None and stats.firmware_link is None
      assert stats.memory_tiers == (node.memory_tier,)
      assert "HMAT" not in stats.label()

  def test_emulated_tier_keeps_its_label(self):
    topo = topology_lib.discover(os.path.join(FIXTURES, "vm_hmat1"))
    with jcxl.Pool(host="8MiB", cxl="8MiB", topology=topo, node=0,
                   emulate_cxl=True) as pool:
      stats = pool.stats()["cxl"]
      assert stats.emulated and stats.link_source == "EMULATED"
      assert stats.firmware_links == ()
      assert stats.label().startswith("cxl (EMULATED on DRAM of nodes [0]")

  def test_hmat_on_some_nodes_only_gives_no_firmware_link(self, tmp_path):
    root = tmp_path / "sys"
    shutil.copytree(os.path.join(FIXTURES, "vm_hmat2"), root)
    shutil.rmtree(root / "devices/system/node/node2/access0")
    topo = topology_lib.discover(root)
    with jcxl.Pool(host="8MiB", cxl="8MiB", topology=topo, node=0) as pool:
      assert pool.stats()["cxl"].firmware_links == ()
      assert pool.stats()["cxl"].link_source is None


class LinkModelTest:

  def test_copy_never_beats_the_link(self):
    link = jcxl.LinkModel(bandwidth="200MB/s", latency_s=1e-3)
    with jcxl.Pool(host=0, cxl="64MiB", cxl_link=link) as pool:
      array = np.ones(20 << 20, np.uint8)
      handle = pool.put(array, "cxl")
      pool.transfer_records()
      pool.get(handle)
      (record,) = pool.transfer_records()
      assert record.nbytes == array.nbytes
      assert record.finished_ns - record.queued_ns >= (
          array.nbytes / 200e6 + 1e-3) * 1e9
      assert pool.stats()["cxl"].link == link

  def test_set_link_changes_the_model(self):
    with jcxl.Pool(host=0, cxl="16MiB") as pool:
      slower = jcxl.LinkModel(bandwidth="100MB/s")
      pool.set_link("cxl", slower)
      assert pool.stats()["cxl"].link == slower
      handle = pool.put(np.ones(4 << 20, np.uint8), "cxl")
      record = pool.transfer_records()[-1]
      assert record.handle == handle
      assert record.finished_ns - record.started_ns >= (4 << 20) / 100e6 * 1e9

  def test_bad_link(self):
    with pytest.raises(ValueError, match="'/s'"):
      jcxl.LinkModel(bandwidth="16GB")
    with pytest.raises(ValueError, match="latency"):
      jcxl.LinkModel(bandwidth="1GB/s", latency_s=-1)


class BadInputTest:

  def _stored(self, pool):
    arrays = [np.arange(100, dtype=np.float32) * i for i in range(3)]
    return [(pool.put(a, t), a) for a, t in zip(arrays, TIERS)]

  def _assert_intact(self, pool, stored):
    for handle, array in stored:
      np.testing.assert_array_equal(pool.get(handle), array)

  def test_unknown_and_freed_handles(self, pool):
    stored = self._stored(pool)
    with pytest.raises(jcxl.UnknownHandleError, match="handle 12345"):
      pool.get(12345)
    with pytest.raises(jcxl.UnknownHandleError):
      pool.get(-1)
    handle = pool.put(np.ones(3), "host")
    pool.free(handle)
    with pytest.raises(jcxl.UnknownHandleError, match=str(handle)):
      pool.get(handle)
    with pytest.raises(jcxl.UnknownHandleError):
      pool.free(handle)
    # The freed slot is reused, but the stale handle stays invalid.
    new = pool.put(np.ones(3), "host")
    assert new != handle
    with pytest.raises(jcxl.UnknownHandleError):
      pool.get(handle)
    self._assert_intact(pool, stored)

  def test_wrong_shape_or_dtype_on_read(self, pool):
    stored = self._stored(pool)
    handle = stored[0][0]
    with pytest.raises(ValueError, match=r"dtype float64.*float32"):
      pool.get(handle, out=np.empty(100, np.float64))
    with pytest.raises(ValueError, match=r"shape \(99,\)"):
      pool.get(handle, out=np.empty(99, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
      pool.get(handle, out=np.empty(200, np.float32)[::2])
    with pytest.raises(ValueError, match=r"out of 404 bytes at offset 0 does "
                       r"not fit in handle \d+, which holds 400 bytes"):
      pool.read_bytes_async(handle, np.empty(101, np.float32))
    self._assert_intact(pool, stored)

  def test_zero_and_negative_sizes(self, pool):
    with pytest.raises(ValueError, match="empty array"):
      pool.put(np.ones((0, 3)), "cxl")
    with pytest.raises(ValueError, match="negative"):
      pool.allocate((-1, 4), np.float32, "cxl")
    with pytest.raises(ValueError, match="0 bytes"):
      pool.allocate((4, 0), np.float32, "cxl")
    with pytest.raises(ValueError, match="negative"):
      jcxl.Pool(host="-1GiB")
    with pytest.raises(ValueError, match="at least one tier"):
      jcxl.Pool(host=0, cxl=0, nvme=0)
    with pytest.raises(ValueError, match="cxl must be a byte count"):
      jcxl.Pool(cxl="lots")

  def test_bad_tier_and_dtype(self, pool):
    with pytest.raises(ValueError, match="tier must be one of 'host', 'cxl'"):
      pool.put(np.ones(3), "gpu")
    with pytest.raises(TypeError, match="numeric"):
      pool.put(np.array(["a", "b"]), "host")

  def test_full_tier_keeps_stored_objects(self, tmp_path):
    with jcxl.Pool(host="8MiB", cxl="8MiB", nvme="16MiB",
                   nvme_dir=tmp_path) as pool:
      stored = self._stored(pool)
      big = np.ones(6 << 20, np.uint8)
      pool.put(big, "cxl")
      with pytest.raises(jcxl.PoolExhaustedError,
                         match=r"cxl tier is full.*6\.00 MiB.*spill=True"):
        pool.put(big, "cxl")
      with pytest.raises(MemoryError):  # the built-in parent class
        pool.put(big, "cxl")
      self._assert_intact(pool, stored)

  def test_spill_to_next_tier(self, tmp_path):
    with jcxl.Pool(host="8MiB", cxl="8MiB", nvme="16MiB", nvme_dir=tmp_path,
                   spill=True) as pool:
      big = np.arange(6 << 20, dtype=np.uint8)
      first = pool.put(big, "cxl")
      second = pool.put(big, "cxl")
      assert pool.info(first).tier is jcxl.Tier.CXL
      assert pool.info(second).tier is jcxl.Tier.NVME
      np.testing.assert_array_equal(pool.get(second), big)
      pool.put(big, "nvme")
      with pytest.raises(jcxl.PoolExhaustedError, match="nvme"):
        pool.put(big, "cxl")

  def test_tier_off(self):
    with jcxl.Pool(host="8MiB", cxl=0) as pool:
      with pytest.raises(ValueError, match="cxl tier is off"):
        pool.put(np.ones(3), "cxl")

  def test_bad_nvme_dir(self, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
      jcxl.Pool(nvme="8MiB", nvme_dir=tmp_path / "missing")
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(ValueError, match="symbolic link"):
      jcxl.Pool(nvme="8MiB", nvme_dir=link)
    with pytest.raises(ValueError, match="not writable"):
      jcxl.Pool(nvme="8MiB", nvme_dir="/proc")

  def test_close_twice_and_use_after_close(self, tmp_path):
    pool = jcxl.Pool(host="8MiB", cxl="8MiB", nvme="8MiB", nvme_dir=tmp_path)
    handle = pool.put(np.ones(3), "nvme")
    private = pool.nvme_dir
    # The swap file, and the lock that says the pool's process is alive.
    assert sorted(os.listdir(private)) == [".owner.lock", "tier.swap"]
    assert oct(os.stat(private).st_mode & 0o777) == oct(0o700)
    assert oct(os.stat(os.path.join(private, "tier.swap")).st_mode & 0o777
               ) == oct(0o600)
    pool.close()
    assert not os.path.exists(private)
    with pytest.raises(jcxl.PoolClosedError, match="already closed"):
      pool.close()
    with pytest.raises(jcxl.PoolClosedError, match="closed"):
      pool.get(handle)
    with pytest.raises(jcxl.PoolClosedError):
      pool.put(np.ones(3), "host")
    assert "closed" in repr(pool)

  def test_keep_nvme_files(self, tmp_path):
    pool = jcxl.Pool(host=0, cxl=0, nvme="8MiB", nvme_dir=tmp_path,
                     keep_nvme_files=True)
    pool.put(np.ones(3), "nvme")
    private = pool.nvme_dir
    pool.close()
    assert os.path.exists(os.path.join(private, "tier.swap"))


class CompactTest:

  def test_compact_keeps_handles_and_data(self, tmp_path):
    with jcxl.Pool(host="64MiB", cxl="64MiB", nvme="64MiB",
                   nvme_dir=tmp_path) as pool:
      rng = np.random.default_rng(0)
      stored = {}
      for i in range(60):
        size = int(rng.choice([100, 3000, 70_000, 1 << 20, 3 << 20]))
        array = rng.integers(0, 255, size, dtype=np.uint8)
        stored[pool.put(array, TIERS[i % 3])] = array
      for handle in list(stored)[::2]:
        pool.free(handle)
        del stored[handle]
      before = pool.stats()
      assert any(before[t].external_fragmentation > 0 for t in TIERS)
      pool.compact()
      after = pool.stats()
      for tier in TIERS:
        assert after[tier].external_fragmentation == 0
        assert after[tier].reserved <= before[tier].reserved
        assert after[tier].live == before[tier].live
      for handle, array in stored.items():
        np.testing.assert_array_equal(pool.get(handle), array)


class ThreadsTest:

  def test_concurrent_puts_and_gets(self, pool):
    errors = []

    def worker(seed):
      try:
        rng = np.random.default_rng(seed)
        for _ in range(30):
          array = rng.integers(0, 255, int(rng.integers(1, 1 << 18)),
                               dtype=np.uint8)
          handle = pool.put(array, TIERS[int(rng.integers(0, 3))])
          np.testing.assert_array_equal(pool.get(handle), array)
          pool.free(handle)
      except Exception as e:  # surfaced below
        errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert not errors, errors
    assert pool.handles() == []


class RecordsTest:

  def test_records_of_each_transfer(self, pool):
    pool.transfer_records()
    handle = pool.put(np.ones(10 << 20, np.uint8), "host")
    pool.get(handle)
    put, get = pool.transfer_records()
    assert put.to_pool and not get.to_pool
    for record in (put, get):
      assert record.handle == handle and record.nbytes == 10 << 20
      assert record.queued_ns <= record.started_ns <= record.finished_ns
      assert record.ok
