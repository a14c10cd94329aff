#pragma once
// The device forms of kernels (tutti/kernel.hpp, DeviceKernel): what a compute step of a plan runs
// in the device interpreter (runtime/device/interpreter.hpp), one team of threads over one range
// of operands. Host/device neutral, like the interpreter: compiled by nvcc for the GPU and by the
// host compiler for the emulated device.
//
// Each computes what its CPU form computes (fused_kernels/zero_step.cpp), operation by operation,
// in the same element order within an element: the emulated device's results equal the CPU's bit
// for bit (neither contracts a multiply and an add), and a GPU's differ where nvcc contracts a
// multiply and an add into one rounding (its default, kept for speed) and where its square root,
// division or pow round differently: the GPU tests compare to rounding. Sums of squares are
// accumulated in double per thread and added across the team in a fixed order, so they are deterministic on one device (not equal to
// the CPU's, whose vector lanes add in another order).
//
// Operands are checked when the plan is flattened (device_plan.cpp, check_operands): data ranges of
// `n` floats, statistics of one float.

#include <cmath>
#include <cstdint>

#include "core/element.hpp"  // TUTTI_HD, TUTTI_UNROLL
#include "core/element_program.hpp"
#include "runtime/device/abi.hpp"

namespace tutti::device {

TUTTI_HD bool finite_float(float x) { return x <= 3.402823466e38f && x >= -3.402823466e38f; }

// A user kernel's element-wise program (tutti/kernel.hpp, ElementProgram), the team's threads
// striding over the elements; the CPU form runs the same evaluator on one thread.
template <class Team>
TUTTI_HD void elementwise(const Team& team, const element::ElementCode* code, int32_t ncode, const float* const* ins,
                          float* const* outs, int64_t n, const double* scalars) {
  element::run_elements(code, ncode, ins, outs, scalars, team.rank(), n, team.size());
  team.sync();
}

// out = in * scale; *stat_out = (stat_in ? *stat_in : 0) + the sum of the squares of out
// ("zero.unscale_sumsq" and "zero.unscale_sumsq_acc"). stat_in may be stat_out.
template <class Team>
TUTTI_HD void unscale_sumsq(const Team& team, float* out, const float* in, int64_t n, float scale, float* stat_out,
                            const float* stat_in) {
  double acc = 0;
  for (int64_t i = team.rank(); i < n; i += team.size()) {
    const float x = in[i] * scale;
    out[i] = x;
    acc += static_cast<double>(x) * static_cast<double>(x);
  }
  const double sum = team.sum(acc);
  if (team.rank() == 0) *stat_out = static_cast<float>(stat_in ? static_cast<double>(*stat_in) + sum : sum);
  team.sync();
}

// One AdamW update of n elements, fused_kernels/optimizer_kernels.cpp's AdamwUpdate element by
// element: the gradient times `clip`; weight decay `decay`, or 1 - lr_wd * mask[i] with a mask.
template <class Team>
TUTTI_HD void adamw_update(const Team& team, const float* g, const float* m_in, const float* v_in, const float* p_in,
                           float* m, float* v, float* p, int64_t n, float clip, float beta1, float beta2, float eps,
                           float decay, float step_size, float c2_sqrt, const float* mask, float lr_wd) {
  const float one_b1 = 1.0f - beta1, one_b2 = 1.0f - beta2;
  for (int64_t i = team.rank(); i < n; i += team.size()) {
    const float gi = g[i] * clip;
    const float mi = m_in[i] * beta1 + gi * one_b1;
    const float vi = v_in[i] * beta2 + (gi * gi) * one_b2;
    const float denom = sqrtf(vi) / c2_sqrt + eps;
    const float dec = mask ? 1.0f - lr_wd * mask[i] : decay;
    const float pi = p_in[i] * dec - step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
  }
  team.sync();
}

// Bias corrections of AdamW's step `step` (scalars: lr, beta1, beta2, eps, weight_decay, step, ...).
struct AdamwConstants {
  float lr, beta1, beta2, eps, wd, step_size, c2_sqrt;
};
TUTTI_HD AdamwConstants adamw_constants(const double* scalars) {
  AdamwConstants k;
  k.lr = static_cast<float>(scalars[0]);
  k.beta1 = static_cast<float>(scalars[1]);
  k.beta2 = static_cast<float>(scalars[2]);
  k.eps = static_cast<float>(scalars[3]);
  k.wd = static_cast<float>(scalars[4]);
  const double step = scalars[5];
  const double c1 = 1.0 - pow(static_cast<double>(k.beta1), step);
  const double c2 = 1.0 - pow(static_cast<double>(k.beta2), step);
  k.step_size = static_cast<float>(static_cast<double>(k.lr) / c1);
  k.c2_sqrt = static_cast<float>(sqrt(c2));
  return k;
}

// "zero.adamw": AdamW with the gradient clipped by the global norm sqrt(total), torch.optim.AdamW's
// update; a non-finite total skips the step (outputs keep their inputs). Scalars: lr, beta1, beta2,
// eps, weight_decay, step, max_norm. Outputs may be their inputs.
template <class Team>
TUTTI_HD void adamw(const Team& team, const float* g, const float* m_in, const float* v_in, const float* p_in,
                    float total, float* m, float* v, float* p, int64_t n, const double* scalars) {
  if (!finite_float(total)) {
    for (int64_t i = team.rank(); i < n; i += team.size()) {
      const float a = m_in[i], b = v_in[i], c = p_in[i];
      m[i] = a, v[i] = b, p[i] = c;
    }
    team.sync();
    return;
  }
  const AdamwConstants k = adamw_constants(scalars);
  const float max_norm = static_cast<float>(scalars[6]);
  const float norm = sqrtf(total);
  float clip = 1.0f;
  if (max_norm > 0) {
    const float c = max_norm / (norm + 1e-6f);
    clip = c < 1.0f ? c : 1.0f;
  }
  adamw_update(team, g, m_in, v_in, p_in, m, v, p, n, clip, k.beta1, k.beta2, k.eps, 1.0f - k.lr * k.wd, k.step_size,
               k.c2_sqrt, nullptr, 0.0f);
}

// "zero.adamw_cast": adamw, then each updated parameter rounded to bfloat16 into p16 (nearest even,
// NaN to the quiet NaN: core/element.hpp's conversion, which the CPU form's loop reproduces).
template <class Team>
TUTTI_HD void adamw_cast(const Team& team, const float* g, const float* m_in, const float* v_in, const float* p_in,
                         float total, float* m, float* v, float* p, uint16_t* p16, int64_t n, const double* scalars) {
  adamw(team, g, m_in, v_in, p_in, total, m, v, p, n, scalars);
  for (int64_t i = team.rank(); i < n; i += team.size()) p16[i] = element::float_to_bf16(p[i]);
  team.sync();
}

// "zero.adamw_masked": AdamW with the call's clip (scalar 6) and per-parameter weight decay (mask[i]
// multiplies weight_decay): ZeroStep::update()'s kernel.
template <class Team>
TUTTI_HD void adamw_masked(const Team& team, const float* g, const float* m_in, const float* v_in, const float* p_in,
                           const float* mask, float* m, float* v, float* p, int64_t n, const double* scalars) {
  const AdamwConstants k = adamw_constants(scalars);
  adamw_update(team, g, m_in, v_in, p_in, m, v, p, n, static_cast<float>(scalars[6]), k.beta1, k.beta2, k.eps,
               1.0f - k.lr * k.wd, k.step_size, k.c2_sqrt, mask, k.lr * k.wd);
}

// --- the epilogue of a row-parallel linear layer (fused_kernels/epilogue.cpp) -------------------

// Whether element `index` of the rows x hidden tensor survives dropout: a hash of (seed, index)
// (splitmix64's finaliser) against a threshold of 24 uniform bits, so every rank, every chunking
// and every device draws the same mask. The CPU form calls this one.
TUTTI_HD bool dropout_kept(uint64_t seed, uint64_t index, uint32_t threshold) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + index + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<uint32_t>(z >> 40) >= threshold;
}

