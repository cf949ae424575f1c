// Tests of the update-program executor: every op against a scalar
// reference written apart from it (NaN, +-0, infinities, subnormals, bf16
// rounding), an adam update against a plain loop bit for bit, in-place
// aliasing, ranges that start and end anywhere, and the validator's errors.
#include "update_program.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "test_util.h"

namespace jcxl {
namespace {

using Kind = UpdateInput::Kind;
using Op = UpdateOp;
using DT = UpdateDType;

constexpr float kInf = std::numeric_limits<float>::infinity();

uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

float FromBits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// Round to nearest even, spelled out differently from the executor's.
uint16_t RefToBF16(float x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xffc0 : 0x7fc0;
  const uint32_t u = Bits(x);
  uint32_t upper = u >> 16;
  const uint32_t lower = u & 0xffffu;
  if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u))) ++upper;
  return static_cast<uint16_t>(upper);
}

float RefFromBF16(uint16_t h) { return FromBits(uint32_t{h} << 16); }
float RefRoundBF16(float x) { return RefFromBF16(RefToBF16(x)); }

float RefMax(float a, float b) {
  if (std::isnan(a)) return a;
  if (std::isnan(b)) return b;
  if (a == b) return std::signbit(a) ? b : a;
  return a > b ? a : b;
}

float RefMin(float a, float b) {
  if (std::isnan(a)) return a;
  if (std::isnan(b)) return b;
  if (a == b) return std::signbit(a) ? a : b;
  return a < b ? a : b;
}

// jax's _integer_pow, one value at a time.
float RefIntPow(float x, int32_t imm, bool bf16) {
  auto round = [&](float v) { return bf16 ? RefRoundBF16(v) : v; };
  int64_t y = imm;
  const bool reciprocal = y < 0;
  if (reciprocal) y = -y;
  if (y == 0) return 1.0f;
  bool have = false;
  float acc = 0;
  while (y > 0) {
    if (y & 1) {
      acc = have ? round(acc * x) : x;
      have = true;
    }
    y >>= 1;
    if (y > 0) x = round(x * x);
  }
  return round(reciprocal ? 1.0f / acc : acc);
}

float RefOp(Op op, DT dtype, int32_t imm, float a, float b, float c) {
  auto t = [](bool v) { return v ? 1.0f : 0.0f; };
  float r = 0;
  switch (op) {
    case Op::kAdd: r = a + b; break;
    case Op::kSub: r = a - b; break;
    case Op::kMul: r = a * b; break;
    case Op::kDiv: r = a / b; break;
    case Op::kMax: r = RefMax(a, b); break;
    case Op::kMin: r = RefMin(a, b); break;
    case Op::kNeg: r = -a; break;
    case Op::kAbs: r = std::fabs(a); break;
    case Op::kSign:
      r = (std::isnan(a) || a == 0.0f) ? a : (a > 0 ? 1.0f : -1.0f);
      break;
    case Op::kSqrt: r = std::sqrt(a); break;
    case Op::kRsqrt: r = 1.0f / std::sqrt(a); break;
    case Op::kSquare: r = a * a; break;
    case Op::kIntPow: r = RefIntPow(a, imm, dtype == DT::kBF16); break;
    case Op::kSelect: r = a != 0.0f ? c : b; break;
    case Op::kClamp: r = RefMin(RefMax(b, a), c); break;
    case Op::kEq: r = t(a == b); break;
    case Op::kNe: r = t(a != b); break;
    case Op::kLt: r = t(a < b); break;
    case Op::kLe: r = t(a <= b); break;
    case Op::kGt: r = t(a > b); break;
    case Op::kGe: r = t(a >= b); break;
    case Op::kAnd: r = t(a != 0.0f && b != 0.0f); break;
    case Op::kOr: r = t(a != 0.0f || b != 0.0f); break;
    case Op::kNot: r = t(a == 0.0f); break;
    case Op::kConvert: r = dtype == DT::kBool ? t(a != 0.0f) : a; break;
    case Op::kCopy: r = a; break;
    case Op::kFma: r = std::fma(a, b, c); break;
    case Op::kFms: r = std::fma(a, b, -c); break;
    case Op::kFnma: r = std::fma(-a, b, c); break;
  }
  return dtype == DT::kBF16 ? RefRoundBF16(r) : r;
}

int Arity(Op op) { return FindUpdateOp(op)->arity; }

