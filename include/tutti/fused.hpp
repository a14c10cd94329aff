#pragma once
// Fused compute + communication: operations whose plan runs kernels on chunks as soon as their data
// is there, verified like every plan (DESIGN.md 7). Each has an unfused reference built from plain
// collectives plus the same kernels, which its tests and benchmark compare it with. The two give the
// same floats wherever the reductions add in the same order: always for 2 ranks; for more, the
// fused plans add the ranks' contributions in rank order and the library's collectives in their
// own, so they agree bit for bit on data whose sums are exact in any order (the tests' small
// integers) and to rounding otherwise.
//
// The ZeRO optimizer step (ZeRO-1/2): the gradients are reduce-scattered, each rank unscales its
// shard and sums its squares (clipping and the non-finite check need the global norm), the ranks
// exchange those sums, each rank runs AdamW on the shard it owns, and the updated parameters are
// all-gathered, chunk by chunk as AdamW finishes them. The compiler proves the plan computes, for
// every parameter chunk, adamw(unscale(sum over ranks of the gradient chunk), m, v, p, norm).
//
//   tutti::fused::ZeroStep step(comm, shard);           // compiles and verifies the plan once
//   tutti::fused::AdamW opt{.lr = 3e-4f, .step = 1, .max_norm = 1.0f};
//   step.run(grads, params, m, v, opt).wait();           // grads, params: size() * shard floats
//   double norm = step.last_norm();                      // once the Work is done
//
// Host float32 buffers. Kernels: "zero.unscale_sumsq", "zero.unscale_sumsq_acc", "zero.adamw"
// (tutti/kernel.hpp), registered by register_kernels(), which ZeroStep calls.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tutti/plan.hpp"
#include "tutti/tutti.hpp"

namespace tutti::fused {

// The fused operations' kernels, registered once in the process (plans that name them can then be
// loaded from JSON). Idempotent, thread-safe.
void register_kernels();

// AdamW as PyTorch's torch.optim.AdamW (decoupled weight decay, bias correction), after clipping
// the global gradient norm to max_norm (0: no clipping, as torch.nn.utils.clip_grad_norm_).
struct AdamW {
  float lr = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
  int64_t step = 1;          // 1 for the first step (bias correction)
  float max_norm = 0.0f;
  float grad_scale = 1.0f;   // gradients are multiplied by it first (1 / the loss scale)
};

// AdamW on n parameters in place, gradients times `clip` (opt.max_norm and opt.grad_scale are not
// used): the element loop every fused step runs, vectorised, for callers that update parameters
// themselves and want the same floats (the trainer's unsharded optimizer).
void adamw(float* p, const float* g, float* m, float* v, int64_t n, const AdamW& opt, float clip);

class ZeroStep {
 public:
  // `shard`: parameters each rank owns; `pieces`: chunks per shard that flow through the pipeline
  // (0: about 256 KiB each). Compiles and verifies the plan; throws InvalidArgument if it fails.
  ZeroStep(Comm& comm, int64_t shard, int pieces = 0);

  // grads: size() * shard gradients, summed over the ranks as they arrive; afterwards this rank's
  // slice (rank() * shard ...) holds the unscaled sum and the rest is unspecified. params: size() *
  // shard parameters, the same on every rank before and after. m, v: this rank's shard of the
  // moments. When the summed gradients hold a non-finite value, nothing is updated (a skipped
  // step, as a loss scaler's) and last_finite() says so. One call at a time per ZeroStep.
  Work run(float* grads, float* params, float* m, float* v, const AdamW& opt);
  // The same result from plain collectives and passes over the shard, one after another. Blocks
  // until done. Two forms, the same floats:
  // - kTorch: what a PyTorch ZeRO step runs: a reduce-scatter; the loss scaler's unscale with its
  //   non-finite check (one pass, torch._amp_foreach_non_finite_check_and_unscale_) and an
  //   all-reduce of the flag; clip_grad_norm_'s sum of squares (a pass), the sums' all-gather and
  //   its scaling of the gradients (a pass); a fused AdamW (a pass); an all-gather of the
  //   parameters.
  // - kOnePass: the same with this library's kernels: unscale and sum of squares in one pass, the
  //   clipping inside AdamW (so only the collectives and the pipelining are not fused).
  enum class Unfused { kTorch, kOnePass };
  void run_unfused(float* grads, float* params, float* m, float* v, const AdamW& opt, Unfused form = Unfused::kTorch);

  // Mixed precision: AdamW on this rank's fp32 master shard, the result cast to bfloat16 on the
  // way, and the bf16 parameters (half the bytes) all-gathered into params16 (size() * shard
  // values). The shard's pieces must be even.
  Work run_bf16(float* grads, float* master, float* m, float* v, uint16_t* params16, const AdamW& opt);
  // The same as PyTorch runs it (kTorch's passes, then a cast pass and an all-gather of bf16).
  void run_bf16_unfused(float* grads, float* master, float* m, float* v, uint16_t* params16, const AdamW& opt);

  // Of the last call, once it is done: the global norm of the unscaled gradients, and whether it
  // is finite (false: the step was skipped).
  double last_norm() const;
  bool last_finite() const;

