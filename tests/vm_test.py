"""Placement on a real kernel: the pool inside VMs with CPU-less NUMA nodes.

Each test class boots one QEMU guest (software emulation, no KVM) through
virtme-ng, on this machine's own root file system (read-only) and a stock
Debian kernel, and runs tests/vm_guest.py there with this interpreter. The
guest reads its topology, places pool objects, asks the kernel (move_pages)
where their pages are, and brings that back as JSON through a shared
directory; the tests assert on it:

* `hmat1`: one CPU-less node whose HMAT says 10 GiB/s and 250 ns;
* `hmat2`: two CPU-less nodes, HMAT bandwidths 2:1;
* `cxl_region`: QEMU's cxl-type3 device turned into a CXL region, a devdax
  namespace, then system RAM on a node of its own.

tools/vm_setup.sh installs QEMU, the kernel, the CXL tools and virtme-ng
(`make test` runs it first; the tests run it themselves when something is
missing). A boot that fails, or outlives JCXL_VM_TIMEOUT_S seconds (default
300) or what is left of JCXL_VM_BUDGET_S (default 600, for all boots
together), fails its tests with the VM's output. The sysfs files the guests
show are saved under tests/fixtures/sysfs/vm_*; JCXL_UPDATE_VM_FIXTURES=1
refreshes them from the guests.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from jcxl._src import topology

ROOT = pathlib.Path(__file__).resolve().parent.parent
GUEST = pathlib.Path(__file__).resolve().parent / "vm_guest.py"
FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "sysfs"
VM_VENV = pathlib.Path(os.environ.get("VM_VENV", ROOT / ".vm-venv"))
TIMEOUT_S = float(os.environ.get("JCXL_VM_TIMEOUT_S", "300"))
BUDGET_S = float(os.environ.get("JCXL_VM_BUDGET_S", "600"))
_first_boot_at: list[float] = []
GIB = 2**30
MIB = 2**20

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(
        sys.platform != "linux" or platform.machine() != "x86_64",
        reason=(
            "the VM tests boot an x86-64 Debian kernel under "
            "qemu-system-x86_64, which cannot be installed on "
            f"{sys.platform} {platform.machine()}"
        ),
    ),
]


def _hmat(target: int, latency_ns: int, bandwidth: str) -> str:
  """QEMU options: what node 0's CPUs see of node `target` (ACPI HMAT)."""
  entry = f"-numa hmat-lb,initiator=0,target={target},hierarchy=memory"
  return (f"{entry},data-type=access-latency,latency={latency_ns} "
          f"{entry},data-type=access-bandwidth,bandwidth={bandwidth}")


# One CPU-less node (1) behind node 0, as the ACPI tables of a machine with
# one CXL expander describe it. `initiator=0` is required with hmat=on.
HMAT1_OPTS = f"""
-machine hmat=on
-object memory-backend-ram,id=m0,size=1G
-object memory-backend-ram,id=m1,size=1G
-numa node,nodeid=0,cpus=0-1,memdev=m0
-numa node,nodeid=1,memdev=m1,initiator=0
-numa dist,src=0,dst=1,val=20
{_hmat(0, 100, "20G")}
{_hmat(1, 250, "10G")}
"""

# Two CPU-less nodes whose HMAT bandwidths are 2:1.
HMAT2_OPTS = f"""
-machine hmat=on
-object memory-backend-ram,id=m0,size=1G
-object memory-backend-ram,id=m1,size=512M
-object memory-backend-ram,id=m2,size=512M
-numa node,nodeid=0,cpus=0-1,memdev=m0
-numa node,nodeid=1,memdev=m1,initiator=0
-numa node,nodeid=2,memdev=m2,initiator=0
-numa dist,src=0,dst=1,val=20
-numa dist,src=0,dst=2,val=25
-numa dist,src=1,dst=2,val=30
{_hmat(0, 100, "40G")}
{_hmat(1, 250, "20G")}
{_hmat(2, 350, "10G")}
"""