// Ops whose NaN result is defined bit for bit (they pick an operand or
// flip a bit); arithmetic NaNs only have to be NaN (which operand's payload
// a vector add returns is the compiler's choice).
bool ExactNaN(Op op) {
  switch (op) {
    case Op::kMax: case Op::kMin: case Op::kNeg: case Op::kAbs:
    case Op::kSign: case Op::kSelect: case Op::kClamp: case Op::kCopy:
    case Op::kConvert:
      return true;
    default:
      return false;
  }
}

bool SameResult(Op op, float got, float want) {
  if (Bits(got) == Bits(want)) return true;
  return !ExactNaN(op) && std::isnan(got) && std::isnan(want);
}

std::string Show(float x) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.9g (0x%08x)", x, Bits(x));
  return text;
}

// Interesting floats: signed zeros, infinities, NaNs (two payloads, both
// signs), subnormals, the extremes, values whose bf16 rounding ties.
std::vector<float> EdgeValues() {
  return {0.0f,
          -0.0f,
          1.0f,
          -1.0f,
          0.5f,
          -2.5f,
          3.0f,
          kInf,
          -kInf,
          FromBits(0x7fc00000u),  // quiet NaN
          FromBits(0xffc00001u),  // -NaN with a payload
          FromBits(0x00000001u),  // smallest subnormal
          FromBits(0x807fffffu),  // largest negative subnormal
          std::numeric_limits<float>::min(),
          std::numeric_limits<float>::max(),
          -std::numeric_limits<float>::max(),
          FromBits(0x3f808000u),  // 1 + 2^-8: a bf16 tie, rounds to even
          FromBits(0x3f818000u),  // 1 + 3 * 2^-8: a tie that rounds up
          FromBits(0x3f80c000u),  // above the tie
          1e-30f,
          7e-3f,
          -123456.789f};
}

UpdateProgram OneOp(Op op, DT dtype, int32_t imm, int64_t n) {
  UpdateProgram p;
  p.num_elements = n;
  const int arity = Arity(op);
  for (int i = 0; i < arity; ++i) p.inputs.push_back({Kind::kObject, i + 1});
  UpdateInstr instr;
  instr.op = op;
  instr.a = 0;
  instr.b = arity > 1 ? 1 : -1;
  instr.c = arity > 2 ? 2 : -1;
  instr.dtype = dtype;
  instr.imm = imm;
  p.code.push_back(instr);
  p.outputs.push_back({arity, 100});
  return p;
}

std::vector<UpdateArray> F32Arrays(std::vector<std::vector<float>*> arrays) {
  std::vector<UpdateArray> out;
  for (auto* a : arrays) out.push_back({a ? a->data() : nullptr, DT::kF32});
  return out;
}

// Every op on every combination of edge values (all pairs; for the
// three-operand ops, triples of a smaller set), as vectors more than a
// chunk long, against RefOp.
void CheckOpOnEdges(Op op, DT dtype, int32_t imm = 0) {
  const std::vector<float> edges = EdgeValues();
  const int arity = Arity(op);
  std::vector<std::vector<float>> operands(3);
  std::vector<float> small = {0.0f, -0.0f, 1.0f, -2.5f, kInf,
                              FromBits(0x7fc00000u), 3.0f};
  if (arity == 3) {
    for (float a : small) {
      for (float b : edges) {
        for (float c : small) {
          operands[0].push_back(a);
          operands[1].push_back(b);
          operands[2].push_back(c);
        }
      }
    }
  } else {
    for (float a : edges) {
      for (float b : edges) {
        operands[0].push_back(a);
        operands[1].push_back(b);
        operands[2].push_back(0);
      }
    }
  }
  // Repeat past a chunk (1024) so the vector loops and their tails run.
  const size_t base = operands[0].size();
  while (operands[0].size() < 2500) {
    for (auto& o : operands) o.push_back(o[o.size() - base]);
  }
  const int64_t n = static_cast<int64_t>(operands[0].size());
  std::vector<float> out(n, 12345.0f);
  UpdateProgram p = OneOp(op, dtype, imm, n);
  CHECK_OK(ValidateUpdateProgram(p));
  std::vector<std::vector<float>*> ins;
  for (int i = 0; i < arity; ++i) ins.push_back(&operands[i]);
  RunUpdateRange(p, F32Arrays(ins), F32Arrays({&out}), nullptr, 0, n);
  for (int64_t k = 0; k < n; ++k) {
    const float want =
        RefOp(op, dtype, imm, operands[0][k], operands[1][k], operands[2][k]);
    if (!SameResult(op, out[k], want)) {
      ::jcxl::testing::Fail(__FILE__, __LINE__,
           std::string("  ") + UpdateOpName(op) + " dtype " +
               std::to_string(static_cast<int>(dtype)) + " imm " +
               std::to_string(imm) + " of (" + Show(operands[0][k]) + ", " +
               Show(operands[1][k]) + ", " + Show(operands[2][k]) +
               "): got " + Show(out[k]) + ", want " + Show(want));
    }
  }
}

