#pragma once
// The unfused ZeRO step's two passes over a rank's shard, for tutti-fused-device-bench: on a CUDA
// stream (zero_unfused_kernels.cu, grid-wide kernels: the reference a GPU program would write) or,
// for the emulated device, on the host. The element work is runtime/device/kernels.hpp's, the same
// as the fused plan's device forms.
#include <cstdint>

namespace tutti::bench {

// g[0..n) *= scale; *sum_squares = the sum of the squares of the scaled values (a float, device
// memory on CUDA). `scratch`: at least unscale_scratch_bytes() of device memory (CUDA only).
void unscale_sumsq(float* g, int64_t n, float scale, float* sum_squares, void* scratch, void* stream, bool cuda);
int64_t unscale_scratch_bytes();
// AdamW with the norm clip over n elements in place; `total`: the global sum of squares (device
// memory on CUDA); scalars: lr, beta1, beta2, eps, weight_decay, step, max_norm.
void adamw(const float* g, float* m, float* v, float* p, int64_t n, const float* total, const double* scalars,
           void* stream, bool cuda);

}  // namespace tutti::bench
