"""Tests of host update programs (jcxl/_src/update_program.py) run by the pool.

An adam update is checked bit for bit against the same float32 arithmetic in
numpy and in a jax.jit on XLA:CPU; every op against jax on edge values (NaN,
+-0, infinities, subnormals); bfloat16 objects and instructions; the errors
a program or a run can raise; and the FFI handlers inside a jitted step.

What XLA:CPU does differently, found here (see test_xla_cpu_*):
  * it contracts a*b + c into one FMA on a CPU that has FMA (jaxlib 0.10
    on this AMD EPYC); a program never does (each op is rounded, as the
    program format says).
  * its algebraic simplifier turns a / s, s a broadcast scalar (adam's
    bias corrections), into a * (1 / s), which rounds twice.
  * With XLA_FLAGS="--xla_cpu_max_isa=AVX --xla_disable_hlo_passes=algsimp"
    (no FMA instructions, no such rewrite) XLA computes adam bit for bit as
    the program does.
  * its rsqrt is a hardware estimate refined by Newton steps, not
    1/sqrt(x) (about a third of the values differ in the last bit); with
    --xla_backend_extra_options=xla_cpu_disable_platform_dependent_math it
    is 1/sqrt(x), as the program computes it.
  * its threads flush subnormals (DAZ and FTZ): a program does the same
    with flush_denormals=True.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import jcxl
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jcxl._src import errors
from jcxl._src import stream
from jcxl._src import update_program as up

f32 = np.float32
bf16 = ml_dtypes.bfloat16
B1, B2, EPS = f32(0.9), f32(0.999), f32(1e-8)
C1, C2 = f32(1) - B1, f32(1) - B2
N = 100_003  # not a multiple of the executor's chunks or blocks
Op = up.UpdateOp
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def pool():
  with jcxl.Pool(host="64MiB", cxl="64MiB") as p:
    yield p


def adam_program(n, p, mu, nu, g):
  """mu = b1 mu + (1 - b1) g; nu = b2 nu + (1 - b2) g g;
  p = p - lr (mu / bc1) / (sqrt(nu / bc2) + eps); scalars lr, bc1, bc2."""
  inputs = [up.Input.object(h) for h in (p, mu, nu, g)]  # 0-3
  inputs += [up.Input.scalar(i) for i in range(3)]  # 4 lr, 5 bc1, 6 bc2
  inputs += [up.Input.const(c) for c in (B1, C1, B2, C2, EPS)]  # 7-11
  code = [
      up.Instr(Op.MUL, 7, 1),  # 12
      up.Instr(Op.MUL, 8, 3),  # 13
      up.Instr(Op.ADD, 12, 13),  # 14 mu'
      up.Instr(Op.MUL, 9, 2),  # 15
      up.Instr(Op.MUL, 3, 3),  # 16 g g
      up.Instr(Op.MUL, 10, 16),  # 17
      up.Instr(Op.ADD, 15, 17),  # 18 nu'
      up.Instr(Op.DIV, 14, 5),  # 19
      up.Instr(Op.DIV, 18, 6),  # 20
      up.Instr(Op.SQRT, 20),  # 21
      up.Instr(Op.ADD, 21, 11),  # 22
      up.Instr(Op.DIV, 19, 22),  # 23
      up.Instr(Op.MUL, 4, 23),  # 24
      up.Instr(Op.SUB, 0, 24),  # 25 p'
  ]
  outputs = [up.Output(25, p), up.Output(14, mu), up.Output(18, nu)]
  return up.Program(n, 3, inputs, code, outputs)


def adam(p, mu, nu, g, lr, bc1, bc2, xp=np):
  """The same arithmetic, in numpy's float32 (or jax's, xp=jnp)."""
  mu = B1 * mu + C1 * g
  nu = B2 * nu + C2 * (g * g)
  return p - lr * ((mu / bc1) / (xp.sqrt(nu / bc2) + EPS)), mu, nu


def adam_state(n=N, seed=0):
  rng = np.random.default_rng(seed)
  p, mu, g = (rng.standard_normal(n, dtype=f32) for _ in range(3))
  nu = np.abs(rng.standard_normal(n, dtype=f32)) * f32(0.01)
  return p, mu, nu, g


def scalars_of(step):
  return np.array([1e-3, f32(1) - B1**step, f32(1) - B2**step], f32)


def bits(x):
  x = np.asarray(x)
  return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def assert_bits_equal(got, want, what=""):
  got, want = bits(got), bits(want)
  differ = np.flatnonzero(got != want)
  assert differ.size == 0, (
      f"{what}: {differ.size} of {got.size} differ, first at {differ[:5]}: "
      f"got {got[differ[:5]]} want {want[differ[:5]]}")


class AdamTest:

  def test_matches_numpy_bit_for_bit(self, pool):
    p, mu, nu, g = adam_state()
    handles = [pool.put(p, "host"), pool.put(mu, "cxl"), pool.put(nu, "cxl"),
               pool.put(g, "host")]
    program = pool.updates.register(adam_program(N, *handles))
    for step in (1, 2, 3):
      s = scalars_of(step)
      pool.updates.run(program, s).wait()
      p, mu, nu = adam(p, mu, nu, g, s[0], s[1], s[2])
      for h, want, name in zip(handles, (p, mu, nu), ("p", "mu", "nu")):
        assert_bits_equal(pool.get(h), want, f"step {step} {name}")
    stats = pool.updates.stats()
    assert (stats.runs, stats.failed, stats.elements) == (3, 0, 3 * N)
    assert stats.bytes_read == 3 * N * 16
    assert stats.bytes_written == 3 * N * 12
    assert stats.threads >= 1 and stats.busy_ns > 0
    # The tiers' link counters leave the runs out (what the cxl tier's
    # link moved: the puts and the gets only).
    assert pool.stats()["cxl"].bytes_read == 3 * 2 * N * 4

  def test_xla_cpu_without_fma_matches_bit_for_bit(self, pool, tmp_path):
    """XLA:CPU with no FMA instructions to contract into, no a / s ->
    a * (1 / s) rewrite (and its portable rsqrt) computes adam as the
    program does, bit for bit."""
    p, mu, nu, g = adam_state(seed=3)
    handles = [pool.put(a, "host") for a in (p, mu, nu, g)]
    program = pool.updates.register(adam_program(N, *handles))
    s = scalars_of(1)
    pool.updates.run(program, s).wait()
    ours = [pool.get(h) for h in handles[:3]]
    np.savez(tmp_path / "in.npz", p=p, mu=mu, nu=nu, g=g, s=s)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
        import numpy as np, jax, jax.numpy as jnp
        import host_update_kernel_test as t
        d = np.load({str(tmp_path / "in.npz")!r})
        s = d["s"]
        out = jax.jit(lambda p, mu, nu, g, lr, bc1, bc2: t.adam(
            p, mu, nu, g, lr, bc1, bc2, xp=jnp))(
                d["p"], d["mu"], d["nu"], d["g"], s[0], s[1], s[2])
        x = np.linspace(0.01, 100, 100003, dtype=np.float32)
        rsqrt = jax.jit(jax.lax.rsqrt)(x)
        np.savez({str(tmp_path / "out.npz")!r}, p=out[0], mu=out[1],
                 nu=out[2], rsqrt=rsqrt, x=x)
        """)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
        "--xla_cpu_max_isa=AVX --xla_disable_hlo_passes=algsimp "
        "--xla_backend_extra_options=xla_cpu_disable_platform_dependent_math"))
    subprocess.run([sys.executable, "-c", script], env=env, check=True,
                   cwd=ROOT, timeout=300)
    xla = np.load(tmp_path / "out.npz")
    for got, name in zip(ours, ("p", "mu", "nu")):
      assert_bits_equal(got, xla[name], f"xla {name}")
    # rsqrt: the program's 1/sqrt(x) is XLA's portable one.
    h = pool.put(xla["x"], "host")
    rsqrt = pool.updates.register(up.Program(
        xla["x"].size, 0, [up.Input.object(h)], [up.Instr(Op.RSQRT, 0)],
        [up.Output(1, h)]))
    pool.updates.run(rsqrt).wait()
    assert_bits_equal(pool.get(h), xla["rsqrt"], "rsqrt")

  def test_xla_cpu_default_contracts_multiply_add(self, pool):
    """Default XLA:CPU fuses b1 * mu + c1 * g into fma(b1, mu, c1 * g)
    where the CPU has FMA; the program rounds b1 * mu first, as numpy."""
    _, mu, _, g = adam_state(seed=5)
    hm, hg = pool.put(mu, "host"), pool.put(g, "host")
    program = pool.updates.register(up.Program(
        N, 0, [up.Input.object(hm), up.Input.object(hg), up.Input.const(B1),
               up.Input.const(C1)],
        [up.Instr(Op.MUL, 2, 0), up.Instr(Op.MUL, 3, 1),
         up.Instr(Op.ADD, 4, 5)], [up.Output(6, hm)]))
    pool.updates.run(program).wait()
    ours = pool.get(hm)
    plain = B1 * mu + C1 * g
    assert_bits_equal(ours, plain, "program vs numpy")
    xla = np.asarray(jax.jit(lambda mu, g: B1 * mu + C1 * g)(mu, g))
    # fma(b1, mu, c1 g): b1 * mu is exact in float64, one rounding to f32
    # (the sum is rounded twice here, which can differ from a true FMA only
    # at a float64 tie, none of which these values hit).
    fused = (np.float64(B1) * mu.astype(np.float64) +
             (C1 * g).astype(np.float64)).astype(f32)
    if not np.array_equal(bits(xla), bits(plain)):
      assert_bits_equal(xla, fused, "XLA:CPU vs an FMA")

  def test_xla_cpu_default_divides_by_a_scalar_reciprocal(self, pool):
    """Default XLA:CPU computes a / s (s a scalar) as a * (1 / s); the
    program divides, as numpy."""
    a = adam_state(seed=6)[0]
    s = f32(0.1)
    h = pool.put(a, "host")
    program = pool.updates.register(up.Program(
        N, 1, [up.Input.object(h), up.Input.scalar(0)],
        [up.Instr(Op.DIV, 0, 1)], [up.Output(2, h)]))
    pool.updates.run(program, [s]).wait()
    assert_bits_equal(pool.get(h), a / s, "program vs numpy")
    xla = np.asarray(jax.jit(lambda a, s: a / s)(a, s))
    if not np.array_equal(bits(xla), bits(a / s)):
      assert_bits_equal(xla, a * (f32(1) / s), "XLA:CPU vs a * (1 / s)")


