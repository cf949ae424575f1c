// The update-program executor: a chunk of every vector register at a time,
// each instruction one loop over the chunk.
//
// Bit-exactness: this file is compiled with -ffp-contract=off (no a*b+c
// fused into an FMA, which rounds once instead of twice) and without
// -ffast-math; -fno-math-errno only lets sqrt vectorize (errno is never
// read here, and the results are the same).
#include "update_program.h"

#include <stdlib.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define JCXL_FLUSH_MXCSR 1
#elif defined(__aarch64__)
#define JCXL_FLUSH_FPCR 1
#endif

// The loops are inlined into the chunk runner, which is compiled twice on
// x86-64 (AVX2 and baseline SSE2, picked at the first run by the CPU's
// features): GCC vectorizes them for the copy they land in. (Not
// target_clones: its ifunc resolver runs before a sanitizer's runtime is
// up, and TSan-instrumented it crashes.)
#ifndef JCXL_PREFETCH
#define JCXL_PREFETCH 4
#endif
#ifndef JCXL_SLOT_PAD
#define JCXL_SLOT_PAD 16
#endif
#define JCXL_INLINE inline __attribute__((always_inline))
#if defined(__x86_64__) && defined(__GNUC__) && !defined(JCXL_NO_CLONES)
#define JCXL_AVX2_CLONE 1
#endif

