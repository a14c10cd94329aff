#pragma once
// Compute kernels: what a plan's compute step runs on a chunk (the DSL's ChunkRef::apply), found
// by name in one registry of the process. Built in: "identity" and "scale" (scalar "factor");
// user code registers its own before it builds or loads plans that name them. Plans in JSON name
// kernels, so a plan file works in any process that registered the same names.
//
// Public and self-contained (standard headers and tutti/types.hpp only).
//
// A kernel maps `inputs` chunk ranges to `outputs` ones of equal length on one rank, any of them in
// place: every input is read before outputs are written, from the kernel's point of view (a kernel
// whose outputs alias its inputs must compute element by element, as AdamW does). Kernels run on
// host memory with `cpu`; on device memory the device interpreter runs the kernel's `device`
// routine, one of a fixed set built into the interpreter (DeviceKernel): every fused operation's
// kernels have one. A user kernel gets a device form by giving an element-wise program
// (ElementProgram: each output element an expression of the same element of the inputs and of the
// scalars), which the interpreter evaluates (DeviceKernel::kElementwise) and which also serves as
// its CPU form when it gives no other. Arbitrary user device code is not supported: calling it from
// the precompiled interpreter would need relocatable device code linked across libraries
// (docs/ARCHITECTURE.md). A plan naming a kernel without a device form runs on host buffers only,
// and the device executor says so by its name.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tutti/types.hpp"

namespace tutti {

struct KernelArgs {
  const void* const* inputs;  // KernelDef::inputs pointers, `count` elements of `type` each
  void* const* outputs;       // KernelDef::outputs pointers; any may equal an input (in place)
  int64_t count;              // elements of input 0
  DataType type;
  const double* scalars;      // the step's values of the kernel's scalars, in declared order
  // Elements of each operand: equal to `count` except for operands in state buffers with a unit of
  // their own (a statistic: a sum of squares has one element per chunk). Null: all are `count`.
  const int64_t* input_counts = nullptr;
  const int64_t* output_counts = nullptr;
  // Where input 0 starts in its buffer, in elements: position-dependent kernels (a dropout mask,
  // rows of a matrix) see the same positions however the plan cuts the buffer into chunks.
  int64_t offset = 0;
  // The definition being run (set by the executors): an element-wise kernel's CPU form reads its
  // program there.
  const struct KernelDef* kernel = nullptr;
};
using KernelFn = void (*)(const KernelArgs&);

// The device interpreter's routines (runtime/device/kernels.hpp), each the device form of a kernel
// with the same operands, scalars and results as its CPU form. Values are the ABI's.
enum class DeviceKernel : int32_t {
  kNone = -1,
  kIdentity = 0,         // "identity"
  kScale = 1,            // "scale"
  kUnscaleSumsq = 2,     // "zero.unscale_sumsq" (tutti/fused.hpp)
  kUnscaleSumsqAcc = 3,  // "zero.unscale_sumsq_acc"
  kAdamw = 4,            // "zero.adamw"
  kAdamwMasked = 5,      // "zero.adamw_masked"
  kAdamwCast = 6,        // "zero.adamw_cast"
  kBiasDropoutResidual = 7,    // "fused.bias_dropout_residual"
  kBiasDropoutResidualLn = 8,  // "fused.bias_dropout_residual_ln"
  kGemm = 9,                   // "fused.gemm"
  kMoeGather = 10,             // "moe.gather"
  kMoeCombineFirst = 11,       // "moe.combine_first"
  kMoeCombine = 12,            // "moe.combine"
  kElementwise = 13,           // any kernel with an ElementProgram (user kernels)
};

// An element-wise program: instruction i computes value i from earlier values, an input's element,
// a scalar or a constant; output k is the value `outputs[k]`. Every value is a float32 and the
// kernels run on float32 calls only. Built by hand or with elementwise::Builder. At most 64 instructions
// (the outputs count one each) and 16 inputs and outputs: the device keeps them in a fixed array
// per thread; register_kernel refuses more, naming the kernel.
enum class ElementOp : int32_t {
  kInput = 0,   // input a's element
  kScalar = 1,  // scalar a of the kernel (constant or per-call, as the step gives it)
  kConst = 2,   // `value`
  kAdd = 3, kSub = 4, kMul = 5, kDiv = 6, kMin = 7, kMax = 8,  // value a (op) value b
  kNeg = 9, kAbs = 10, kSqrt = 11, kExp = 12, kTanh = 13,     // op(value a)
  kFma = 14,     // a * b + c, rounded once
  kSelect = 15,  // a > 0 ? b : c
};
struct ElementInstr {
  ElementOp op = ElementOp::kConst;
  int32_t a = 0, b = 0, c = 0;
  double value = 0;
};
struct ElementProgram {
  std::vector<ElementInstr> code;
  std::vector<int32_t> outputs;  // output k = the value of instruction outputs[k]
  bool empty() const { return code.empty(); }
};

// Builds an ElementProgram from expressions (in their own namespace, so that sqrt, min or max
// elsewhere in tutti keep meaning the standard ones):
//   namespace ew = tutti::elementwise;
//   ew::Builder b;
//   ew::Value y = b.input(0) + b.scalar(0);
//   b.output(y * 0.5 * (1.0 + tanh(0.7978845608 * (y + 0.044715 * y * y * y))));  // bias + GELU
//   def.element = std::move(b).build();
namespace elementwise {
class Builder;
class Value {
 public:
  int32_t index() const { return index_; }
  Builder* builder() const { return builder_; }

