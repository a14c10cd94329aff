// The fused epilogue of a row-parallel linear layer (tutti/fused.hpp): all-reduce or reduce-scatter
// -> bias + dropout + residual (+ LayerNorm). Its kernels, its program with the postcondition the
// compiler proves, and the unfused reference.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "core/datatype.hpp"
#include "core/error.hpp"
#include "fused_kernels/common.hpp"
#include "fused_kernels/epilogue_kernels.hpp"
#include "tutti/fused.hpp"
#include "tutti/kernel.hpp"

namespace tutti::fused {
namespace {

// The seed travels as two exact 32-bit halves (a double holds 53 bits, a seed 64).
enum Slot : int { kDropout, kSeedHigh, kSeedLow, kLnEps, kSlots };

// out = residual + dropout(y + bias) on whole rows; returns the row length (the bias's).
int64_t bias_dropout_add(const KernelArgs& a, float* out) {
  const auto* y = static_cast<const float*>(a.inputs[0]);
  const auto* bias = static_cast<const float*>(a.inputs[1]);
  const auto* residual = static_cast<const float*>(a.inputs[2]);
  const int64_t hidden = a.input_counts ? a.input_counts[1] : 0;
  if (hidden <= 0 || a.count % hidden != 0 || a.offset % hidden != 0)
    throw InvalidArgument(fmt::format("kernel 'fused.bias_dropout_residual': {} elements at {} are not whole rows of {}",
                                      a.count, a.offset, hidden));
  if (a.input_counts[2] != a.count || (a.output_counts && a.output_counts[0] != a.count))
    throw InvalidArgument(fmt::format("kernel 'fused.bias_dropout_residual': {} elements, but the residual holds {} and "
                                      "the output {}",
                                      a.count, a.input_counts[2], a.output_counts ? a.output_counts[0] : a.count));
  const double p = a.scalars[kDropout];
  BiasDropoutArgs args{y, bias, residual, out, a.count, hidden, p > 0,
                       (static_cast<uint64_t>(a.scalars[kSeedHigh]) << 32) | static_cast<uint64_t>(a.scalars[kSeedLow]),
                       static_cast<uint64_t>(a.offset), static_cast<uint32_t>(std::min(p, 1.0) * 16777216.0),
                       p < 1 ? static_cast<float>(1.0 / (1.0 - p)) : 0.0f};
  bias_dropout_add_rows(args);
  return hidden;
}

// inputs {y, bias, residual}, outputs {out}; scalars {dropout, seed}.
void bdr(const KernelArgs& a) {
  require_float(a, "fused.bias_dropout_residual");
  bias_dropout_add(a, static_cast<float*>(a.outputs[0]));
}

// inputs {y, bias, residual, gamma, beta}, outputs {out, ln}; scalars {dropout, seed, eps}.
void bdr_ln(const KernelArgs& a) {
  require_float(a, "fused.bias_dropout_residual_ln");
  auto* out = static_cast<float*>(a.outputs[0]);
  auto* ln = static_cast<float*>(a.outputs[1]);
  const auto* gamma = static_cast<const float*>(a.inputs[3]);
  const auto* beta = static_cast<const float*>(a.inputs[4]);
  if (a.input_counts && (a.input_counts[3] != a.input_counts[1] || a.input_counts[4] != a.input_counts[1] ||
                         (a.output_counts && a.output_counts[1] != a.count)))
    throw InvalidArgument(fmt::format("kernel 'fused.bias_dropout_residual_ln': gamma and beta hold {} and {} of {}, "
                                      "ln {} of {}",
                                      a.input_counts[3], a.input_counts[4], a.input_counts[1],
                                      a.output_counts ? a.output_counts[1] : a.count, a.count));
  const int64_t hidden = bias_dropout_add(a, out);
  layer_norm_rows(out, gamma, beta, ln, a.count, hidden, static_cast<float>(a.scalars[kLnEps]));
}

struct KernelIds {
  KernelId bdr, bdr_ln;
};

const KernelIds& ids() {
  static const KernelIds k = [] {
    // Mixed units: the bias, gamma and beta are rows (state buffers of unit hidden).
    return KernelIds{
        register_once({"fused.bias_dropout_residual", {"dropout", "seed_high", "seed_low"}, bdr, 1.5, 3, 1}, true,
                      DeviceKernel::kBiasDropoutResidual),
        register_once(
            {"fused.bias_dropout_residual_ln", {"dropout", "seed_high", "seed_low", "eps"}, bdr_ln, 3.0, 5, 2}, true,
            DeviceKernel::kBiasDropoutResidualLn),
    };
  }();
  return k;
}

std::vector<ScalarArg> scalars_for(bool ln) {
  std::vector<ScalarArg> s = {ScalarArg::per_call(kDropout), ScalarArg::per_call(kSeedHigh), ScalarArg::per_call(kSeedLow)};
  if (ln) s.push_back(ScalarArg::per_call(kLnEps));
  return s;
}

std::vector<double> call_scalars(const EpilogueOptions& o) {
  return {o.dropout, static_cast<double>(o.seed >> 32), static_cast<double>(o.seed & 0xFFFFFFFFu), o.ln_eps};
}

// State buffers, in order (gamma and beta with LayerNorm only).
enum State : int { kBias, kResidual, kLn, kGamma, kBeta };


}  // namespace

dsl::Program bias_dropout_residual_program(int n, int K, int64_t hidden, const EpilogueOptions& o) {
  TUTTI_CHECK(n >= 1 && K >= 1 && hidden >= 1, InvalidArgument,
              "bias_dropout_residual_program: {} ranks, {} pieces, hidden {}", n, K, hidden);
  const KernelIds& k = ids();
  const bool sp = o.sequence_parallel, ln = o.layer_norm;
  const KernelId kernel = ln ? k.bdr_ln : k.bdr;
  const std::vector<ScalarArg> scalars = scalars_for(ln);
  // out (and ln) of row block c, computed by its owner q = c / K from the summed partials.
  auto result = [=](int c, int output) {
    Content sum;
    for (int r = 0; r < n; ++r) sum.merge(Content::of(r, c));
    const int q = c / K, local = sp ? c % K : c;
    std::vector<Content> args = {sum, Content::of_state(q, kBias, 0), Content::of_state(q, kResidual, local)};
    if (ln) args.push_back(Content::of_state(q, kGamma, 0)), args.push_back(Content::of_state(q, kBeta, 0));
    return std::optional<Content>(Content::apply(kernel, args, scalars, output));
  };
  const int blocks = n * K, mine = sp ? K : n * K;  // rows blocks in all, and in this rank's out
  CollectiveSpec s;
  s.kind = Collective::kCustom;
  s.nranks = n;
  s.chunk_factor = blocks;
  s.custom_input_chunks = blocks;
  s.custom_output_chunks = mine;
  s.custom_post = [=](int q, int i) { return result(sp ? q * K + i : i, 0); };
  s.states = {StateBufferSpec{"bias", 1, hidden, {}}, StateBufferSpec{"residual", mine, 0, {}},
              StateBufferSpec{"ln", ln ? mine : 0, 0, [=](int q, int i) { return result(sp ? q * K + i : i, 1); }}};
  if (ln) s.states.push_back(StateBufferSpec{"gamma", 1, hidden, {}}), s.states.push_back(StateBufferSpec{"beta", 1, hidden, {}});
  dsl::Program p(fmt::format("bias_dropout_residual{}{}_n{}_k{}", sp ? "_sp" : "", ln ? "_ln" : "", n, K), s);
  const dsl::Buffer in = dsl::Buffer::input(), out = dsl::Buffer::output();
  for (int q = 0; q < n; ++q)
    for (int j = 0; j < K; ++j) {
      const int c = q * K + j, local = sp ? j : c;
      // The block's sum, on its owner, in place in its partials.
      auto y = p.chunk(q, in, c);
      for (int r = 0; r < n; ++r)
        if (r != q) y.reduce(p.chunk(r, in, c));
      std::vector<dsl::ChunkRef> args = {y, p.chunk(q, dsl::Buffer::state("bias"), 0),
                                         p.chunk(q, dsl::Buffer::state("residual"), local)};
      std::vector<dsl::ChunkRef> results = {p.chunk(q, out, local)};
      if (ln) {
        args.push_back(p.chunk(q, dsl::Buffer::state("gamma"), 0));
        args.push_back(p.chunk(q, dsl::Buffer::state("beta"), 0));
        results.push_back(p.chunk(q, dsl::Buffer::state("ln"), local));
      }
      p.apply(kernel, args, results, scalars);
      if (sp) continue;
      // The finished rows to every other rank.
      for (int r = 0; r < n; ++r)
        if (r != q) {
          p.chunk(q, out, c).copy(r, out, c);
          if (ln) p.chunk(q, dsl::Buffer::state("ln"), c).copy(r, dsl::Buffer::state("ln"), c);
        }
    }
  return p;
}

BiasDropoutResidual::BiasDropoutResidual(Comm& comm, int64_t rows, int64_t hidden, const EpilogueOptions& options,
                                         int pieces)
    : comm_(comm), rows_(rows), hidden_(hidden), options_(options) {
  const int n = comm.size();
  TUTTI_CHECK(rows >= 1 && hidden >= 1 && rows % n == 0, InvalidArgument,
              "rank {}: BiasDropoutResidual: {} rows of {} do not split over {} ranks", comm.rank(), rows, hidden, n);
  // About 512 KiB a piece: with the kernels vectorised, pieces of 256 KiB (32 per rank at GPT-2's
  // 8192 x 768 on 2 ranks) cost the pipeline more than they hid; 8-16 pieces ran 10-25 % faster
  // (docs/PERFORMANCE.md, "Vectorised epilogue").
  pieces_ = pieces > 0 ? pieces : pieces_for(rows / n, hidden * static_cast<int64_t>(sizeof(float)), 512 << 10, 256);
  TUTTI_CHECK((rows / n) % pieces_ == 0, InvalidArgument,
              "rank {}: BiasDropoutResidual: {} rows per rank do not split into {} pieces", comm.rank(), rows / n, pieces_);
  TUTTI_CHECK(options.dropout >= 0 && options.dropout < 1, InvalidArgument,
              "rank {}: BiasDropoutResidual: dropout {} is not in [0, 1)", comm.rank(), options.dropout);
  plan_ = compile_plan(bias_dropout_residual_program(n, pieces_, hidden, options));
}

Work BiasDropoutResidual::run(float* partial, const float* bias, const float* residual, float* out, const float* gamma,
                              const float* beta, float* ln) {
  TUTTI_CHECK(partial && bias && residual && out && (!options_.layer_norm || (gamma && beta && ln)), InvalidArgument,
              "rank {}: BiasDropoutResidual::run: a null buffer{}", comm_.rank(),
              options_.layer_norm ? " (LayerNorm needs gamma, beta and ln)" : "");
  PlanCall call;
  call.input = partial;
  call.output = out;
  call.count = static_cast<size_t>(rows_ * hidden_);
  call.states = {const_cast<float*>(bias), const_cast<float*>(residual), ln};  // read-only ones are only read
  if (options_.layer_norm) call.states.push_back(const_cast<float*>(gamma)), call.states.push_back(const_cast<float*>(beta));
  call.scalars = call_scalars(options_);
  return run_plan(comm_, plan_, call);
}

void BiasDropoutResidual::run_unfused(float* partial, const float* bias, const float* residual, float* out,
                                      const float* gamma, const float* beta, float* ln) {
  const int n = comm_.size(), q = comm_.rank();
  const int64_t total = rows_ * hidden_;
  const int64_t mine = options_.sequence_parallel ? total / n : total;
  const int64_t first = options_.sequence_parallel ? q * mine : 0;  // where this rank's rows start
  float* y = partial + first;
  if (options_.sequence_parallel)
    comm_.reduce_scatter(partial, y, static_cast<size_t>(mine), DataType::kFloat32, RedOp::kSum).wait();
  else
    comm_.all_reduce(partial, partial, static_cast<size_t>(total), DataType::kFloat32, RedOp::kSum).wait();
  // The epilogue over the rows, in the fused plan's row blocks (the same floats either way).
  const std::vector<double> s = call_scalars(options_);
  const int64_t block = total / (static_cast<int64_t>(n) * pieces_);
  const KernelDef& def = kernel_def(options_.layer_norm ? ids().bdr_ln : ids().bdr);
  for (int64_t at = 0; at < mine; at += block) {
    const void* ins[5] = {y + at, bias, residual + at, gamma, beta};
    void* outs[2] = {out + at, ln ? ln + at : nullptr};
    const int64_t in_counts[5] = {block, hidden_, block, hidden_, hidden_}, out_counts[2] = {block, block};
    KernelArgs a{ins, outs, block, DataType::kFloat32, s.data(), in_counts, out_counts, first + at};
    def.cpu(a);
  }
}

}  // namespace tutti::fused