  // The step in two halves, for a trainer whose gradient norm spans more than this group (several
  // parameter groups, tensor parallelism): reduce() each group as backward finishes it, add the
  // groups' local_sum_squares() over every dimension, then update() each group with the clip.
  //
  // reduce: the in-place reduce-scatter of grads, each chunk unscaled (times grad_scale, e.g.
  // 1 / size() for a mean) and its squares summed as it is reduced.
  Work reduce(float* grads, float grad_scale);
  // The sum of squares of this rank's unscaled slice, once reduce()'s Work is done.
  double local_sum_squares() const;
  // update: AdamW on this rank's slice of grads (as reduce left it), times `clip`, into master, m
  // and v (this rank's shard each), and each updated chunk all-gathered into params (size() *
  // shard) as it is done. decay: per-parameter multipliers of opt.weight_decay (0 or 1: which
  // tensors decay); null: all 1. opt.max_norm and opt.grad_scale are not used (clip is given).
  Work update(const float* grads, float* master, float* m, float* v, float* params, const float* decay,
              const AdamW& opt, float clip);

  const CompiledPlan& plan() const { return plan_; }
  int pieces() const { return pieces_; }

 private:
  Comm& comm_;
  int64_t shard_;
  int pieces_;
  CompiledPlan plan_, reduce_plan_, update_plan_, bf16_plan_;  // all but plan_ compiled on first use
  std::unique_ptr<float[]> stats_;  // [0]: the global sum of squares; [1 + r]: rank r's
  std::vector<float> ones_;         // update()'s decay multipliers when none are given
  // The unfused forms: the passes up to the optimizer (returns its scalars), and AdamW.
  std::vector<double> unfused_to_optimizer(float* grads, const AdamW& opt, Unfused form);
  void unfused_adamw(const float* mine, float* master, float* m, float* v, const std::vector<double>& scalars);
};

// The mixed-precision step's program (ZeroStep::run_bf16): pieces of `piece` parameters (even).
dsl::Program zero_step_bf16_program(int nranks, int pieces, int64_t piece);
// The halves' programs (ZeroStep::reduce: state buffer stats, size() floats, scalar the gradient
// scale; ZeroStep::update: state buffers master, m, v, params, decay, scalars lr, beta1, beta2, eps,
// weight decay, step, clip).
dsl::Program zero_reduce_program(int nranks, int pieces);
dsl::Program zero_update_program(int nranks, int pieces);

// The epilogue of a row-parallel linear layer (Megatron-LM's): the ranks' partial outputs are
// summed, then out = residual + dropout(sum + bias), and optionally ln = LayerNorm(out). Fused, each
// rank sums one block of rows, applies the epilogue to it at once, and (all-reduce form) all-gathers
// the finished rows: the epilogue runs on 1/size() of the rows per rank instead of all of them. The
// sequence-parallel form is a reduce-scatter: each rank keeps its rows/size() rows.
//
// Dropout keeps element i of the rows x hidden tensor when a hash of (seed, i) says so, and scales
// kept elements by 1 / (1 - p): the same mask whichever rank computes the element.
struct EpilogueOptions {
  float dropout = 0.0f;        // probability of dropping an element
  uint64_t seed = 0;           // the dropout mask's
  bool layer_norm = false;     // also ln = (out - mean) / sqrt(var + eps) * gamma + beta, per row
  float ln_eps = 1e-5f;
  bool sequence_parallel = false;  // reduce-scatter form
};

class BiasDropoutResidual {
 public:
  // rows x hidden activations; `pieces`: row blocks per rank in the pipeline (0: about 256 KiB).
  // rows must split into size() * pieces blocks. Compiles and verifies the plan.
  BiasDropoutResidual(Comm& comm, int64_t rows, int64_t hidden, const EpilogueOptions& options, int pieces = 0);

  // partial: rows x hidden, this rank's partial sums (summed over the ranks in place: afterwards
  // unspecified). bias, gamma, beta: hidden. residual, out, ln: rows x hidden, or this rank's rows /
  // size() x hidden in the sequence-parallel form. residual and bias are the same on every rank in
  // the all-reduce form (tensor parallelism replicates them). ln, gamma, beta: with layer_norm only.
  Work run(float* partial, const float* bias, const float* residual, float* out, const float* gamma = nullptr,
           const float* beta = nullptr, float* ln = nullptr);
  // The same from an all-reduce (or reduce-scatter) and the epilogue over the rows after it.
  void run_unfused(float* partial, const float* bias, const float* residual, float* out, const float* gamma = nullptr,
                   const float* beta = nullptr, float* ln = nullptr);

  const CompiledPlan& plan() const { return plan_; }
  int pieces() const { return pieces_; }

