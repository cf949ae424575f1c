"""Property-based tests: allocator invariants under random operations.

10,000 random allocate / free / compact steps (50 runs of 200) on a small
pool with all three tiers; after every step no two live objects overlap,
every byte is accounted for, and after every compaction each handle still
reads back the bytes written to it.
"""

from __future__ import annotations

import collections

import hypothesis
from hypothesis import stateful
from hypothesis import strategies as st
import jcxl
import numpy as np
import pytest

TIERS = ("host", "cxl", "nvme")
# Slab-sized, page-sized and multi-MiB objects all take part.
SIZES = st.one_of(st.integers(1, 4096), st.integers(4097, 300_000),
                  st.integers(300_001, 1 << 20))


def payload(handle: int, nbytes: int) -> np.ndarray:
  return np.random.default_rng(handle).integers(0, 256, nbytes, np.uint8)


class PoolMachine(stateful.RuleBasedStateMachine):
  """Random pool traffic against a shadow model of what should be stored."""

  def __init__(self):
    super().__init__()
    self.dir = tmp_dir_factory.mktemp("nvme")
    self.pool = jcxl.Pool(host="4MiB", cxl="4MiB", nvme="4MiB",
                          nvme_dir=self.dir, spill=False)
    self.live: dict[int, int] = {}  # handle -> nbytes

  @stateful.rule(nbytes=SIZES, tier=st.sampled_from(TIERS))
  def put(self, nbytes, tier):
    try:
      handle = self.pool.allocate((nbytes,), np.uint8, tier)
    except jcxl.PoolExhaustedError:
      return
    self.pool.put_async(handle, payload(handle, nbytes)).wait()
    assert handle not in self.live
    self.live[handle] = nbytes

  @stateful.precondition(lambda self: self.live)
  @stateful.rule(data=st.data())
  def free(self, data):
    handle = data.draw(st.sampled_from(sorted(self.live)))
    self.pool.free(handle)
    del self.live[handle]
    with pytest.raises(jcxl.UnknownHandleError):
      self.pool.info(handle)

  @stateful.rule()
  def compact(self):
    self.pool.compact()
    for tier in TIERS:
      assert self.pool.stats()[tier].external_fragmentation == 0
    for handle, nbytes in self.live.items():
      np.testing.assert_array_equal(self.pool.get(handle),
                                    payload(handle, nbytes))

  @stateful.invariant()
  def no_overlap_and_all_bytes_accounted(self):
    assert sorted(self.pool.handles()) == sorted(self.live)
    extents = collections.defaultdict(list)
    live_by_tier = collections.Counter()
    for handle, nbytes in self.live.items():
      info = self.pool.info(handle)
      assert info.nbytes == nbytes
      extents[(info.tier, info.node)].append((info.offset, nbytes))
      live_by_tier[info.tier.value] += nbytes
    for spans in extents.values():
      spans.sort()
      for (a, a_len), (b, _) in zip(spans, spans[1:]):
        assert a + a_len <= b, "two live objects overlap"
    stats = self.pool.stats()
    for tier in TIERS:
      s = stats[tier]
      assert s.live == live_by_tier[tier]
      assert s.live <= s.reserved <= s.capacity
      assert s.free == s.capacity - s.reserved + round(
          s.external_fragmentation * s.reserved)
      for offset, nbytes in (e for (t, _), v in extents.items()
                             if t.value == tier for e in v):
        assert offset + nbytes <= s.reserved

  def teardown(self):
    self.pool.close()


tmp_dir_factory = None


@pytest.fixture(autouse=True)
def _tmp_factory(tmp_path_factory):
  global tmp_dir_factory
  tmp_dir_factory = tmp_path_factory


class PoolPropertyTest:

  def test_ten_thousand_random_operations(self):
    stateful.run_state_machine_as_test(
        PoolMachine,
        settings=hypothesis.settings(
            max_examples=50, stateful_step_count=200, deadline=None,
            derandomize=True,
            suppress_health_check=list(hypothesis.HealthCheck)))
