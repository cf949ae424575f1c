"""Property-based test of the Python pool API under valid and invalid calls.

A hypothesis state machine calls put / get / get_async / put_async /
allocate / free / compact / close in random order with random dtypes
(ml_dtypes' included, and non-native byte order), random shapes (empty and
absurd ones too) and bad arguments of every kind (wrong types, freed and
made-up handles, out-of-range offsets, non-numeric dtypes). After every
call: it returned the right bytes or raised the Python exception it should,
and every object stored before still holds its bytes.

By default a bounded run (a few seconds); the long run:

  JCXL_API_PROPERTY_EXAMPLES=4000 .venv/bin/python -m pytest -q -s \
      tests/pool_api_property_test.py

prints how many calls it made, by kind (docs/faults.md has a run's counts).
"""

from __future__ import annotations

import collections
import os
import tempfile

import hypothesis
from hypothesis import stateful
from hypothesis import strategies as st
import jcxl
import ml_dtypes
import numpy as np
import pytest

# Transfers dropped before wait(): the copy engine keeps their buffers
# alive until it is done with them. (A switch, to tell a failure of that
# apart from the rest.)
DROP_TRANSFERS = True

EXAMPLES = int(os.environ.get("JCXL_API_PROPERTY_EXAMPLES", "40"))
STEPS = 50
TIERS = ("host", "cxl", "nvme")
DTYPES = [np.dtype(d) for d in (
    np.bool_, np.int8, np.uint8, np.int16, np.int32, np.int64, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128,
    ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
    ml_dtypes.int4, ml_dtypes.uint4, ">i2", ">i8", ">f4", ">f8", ">c8",
    ">u4")]
SHAPES = st.lists(st.integers(0, 16), min_size=0, max_size=3).map(tuple)
CALLS_BETWEEN_CLOSES = 25
# The pool refuses these dtypes whatever the shape.
BAD_DTYPES = [np.dtype(d) for d in (
    object, "U3", "S4", "M8[s]", "m8[s]", [("a", "<f4"), ("b", "<i4")],
    "V8")]
# Shapes that are not what they say: (shape, exception).
BAD_SHAPES = [((3.7,), TypeError), ((True, 2), TypeError), ((-1,), ValueError),
              ((2**62 + 1,), ValueError), ((2**40, 2**40), ValueError),
              (("4",), TypeError), ((np.float32(2),), TypeError),
              (None, TypeError)]


def random_array(seed: int, shape: tuple[int, ...], dtype: np.dtype
                 ) -> np.ndarray:
  """Random bytes of `shape` and `dtype` (NaN payloads and all)."""
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8)
  return raw.view(dtype).reshape(shape)


def native(array: np.ndarray) -> np.ndarray:
  """What the pool should give back: the values in native byte order."""
  return array.astype(array.dtype.newbyteorder("="))


def same(got: np.ndarray, want: np.ndarray) -> bool:
  return (got.dtype == want.dtype and got.shape == want.shape and
          got.tobytes() == want.tobytes())