constexpr Op kAllOps[] = {
    Op::kAdd, Op::kSub, Op::kMul, Op::kDiv, Op::kMax, Op::kMin,
    Op::kNeg, Op::kAbs, Op::kSign, Op::kSqrt, Op::kRsqrt, Op::kSquare,
    Op::kSelect, Op::kClamp, Op::kEq, Op::kNe, Op::kLt, Op::kLe,
    Op::kGt, Op::kGe, Op::kAnd, Op::kOr, Op::kNot, Op::kCopy};

TEST(EveryOpMatchesTheReferenceOnEdgeValues) {
  for (Op op : kAllOps) CheckOpOnEdges(op, DT::kF32);
}

TEST(EveryOpRoundsItsResultToBF16WhenAsked) {
  for (Op op : kAllOps) CheckOpOnEdges(op, DT::kBF16);
}

TEST(ConvertToBoolAndBF16) {
  CheckOpOnEdges(Op::kConvert, DT::kBool);
  CheckOpOnEdges(Op::kConvert, DT::kBF16);
  CheckOpOnEdges(Op::kConvert, DT::kF32);
}

TEST(IntPowSquaresAsJaxDoes) {
  for (int32_t imm : {0, 1, 2, 3, 4, 5, 7, 8, 13, 31, -1, -2, -3, -7,
                      std::numeric_limits<int32_t>::max(),
                      std::numeric_limits<int32_t>::min()}) {
    CheckOpOnEdges(Op::kIntPow, DT::kF32, imm);
    CheckOpOnEdges(Op::kIntPow, DT::kBF16, imm);
  }
  // x ** 2 is x * x and x ** 3 is (x * x) * x: exactly, on random values.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  std::vector<float> x(3000);
  for (float& v : x) v = dist(rng);
  for (int32_t imm : {2, 3, -1}) {
    std::vector<float> out(x.size());
    UpdateProgram p = OneOp(Op::kIntPow, DT::kF32, imm, x.size());
    RunUpdateRange(p, F32Arrays({&x}), F32Arrays({&out}), nullptr, 0,
                   x.size());
    for (size_t k = 0; k < x.size(); ++k) {
      const float want = imm == 2 ? x[k] * x[k]
                         : imm == 3 ? (x[k] * x[k]) * x[k]
                                    : 1.0f / x[k];
      CHECK_EQ(Bits(out[k]), Bits(want));
    }
  }
}

TEST(MaxMinAndSignOfZerosAndNaNs) {
  // The cases XLA:CPU was seen to compute (tests/host_update_kernel_test.py
  // checks them against jax.jit).
  const float nan = FromBits(0x7f800001u);  // a signalling NaN stays as is
  struct Case {
    Op op;
    float a, b, want;
  } cases[] = {
      {Op::kMax, -0.0f, 0.0f, 0.0f},  {Op::kMax, 0.0f, -0.0f, 0.0f},
      {Op::kMin, -0.0f, 0.0f, -0.0f}, {Op::kMin, 0.0f, -0.0f, -0.0f},
      {Op::kMax, nan, 1.0f, nan},     {Op::kMax, 1.0f, nan, nan},
      {Op::kMin, nan, -kInf, nan},    {Op::kSign, -0.0f, 0, -0.0f},
      {Op::kSign, nan, 0, nan},       {Op::kSign, -kInf, 0, -1.0f},
  };
  for (const Case& c : cases) {
    std::vector<float> a(1, c.a), b(1, c.b), out(1);
    UpdateProgram p = OneOp(c.op, DT::kF32, 0, 1);
    std::vector<UpdateArray> ins = F32Arrays({&a, &b});
    ins.resize(p.inputs.size());
    RunUpdateRange(p, ins, F32Arrays({&out}), nullptr, 0, 1);
    CHECK_EQ(Bits(out[0]), Bits(c.want));
  }
}

