"""Bad input at the public boundary: one validation of shapes and dtypes for
every entry point, native byte order on the way in, and errors that name
the argument, what it got and what it accepts."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

import jcxl
from jcxl._src.schedules import plan as schedule_lib
from jcxl._src import stream
from jcxl._src import validation

BAD_DTYPES = [object, "U3", "S4", "M8[s]", "m8[ns]",
              [("a", "<f4"), ("b", "<i4")], "(2,)f4", "V8", None]
BAD_SHAPES = [
    ((3.7,), TypeError, r"shape\[0\] must be a non-negative int, but got 3.7"),
    ((True, 2), TypeError, r"shape\[0\] .* but got True"),
    ((2, -1), ValueError, r"shape\[1\] must be a non-negative int in"),
    ((2**62 + 1,), ValueError, r"18446744073709551620 bytes, more than"),
    ((2**40, 2**40), ValueError, r"bytes, more than the 9223372036854775807"),
    ((np.float64(4),), TypeError, r"shape\[0\]"),
    ("44", TypeError, r"shape must be a sequence"),
]


@pytest.fixture
def pool():
  with jcxl.Pool(host="4MiB", cxl="4MiB") as p:
    yield p


class ShapeAndDtypeTest:
  """Finding: allocate took dtypes put refused, and shapes that were not
  what they said (2**62+1 stored as 16 bytes, 3.7 as 3)."""

  @pytest.mark.parametrize("dtype", BAD_DTYPES, ids=str)
  def test_allocate_refuses_what_put_refuses(self, pool, dtype):
    with pytest.raises(TypeError, match="dtype must be numeric"):
      pool.allocate((3,), dtype)
    assert pool.handles() == []

  @pytest.mark.parametrize("dtype", ["U3", object, "M8[s]",
                                     [("a", "<f4"), ("b", "<i4")]], ids=str)
  def test_put_and_place_refuse_the_same(self, pool, dtype):
    array = np.zeros(3, dtype)
    with pytest.raises(TypeError, match="array: dtype must be numeric"):
      pool.put(array)
    with pytest.raises(TypeError, match=r"leaf \['x'\]: dtype must be"):
      jcxl.place({"x": array}, "cxl", pool=pool)
    assert pool.handles() == []

  @pytest.mark.parametrize("shape, error, match", BAD_SHAPES)
  def test_allocate_refuses_shapes_that_are_not_what_they_say(
      self, pool, shape, error, match):
    with pytest.raises(error, match=match):
      pool.allocate(shape, np.float32)
    assert pool.handles() == []

  @pytest.mark.parametrize("dtype", [
      np.bool_, np.int8, np.uint64, np.float16, np.complex128,
      ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
      ml_dtypes.int4], ids=lambda d: np.dtype(d).name)
  def test_numeric_dtypes_round_trip(self, pool, dtype):
    values = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    handle = pool.put(values)
    got = pool.get(handle)
    assert got.dtype == values.dtype
    assert got.tobytes() == values.tobytes()
    allocated = pool.allocate(np.array([2, 3, 4]), dtype)  # numpy ints too
    assert pool.info(allocated).shape == (2, 3, 4)

  def test_one_int_is_a_1d_shape(self, pool):
    assert pool.info(pool.allocate(5, np.float32)).shape == (5,)


class ByteOrderTest:
  """Finding: '>f4' came back from put/get, place/gather and a checkpoint
  as garbage; it is now stored in native order (same values)."""

  @pytest.mark.parametrize("dtype", [">f4", ">f8", ">i2", ">u8", ">c8"])
  def test_put_get_keeps_the_values(self, pool, dtype):
    values = (np.arange(-5, 5) * 3).astype(dtype)
    got = pool.get(pool.put(values))
    assert got.dtype == values.dtype.newbyteorder("=")
    np.testing.assert_array_equal(got, values)

  def test_put_async_into_an_object_converts_too(self, pool):
    handle = pool.allocate((4,), ">f4")
    assert pool.info(handle).dtype == np.float32
    pool.put_async(handle, np.array([1.5, -2, 3, 4], ">f4")).wait()
    np.testing.assert_array_equal(pool.get(handle), [1.5, -2, 3, 4])

  def test_non_contiguous_swapped_view(self, pool):
    values = np.arange(20, dtype=">i4").reshape(4, 5)[:, ::2]
    np.testing.assert_array_equal(pool.get(pool.put(values)), values)

  def test_place_gather_keeps_the_values(self, pool):
    values = np.linspace(-1, 1, 16).astype(">f4").reshape(4, 4)
    placed = jcxl.place({"w": values}, "cxl", pool=pool)
    assert placed["w"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(jcxl.gather(placed)["w"]),
                                  values)


class NamedErrorsTest:
  """Finding: errors that did not name the problem (nan/inf/huge sizes,
  bad timeouts, OverflowError for 'bucket:inf', nanobind's "incompatible
  function arguments", cxl='0.5B' turning the tier off, set_link on a
  closed pool returning silently)."""

  @pytest.mark.parametrize("value, error, match", [
      (float("nan"), ValueError, "host must be a finite byte count, but got "
       "nan"),
      (float("inf"), ValueError, "host must be a finite byte count"),
      (2**64, ValueError, r"host must be at most 9223372036854775807 bytes"),
      ("12345678901234567890TiB", ValueError, "host must be at most"),
      (1e30, ValueError, "host must be at most"),
      ("0.5B", ValueError, r"host must be 0 or at least 1 byte, but got "
       "'0.5B'"),
      ("-1KiB", ValueError, "host must not be negative"),
      ([1], TypeError, "host must be a byte count"),
      (True, TypeError, "host must be a byte count"),
  ])
  def test_pool_sizes(self, value, error, match):
    with pytest.raises(error, match=match):
      jcxl.Pool(host=value, cxl="1MiB")

  def test_fractional_sizes_round_down(self):
    with jcxl.Pool(host="4.5KiB", cxl=0) as p:
      assert p.settings()["host"] == "4.50 KiB"  # 4608 bytes

  @pytest.mark.parametrize("value, error", [
      ("5", TypeError), (None, TypeError), (True, TypeError),
      (float("nan"), ValueError), (float("inf"), ValueError),
      (0, ValueError), (-1, ValueError)])
  def test_timeout(self, value, error):
    with pytest.raises(error, match=r"timeout_s must be a finite number of "
                       r"seconds > 0, but got"):
      jcxl.Pool(host="1MiB", cxl=0, timeout_s=value)

  @pytest.mark.parametrize("kwargs, error, match", [
      ({"copy_threads": 2**40}, ValueError,
       r"copy_threads must be an int in \[1, 1024\]"),
      ({"copy_threads": 2.0}, TypeError, "copy_threads must be an int"),
      ({"chunk_bytes": float("nan")}, ValueError,
       "chunk_bytes must be a finite byte count"),
  ])
  def test_other_pool_arguments(self, kwargs, error, match):
    with pytest.raises(error, match=match):
      jcxl.Pool(host="1MiB", cxl=0, **kwargs)

  @pytest.mark.parametrize("call, error, match", [
      (lambda p, h: p.get("a"), TypeError,
       r"handle must be an int32 pool handle, but got 'a' \(str\)"),
      (lambda p, h: p.get(2**40), ValueError,
       r"handle must be an int32 pool handle in \[-2147483648"),
      (lambda p, h: p.free(1.0), TypeError, "handle must be an int32"),
      (lambda p, h: p.info(None), TypeError, "handle must be an int32"),
      (lambda p, h: p.get(h, priority="x"), TypeError,
       r"priority must be an int32, but got 'x'"),
      (lambda p, h: p.get(h, priority=2**40), ValueError,
       "priority must be an int32 in"),
      (lambda p, h: p.put(np.ones(3), priority=float("nan")), TypeError,
       "priority must be an int32"),
      (lambda p, h: p.put_async(h, np.ones(1, np.float32), offset=-1),
       ValueError, r"offset must be an int in \[0, "),
      (lambda p, h: p.get_async(h, chunk_bytes=-1), ValueError,
       "chunk_bytes must be an int in"),
      (lambda p, h: p.read_bytes_async(h, np.ones(1, np.uint8), offset=0.5),
       TypeError, "offset must be an int"),
  ])
  def test_handles_priorities_offsets(self, pool, call, error, match):
    handle = pool.put(np.arange(4, dtype=np.float32))
    with pytest.raises(error, match=match):
      call(pool, handle)
    np.testing.assert_array_equal(pool.get(handle), np.arange(4))

  def test_set_link_on_a_closed_pool(self):
    pool = jcxl.Pool(host="1MiB", cxl="1MiB")
    pool.close()
    with pytest.raises(jcxl.PoolClosedError, match="is closed"):
      pool.set_link("cxl", jcxl.LinkModel("1GB/s"))

  @pytest.mark.parametrize("kwargs, error, match", [
      ({"bandwidth": float("nan")}, ValueError,
       "link bandwidth must be a finite byte count"),
      ({"bandwidth": "1GB/s", "latency_s": float("inf")}, ValueError,
       r"latency_s must be a number of seconds in \[0, 3600\], but got inf"),
      ({"bandwidth": "1GB/s", "latency_s": "1"}, TypeError,
       r"latency_s must be a number of seconds in \[0, 3600\], but got '1'"),
  ])
  def test_link_model(self, kwargs, error, match):
    with pytest.raises(error, match=match):
      jcxl.LinkModel(**kwargs)

  @pytest.mark.parametrize("schedule", [
      "bucket:inf", "bucket:nan", "bucket:1e400", "bucket:1e300",
      "fixed:99999999999999999999"])
  def test_schedule(self, schedule):
    with pytest.raises(ValueError, match=r"schedule must be .* but got"):
      schedule_lib.parse_schedule(schedule)

  def test_device_budget(self):
    with pytest.raises(ValueError, match="device_budget must be a finite"):
      jcxl.cxl_offload(lambda x: x, device_budget=float("nan"))


class MoreNamedErrorsTest:
  """Errors of the same kind found across the public API."""

  @pytest.mark.parametrize("kwargs, error, match", [
      ({"priority": "x"}, TypeError, "jcxl.fetch priority must be an int32"),
      ({"priority": 2**40}, ValueError, "jcxl.fetch priority must be"),
      # a negative chunk size used to stall the copy until the deadline
      ({"chunk_bytes": -1}, ValueError, "jcxl.fetch chunk_bytes must be an "
       "int in"),
  ])
  def test_fetch_arguments(self, pool, kwargs, error, match):
    w = jcxl.place(np.ones((4, 4), np.float32), "cxl", pool=pool)
    with pytest.raises(error, match=match):
      jax.jit(lambda w: jcxl.fetch(w, **kwargs))(w)
    with pytest.raises(error, match=match.replace("fetch", "store")):
      jax.jit(lambda w: jcxl.store(w, jax.numpy.ones((4, 4)), **kwargs))(w)
    np.testing.assert_array_equal(np.asarray(jcxl.gather(w)), 1)

  def test_place_arguments(self, pool):
    with pytest.raises(TypeError, match="pool must be a jcxl.Pool, but got"):
      jcxl.place({"w": np.ones(3)}, "cxl", pool="pool")
    with pytest.raises(TypeError, match=r"sharding for leaf \['w'\] must be "
                       "a jax.sharding.Sharding"):
      jcxl.place({"w": np.ones(3)}, "cxl", pool=pool, sharding={"w": "x"})
    assert pool.handles() == []

  def test_read_bytes_out_must_be_an_array(self, pool):
    handle = pool.put(np.ones(2, np.float32))
    with pytest.raises(TypeError, match="out must be a numpy array, but got "
                       "list"):
      pool.read_bytes_async(handle, [1, 2])

  def test_cxl_offload_takes_a_function(self):
    with pytest.raises(TypeError, match="decorates a function, but got 5"):
      jcxl.cxl_offload(5)

  def test_checkpoint_metadata_must_be_json(self, pool, tmp_path):
    tree = {"w": jcxl.place(np.ones(3, np.float32), "cxl", pool=pool)}
    with pytest.raises(TypeError, match="metadata must be a JSON-serial"):
      jcxl.checkpoint.save(tmp_path / "c", tree, metadata={"a": object()})
    assert not list(tmp_path.iterdir())  # nothing written


class AuditTest:
  """Inputs a second audit found accepted and then crashing, silently
  misread, or refused without saying what was wrong."""

  @pytest.mark.parametrize("latency", [1e300, 1e12, 3600.5])
  def test_link_latency_past_an_hour_is_refused(self, latency):
    # It used to be taken, and then Pool/set_link failed with an
    # OverflowError or nanobind's "incompatible function arguments".
    with pytest.raises(ValueError, match=r"link latency_s must be a number "
                       r"of seconds in \[0, 3600\], but got"):
      jcxl.LinkModel("1GB/s", latency)

  def test_the_longest_link_latency_reaches_the_pool(self):
    link = jcxl.LinkModel("1GB/s", 3600)
    with jcxl.Pool(host=0, cxl="1MiB", emulate_cxl=True,
                   cxl_link=link) as p:
      assert p.stats()["cxl"].link.latency_s == 3600
      p.set_link("cxl", jcxl.LinkModel("2GB/s", 1e-7))
      assert p.stats()["cxl"].link.latency_s == pytest.approx(1e-7)

  @pytest.mark.parametrize("seconds, ms", [(1e-4, 1), (1e-3, 1),
                                           (0.0015, 2), (2.0, 2000),
                                           (1e300, 2**60 // 10**6)])
  def test_a_steps_deadline_is_never_0_ms(self, seconds, ms):
    # A deadline under 1 ms was truncated to 0: every cxl_offload wait failed.
    assert validation.timeout_ms(seconds) == ms
    with jcxl.Pool(host="1MiB", cxl=0, timeout_s=seconds) as p:
      assert stream._timeout_ms(p) == ms

  @pytest.mark.parametrize("tier", ["host", "cxl", "nvme"])
  @pytest.mark.parametrize("capacity", [1, 4095, "4000B"])
  def test_a_tier_below_one_page_is_refused(self, tier, capacity, tmp_path):
    # It used to round down to a 0 B tier that refused every put.
    sizes = {"host": "1MiB", "cxl": 0, tier: capacity}
    with pytest.raises(ValueError, match=rf"{tier} must be 0 \(off\) or at "
                       rf"least 4096 bytes .* but got {capacity!r}"):
      jcxl.Pool(**sizes, nvme_dir=tmp_path)
    assert not list(tmp_path.iterdir())

  @pytest.mark.parametrize("kwargs, match", [
      ({"spill": "no"}, "spill must be True or False, but got 'no'"),
      ({"spill": 1}, "spill must be True or False, but got 1"),
      ({"emulate_cxl": "false"}, "emulate_cxl must be True or False"),
      ({"keep_nvme_files": None}, "keep_nvme_files must be True or False"),
      ({"node": 0.0}, r"node must be a NUMA node id, but got 0.0 \(float\)"),
      ({"node": True}, "node must be a NUMA node id, but got True"),
      ({"node": "0"}, "node must be a NUMA node id, but got '0'"),
  ])
  def test_flags_and_node_take_only_their_type(self, kwargs, match):
    with pytest.raises(TypeError, match=match):
      jcxl.Pool(host="1MiB", cxl=0, **kwargs)

  def test_numpy_bools_and_ints_are_taken(self):
    with jcxl.Pool(host="1MiB", cxl=0, spill=np.bool_(True),
                   node=np.int64(jcxl.Pool(host="1MiB", cxl=0).node)) as p:
      assert p.settings()["spill"] is True

  def test_place_names_the_empty_leaf(self, pool):
    with pytest.raises(ValueError, match=r"leaf \['b'\]: cannot store an "
                       r"empty array \(shape \(0, 3\), float32\)"):
      jcxl.place({"a": np.ones(2), "b": np.zeros((0, 3), np.float32)},
                 "cxl", pool=pool)
    assert pool.handles() == []

  @pytest.mark.parametrize("call, error, match", [
      # the same bytes, other numbers: read back as garbage before
      (lambda p, h: p.put_async(h, np.zeros(4, np.float64)), TypeError,
       r"array has dtype float64, but handle \d+ holds float32 \(shape "
       r"\(8,\)\)"),
      (lambda p, h: p.put_async(h, np.zeros(2, np.int32), offset=8),
       TypeError, "array has dtype int32, but handle"),
      (lambda p, h: p.put_async(h, np.zeros(9, np.float32)), ValueError,
       r"array of 36 bytes at offset 0 does not fit in handle \d+, which "
       r"holds 32 bytes"),
      (lambda p, h: p.put_async(h, np.zeros(2, np.float32), offset=28),
       ValueError, "array of 8 bytes at offset 28 does not fit"),
      (lambda p, h: p.put_async(h, np.zeros(1, np.float32), offset=2),
       ValueError, r"offset 2 is not a whole number of float32 items \(4 "
       r"bytes each\)"),
      (lambda p, h: p.read_bytes_async(h, np.zeros(4, np.float64)),
       TypeError, "out has dtype float64, but handle"),
      (lambda p, h: p.read_bytes_async(h, np.zeros(2, np.float32),
                                       offset=30), ValueError,
       "offset 30 is not a whole number"),
      (lambda p, h: p.read_bytes_async(h, np.zeros(3, np.float32),
                                       offset=24), ValueError,
       "out of 12 bytes at offset 24 does not fit"),
      (lambda p, h: p.get(h, np.zeros(8, np.int32)), ValueError,
       "out has shape .* and dtype int32, but handle"),
  ])
  def test_transfers_check_the_objects_dtype_and_size(self, pool, call,
                                                      error, match):
    stored = np.arange(8, dtype=np.float32)
    handle = pool.put(stored)
    with pytest.raises(error, match=match):
      call(pool, handle).wait()
    np.testing.assert_array_equal(pool.get(handle), stored)

  def test_partial_writes_and_reads_of_the_objects_dtype_work(self, pool):
    handle = pool.put(np.zeros(8, np.float32))
    pool.put_async(handle, np.full(2, 7, ">f4"), offset=8).wait()
    out = np.empty(3, np.float32)
    pool.read_bytes_async(handle, out, offset=4).wait()
    np.testing.assert_array_equal(out, [0, 7, 7])