# Edge values: +-0, +-1, infinities, NaNs (two payloads), subnormals, the
# largest and smallest normals, bf16 ties.
EDGES = np.array([0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.0, np.inf, -np.inf,
                  np.nan, -np.nan, 1e-45, -1e-39, 1.1754944e-38,
                  3.4028235e38, -3.4028235e38, 1.00390625, 1.01171875,
                  1e-30, 7e-3, -123456.79], f32)
EDGES[10] = np.array([0xffc00001], np.uint32).view(f32)[0]  # -NaN, payload


def grid(arity):
  """Every pair of edge values (arity 2); each value (1); triples of a
  smaller set (3)."""
  if arity == 1:
    return [EDGES]
  if arity == 2:
    a, b = np.meshgrid(EDGES, EDGES, indexing="ij")
    return [a.ravel(), b.ravel()]
  small = np.array([0.0, -0.0, 1.0, -2.5, np.inf, np.nan, 3.0], f32)
  a, b, c = np.meshgrid(small, EDGES, small, indexing="ij")
  return [a.ravel(), b.ravel(), c.ravel()]


def as_bool(x):
  return x != 0


# op -> (arity, jax function of float32 operands, result dtype)
OPS = {
    Op.ADD: (2, lax.add), Op.SUB: (2, lax.sub), Op.MUL: (2, lax.mul),
    Op.DIV: (2, lax.div), Op.MAX: (2, lax.max), Op.MIN: (2, lax.min),
    Op.NEG: (1, lax.neg), Op.ABS: (1, lax.abs), Op.SIGN: (1, lax.sign),
    Op.SQRT: (1, lax.sqrt), Op.SQUARE: (1, lax.square),
    Op.SELECT: (3, lambda a, b, c: lax.select_n(as_bool(a), b, c)),
    Op.CLAMP: (3, lax.clamp),
    Op.EQ: (2, lax.eq), Op.NE: (2, lax.ne), Op.LT: (2, lax.lt),
    Op.LE: (2, lax.le), Op.GT: (2, lax.gt), Op.GE: (2, lax.ge),
    Op.AND: (2, lambda a, b: jnp.logical_and(as_bool(a), as_bool(b))),
    Op.OR: (2, lambda a, b: jnp.logical_or(as_bool(a), as_bool(b))),
    Op.NOT: (1, lambda a: jnp.logical_not(as_bool(a))),
    Op.COPY: (1, lambda a: a),
}
# Ops whose NaN result is defined bit for bit (they flip or keep bits);
# other NaNs only have to be NaN: which payload a vector unit keeps is its
# own choice, and XLA:CPU's max and min (so clamp) change the sign bit of
# the NaN they return, as its x86 lowering goes (max(0, -NaN) is +NaN on
# this AMD EPYC with AVX-512). The program returns the NaN operand as is
# (ffi/tests/update_program_test.cc checks that).
EXACT_NAN = {Op.NEG, Op.ABS, Op.SIGN, Op.SELECT, Op.COPY}