// The bf16 objects: widened on the way in, rounded on the way out.
TEST(BF16ObjectsAreWidenedAndRounded) {
  std::vector<float> values = EdgeValues();
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> bits;
  while (values.size() < 3000) values.push_back(FromBits(bits(rng)));
  const int64_t n = static_cast<int64_t>(values.size());
  std::vector<uint16_t> in(n), out(n, 0), copy(n, 0);
  for (int64_t k = 0; k < n; ++k) in[k] = RefToBF16(values[k]);
  std::vector<float> f32_out(n);
  // out = in * 3 (bf16 -> bf16); f32_out = bf16 in, widened; copy = values.
  UpdateProgram p;
  p.num_elements = n;
  p.inputs = {{Kind::kObject, 1}, {Kind::kConstant, 0, 0, 3.0f},
              {Kind::kObject, 2}};
  p.code = {{Op::kMul, 0, 1, -1, DT::kF32, 0}};
  p.outputs = {{3, 3}, {0, 4}, {2, 5}};
  CHECK_OK(ValidateUpdateProgram(p));
  std::vector<UpdateArray> ins = {{in.data(), DT::kBF16}, {},
                                  {values.data(), DT::kF32}};
  std::vector<UpdateArray> outs = {{out.data(), DT::kBF16},
                                   {f32_out.data(), DT::kF32},
                                   {copy.data(), DT::kBF16}};
  RunUpdateRange(p, ins, outs, nullptr, 0, n);
  for (int64_t k = 0; k < n; ++k) {
    const float widened = RefFromBF16(in[k]);
    CHECK_EQ(Bits(f32_out[k]), Bits(widened));
    CHECK_EQ(out[k], RefToBF16(widened * 3.0f));
    CHECK_EQ(copy[k], RefToBF16(values[k]));
  }
  // Some fixed roundings: ties to even, NaNs to 0x7fc0 with their sign,
  // the largest float to infinity (as ml_dtypes rounds it).
  CHECK_EQ(RefToBF16(FromBits(0x3f808000u)), 0x3f80);
  CHECK_EQ(RefToBF16(FromBits(0x3f818000u)), 0x3f82);
  CHECK_EQ(RefToBF16(std::numeric_limits<float>::max()), 0x7f80);
  CHECK_EQ(copy[9], 0x7fc0);   // EdgeValues()[9]: quiet NaN
  CHECK_EQ(copy[10], 0xffc0);  // -NaN with a payload
  CHECK_EQ(copy[16], 0x3f80);
  CHECK_EQ(copy[17], 0x3f82);
  CHECK_EQ(copy[14], 0x7f80);
}

// mu = b1 mu + (1 - b1) g; nu = b2 nu + (1 - b2) g^2;
// p = p - lr * (mu / bc1) / (sqrt(nu / bc2) + eps), in place.
UpdateProgram Adam(int64_t n, int32_t p, int32_t mu, int32_t nu, int32_t g) {
  UpdateProgram prog;
  prog.num_elements = n;
  prog.num_scalars = 3;  // lr, bc1, bc2
  prog.inputs = {{Kind::kObject, p},  // 0
                 {Kind::kObject, mu},  // 1
                 {Kind::kObject, nu},  // 2
                 {Kind::kObject, g},   // 3
                 {Kind::kScalar, 0, 0},  // 4 lr
                 {Kind::kScalar, 0, 1},  // 5 bc1
                 {Kind::kScalar, 0, 2},  // 6 bc2
                 {Kind::kConstant, 0, 0, 0.9f},   // 7 b1
                 {Kind::kConstant, 0, 0, 0.999f},  // 8 b2
                 {Kind::kConstant, 0, 0, 1e-8f},  // 9 eps
                 {Kind::kConstant, 0, 0, 1.0f}};  // 10
  prog.code = {
      {Op::kMul, 7, 1},    // 11 b1 mu
      {Op::kSub, 10, 7},   // 12 1 - b1 (a scalar)
      {Op::kMul, 12, 3},   // 13 (1 - b1) g
      {Op::kAdd, 11, 13},  // 14 mu'
      {Op::kMul, 8, 2},    // 15 b2 nu
      {Op::kSub, 10, 8},   // 16 1 - b2
      {Op::kIntPow, 3, -1, -1, DT::kF32, 2},  // 17 g^2
      {Op::kMul, 16, 17},  // 18
      {Op::kAdd, 15, 18},  // 19 nu'
      {Op::kDiv, 14, 5},   // 20 mu' / bc1
      {Op::kDiv, 19, 6},   // 21 nu' / bc2
      {Op::kSqrt, 21},     // 22
      {Op::kAdd, 22, 9},   // 23
      {Op::kDiv, 20, 23},  // 24
      {Op::kMul, 4, 24},   // 25 lr * ...
      {Op::kSub, 0, 25},   // 26 p'
      {Op::kMul, 0, 0},    // 27 dead code
  };
  prog.outputs = {{26, p}, {14, mu}, {19, nu}};
  return prog;
}

