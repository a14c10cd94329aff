// The GPT's kernels on a CUDA device: GEMMs (and attention's batched GEMMs) through cuBLAS, the
// rest as plain one-thread-per-element or one-block-per-row kernels in the spirit of llm.c's.
// Float32 throughout; everything runs on one stream per Ops, and the calls that hand results to the
// host (download, mean_loss, sum_squares) synchronise it.

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "trainer/ops.hpp"
#include "tutti/types.hpp"

namespace tutti::train {
namespace {

void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) {
    cudaGetLastError();
    throw Error(ErrorKind::kSystem, fmt::format("CUDA: {}: {}", what, cudaGetErrorString(rc)));
  }
}
void check(cublasStatus_t rc, const char* what) {
  if (rc != CUBLAS_STATUS_SUCCESS) throw Error(ErrorKind::kSystem, fmt::format("cuBLAS: {}: status {}", what, static_cast<int>(rc)));
}

constexpr int kThreads = 256;
unsigned grid(int64_t n) { return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 20)); }
#define FOR_EACH(i, n) for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// Sum over a block (kThreads threads) of one value per thread.
__device__ float block_sum(float v) {
  __shared__ float part[kThreads / 32];
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  float s = 0;
  for (int w = 0; w < kThreads / 32; ++w) s += part[w];
  __syncthreads();
  return s;
}
__device__ float block_max(float v) {
  __shared__ float part[kThreads / 32];
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  float m = -INFINITY;
  for (int w = 0; w < kThreads / 32; ++w) m = fmaxf(m, part[w]);
  __syncthreads();
  return m;
}

