#pragma once
// Reduction kernels over every DataType: dst = a (op) b and the n-ary dst = (op) srcs, vectorised
// with Highway (runtime dispatch to the best instruction set of the machine).
//
// Semantics, shared with the CUDA kernels through core/element.hpp:
// - sum/prod/min/max fold left to right, rounding to the element type after every step, so a
//   chain of binary steps (what a collective does) equals one n-ary call.
// - avg and premulsum are sums with a pre- or post-step: premulsum multiplies each contribution by
//   the scalar before summing (prepare), avg divides the final sum by the number of contributions
//   (finalize). combine() treats both as sum.
// - dst may alias any source exactly; partial overlaps are not supported.
// - Pointers need no alignment; any element count works.

#include <cstddef>
#include <cstdint>
#include <span>

#include "core/datatype.hpp"

namespace tutti {

struct Reduction {
  RedOp op = RedOp::kSum;
  DataType type = DataType::kFloat32;
  // premulsum's scalar, stored in the element type (the first size_of(type) bytes are used).
  alignas(8) unsigned char scalar[8] = {};
};

// dst[i] = a[i] (op) b[i]; avg and premulsum combine as sum.
void combine(RedOp op, DataType type, void* dst, const void* a, const void* b, size_t count);

// dst[i] = srcs[0][i] (op) srcs[1][i] (op) ...; avg and premulsum combine as sum. srcs non-empty.
void combine_n(RedOp op, DataType type, void* dst, std::span<const void* const> srcs, size_t count);

// premulsum's pre-step: dst[i] = src[i] * scalar (scalar in the element type).
void scale(DataType type, void* dst, const void* src, const void* scalar, size_t count);

// avg's post-step: dst[i] = src[i] / divisor (integers truncate toward zero).
void divide(DataType type, void* dst, const void* src, uint64_t divisor, size_t count);

// The whole reduction of one set of contributions: prepare each, combine, finalize.
// Scratch-free: for premulsum, dst holds the running result.
void reduce(const Reduction& red, void* dst, std::span<const void* const> srcs, size_t count);

// Stores v as one element of `type` at dst (rounded to nearest even; integers truncate). For
// scalars (premulsum, scale kernels) and test data.
void store_value(DataType type, void* dst, double v);

// Name of the Highway target that the kernels dispatch to on this machine (e.g. "AVX3").
const char* reduce_target_name();

}  // namespace tutti
