"""Bandwidth of a host update program (adam) next to a plain memcpy.

The adam program reads p, mu, nu and g (float32) and writes p, mu and nu in
place: 28 bytes of memory traffic per element. Each baseline moves the same
28 bytes per element (it copies 14 bytes per element: 14 read, 14 written),
taking turns with the kernel so that the machine's other load hits every
side alike (``bench.interleaved``):

* ``memcpy_1t``: numpy's copyto on one thread;
* ``memcpy_mt``: copyto in as many slices as the pool has update threads,
  on that many Python threads (numpy releases the GIL while it copies);
* ``pool_copy``: the pool's own copy engine (``put_async`` into a host
  object, its streaming-store copy) with as many copy threads.

Reported per side: the median of the repetitions in GB/s (decimal) of bytes
moved, and the kernel's ratio to each baseline (target: >= 0.7 of memcpy).

  python -m benchmarks.host_update_bandwidth --elements 64M --repeats 9
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys

import numpy as np

import jcxl
from benchmarks import bench
from jcxl.experimental import updates as up

BYTES_PER_ELEMENT = 28  # p, mu, nu, g read (16) + p, mu, nu written (12)
B1, B2, EPS = np.float32(0.9), np.float32(0.999), np.float32(1e-8)


def adam_program(n: int, p: int, mu: int, nu: int, g: int) -> up.Program:
  """mu = b1 mu + (1 - b1) g; nu = b2 nu + (1 - b2) g^2;
  p = p - lr (mu / bc1) / (sqrt(nu / bc2) + eps), with scalars lr, bc1,
  bc2 (optax's scale_by_adam, then scale by -lr)."""
  one = np.float32(1)
  inputs = [up.Input.object(p), up.Input.object(mu), up.Input.object(nu),
            up.Input.object(g),  # 0-3
            up.Input.scalar(0), up.Input.scalar(1), up.Input.scalar(2),  # 4-6
            up.Input.const(B1), up.Input.const(one - B1),  # 7, 8
            up.Input.const(B2), up.Input.const(one - B2),  # 9, 10
            up.Input.const(EPS)]  # 11
  op = up.UpdateOp
  code = [up.Instr(op.MUL, 7, 1), up.Instr(op.MUL, 8, 3),  # 12, 13
          up.Instr(op.ADD, 12, 13),  # 14 mu'
          up.Instr(op.MUL, 9, 2),  # 15
          up.Instr(op.INTEGER_POW, 3, imm=2),  # 16 g^2
          up.Instr(op.MUL, 10, 16), up.Instr(op.ADD, 15, 17),  # 17, 18 nu'
          up.Instr(op.DIV, 14, 5), up.Instr(op.DIV, 18, 6),  # 19, 20
          up.Instr(op.SQRT, 20), up.Instr(op.ADD, 21, 11),  # 21, 22
          up.Instr(op.DIV, 19, 22), up.Instr(op.MUL, 4, 23),  # 23, 24
          up.Instr(op.SUB, 0, 24)]  # 25 p'
  return up.Program(n, 3, inputs, code,
                    [up.Output(25, p), up.Output(14, mu), up.Output(18, nu)])


def parse_count(text: str) -> int:
  """'64M' -> 64 * 2**20 (K, M, G: binary multiples)."""
  scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
  count = int(text[:-1] if scale > 1 else text) * scale
  if count < 1:
    raise ValueError(f"--elements must be >= 1, got {text!r}")
  return count


def measure(n: int, repeats: int, update_threads: int = 0) -> dict:
  """The adam program on `n` elements against each memcpy baseline, taking
  turns `repeats` times: GB/s (medians), ratios, the verdict."""
  rng = np.random.default_rng(0)
  arrays = [rng.standard_normal(n, dtype=np.float32) for _ in range(4)]
  np.abs(arrays[2], out=arrays[2])
  arrays[2] *= np.float32(1e-3)
  copy_bytes = n * BYTES_PER_ELEMENT // 2
  host = 4 * n * 4 + copy_bytes + (64 << 20)
  with jcxl.Pool(host=host, cxl=0, update_threads=update_threads,
                 copy_threads=update_threads or
                 min(16, len(os.sched_getaffinity(0)))) as pool:
    handles = [pool.put(a, "host") for a in arrays]
    del arrays
    program = pool.updates.register(adam_program(n, *handles))
    scalars = np.array([1e-6, 0.1, 0.001], np.float32)
    pool.updates.run(program, scalars).wait()  # starts the threads
    threads = pool.updates.stats().threads
    src = bench.pattern(copy_bytes)
    dst = bench.pretouched(copy_bytes)
    target = pool.allocate((copy_bytes,), np.uint8, "host")
    pool.put_async(target, src).wait()  # touches its pages
    slices = np.array_split(np.arange(copy_bytes), threads)
    bounds = [(int(s[0]), int(s[-1]) + 1) for s in slices if s.size]
    executor = concurrent.futures.ThreadPoolExecutor(threads)

    def memcpy_mt():
      list(executor.map(
          lambda b: np.copyto(dst[b[0]:b[1]], src[b[0]:b[1]]), bounds))

    timings = bench.interleaved(
        {"kernel": lambda: pool.updates.run(program, scalars).wait(),
         "memcpy_1t": lambda: bench.memcpy(dst, src),
         "memcpy_mt": memcpy_mt,
         "pool_copy": lambda: pool.put_async(target, src).wait()},
        nbytes=n * BYTES_PER_ELEMENT, repeats=repeats)
    executor.shutdown()
    stats = pool.updates.stats()
  median = {name: statistics.median(t.seconds) for name, t in timings.items()}
  gbps = {name: n * BYTES_PER_ELEMENT / s / 1e9 for name, s in median.items()}
  ratios = {f"kernel/{name}": gbps["kernel"] / gbps[name]
            for name in timings if name != "kernel"}
  best_baseline = max(v for k, v in gbps.items() if k != "kernel")
  verdict = bench.Bound("kernel vs the fastest memcpy", gbps["kernel"] /
                        best_baseline, 0.7, at_most=False, unit="x")
  return {"elements": n, "threads": threads, "repeats": repeats,
          "seconds": {k: list(t.seconds) for k, t in timings.items()},
          "best_s": {k: t.best_s for k, t in timings.items()},
          "gbps_median": gbps, "ratios": ratios,
          "ratio": gbps["kernel"] / best_baseline,
          "verdict": verdict.to_json(), "update_stats": str(stats)}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--elements", default="64M",
                      help="elements per array (64M: 1.75 GiB of traffic)")
  parser.add_argument("--repeats", type=int, default=9)
  parser.add_argument("--update-threads", type=int, default=0,
                      help="the pool's update threads (0: its default)")
  parser.add_argument("--json", help="also write the results here")
  args = parser.parse_args(argv)
  n = parse_count(args.elements)
  result = measure(n, args.repeats, args.update_threads)
  print(f"host update bandwidth: adam on {n} float32 elements "
        f"({n * BYTES_PER_ELEMENT / 2**30:.2f} GiB moved per run), "
        f"{result['threads']} update threads, {args.repeats} repeats, median")
  print(f"  {bench.describe_machine()}")
  for name, gbps in result["gbps_median"].items():
    print(f"  {name:10s} {gbps:6.2f} GB/s   median "
          f"{n * BYTES_PER_ELEMENT / gbps / 1e6:7.1f} ms   best "
          f"{result['best_s'][name] * 1e3:7.1f} ms")
  for name, ratio in result["ratios"].items():
    print(f"  {name:20s} {ratio:.2f}")
  print(f"  kernel vs the fastest memcpy: {result['ratio']:.2f} (target "
        ">= 0.7)")
  print(f"  update_stats: {result['update_stats']}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
