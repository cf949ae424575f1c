"""Tests for jcxl._src.topology on fixture sysfs trees and this machine."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil

import pytest

from jcxl._src import topology

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "sysfs"
ONE_NODE = FIXTURES / "one_node"
TWO_SOCKET = FIXTURES / "two_socket_two_cxl"
# Saved from the QEMU guests of tests/vm_test.py (kernel 6.1).
VM_HMAT1 = FIXTURES / "vm_hmat1"
VM_HMAT2 = FIXTURES / "vm_hmat2"
VM_CXL_REGION = FIXTURES / "vm_cxl_region"
NODE_DIR = pathlib.Path("devices", "system", "node")
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  """Stands in for a jax.Device: the attributes device_node reads."""

  platform: str
  pci_bus_id: str | None = None
  local_hardware_id: int | None = None


@dataclasses.dataclass(frozen=True)
class FakeGpuWithoutBusId:
  """Like a JAX CUDA device: no pci_bus_id attribute at all."""

  local_hardware_id: int
  platform: str = "gpu"


def _copy(src: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
  dst = tmp_path / "sys"
  shutil.copytree(src, dst)
  return dst


def _write(path: pathlib.Path, text: str) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)


@pytest.fixture
def two_socket() -> topology.Topology:
  return topology.discover(TWO_SOCKET)


class ParseCpulistTest:

  @pytest.mark.parametrize(
      "text, expected",
      [
          ("", ()),
          ("\n", ()),
          ("0\n", (0,)),
          ("0-3", (0, 1, 2, 3)),
          ("0-3,8-11\n", (0, 1, 2, 3, 8, 9, 10, 11)),
          ("5,1,3", (1, 3, 5)),
          ("0-2,1-3", (0, 1, 2, 3)),
          (" 2 , 4-5 ", (2, 4, 5)),
          ("7-7", (7,)),
      ],
  )
  def test_parses(self, text, expected):
    assert topology.parse_cpulist(text) == expected

  @pytest.mark.parametrize("text", ["a", "0-", "-1", "3-1", "0-1-2", "1,,2"])
  def test_rejects_malformed(self, text):
    with pytest.raises(ValueError, match="my_file"):
      topology.parse_cpulist(text, source="my_file")

  @pytest.mark.parametrize(
      "ids, expected",
      [((), ""), ((3,), "3"), ((0, 1, 2, 3, 8, 10, 11), "0-3,8,10-11")],
  )
  def test_formats_back(self, ids, expected):
    assert topology.format_cpulist(ids) == expected
    assert topology.parse_cpulist(expected) == tuple(ids)


class OneNodeFixtureTest:

  def test_reads_the_node(self):
    topo = topology.discover(ONE_NODE)
    assert topo.sysfs_root == str(ONE_NODE)
    assert topo.nodes == (
        topology.NumaNode(
            id=0,
            cpus=(0, 1),
            memory_bytes=5072672 * 1024,
            distances=((0, 10),),
            memory_tier=4,
            hmat=None,
            cxl_confirmed=False,
        ),
    )

  def test_has_no_cxl(self):
    topo = topology.discover(ONE_NODE)
    assert topo.cxl_nodes == ()
    assert topo.nearest_cxl_nodes(0) == ()
    assert topo.nearest_memory_node(0) == 0
    assert topo.node_of_cpu(1) == 0

  def test_accepts_pathlike_and_str(self):
    assert topology.discover(str(ONE_NODE)) == topology.discover(ONE_NODE)


class TwoSocketFixtureTest:

  def test_node_ids_cpus_and_memory(self, two_socket):
    assert two_socket.node_ids == (0, 1, 2, 3)
    assert [n.cpus for n in two_socket.nodes] == [
        tuple(range(0, 16)),
        tuple(range(16, 32)),
        (),
        (),
    ]
    assert [n.memory_bytes for n in two_socket.nodes] == [
        263546744 * 1024,
        264211236 * 1024,
        132120576 * 1024,
        132120576 * 1024,
    ]

  def test_distance_matrix(self, two_socket):
    matrix = [
        [two_socket.distance(a, b) for b in range(4)] for a in range(4)
    ]
    assert matrix == [
        [10, 21, 14, 24],
        [21, 10, 24, 14],
        [14, 24, 10, 26],
        [24, 14, 26, 10],
    ]
    assert two_socket.node(2).distances == ((0, 14), (1, 24), (2, 10), (3, 26))

  def test_memory_tiers(self, two_socket):
    assert [n.memory_tier for n in two_socket.nodes] == [4, 4, 22, 22]

  def test_hmat(self, two_socket):
    dram = topology.Hmat(
        read_bandwidth_mbps=245760,
        write_bandwidth_mbps=204800,
        read_latency_ns=97,
        write_latency_ns=107,
    )
    cxl = topology.Hmat(
        read_bandwidth_mbps=32768,
        write_bandwidth_mbps=28672,
        read_latency_ns=271,
        write_latency_ns=296,
    )
    assert [n.hmat for n in two_socket.nodes] == [dram, dram, cxl, cxl]

  def test_cxl_nodes(self, two_socket):
    assert [n.id for n in two_socket.cpu_nodes] == [0, 1]
    assert [n.id for n in two_socket.cxl_nodes] == [2, 3]
    assert [n.cxl_confirmed for n in two_socket.nodes] == [
        False,
        False,
        True,
        True,
    ]
    assert [n.is_cxl_candidate for n in two_socket.nodes] == [
        False,
        False,
        True,
        True,
    ]
    assert [n.has_cpus for n in two_socket.nodes] == [True, True, False, False]

  def test_nearest_cxl_nodes(self, two_socket):
    assert two_socket.nearest_cxl_nodes(0) == (2, 3)
    assert two_socket.nearest_cxl_nodes(1) == (3, 2)
    assert two_socket.nearest_cxl_nodes(2) == (2, 3)

  def test_nearest_cxl_nodes_breaks_ties_by_id(self, tmp_path):
    root = _copy(TWO_SOCKET, tmp_path)
    for node_id, row in enumerate(
        ["10 21 20 20", "21 10 20 20", "20 20 10 26", "20 20 26 10"]
    ):
      _write(root / NODE_DIR / f"node{node_id}" / "distance", row + "\n")
    assert topology.discover(root).nearest_cxl_nodes(1) == (2, 3)

  def test_nearest_memory_node(self, two_socket, tmp_path):
    assert two_socket.nearest_memory_node(1) == 1
    assert two_socket.nearest_memory_node(3) == 3
    # A memoryless CPU node (e.g. a CPU-only socket) borrows the nearest.
    root = _copy(TWO_SOCKET, tmp_path)
    _write(root / NODE_DIR / "node1" / "meminfo", "Node 1 MemTotal: 0 kB\n")
    assert topology.discover(root).nearest_memory_node(1) == 3

  def test_node_of_cpu(self, two_socket):
    assert two_socket.node_of_cpu(0) == 0
    assert two_socket.node_of_cpu(15) == 0
    assert two_socket.node_of_cpu(16) == 1
    assert two_socket.node_of_cpu(31) == 1
    with pytest.raises(ValueError, match=r"0-31, but got 32"):
      two_socket.node_of_cpu(32)

  def test_unknown_node_names_id_and_known_ids(self, two_socket):
    with pytest.raises(ValueError, match=r"\[0, 1, 2, 3\], but got 7"):
      two_socket.node(7)
    with pytest.raises(ValueError, match=r"but got 9"):
      two_socket.distance(0, 9)
    with pytest.raises(ValueError, match=r"but got 5"):
      two_socket.nearest_cxl_nodes(5)

  def test_is_frozen_and_hashable(self, two_socket):
    assert hash(two_socket) == hash(topology.discover(TWO_SOCKET))
    with pytest.raises(dataclasses.FrozenInstanceError):
      two_socket.nodes[0].memory_tier = 1  # type: ignore[misc]

  def test_summary(self, two_socket):
    lines = two_socket.summary().splitlines()
    assert lines[0] == f"NUMA topology from {TWO_SOCKET}"
    assert lines[1].split() == [
        "node", "cpus", "memory", "tier", "cxl", "hmat", "read", "distances"
    ]
    assert lines[2].split() == [
        "0", "0-15", "251.3", "GiB", "4", "-", "245760", "MB/s", "97", "ns",
        "10", "21", "14", "24",
    ]
    assert lines[4].split() == [
        "2", "-", "126.0", "GiB", "22", "yes", "32768", "MB/s", "271", "ns",
        "14", "24", "10", "26",
    ]


class VmFixturesTest:
  """Trees a real kernel showed: CPU-less nodes from HMAT and a CXL region."""

  @pytest.mark.parametrize("root", [VM_HMAT1, VM_HMAT2, VM_CXL_REGION],
                           ids=lambda p: p.name)
  def test_saved_as_plain_files(self, root):
    paths = list(root.rglob("*"))
    assert paths and not any(p.is_symlink() for p in paths)

  def test_one_cpu_less_node_with_hmat(self):
    topo = topology.discover(VM_HMAT1)
    assert topo.node_ids == (0, 1)
    assert [n.cpus for n in topo.nodes] == [(0, 1), ()]
    assert [n.id for n in topo.cxl_nodes] == [1]
    assert topo.node(0).hmat == topology.Hmat(
        read_bandwidth_mbps=20480,
        write_bandwidth_mbps=20480,
        read_latency_ns=100,
        write_latency_ns=100,
    )
    assert topo.node(1).hmat == topology.Hmat(
        read_bandwidth_mbps=10240,
        write_bandwidth_mbps=10240,
        read_latency_ns=250,
        write_latency_ns=250,
    )
    assert topo.distance(0, 1) == topo.distance(1, 0) == 20
    # Kernel 6.1 puts every node in the default tier whatever HMAT says.
    assert [n.memory_tier for n in topo.nodes] == [4, 4]
    assert topo.nearest_cxl_nodes(0) == (1,)
    assert not topo.node(1).cxl_confirmed  # no /sys/bus/cxl in this guest
    assert 0.9 * GIB < topo.node(1).memory_bytes <= GIB

  def test_two_cpu_less_nodes_with_hmat(self):
    topo = topology.discover(VM_HMAT2)
    assert [n.id for n in topo.cxl_nodes] == [1, 2]
    assert [n.hmat.read_bandwidth_mbps for n in topo.nodes] == [
        40960, 20480, 10240,
    ]
    assert [n.hmat.read_latency_ns for n in topo.nodes] == [100, 250, 350]
    assert topo.nearest_cxl_nodes(0) == (1, 2)
    assert [topo.distance(0, n) for n in (1, 2)] == [20, 25]
    assert topo.distance(1, 2) == 30
    assert not any(n.cxl_confirmed for n in topo.nodes)

  def test_cxl_region_onlined_as_system_ram(self):
    topo = topology.discover(VM_CXL_REGION)
    assert topo.node_ids == (0, 1)
    (node,) = topo.cxl_nodes
    assert node.id == 1 and node.cpus == () and node.hmat is None
    assert node.cxl_confirmed and not topo.node(0).cxl_confirmed
    # device-dax memory goes to a slower kernel tier than DRAM.
    assert [n.memory_tier for n in topo.nodes] == [4, 22]
    assert 0 < node.memory_bytes <= 256 * 2**20
    assert "yes" in topo.summary().splitlines()[3].split()

  def test_cxl_region_confirmed_by_a_later_block_of_its_range(self):
    # The devdax namespace's metadata takes the region's start: its first
    # 128 MiB block stays offline and node 1 holds the second only.
    region = VM_CXL_REGION / "bus" / "cxl" / "devices" / "region0"
    start = int((region / "resource").read_text(), 16)
    block_size = int(
        (VM_CXL_REGION / "devices/system/memory/block_size_bytes").read_text(),
        16,
    )
    node1 = VM_CXL_REGION / NODE_DIR / "node1"
    assert not (node1 / f"memory{start // block_size}").exists()
    assert (node1 / f"memory{start // block_size + 1}").exists()

  def test_block_outside_the_region_confirms_nothing(self, tmp_path):
    root = _copy(VM_CXL_REGION, tmp_path)
    region = root / "bus" / "cxl" / "devices" / "region0"
    _write(region / "size", "0x8000000\n")  # its first block only
    assert not topology.discover(root).node(1).cxl_confirmed
    (region / "size").unlink()  # without a size: the first block only
    assert not topology.discover(root).node(1).cxl_confirmed

class CxlConfirmationTest:

  def test_memory_block_confirms_without_dax(self, tmp_path):
    root = _copy(TWO_SOCKET, tmp_path)
    shutil.rmtree(root / "bus" / "cxl" / "devices" / "dax_region1")
    topo = topology.discover(root)
    assert [n.cxl_confirmed for n in topo.nodes] == [False, False, True, True]

  def test_dax_confirms_without_memory_block(self, tmp_path):
    root = _copy(TWO_SOCKET, tmp_path)
    shutil.rmtree(root / NODE_DIR / "node3" / "memory321")
    topo = topology.discover(root)
    assert topo.node(3).cxl_confirmed

  def test_candidate_stays_unconfirmed_without_evidence(self, tmp_path):
    root = _copy(TWO_SOCKET, tmp_path)
    shutil.rmtree(root / "bus" / "cxl" / "devices" / "dax_region1")
    shutil.rmtree(root / NODE_DIR / "node3" / "memory321")
    topo = topology.discover(root)
    assert topo.node(3).is_cxl_candidate
    assert not topo.node(3).cxl_confirmed
    assert topo.node(2).cxl_confirmed
    assert "candidate" in topo.summary().splitlines()[5]

  def test_unassigned_region_confirms_nothing(self, tmp_path):
    root = _copy(TWO_SOCKET, tmp_path)
    shutil.rmtree(root / "bus" / "cxl" / "devices" / "dax_region0")
    _write(
        root / "bus" / "cxl" / "devices" / "region0" / "resource",
        "0xffffffffffffffff\n",
    )
    assert not topology.discover(root).node(2).cxl_confirmed

  def test_no_cxl_bus(self, tmp_path):
    root = _copy(TWO_SOCKET, tmp_path)
    shutil.rmtree(root / "bus" / "cxl")
    topo = topology.discover(root)
    assert [n.id for n in topo.cxl_nodes] == [2, 3]
    assert not any(n.cxl_confirmed for n in topo.nodes)


class OptionalFilesTest:

  def test_no_tiers_no_hmat(self, tmp_path):
    root = _copy(TWO_SOCKET, tmp_path)
    shutil.rmtree(root / "devices" / "virtual" / "memory_tiering")
    for node_id in range(4):
      shutil.rmtree(root / NODE_DIR / f"node{node_id}" / "access0")
    topo = topology.discover(root)
    assert [n.memory_tier for n in topo.nodes] == [None] * 4
    assert [n.hmat for n in topo.nodes] == [None] * 4

  def test_partial_hmat(self, tmp_path):
    root = _copy(TWO_SOCKET, tmp_path)
    initiators = root / NODE_DIR / "node2" / "access0" / "initiators"
    (initiators / "write_bandwidth").unlink()
    (initiators / "write_latency").unlink()
    assert topology.discover(root).node(2).hmat == topology.Hmat(
        read_bandwidth_mbps=32768,
        write_bandwidth_mbps=None,
        read_latency_ns=271,
        write_latency_ns=None,
    )

  def test_malformed_hmat_names_file(self, tmp_path):
    root = _copy(TWO_SOCKET, tmp_path)
    path = root / NODE_DIR / "node3" / "access0" / "initiators" / "read_latency"
    _write(path, "fast\n")
    with pytest.raises(ValueError, match=re.escape(str(path))):
      topology.discover(root)

  def test_tier_file_named_nodes(self, tmp_path):
    root = _copy(TWO_SOCKET, tmp_path)
    tier = root / "devices" / "virtual" / "memory_tiering" / "memory_tier22"
    (tier / "nodelist").rename(tier / "nodes")
    assert topology.discover(root).node(3).memory_tier == 22


class MalformedSysfsTest:

  def test_malformed_distance_names_file(self, tmp_path):
    root = _copy(TWO_SOCKET, tmp_path)
    path = root / NODE_DIR / "node1" / "distance"
    _write(path, "21 10 x 14\n")
    with pytest.raises(ValueError, match=re.escape(str(path))):
      topology.discover(root)

  def test_short_distance_row_names_file(self, tmp_path):
    root = _copy(TWO_SOCKET, tmp_path)
    path = root / NODE_DIR / "node2" / "distance"
    _write(path, "14 24 10\n")
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*holds 3"):
      topology.discover(root)

  @pytest.mark.parametrize("name", ["cpulist", "meminfo", "distance"])
  def test_missing_required_file_names_it(self, tmp_path, name):
    root = _copy(TWO_SOCKET, tmp_path)
    path = root / NODE_DIR / "node1" / name
    path.unlink()
    with pytest.raises(ValueError, match=re.escape(str(path))):
      topology.discover(root)

  def test_meminfo_without_memtotal_names_file(self, tmp_path):
    root = _copy(TWO_SOCKET, tmp_path)
    path = root / NODE_DIR / "node0" / "meminfo"
    _write(path, "Node 0 MemFree: 1 kB\n")
    with pytest.raises(ValueError, match=re.escape(str(path))):
      topology.discover(root)

  def test_online_node_without_directory(self, tmp_path):
    root = _copy(TWO_SOCKET, tmp_path)
    shutil.rmtree(root / NODE_DIR / "node3")
    with pytest.raises(ValueError, match=r"lists node 3, but .*node3"):
      topology.discover(root)

  def test_malformed_online_names_file(self, tmp_path):
    root = _copy(TWO_SOCKET, tmp_path)
    path = root / NODE_DIR / "online"
    _write(path, "zero\n")
    with pytest.raises(ValueError, match=re.escape(str(path))):
      topology.discover(root)


class NoNumaSysfsTest:

  def test_falls_back_to_one_node(self, tmp_path):
    _write(tmp_path / "sys" / "devices" / "system" / "cpu" / "online", "0-7\n")
    _write(tmp_path / "proc" / "meminfo", "MemTotal: 16384 kB\nMemFree: 1 kB\n")
    topo = topology.discover(tmp_path / "sys", proc_root=tmp_path / "proc")
    assert topo.nodes == (
        topology.NumaNode(
            id=0,
            cpus=tuple(range(8)),
            memory_bytes=16384 * 1024,
            distances=((0, 10),),
        ),
    )

  def test_empty_root_uses_cpu_count(self, tmp_path):
    topo = topology.discover(tmp_path, proc_root=tmp_path)
    (node,) = topo.nodes
    assert node.cpus == tuple(range(os.cpu_count() or 1))
    assert node.memory_bytes == 0
    with pytest.raises(ValueError, match="no node has memory"):
      topo.nearest_memory_node(0)


class NodeOfCurrentProcessTest:

  @pytest.mark.parametrize(
      "allowed, expected",
      [({17, 18, 3}, 1), ({1, 2, 30}, 0), ({0, 16}, 0), ({99}, 0)],
  )
  def test_majority_node(self, two_socket, monkeypatch, allowed, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: allowed)
    assert topology.node_of_current_process(two_socket) == expected


class DeviceNodeTest:

  @pytest.fixture(autouse=True)
  def _pin_process_to_socket_1(self, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {20, 21})
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

  def test_cpu_device_uses_process_node(self, two_socket):
    assert topology.device_node(FakeDevice("cpu"), two_socket) == 1

  @pytest.mark.parametrize(
      "bus_id, expected",
      [
          ("0000:17:00.0", 0),
          ("00000000:17:00.0", 0),
          ("17:00.0", 0),
          ("0000:B1:00.0", 1),
      ],
  )
  def test_gpu_uses_pci_numa_node(self, two_socket, bus_id, expected):
    device = FakeDevice("gpu", pci_bus_id=bus_id)
    assert topology.device_node(device, two_socket) == expected

  def test_unknown_pci_node_falls_back_to_process(self, tmp_path):
    root = _copy(TWO_SOCKET, tmp_path)
    _write(root / "bus/pci/devices/0000:17:00.0/numa_node", "-1\n")
    device = FakeDevice("gpu", pci_bus_id="0000:17:00.0")
    assert topology.device_node(device, topology.discover(root)) == 1

  def test_missing_pci_device_falls_back_to_process(self, two_socket):
    device = FakeDevice("gpu", pci_bus_id="0000:42:00.0")
    assert topology.device_node(device, two_socket) == 1

  def test_gpu_in_pci_order(self, two_socket, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert topology.device_node(FakeGpuWithoutBusId(0), two_socket) == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert topology.device_node(FakeGpuWithoutBusId(0), two_socket) == 1

  def test_gpu_without_order_falls_back_to_process(self, two_socket):
    # GPUs on two nodes and no PCI ordering promise: no safe answer.
    assert topology.device_node(FakeGpuWithoutBusId(0), two_socket) == 1

  def test_fallback_is_logged_once_per_device(self, two_socket, caplog):
    # Placement asks at every transfer's setup: one line per device, not
    # one per ask.
    caplog.set_level("INFO", logger=topology.__name__)
    for device_id in (7, 7, 7, 8):
      topology.device_node(FakeGpuWithoutBusId(device_id), two_socket)
    lines = [r for r in caplog.records if "no NUMA node" in r.getMessage()]
    assert len(lines) == 2

  def test_gpus_all_on_one_node(self, tmp_path):
    root = _copy(TWO_SOCKET, tmp_path)
    _write(root / "bus/pci/devices/0000:b1:00.0/numa_node", "0\n")
    device = FakeGpuWithoutBusId(1)
    assert topology.device_node(device, topology.discover(root)) == 0

  def test_bad_pci_bus_id(self, two_socket):
    with pytest.raises(ValueError, match="pci_bus_id.*'gpu0'"):
      topology.device_node(FakeDevice("gpu", pci_bus_id="gpu0"), two_socket)

  def test_not_a_device(self, two_socket):
    with pytest.raises(TypeError, match="jax.Device.*int"):
      topology.device_node(3, two_socket)

  def test_jax_cpu_device(self):
    jax = pytest.importorskip("jax")
    topo = topology.discover(ONE_NODE)
    assert topology.device_node(jax.devices("cpu")[0], topo) == 0


@pytest.mark.skipif(
    not os.path.isdir("/sys/devices/system/node"),
    reason="this machine's kernel shows no NUMA nodes",
)
class RealMachineTest:

  def test_discovers_this_machine(self):
    topo = topology.discover("/sys")
    assert 0 in topo.node_ids
    cpus = [c for n in topo.nodes for c in n.cpus]
    assert len(cpus) == len(set(cpus))
    with open("/sys/devices/system/cpu/online") as f:
      assert sorted(cpus) == list(topology.parse_cpulist(f.read()))
    assert all(n.distance_to(n.id) == 10 for n in topo.nodes)
    assert sum(n.memory_bytes for n in topo.nodes) > 0
    assert topology.node_of_current_process(topo) in topo.node_ids
    assert topo.summary().startswith("NUMA topology from /sys")
