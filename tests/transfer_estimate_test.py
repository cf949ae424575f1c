"""The copy engine's round trip, measured for offline plans."""

import jcxl
import pytest

from jcxl._src import transfer_estimate


@pytest.fixture
def pool():
  with jcxl.Pool(host="1MiB", cxl=0) as p:
    yield p


class RoundTripTest:

  def test_timed_on_fetches_that_really_ran(self, pool):
    pool.transfer_records()  # the placements' own writes
    seconds = transfer_estimate.measure_round_trip(pool)
    reads = [r for r in pool.transfer_records() if not r.to_pool]
    chain = transfer_estimate._CHAIN
    # A warm-up run and at least one timed run, each fetching every object
    # of the chain once, in the host tier.
    assert len(reads) >= 2 * chain and len(reads) % chain == 0
    assert all(r.ok and r.tier == jcxl.Tier.HOST for r in reads)
    assert 0 < seconds < 0.1

  def test_frees_what_it_placed(self, pool):
    before = pool.handles()
    transfer_estimate.measure_round_trip(pool)
    assert pool.handles() == before

  def test_measured_once_per_process(self):
    first = transfer_estimate.round_trip_seconds()
    assert transfer_estimate.round_trip_seconds() == first > 0