__global__ void add_bias_k(float* out, const float* bias, int64_t N, int64_t C) { FOR_EACH(i, N * C) out[i] += bias[i % C]; }
__global__ void column_sum_k(float* dbias, const float* dout, int64_t N, int64_t C) {
  FOR_EACH(c, C) {
    float s = 0;
    for (int64_t r = 0; r < N; ++r) s += dout[r * C + c];
    dbias[c] += s;
  }
}
__global__ void layernorm_k(float* out, float* mean, float* rstd, const float* inp, const float* w, const float* b,
                            int64_t C) {
  const int64_t r = blockIdx.x;
  const float* x = inp + r * C;
  float s = 0;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) s += x[i];
  const float m = block_sum(s) / C;
  float v = 0;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) v += (x[i] - m) * (x[i] - m);
  const float rs = rsqrtf(block_sum(v) / C + 1e-5f);
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) out[r * C + i] = (x[i] - m) * rs * w[i] + b[i];
  if (threadIdx.x == 0) mean[r] = m, rstd[r] = rs;
}
__global__ void layernorm_back_k(float* dinp, const float* dout, const float* inp, const float* w, const float* mean,
                                 const float* rstd, int64_t C) {
  const int64_t r = blockIdx.x;
  const float m = mean[r], rs = rstd[r];
  float a = 0, b = 0;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const float d = w[i] * dout[r * C + i];
    a += d;
    b += d * (inp[r * C + i] - m) * rs;
  }
  a = block_sum(a) / C;
  b = block_sum(b) / C;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const float n = (inp[r * C + i] - m) * rs;
    dinp[r * C + i] += (w[i] * dout[r * C + i] - a - n * b) * rs;
  }
}
__global__ void layernorm_params_back_k(float* dw, float* db, const float* dout, const float* inp, const float* mean,
                                        const float* rstd, int64_t N, int64_t C) {
  FOR_EACH(i, C) {
    float gw = 0, gb = 0;
    for (int64_t r = 0; r < N; ++r) {
      const float d = dout[r * C + i];
      gw += (inp[r * C + i] - mean[r]) * rstd[r] * d;
      gb += d;
    }
    dw[i] += gw;
    db[i] += gb;
  }
}
// Scores (B*NH rows of T x T, already q.k) to probabilities: scale, causal mask, softmax per row.
__global__ void softmax_causal_k(float* att, int64_t T, float scale) {
  const int64_t row = blockIdx.x, t = row % T;
  float* a = att + row * T;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) m = fmaxf(m, a[j] * scale);
  m = block_max(m);
  float s = 0;
  for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) s += expf(a[j] * scale - m);
  const float inv = 1.0f / block_sum(s);
  for (int64_t j = threadIdx.x; j < T; j += blockDim.x) a[j] = j <= t ? expf(a[j] * scale - m) * inv : 0.0f;
}
// d(scores) from d(probabilities), in place, times the scale (so later GEMMs give dq and dk).
__global__ void softmax_back_k(float* datt, const float* att, int64_t T, float scale) {
  const int64_t row = blockIdx.x;
  const float* a = att + row * T;
  float* d = datt + row * T;
  float s = 0;
  for (int64_t j = threadIdx.x; j < T; j += blockDim.x) s += a[j] * d[j];
  s = block_sum(s);
  for (int64_t j = threadIdx.x; j < T; j += blockDim.x) d[j] = a[j] * (d[j] - s) * scale;
}
__global__ void gelu_k(float* out, const float* inp, int64_t n) {
  const float s = sqrtf(2.0f / static_cast<float>(M_PI));
  FOR_EACH(i, n) {
    const float x = inp[i];
    out[i] = 0.5f * x * (1.0f + tanhf(s * (x + 0.044715f * x * x * x)));
  }
}
__global__ void gelu_back_k(float* dinp, const float* inp, const float* dout, int64_t n) {
  const float s = sqrtf(2.0f / static_cast<float>(M_PI));
  FOR_EACH(i, n) {
    const float x = inp[i], th = tanhf(s * (x + 0.044715f * x * x * x));
    dinp[i] = (0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * s * (1.0f + 3.0f * 0.044715f * x * x)) * dout[i];
  }
}
__global__ void add_k(float* out, const float* a, const float* b, int64_t n) { FOR_EACH(i, n) out[i] = a[i] + b[i]; }
__global__ void accumulate_k(float* out, const float* a, int64_t n) { FOR_EACH(i, n) out[i] += a[i]; }
__global__ void scale_k(float* p, float s, int64_t n) { FOR_EACH(i, n) p[i] *= s; }
__global__ void embed_k(float* out, const int32_t* tokens, const float* wte, int64_t v0, int64_t Vl, const float* wpe,
                        int64_t t0, int64_t N, int64_t B, int64_t C) {
  FOR_EACH(i, N * C) {
    const int64_t r = i / C, c = i % C, v = static_cast<int64_t>(tokens[r]) - v0;
    out[i] = (v >= 0 && v < Vl ? wte[v * C + c] : 0.0f) + (wpe ? wpe[(t0 + r / B) * C + c] : 0.0f);
  }
}
// One thread per channel walks the rows: no atomics, the same sums every run.
__global__ void embed_back_k(float* dwte, const int32_t* tokens, const float* dout, int64_t v0, int64_t Vl, int64_t N,
                             int64_t C) {
  FOR_EACH(c, C) {
    for (int64_t r = 0; r < N; ++r) {
      const int64_t v = static_cast<int64_t>(tokens[r]) - v0;
      if (v >= 0 && v < Vl) dwte[v * C + c] += dout[r * C + c];
    }
  }
}
__global__ void position_back_k(float* dwpe, const float* dout, int64_t t0, int64_t N, int64_t B, int64_t C) {
  FOR_EACH(c, C) {
    for (int64_t r = 0; r < N; ++r) dwpe[(t0 + r / B) * C + c] += dout[r * C + c];
  }
}
__global__ void row_max_k(float* maxv, const float* logits, int64_t Vl) {
  const int64_t r = blockIdx.x;
  float m = -INFINITY;
  for (int64_t v = threadIdx.x; v < Vl; v += blockDim.x) m = fmaxf(m, logits[r * Vl + v]);
  m = block_max(m);
  if (threadIdx.x == 0) maxv[r] = m;
}
__global__ void row_sum_exp_k(float* sum, const float* logits, const float* maxv, int64_t Vl) {
  const int64_t r = blockIdx.x;
  float s = 0;
  for (int64_t v = threadIdx.x; v < Vl; v += blockDim.x) s += expf(logits[r * Vl + v] - maxv[r]);
  s = block_sum(s);
  if (threadIdx.x == 0) sum[r] = s;
}
__global__ void target_logit_k(float* out, const float* logits, const int32_t* targets, int64_t v0, int64_t N, int64_t Vl) {
  FOR_EACH(r, N) {
    const int64_t v = static_cast<int64_t>(targets[r]) - v0;
    out[r] = v >= 0 && v < Vl ? logits[r * Vl + v] : 0.0f;
  }
}
__global__ void ce_back_k(float* dlogits, const float* logits, const float* maxv, const float* sum,
                          const int32_t* targets, int64_t v0, float scale, int64_t N, int64_t Vl) {
  FOR_EACH(i, N * Vl) {
    const int64_t r = i / Vl, v = i % Vl;
    const float p = expf(logits[i] - maxv[r]) / sum[r];
    dlogits[i] = (p - (v == static_cast<int64_t>(targets[r]) - v0 ? 1.0f : 0.0f)) * scale;
  }
}
__global__ void sum_squares_k(double* out, const float* p, int64_t n) {
  double s = 0;
  FOR_EACH(i, n) s += static_cast<double>(p[i]) * p[i];
  for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (threadIdx.x % 32 == 0) atomicAdd(out, s);
}
__global__ void adamw_k(float* p, const float* g, float* m, float* v, int64_t n, float lr, float b1, float b2, float eps,
                        float decay, float step_size, float c2_sqrt, float grad_scale) {
  FOR_EACH(i, n) {
    const float gi = g[i] * grad_scale;
    p[i] *= decay;
    m[i] = m[i] * b1 + gi * (1.0f - b1);
    v[i] = v[i] * b2 + gi * gi * (1.0f - b2);
    p[i] -= step_size * (m[i] / (sqrtf(v[i]) / c2_sqrt + eps));
  }
  (void)lr;
}

