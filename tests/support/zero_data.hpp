#pragma once
// Inputs of a fused ZeRO step (tutti/fused.hpp's zero_step_program) for tests that run it on
// several executors or through several APIs and compare the floats. Gradients are small integers,
// so their sums and sums of squares are exact in any order; the other inputs are arbitrary floats,
// the same whichever way the step runs.
#include <cstdint>
#include <limits>
#include <vector>

#include "tutti/fused.hpp"

namespace tutti::test_support {

// One rank's buffers: gradients and parameters of every rank (size() * shard), its moments
// (shard), the plan's statistics (size() + 1).
struct ZeroBuffers {
  std::vector<float> grads, params, m, v, stats;
};

inline ZeroBuffers zero_rank_inputs(int n, int r, int64_t shard) {
  ZeroBuffers x;
  x.grads.resize(static_cast<size_t>(n * shard));
  x.params.resize(x.grads.size());
  for (size_t i = 0; i < x.grads.size(); ++i) {
    x.grads[i] = static_cast<float>(static_cast<int>((i * 7 + static_cast<size_t>(r) * 3) % 9) - 4);
    x.params[i] = 0.01f * static_cast<float>(i % 29) - 0.1f;  // the same on every rank
  }
  x.m.resize(static_cast<size_t>(shard));
  x.v.resize(x.m.size());
  for (size_t i = 0; i < x.m.size(); ++i) {
    x.m[i] = 0.001f * static_cast<float>((i + static_cast<size_t>(r)) % 7);
    x.v[i] = 0.0001f * static_cast<float>((i * 3 + static_cast<size_t>(r)) % 5);
  }
  x.stats.assign(static_cast<size_t>(n + 1), -1.0f);
  return x;
}

// Every rank's; `poison`: rank 1's gradients hold an infinity (the step must be skipped).
inline std::vector<ZeroBuffers> zero_inputs(int n, int64_t shard, bool poison) {
  std::vector<ZeroBuffers> b;
  for (int r = 0; r < n; ++r) b.push_back(zero_rank_inputs(n, r, shard));
  if (poison) b[1].grads[static_cast<size_t>(shard) / 2] = std::numeric_limits<float>::infinity();
  return b;
}

// A step whose clip and decay matter for the data above; the gradient scale is exact.
inline fused::AdamW zero_step_options() {
  fused::AdamW opt;
  opt.lr = 1e-2f;
  opt.weight_decay = 0.1f;
  opt.step = 3;
  opt.max_norm = 1.0f;
  opt.grad_scale = 0.5f;
  return opt;
}

}  // namespace tutti::test_support
