#pragma once
// The compiled form of a user kernel's element-wise program (tutti/kernel.hpp, ElementProgram) and
// the loop that runs it: one evaluator for the CPU form and for the device interpreter
// (runtime/device/kernels.hpp), host/device neutral, so the emulated device gives the CPU's floats
// bit for bit and a GPU differs only where its sqrt, exp, tanh or division round differently.
//
// Every value is a float. Per element, every instruction runs in order, each reading values of
// earlier ones; the stores come last, so an output may be an input (in place). A program holds at
// most kMaxCode instructions (stores included) and a kernel at most kMaxOperands inputs and as many
// outputs: the device evaluates in a fixed array per thread. Registration refuses more, by name.

#include <cmath>
#include <cstdint>

#include "core/element.hpp"  // TUTTI_HD

namespace tutti::element {

inline constexpr int kMaxCode = 64;
inline constexpr int kMaxOperands = 16;

// Values of ElementOp (tutti/kernel.hpp), then the store that ends a program.
enum Code : int32_t {
  kLoad = 0, kScalar = 1, kConst = 2,
  kAdd = 3, kSub = 4, kMul = 5, kDiv = 6, kMin = 7, kMax = 8,
  kNeg = 9, kAbs = 10, kSqrt = 11, kExp = 12, kTanh = 13,
  kFma = 14, kSelect = 15,
  kStore = 100,  // outputs[a][i] = value b
};

struct ElementCode {
  int32_t op = 0, a = 0, b = 0, c = 0;
  float value = 0;  // kConst
};

// outs[k][i] for i in [begin, n) step `stride` (a team's share), from ins[k][i] and the scalars.
TUTTI_HD void run_elements(const ElementCode* code, int32_t ncode, const float* const* ins, float* const* outs,
                           const double* scalars, int64_t begin, int64_t n, int64_t stride) {
  float v[kMaxCode];
  for (int64_t i = begin; i < n; i += stride) {
    for (int32_t k = 0; k < ncode && k < kMaxCode; ++k) {
      const ElementCode c = code[k];
      float r = 0;
      switch (c.op) {
        case kLoad: r = ins[c.a][i]; break;
        case kScalar: r = static_cast<float>(scalars[c.a]); break;
        case kConst: r = c.value; break;
        case kAdd: r = v[c.a] + v[c.b]; break;
        case kSub: r = v[c.a] - v[c.b]; break;
        case kMul: r = v[c.a] * v[c.b]; break;
        case kDiv: r = v[c.a] / v[c.b]; break;
        case kMin: r = v[c.b] < v[c.a] ? v[c.b] : v[c.a]; break;
        case kMax: r = v[c.a] < v[c.b] ? v[c.b] : v[c.a]; break;
        case kNeg: r = -v[c.a]; break;
        case kAbs: r = fabsf(v[c.a]); break;
        case kSqrt: r = sqrtf(v[c.a]); break;
        case kExp: r = expf(v[c.a]); break;
        case kTanh: r = tanhf(v[c.a]); break;
        case kFma: r = fmaf(v[c.a], v[c.b], v[c.c]); break;
        case kSelect: r = v[c.a] > 0 ? v[c.b] : v[c.c]; break;
        case kStore: outs[c.a][i] = v[c.b]; break;
        default: break;
      }
      v[k] = r;
    }
  }
}

}  // namespace tutti::element

#if !defined(__CUDA_ARCH__)
#include <vector>
namespace tutti {
struct KernelDef;
// The kernel's ElementProgram as the evaluator runs it: its instructions, then one store per
// output. The program was checked when the kernel was registered.
std::vector<element::ElementCode> compile_elements(const KernelDef& def);
}  // namespace tutti
#endif
