#pragma once
// The optimizer's element loops, vectorised with Highway for the CPU the process runs on. The
// fused ZeRO step's kernels and its unfused reference both call them, on the same pieces, so the
// two agree bit for bit.

#include <cstdint>

namespace tutti::fused {

// out = in * scale (out may be in); returns the sum of the squares of out, accumulated in double.
double unscale_square(float* out, const float* in, int64_t n, float scale);

// One AdamW update of n elements with the gradient multiplied by `clip` (outputs may be inputs):
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2;
//   p = p * decay - step_size * m / (sqrt(v) / c2_sqrt + eps)
// with step_size = lr / (1 - beta1^step), c2_sqrt = sqrt(1 - beta2^step), decay = 1 - lr * wd
// (torch.optim.AdamW's update).
struct AdamwArgs {
  const float *g, *m_in, *v_in, *p_in;
  float *m, *v, *p;
  float clip, beta1, beta2, eps, decay, step_size, c2_sqrt;
};
void adamw_update(const AdamwArgs& args, int64_t n);

}  // namespace tutti::fused