// The dropout of scalars {probability, seed high 32 bits, seed low 32 bits}: threshold and scale.
struct Dropout {
  bool on;
  uint64_t seed;
  uint32_t threshold;
  float scale;
};
TUTTI_HD Dropout dropout_of(const double* scalars) {
  const double p = scalars[0];
  Dropout d;
  d.on = p > 0;
  d.seed = (static_cast<uint64_t>(scalars[1]) << 32) | static_cast<uint64_t>(scalars[2]);
  d.threshold = static_cast<uint32_t>((p < 1.0 ? p : 1.0) * 16777216.0);
  d.scale = p < 1 ? static_cast<float>(1.0 / (1.0 - p)) : 0.0f;
  return d;
}

// residual + dropout(y + bias) of one element at `index` (column c), as the CPU form computes it.
TUTTI_HD float bias_dropout_add(const Dropout& d, float y, float bias, float residual, uint64_t index) {
  if (!d.on) return residual + (y + bias);
  const float x = dropout_kept(d.seed, index, d.threshold) ? (y + bias) * d.scale : 0.0f;
  return residual + x;
}

// "fused.bias_dropout_residual": out = residual + dropout(y + bias) over n elements of whole rows
// of `hidden` (the bias's length); `offset`: where y starts in the rows x hidden tensor (a multiple
// of hidden, checked per call). Scalars: dropout, seed_high, seed_low. out may be y.
template <class Team>
TUTTI_HD void bias_dropout_residual(const Team& team, const float* y, const float* bias, const float* residual,
                                    float* out, int64_t n, int64_t hidden, int64_t offset, const double* scalars) {
  const Dropout d = dropout_of(scalars);
  for (int64_t i = team.rank(); i < n; i += team.size())
    out[i] = bias_dropout_add(d, y[i], bias[i % hidden], residual[i], static_cast<uint64_t>(offset + i));
  team.sync();
}