class PoolApiMachine(stateful.RuleBasedStateMachine):
  """Random calls against a shadow copy of what the pool should hold."""

  calls: collections.Counter = collections.Counter()

  def __init__(self):
    super().__init__()
    # (the pool makes its own private directory in it, removed on close)
    self.nvme_dir = ("/dev/shm" if os.access("/dev/shm", os.W_OK) else
                     tempfile.gettempdir())
    self.pool = self._new_pool()
    self.shadow: dict[int, np.ndarray] = {}
    self.freed: list[int] = []
    self.since_close = 0

  def _new_pool(self) -> jcxl.Pool:
    return jcxl.Pool(host="256KiB", cxl="256KiB", nvme="256KiB",
                     nvme_dir=self.nvme_dir, timeout_s=30)

  def count(self, kind: str) -> None:
    PoolApiMachine.calls[kind] += 1
    self.since_close += 1

  def pick(self, data) -> int | None:
    # By position, drawn the same way whatever the state: hypothesis replays
    # draws, and handles differ from run to run (they carry the pool id).
    position = data.draw(st.integers(0, 2**16))
    handles = sorted(self.shadow)
    return handles[position % len(handles)] if handles else None

  # ---------------------------------------------------------- valid calls

  @stateful.rule(seed=st.integers(0, 2**32 - 1), shape=SHAPES,
                 dtype=st.sampled_from(DTYPES), tier=st.sampled_from(TIERS))
  def put(self, seed, shape, dtype, tier):
    self.count("put")
    array = random_array(seed, shape, dtype)
    if array.size == 0:
      with pytest.raises(ValueError, match="empty"):
        self.pool.put(array, tier)
      return
    try:
      handle = self.pool.put(array, tier)
    except jcxl.PoolExhaustedError:
      self.count("put exhausted")
      return
    assert handle not in self.shadow
    self.shadow[handle] = native(array)
    assert same(self.pool.get(handle), self.shadow[handle])

  @stateful.rule(seed=st.integers(0, 2**32 - 1), shape=SHAPES,
                 dtype=st.sampled_from(DTYPES), tier=st.sampled_from(TIERS))
  def allocate_then_write(self, seed, shape, dtype, tier):
    self.count("allocate")
    if int(np.prod(shape)) == 0:
      with pytest.raises(ValueError, match="empty"):
        self.pool.allocate(shape, dtype, tier)
      return
    try:
      handle = self.pool.allocate(shape, dtype, tier)
    except jcxl.PoolExhaustedError:
      self.count("allocate exhausted")
      return
    info = self.pool.info(handle)
    assert info.shape == shape and info.dtype == dtype.newbyteorder("=")
    array = random_array(seed, shape, dtype)
    self.pool.put_async(handle, array).wait()
    self.count("put_async")
    self.shadow[handle] = native(array)

  @stateful.rule(data=st.data(), into=st.booleans(),
                 priority=st.integers(-2**31, 2**31 - 1))
  def get(self, data, into, priority):
    handle = self.pick(data)
    if handle is None:
      return
    self.count("get")
    want = self.shadow[handle]
    out = np.empty_like(want) if into else None
    got = self.pool.get(handle, out, priority=priority)
    assert same(got, want)
    if into:
      assert got is out

  @stateful.rule(data=st.data(), drop=st.booleans())
  def get_async(self, data, drop):
    handle = self.pick(data)
    if handle is None:
      return
    self.count("get_async")
    transfer = self.pool.get_async(handle)
    if drop and DROP_TRANSFERS:
      self.count("get_async dropped")
      del transfer
      return
    assert same(transfer.wait(), self.shadow[handle])

  @stateful.rule(data=st.data(), seed=st.integers(0, 2**32 - 1),
                 drop=st.booleans(), swapped=st.booleans())
  def put_async(self, data, seed, drop, swapped):
    """Rewrites a whole object, or (dropped unwaited) the bytes it holds
    already, so that what it holds next does not depend on timing."""
    handle = self.pick(data)
    if handle is None:
      return
    self.count("put_async")
    want = self.shadow[handle]
    if drop and DROP_TRANSFERS:
      self.count("put_async dropped")
      self.pool.put_async(handle, want.copy())  # never waited for
      return
    array = random_array(seed, want.shape, want.dtype)
    if swapped and array.dtype.kind in "iufc" and array.dtype.itemsize > 1:
      array = array.astype(array.dtype.newbyteorder(">"))
    self.pool.put_async(handle, array).wait()
    self.shadow[handle] = native(array)

  @stateful.rule(data=st.data())
  def free(self, data):
    handle = self.pick(data)
    if handle is None:
      return
    self.count("free")
    self.pool.free(handle)
    del self.shadow[handle]
    self.freed.append(handle)

  @stateful.rule()
  def compact(self):
    self.count("compact")
    self.pool.compact()

  @stateful.rule()
  def close_and_reopen(self):
    """Closing loses the objects (by design); the closed pool refuses
    everything with PoolClosedError, and a new pool starts empty."""
    if self.since_close < CALLS_BETWEEN_CLOSES:
      return  # (a precondition would make hypothesis's draws depend on it)
    self.count("close")
    old = self.pool
    handles = sorted(self.shadow)
    old.close()
    with pytest.raises(jcxl.PoolClosedError):
      old.put(np.ones(3, np.float32))
    with pytest.raises(jcxl.PoolClosedError):
      old.close()
    if handles:
      with pytest.raises(jcxl.PoolClosedError):
        old.get(handles[0])
    self.pool = self._new_pool()
    self.shadow.clear()
    self.freed.clear()
    self.since_close = 0

  # -------------------------------------------------------- invalid calls

  @stateful.rule(dtype=st.sampled_from(BAD_DTYPES), via_put=st.booleans())
  def bad_dtype(self, dtype, via_put):
    self.count("bad dtype")
    with pytest.raises(TypeError, match="dtype must be numeric"):
      if via_put:
        self.pool.put(np.zeros(3, dtype))
      else:
        self.pool.allocate((3,), dtype)

  @stateful.rule(bad=st.sampled_from(BAD_SHAPES))
  def bad_shape(self, bad):
    self.count("bad shape")
    shape, error = bad
    with pytest.raises(error, match="shape"):
      self.pool.allocate(shape, np.float32)

  @stateful.rule(data=st.data())
  def bad_handle(self, data):
    self.count("bad handle")
    candidates = [("x", TypeError), (1.0, TypeError), (None, TypeError),
                  (True, TypeError), (2**40, ValueError),
                  (-2**31 - 1, ValueError)]
    made_up = data.draw(st.integers(-2**31, 2**31 - 1))
    if made_up not in self.shadow:
      candidates.append((made_up, jcxl.UnknownHandleError))
    candidates += [(h, jcxl.UnknownHandleError) for h in self.freed[-4:]]
    handle, error = candidates[data.draw(st.integers(0, 2**16)) %
                               len(candidates)]
    call = data.draw(st.sampled_from(("get", "get_async", "free", "info",
                                      "put_async")))
    with pytest.raises(error):
      if call == "put_async":
        self.pool.put_async(handle, np.ones(1, np.uint8)).wait()
      elif call == "get_async":
        self.pool.get_async(handle).wait()
      else:
        getattr(self.pool, call)(handle)

  @stateful.rule(
      data=st.data(),
      case=st.sampled_from(("priority type", "priority range", "offset",
                            "offset past end", "out shape", "out dtype",
                            "tier", "chunk_bytes")),
      bad_priority=st.sampled_from(("1", 1.5, None, float("nan"))),
      bad_offset=st.sampled_from((-1, 0.5, 2**64)))
  def bad_arguments(self, data, case, bad_priority, bad_offset):
    # (every draw made whatever the state: hypothesis replays draws)
    handle = self.pick(data)
    if handle is None:
      return
    self.count("bad arguments")
    want = self.shadow[handle]
    if case == "priority type":
      with pytest.raises(TypeError, match="priority"):
        self.pool.get(handle, priority=bad_priority)
    elif case == "priority range":
      with pytest.raises(ValueError, match="priority"):
        self.pool.get(handle, priority=2**31)
    elif case == "offset":
      with pytest.raises((TypeError, ValueError), match="offset"):
        self.pool.put_async(handle, want, offset=bad_offset)
    elif case == "offset past end":
      with pytest.raises(ValueError, match="does not fit in handle"):
        self.pool.put_async(handle, want.reshape(-1)[:1].copy(),
                            offset=want.nbytes)
    elif case == "out shape":
      with pytest.raises(ValueError, match="out has shape"):
        self.pool.get(handle, np.empty((want.size + 1,), want.dtype))
    elif case == "out dtype":
      other = np.uint8 if want.dtype != np.uint8 else np.int8
      with pytest.raises(ValueError, match="out has shape"):
        self.pool.get(handle, np.empty(want.shape, other))
    elif case == "tier":
      with pytest.raises(ValueError, match="tier must be"):
        self.pool.put(want, "gpu")
    else:
      with pytest.raises((TypeError, ValueError), match="chunk_bytes"):
        self.pool.get_async(handle, chunk_bytes=-1)

  # ------------------------------------------------------------ checks

  @stateful.invariant()
  def every_object_intact(self):
    assert sorted(self.pool.handles()) == sorted(self.shadow)
    for handle, want in self.shadow.items():
      assert same(self.pool.get(handle), want), handle

  def teardown(self):
    if not self.pool.closed:
      self.pool.close()


class PoolApiPropertyTest:

  def test_random_valid_and_invalid_calls(self):
    PoolApiMachine.calls = collections.Counter()
    stateful.run_state_machine_as_test(
        PoolApiMachine,
        settings=hypothesis.settings(
            max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
            derandomize=EXAMPLES <= 40, database=None,
            suppress_health_check=list(hypothesis.HealthCheck)))
    calls = PoolApiMachine.calls
    total = sum(v for k, v in calls.items()
                if "exhausted" not in k and "dropped" not in k)
    print(f"pool API calls: {total} ({dict(sorted(calls.items()))})")
    assert total >= EXAMPLES * 10
    for kind in ("put", "get", "get_async", "put_async", "free", "compact",
                 "close", "bad dtype", "bad shape", "bad handle",
                 "bad arguments"):
      assert calls[kind] > 0, kind
