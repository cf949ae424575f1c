// Elementwise update programs: an optimizer's update of one layer (adam,
// adamw, sgd with momentum, lion, ... as optax traces them), taken by jcxl
// from the step's jaxpr and run on the host CPU in place on pool objects
// (the "near-memory" update: only weights in and gradients out cross the
// device link).
//
// A program is straight-line code over registers. Every register is either
// a vector of the chunk being processed (float lanes) or a scalar (one
// float broadcast to every lane). Registers [0, inputs.size()) are the
// program's inputs, in order; instruction i writes register
// inputs.size() + i. Values are computed in float32; an instruction whose
// `dtype` is kBF16 rounds its result to bfloat16 (round to nearest even),
// as XLA:CPU computes bfloat16 arithmetic. Booleans are 0.0f / 1.0f.
//
// The arithmetic is IEEE float32 with no fast-math contraction, so a
// program matches XLA:CPU's evaluation of the same jaxpr bit for bit where
// XLA does the same operations (add, sub, mul, div, sqrt, min, max, ...).
//
// Where XLA:CPU does other operations (jaxlib 0.10 on an x86 CPU with FMA,
// measured in tests/host_update_kernel_test.py): it contracts a*b + c into
// one FMA, rewrites a / s (s a broadcast scalar) as a * (1 / s), computes
// rsqrt from a hardware estimate, and flushes subnormals. Under XLA_FLAGS=
// "--xla_cpu_max_isa=AVX --xla_disable_hlo_passes=algsimp" (and
// flush_denormals below) it computes adam bit for bit as a program does.
#ifndef JCXL_FFI_UPDATE_PROGRAM_H_
#define JCXL_FFI_UPDATE_PROGRAM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "status.h"
#include "update_ops.h"

namespace jcxl {

enum class UpdateDType : int32_t { kF32 = 0, kBF16 = 1, kBool = 2 };

// Operations, by the name of the JAX primitive they implement (the table
// and what each op computes: update_ops.h). Operands a, b, c are register
// numbers (-1: unused).
enum class UpdateOp : int32_t {
#define JCXL_UPDATE_OP_ENUMERATOR(name, code, primitive, arity, traced) \
  k##name = code,
  JCXL_UPDATE_OPS(JCXL_UPDATE_OP_ENUMERATOR)
#undef JCXL_UPDATE_OP_ENUMERATOR
};

// One row of the table of ops (update_ops.h).
struct UpdateOpInfo {
  UpdateOp op;
  const char* enumerator;  // "IntPow" (UpdateOp::kIntPow)
  const char* name;        // "integer_pow"
  int arity;               // operands read: 1, 2 or 3
  bool traced;             // a jaxpr's primitive `name` maps to it
};

// Every op, in code order (codes are 0 .. kNumUpdateOps - 1).
inline constexpr UpdateOpInfo kUpdateOps[] = {
#define JCXL_UPDATE_OP_INFO(name, code, primitive, arity, traced) \
  {UpdateOp::k##name, #name, primitive, arity, traced != 0},
    JCXL_UPDATE_OPS(JCXL_UPDATE_OP_INFO)
#undef JCXL_UPDATE_OP_INFO
};
inline constexpr int32_t kNumUpdateOps =
    static_cast<int32_t>(sizeof(kUpdateOps) / sizeof(kUpdateOps[0]));

namespace internal {
constexpr bool UpdateOpsAreDense() {
  for (int32_t i = 0; i < kNumUpdateOps; ++i) {
    if (static_cast<int32_t>(kUpdateOps[i].op) != i) return false;
    if (kUpdateOps[i].arity < 1 || kUpdateOps[i].arity > 3) return false;
  }
  return true;
}
}  // namespace internal
static_assert(internal::UpdateOpsAreDense(),
              "update_ops.h: codes must be 0, 1, 2, ... in table order and "
              "arities 1, 2 or 3");

// The table's row of `op`, or nullptr when it is not an op (a program's
// op comes from outside as an int).
constexpr const UpdateOpInfo* FindUpdateOp(UpdateOp op) {
  const int32_t code = static_cast<int32_t>(op);
  return code >= 0 && code < kNumUpdateOps ? &kUpdateOps[code] : nullptr;
}

struct UpdateInstr {
  UpdateOp op = UpdateOp::kCopy;
  int32_t a = -1, b = -1, c = -1;
  UpdateDType dtype = UpdateDType::kF32;  // the result's
  int32_t imm = 0;                        // kIntPow's exponent
};

// An input register: a pool object read element by element, a scalar given
// at each run (the step's learning rate, bias corrections, clip scale: they
// change every step), or a constant of the program.
struct UpdateInput {
  enum class Kind : int32_t { kObject = 0, kScalar = 1, kConstant = 2 };
  Kind kind = Kind::kObject;
  int32_t handle = 0;        // kObject: the pool object (f32 or bf16)
  int32_t scalar_index = 0;  // kScalar: index into each run's scalars
  float constant = 0;        // kConstant
};

// An output: a register written into a pool object, converted to the
// object's dtype. An object may be both read and written (in place): each
// chunk is read before any of its outputs is written.
struct UpdateOutput {
  int32_t reg = 0;
  int32_t handle = 0;
};

struct UpdateProgram {
  int64_t num_elements = 0;  // of every object the program reads or writes
  int32_t num_scalars = 0;   // floats each run passes
  std::vector<UpdateInput> inputs;
  std::vector<UpdateInstr> code;
  std::vector<UpdateOutput> outputs;
  // Subnormal operands read as zero and subnormal results become zero
  // (x86 DAZ + FTZ), as XLA:CPU computes (its threads run so). Off: IEEE
  // subnormals, as numpy and XLA:GPU (without --xla_gpu_ftz) compute.
  // Conversions (bf16 <-> f32, loads, stores) never flush.
  bool flush_denormals = false;
};

// The most registers (inputs plus instructions) a program may have.
constexpr int64_t kMaxUpdateRegisters = int64_t{1} << 14;

// Checks a program's structure: operands name earlier registers, ops and
// dtypes are known, outputs are vector registers, scalar indices lie in
// [0, num_scalars). Object handles are checked by the pool.
Status ValidateUpdateProgram(const UpdateProgram& program);

// Per input register: whether running the program reads it (an input that
// no live instruction or output uses is never read). `program` must be
// valid.
std::vector<bool> UpdateInputsRead(const UpdateProgram& program);

// The name of an op as the JAX primitive's ("add", "integer_pow", ...);
// "?" for a value that is not an op.
const char* UpdateOpName(UpdateOp op);

// One array a run reads or writes, resolved by the pool to memory.
struct UpdateArray {
  void* data = nullptr;
  UpdateDType dtype = UpdateDType::kF32;  // kF32 or kBF16
};

// Runs `program` on elements [begin, end) of its arrays: `in` per input
// register (kObject inputs only are read; others ignored), `out` per
// output. Single-threaded; the caller splits the range over threads.
// `scalars` holds program.num_scalars floats. `program` must be valid
// (ValidateUpdateProgram); arrays are either the same array or disjoint.
void RunUpdateRange(const UpdateProgram& program,
                    const std::vector<UpdateArray>& in,
                    const std::vector<UpdateArray>& out, const float* scalars,
                    int64_t begin, int64_t end);

}  // namespace jcxl

#endif  // JCXL_FFI_UPDATE_PROGRAM_H_