 private:
  friend class Builder;
  Value(Builder* b, int32_t i) : builder_(b), index_(i) {}
  Builder* builder_;
  int32_t index_;
};
class Builder {
 public:
  Value input(int k) { return push({ElementOp::kInput, k, 0, 0, 0}); }
  Value scalar(int k) { return push({ElementOp::kScalar, k, 0, 0, 0}); }
  Value constant(double v) { return push({ElementOp::kConst, 0, 0, 0, v}); }
  Value apply(ElementOp op, Value a, Value b, Value c) { return push({op, a.index(), b.index(), c.index(), 0}); }
  Value apply(ElementOp op, Value a, Value b) { return push({op, a.index(), b.index(), 0, 0}); }
  Value apply(ElementOp op, Value a) { return push({op, a.index(), 0, 0, 0}); }
  void output(Value v) { program_.outputs.push_back(v.index()); }  // outputs in order
  ElementProgram build() && { return std::move(program_); }

 private:
  Value push(ElementInstr in) {
    program_.code.push_back(in);
    return Value(this, static_cast<int32_t>(program_.code.size() - 1));
  }
  ElementProgram program_;
};
inline Value operator+(Value a, Value b) { return a.builder()->apply(ElementOp::kAdd, a, b); }
inline Value operator-(Value a, Value b) { return a.builder()->apply(ElementOp::kSub, a, b); }
inline Value operator*(Value a, Value b) { return a.builder()->apply(ElementOp::kMul, a, b); }
inline Value operator/(Value a, Value b) { return a.builder()->apply(ElementOp::kDiv, a, b); }
inline Value operator-(Value a) { return a.builder()->apply(ElementOp::kNeg, a); }
inline Value operator+(Value a, double b) { return a + a.builder()->constant(b); }
inline Value operator+(double a, Value b) { return b.builder()->constant(a) + b; }
inline Value operator-(Value a, double b) { return a - a.builder()->constant(b); }
inline Value operator-(double a, Value b) { return b.builder()->constant(a) - b; }
inline Value operator*(Value a, double b) { return a * a.builder()->constant(b); }
inline Value operator*(double a, Value b) { return b.builder()->constant(a) * b; }
inline Value operator/(Value a, double b) { return a / a.builder()->constant(b); }
inline Value operator/(double a, Value b) { return b.builder()->constant(a) / b; }
inline Value min(Value a, Value b) { return a.builder()->apply(ElementOp::kMin, a, b); }
inline Value max(Value a, Value b) { return a.builder()->apply(ElementOp::kMax, a, b); }
inline Value abs(Value a) { return a.builder()->apply(ElementOp::kAbs, a); }
inline Value sqrt(Value a) { return a.builder()->apply(ElementOp::kSqrt, a); }
inline Value exp(Value a) { return a.builder()->apply(ElementOp::kExp, a); }
inline Value tanh(Value a) { return a.builder()->apply(ElementOp::kTanh, a); }
inline Value fma(Value a, Value b, Value c) { return a.builder()->apply(ElementOp::kFma, a, b, c); }
inline Value select(Value cond, Value if_positive, Value otherwise) {
  return cond.builder()->apply(ElementOp::kSelect, cond, if_positive, otherwise);
}
}  // namespace elementwise

struct KernelDef {
  std::string name;                  // unique in the process: letters, digits, '_', '.', '-'
  std::vector<std::string> scalars;  // names of the scalars a step gives it
  KernelFn cpu = nullptr;            // required
  // The simulator's cost: this many times the time of copying output 0's bytes.
  double copy_cost = 1.0;
  int inputs = 1, outputs = 1;  // chunk operands it reads and writes (at least 1 each)
  // Optional: the cost for a step's constant scalars (per-call ones read as 0), for kernels whose
  // work per byte depends on them (a GEMM's grows with its inner size). Null: copy_cost.
  double (*cost_of)(const double* scalars) = nullptr;
  // Whether its operands may lie in buffers of different units (a statistic, a bias row: state
  // buffers with a unit of their own). Such a kernel reads each operand's length from
  // KernelArgs::input_counts / output_counts and must check them; the others get operands of one
  // unit only (the verifier and the DSL refuse the rest), so `count` is every operand's length.
  bool mixed_units = false;
  // Its device form, if the interpreter has one.
  DeviceKernel device = DeviceKernel::kNone;
  // A user kernel's device form, and its CPU form when `cpu` is null: register_kernel checks it
  // against inputs, outputs and scalars and sets `device` to kElementwise.
  ElementProgram element{};
  // Optional: the CPU form as an epilogue streamed over a reduction's receive. Where a plan has a
  // reducing receive that stores a chunk (recv_reduce_copy) and, right after it (in its block or by
  // a dependency), a compute step of this kernel rewriting that chunk in place as its first input
  // and output, the CPU executor runs the kernel on each range of the chunk right after the receive
  // has combined it, while the range is in L1, so the epilogue costs no pass over the chunk of its
  // own; the compute step then only finishes it. Only for kernels that rewrite input 0 in place as
  // output 0, element by element in order, and whose other operands are statistics or constants.
  //
  // For one chunk, in this order: a first call with the empty range [0, 0) when the receive starts
  // (check the operands there: a throw fails the call, as one from `cpu` does, but is reported at
  // the receive); then ranges [from, to), each `to` a multiple of 64 elements, from inside the
  // transport's progress on the thread that drives the receive's connection (these calls must not
  // throw: an error there reads as a broken connection); then, when the compute step itself runs
  // (its dependencies met, possibly on another worker thread, after the receive is done), one call
  // with `last` and the rest of the chunk, [from, count), possibly empty. Only that call may read
  // or write any operand other than the chunk's range. `state` holds `stream_state` bytes, zeroed
  // before the first call and kept across the calls (a running sum, a carry). `a` is the step's
  // arguments as `cpu` gets them. The results must equal `cpu`'s, bit for bit, however the chunk is
  // cut: the executor decides where to stream (TUTTI_STREAM_EPILOGUES=0 turns it off).
  void (*stream)(const KernelArgs& a, void* state, int64_t from, int64_t to, bool last) = nullptr;
  size_t stream_state = 0;
};

// A kernel's scalar as a plan holds it: a constant, or slot `slot` of the values each call passes
// (ExecArgs::scalars), so one cached plan runs with a new learning rate or step at every call.
struct ScalarArg {
  double value = 0;
  int slot = -1;  // >= 0: the call's value in this slot
  ScalarArg() = default;
  ScalarArg(double v) : value(v) {}  // NOLINT(google-explicit-constructor): a constant is a scalar
  static ScalarArg per_call(int slot) {
    ScalarArg s;
    s.slot = slot;
    return s;
  }
  bool operator==(const ScalarArg&) const = default;
  auto operator<=>(const ScalarArg&) const = default;
};

using KernelId = int32_t;
namespace kernels {
inline constexpr KernelId kIdentity = 0;  // output = input
inline constexpr KernelId kScale = 1;     // output = input * factor (the element type's product)
}  // namespace kernels

// Thread-safe. Throws InvalidArgument naming the kernel for an empty or malformed name, a name
// already registered, no CPU implementation (and no element-wise program to serve as one), or an
// element-wise program that does not fit its inputs, outputs and scalars (naming the instruction).
KernelId register_kernel(KernelDef def);
std::optional<KernelId> find_kernel(std::string_view name);
// Throws InvalidArgument for an id no kernel has.
const KernelDef& kernel_def(KernelId id);

}  // namespace tutti