def run_one(pool, op, operands, *, dtype=up.UpdateDType.F32, imm=0,
            flush=False, out_dtype=np.float32):
  n = operands[0].size
  handles = [pool.put(np.ascontiguousarray(x), "host") for x in operands]
  out = pool.allocate((n,), out_dtype, "host")
  arity = len(operands)
  instr = up.Instr(op, 0, 1 if arity > 1 else -1, 2 if arity > 2 else -1,
                   dtype=dtype, imm=imm)
  program = pool.updates.register(up.Program(
      n, 0, [up.Input.object(h) for h in handles], [instr],
      [up.Output(arity, out)], flush_denormals=flush))
  pool.updates.run(program).wait()
  result = pool.get(out)
  pool.updates.release(program)
  for h in handles + [out]:
    pool.free(h)
  return result


def assert_same(op, got, want, what):
  got = np.asarray(got, f32)
  want = np.asarray(want).astype(f32)
  same = bits(got) == bits(want)
  if op not in EXACT_NAN:
    same |= np.isnan(got) & np.isnan(want)
  bad = np.flatnonzero(~same)
  assert bad.size == 0, (f"{what}: {bad.size} differ, e.g. got "
                         f"{got[bad[:4]]} want {want[bad[:4]]}")


class OpsTest:

  @pytest.mark.parametrize("op", list(OPS), ids=lambda o: o.name)
  def test_matches_xla_cpu_on_edge_values(self, pool, op):
    """XLA:CPU flushes subnormals: the program does with
    flush_denormals=True (max, min, sign and clamp of a subnormal give the
    +-0 it reads as, as XLA's do)."""
    arity, fn = OPS[op]
    operands = grid(arity)
    got = run_one(pool, op, operands, flush=True)
    want = jax.jit(fn)(*operands)
    assert_same(op, got, want, f"{op.name} vs XLA:CPU")

  @pytest.mark.parametrize("op", [Op.ADD, Op.MUL, Op.DIV, Op.SQRT,
                                  Op.RSQRT, Op.SIGN], ids=lambda o: o.name)
  def test_without_flushing_matches_numpy(self, pool, op):
    """IEEE subnormals (flush_denormals=False), as numpy computes."""
    arity = 1 if op in (Op.SQRT, Op.RSQRT, Op.SIGN) else 2
    operands = grid(arity)
    got = run_one(pool, op, operands)
    with np.errstate(all="ignore"):
      ref = {Op.ADD: np.add, Op.MUL: np.multiply, Op.DIV: np.divide,
             Op.SQRT: np.sqrt, Op.RSQRT: lambda x: f32(1) / np.sqrt(x),
             Op.SIGN: lambda x: np.where(np.isnan(x) | (x == 0), x,
                                         np.sign(x))}[op](*operands)
    assert_same(op, got, ref, f"{op.name} vs numpy")

  @pytest.mark.parametrize("imm", [0, 1, 2, 3, 5, 8, -1, -2, -3])
  def test_integer_pow_squares_as_jax(self, pool, imm):
    (x,) = grid(1)
    x = np.concatenate([x, np.linspace(-3, 3, 1001, dtype=f32)])
    got = run_one(pool, Op.INTEGER_POW, [x], imm=imm, flush=True)
    want = jax.jit(lambda v: lax.integer_pow(v, imm))(x)
    assert_same(Op.INTEGER_POW, got, want, f"x ** {imm}")
    # In bfloat16, every product rounded, as XLA computes it.
    xb = x.astype(bf16)
    got = run_one(pool, Op.INTEGER_POW, [xb.astype(f32)], imm=imm,
                  dtype=up.UpdateDType.BF16, flush=True)
    want = jax.jit(lambda v: lax.integer_pow(v, imm))(xb)
    assert_same(Op.INTEGER_POW, got, np.asarray(want).astype(f32),
                f"bf16 x ** {imm}")

  def test_convert(self, pool):
    (x,) = grid(1)
    got = run_one(pool, Op.CONVERT, [x], dtype=up.UpdateDType.BOOL)
    assert_same(Op.CONVERT, got, (x != 0).astype(f32), "to bool")
    got = run_one(pool, Op.CONVERT, [x], dtype=up.UpdateDType.BF16)
    want = np.asarray(jax.jit(lambda v: v.astype(jnp.bfloat16))(x))
    assert_same(Op.COPY, got, want.astype(f32), "to bf16")


