// The unfused ZeRO step's passes as grid-wide CUDA kernels (zero_unfused_kernels.hpp).
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "runtime/device/kernels.hpp"
#include "tools/bench/zero_unfused_kernels.hpp"

namespace tutti::bench {
namespace {

constexpr int kThreads = 256, kBlocks = 1024;

void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(rc));
}

// Every thread of the grid, one element at a time (kernels.hpp's loops stride by the team).
struct GridTeam {
  __device__ int64_t rank() const { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
  __device__ int64_t size() const { return static_cast<int64_t>(gridDim.x) * blockDim.x; }
  __device__ void sync() const {}  // elementwise: the kernel's end orders what follows
};

__global__ void unscale_partial(float* g, int64_t n, float scale, double* partial) {
  __shared__ double sums[kThreads];
  double acc = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float x = g[i] * scale;
    g[i] = x;
    acc += static_cast<double>(x) * x;
  }
  sums[threadIdx.x] = acc;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s /= 2) {
    if (static_cast<int>(threadIdx.x) < s) sums[threadIdx.x] += sums[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = sums[0];
}

__global__ void add_partials(const double* partial, int n, float* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  double t = 0;
  for (int i = 0; i < n; ++i) t += partial[i];
  *out = static_cast<float>(t);
}

struct Scalars {
  double v[7];
};

__global__ void adamw_kernel(const float* g, float* m, float* v, float* p, int64_t n, const float* total, Scalars s) {
  device::adamw(GridTeam{}, g, m, v, p, *total, m, v, p, n, s.v);
}

}  // namespace

int64_t unscale_scratch_bytes() { return kBlocks * static_cast<int64_t>(sizeof(double)); }

void unscale_sumsq(float* g, int64_t n, float scale, float* sum_squares, void* scratch, void* stream, bool cuda) {
  if (!cuda) {
    double acc = 0;
    for (int64_t i = 0; i < n; ++i) {
      g[i] *= scale;
      acc += static_cast<double>(g[i]) * g[i];
    }
    *sum_squares = static_cast<float>(acc);
    return;
  }
  auto s = static_cast<cudaStream_t>(stream);
  auto* partial = static_cast<double*>(scratch);
  unscale_partial<<<kBlocks, kThreads, 0, s>>>(g, n, scale, partial);
  add_partials<<<1, 1, 0, s>>>(partial, kBlocks, sum_squares);
  check(cudaGetLastError(), "unscale_sumsq");
}

void adamw(const float* g, float* m, float* v, float* p, int64_t n, const float* total, const double* scalars,
           void* stream, bool cuda) {
  if (!cuda) {
    struct HostTeam {  // one thread: the host's loop
      TUTTI_HD int rank() const { return 0; }
      TUTTI_HD int size() const { return 1; }
      TUTTI_HD void sync() const {}
    };
    device::adamw(HostTeam{}, g, m, v, p, *total, m, v, p, n, scalars);
    return;
  }
  Scalars s;
  for (int i = 0; i < 7; ++i) s.v[i] = scalars[i];
  adamw_kernel<<<kBlocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(g, m, v, p, n, total, s);
  check(cudaGetLastError(), "adamw");
}

}  // namespace tutti::bench
