"""The program tests/vm_test.py runs inside a VM, with the host's interpreter.

It reads the guest kernel's NUMA topology, places pool objects, asks the
kernel (move_pages) where their pages landed, saves the sysfs files that
`jcxl.topology` reads into `OUT/sysfs`, and writes what it saw to
`OUT/result.json`:

  <host python> tests/vm_guest.py SCENARIO OUT

SCENARIO is `hmat1` (one CPU-less node with HMAT figures), `hmat2` (two,
with different bandwidths) or `cxl_region` (a CXL region that this program
creates through the kernel's CXL driver and onlines as system RAM first).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback

_STARTED = time.monotonic()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_NODE_DIR = os.path.join("devices", "system", "node")
_TIERS_DIR = os.path.join("devices", "virtual", "memory_tiering")
_CXL_DIR = os.path.join("bus", "cxl", "devices")
_HMAT_FILES = ("read_bandwidth", "write_bandwidth", "read_latency",
               "write_latency")
_CXL_MODULES = ("cxl_acpi", "cxl_port", "cxl_pci", "cxl_mem", "cxl_pmem",
                "nd_pmem", "dax_pmem", "device_dax", "kmem")
MIB = 2**20


def import_pool():
  """Imports jcxl's pool and topology modules, without jcxl/__init__.py.

  The package's __init__ brings in jax (placement, streaming, the step
  transform), which the pool does not need and which takes minutes to import
  under software emulation (255 s in one guest, against 19 s for Python
  alone). The modules and their C++ core are the installed ones.
  """
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.find_spec("jcxl")
  sys.modules["jcxl"] = importlib.util.module_from_spec(spec)
  from jcxl._src import pool  # pylint: disable=g-import-not-at-top
  from jcxl._src import topology  # pylint: disable=g-import-not-at-top
  return pool, topology


def _copy_file(src_root: str, dst_root: str, relative: str) -> None:
  """Copies one sysfs file's text, if it exists (never a directory walk)."""
  try:
    with open(os.path.join(src_root, relative), encoding="ascii") as f:
      text = f.read()
  except OSError:
    return
  path = os.path.join(dst_root, relative)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="ascii") as f:
    f.write(text)


def _listdir(path: str) -> list[str]:
  try:
    return sorted(os.listdir(path))
  except OSError:
    return []


def capture_sysfs(src: str, dst: str) -> None:
  """Saves the sysfs files that jcxl.topology reads, by name.

  The node `accessN/` directories and `memory_tiering` hold symlinks that
  loop back up the tree, so each file is named, never found by a walk.
  Memory block entries `nodeN/memoryB` (symlinks) become directories holding
  the block's `online` file.
  """
  for name in ("online", "possible", "has_cpu", "has_memory"):
    _copy_file(src, dst, os.path.join(_NODE_DIR, name))
  _copy_file(src, dst, os.path.join("devices", "system", "cpu", "online"))
  _copy_file(src, dst,
             os.path.join("devices", "system", "memory", "block_size_bytes"))
  for node in _listdir(os.path.join(src, _NODE_DIR)):
    if not re.fullmatch(r"node\d+", node):
      continue
    node_dir = os.path.join(_NODE_DIR, node)
    for name in ("cpulist", "meminfo", "distance"):
      _copy_file(src, dst, os.path.join(node_dir, name))
    for name in _HMAT_FILES:
      _copy_file(src, dst,
                 os.path.join(node_dir, "access0", "initiators", name))
    for name in _listdir(os.path.join(src, node_dir)):
      if re.fullmatch(r"memory\d+", name):
        _copy_file(src, dst, os.path.join(node_dir, name, "online"))
  for tier in _listdir(os.path.join(src, _TIERS_DIR)):
    if re.fullmatch(r"memory_tier\d+", tier):
      _copy_file(src, dst, os.path.join(_TIERS_DIR, tier, "nodelist"))
  for name in _listdir(os.path.join(src, _CXL_DIR)):
    if re.fullmatch(r"region\d+", name):
      for leaf in ("resource", "size"):
        _copy_file(src, dst, os.path.join(_CXL_DIR, name, leaf))
    elif re.fullmatch(r"dax_region\d+", name):
      for dax in _listdir(os.path.join(src, _CXL_DIR, name)):
        if re.fullmatch(r"dax\d+\.\d+", dax):
          _copy_file(src, dst, os.path.join(_CXL_DIR, name, dax, "target_node"))