// The order a LayerNorm adds a row in, so that a CPU's vector lanes can follow it: eight partial
// sums, a thread's j-th element of the row into partial j % 8, combined as a fixed tree, then the
// team's sum (Team::sum). With a team of one thread, element c goes to partial c % 8: a vector of
// eight doubles (or two of four, four of two) accumulating the row in order, as the CPU form
// (fused_kernels/epilogue_kernels.cpp) does; so the emulated device and the CPU agree bit for bit.
TUTTI_HD double lane_tree(const double* p) {
  return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}
template <class Team, class Value>
TUTTI_HD double row_sum(const Team& team, int64_t hidden, Value value) {
  double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int j = 0;
  for (int64_t c = team.rank(); c < hidden; c += team.size(), j = (j + 1) & 7) part[j] += value(c);
  return team.sum(lane_tree(part));
}

// "fused.bias_dropout_residual_ln": the same, then ln = LayerNorm(out) * gamma + beta per row, with
// the CPU form's arithmetic (double sums of the row and of its squared deviations, in row_sum's
// order; float mean and reciprocal standard deviation). Row by row, each thread reads back only
// what it wrote. Scalars: dropout, seed_high, seed_low, eps.
template <class Team>
TUTTI_HD void bias_dropout_residual_ln(const Team& team, const float* y, const float* bias, const float* residual,
                                       const float* gamma, const float* beta, float* out, float* ln, int64_t n,
                                       int64_t hidden, int64_t offset, const double* scalars) {
  const Dropout d = dropout_of(scalars);
  const auto eps = static_cast<float>(scalars[3]);
  for (int64_t row = 0; row < n; row += hidden) {
    const double sum = row_sum(team, hidden, [&](int64_t c) {
      const int64_t i = row + c;
      const float o = bias_dropout_add(d, y[i], bias[c], residual[i], static_cast<uint64_t>(offset + i));
      out[i] = o;
      return static_cast<double>(o);
    });
    const float mean = static_cast<float>(sum / static_cast<double>(hidden));
    const double sq = row_sum(team, hidden, [&](int64_t c) {
      const float dev = out[row + c] - mean;
      return static_cast<double>(dev) * static_cast<double>(dev);
    });
    const float rstd = 1.0f / sqrtf(static_cast<float>(sq / static_cast<double>(hidden)) + eps);
    for (int64_t c = team.rank(); c < hidden; c += team.size())
      ln[row + c] = (out[row + c] - mean) * rstd * gamma[c] + beta[c];
  }
  team.sync();
}

// --- GEMM blocks (fused_kernels/gemm_overlap.cpp) -----------------------------------------------

// "fused.gemm": c (rows x n) = a (rows x k) @ b (k x n), row major; each output element a float
// sum over k in order (the CPU form, OpenBLAS, may add in another order: the tests compare them on
// exact operands). Lengths are checked per call (device_executor.cpp). c must not overlap a or b.
//
// Tiled: the team loads a tile of a (`rows_per_tile` x kGemmTileK) and one of b (kGemmTileK x
// `cols_per_tile`) into its shared scratch, and each thread keeps kGemmRowsPerThread outputs of
// one column in registers across the k tiles, so a and b are read from global memory once per
// tile instead of once per output element (the plain form read a row of a and a column of b for
// every element). A warp's threads take 32 neighbouring columns: their loads of b are coalesced and
// their reads of a's tile are one broadcast. Any team size works that is a multiple of 32 or less
// than 32 (the emulated device's team of one thread: tiles of kGemmRowsPerThread x 1): the
// arithmetic per output is the plain loop's, so the result does not depend on the team.
inline constexpr int kGemmTileK = 16;
inline constexpr int kGemmRowsPerThread = 4;
// Floats of team scratch the GEMM uses at most: a's tile (transposed, one float of padding per k
// row so a warp's stores fall in different banks) and b's.
inline constexpr int kGemmScratchFloats =
    kGemmTileK * (kMaxBlockThreads / 32 * kGemmRowsPerThread + 1) + kGemmTileK * 32;