class BFloat16Test:

  def test_bf16_params_with_f32_moments(self, pool):
    p, mu, nu, g = adam_state(seed=7)
    pb = p.astype(bf16)
    hp = pool.put(pb, "host")
    hm, hn, hg = (pool.put(a, "cxl") for a in (mu, nu, g))
    program = pool.updates.register(adam_program(N, hp, hm, hn, hg))
    s = scalars_of(1)
    pool.updates.run(program, s).wait()
    want_p, want_mu, want_nu = adam(pb.astype(f32), mu, nu, g, *s)
    got = pool.get(hp)
    assert got.dtype == bf16
    assert_bits_equal(got, want_p.astype(bf16), "bf16 p")
    assert_bits_equal(pool.get(hm), want_mu, "mu")

  def test_bf16_instructions_round_every_result(self, pool):
    rng = np.random.default_rng(9)
    x, y, z = (rng.standard_normal(N, dtype=f32).astype(bf16)
               for _ in range(3))
    handles = [pool.put(a, "host") for a in (x, y, z)]
    out = pool.allocate((N,), bf16, "cxl")
    program = pool.updates.register(up.Program(
        N, 0, [up.Input.object(h) for h in handles],
        [up.Instr(Op.MUL, 0, 1, dtype=up.UpdateDType.BF16),
         up.Instr(Op.ADD, 3, 2, dtype=up.UpdateDType.BF16)],
        [up.Output(4, out)]))
    pool.updates.run(program).wait()
    got = pool.get(out)
    want = ((x.astype(f32) * y.astype(f32)).astype(bf16).astype(f32) +
            z.astype(f32)).astype(bf16)
    assert_bits_equal(got, want, "numpy, rounded per op")
    xla = jax.jit(lambda a, b, c: a * b + c)(x, y, z)
    assert_bits_equal(got, np.asarray(xla), "XLA:CPU bf16")

  def test_nan_and_ties_round_as_ml_dtypes(self, pool):
    (x,) = grid(1)
    h = pool.put(x, "host")
    out = pool.allocate(x.shape, bf16, "host")
    program = pool.updates.register(up.Program(
        x.size, 0, [up.Input.object(h)], [], [up.Output(0, out)]))
    pool.updates.run(program).wait()
    assert_bits_equal(pool.get(out), x.astype(bf16), "f32 -> bf16")