# A CXL Type-3 device behind a CXL host bridge and root port, with a 4 GiB
# fixed memory window. Node 0 is given explicitly so that the window gets a
# node of its own. The host bridge has a second, empty root port: with one
# port Linux leaves the bridge's HDM decoder unprogrammed (pass-through, as
# CXL 2.0 allows), which QEMU 7.2 cannot route, so every read of the region
# returns zeros and writes vanish.
_CXL_FILE = "-object memory-backend-file,share=on,size=256M"
CXL_OPTS = f"""
-object memory-backend-ram,id=m0,size=2G
-numa node,nodeid=0,cpus=0-1,memdev=m0
-machine cxl=on
{_CXL_FILE},id=cxl-mem1,mem-path={{dir}}/cxl.raw
{_CXL_FILE},id=cxl-lsa1,mem-path={{dir}}/lsa.raw
-device pxb-cxl,bus_nr=12,bus=pcie.0,id=cxl.1
-device cxl-rp,port=0,bus=cxl.1,id=root_port13,chassis=0,slot=2
-device cxl-rp,port=1,bus=cxl.1,id=root_port14,chassis=0,slot=3
-device cxl-type3,bus=root_port13,memdev=cxl-mem1,lsa=cxl-lsa1,id=cxl-pmem0
-M cxl-fmw.0.targets.0=cxl.1,cxl-fmw.0.size=4G
"""


def _kernel() -> pathlib.Path | None:
  """The newest /boot kernel whose modules are installed."""
  kernels = []
  for path in pathlib.Path("/boot").glob("vmlinuz-*"):
    release = path.name[len("vmlinuz-"):]
    if (pathlib.Path("/lib/modules") / release).is_dir():
      kernels.append(path)
  return max(kernels, default=None, key=lambda p: p.stat().st_mtime)


def _tools_missing() -> list[str]:
  missing = []
  if not (VM_VENV / "bin" / "vng").exists():
    missing.append(str(VM_VENV / "bin" / "vng"))
  for program in ("qemu-system-x86_64", "cxl", "ndctl", "daxctl"):
    if shutil.which(program) is None:
      missing.append(program)
  if _kernel() is None:
    missing.append("/boot/vmlinuz-* with /lib/modules")
  return missing


