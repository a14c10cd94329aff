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
// kernels have one. Device code of user kernels is a next step (docs/ARCHITECTURE.md): a plan naming
// a kernel without one runs on host buffers only, and the device executor says so by its name.

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
};

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
// already registered, or no CPU implementation.
KernelId register_kernel(KernelDef def);
std::optional<KernelId> find_kernel(std::string_view name);
// Throws InvalidArgument for an id no kernel has.
const KernelDef& kernel_def(KernelId id);

}  // namespace tutti
