#pragma once
// The compute kernels of the GPT (trainer/gpt.hpp), behind one small interface so the model code
// runs on the CPU (trainer/ops_cpu.cpp: OpenBLAS GEMMs, OpenMP loops) and on CUDA alike. Pointers
// are the backend's memory (host memory on the CPU); sizes are elements, 64-bit.
//
// Activations are rows of a matrix, row r = t * B + b for position t of sequence b (sequence-major,
// as Megatron's [s, b, h]): a split of the sequence over ranks is then a contiguous block of rows.
// "+=" marks outputs that accumulate (gradients); everything else is overwritten.

#include <cstdint>
#include <memory>

namespace tutti::train {

class Ops {
 public:
  virtual ~Ops() = default;
  virtual const char* name() const = 0;

  virtual float* alloc(int64_t n) = 0;  // zero-filled
  virtual void release(float* p) = 0;
  virtual void upload(float* dst, const float* host, int64_t n) = 0;
  virtual void download(float* host, const float* src, int64_t n) = 0;
  virtual void zero(float* p, int64_t n) = 0;
  virtual void copy(float* dst, const float* src, int64_t n) = 0;
  // The contents are no longer needed: they read as zero from now on, and the memory may go back to
  // the system until then (the CPU returns the whole pages inside; ZeRO-2/3 release shards this way).
  virtual void discard(float* p, int64_t n) { zero(p, n); }

  // out[N][OC] = inp[N][C] . w[OC][C]^T (+ bias[OC])
  virtual void matmul(float* out, const float* inp, const float* w, const float* bias, int64_t N, int64_t C,
                      int64_t OC) = 0;
  // dinp[N][C] = dout . w; dw += dout^T . inp; dbias += column sums of dout (each skipped when null)
  virtual void matmul_backward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp,
                               const float* w, int64_t N, int64_t C, int64_t OC) = 0;
  // out = (inp - mean) * rstd * w + b per row, saving mean and rstd (eps 1e-5, as PyTorch's default)
  virtual void layernorm(float* out, float* mean, float* rstd, const float* inp, const float* w, const float* b,
                         int64_t N, int64_t C) = 0;
  // dinp += ..., dw += ..., db += ...
  virtual void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                                  const float* w, const float* mean, const float* rstd, int64_t N, int64_t C) = 0;
  // Causal self-attention of NH heads of size hs over qkv[N][3 * NH * hs] (q, k, v blocks, each
  // head-major): out[N][NH * hs]; att[B][NH][T][T] keeps the probabilities for backward.
  virtual void attention(float* out, float* att, const float* qkv, int64_t T, int64_t B, int64_t NH, int64_t hs) = 0;
  // dqkv = ...; datt is scratch of att's size
  virtual void attention_backward(float* dqkv, float* datt, const float* dout, const float* qkv, const float* att,
                                  int64_t T, int64_t B, int64_t NH, int64_t hs) = 0;
  // GELU, tanh approximation (GPT-2's)
  virtual void gelu(float* out, const float* inp, int64_t n) = 0;
  virtual void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) = 0;
  virtual void add(float* out, const float* a, const float* b, int64_t n) = 0;  // out = a + b
  virtual void accumulate(float* out, const float* a, int64_t n) = 0;         // out += a
  virtual void add_bias(float* out, const float* bias, int64_t N, int64_t C) = 0;   // out[r] += bias
  virtual void bias_backward(float* dbias, const float* dout, int64_t N, int64_t C) = 0;  // dbias += column sums
  virtual void scale(float* p, float s, int64_t n) = 0;

  // Embeddings of the rows: token ids in [v0, v0 + Vl) look up wte (rows of the rank's vocabulary
  // slice), others give 0; then wpe's row of the position is added when wpe is not null. Rows are
  // positions t0 + r / B.
  virtual void embed(float* out, const int32_t* tokens, const float* wte, int64_t v0, int64_t Vl, const float* wpe,
                     int64_t t0, int64_t N, int64_t B, int64_t C) = 0;
  virtual void embed_backward(float* dwte, const int32_t* tokens, const float* dout, int64_t v0, int64_t Vl,
                              int64_t N, int64_t C) = 0;  // dwte += ...
  virtual void position_backward(float* dwpe, const float* dout, int64_t t0, int64_t N, int64_t B,
                                 int64_t C) = 0;  // dwpe += ...

  // Cross-entropy over a vocabulary split across ranks (Megatron's vocab-parallel loss). Per row of
  // logits[N][Vl]: its maximum; the sum of exp(logit - max) given the (all-reduced) maximum; the
  // target's logit where the target is in [v0, v0 + Vl), else 0.
  virtual void row_max(float* maxv, const float* logits, int64_t N, int64_t Vl) = 0;
  virtual void row_sum_exp(float* sum, const float* logits, const float* maxv, int64_t N, int64_t Vl) = 0;
  virtual void target_logit(float* out, const float* logits, const int32_t* targets, int64_t v0, int64_t N,
                            int64_t Vl) = 0;
  // The mean over rows of log(sum) + max - target, in double.
  virtual double mean_loss(const float* maxv, const float* sum, const float* target, int64_t N) = 0;
  // dlogits = (softmax - onehot(target)) * scale; may be logits itself.
  virtual void cross_entropy_backward(float* dlogits, const float* logits, const float* maxv, const float* sum,
                                      const int32_t* targets, int64_t v0, float scale, int64_t N, int64_t Vl) = 0;

  virtual double sum_squares(const float* p, int64_t n) = 0;
  // PyTorch's AdamW on n elements: p -= lr * wd * p; m, v updated; p -= lr / (1 - b1^t) * m /
  // (sqrt(v) / sqrt(1 - b2^t) + eps), with the gradient scaled by grad_scale first.
  virtual void adamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                     float eps, float wd, int step, float grad_scale) = 0;

  // Token ids, which live in the backend's memory too.
  virtual int32_t* alloc_tokens(int64_t n) = 0;
  virtual void release_tokens(int32_t* p) = 0;
  virtual void upload_tokens(int32_t* dst, const int32_t* host, int64_t n) = 0;
};

// threads: OpenMP threads and OpenBLAS threads of this process (0: OpenMP's default).
std::unique_ptr<Ops> make_cpu_ops(int threads);
// Only in CUDA builds; throws InvalidUsage without a device. bf16: the linear layers multiply
// bfloat16-rounded operands on the tensor cores (float32 accumulation, float32 master weights).
std::unique_ptr<Ops> make_cuda_ops(int device, bool bf16 = false);

}  // namespace tutti::train