struct AdamState {
  std::vector<float> p, mu, nu, g;
};

AdamState RandomAdamState(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  AdamState s{std::vector<float>(n), std::vector<float>(n),
              std::vector<float>(n), std::vector<float>(n)};
  for (int64_t k = 0; k < n; ++k) {
    s.p[k] = normal(rng);
    s.mu[k] = 0.1f * normal(rng);
    s.nu[k] = 0.01f * std::fabs(normal(rng));
    s.g[k] = normal(rng);
  }
  return s;
}

void AdamReference(AdamState& s, float lr, float bc1, float bc2) {
  const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
  for (size_t k = 0; k < s.p.size(); ++k) {
    const float mu = b1 * s.mu[k] + (1.0f - b1) * s.g[k];
    const float nu = b2 * s.nu[k] + (1.0f - b2) * (s.g[k] * s.g[k]);
    s.p[k] = s.p[k] - lr * ((mu / bc1) / (std::sqrt(nu / bc2) + eps));
    s.mu[k] = mu;
    s.nu[k] = nu;
  }
}

TEST(AdamMatchesAPlainLoopBitForBit) {
  const int64_t n = 100'003;
  AdamState s = RandomAdamState(n, 11), ref = s;
  UpdateProgram prog = Adam(n, 1, 2, 3, 4);
  CHECK_OK(ValidateUpdateProgram(prog));
  const float scalars[3] = {1e-3f, 0.1f, 0.001f};
  for (int step = 0; step < 3; ++step) {
    RunUpdateRange(prog, F32Arrays({&s.p, &s.mu, &s.nu, &s.g, 0, 0, 0, 0, 0,
                                    0, 0}),
                   F32Arrays({&s.p, &s.mu, &s.nu}), scalars, 0, n);
    AdamReference(ref, scalars[0], scalars[1], scalars[2]);
  }
  CHECK(std::memcmp(s.p.data(), ref.p.data(), n * 4) == 0);
  CHECK(std::memcmp(s.mu.data(), ref.mu.data(), n * 4) == 0);
  CHECK(std::memcmp(s.nu.data(), ref.nu.data(), n * 4) == 0);
}

TEST(RangesSplitAnywhereGiveTheSameResult) {
  const int64_t n = 5000;
  AdamState whole = RandomAdamState(n, 5), split = whole;
  UpdateProgram prog = Adam(n, 1, 2, 3, 4);
  const float scalars[3] = {0.01f, 0.5f, 0.25f};
  auto run = [&](AdamState& s, int64_t begin, int64_t end) {
    RunUpdateRange(prog, F32Arrays({&s.p, &s.mu, &s.nu, &s.g, 0, 0, 0, 0, 0,
                                    0, 0}),
                   F32Arrays({&s.p, &s.mu, &s.nu}), scalars, begin, end);
  };
  run(whole, 0, n);
  // Not chunk aligned, single elements, empty ranges.
  const int64_t cuts[] = {0, 3, 3, 4, 1023, 1025, 1026, 2500, 4999, 5000};
  for (size_t i = 0; i + 1 < sizeof(cuts) / sizeof(cuts[0]); ++i) {
    run(split, cuts[i], cuts[i + 1]);
  }
  CHECK(std::memcmp(whole.p.data(), split.p.data(), n * 4) == 0);
  CHECK(std::memcmp(whole.nu.data(), split.nu.data(), n * 4) == 0);
  // An empty range touches nothing.
  AdamState before = split;
  run(split, 7, 7);
  run(split, 9, 2);
  CHECK(std::memcmp(before.p.data(), split.p.data(), n * 4) == 0);
}