@pytest.fixture(scope="session")
def kernel() -> pathlib.Path:
  """Installs what the VMs need (once), and returns the kernel to boot."""
  if _tools_missing():
    done = subprocess.run(["bash", str(ROOT / "tools" / "vm_setup.sh")],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0 or _tools_missing():
      pytest.fail(
          f"tools/vm_setup.sh could not install {_tools_missing()} "
          f"(exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
  return _kernel()


def _one_line(opts: str) -> str:
  return " ".join(opts.split())


def boot(kernel: pathlib.Path, scenario: str, qemu_opts: str, memory: str,
         workdir: pathlib.Path) -> dict:
  """Boots a VM that runs tests/vm_guest.py; returns its result.json.

  Fails the calling test, with the VM's output, when the VM does not start,
  the guest program fails, or the boot outlives TIMEOUT_S (or what is left
  of BUDGET_S).
  """
  out = workdir / "out"
  out.mkdir(parents=True, exist_ok=True)
  guest = " ".join(shlex.quote(str(a)) for a in
                   (sys.executable, GUEST, scenario, out))
  argv = [
      # root in the guest: the CXL guest loads modules and creates a region.
      str(VM_VENV / "bin" / "vng"), "--disable-kvm", "--user=root",
      "--cpus", "2",
      # The kernel's console too: what a VM that fails to start printed.
      "--verbose",
      "--memory", memory,
      # One argument: vng's parser takes a separate "-machine ..." for a flag.
      f"--qemu-opts={_one_line(qemu_opts)}",
      "--run", str(kernel), f"--rwdir={out}", f"--exec={guest}",
  ]
  env = dict(os.environ)
  env["PATH"] = f"{VM_VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
  start = time.monotonic()
  if not _first_boot_at:
    _first_boot_at.append(start)
  timeout_s = min(TIMEOUT_S, BUDGET_S - (start - _first_boot_at[0]))
  if timeout_s <= 0:
    pytest.fail(f"the {scenario} VM was not started: the VM tests' "
                f"{BUDGET_S:.0f} s (JCXL_VM_BUDGET_S) are spent", pytrace=False)
  # Its own session, so that a timeout kills QEMU along with vng.
  process = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             cwd=workdir, env=env, start_new_session=True)
  try:
    output, _ = process.communicate(timeout=timeout_s)
    timed_out = False
  except subprocess.TimeoutExpired:
    os.killpg(process.pid, signal.SIGKILL)
    output, _ = process.communicate()
    timed_out = True
  if timed_out:
    pytest.fail(
        f"the {scenario} VM did not finish within {timeout_s:.0f} s "
        f"(JCXL_VM_TIMEOUT_S {TIMEOUT_S:.0f} s per boot, JCXL_VM_BUDGET_S "
        f"{BUDGET_S:.0f} s for all); its output:\n"
        f"{output.decode(errors='replace')}", pytrace=False)
  wall_s = time.monotonic() - start
  text = output.decode(errors="replace")
  result_path = out / "result.json"
  if not result_path.exists():
    pytest.fail(
        f"the {scenario} VM exited {process.returncode} after {wall_s:.0f} s "
        f"without a result; command:\n{shlex.join(argv)}\noutput:\n{text}",
        pytrace=False)
  result = json.loads(result_path.read_text())
  if process.returncode != 0 or not result.get("ok"):
    pytest.fail(
        f"the {scenario} VM exited {process.returncode} after {wall_s:.0f} s;"
        f" guest error:\n{result.get('error')}\ncommands run in the guest:\n"
        f"{json.dumps(result.get('commands'), indent=1)}\noutput:\n{text}",
        pytrace=False)
  result["wall_s"] = wall_s
  result["output"] = text
  print(f"{scenario} VM: {wall_s:.0f} s wall, guest program "
        f"{result['elapsed_s']:.0f} s\n{result['summary']}\n{result['stats']}")
  if os.environ.get("JCXL_UPDATE_VM_FIXTURES") == "1":
    fixture = FIXTURES / f"vm_{scenario}"
    shutil.rmtree(fixture, ignore_errors=True)
    shutil.copytree(out / "sysfs", fixture)
  return result


def _node(result: dict, node_id: int) -> dict:
  (node,) = [n for n in result["nodes"] if n["id"] == node_id]
  return node


def _pages_only_on(placed: dict, node_id: int) -> None:
  for obj in placed["objects"]:
    assert obj["node"] == node_id, obj
    assert obj["pages_by_node"] == {
        str(node_id): obj["nbytes"] // os.sysconf("SC_PAGESIZE")
    }, obj


def _read_back_intact(result: dict) -> None:
  for tier in ("host", "cxl"):
    bad = [o for o in result[tier]["objects"] if o["bad_bytes"]]
    assert not bad, f"{tier} objects read back wrong: {bad}"


def _fixture_facts(topo: topology.Topology) -> list[tuple]:
  """What a saved tree must keep (MemTotal moves with kernel versions)."""
  return [(n.id, n.cpus, n.distances, n.memory_tier, n.hmat, n.cxl_confirmed)
          for n in topo.nodes]


def _check_saved_fixture(result: dict, workdir: pathlib.Path,
                         scenario: str) -> None:
  """The guest's files reproduce its topology, as does the saved fixture."""
  assert result["capture_matches"]
  captured = topology.discover(workdir / "out" / "sysfs")
  saved = topology.discover(FIXTURES / f"vm_{scenario}")
  assert _fixture_facts(saved) == _fixture_facts(captured)


@pytest.fixture(scope="class")
def hmat1(kernel, tmp_path_factory) -> tuple[dict, pathlib.Path]:
  workdir = tmp_path_factory.mktemp("vm_hmat1")
  return boot(kernel, "hmat1", HMAT1_OPTS, "2G", workdir), workdir


@pytest.fixture(scope="class")
def hmat2(kernel, tmp_path_factory) -> tuple[dict, pathlib.Path]:
  workdir = tmp_path_factory.mktemp("vm_hmat2")
  return boot(kernel, "hmat2", HMAT2_OPTS, "2G", workdir), workdir


@pytest.fixture(scope="class")
def cxl_region(kernel, tmp_path_factory) -> tuple[dict, pathlib.Path]:
  workdir = tmp_path_factory.mktemp("vm_cxl_region")
  opts = CXL_OPTS.format(dir=workdir)
  return boot(kernel, "cxl_region", opts, "2G", workdir), workdir


class OneHmatNodeVmTest:

  def test_topology_finds_the_cpu_less_node_with_its_hmat(self, hmat1):
    result, _ = hmat1
    node0, node1 = _node(result, 0), _node(result, 1)
    assert node0["cpus"] == [0, 1] and node1["cpus"] == []
    assert node1["cxl_candidate"] and not node0["cxl_candidate"]
    assert node1["distances"] == [[0, 20], [1, 10]]
    # QEMU's bandwidth=10G (GiB/s) reads back in MiB/s.
    assert node1["hmat"]["read_bandwidth_mbps"] == 10240
    assert node1["hmat"]["read_latency_ns"] == 250
    assert node0["hmat"]["read_bandwidth_mbps"] == 20480
    assert node0["hmat"]["read_latency_ns"] == 100
    assert 0.9 * GIB < node1["memory_bytes"] <= GIB

  def test_cxl_tier_is_real_with_the_hmat_link(self, hmat1):
    result, _ = hmat1
    cxl = result["tiers"]["cxl"]
    assert not cxl["emulated"] and cxl["nodes"] == [1]
    assert cxl["link_source"] == "HMAT"
    assert "link from HMAT: node 1 10.7 GB/s 250 ns" in cxl["label"]
    assert "EMULATED" not in result["stats"]
    assert cxl["firmware_link"]["bandwidth"] == 10 * GIB
    assert cxl["firmware_link"]["latency_s"] == pytest.approx(250e-9)
    assert result["link_estimate"] == cxl["firmware_link"]

  def test_pages_land_on_their_tiers_nodes(self, hmat1):
    result, _ = hmat1
    assert result["pool_node"] == 0
    _pages_only_on(result["cxl"], 1)
    _pages_only_on(result["host"], 0)

  def test_objects_read_back_intact(self, hmat1):
    _read_back_intact(hmat1[0])

  def test_saved_fixture(self, hmat1):
    _check_saved_fixture(*hmat1, "hmat1")


class TwoHmatNodesVmTest:

  def test_topology_reads_both_bandwidths(self, hmat2):
    result, _ = hmat2
    assert [n["id"] for n in result["nodes"] if n["cxl_candidate"]] == [1, 2]
    assert _node(result, 1)["hmat"]["read_bandwidth_mbps"] == 20480
    assert _node(result, 2)["hmat"]["read_bandwidth_mbps"] == 10240
    assert _node(result, 2)["hmat"]["read_latency_ns"] == 350

  def test_cxl_objects_interleave_by_bandwidth(self, hmat2):
    result, _ = hmat2
    cxl = result["tiers"]["cxl"]
    assert not cxl["emulated"] and cxl["nodes"] == [1, 2]
    assert cxl["link_source"] == "HMAT"
    assert cxl["firmware_link"]["bandwidth"] == 30 * GIB
    assert cxl["firmware_link"]["latency_s"] == pytest.approx(350e-9)
    nodes = [o["node"] for o in result["cxl"]["objects"]]
    assert set(nodes) == {1, 2}
    # Interleaved as the objects arrive, not one node filled first.
    assert 2 in nodes[:3] and 1 in nodes[:3]
    placed = result["cxl"]["bytes_by_node"]
    assert set(placed) == {"1", "2"}
    total = placed["1"] + placed["2"]
    for node, weight in (("1", 2 / 3), ("2", 1 / 3)):
      assert placed[node] / total == pytest.approx(weight, rel=0.05), placed

  def test_pages_land_where_the_pool_says(self, hmat2):
    result, _ = hmat2
    for obj in result["cxl"]["objects"]:
      assert list(obj["pages_by_node"]) == [str(obj["node"])], obj
    _pages_only_on(result["host"], 0)

  def test_objects_read_back_intact(self, hmat2):
    _read_back_intact(hmat2[0])

  def test_saved_fixture(self, hmat2):
    _check_saved_fixture(*hmat2, "hmat2")


class CxlRegionVmTest:

  def test_region_becomes_a_cpu_less_node(self, cxl_region):
    result, _ = cxl_region
    target = result["cxl_setup"]["dax"]["target_node"]
    node = _node(result, target)
    assert target != 0 and node["cpus"] == [] and node["memory_bytes"] > 0

  def test_topology_confirms_it_through_sys_bus_cxl(self, cxl_region):
    result, _ = cxl_region
    target = result["cxl_setup"]["dax"]["target_node"]
    assert [n["id"] for n in result["nodes"] if n["cxl_confirmed"]] == [target]
    # The kernel puts device-dax memory in a slower tier than DRAM.
    tiers = [_node(result, n)["memory_tier"] for n in (0, target)]
    assert tiers[1] > tiers[0], tiers

  def test_cxl_objects_land_on_the_region(self, cxl_region):
    result, _ = cxl_region
    target = result["cxl_setup"]["dax"]["target_node"]
    cxl = result["tiers"]["cxl"]
    assert not cxl["emulated"] and cxl["nodes"] == [target]
    assert cxl["memory_tiers"] == [_node(result, target)["memory_tier"]]
    _pages_only_on(result["cxl"], target)
    _pages_only_on(result["host"], 0)

  def test_objects_read_back_intact(self, cxl_region):
    _read_back_intact(cxl_region[0])

  def test_saved_fixture(self, cxl_region):
    _check_saved_fixture(*cxl_region, "cxl_region")
