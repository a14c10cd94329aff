#pragma once
// The optimizer's element loops, vectorised with Highway for the CPU the process runs on. The
// fused ZeRO step's kernels and its unfused reference both call them, on the same pieces, so the
// two agree bit for bit.

#include <cstddef>
#include <cstdint>

namespace tutti::fused {

// out = in * scale (out may be in); returns the sum of the squares of out, accumulated in double.
double unscale_square(float* out, const float* in, int64_t n, float scale);

// unscale_square over a chunk cut into consecutive pieces (a streamed epilogue, KernelDef::stream):
// `acc` holds unscale_square_state_bytes() bytes, zero before the first piece; every piece but the
// last is a multiple of kSquareGroup elements. Returns, on the last piece, what unscale_square returns for
// the whole chunk, bit for bit; 0 before.
inline constexpr int64_t kSquareGroup = 64;
size_t unscale_square_state_bytes();
double unscale_square_piece(float* out, const float* in, int64_t n, float scale, double* acc, bool last);

// The sum of squares of x in double, accumulated as unscale_square does (the same double for the
// same floats): the unfused norm pass.
double sum_squares(const float* x, int64_t n);

// x *= factor in place; returns whether every result is finite (the unscale + non-finite check pass
// of a loss scaler, torch._amp_foreach_non_finite_check_and_unscale_'s).
bool scale_check(float* x, int64_t n, float factor);

// out[i] = in[i] rounded to bfloat16 (nearest even; core/element.hpp's conversion).
void to_bf16(uint16_t* out, const float* in, int64_t n);

// One AdamW update of n elements with the gradient multiplied by `clip` (outputs may be inputs):
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2;
//   p = p * decay - step_size * (m / (sqrt(v) / c2_sqrt + eps))
// with step_size = lr / (1 - beta1^step), c2_sqrt = sqrt(1 - beta2^step), decay = 1 - lr * wd
// (torch.optim.AdamW's update).
struct AdamwArgs {
  const float *g, *m_in, *v_in, *p_in;
  float *m, *v, *p;
  float clip, beta1, beta2, eps, decay, step_size, c2_sqrt;
  // Per-parameter weight decay: decay_i = 1 - lr_wd * decay_mask[i] replaces `decay` (null: not used).
  const float* decay_mask = nullptr;
  float lr_wd = 0;
};
void adamw_update(const AdamwArgs& args, int64_t n);

}  // namespace tutti::fused