TEST(InPlaceOutputsReadEveryInputFirst) {
  const int64_t n = 3000;
  std::vector<float> a(n), b(n);
  for (int64_t k = 0; k < n; ++k) {
    a[k] = static_cast<float>(k);
    b[k] = static_cast<float>(-k);
  }
  // A swap: a <- b, b <- a, both straight from their input registers.
  UpdateProgram swap;
  swap.num_elements = n;
  swap.inputs = {{Kind::kObject, 1}, {Kind::kObject, 2}};
  swap.outputs = {{1, 1}, {0, 2}};
  CHECK_OK(ValidateUpdateProgram(swap));
  RunUpdateRange(swap, F32Arrays({&a, &b}), F32Arrays({&a, &b}), nullptr, 0,
                 n);
  for (int64_t k = 0; k < n; ++k) {
    CHECK_EQ(a[k], static_cast<float>(-k));
    CHECK_EQ(b[k], static_cast<float>(k));
  }
  // a <- a * 2 + b, b <- a (the old a), a read in place by the code.
  UpdateProgram mix;
  mix.num_elements = n;
  mix.inputs = {{Kind::kObject, 1}, {Kind::kObject, 2},
                {Kind::kConstant, 0, 0, 2.0f}};
  mix.code = {{Op::kMul, 0, 2}, {Op::kAdd, 3, 1}};
  mix.outputs = {{4, 1}, {0, 2}};
  std::vector<float> a0 = a, b0 = b;
  RunUpdateRange(mix, F32Arrays({&a, &b, 0}), F32Arrays({&a, &b}), nullptr, 0,
                 n);
  for (int64_t k = 0; k < n; ++k) {
    CHECK_EQ(a[k], a0[k] * 2.0f + b0[k]);
    CHECK_EQ(b[k], a0[k]);
  }
  // bf16 in place: x <- x + 1, read and written as bf16.
  std::vector<uint16_t> h(n);
  for (int64_t k = 0; k < n; ++k) h[k] = RefToBF16(static_cast<float>(k));
  UpdateProgram inc;
  inc.num_elements = n;
  inc.inputs = {{Kind::kObject, 1}, {Kind::kConstant, 0, 0, 1.0f}};
  inc.code = {{Op::kAdd, 0, 1}};
  inc.outputs = {{2, 1}};
  std::vector<uint16_t> h0 = h;
  RunUpdateRange(inc, {{h.data(), DT::kBF16}, {}}, {{h.data(), DT::kBF16}},
                 nullptr, 0, n);
  for (int64_t k = 0; k < n; ++k) {
    CHECK_EQ(h[k], RefToBF16(RefFromBF16(h0[k]) + 1.0f));
  }
}

TEST(ScalarRegistersAreComputedOnceAndBroadcast) {
  // r = x * (s0 - s1 ** 2) + sqrt(c): the parenthesis and sqrt(c) are
  // scalar registers.
  const int64_t n = 2100;
  std::vector<float> x(n), r(n);
  for (int64_t k = 0; k < n; ++k) x[k] = 0.25f * static_cast<float>(k);
  UpdateProgram p;
  p.num_elements = n;
  p.num_scalars = 2;
  p.inputs = {{Kind::kObject, 1}, {Kind::kScalar, 0, 0},
              {Kind::kScalar, 0, 1}, {Kind::kConstant, 0, 0, 2.0f}};
  p.code = {{Op::kIntPow, 2, -1, -1, DT::kF32, 2},  // 4
            {Op::kSub, 1, 4},                       // 5
            {Op::kMul, 0, 5},                       // 6
            {Op::kSqrt, 3},                         // 7
            {Op::kAdd, 6, 7}};                      // 8
  p.outputs = {{8, 2}};
  CHECK_OK(ValidateUpdateProgram(p));
  const float scalars[2] = {5.0f, 1.5f};
  RunUpdateRange(p, F32Arrays({&x, 0, 0, 0}), F32Arrays({&r}), scalars, 0, n);
  const float s = 5.0f - 1.5f * 1.5f, c = std::sqrt(2.0f);
  for (int64_t k = 0; k < n; ++k) CHECK_EQ(Bits(r[k]), Bits(x[k] * s + c));
}