class CopyTest:
  """Pool.allocate_copy: a bfloat16 copy the pool keeps of an object."""

  @pytest.mark.parametrize("tier", ["host", "cxl"])
  def test_a_copy_follows_every_write_of_its_source(self, pool, tier):
    (x,) = grid(1)
    h = pool.put(x, tier)
    c = pool.allocate_copy(h, bf16)
    info = pool.info(c)
    assert (info.copy_of, info.tier.value, info.dtype) == (h, tier, bf16)
    assert_bits_equal(pool.get(c), x.astype(bf16), "made")
    y = np.random.default_rng(3).normal(size=x.shape).astype(f32)
    pool.put_async(h, y).wait()
    assert_bits_equal(pool.get(c), y.astype(bf16), "after a put")
    g = pool.put(np.full(x.shape, 0.5, f32), tier)
    both = pool.updates.register(up.Program(
        x.size, 0, [up.Input.object(h), up.Input.object(g)],
        [up.Instr(op=Op.SUB, a=0, b=1)],
        [up.Output(2, h), up.Output(2, c)]))
    pool.updates.run(both).wait()
    runs = pool.updates.stats().runs
    assert_bits_equal(pool.get(c), (y - f32(0.5)).astype(bf16), "updated")
    assert pool.updates.stats().runs == runs  # written fresh: no refresh

  def test_what_a_copy_refuses(self, pool):
    h = pool.put(np.ones(64, f32), "host")
    c = pool.allocate_copy(h, bf16)
    with pytest.raises(ValueError, match="is a copy the pool keeps of "
                       f"handle {h}; write the source"):
      pool.put_async(c, np.zeros(64, bf16)).wait()
    with pytest.raises(ValueError, match="only from the register it writes "
                       "the source from"):
      pool.updates.register(up.Program(
          64, 0, [up.Input.object(h)], [up.Instr(op=Op.NEG, a=0)],
          [up.Output(1, h), up.Output(0, c)]))
    with pytest.raises(ValueError, match="is itself a copy"):
      pool.allocate_copy(c, bf16)
    with pytest.raises(ValueError, match="not float16"):
      pool.allocate_copy(h, np.float16)
    with pytest.raises(ValueError, match="holds int32"):
      pool.allocate_copy(pool.put(np.ones(4, np.int32), "host"), bf16)
    pool.free(h)
    with pytest.raises(errors.UnknownHandleError,
                       match=f"is a copy of handle {h}, which was freed"):
      pool.get(c)