def _run(argv: list[str], log: list[dict]) -> str:
  """Runs a command, logging it; raises with its output when it fails."""
  started = time.monotonic()
  done = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                        check=False)
  log.append({"argv": argv, "rc": done.returncode, "stdout": done.stdout,
              "stderr": done.stderr, "seconds": time.monotonic() - started})
  if done.returncode != 0:
    raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): "
                       f"{done.stdout}{done.stderr}")
  return done.stdout


def create_cxl_region(log: list[dict]) -> dict:
  """Turns QEMU's cxl-type3 device into a CPU-less node of system RAM.

  The path a CXL memory expander takes on a real machine: the CXL drivers
  enumerate the device, `cxl create-region` programs the HDM decoders, and
  the region's memory reaches the page allocator through device-dax (kmem).
  """
  for module in _CXL_MODULES:
    _run(["modprobe", module], log)
  # The memdev appears asynchronously once cxl_pci/cxl_mem have probed.
  deadline = time.monotonic() + 30
  while not os.path.exists("/sys/bus/cxl/devices/mem0"):
    if time.monotonic() > deadline:
      raise RuntimeError("no /sys/bus/cxl/devices/mem0 after loading "
                         f"{', '.join(_CXL_MODULES)}")
    time.sleep(0.5)
  region = json.loads(_run(["cxl", "create-region", "-m", "-d", "decoder0.0",
                            "-w", "1", "-t", "pmem", "-s", "256M", "mem0"],
                           log))
  namespace = json.loads(_run(["ndctl", "create-namespace", "-r", "region0",
                               "-m", "devdax"], log))
  dax_name = namespace["daxregion"]["devices"][0]["chardev"]
  onlined = json.loads(_run(["daxctl", "reconfigure-device",
                             "--mode=system-ram", dax_name], log))
  if isinstance(onlined, list):
    onlined = onlined[0]
  return {"region": region, "namespace": namespace, "dax": onlined}


def bus_facts() -> dict:
  """What /sys/bus/cxl and /sys/bus/dax show, by name (for the record)."""
  cxl_dir = os.path.join("/sys", _CXL_DIR)
  facts = {"cxl_devices": _listdir(cxl_dir), "regions": {}, "dax": {}}
  for name in facts["cxl_devices"]:
    if re.fullmatch(r"region\d+", name):
      facts["regions"][name] = {
          leaf: _read_text(os.path.join(cxl_dir, name, leaf))
          for leaf in ("resource", "size", "mode")}
  dax_dir = "/sys/bus/dax/devices"
  for name in _listdir(dax_dir):
    facts["dax"][name] = {
        "device": os.path.realpath(os.path.join(dax_dir, name)),
        "target_node": _read_text(os.path.join(dax_dir, name, "target_node")),
    }
  facts["block_size_bytes"] = _read_text(
      "/sys/devices/system/memory/block_size_bytes")
  return facts


def _read_text(path: str) -> str | None:
  try:
    with open(path, encoding="ascii") as f:
      return f.read().strip()
  except OSError:
    return None


def node_facts(topo) -> list[dict]:
  out = []
  for n in topo.nodes:
    out.append({
        "id": n.id,
        "cpus": list(n.cpus),
        "memory_bytes": n.memory_bytes,
        "distances": [list(d) for d in n.distances],
        "memory_tier": n.memory_tier,
        "hmat": None if n.hmat is None else dataclasses.asdict(n.hmat),
        "cxl_candidate": n.is_cxl_candidate,
        "cxl_confirmed": n.cxl_confirmed,
    })
  return out


