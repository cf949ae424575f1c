"""A fragmented tier holds what its free bytes would hold.

An allocation that finds no free extent large enough, though the tier's free
bytes would hold it, compacts the tier first (handles stay valid, bounded by
the pool's timeout_s waiting for transfers) and says in its
PoolExhaustedError when even that could not help. Memory tiers compact
themselves after frees: a random churn of real model shapes keeps external
fragmentation under 5% and live bytes over 95% of the reserved ones.
"""

from __future__ import annotations

import jcxl
import ml_dtypes
import numpy as np
import pytest

from benchmarks import alloc_trace

KIB = 1 << 10
MIB = 1 << 20


def fragment(pool, tier: str, rng) -> dict[int, np.ndarray]:
  """Fills `tier` with large and small objects, then frees every other
  large one: about half the tier is free, in holes of at most 368 KiB."""
  stored = {}
  large = []
  while True:
    try:
      array = rng.integers(0, 256, 368 * KIB, np.uint8)
      handle = pool.put(array, tier)
    except jcxl.PoolExhaustedError:
      break
    stored[handle] = array
    large.append(handle)
    small = rng.integers(0, 256, 4 * KIB, np.uint8)
    try:
      stored[pool.put(small, tier)] = small
    except jcxl.PoolExhaustedError:
      break
  for handle in large[::2]:
    pool.free(handle)
    del stored[handle]
  return stored


def assert_intact(pool, stored) -> None:
  for handle, array in stored.items():
    np.testing.assert_array_equal(pool.get(handle), array)


class CompactBeforeGivingUpTest:

  def test_a_fragmented_tier_is_compacted_to_hold_a_put(self, tmp_path):
    # The nvme tier compacts only when an allocation needs it.
    with jcxl.Pool(host="8MiB", cxl=0, nvme="32MiB", nvme_dir=tmp_path,
                   timeout_s=10) as pool:
      rng = np.random.default_rng(0)
      stored = fragment(pool, "nvme", rng)
      before = pool.stats()["nvme"]
      assert before.free > 15 * MIB and before.largest_free <= 368 * KIB
      big = rng.integers(0, 256, 14 * MIB + 990 * KIB, np.uint8)
      handle = pool.put(big, "nvme")  # raised PoolExhaustedError before
      after = pool.stats()["nvme"]
      assert after.external_fragmentation == 0
      stored[handle] = big
      assert_intact(pool, stored)

  def test_says_when_compacting_cannot_help(self, tmp_path):
    with jcxl.Pool(host="8MiB", cxl=0, nvme="32MiB", nvme_dir=tmp_path,
                   timeout_s=10) as pool:
      stored = fragment(pool, "nvme", np.random.default_rng(1))
      free = pool.stats()["nvme"].free
      too_big = np.ones(free + 64 * KIB, np.uint8)
      with pytest.raises(jcxl.PoolExhaustedError,
                         match=r"free of 32.00 MiB, largest free extent "
                         r"368.00 KiB \(compacting cannot help: too few "
                         r"bytes are free\)"):
        pool.put(too_big, "nvme")
      assert pool.stats()["nvme"].largest_free <= 368 * KIB  # not compacted
      assert_intact(pool, stored)

  def test_says_when_transfers_in_flight_keep_it_from_compacting(self):
    with jcxl.Pool(host="32MiB", cxl=0, timeout_s=0.3) as pool:
      rng = np.random.default_rng(2)
      pinned = pool.put(np.arange(1000.0), "host")
      pool._inject_fault("stall", direction="read")
      stalled = pool.get_async(pinned)  # in flight: nothing may move
      stored = fragment(pool, "host", rng)
      assert pool.stats()["host"].largest_free <= 368 * KIB
      big = rng.integers(0, 256, 14 * MIB, np.uint8)
      with pytest.raises(jcxl.PoolExhaustedError,
                         match=r"compacting to make room failed: transfers "
                         r"still in flight after 300 ms"):
        pool.put(big, "host")
      pool._inject_fault(None)
      np.testing.assert_array_equal(stalled.wait(), np.arange(1000.0))
      stored[pool.put(big, "host")] = big  # with nothing in flight: room
      assert_intact(pool, stored)