class ErrorsTest:

  def test_register_refuses_bad_objects(self, pool):
    good = pool.put(np.ones(1000, f32), "host")
    ints = pool.put(np.ones(1000, np.int32), "host")
    longer = pool.put(np.ones(1001, f32), "cxl")
    def program(handle, as_output=False):
      inputs = [up.Input.object(good), up.Input.const(1.0)]
      outputs = [up.Output(2, good)]
      if as_output:
        outputs.append(up.Output(0, handle))
      else:
        inputs.append(up.Input.object(handle))
      return up.Program(1000, 0, inputs, [up.Instr(Op.ADD, 0, 1)], outputs)
    for as_output in (False, True):
      where = "output 1" if as_output else "input 2"
      with pytest.raises(ValueError, match=f"{where}: handle {ints} .*holds "
                         "int32; update programs read and write float32 or "
                         "bfloat16"):
        pool.updates.register(program(ints, as_output))
      with pytest.raises(ValueError, match=f"{where}: handle {longer} .*"
                         "holds 1001 elements, but the program is for "
                         "num_elements = 1000"):
        pool.updates.register(program(longer, as_output))
      with pytest.raises(errors.UnknownHandleError,
                         match=f"{where}: handle 123456 is unknown"):
        pool.updates.register(program(123456, as_output))

  def test_malformed_programs(self, pool):
    h = pool.put(np.ones(10, f32), "host")
    base = dict(num_elements=10, num_scalars=1,
                inputs=[up.Input.object(h), up.Input.scalar(0)],
                outputs=[up.Output(2, h)])
    cases = [
        ([up.Instr(Op.MUL, 0, 5)], ValueError,
         "instruction 0 .*operand b = 5 is not an earlier register"),
        ([up.Instr(99, 0, 1)], ValueError, "unknown op 99"),
        ([up.Instr(Op.MUL, 0, 1, dtype=7)], ValueError, "unknown dtype 7"),
        ([up.Instr(Op.MUL, 0, 1.5)], TypeError, "instruction 0 b must be an "
         "int"),
    ]
    for code, error, message in cases:
      with pytest.raises(error, match=message):
        pool.updates.register(up.Program(code=code, **base))
    with pytest.raises(ValueError, match="input 1: scalar_index 3 is not in"):
      pool.updates.register(up.Program(
          10, 1, [up.Input.object(h), up.Input.scalar(3)],
          [up.Instr(Op.MUL, 0, 1)], [up.Output(2, h)]))
    with pytest.raises(ValueError, match="register 1 is a scalar"):
      pool.updates.register(up.Program(
          10, 1, [up.Input.object(h), up.Input.scalar(0)], [],
          [up.Output(1, h)]))
    with pytest.raises(TypeError, match="takes a jcxl update Program"):
      pool.updates.register({"num_elements": 10})
    with pytest.raises(ValueError, match="not an earlier register"):
      up.Program(code=[up.Instr(Op.NEG, 3)], **base).validate()

  def test_runs_refuse_wrong_scalars_and_freed_objects(self, pool):
    p, mu, nu, g = (pool.put(np.ones(N, f32), "host") for _ in range(4))
    program = pool.updates.register(adam_program(N, p, mu, nu, g))
    with pytest.raises(ValueError, match=f"update program {program} takes 3 "
                       "scalars per run, but got 2"):
      pool.updates.run(program, [1.0, 2.0])
    pool.free(g)
    with pytest.raises(errors.UnknownHandleError,
                       match=f"update program {program}: input 3 .*handle "
                       f"{g} is unknown"):
      pool.updates.run(program, [1.0, 1.0, 1.0])
    pool.updates.release(program)
    with pytest.raises(errors.UnknownHandleError, match="released, or never"):
      pool.updates.run(program, [1.0, 1.0, 1.0])
    with pytest.raises(errors.UnknownHandleError, match="released, or never"):
      pool.updates.release(program)

  def test_free_waits_for_a_run(self, pool):
    h = pool.put(np.arange(N, dtype=f32), "host")
    program = pool.updates.register(up.Program(
        N, 0, [up.Input.object(h), up.Input.const(2.0)],
        [up.Instr(Op.MUL, 0, 1)], [up.Output(2, h)]))
    pool.updates._hold(True)
    run = pool.updates.run(program)
    with pytest.raises(errors.TransferTimeoutError):
      run.wait(timeout_s=0.01)
    assert not run.done()
    pool.updates._hold(False)
    run.wait()
    assert run.done() and run.program_id == program
    assert_bits_equal(pool.get(h), np.arange(N, dtype=f32) * 2, "doubled")

  def test_update_threads_argument(self):
    with pytest.raises(ValueError, match="update_threads"):
      jcxl.Pool(host="4MiB", cxl=0, update_threads=-1)
    with pytest.raises(TypeError, match="update_threads"):
      jcxl.Pool(host="4MiB", cxl=0, update_threads=1.5)
    with jcxl.Pool(host="4MiB", cxl=0, update_threads=3) as p:
      assert p.updates.stats().threads == 0  # started at the first run
      h = p.put(np.ones(1000, f32), "host")
      p.updates.run(p.updates.register(up.Program(
          1000, 0, [up.Input.object(h)], [up.Instr(Op.NEG, 0)],
          [up.Output(1, h)]))).wait()
      assert p.updates.stats().threads == 3
      assert (p.get(h) == -1).all()


