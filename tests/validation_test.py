"""Bad input at the public boundary: one validation of shapes and dtypes for
every entry point, native byte order on the way in, and errors that name
the argument, what it got and what it accepts."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

import jcxl
from jcxl._src import schedule as schedule_lib

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
    with jcxl.Pool(host="1.5KiB", cxl=0) as p:
      assert p.settings()["host"] == "1.50 KiB"  # 1536 bytes

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
       "latency_s must be a finite number of seconds"),
      ({"bandwidth": "1GB/s", "latency_s": "1"}, TypeError,
       "latency_s must be a finite number of seconds >= 0, but got '1'"),
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