namespace jcxl {
namespace {

// Floats per chunk: a vector register is 1 KiB, so the live registers of a
// program (an adam update keeps about ten) stay in L1 while it runs. (On
// an AMD EPYC, adam on 16M elements, one thread: 256 floats 2.6 ns per
// element, 1024 floats 3.5 ns, 2048 floats 3.6 ns.)
constexpr int kChunk = 256;
// Floats from one register's chunk to the next: a cache line more than a
// chunk, so that registers do not sit at the same offset in 4 KiB pages (a
// load from one then waits on a store to another that only looks like the
// same address: "4K aliasing").
constexpr int kSlotStride = kChunk + JCXL_SLOT_PAD;
// How many chunks ahead the inputs are prefetched, into L2 (prefetcht2):
// adam on 16M elements, one thread, took 2.1-2.6 ns per element prefetched
// 4 chunks ahead into L2, 3.0-4.4 ns 2 chunks ahead into L1 (whose fill
// buffers a burst of prefetches overruns), 3.0 ns without prefetching.
constexpr int kPrefetchChunks = JCXL_PREFETCH;

JCXL_INLINE uint32_t BitsOf(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

JCXL_INLINE float FloatOf(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// f32 -> bf16, round to nearest even, as XLA and ml_dtypes convert: a NaN
// becomes the quiet NaN 0x7fc0 with its sign (never an infinity).
JCXL_INLINE uint16_t ToBF16(float x) {
  const uint32_t u = BitsOf(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7fc0u);
  }
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

JCXL_INLINE float FromBF16(uint16_t h) { return FloatOf(static_cast<uint32_t>(h) << 16); }

JCXL_INLINE float RoundBF16(float x) { return FromBF16(ToBF16(x)); }

// lax.max / lax.min as XLA:CPU computes them: a NaN operand is the result
// (the first one if both are), and -0 < +0. Selects, not branches, so that
// the loops vectorize.
JCXL_INLINE float MaxOf(float a, float b) {
  const float equal = FloatOf(BitsOf(a) & BitsOf(b));  // +0 if either is
  float r = a > b ? a : b;
  r = a == b ? equal : r;
  r = b != b ? b : r;
  return a != a ? a : r;
}

JCXL_INLINE float MinOf(float a, float b) {
  const float equal = FloatOf(BitsOf(a) | BitsOf(b));  // -0 if either is
  float r = a < b ? a : b;
  r = a == b ? equal : r;
  r = b != b ? b : r;
  return a != a ? a : r;
}

// A subnormal as the +-0 it reads as under DAZ: max, min, sign and clamp
// pick an operand, and with flush_denormals XLA:CPU's (the hardware's)
// pick a flushed one.
JCXL_INLINE float Daz(float x) {
  const uint32_t u = BitsOf(x);
  return FloatOf((u & 0x7f800000u) == 0 ? u & 0x80000000u : u);
}

// +-0 and NaN are their own sign.
JCXL_INLINE float SignOf(float a) {
  const float r = a < 0.0f ? -1.0f : a;
  return a > 0.0f ? 1.0f : r;
}

JCXL_INLINE float Bool(bool b) { return b ? 1.0f : 0.0f; }

// The loops every op is: `r` never aliases an operand (the executor gives
// each result a register of its own); operands may alias each other.
template <typename F>
JCXL_INLINE void Map1(const float* a, float* __restrict r, int n, F f) {
  for (int k = 0; k < n; ++k) r[k] = f(a[k]);
}

// Which operand of a binary op is one scalar (read once, not a chunk).
enum Broadcast { kNone = 0, kScalarA = 1, kScalarB = 2 };

template <typename F>
JCXL_INLINE void Map2(const float* a, const float* b, float* __restrict r,
                      int n, Broadcast scalar, F f) {
  if (scalar == kScalarA) {
    const float x = *a;
    for (int k = 0; k < n; ++k) r[k] = f(x, b[k]);
  } else if (scalar == kScalarB) {
    const float y = *b;
    for (int k = 0; k < n; ++k) r[k] = f(a[k], y);
  } else {
    for (int k = 0; k < n; ++k) r[k] = f(a[k], b[k]);
  }
}

template <typename F>
JCXL_INLINE void Map3(const float* a, const float* b, const float* c,
                      float* __restrict r, int n, F f) {
  for (int k = 0; k < n; ++k) r[k] = f(a[k], b[k], c[k]);
}

JCXL_INLINE void RoundBF16InPlace(float* r, int n) {
  for (int k = 0; k < n; ++k) r[k] = RoundBF16(r[k]);
}

// x ** y by squaring, in the order jax's _integer_pow multiplies (so that
// a bf16 result, rounded after each product, matches XLA's); the running
// square lives in `square`.
JCXL_INLINE void IntPow(const float* a, float* __restrict r,
                        float* __restrict square, int n, int32_t imm,
                        bool bf16) {
  int64_t y = imm;
  const bool reciprocal = y < 0;
  if (reciprocal) y = -y;
  if (y == 0) {
    std::fill(r, r + n, 1.0f);
    return;
  }
  const float* x = a;
  bool have_acc = false;
  while (y > 0) {
    if (y & 1) {
      if (!have_acc) {
        std::memcpy(r, x, sizeof(float) * n);
        have_acc = true;
      } else {
        for (int k = 0; k < n; ++k) r[k] = r[k] * x[k];
        if (bf16) RoundBF16InPlace(r, n);
      }
    }
    y >>= 1;
    if (y > 0) {
      if (x == square) {
        for (int k = 0; k < n; ++k) square[k] = square[k] * square[k];
      } else {
        for (int k = 0; k < n; ++k) square[k] = x[k] * x[k];
      }
      if (bf16) RoundBF16InPlace(square, n);
      x = square;
    }
  }
  if (reciprocal) {
    for (int k = 0; k < n; ++k) r[k] = 1.0f / r[k];
  }
}

// The kernels: one case per op of update_ops.h (no default: this file is
// built with -Werror=switch, so an op without its kernel fails to compile).
// r = instr(a, b, c) over n lanes (unused operands may be null; a binary
// op's `scalar` operand is one float); `scratch` holds n floats. `flush`:
// the program flushes subnormals (the arithmetic does so in hardware; the
// ops that pick an operand here).
JCXL_INLINE void Apply(const UpdateInstr& instr, const float* a,
                       const float* b, const float* c, float* __restrict r,
                       float* __restrict scratch, int n, Broadcast scalar,
                       bool flush) {
  using Op = UpdateOp;
  switch (instr.op) {
    case Op::kAdd:
      Map2(a, b, r, n, scalar, [](float x, float y) { return x + y; });
      break;
    case Op::kSub:
      Map2(a, b, r, n, scalar, [](float x, float y) { return x - y; });
      break;
    case Op::kMul:
      Map2(a, b, r, n, scalar, [](float x, float y) { return x * y; });
      break;
    case Op::kDiv:
      Map2(a, b, r, n, scalar, [](float x, float y) { return x / y; });
      break;
    case Op::kMax:
      if (flush) {
        Map2(a, b, r, n, scalar,
             [](float x, float y) { return MaxOf(Daz(x), Daz(y)); });
      } else {
        Map2(a, b, r, n, scalar, [](float x, float y) { return MaxOf(x, y); });
      }
      break;
    case Op::kMin:
      if (flush) {
        Map2(a, b, r, n, scalar,
             [](float x, float y) { return MinOf(Daz(x), Daz(y)); });
      } else {
        Map2(a, b, r, n, scalar, [](float x, float y) { return MinOf(x, y); });
      }
      break;
    case Op::kNeg:
      Map1(a, r, n, [](float x) { return -x; });
      break;
    case Op::kAbs:
      Map1(a, r, n, [](float x) { return std::fabs(x); });
      break;
    case Op::kSign:
      if (flush) {
        Map1(a, r, n, [](float x) { return SignOf(Daz(x)); });
      } else {
        Map1(a, r, n, [](float x) { return SignOf(x); });
      }
      break;
    case Op::kSqrt:
      Map1(a, r, n, [](float x) { return std::sqrt(x); });
      break;
    case Op::kRsqrt:
      Map1(a, r, n, [](float x) { return 1.0f / std::sqrt(x); });
      break;
    case Op::kSquare:
      Map1(a, r, n, [](float x) { return x * x; });
      break;
    case Op::kIntPow:
      IntPow(a, r, scratch, n, instr.imm, instr.dtype == UpdateDType::kBF16);
      break;
    case Op::kSelect:
      Map3(a, b, c, r, n,
           [](float p, float f, float t) { return p != 0.0f ? t : f; });
      break;
    case Op::kClamp:
      if (flush) {
        Map3(a, b, c, r, n, [](float lo, float x, float hi) {
          return MinOf(MaxOf(Daz(x), Daz(lo)), Daz(hi));
        });
      } else {
        Map3(a, b, c, r, n, [](float lo, float x, float hi) {
          return MinOf(MaxOf(x, lo), hi);
        });
      }
      break;
    case Op::kEq:
      Map2(a, b, r, n, scalar, [](float x, float y) { return Bool(x == y); });
      break;
    case Op::kNe:
      Map2(a, b, r, n, scalar, [](float x, float y) { return Bool(x != y); });
      break;
    case Op::kLt:
      Map2(a, b, r, n, scalar, [](float x, float y) { return Bool(x < y); });
      break;
    case Op::kLe:
      Map2(a, b, r, n, scalar, [](float x, float y) { return Bool(x <= y); });
      break;
    case Op::kGt:
      Map2(a, b, r, n, scalar, [](float x, float y) { return Bool(x > y); });
      break;
    case Op::kGe:
      Map2(a, b, r, n, scalar, [](float x, float y) { return Bool(x >= y); });
      break;
    case Op::kAnd:
      Map2(a, b, r, n, scalar, [](float x, float y) {
        return Bool((x != 0.0f) & (y != 0.0f));
      });
      break;
    case Op::kOr:
      Map2(a, b, r, n, scalar, [](float x, float y) {
        return Bool((x != 0.0f) | (y != 0.0f));
      });
      break;
    case Op::kNot:
      Map1(a, r, n, [](float x) { return Bool(x == 0.0f); });
      break;
    case Op::kConvert:
      if (instr.dtype == UpdateDType::kBool) {
        Map1(a, r, n, [](float x) { return Bool(x != 0.0f); });
      } else {
        std::memcpy(r, a, sizeof(float) * n);  // bf16: rounded below
      }
      break;
    case Op::kCopy:
      std::memcpy(r, a, sizeof(float) * n);
      break;
    // One rounding: the FMA instruction in the AVX2+FMA clone (libm's
    // fmaf, as exact but slower, elsewhere).
    case Op::kFma:
      Map3(a, b, c, r, n,
           [](float x, float y, float z) { return __builtin_fmaf(x, y, z); });
      break;
    case Op::kFms:
      Map3(a, b, c, r, n,
           [](float x, float y, float z) { return __builtin_fmaf(x, y, -z); });
      break;
    case Op::kFnma:
      Map3(a, b, c, r, n,
           [](float x, float y, float z) { return __builtin_fmaf(-x, y, z); });
      break;
  }
  if (instr.dtype == UpdateDType::kBF16) RoundBF16InPlace(r, n);
}

// 0: not an op.
int ArityOf(UpdateOp op) {
  const UpdateOpInfo* info = FindUpdateOp(op);
  return info == nullptr ? 0 : info->arity;
}

int32_t OperandOf(const UpdateInstr& instr, int i) {
  return i == 0 ? instr.a : i == 1 ? instr.b : instr.c;
}

Status Invalid(const std::string& message) {
  return Status(Code::kInvalidArgument, "update program: " + message);
}

// Subnormals flushed for the length of a run (the calling thread's own
// floating-point state, put back after).
class FlushDenormals {
 public:
  explicit FlushDenormals(bool on) : on_(on) {
    if (!on_) return;
#if defined(JCXL_FLUSH_MXCSR)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
#elif defined(JCXL_FLUSH_FPCR)
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    fpcr |= uint64_t{1} << 24;  // FZ: inputs and results
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr));
#endif
  }
  ~FlushDenormals() {
    if (!on_) return;
#if defined(JCXL_FLUSH_MXCSR)
    _mm_setcsr(static_cast<unsigned>(saved_));
#elif defined(JCXL_FLUSH_FPCR)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  bool on_;
  uint64_t saved_ = 0;
};

// This thread's register file: grown to the largest program it ran, kept
// for the next run (a run calls RunUpdateRange once per block).
float* Registers(size_t floats) {
  struct Deleter {
    void operator()(float* p) const { free(p); }
  };
  thread_local std::unique_ptr<float, Deleter> memory;
  thread_local size_t capacity = 0;
  if (floats > capacity) {
    const size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
    memory.reset(static_cast<float*>(aligned_alloc(64, bytes)));
    capacity = memory ? floats : 0;
  }
  return memory.get();
}

// What one call runs: which registers are scalars (and their values),
// which are live, where each vector register's chunk lives.
struct Plan {
  explicit Plan(const UpdateProgram& program,
                const std::vector<UpdateArray>& in,
                const std::vector<UpdateArray>& out, const float* scalars);

  const UpdateProgram& program;
  int num_inputs;
  int num_regs;
  std::vector<char> scalar;   // per register
  std::vector<char> live;     // per register
  std::vector<char> in_place;  // per input: read straight from the object
  std::vector<float> value;   // scalar registers' values
  std::vector<int> slot;      // per register: its chunk, -1 if none
  // Scalar operands of vector select and clamp, filled into a chunk each
  // (binary ops read theirs as one float).
  std::vector<int> broadcast;
  std::vector<Broadcast> which;  // per instruction: a binary op's scalar
  int scratch_slot = -1;      // kIntPow's running square
  int num_slots = 0;
};

Plan::Plan(const UpdateProgram& p, const std::vector<UpdateArray>& in,
           const std::vector<UpdateArray>& out, const float* scalars)
    : program(p),
      num_inputs(static_cast<int>(p.inputs.size())),
      num_regs(static_cast<int>(p.inputs.size() + p.code.size())),
      scalar(num_regs, 0),
      live(num_regs, 0),
      in_place(num_inputs, 0),
      value(num_regs, 0.0f),
      slot(num_regs, -1),
      which(p.code.size(), kNone) {
  using Kind = UpdateInput::Kind;
  for (int i = 0; i < num_inputs; ++i) {
    scalar[i] = p.inputs[i].kind != Kind::kObject;
  }
  for (size_t i = 0; i < p.code.size(); ++i) {
    const UpdateInstr& instr = p.code[i];
    bool all = true;
    for (int k = 0; k < ArityOf(instr.op); ++k) {
      all = all && scalar[OperandOf(instr, k)];
    }
    scalar[num_inputs + i] = all;
  }
  // Liveness, backwards from the outputs: dead code never runs, and an
  // input nothing reads is never loaded.
  for (const UpdateOutput& o : p.outputs) live[o.reg] = 1;
  for (int i = static_cast<int>(p.code.size()) - 1; i >= 0; --i) {
    if (!live[num_inputs + i]) continue;
    const UpdateInstr& instr = p.code[i];
    for (int k = 0; k < ArityOf(instr.op); ++k) live[OperandOf(instr, k)] = 1;
  }
  // Scalar registers: computed once, by the same loops as vectors.
  float unused = 0;
  for (int r = 0; r < num_regs; ++r) {
    if (!scalar[r] || !live[r]) continue;
    if (r < num_inputs) {
      const UpdateInput& input = p.inputs[r];
      value[r] = input.kind == Kind::kConstant ? input.constant
                                               : scalars[input.scalar_index];
      continue;
    }
    const UpdateInstr& instr = p.code[r - num_inputs];
    const int arity = ArityOf(instr.op);
    Apply(instr, &value[instr.a], arity > 1 ? &value[instr.b] : nullptr,
          arity > 2 ? &value[instr.c] : nullptr, &value[r], &unused, 1,
          kNone, p.flush_denormals);
  }
  // An f32 input is read in place unless an output copies it, unchanged,
  // into another array while some output overwrites it: outputs are
  // written one after the other, so it would be read after being written.
  for (int i = 0; i < num_inputs; ++i) {
    if (scalar[i] || !live[i] || in[i].dtype != UpdateDType::kF32) continue;
    bool copied_elsewhere = false, overwritten = false;
    for (size_t o = 0; o < p.outputs.size(); ++o) {
      if (out[o].data == in[i].data) overwritten = true;
      if (p.outputs[o].reg == i && out[o].data != in[i].data) {
        copied_elsewhere = true;
      }
    }
    in_place[i] = !(copied_elsewhere && overwritten);
  }
  // Register allocation: a chunk per live vector register, reused once its
  // last reader ran (outputs read theirs at the end of the chunk).
  std::vector<int> last_use(num_regs, -1);
  std::vector<char> ternary_operand(num_regs, 0);
  for (size_t i = 0; i < p.code.size(); ++i) {
    if (!live[num_inputs + i] || scalar[num_inputs + i]) continue;
    const UpdateInstr& instr = p.code[i];
    const int arity = ArityOf(instr.op);
    for (int k = 0; k < arity; ++k) {
      last_use[OperandOf(instr, k)] = static_cast<int>(i);
      if (arity == 3) ternary_operand[OperandOf(instr, k)] = 1;
    }
    if (arity == 2) {
      which[i] = scalar[instr.a] ? kScalarA : scalar[instr.b] ? kScalarB
                                                               : kNone;
    }
  }
  for (const UpdateOutput& o : p.outputs) last_use[o.reg] = INT_MAX;
  std::vector<int> free_slots;
  auto take = [&] {
    if (free_slots.empty()) return num_slots++;
    const int s = free_slots.back();
    free_slots.pop_back();
    return s;
  };
  for (int r = 0; r < num_regs; ++r) {
    if (scalar[r] && live[r] && ternary_operand[r]) {
      broadcast.push_back(r);
      slot[r] = take();
    }
  }
  for (size_t i = 0; i < p.code.size(); ++i) {
    if (live[num_inputs + i] && !scalar[num_inputs + i] &&
        p.code[i].op == UpdateOp::kIntPow) {
      scratch_slot = take();
      break;
    }
  }
  for (int i = 0; i < num_inputs; ++i) {
    if (!scalar[i] && live[i] && !in_place[i]) slot[i] = take();
  }
  for (size_t i = 0; i < p.code.size(); ++i) {
    const int r = num_inputs + static_cast<int>(i);
    if (!live[r] || scalar[r]) continue;
    slot[r] = take();  // before its operands' are freed: never aliased
    const UpdateInstr& instr = p.code[i];
    for (int k = 0; k < ArityOf(instr.op); ++k) {
      const int operand = OperandOf(instr, k);
      bool seen = false;  // x * x frees x once
      for (int j = 0; j < k; ++j) seen = seen || OperandOf(instr, j) == operand;
      if (!seen && !scalar[operand] && slot[operand] >= 0 &&
          last_use[operand] == static_cast<int>(i)) {
        free_slots.push_back(slot[operand]);
      }
    }
  }
}

}  // namespace

const char* UpdateOpName(UpdateOp op) {
  const UpdateOpInfo* info = FindUpdateOp(op);
  return info == nullptr ? "?" : info->name;
}

Status ValidateUpdateProgram(const UpdateProgram& program) {
  using Kind = UpdateInput::Kind;
  if (program.num_elements < 0) {
    return Invalid("num_elements must be >= 0, got " +
                   std::to_string(program.num_elements));
  }
  if (program.num_scalars < 0) {
    return Invalid("num_scalars must be >= 0, got " +
                   std::to_string(program.num_scalars));
  }
  const int64_t num_inputs = static_cast<int64_t>(program.inputs.size());
  const int64_t num_regs =
      num_inputs + static_cast<int64_t>(program.code.size());
  if (num_regs > kMaxUpdateRegisters) {
    return Invalid("has " + std::to_string(num_regs) +
                   " registers (inputs + instructions); at most " +
                   std::to_string(kMaxUpdateRegisters) + " are allowed");
  }
#if !defined(JCXL_FLUSH_MXCSR) && !defined(JCXL_FLUSH_FPCR)
  if (program.flush_denormals) {
    return Invalid("flush_denormals is not supported on this CPU");
  }
#endif
  std::vector<char> scalar(num_regs, 0);
  for (int64_t i = 0; i < num_inputs; ++i) {
    const UpdateInput& input = program.inputs[i];
    const std::string where = "input " + std::to_string(i);
    switch (input.kind) {
      case Kind::kObject:
        break;
      case Kind::kScalar:
        if (input.scalar_index < 0 ||
            input.scalar_index >= program.num_scalars) {
          return Invalid(where + ": scalar_index " +
                         std::to_string(input.scalar_index) +
                         " is not in [0, num_scalars = " +
                         std::to_string(program.num_scalars) + ")");
        }
        scalar[i] = 1;
        break;
      case Kind::kConstant:
        scalar[i] = 1;
        break;
      default:
        return Invalid(where + ": unknown kind " +
                       std::to_string(static_cast<int32_t>(input.kind)) +
                       " (0: object, 1: scalar, 2: constant)");
    }
  }
  for (size_t i = 0; i < program.code.size(); ++i) {
    const UpdateInstr& instr = program.code[i];
    const int64_t reg = num_inputs + static_cast<int64_t>(i);
    const int arity = ArityOf(instr.op);
    const std::string where = "instruction " + std::to_string(i) +
                              " (register " + std::to_string(reg) + ")";
    if (arity == 0) {
      return Invalid(where + ": unknown op " +
                     std::to_string(static_cast<int32_t>(instr.op)) +
                     " (ops are 0.." + std::to_string(kNumUpdateOps - 1) +
                     ")");
    }
    if (instr.dtype != UpdateDType::kF32 && instr.dtype != UpdateDType::kBF16 &&
        instr.dtype != UpdateDType::kBool) {
      return Invalid(where + ": unknown dtype " +
                     std::to_string(static_cast<int32_t>(instr.dtype)) +
                     " (0: f32, 1: bf16, 2: bool)");
    }
    bool all_scalar = true;
    for (int k = 0; k < arity; ++k) {
      const int32_t operand = OperandOf(instr, k);
      if (operand < 0 || operand >= reg) {
        return Invalid(where + ": " + UpdateOpName(instr.op) + " takes " +
                       std::to_string(arity) + " operand" +
                       (arity > 1 ? "s" : "") + "; operand " + "abc"[k] +
                       " = " + std::to_string(operand) +
                       " is not an earlier register (0.." +
                       std::to_string(reg - 1) + ")");
      }
      all_scalar = all_scalar && scalar[operand];
    }
    scalar[reg] = all_scalar;
  }
  std::vector<std::pair<int32_t, size_t>> written;
  for (size_t o = 0; o < program.outputs.size(); ++o) {
    const UpdateOutput& output = program.outputs[o];
    const std::string where = "output " + std::to_string(o);
    if (output.reg < 0 || output.reg >= num_regs) {
      return Invalid(where + ": register " + std::to_string(output.reg) +
                     " does not exist (0.." + std::to_string(num_regs - 1) +
                     ")");
    }
    if (scalar[output.reg]) {
      return Invalid(where + ": register " + std::to_string(output.reg) +
                     " is a scalar (it depends on no object); outputs must "
                     "be vector registers");
    }
    for (const auto& [handle, other] : written) {
      if (handle == output.handle) {
        return Invalid(where + " and output " + std::to_string(other) +
                       " both write handle " + std::to_string(handle));
      }
    }
    written.emplace_back(output.handle, o);
  }
  return Status::Ok();
}

std::vector<bool> UpdateInputsRead(const UpdateProgram& program) {
  const size_t num_inputs = program.inputs.size();
  std::vector<char> live(num_inputs + program.code.size(), 0);
  for (const UpdateOutput& o : program.outputs) live[o.reg] = 1;
  for (size_t i = program.code.size(); i-- > 0;) {
    if (!live[num_inputs + i]) continue;
    const UpdateInstr& instr = program.code[i];
    for (int k = 0; k < ArityOf(instr.op); ++k) live[OperandOf(instr, k)] = 1;
  }
  std::vector<bool> read(num_inputs);
  for (size_t i = 0; i < num_inputs; ++i) {
    read[i] = live[i] &&
              program.inputs[i].kind == UpdateInput::Kind::kObject;
  }
  return read;
}

namespace {

// Elements [begin, end) chunk by chunk; `reg` holds the scalar registers'
// pointers already.
JCXL_INLINE void RunChunksInline(const UpdateProgram& program,
                                 const Plan& plan,
                                 const std::vector<UpdateArray>& in,
                                 const std::vector<UpdateArray>& out,
                                 float* regs, std::vector<const float*>& reg,
                                 int64_t begin, int64_t end) {
  auto chunk_of = [&](int slot) { return regs + size_t(slot) * kSlotStride; };
  float* scratch =
      plan.scratch_slot >= 0 ? chunk_of(plan.scratch_slot) : nullptr;
  const int num_inputs = plan.num_inputs;
  for (int64_t first = begin; first < end; first += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, end - first));
    // The inputs of a chunk ahead start coming from memory while this one
    // computes (the hardware prefetcher idles through the divisions).
    const int64_t ahead = first + kPrefetchChunks * kChunk;
    if (ahead < end) {
      const int64_t count = std::min<int64_t>(kChunk, end - ahead);
      for (int i = 0; i < num_inputs; ++i) {
        if (plan.scalar[i] || !plan.live[i]) continue;
        const size_t item = in[i].dtype == UpdateDType::kF32 ? 4 : 2;
        const char* from = static_cast<const char*>(in[i].data) + ahead * item;
        for (size_t b = 0; b < count * item; b += 64) {
          __builtin_prefetch(from + b, 0, 1);
        }
      }
    }
    // Every input of the chunk is read before any output is written.
    for (int i = 0; i < num_inputs; ++i) {
      if (plan.scalar[i] || !plan.live[i]) continue;
      if (in[i].dtype == UpdateDType::kF32) {
        const float* src = static_cast<const float*>(in[i].data) + first;
        if (plan.in_place[i]) {
          reg[i] = src;
        } else {
          std::memcpy(chunk_of(plan.slot[i]), src, sizeof(float) * n);
          reg[i] = chunk_of(plan.slot[i]);
        }
      } else {
        const uint16_t* src = static_cast<const uint16_t*>(in[i].data) + first;
        float* dst = chunk_of(plan.slot[i]);
        for (int k = 0; k < n; ++k) dst[k] = FromBF16(src[k]);
        reg[i] = dst;
      }
    }
    for (size_t i = 0; i < program.code.size(); ++i) {
      const int r = num_inputs + static_cast<int>(i);
      if (!plan.live[r] || plan.scalar[r]) continue;
      const UpdateInstr& instr = program.code[i];
      const int arity = ArityOf(instr.op);
      float* result = chunk_of(plan.slot[r]);
      Apply(instr, reg[instr.a], arity > 1 ? reg[instr.b] : nullptr,
            arity > 2 ? reg[instr.c] : nullptr, result, scratch, n,
            plan.which[i], program.flush_denormals);
      reg[r] = result;
    }
    for (size_t o = 0; o < program.outputs.size(); ++o) {
      const int r = program.outputs[o].reg;
      if (r < num_inputs && in[r].data == out[o].data &&
          in[r].dtype == out[o].dtype) {
        continue;  // an object written back unchanged
      }
      if (out[o].dtype == UpdateDType::kF32) {
        std::memcpy(static_cast<float*>(out[o].data) + first, reg[r],
                    sizeof(float) * n);
      } else {
        uint16_t* dst = static_cast<uint16_t*>(out[o].data) + first;
        const float* src = reg[r];
        for (int k = 0; k < n; ++k) dst[k] = ToBF16(src[k]);
      }
    }
  }
}

void RunChunksBaseline(const UpdateProgram& program, const Plan& plan,
                       const std::vector<UpdateArray>& in,
                       const std::vector<UpdateArray>& out, float* regs,
                       std::vector<const float*>& reg, int64_t begin,
                       int64_t end) {
  RunChunksInline(program, plan, in, out, regs, reg, begin, end);
}

#if defined(JCXL_AVX2_CLONE)
__attribute__((target("avx2,fma"))) void RunChunksAvx2(
    const UpdateProgram& program, const Plan& plan,
    const std::vector<UpdateArray>& in, const std::vector<UpdateArray>& out,
    float* regs, std::vector<const float*>& reg, int64_t begin, int64_t end) {
  RunChunksInline(program, plan, in, out, regs, reg, begin, end);
}

bool HasAvx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0 &&
           __builtin_cpu_supports("fma") != 0;
  }();
  return has;
}
#endif