__global__ void to_bf16_k(__nv_bfloat16* out, const float* in, int64_t n) { FOR_EACH(i, n) out[i] = __float2bfloat16(in[i]); }

class CudaOps final : public Ops {
 public:
  CudaOps(int device, bool bf16) : device_(device), bf16_(bf16) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || device < 0 || device >= n) {
      cudaGetLastError();
      throw InvalidUsage(fmt::format("CUDA device {} does not exist ({} found)", device, n));
    }
    check(cudaSetDevice(device), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cublasCreate(&blas_), "cublasCreate");
    check(cublasSetStream(blas_, stream_), "cublasSetStream");
    check(cudaMalloc(&scalar_, sizeof(double)), "cudaMalloc");
  }
  ~CudaOps() override {
    for (void* p : bf16_buf_) cudaFree(p);
    cudaFree(scalar_);
    cublasDestroy(blas_);
    cudaStreamDestroy(stream_);
  }
  const char* name() const override { return "cuda"; }

  float* alloc(int64_t n) override {
    void* p = nullptr;
    check(cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float)), "cudaMalloc");
    check(cudaMemsetAsync(p, 0, static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float), stream_), "cudaMemset");
    return static_cast<float*>(p);
  }
  void release(float* p) override {
    cudaStreamSynchronize(stream_);
    cudaFree(p);
  }
  void upload(float* dst, const float* host, int64_t n) override {
    check(cudaMemcpyAsync(dst, host, bytes(n), cudaMemcpyHostToDevice, stream_), "upload");
    check(cudaStreamSynchronize(stream_), "upload");
  }
  void download(float* host, const float* src, int64_t n) override {
    check(cudaMemcpyAsync(host, src, bytes(n), cudaMemcpyDeviceToHost, stream_), "download");
    check(cudaStreamSynchronize(stream_), "download");
  }
  void zero(float* p, int64_t n) override {
    if (n > 0) check(cudaMemsetAsync(p, 0, bytes(n), stream_), "cudaMemset");
  }
  void copy(float* dst, const float* src, int64_t n) override {
    if (n > 0 && dst != src) check(cudaMemcpyAsync(dst, src, bytes(n), cudaMemcpyDeviceToDevice, stream_), "copy");
  }

  // The linear layers: float32, or with --bf16 their operands rounded to bfloat16 and multiplied on
  // the tensor cores with float32 accumulation and float32 results (the master weights, gradients
  // and everything else stay float32).
  void matmul(float* out, const float* inp, const float* w, const float* bias, int64_t N, int64_t C,
              int64_t OC) override {
    linear(false, true, N, OC, C, inp, C, w, C, out, OC, 0.0f);
    if (bias) add_bias(out, bias, N, OC);
  }
  void matmul_backward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp, const float* w,
                       int64_t N, int64_t C, int64_t OC) override {
    if (dinp) linear(false, false, N, C, OC, dout, OC, w, C, dinp, C, 0.0f);
    if (dw) linear(true, false, OC, C, N, dout, OC, inp, C, dw, C, 1.0f);
    if (dbias) bias_backward(dbias, dout, N, OC);
  }
  void layernorm(float* out, float* mean, float* rstd, const float* inp, const float* w, const float* b, int64_t N,
                 int64_t C) override {
    if (N > 0) layernorm_k<<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(out, mean, rstd, inp, w, b, C);
    launched("layernorm");
  }
  void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                          const float* mean, const float* rstd, int64_t N, int64_t C) override {
    if (N > 0) layernorm_back_k<<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(dinp, dout, inp, w, mean, rstd, C);
    layernorm_params_back_k<<<grid(C), kThreads, 0, stream_>>>(dw, db, dout, inp, mean, rstd, N, C);
    launched("layernorm backward");
  }

  // Per sequence b, heads as a strided batch: Q, K, V of head h are T x hs matrices with row stride
  // B * 3C (rows t * B + b), starting at b * 3C + {0, C, 2C} + h * hs.
  void attention(float* out, float* att, const float* qkv, int64_t T, int64_t B, int64_t NH, int64_t hs) override {
    const int64_t C = NH * hs, ld = B * 3 * C;
    for (int64_t b = 0; b < B; ++b) {
      const float* q = qkv + b * 3 * C;
      float* a = att + b * NH * T * T;
      // scores = Q K^T
      gemm(false, true, T, T, hs, q, ld, q + C, ld, a, T, 1.0f, 0.0f, NH, hs, hs, T * T);
    }
    softmax_causal_k<<<static_cast<unsigned>(B * NH * T), kThreads, 0, stream_>>>(att, T, 1.0f / sqrtf(static_cast<float>(hs)));
    launched("attention softmax");
    for (int64_t b = 0; b < B; ++b)  // out = P V
      gemm(false, false, T, hs, T, att + b * NH * T * T, T, qkv + b * 3 * C + 2 * C, ld, out + b * C, B * C, 1.0f, 0.0f,
           NH, T * T, hs, hs);
  }
  void attention_backward(float* dqkv, float* datt, const float* dout, const float* qkv, const float* att, int64_t T,
                          int64_t B, int64_t NH, int64_t hs) override {
    const int64_t C = NH * hs, ld = B * 3 * C;
    for (int64_t b = 0; b < B; ++b) {
      const float* v = qkv + b * 3 * C + 2 * C;
      const float* dy = dout + b * C;
      // dP = dY V^T; dV = P^T dY
      gemm(false, true, T, T, hs, dy, B * C, v, ld, datt + b * NH * T * T, T, 1.0f, 0.0f, NH, hs, hs, T * T);
      gemm(true, false, T, hs, T, att + b * NH * T * T, T, dy, B * C, dqkv + b * 3 * C + 2 * C, ld, 1.0f, 0.0f, NH, T * T,
           hs, hs);
    }
    softmax_back_k<<<static_cast<unsigned>(B * NH * T), kThreads, 0, stream_>>>(datt, att, T, 1.0f / sqrtf(static_cast<float>(hs)));
    launched("attention softmax backward");
    for (int64_t b = 0; b < B; ++b) {
      const float* q = qkv + b * 3 * C;
      const float* ds = datt + b * NH * T * T;
      // dQ = dS K; dK = dS^T Q (dS carries the scale)
      gemm(false, false, T, hs, T, ds, T, q + C, ld, dqkv + b * 3 * C, ld, 1.0f, 0.0f, NH, T * T, hs, hs);
      gemm(true, false, T, hs, T, ds, T, q, ld, dqkv + b * 3 * C + C, ld, 1.0f, 0.0f, NH, T * T, hs, hs);
    }
  }
  void gelu(float* out, const float* inp, int64_t n) override { run(gelu_k, n, "gelu", out, inp, n); }
  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) override {
    run(gelu_back_k, n, "gelu backward", dinp, inp, dout, n);
  }
  void add(float* out, const float* a, const float* b, int64_t n) override { run(add_k, n, "add", out, a, b, n); }
  void accumulate(float* out, const float* a, int64_t n) override { run(accumulate_k, n, "accumulate", out, a, n); }
  void add_bias(float* out, const float* bias, int64_t N, int64_t C) override {
    run(add_bias_k, N * C, "bias", out, bias, N, C);
  }
  void bias_backward(float* dbias, const float* dout, int64_t N, int64_t C) override {
    run(column_sum_k, C, "bias backward", dbias, dout, N, C);
  }
  void scale(float* p, float s, int64_t n) override { run(scale_k, n, "scale", p, s, n); }
  void embed(float* out, const int32_t* tokens, const float* wte, int64_t v0, int64_t Vl, const float* wpe, int64_t t0,
             int64_t N, int64_t B, int64_t C) override {
    run(embed_k, N * C, "embedding", out, tokens, wte, v0, Vl, wpe, t0, N, B, C);
  }
  void embed_backward(float* dwte, const int32_t* tokens, const float* dout, int64_t v0, int64_t Vl, int64_t N,
                      int64_t C) override {
    run(embed_back_k, C, "embedding backward", dwte, tokens, dout, v0, Vl, N, C);
  }
  void position_backward(float* dwpe, const float* dout, int64_t t0, int64_t N, int64_t B, int64_t C) override {
    run(position_back_k, C, "position backward", dwpe, dout, t0, N, B, C);
  }
  void row_max(float* maxv, const float* logits, int64_t N, int64_t Vl) override {
    if (N > 0) row_max_k<<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(maxv, logits, Vl);
    launched("row max");
  }
  void row_sum_exp(float* sum, const float* logits, const float* maxv, int64_t N, int64_t Vl) override {
    if (N > 0) row_sum_exp_k<<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(sum, logits, maxv, Vl);
    launched("row sum");
  }
  void target_logit(float* out, const float* logits, const int32_t* targets, int64_t v0, int64_t N,
                    int64_t Vl) override {
    run(target_logit_k, N, "target logit", out, logits, targets, v0, N, Vl);
  }
  double mean_loss(const float* maxv, const float* sum, const float* target, int64_t N) override {
    std::vector<float> m(static_cast<size_t>(N)), s(m.size()), t(m.size());
    download(m.data(), maxv, N);
    download(s.data(), sum, N);
    download(t.data(), target, N);
    double total = 0;
    for (int64_t r = 0; r < N; ++r) total += std::log(static_cast<double>(s[r])) + m[r] - t[r];
    return N > 0 ? total / static_cast<double>(N) : 0.0;
  }
  void cross_entropy_backward(float* dlogits, const float* logits, const float* maxv, const float* sum,
                              const int32_t* targets, int64_t v0, float scale, int64_t N, int64_t Vl) override {
    run(ce_back_k, N * Vl, "cross-entropy backward", dlogits, logits, maxv, sum, targets, v0, scale, N, Vl);
  }
  double sum_squares(const float* p, int64_t n) override {
    check(cudaMemsetAsync(scalar_, 0, sizeof(double), stream_), "cudaMemset");
    if (n > 0) sum_squares_k<<<grid(n), kThreads, 0, stream_>>>(scalar_, p, n);
    launched("sum of squares");
    double out = 0;
    check(cudaMemcpyAsync(&out, scalar_, sizeof(double), cudaMemcpyDeviceToHost, stream_), "download");
    check(cudaStreamSynchronize(stream_), "sum of squares");
    return out;
  }
  void adamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1, float beta2, float eps,
             float wd, int step, float grad_scale) override {
    const double c1 = 1.0 - std::pow(static_cast<double>(beta1), step);
    const double c2 = 1.0 - std::pow(static_cast<double>(beta2), step);
    run(adamw_k, n, "adamw", p, g, m, v, n, lr, beta1, beta2, eps, 1.0f - lr * wd,
        static_cast<float>(static_cast<double>(lr) / c1), static_cast<float>(std::sqrt(c2)), grad_scale);
  }
  int32_t* alloc_tokens(int64_t n) override {
    void* p = nullptr;
    check(cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(int32_t)), "cudaMalloc");
    return static_cast<int32_t*>(p);
  }
  void release_tokens(int32_t* p) override {
    cudaStreamSynchronize(stream_);
    cudaFree(p);
  }
  void upload_tokens(int32_t* dst, const int32_t* host, int64_t n) override {
    check(cudaMemcpyAsync(dst, host, static_cast<size_t>(n) * sizeof(int32_t), cudaMemcpyHostToDevice, stream_),
          "upload");
    check(cudaStreamSynchronize(stream_), "upload");
  }

 private:
  static size_t bytes(int64_t n) { return static_cast<size_t>(n) * sizeof(float); }
  void launched(const char* what) { check(cudaGetLastError(), what); }
  template <class K, class... A>
  void run(K kernel, int64_t n, const char* what, A... args) {
    if (n > 0) kernel<<<grid(n), kThreads, 0, stream_>>>(args...);
    launched(what);
  }
  // A linear layer's GEMM on contiguous operands (A: m x k or k x m, B likewise).
  void linear(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* B,
              int64_t ldb, float* Cm, int64_t ldc, float beta) {
    if (!bf16_) return gemm(ta, tb, m, n, k, A, lda, B, ldb, Cm, ldc, 1.0f, beta);
    const __nv_bfloat16* a = rounded(0, A, m * k);
    const __nv_bfloat16* b = rounded(1, B, n * k);
    const float alpha = 1.0f;
    auto i32 = [](int64_t v) {
      if (v < 0 || v > INT32_MAX) throw std::length_error("a GEMM dimension does not fit cuBLAS's 32-bit sizes");
      return static_cast<int>(v);
    };
    check(cublasGemmEx(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, i32(n), i32(m), i32(k),
                       &alpha, b, CUDA_R_16BF, i32(ldb), a, CUDA_R_16BF, i32(lda), &beta, Cm, CUDA_R_32F, i32(ldc),
                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "gemm (bf16)");
  }
  // `n` floats rounded to bfloat16 in scratch buffer `slot` (grown on demand).
  const __nv_bfloat16* rounded(int slot, const float* p, int64_t n) {
    if (bf16_size_[slot] < n) {
      check(cudaStreamSynchronize(stream_), "bf16 scratch");
      cudaFree(bf16_buf_[slot]);
      bf16_buf_[slot] = nullptr;
      check(cudaMalloc(&bf16_buf_[slot], static_cast<size_t>(n) * sizeof(__nv_bfloat16)), "cudaMalloc");
      bf16_size_[slot] = n;
    }
    auto* out = static_cast<__nv_bfloat16*>(bf16_buf_[slot]);
    run(to_bf16_k, n, "bf16 rounding", out, p, n);
    return out;
  }

  // Row-major C[m x n] = alpha op(A) op(B) + beta C (op(A) is m x k), `batch` times with the given
  // strides; cuBLAS is column-major, so it computes C^T = op(B)^T op(A)^T.
  void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* B, int64_t ldb,
            float* Cm, int64_t ldc, float alpha, float beta, int64_t batch = 1, int64_t sa = 0, int64_t sb = 0,
            int64_t sc = 0) {
    auto i32 = [](int64_t v) {
      if (v < 0 || v > INT32_MAX) throw std::length_error("a GEMM dimension does not fit cuBLAS's 32-bit sizes");
      return static_cast<int>(v);
    };
    const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (batch == 1)
      check(cublasSgemm(blas_, opb, opa, i32(n), i32(m), i32(k), &alpha, B, i32(ldb), A, i32(lda), &beta, Cm, i32(ldc)),
            "sgemm");
    else
      check(cublasSgemmStridedBatched(blas_, opb, opa, i32(n), i32(m), i32(k), &alpha, B, i32(ldb), sb, A, i32(lda), sa,
                                      &beta, Cm, i32(ldc), sc, i32(batch)),
            "sgemm (batched)");
  }

  int device_;
  bool bf16_;
  void* bf16_buf_[2] = {nullptr, nullptr};
  int64_t bf16_size_[2] = {0, 0};
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  double* scalar_ = nullptr;
};

}  // namespace

std::unique_ptr<Ops> make_cuda_ops(int device, bool bf16) { return std::make_unique<CudaOps>(device, bf16); }

}  // namespace tutti::train
