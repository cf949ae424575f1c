// The one table of update-program operations (update_program.h). Every
// list of ops derives from it: the UpdateOp enum, each op's name and arity,
// the executor's validation, and the Python side's UpdateOp and its map of
// JAX primitives (through the extension's update_ops(), see module.cc).
// Adding an op is one line here plus its kernel, a case of Apply in
// update_program.cc (built with -Werror=switch: a missing one fails to
// compile).
//
// X(Name, code, "name", arity, traced):
//   Name    the enumerator (UpdateOp::kName; Python: UpdateOp.NAME with
//           words split by '_', as INT_POW)
//   code    its value, 0, 1, 2, ... in table order (programs carry it)
//   "name"  the JAX primitive it implements, or its own name
//   arity   operands a, b, c it reads (1, 2 or 3)
//   traced  1: a jaxpr's equation of primitive "name" maps to it; 0: made
//           only by jcxl itself (the fused multiply-adds)
//
// Operands a, b, c are register numbers; booleans are 0.0f / 1.0f.
#ifndef JCXL_FFI_UPDATE_OPS_H_
#define JCXL_FFI_UPDATE_OPS_H_

// clang-format off
#define JCXL_UPDATE_OPS(X)                                                    \
  X(Add,     0, "add", 2, 1)          /* a + b */                             \
  X(Sub,     1, "sub", 2, 1)          /* a - b */                             \
  X(Mul,     2, "mul", 2, 1)          /* a * b */                             \
  X(Div,     3, "div", 2, 1)          /* a / b */                             \
  X(Max,     4, "max", 2, 1)          /* NaN if either is NaN (lax.max) */    \
  X(Min,     5, "min", 2, 1)          /* NaN if either is NaN (lax.min) */    \
  X(Neg,     6, "neg", 1, 1)          /* -a */                                \
  X(Abs,     7, "abs", 1, 1)          /* |a| */                               \
  X(Sign,    8, "sign", 1, 1)         /* -1, 0, 1; NaN, -0 stay (lax.sign) */ \
  X(Sqrt,    9, "sqrt", 1, 1)         /* sqrt(a) */                           \
  X(Rsqrt,  10, "rsqrt", 1, 1)        /* 1 / sqrt(a) */                       \
  X(Square, 11, "square", 1, 1)       /* a * a */                             \
  /* a ** imm (an integer, may be negative) by squaring, as jax lowers     */ \
  /* lax.integer_pow (x*x for 2, 1/(x**|n|) for n < 0, 1 for 0); with      */ \
  /* dtype kBF16 every product is rounded, as each is a bfloat16 op        */ \
  X(IntPow, 12, "integer_pow", 1, 1)                                          \
  X(Select, 13, "select_n", 3, 1)     /* a ? c : b (a is the predicate) */    \
  X(Clamp,  14, "clamp", 3, 1)        /* min(max(b, a), c): lo, x, hi */      \
  X(Eq,     15, "eq", 2, 1)           /* comparisons -> bool */               \
  X(Ne,     16, "ne", 2, 1)                                                   \
  X(Lt,     17, "lt", 2, 1)                                                   \
  X(Le,     18, "le", 2, 1)                                                   \
  X(Gt,     19, "gt", 2, 1)                                                   \
  X(Ge,     20, "ge", 2, 1)                                                   \
  X(And,    21, "and", 2, 1)          /* on bools */                          \
  X(Or,     22, "or", 2, 1)                                                   \
  X(Not,    23, "not", 1, 1)                                                  \
  /* a to `dtype` (f32 -> bf16 rounds; -> bool is a != 0) */                  \
  X(Convert, 24, "convert_element_type", 1, 1)                                \
  X(Copy,   25, "copy", 1, 1)         /* a */                                 \
  /* Fused multiply-adds, rounded once: XLA's loops contract a product     */ \
  /* used once into the sum that uses it on CPUs and GPUs with FMA, so     */ \
  /* programs taken from a jaxpr contract them too (the same bits).        */ \
  X(Fma,    26, "fma", 3, 0)          /* a * b + c */                         \
  X(Fms,    27, "fms", 3, 0)          /* a * b - c */                         \
  X(Fnma,   28, "fnma", 3, 0)         /* c - a * b */
// clang-format on

#endif  // JCXL_FFI_UPDATE_OPS_H_