void RunChunks(const UpdateProgram& program, const Plan& plan,
               const std::vector<UpdateArray>& in,
               const std::vector<UpdateArray>& out, float* regs,
               std::vector<const float*>& reg, int64_t begin, int64_t end) {
#if defined(JCXL_AVX2_CLONE)
  if (HasAvx2()) {
    RunChunksAvx2(program, plan, in, out, regs, reg, begin, end);
    return;
  }
#endif
  RunChunksBaseline(program, plan, in, out, regs, reg, begin, end);
}

}  // namespace

void RunUpdateRange(const UpdateProgram& program,
                    const std::vector<UpdateArray>& in,
                    const std::vector<UpdateArray>& out, const float* scalars,
                    int64_t begin, int64_t end) {
  if (end <= begin || in.size() != program.inputs.size() ||
      out.size() != program.outputs.size()) {
    return;
  }
  FlushDenormals flush(program.flush_denormals);
  const Plan plan(program, in, out, scalars);
  float* regs = Registers(static_cast<size_t>(plan.num_slots) * kSlotStride);
  if (regs == nullptr && plan.num_slots > 0) std::abort();  // out of memory
  std::vector<const float*> reg(plan.num_regs, nullptr);
  for (int r = 0; r < plan.num_regs; ++r) {
    if (plan.scalar[r]) reg[r] = &plan.value[r];
  }
  for (int r : plan.broadcast) {
    float* chunk = regs + size_t(plan.slot[r]) * kSlotStride;
    std::fill(chunk, chunk + kChunk, plan.value[r]);
    reg[r] = chunk;
  }
  RunChunks(program, plan, in, out, regs, reg, begin, end);
}

}  // namespace jcxl