TEST(UnreadInputsAreNeverTouched) {
  // Input 1 feeds only dead code: its null array must never be read.
  const int64_t n = 100;
  std::vector<float> x(n, 2.0f), r(n);
  UpdateProgram p;
  p.num_elements = n;
  p.inputs = {{Kind::kObject, 1}, {Kind::kObject, 2}};
  p.code = {{Op::kNeg, 1}, {Op::kSquare, 0}};
  p.outputs = {{3, 3}};
  CHECK_OK(ValidateUpdateProgram(p));
  std::vector<bool> read = UpdateInputsRead(p);
  CHECK(read[0]);
  CHECK(!read[1]);
  RunUpdateRange(p, {{x.data(), DT::kF32}, {nullptr, DT::kF32}},
                 F32Arrays({&r}), nullptr, 0, n);
  for (float v : r) CHECK_EQ(v, 4.0f);
}

TEST(FlushDenormalsFlushesOperandsAndResultsOnly) {
  const float tiny = FromBits(0x00000010u);  // subnormal
  const float small = std::numeric_limits<float>::min();  // normal
  std::vector<float> x = {tiny, small, 1.0f, -tiny};
  std::vector<float> half(x.size()), copy(x.size());
  UpdateProgram p;
  p.num_elements = static_cast<int64_t>(x.size());
  p.inputs = {{Kind::kObject, 1}, {Kind::kConstant, 0, 0, 0.5f}};
  p.code = {{Op::kMul, 0, 1}};
  p.outputs = {{2, 2}, {0, 3}};
  for (bool flush : {false, true}) {
    p.flush_denormals = flush;
    CHECK_OK(ValidateUpdateProgram(p));
    RunUpdateRange(p, F32Arrays({&x, 0}), F32Arrays({&half, &copy}), nullptr,
                   0, p.num_elements);
    CHECK_EQ(Bits(half[0]), flush ? 0u : Bits(tiny * 0.5f));
    CHECK_EQ(Bits(half[1]), flush ? 0u : Bits(small * 0.5f));
    CHECK_EQ(half[2], 0.5f);
    CHECK_EQ(Bits(copy[0]), Bits(tiny));  // a copy is no arithmetic
  }
  // The thread's own state is put back.
  volatile float v = tiny;
  CHECK_EQ(Bits(v * 1.0f), Bits(tiny));
  // The ops that pick an operand pick the +-0 a subnormal reads as (as
  // XLA:CPU's do under its DAZ), but only when flushing.
  struct Case {
    Op op;
    float a, b, flushed, kept;
  } cases[] = {
      {Op::kMax, -1.0f, tiny, 0.0f, tiny},
      {Op::kMin, 0.0f, -tiny, -0.0f, -tiny},
      {Op::kMin, -0.0f, tiny, -0.0f, -0.0f},
      {Op::kSign, -tiny, 0, -0.0f, -1.0f},
  };
  for (const Case& c : cases) {
    for (bool flush : {false, true}) {
      std::vector<float> a(1, c.a), b(1, c.b), out(1);
      UpdateProgram one = OneOp(c.op, DT::kF32, 0, 1);
      one.flush_denormals = flush;
      std::vector<UpdateArray> ins = F32Arrays({&a, &b});
      ins.resize(one.inputs.size());
      RunUpdateRange(one, ins, F32Arrays({&out}), nullptr, 0, 1);
      CHECK_EQ(Bits(out[0]), Bits(flush ? c.flushed : c.kept));
    }
  }
}

Status Validate(const UpdateProgram& p) { return ValidateUpdateProgram(p); }

