// The GPT's kernels on the CPU: GEMMs through OpenBLAS, the rest as plain loops (llm.c's, with rows
// in sequence-major order) over OpenMP threads.
#include <cblas.h>
#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <new>

#include "trainer/ops.hpp"
#include "tutti/fused.hpp"
#include "tutti/types.hpp"

extern "C" void openblas_set_num_threads(int);

namespace tutti::train {
namespace {

constexpr float kLayerNormEps = 1e-5f;

class CpuOps final : public Ops {
 public:
  // One threading runtime: OpenBLAS runs single-threaded inside OpenMP's threads, each GEMM cut
  // into row blocks. (OpenBLAS's own threads beside OpenMP's spinning ones fought over the cores:
  // 2 ranks of 1 thread ran faster than 1 rank of 2.)
  explicit CpuOps(int threads) : threads_(threads > 0 ? threads : omp_get_max_threads()) {
    openblas_set_num_threads(1);
  }
  const char* name() const override { return "cpu"; }

  float* alloc(int64_t n) override {
    auto* p = static_cast<float*>(std::aligned_alloc(64, round64(n * sizeof(float))));
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, static_cast<size_t>(n) * sizeof(float));
    return p;
  }
  void release(float* p) override { std::free(p); }
  void upload(float* dst, const float* host, int64_t n) override { copy(dst, host, n); }
  void download(float* host, const float* src, int64_t n) override { copy(host, src, n); }
  void zero(float* p, int64_t n) override {
    if (n > 0) std::memset(p, 0, static_cast<size_t>(n) * sizeof(float));
  }
  void discard(float* p, int64_t n) override {
    if (n <= 0) return;
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const auto begin = reinterpret_cast<uintptr_t>(p), end = reinterpret_cast<uintptr_t>(p + n);
    const uintptr_t inner_begin = (begin + page - 1) / page * page, inner_end = end / page * page;
    // Private anonymous pages read as zero after MADV_DONTNEED; the partial pages at the edges are
    // shared with neighbouring data and are zeroed instead.
    if (inner_end > inner_begin && madvise(reinterpret_cast<void*>(inner_begin), inner_end - inner_begin,
                                           MADV_DONTNEED) == 0) {
      zero(p, static_cast<int64_t>((inner_begin - begin) / sizeof(float)));
      zero(reinterpret_cast<float*>(inner_end), static_cast<int64_t>((end - inner_end) / sizeof(float)));
      return;
    }
    zero(p, n);
  }
  void copy(float* dst, const float* src, int64_t n) override {
    if (n > 0 && dst != src) std::memmove(dst, src, static_cast<size_t>(n) * sizeof(float));
  }