 private:
  Comm& comm_;
  int64_t rows_, hidden_;
  EpilogueOptions options_;
  int pieces_;
  CompiledPlan plan_;
};

dsl::Program bias_dropout_residual_program(int nranks, int pieces, int64_t hidden, const EpilogueOptions& options);

// Linear layers under sequence parallelism (Megatron-LM's), with the GEMM cut into row blocks that
// flow through the collective as they are finished or arrive. GEMMs are OpenBLAS's (sgemm, row
// major); set OPENBLAS_NUM_THREADS as for any program with several ranks per host.
//
// Row-parallel: out = reduce_scatter(x @ w). x: rows x k (this rank's slice of the features), w:
// k x n; out: rows / size() x n, the sum over the ranks of their products' rows for this rank.
// Fused, each rank computes the blocks of the other ranks' rows first, sending each as it is done,
// and its own last, so the sends run under the GEMM.
class GemmReduceScatter {
 public:
  GemmReduceScatter(Comm& comm, int64_t rows, int64_t k, int64_t n, int pieces = 0);
  Work run(const float* x, const float* w, float* out);
  void run_unfused(const float* x, const float* w, float* out);  // the GEMM, then reduce_scatter
  const CompiledPlan& plan() const { return plan_; }
  int pieces() const { return pieces_; }

 private:
  Comm& comm_;
  int64_t rows_, k_, n_;
  int pieces_;
  CompiledPlan plan_;
  std::vector<float> product_;  // the unfused GEMM's rows x n
};

// Column-parallel: gathered = all_gather(x); y = gathered @ w. x: rows / size() x k (this rank's
// rows), w: k x n (this rank's slice of the outputs); gathered: rows x k, y: rows x n. Fused, the
// GEMM runs on each block of rows as it arrives (this rank's own first).
class AllGatherGemm {
 public:
  AllGatherGemm(Comm& comm, int64_t rows, int64_t k, int64_t n, int pieces = 0);
  Work run(const float* x, const float* w, float* gathered, float* y);
  void run_unfused(const float* x, const float* w, float* gathered, float* y);  // all_gather, then the GEMM
  const CompiledPlan& plan() const { return plan_; }
  int pieces() const { return pieces_; }

 private:
  Comm& comm_;
  int64_t rows_, k_, n_;
  int pieces_;
  CompiledPlan plan_;
};

// c = a @ b (rows x k by k x n, row major): the GEMM the fused operations run on each block.
void gemm(const float* a, const float* b, float* c, int64_t rows, int64_t k, int64_t n);

dsl::Program gemm_reduce_scatter_program(int nranks, int pieces, int64_t rows, int64_t k, int64_t n);
dsl::Program all_gather_gemm_program(int nranks, int pieces, int64_t rows, int64_t k, int64_t n);

// Mixture-of-experts dispatch and combine over an expert-parallel group (one rank's experts per
// rank), with a fixed capacity of `capacity` token slots from each rank to each rank (GShard's;
// unused slots have index -1). Per rank: `tokens` rows of `hidden`.
//
// dispatch: expert_in block r (capacity x hidden) on rank q = the rows of rank r's x that rank r
//   routes to q, gathered by index[q] (int32, capacity per destination) as each block is sent.
// combine: y = sum over the blocks that come back of gate * expert_out row, scattered to the token
//   each slot came from, weighted as each block arrives (own block first, then rank + 1, ...).
class MoeExchange {
 public:
  MoeExchange(Comm& comm, int64_t tokens, int64_t hidden, int64_t capacity);
  // x: tokens x hidden; index: size() x capacity int32 (slot -> token, -1: empty); expert_in:
  // size() x capacity x hidden.
  Work dispatch(const float* x, const int32_t* index, float* expert_in);
  // expert_out: size() x capacity x hidden (block r: the outputs for rank r's tokens); gate:
  // size() x capacity, the weights of index's slots; y: tokens x hidden (written whole: 0 where no
  // slot points).
  Work combine(const float* expert_out, const float* gate, const int32_t* index, float* y);
  // The same from all_to_all and separate gather / weighted scatter passes.
  void dispatch_unfused(const float* x, const int32_t* index, float* expert_in);
  void combine_unfused(const float* expert_out, const float* gate, const int32_t* index, float* y);
  const CompiledPlan& dispatch_plan() const { return dispatch_; }
  const CompiledPlan& combine_plan() const { return combine_; }

 private:
  Comm& comm_;
  int64_t tokens_, hidden_, capacity_;
  CompiledPlan dispatch_, combine_;
  std::vector<float> staging_;  // the unfused forms' grouped tokens
};

dsl::Program moe_dispatch_program(int nranks, int64_t tokens, int64_t hidden, int64_t capacity);
dsl::Program moe_combine_program(int nranks, int64_t tokens, int64_t hidden, int64_t capacity);

// The DSL program of the fused step for `nranks` ranks and `pieces` chunks per shard (what ZeroStep
// compiles; tutti-compile and the tests use it too).
dsl::Program zero_step_program(int nranks, int pieces);
// What a call of that program's plan passes as its per-call scalars (PlanCall::scalars), in slot
// order: the gradient scale, then AdamW's lr, beta1, beta2, eps, weight decay, step and max norm.
// Its state buffers, in order: params (size() * shard), m, v (the shard), stats (size() + 1 floats).
std::vector<double> zero_step_scalars(const AdamW& opt);

}  // namespace tutti::fused