// The table (update_ops.h) is every list of ops: names are unique, and
// validation asks each op for the operands its row says, no more.
TEST(TheTableOfOpsIsWhatValidationAndNamesUse) {
  for (int32_t code = 0; code < kNumUpdateOps; ++code) {
    const UpdateOpInfo& info = kUpdateOps[code];
    const Op op = static_cast<Op>(code);
    CHECK(FindUpdateOp(op) == &info);
    CHECK_EQ(std::string(UpdateOpName(op)), std::string(info.name));
    for (int32_t other = 0; other < code; ++other) {
      CHECK_NE(std::string(kUpdateOps[other].name), std::string(info.name));
      CHECK_NE(std::string(kUpdateOps[other].enumerator),
               std::string(info.enumerator));
    }
    UpdateProgram p = OneOp(op, DT::kF32, 2, 8);
    CHECK_OK(ValidateUpdateProgram(p));
    // Its last operand unset: refused, naming the op and its arity.
    UpdateInstr& instr = p.code[0];
    (info.arity == 1 ? instr.a : info.arity == 2 ? instr.b : instr.c) = -1;
    Status status = ValidateUpdateProgram(p);
    CHECK_CODE(status, Code::kInvalidArgument);
    CHECK_CONTAINS(status.message(),
                   std::string(info.name) + " takes " +
                       std::to_string(info.arity) + " operand");
  }
  CHECK(FindUpdateOp(static_cast<Op>(kNumUpdateOps)) == nullptr);
  CHECK(FindUpdateOp(static_cast<Op>(-1)) == nullptr);
  CHECK_EQ(std::string(UpdateOpName(static_cast<Op>(kNumUpdateOps))),
           std::string("?"));
  UpdateProgram p = OneOp(Op::kAdd, DT::kF32, 0, 8);
  p.code[0].op = static_cast<Op>(kNumUpdateOps);
  Status status = ValidateUpdateProgram(p);
  CHECK_CODE(status, Code::kInvalidArgument);
  CHECK_CONTAINS(status.message(),
                 "unknown op " + std::to_string(kNumUpdateOps) +
                     " (ops are 0.." + std::to_string(kNumUpdateOps - 1) +
                     ")");
}

TEST(ValidationNamesWhatIsWrong) {
  UpdateProgram good;
  good.num_elements = 10;
  good.num_scalars = 1;
  good.inputs = {{Kind::kObject, 1}, {Kind::kScalar, 0, 0}};
  good.code = {{Op::kMul, 0, 1}};
  good.outputs = {{2, 1}};
  CHECK_OK(Validate(good));
  struct Case {
    std::string want;
    UpdateProgram program;
  };
  std::vector<Case> cases;
  auto with = [&](std::string want, auto change) {
    UpdateProgram p = good;
    change(p);
    cases.push_back({std::move(want), std::move(p)});
  };
  with("num_elements must be >= 0",
       [](UpdateProgram& p) { p.num_elements = -1; });
  with("num_scalars must be >= 0",
       [](UpdateProgram& p) { p.num_scalars = -2; });
  with("input 1: scalar_index 1 is not in [0, num_scalars = 1)",
       [](UpdateProgram& p) { p.inputs[1].scalar_index = 1; });
  with("input 0: unknown kind 7", [](UpdateProgram& p) {
    p.inputs[0].kind = static_cast<Kind>(7);
  });
  with("instruction 0 (register 2): unknown op 99", [](UpdateProgram& p) {
    p.code[0].op = static_cast<Op>(99);
  });
  with("instruction 0 (register 2): unknown dtype 5", [](UpdateProgram& p) {
    p.code[0].dtype = static_cast<DT>(5);
  });
  with("mul takes 2 operands; operand b = 2 is not an earlier register",
       [](UpdateProgram& p) { p.code[0].b = 2; });
  with("operand a = -1", [](UpdateProgram& p) { p.code[0].a = -1; });
  with("operand c = 9", [](UpdateProgram& p) {
    p.code[0] = {Op::kSelect, 0, 1, 9};
  });
  with("output 0: register 3 does not exist",
       [](UpdateProgram& p) { p.outputs[0].reg = 3; });
  with("output 0: register 1 is a scalar",
       [](UpdateProgram& p) { p.outputs[0].reg = 1; });
  with("output 1 and output 0 both write handle 1",
       [](UpdateProgram& p) { p.outputs.push_back({0, 1}); });
  with("registers (inputs + instructions); at most", [](UpdateProgram& p) {
    p.code.assign(kMaxUpdateRegisters, {Op::kCopy, 0});
  });
  for (const Case& c : cases) {
    Status status = Validate(c.program);
    CHECK_CODE(status, Code::kInvalidArgument);
    CHECK_CONTAINS(status.message(), c.want);
    CHECK_CONTAINS(status.message(), "update program: ");
  }
  // Unused operands are not looked at.
  UpdateProgram unary = good;
  unary.code = {{Op::kNeg, 0, 77, -5}};
  CHECK_OK(Validate(unary));
}

}  // namespace
}  // namespace jcxl

JCXL_TEST_MAIN()