  void matmul(float* out, const float* inp, const float* w, const float* bias, int64_t N, int64_t C,
              int64_t OC) override {
    // Rows of out in blocks, one GEMM each.
    blocks(N, [&](int64_t r0, int64_t n) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, blas(n), blas(OC), blas(C), 1.0f, inp + r0 * C, blas(C), w,
                  blas(C), 0.0f, out + r0 * OC, blas(OC));
    });
    if (bias) add_bias(out, bias, N, OC);
  }

  void matmul_backward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp, const float* w,
                       int64_t N, int64_t C, int64_t OC) override {
    if (dinp)
      blocks(N, [&](int64_t r0, int64_t n) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, blas(n), blas(C), blas(OC), 1.0f, dout + r0 * OC,
                    blas(OC), w, blas(C), 0.0f, dinp + r0 * C, blas(C));
      });
    // dw's rows (output features) in blocks: each block reads its columns of dout.
    if (dw)
      blocks(OC, [&](int64_t o0, int64_t n) {
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, blas(n), blas(C), blas(N), 1.0f, dout + o0, blas(OC), inp,
                    blas(C), 1.0f, dw + o0 * C, blas(C));
      });
    if (dbias) bias_backward(dbias, dout, N, OC);
  }

  void layernorm(float* out, float* mean, float* rstd, const float* inp, const float* w, const float* b, int64_t N,
                 int64_t C) override {
#pragma omp parallel for num_threads(threads_)
    for (int64_t r = 0; r < N; ++r) {
      const float* x = inp + r * C;
      float m = 0;
      for (int64_t i = 0; i < C; ++i) m += x[i];
      m /= static_cast<float>(C);
      float var = 0;
      for (int64_t i = 0; i < C; ++i) var += (x[i] - m) * (x[i] - m);
      var /= static_cast<float>(C);
      const float s = 1.0f / std::sqrt(var + kLayerNormEps);
      float* o = out + r * C;
      for (int64_t i = 0; i < C; ++i) o[i] = (x[i] - m) * s * w[i] + b[i];
      mean[r] = m;
      rstd[r] = s;
    }
  }

  void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                          const float* mean, const float* rstd, int64_t N, int64_t C) override {
#pragma omp parallel for num_threads(threads_)
    for (int64_t r = 0; r < N; ++r) {
      const float* dy = dout + r * C;
      const float* x = inp + r * C;
      const float m = mean[r], s = rstd[r];
      float dnorm_mean = 0, dnorm_norm_mean = 0;
      for (int64_t i = 0; i < C; ++i) {
        const float dnorm = w[i] * dy[i];
        dnorm_mean += dnorm;
        dnorm_norm_mean += dnorm * (x[i] - m) * s;
      }
      dnorm_mean /= static_cast<float>(C);
      dnorm_norm_mean /= static_cast<float>(C);
      float* dx = dinp + r * C;
      for (int64_t i = 0; i < C; ++i) {
        const float norm = (x[i] - m) * s;
        dx[i] += (w[i] * dy[i] - dnorm_mean - norm * dnorm_norm_mean) * s;
      }
    }
    // The parameter gradients sum over rows: split by column so threads never share an element.
#pragma omp parallel for num_threads(threads_)
    for (int64_t i = 0; i < C; ++i) {
      float gw = 0, gb = 0;
      for (int64_t r = 0; r < N; ++r) {
        const float dy = dout[r * C + i];
        gw += (inp[r * C + i] - mean[r]) * rstd[r] * dy;
        gb += dy;
      }
      dw[i] += gw;
      db[i] += gb;
    }
  }

  void attention(float* out, float* att, const float* qkv, int64_t T, int64_t B, int64_t NH, int64_t hs) override {
    const int64_t C = NH * hs, C3 = 3 * C;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
#pragma omp parallel for collapse(2) num_threads(threads_)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < NH; ++h)
        for (int64_t t = 0; t < T; ++t) {
          const float* q = qkv + (t * B + b) * C3 + h * hs;
          float* a = att + ((b * NH + h) * T + t) * T;
          float maxv = -INFINITY;
          for (int64_t t2 = 0; t2 <= t; ++t2) {
            const float* k = qkv + (t2 * B + b) * C3 + C + h * hs;
            float dot = 0;
            for (int64_t i = 0; i < hs; ++i) dot += q[i] * k[i];
            a[t2] = dot * scale;
            maxv = std::max(maxv, a[t2]);
          }
          float sum = 0;
          for (int64_t t2 = 0; t2 <= t; ++t2) {
            a[t2] = std::exp(a[t2] - maxv);
            sum += a[t2];
          }
          const float inv = 1.0f / sum;
          for (int64_t t2 = 0; t2 < T; ++t2) a[t2] = t2 <= t ? a[t2] * inv : 0.0f;
          float* o = out + (t * B + b) * C + h * hs;
          for (int64_t i = 0; i < hs; ++i) o[i] = 0;
          for (int64_t t2 = 0; t2 <= t; ++t2) {
            const float* v = qkv + (t2 * B + b) * C3 + 2 * C + h * hs;
            for (int64_t i = 0; i < hs; ++i) o[i] += a[t2] * v[i];
          }
        }
  }

  void attention_backward(float* dqkv, float* datt, const float* dout, const float* qkv, const float* att, int64_t T,
                          int64_t B, int64_t NH, int64_t hs) override {
    const int64_t C = NH * hs, C3 = 3 * C;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
    zero(dqkv, T * B * C3);
    // Each (sequence, head) touches only its own rows' slices of dqkv: no two threads share one.
#pragma omp parallel for collapse(2) num_threads(threads_)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < NH; ++h)
        for (int64_t t = 0; t < T; ++t) {
          const float* a = att + ((b * NH + h) * T + t) * T;
          float* da = datt + ((b * NH + h) * T + t) * T;  // d(probabilities), then d(scores)
          const float* dy = dout + (t * B + b) * C + h * hs;
          for (int64_t t2 = 0; t2 <= t; ++t2) {
            const float* v = qkv + (t2 * B + b) * C3 + 2 * C + h * hs;
            float* dv = dqkv + (t2 * B + b) * C3 + 2 * C + h * hs;
            float d = 0;
            for (int64_t i = 0; i < hs; ++i) {
              d += v[i] * dy[i];
              dv[i] += a[t2] * dy[i];
            }
            da[t2] = d;
          }
          float dot = 0;  // softmax backward: dscore = a * (da - sum(a * da))
          for (int64_t t2 = 0; t2 <= t; ++t2) dot += a[t2] * da[t2];
          for (int64_t t2 = 0; t2 <= t; ++t2) da[t2] = a[t2] * (da[t2] - dot);
          const float* q = qkv + (t * B + b) * C3 + h * hs;
          float* dq = dqkv + (t * B + b) * C3 + h * hs;
          for (int64_t t2 = 0; t2 <= t; ++t2) {
            const float* k = qkv + (t2 * B + b) * C3 + C + h * hs;
            float* dk = dqkv + (t2 * B + b) * C3 + C + h * hs;
            const float g = da[t2] * scale;
            for (int64_t i = 0; i < hs; ++i) {
              dq[i] += g * k[i];
              dk[i] += g * q[i];
            }
          }
        }
  }

  void gelu(float* out, const float* inp, int64_t n) override {
    const float s = std::sqrt(2.0f / static_cast<float>(M_PI));
#pragma omp parallel for num_threads(threads_)
    for (int64_t i = 0; i < n; ++i) {
      const float x = inp[i];
      out[i] = 0.5f * x * (1.0f + std::tanh(s * (x + 0.044715f * x * x * x)));
    }
  }

  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) override {
    const float s = std::sqrt(2.0f / static_cast<float>(M_PI));
#pragma omp parallel for num_threads(threads_)
    for (int64_t i = 0; i < n; ++i) {
      const float x = inp[i];
      const float u = s * (x + 0.044715f * x * x * x);
      const float th = std::tanh(u);
      const float sech2 = 1.0f - th * th;
      const float grad = 0.5f * (1.0f + th) + 0.5f * x * sech2 * s * (1.0f + 3.0f * 0.044715f * x * x);
      dinp[i] = grad * dout[i];
    }
  }

  void add(float* out, const float* a, const float* b, int64_t n) override {
#pragma omp parallel for num_threads(threads_)
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
  }
  void accumulate(float* out, const float* a, int64_t n) override {
#pragma omp parallel for num_threads(threads_)
    for (int64_t i = 0; i < n; ++i) out[i] += a[i];
  }
  void add_bias(float* out, const float* bias, int64_t N, int64_t C) override {
#pragma omp parallel for num_threads(threads_)
    for (int64_t r = 0; r < N; ++r)
      for (int64_t i = 0; i < C; ++i) out[r * C + i] += bias[i];
  }
  void bias_backward(float* dbias, const float* dout, int64_t N, int64_t C) override {
#pragma omp parallel for num_threads(threads_)
    for (int64_t i = 0; i < C; ++i) {
      float s = 0;
      for (int64_t r = 0; r < N; ++r) s += dout[r * C + i];
      dbias[i] += s;
    }
  }
  void scale(float* p, float s, int64_t n) override {
#pragma omp parallel for num_threads(threads_)
    for (int64_t i = 0; i < n; ++i) p[i] *= s;
  }

  void embed(float* out, const int32_t* tokens, const float* wte, int64_t v0, int64_t Vl, const float* wpe, int64_t t0,
             int64_t N, int64_t B, int64_t C) override {
#pragma omp parallel for num_threads(threads_)
    for (int64_t r = 0; r < N; ++r) {
      const int64_t v = static_cast<int64_t>(tokens[r]) - v0;
      const float* e = v >= 0 && v < Vl ? wte + v * C : nullptr;
      const float* p = wpe ? wpe + (t0 + r / B) * C : nullptr;
      float* o = out + r * C;
      for (int64_t i = 0; i < C; ++i) o[i] = (e ? e[i] : 0.0f) + (p ? p[i] : 0.0f);
    }
  }
  void embed_backward(float* dwte, const int32_t* tokens, const float* dout, int64_t v0, int64_t Vl, int64_t N,
                      int64_t C) override {
    // Rows with the same token add into one row of dwte: split the work by channel.
#pragma omp parallel for num_threads(threads_)
    for (int64_t i = 0; i < C; ++i)
      for (int64_t r = 0; r < N; ++r) {
        const int64_t v = static_cast<int64_t>(tokens[r]) - v0;
        if (v >= 0 && v < Vl) dwte[v * C + i] += dout[r * C + i];
      }
  }
  void position_backward(float* dwpe, const float* dout, int64_t t0, int64_t N, int64_t B, int64_t C) override {
#pragma omp parallel for num_threads(threads_)
    for (int64_t i = 0; i < C; ++i)
      for (int64_t r = 0; r < N; ++r) dwpe[(t0 + r / B) * C + i] += dout[r * C + i];
  }

  void row_max(float* maxv, const float* logits, int64_t N, int64_t Vl) override {
#pragma omp parallel for num_threads(threads_)
    for (int64_t r = 0; r < N; ++r) {
      float m = -INFINITY;
      for (int64_t v = 0; v < Vl; ++v) m = std::max(m, logits[r * Vl + v]);
      maxv[r] = m;
    }
  }
  void row_sum_exp(float* sum, const float* logits, const float* maxv, int64_t N, int64_t Vl) override {
#pragma omp parallel for num_threads(threads_)
    for (int64_t r = 0; r < N; ++r) {
      float s = 0;
      for (int64_t v = 0; v < Vl; ++v) s += std::exp(logits[r * Vl + v] - maxv[r]);
      sum[r] = s;
    }
  }
  void target_logit(float* out, const float* logits, const int32_t* targets, int64_t v0, int64_t N,
                    int64_t Vl) override {
    for (int64_t r = 0; r < N; ++r) {
      const int64_t v = static_cast<int64_t>(targets[r]) - v0;
      out[r] = v >= 0 && v < Vl ? logits[r * Vl + v] : 0.0f;
    }
  }
  double mean_loss(const float* maxv, const float* sum, const float* target, int64_t N) override {
    double total = 0;
    for (int64_t r = 0; r < N; ++r) total += std::log(static_cast<double>(sum[r])) + maxv[r] - target[r];
    return N > 0 ? total / static_cast<double>(N) : 0.0;
  }
  void cross_entropy_backward(float* dlogits, const float* logits, const float* maxv, const float* sum,
                              const int32_t* targets, int64_t v0, float scale, int64_t N, int64_t Vl) override {
#pragma omp parallel for num_threads(threads_)
    for (int64_t r = 0; r < N; ++r) {
      const float inv = 1.0f / sum[r];
      const int64_t target = static_cast<int64_t>(targets[r]) - v0;
      for (int64_t v = 0; v < Vl; ++v) {
        const float p = std::exp(logits[r * Vl + v] - maxv[r]) * inv;
        dlogits[r * Vl + v] = (p - (v == target ? 1.0f : 0.0f)) * scale;
      }
    }
  }

  double sum_squares(const float* p, int64_t n) override {
    double s = 0;
#pragma omp parallel for reduction(+ : s) num_threads(threads_)
    for (int64_t i = 0; i < n; ++i) s += static_cast<double>(p[i]) * p[i];
    return s;
  }

  void adamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1, float beta2, float eps,
             float wd, int step, float grad_scale) override {
    // The fused ZeRO step's loop (tutti/fused.hpp), so every layout updates with the same floats.
    tutti::fused::AdamW opt;
    opt.lr = lr;
    opt.beta1 = beta1;
    opt.beta2 = beta2;
    opt.eps = eps;
    opt.weight_decay = wd;
    opt.step = step;
    const int64_t block = (n + threads_ - 1) / std::max(threads_, 1);
#pragma omp parallel for num_threads(threads_)
    for (int t = 0; t < threads_; ++t) {
      const int64_t lo = std::min(n, t * block), hi = std::min(n, lo + block);
      if (hi > lo) tutti::fused::adamw(p + lo, g + lo, m + lo, v + lo, hi - lo, opt, grad_scale);
    }
  }

  int32_t* alloc_tokens(int64_t n) override {
    auto* p = static_cast<int32_t*>(std::aligned_alloc(64, round64(n * sizeof(int32_t))));
    if (!p) throw std::bad_alloc();
    return p;
  }
  void release_tokens(int32_t* p) override { std::free(p); }
  void upload_tokens(int32_t* dst, const int32_t* host, int64_t n) override {
    if (n > 0) std::memcpy(dst, host, static_cast<size_t>(n) * sizeof(int32_t));
  }

 private:
  // f(first, count) over `threads_` contiguous blocks of [0, n), in parallel.
  template <class F>
  void blocks(int64_t n, F f) {
    const int64_t k = std::max<int64_t>(1, std::min<int64_t>(threads_, n / 16));
#pragma omp parallel for num_threads(static_cast<int>(k))
    for (int64_t i = 0; i < k; ++i) {
      const int64_t b = n * i / k, e = n * (i + 1) / k;
      if (e > b) f(b, e - b);
    }
  }
  static size_t round64(int64_t bytes) { return static_cast<size_t>(std::max<int64_t>(64, (bytes + 63) / 64 * 64)); }
  // OpenBLAS takes 32-bit dimensions: refuse what does not fit rather than wrap.
  static blasint blas(int64_t n) {
    if (n < 0 || n > std::numeric_limits<blasint>::max())
      throw std::length_error("a matrix dimension does not fit OpenBLAS's 32-bit sizes");
    return static_cast<blasint>(n);
  }
  int threads_;
};

}  // namespace

std::unique_ptr<Ops> make_cpu_ops(int threads) { return std::make_unique<CpuOps>(threads); }

#ifndef TUTTI_TRAINER_CUDA
std::unique_ptr<Ops> make_cuda_ops(int, bool) {
  throw InvalidUsage("tutti-train: this build has no CUDA (configure with the CUDA toolkit for --device cuda)");
}
#endif

}  // namespace tutti::train
