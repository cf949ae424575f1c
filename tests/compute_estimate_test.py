"""The compute estimate the adaptive schedule starts from."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jcxl._src.schedules import compute_estimate
from jcxl._src.step_ir.program import Program


def estimate(fn, *args) -> list[float]:
  closed = jax.make_jaxpr(fn)(*args)
  program = Program(closed, len(args))
  return compute_estimate.node_seconds(program.nodes, program.resolve)


X = np.ones((1 << 16,), np.float32)


def test_fused_elementwise_run_costs_what_it_reads_and_writes():
  def one_op(x):
    return x * 2.0

  def ten_ops(x):
    for i in range(10):
      x = x * 2.0 + float(i)
    return x

  # Twenty equations fuse into one loop: one read, one write of x, like a
  # single equation (counting every output would charge twenty times).
  assert sum(estimate(ten_ops, X)) == pytest.approx(sum(estimate(one_op, X)))
  _, rate = compute_estimate.device_rates()
  assert sum(estimate(one_op, X)) == pytest.approx(X.size / rate)


def test_output_read_by_an_unfused_node_is_written_out():
  w = np.ones((X.size, 8), np.float32)

  def into_dot(x, w):
    return (x * 2.0) @ w

  def reduced(x, w):
    return jnp.sum(x * 2.0) + w[0, 0]

  scaled_into_dot = estimate(into_dot, X, w)[0]
  scaled_into_sum = estimate(reduced, X, w)[0]
  _, rate = compute_estimate.device_rates()
  # x * 2 is read and written out before the product reads it; fused into
  # the sum, only read.
  assert scaled_into_dot == pytest.approx(2 * X.size / (2 * rate))
  assert scaled_into_sum == pytest.approx(X.size / (2 * rate))


def test_products_are_timed_per_shape_once():
  small = np.ones((32, 32), np.float32)
  large = np.ones((512, 512), np.float32)
  matmul = lambda a, b: a @ b
  before = compute_estimate._dot_seconds.cache_info().misses
  (t_large,) = estimate(matmul, large, large)
  (t_small,) = estimate(matmul, small, small)
  assert estimate(matmul, large, large) == [t_large]  # measured once
  assert compute_estimate._dot_seconds.cache_info().misses - before == 2
  # 4096 times the multiply-adds; a small product is mostly call overhead.
  assert t_large > 4 * t_small > 0


def test_loop_body_counts_once_per_iteration_fused_alike():
  def body(c, x):
    return c, x * 2.0 + 1.0

  def scanned(xs):
    return jax.lax.scan(body, 0.0, xs)[1]

  xs = np.ones((6, 1024), np.float32)
  (loop,) = estimate(scanned, xs)
  one = sum(estimate(lambda x: x * 2.0 + 1.0, xs[0]))
  assert loop == pytest.approx(6 * one)


def test_a_large_product_is_timed_on_a_slice(monkeypatch):
  monkeypatch.setattr(compute_estimate, "_TIMED_FLOPS", 2 * 64**3)
  a = np.ones((256, 64), np.float32)
  b = np.ones((64, 64), np.float32)
  (estimated,) = estimate(lambda a, b: a @ b, a, b)
  # Its largest free dimension (256 rows) cut to 64, the time scaled by 4.
  sliced = compute_estimate._dot_seconds(
      (64, 64), (64, 64), a.dtype, b.dtype, (((1,), (0,)), ((), ())),
      np.dtype(np.float32))
  assert estimated == pytest.approx(4 * sliced)


def test_costly_elementwise_work_is_charged_its_time_beyond_its_elements(
    monkeypatch):
  timed = []

  def time_eqn(eqn):  # as if the device took 5 ms for it
    timed.append(eqn.primitive.name)
    return 5e-3
  monkeypatch.setattr(compute_estimate, "_time_eqn", time_eqn)
  compute_estimate._eqn_seconds.clear()
  # The same elements read and written: a scale costs them alone, an exp
  # is timed and costs what the device took.
  (scaled,) = estimate(lambda x: x * 2.0, X)
  (exp,) = estimate(jnp.exp, X)
  _, rate = compute_estimate.device_rates()
  assert scaled == pytest.approx(X.size / rate)
  assert exp == pytest.approx(max(5e-3, X.size / rate))
  assert timed == ["exp"]


def test_a_reduction_is_timed_once_per_signature():
  grid = np.ones((512, 512), np.float32)
  column_sums = lambda x: jnp.sum(x, axis=0)
  compute_estimate._eqn_seconds.clear()
  (first,) = estimate(column_sums, grid)
  assert len(compute_estimate._eqn_seconds) == 1
  assert estimate(column_sums, grid) == [first]  # not timed again
  assert len(compute_estimate._eqn_seconds) == 1
  # It reads the grid and writes a row; its time beyond that is added.
  _, rate = compute_estimate.device_rates()
  moved = (grid.size + grid.shape[1]) / (2 * rate)
  (timed,) = compute_estimate._eqn_seconds.values()
  assert first == pytest.approx(moved + max(0.0, timed - moved))


def test_an_equation_too_large_to_time_is_charged_its_elements(monkeypatch):
  monkeypatch.setattr(compute_estimate, "_TIMED_ELEMENTS", 1000)
  compute_estimate._eqn_seconds.clear()
  (exp,) = estimate(jnp.exp, X)
  _, rate = compute_estimate.device_rates()
  assert exp == pytest.approx(X.size / rate)
  assert not compute_estimate._eqn_seconds


def test_a_slow_first_run_is_not_taken_for_the_timing():
  calls = []

  def first_run_stalls():
    calls.append(None)
    if len(calls) == 1:  # a fresh process's first run of a product
      time.sleep(0.3)
    return jnp.zeros(())

  assert compute_estimate._typical_seconds(first_run_stalls) < 0.1
  assert len(calls) == 6  # the warm-up and five timed runs


def test_a_long_run_is_timed_once_after_its_warm_up():
  calls = []

  def slow():
    calls.append(None)
    time.sleep(0.12)
    return jnp.zeros(())

  assert compute_estimate._typical_seconds(slow) >= 0.12
  assert len(calls) == 2


def test_timed_runs_do_not_copy_their_arguments_in():
  # Passed as numpy arrays, every timed run copied its arguments onto the
  # device first: an elementwise loop over 4M elements timed 10x slower,
  # and every estimate built on that rate with it.
  seen = []

  def run(x):
    seen.append(type(x))
    return x

  compute_estimate._typical_seconds(run, np.ones((4,), np.float32))
  assert seen and all(issubclass(t, jax.Array) for t in seen), seen


def test_rates_are_measured_on_device_arrays_inside_a_trace():
  # Estimates are made while a step is traced: the timed runs must still
  # be of concrete arrays.
  seen = []

  def run(x):
    seen.append(isinstance(x, jax.core.Tracer))
    return x

  jax.make_jaxpr(lambda y: compute_estimate._typical_seconds(
      run, np.ones((4,), np.float32)) + y)(1.0)
  assert seen and not any(seen)


def program_of(fn, *args) -> Program:
  return Program(jax.make_jaxpr(fn)(*args), len(args))


def run_of(program, needed=lambda key: True):
  return compute_estimate.run_seconds(program.nodes, program.resolve,
                                      program.consts, needed)


def test_a_run_is_compiled_whole_and_timed_once(monkeypatch):
  compiled = []
  timed = compute_estimate._device_seconds

  def record(c, avals):
    compiled.append(c)
    return timed(c, avals)

  monkeypatch.setattr(compute_estimate, "_device_seconds", record)
  a = np.ones((64, 64), np.float32)
  program = program_of(lambda a, b: jnp.tanh(a @ b) @ b, a, a)
  seconds = run_of(program)
  assert seconds is not None and seconds >= 0
  assert len(compiled) == 1  # both products and the tanh: one program
  assert run_of(program_of(lambda a, b: jnp.tanh(a @ b) @ b, a, a)) == seconds
  assert len(compiled) == 1  # the same run again: not compiled again


def test_a_run_returns_only_what_is_read_after_it(monkeypatch):
  outputs = []
  monkeypatch.setattr(compute_estimate, "_device_seconds", lambda c, avals: (
      outputs.append(len(jax.tree.leaves(c.out_info))) or 0.0))
  program = program_of(lambda x: (x * 2.0) * 3.0, X[:1000])
  last = program.nodes[-1].outs[0]
  compute_estimate._run_seconds.clear()
  run_of(program, needed=lambda key: key == last)
  compute_estimate._run_seconds.clear()
  run_of(program)
  # Intermediates the step reads nowhere else stay inside the run's
  # loops, as the compiler would keep them in the step.
  assert outputs == [1, 2]


def test_a_run_is_charged_its_time_less_what_calling_it_costs(monkeypatch):
  # Summed over a step's many small runs, the calls' own cost (which the
  # step, one call, does not pay) came to a fifth of an MLP's estimate.
  def fake(fn, *args, **kwargs):  # the empty program: one int32 scalar
    (out,) = jax.tree.leaves(fn.out_info)
    return 0.001 if out.dtype == np.int32 else 0.005

  monkeypatch.setattr(compute_estimate, "_typical_seconds", fake)
  compute_estimate._run_seconds.clear()
  assert run_of(program_of(lambda x: x * 2.0, X)) == pytest.approx(0.004)


def test_a_run_too_large_to_allocate_here_is_not_timed(monkeypatch):
  monkeypatch.setattr(compute_estimate, "_TIMED_RUN_BYTES", X.nbytes)
  compute_estimate._run_seconds.clear()
  assert run_of(program_of(lambda x: x * 2.0, X)) is None  # x and 2x


def test_a_run_with_side_effects_is_not_timed():
  def prints(x):
    jax.debug.print("{}", x)
    return x * 2.0

  assert run_of(program_of(prints, X)) is None


def mlp_step(depth=3, width=128):
  """An adamw step over `depth` identical layers, and its abstract args."""
  import optax  # pylint: disable=g-import-not-at-top
  params = {f"layer{i}": {"w": jax.ShapeDtypeStruct((width, width),
                                                    np.float32)}
            for i in range(depth)}
  tx = optax.adamw(1e-3)
  x = jax.ShapeDtypeStruct((32, width), np.float32)

  def loss_fn(p, x):
    for i in range(depth):
      x = jnp.tanh(x @ p[f"layer{i}"]["w"])
    return jnp.mean(x ** 2)

  def step(p, s, x):
    loss, g = jax.value_and_grad(loss_fn)(p, x)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  return step, (params, jax.eval_shape(tx.init, params)), x


def test_timed_timeline_times_each_distinct_segment_once(monkeypatch):
  from jcxl._src.offload.step import step_timeline  # pylint: disable=g-import-not-at-top
  compiled = []
  timed = compute_estimate._device_seconds
  monkeypatch.setattr(compute_estimate, "_device_seconds", lambda c, a: (
      compiled.append(c) or timed(c, a)))
  compute_estimate._run_seconds.clear()
  shallow, _ = step_timeline(*mlp_step(depth=6), timed=True)
  first = len(compiled)
  deep, _ = step_timeline(*mlp_step(depth=10), timed=True)
  # Four more layers like the middle ones: more segments, all timed
  # already.
  assert 0 < first < len(shallow) < len(deep)
  assert len(compiled) == first
  assert sum(s.compute_s for s in deep) > sum(s.compute_s for s in shallow)


def test_timed_timeline_falls_back_to_estimates_where_runs_are_too_large(
    monkeypatch):
  from jcxl._src.offload.step import step_timeline  # pylint: disable=g-import-not-at-top
  step, state, x = mlp_step()
  estimated, _ = step_timeline(step, state, x)
  monkeypatch.setattr(compute_estimate, "_TIMED_RUN_BYTES", 0)
  compute_estimate._run_seconds.clear()
  fallen_back, _ = step_timeline(step, state, x, timed=True)
  assert [s.compute_s for s in fallen_back] == pytest.approx(
      [s.compute_s for s in estimated])
  assert sum(s.compute_s for s in fallen_back) > 0