def test_nvme_objects(tmp_path):
  with jcxl.Pool(host="64MiB", cxl=0, nvme="64MiB",
                 nvme_dir=str(tmp_path)) as pool:
    n = 1_500_001  # a staging block (1 Mi elements) and a ragged tail
    p, mu, nu, g = adam_state(n, seed=11)
    handles = [pool.put(p, "nvme"), pool.put(mu, "nvme"),
               pool.put(nu, "host"), pool.put(g, "nvme")]
    program = pool.updates.register(adam_program(n, *handles))
    s = scalars_of(1)
    pool.updates.run(program, s).wait()
    for h, want, name in zip(handles, adam(p, mu, nu, g, *s), ("p", "mu",
                                                               "nu")):
      assert_bits_equal(pool.get(h), want, f"nvme {name}")


class JitTest:

  def test_update_start_and_done_in_a_step(self, pool):
    p, mu, nu, g = adam_state(seed=13)
    handles = [pool.put(a, "cxl") for a in (p, mu, nu, g)]
    program = pool.updates.register(adam_program(N, *handles))

    @jax.jit
    def step(t, grads_token):
      t = t.astype(jnp.float32)
      scalars = jnp.stack([jnp.float32(1e-3), 1 - B1**t, 1 - B2**t])
      token = stream.update_start(pool.id, program, scalars,
                                  after=grads_token)
      done = stream.update_done(token, pool_id=pool.id)
      return done, scalars

    for t in (1, 2):
      done, s = step(jnp.int32(t), jnp.zeros(()))
      assert done.shape == (1,) and done.dtype == jnp.int32
      s = np.asarray(s)
      p, mu, nu = adam(p, mu, nu, g, s[0], s[1], s[2])
    for h, want, name in zip(handles, (p, mu, nu), ("p", "mu", "nu")):
      assert_bits_equal(pool.get(h), want, f"jit {name}")
    text = jax.jit(lambda s: stream.update_done(
        stream.update_start(pool.id, program, s))).lower(
            jnp.zeros(3, jnp.float32)).as_text()
    assert "jcxl_update_start" in text and "jcxl_update_done" in text

  def test_errors_inside_a_step(self, pool):
    h = pool.put(np.ones(N, f32), "host")
    extra = pool.put(np.ones(N, f32), "host")
    program = pool.updates.register(up.Program(
        N, 1, [up.Input.object(h), up.Input.scalar(0), up.Input.object(extra)],
        [up.Instr(Op.MUL, 0, 1), up.Instr(Op.ADD, 3, 2)], [up.Output(4, h)]))
    with pytest.raises(ValueError, match="takes 1 scalars per run, got 2"):
      stream.update_start(pool.id, program, jnp.ones(2))
    with pytest.raises(errors.UnknownHandleError):
      stream.update_start(pool.id, program + 7, jnp.ones(1))

    # A done that times out names the program; the run goes on.
    @jax.jit
    def slow(s):
      return stream.update_done(stream.update_start(pool.id, program, s),
                                timeout_ms=50)
    pool.updates._hold(True)
    try:
      with pytest.raises(jax.errors.JaxRuntimeError, match=f"(?s)DEADLINE_EXCEEDED.*program "
                         f"{program}"):
        slow(jnp.full(1, 2.0)).block_until_ready()
    finally:
      pool.updates._hold(False)
    runs = pool.updates.stats().runs
    # A token no start made.
    bogus = jax.jit(lambda: stream.update_done(jnp.array([7777777, 5],
                                                         jnp.int32)))
    with pytest.raises(jax.errors.JaxRuntimeError, match="no update run .* is waiting"):
      bogus().block_until_ready()
    # An object freed since registration fails the start, naming it.
    pool.free(extra)
    step = jax.jit(lambda s: stream.update_done(
        stream.update_start(pool.id, program, s), pool_id=pool.id))
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"(?s)jcxl_update_start.*input 2.*"
                       f"handle {extra}"):
      step(jnp.ones(1)).block_until_ready()
    assert pool.updates.stats().runs >= runs