template <class Team>
TUTTI_HD void gemm(const Team& team, const float* a, const float* b, float* c, int64_t rows, int64_t k, int64_t n) {
  const int size = team.size(), t = team.rank();
  const int tn = size < 32 ? size : 32;                   // columns per tile
  const int tm = size / tn * kGemmRowsPerThread;          // rows per tile
  const int lda = tm + 1;                                 // a's tile, [q][i], padded
  float* const as = team.scratch();
  float* const bs = as + kGemmTileK * lda;                // b's tile, [q][j]
  const int j0 = t % tn, i0 = t / tn * kGemmRowsPerThread;  // this thread's column and first row
  for (int64_t ti = 0; ti < rows; ti += tm)
    for (int64_t tj = 0; tj < n; tj += tn) {
      float acc[kGemmRowsPerThread];
      TUTTI_UNROLL
      for (int r = 0; r < kGemmRowsPerThread; ++r) acc[r] = 0.0f;
      for (int64_t tk = 0; tk < k; tk += kGemmTileK) {
        const int kk = static_cast<int>(k - tk < kGemmTileK ? k - tk : kGemmTileK);
        for (int e = t; e < tm * kGemmTileK; e += size) {  // along a's rows: neighbours read neighbours
          const int i = e / kGemmTileK, q = e % kGemmTileK;
          as[q * lda + i] = ti + i < rows && q < kk ? a[(ti + i) * k + tk + q] : 0.0f;
        }
        for (int e = t; e < kGemmTileK * tn; e += size) {
          const int q = e / tn, j = e % tn;
          bs[q * tn + j] = q < kk && tj + j < n ? b[(tk + q) * n + tj + j] : 0.0f;
        }
        team.sync();
        for (int q = 0; q < kk; ++q) {  // only the k that exist: no extra "+ 0 * x" terms
          const float bv = bs[q * tn + j0];
          TUTTI_UNROLL
          for (int r = 0; r < kGemmRowsPerThread; ++r) acc[r] += as[q * lda + i0 + r] * bv;
        }
        team.sync();  // the tiles are reloaded next
      }
      TUTTI_UNROLL
      for (int r = 0; r < kGemmRowsPerThread; ++r)
        if (ti + i0 + r < rows && tj + j0 < n) c[(ti + i0 + r) * n + tj + j0] = acc[r];
    }
  team.sync();
}

// --- MoE dispatch and combine (fused_kernels/moe.cpp) --------------------------------------------
// Index tables are int32 token numbers, -1 for an empty slot. A device form cannot throw: a slot
// that names a token outside the table is reported through *bad (slot, value: the first one a
// thread met) and the kernel returns false on every thread, leaving its output unspecified; the
// interpreter stops the launch with it (Status::failed = kBadIndex), which the host reports.

struct BadIndex {
  int64_t slot = -1, value = 0;
};

// "moe.gather": block row s = x row index[s] (tokens rows of hidden), zeros for an empty slot.
template <class Team>
TUTTI_HD bool moe_gather(const Team& team, const float* x, const int32_t* index, float* block, int64_t tokens,
                         int64_t slots, int64_t hidden, BadIndex* bad) {
  bool wrong = false;
  for (int64_t e = team.rank(); e < slots * hidden; e += team.size()) {
    const int64_t s = e / hidden, c = e % hidden;
    const int32_t t = index[s];
    if (t < -1 || t >= tokens) {
      if (!wrong) bad->slot = s, bad->value = t;
      wrong = true;
      continue;
    }
    block[e] = t < 0 ? 0.0f : x[t * hidden + c];
  }
  return !team.sync_or(wrong);
}

// "moe.combine_first" (y_in null: y starts at zero) and "moe.combine" (y starts as y_in, which may
// be y): y row index[s] += gate[s] * block row s, slot after slot. A thread owns columns, so each
// element adds its slots in order, as the CPU form does.
template <class Team>
TUTTI_HD bool moe_combine(const Team& team, const float* block, const float* gate, const int32_t* index,
                          const float* y_in, float* y, int64_t tokens, int64_t slots, int64_t hidden, BadIndex* bad) {
  bool wrong = false;
  for (int64_t s = team.rank(); s < slots; s += team.size())
    if (index[s] < -1 || index[s] >= tokens) {
      if (!wrong) bad->slot = s, bad->value = index[s];
      wrong = true;
    }
  if (team.sync_or(wrong)) return false;
  for (int64_t c = team.rank(); c < hidden; c += team.size()) {
    for (int64_t t = 0; t < tokens; ++t) y[t * hidden + c] = y_in ? y_in[t * hidden + c] : 0.0f;
    for (int64_t s = 0; s < slots; ++s) {
      const int32_t t = index[s];
      if (t < 0) continue;
      y[t * hidden + c] += gate[s] * block[s * hidden + c];
    }
  }
  team.sync();
  return true;
}

}  // namespace tutti::device