def place_objects(pool, tier: str, count: int, nbytes: int) -> dict:
  """Puts `count` objects in `tier`; where the pool and the kernel put them."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  page = os.sysconf("SC_PAGESIZE")
  objects = []
  bytes_by_node = collections.Counter()
  for i in range(count):
    data = np.full(nbytes, i % 251 + 1, np.uint8)  # never all zeros
    handle = pool.put(data, tier)
    info = pool.info(handle)
    pages = collections.Counter(int(x) for x in pool.page_nodes(handle))
    for node, n in pages.items():
      bytes_by_node[str(node)] += n * page
    back = pool.get(handle)
    bad = np.flatnonzero(back != data)
    objects.append({
        "node": info.node,
        "nbytes": info.nbytes,
        "pages_by_node": {str(k): v for k, v in pages.items()},
        "bad_bytes": int(bad.size),
        "first_bad": int(bad[0]) if bad.size else None,
        "fill": i % 251 + 1,
        "seen": (sorted({int(v) for v in back[bad[:256]]})
                 if bad.size else []),
    })
  return {"objects": objects, "bytes_by_node": dict(bytes_by_node)}


def tier_facts(stats) -> dict:
  link = stats.firmware_link
  return {
      "label": stats.label(),
      "nodes": list(stats.nodes),
      "emulated": stats.emulated,
      "link_source": stats.link_source,
      "memory_tiers": list(stats.memory_tiers),
      "firmware_links": [dataclasses.asdict(f) for f in stats.firmware_links],
      "firmware_link": None if link is None else {
          "bandwidth": link.bandwidth, "latency_s": link.latency_s},
  }


def main(argv: list[str]) -> int:
  if len(argv) != 3:
    print(__doc__, file=sys.stderr)
    return 2
  scenario, out = argv[1], argv[2]
  result: dict = {"scenario": scenario, "kernel": os.uname().release,
                  "commands": []}
  try:
    if scenario == "cxl_region":
      result["cxl_setup"] = create_cxl_region(result["commands"])
    started = time.monotonic()
    pool_lib, topology = import_pool()
    result["import_s"] = time.monotonic() - started
    result["jax_imported"] = "jax" in sys.modules
    result["sys_bus"] = bus_facts()

    capture = os.path.join(out, "sysfs")
    shutil.rmtree(capture, ignore_errors=True)
    capture_sysfs("/sys", capture)
    live = topology.discover("/sys")
    saved = topology.discover(capture)
    result["summary"] = live.summary()
    result["nodes"] = node_facts(live)
    result["capture_matches"] = (
        dataclasses.replace(saved, sysfs_root="/sys") == live)

    # Few bytes on the CXL region: QEMU emulates its every access (MMIO).
    count, nbytes = {"hmat1": (4, 8 * MIB), "hmat2": (24, 4 * MIB),
                     "cxl_region": (4, 4 * MIB)}[scenario]
    cxl_capacity = f"{count * nbytes // MIB + 16}MiB"
    with pool_lib.Pool(host="64MiB", cxl=cxl_capacity,
                       copy_threads=1) as pool:
      result["pool_node"] = pool.node
      result["host"] = place_objects(pool, "host", 2, 8 * MIB)
      result["cxl"] = place_objects(pool, "cxl", count, nbytes)
      stats = pool.stats()
      result["stats"] = str(stats)
      result["tiers"] = {t: tier_facts(stats[t]) for t in ("host", "cxl")}
      if stats["cxl"].firmware_link is not None:  # else it would measure
        link = pool.link_estimate("cxl")
        result["link_estimate"] = {"bandwidth": link.bandwidth,
                                   "latency_s": link.latency_s}
    result["ok"] = True
  except BaseException:  # pylint: disable=broad-except
    result["ok"] = False
    result["error"] = traceback.format_exc()
  result["elapsed_s"] = time.monotonic() - _STARTED
  with open(os.path.join(out, "result.json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  print(result.get("summary", ""))
  print(result.get("stats", ""))
  if not result["ok"]:
    print(result["error"], file=sys.stderr)
  return 0 if result["ok"] else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv))
