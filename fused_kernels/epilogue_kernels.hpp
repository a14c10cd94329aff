#pragma once
// The epilogue's element loop, vectorised with Highway for the CPU the process runs on: the fused
// plan's kernel and the unfused reference both call it, and it computes, element by element, what
// the device form computes (runtime/device/kernels.hpp, bias_dropout_add), so the CPU executor, the
// emulated device and the unfused reference agree bit for bit.

#include <cstdint>

namespace tutti::fused {

// out = residual + dropout(y + bias) over `count` elements of whole rows of `hidden` (the bias's
// length). Element i's mask is device::dropout_kept(seed, first_index + i, threshold): a hash of
// its place in the whole tensor, so any split into pieces draws the same mask. A kept element is
// (y + bias) * scale, a dropped one 0; with `dropout` false nothing is dropped or scaled. out may be
// y or residual.
struct BiasDropoutArgs {
  const float *y, *bias, *residual;
  float* out;
  int64_t count, hidden;
  bool dropout;
  uint64_t seed, first_index;
  uint32_t threshold;  // of 24 uniform bits: dropped below it
  float scale;
};
void bias_dropout_add_rows(const BiasDropoutArgs& args);

// ln = LayerNorm(x) * gamma + beta over `count` elements of whole rows of `hidden`: the mean and
// the variance summed in double in device::row_sum's order (eight lanes, a fixed tree), float mean
// and reciprocal standard deviation, as the device form computes them.
void layer_norm_rows(const float* x, const float* gamma, const float* beta, float* ln, int64_t count, int64_t hidden,
                     float eps);

}  // namespace tutti::fused