def churn_shapes() -> list[tuple[int, ...]]:
  """gpt2's parameter shapes, but for the token embedding (147 MiB)."""
  shapes = alloc_trace.model_shapes("gpt2").params
  return [shape for name, shape in shapes if not name.endswith("wte")]


class ChurnTest:

  def test_random_churn_of_model_shapes_stays_compact(self):
    shapes = churn_shapes()
    dtype = np.dtype(ml_dtypes.bfloat16)
    sizes = [int(np.prod(s)) * dtype.itemsize for s in shapes]
    assert min(sizes) < 4 * KIB and max(sizes) > 4 * MIB  # mixed
    capacity = 64 * MIB
    rng = np.random.default_rng(0)
    worst_fragmentation, worst_live = 0.0, 1.0
    with jcxl.Pool(host=capacity, cxl=0, timeout_s=30) as pool:
      live = {}
      live_bytes = 0
      for step in range(1200):
        i = int(rng.integers(len(shapes)))
        grow = live_bytes + sizes[i] < 0.85 * capacity and (
            not live or rng.random() < 0.55)
        if grow:
          value = np.full(shapes[i], step % 97, dtype)
          live[pool.put(value, "host")] = (step % 97, shapes[i])
          live_bytes += sizes[i]
        else:
          handle = list(live)[int(rng.integers(len(live)))]
          live_bytes -= int(np.prod(live.pop(handle)[1])) * dtype.itemsize
          pool.free(handle)
        stats = pool.stats()["host"]
        assert stats.live == live_bytes
        if live_bytes > capacity // 4:  # past the start, while it is full
          worst_fragmentation = max(worst_fragmentation,
                                    stats.external_fragmentation)
          worst_live = min(worst_live, stats.live / stats.reserved)
      for handle, (value, shape) in live.items():
        np.testing.assert_array_equal(pool.get(handle),
                                      np.full(shape, value, dtype))
    print(f"\nchurn of {len(shapes)} gpt2 shapes: worst external "
          f"fragmentation {worst_fragmentation:.2%}, worst live/reserved "
          f"{worst_live:.2%}")
    assert worst_fragmentation < 0.05
    assert worst_live > 0.95


class BoundedCompactionTest:
  """A free compacts its tier under the pool's lock, so it moves a bounded
  number of bytes (64 MiB, plus at most one extent); the next frees go on
  where it stopped."""

  def test_a_free_moves_a_bounded_number_of_bytes(self):
    size = 12 * MIB
    marker = lambda i: np.full(4 * KIB, i, np.uint8)
    with jcxl.Pool(host="256MiB", cxl=0) as pool:
      bottom = pool.allocate((8 * MIB,), np.uint8, "host")
      above = [pool.allocate((size,), np.uint8, "host") for _ in range(16)]
      for i, handle in enumerate(above):  # only the ends: pages stay unbacked
        pool.put_async(handle, marker(i)).wait()
        pool.put_async(handle, marker(i), offset=size - 4 * KIB).wait()
      offsets = {h: pool.info(h).offset for h in above}
      # An 8 MiB hole under 192 MiB of 12 MiB objects: none fits in it, so
      # the objects above it slide down; it used to move all 192 MiB at once.
      pool.free(bottom)
      moved = [h for h in above if pool.info(h).offset != offsets[h]]
      assert 0 < len(moved) * size <= 64 * MIB + size, len(moved)
      assert pool.stats()["host"].external_fragmentation > 0.02
      for handle in above[::-1][:3]:  # each free goes on where it stopped
        pool.free(handle)
        above.pop()
      stats = pool.stats()["host"]
      assert stats.external_fragmentation == 0
      assert stats.reserved == stats.live == len(above) * size
      for i, handle in enumerate(above):
        for offset in (0, size - 4 * KIB):
          out = np.empty(4 * KIB, np.uint8)
          pool.read_bytes_async(handle, out, offset=offset).wait()
          np.testing.assert_array_equal(out, marker(i))
