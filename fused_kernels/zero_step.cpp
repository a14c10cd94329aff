// The fused ZeRO optimizer step (tutti/fused.hpp): its kernels, its DSL program with the
// postcondition the compiler proves, and the unfused reference.
#include <fmt/format.h>

#include <array>
#include <initializer_list>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>
#include <mutex>

#include "core/datatype.hpp"
#include "core/error.hpp"
#include "fused_kernels/common.hpp"
#include "fused_kernels/optimizer_kernels.hpp"
#include "tutti/fused.hpp"
#include "tutti/kernel.hpp"

namespace tutti::fused {
namespace {

// Scalar slots of every call of the plan (PlanCall::scalars), so one compiled plan serves any
// optimizer settings and step.
enum Slot : int { kGradScale, kLr, kBeta1, kBeta2, kEps, kWeightDecay, kStep, kMaxNorm, kSlots };

// Kernels with mixed units check what each operand holds: `want[i]` elements, or -1 for "at least
// one" (a statistic). Without counts (a direct call) the caller vouches for them.
void require_counts(const KernelArgs& a, const char* kernel, std::initializer_list<int64_t> ins,
                    std::initializer_list<int64_t> outs) {
  if (!a.input_counts || !a.output_counts) return;
  auto check = [&](const int64_t* got, std::initializer_list<int64_t> want, const char* what) {
    size_t i = 0;
    for (int64_t w : want) {
      if (w >= 0 ? got[i] != w : got[i] < 1)
        throw InvalidArgument(fmt::format("kernel '{}': {} {} holds {} element(s), {} needed", kernel, what, i, got[i],
                                          w >= 0 ? fmt::format("{}", w) : std::string("at least 1")));
      ++i;
    }
  };
  check(a.input_counts, ins, "input");
  check(a.output_counts, outs, "output");
}

// inputs {g}, outputs {g', s}: g' = g * grad_scale; s = sum of squares of g' (one element).
void unscale_sumsq(const KernelArgs& a) {
  require_float(a, "zero.unscale_sumsq");
  require_counts(a, "zero.unscale_sumsq", {a.count}, {a.count, -1});
  const double sum = unscale_square(static_cast<float*>(a.outputs[0]), static_cast<const float*>(a.inputs[0]), a.count,
                                    static_cast<float>(a.scalars[0]));
  *static_cast<float*>(a.outputs[1]) = static_cast<float>(sum);
}

// inputs {g, s}, outputs {g', s'}: as unscale_sumsq, adding to the running sum s.
void unscale_sumsq_acc(const KernelArgs& a) {
  require_float(a, "zero.unscale_sumsq_acc");
  require_counts(a, "zero.unscale_sumsq_acc", {a.count, -1}, {a.count, -1});
  const float before = *static_cast<const float*>(a.inputs[1]);
  const double sum = unscale_square(static_cast<float*>(a.outputs[0]), static_cast<const float*>(a.inputs[0]), a.count,
                                    static_cast<float>(a.scalars[0]));
  *static_cast<float*>(a.outputs[1]) = static_cast<float>(static_cast<double>(before) + sum);
}

// Both as epilogues streamed over the reduce-scatter (KernelDef::stream): the unscale and the sum
// of squares on each range of a chunk as it is combined, the sum written when the step runs.
template <bool Acc>
void unscale_sumsq_stream(const KernelArgs& a, void* state, int64_t from, int64_t to, bool last) {
  constexpr bool acc = Acc;
  const char* name = acc ? "zero.unscale_sumsq_acc" : "zero.unscale_sumsq";
  if (from == 0) {  // the first call checks the operands
    require_float(a, name);
    if (acc) require_counts(a, name, {a.count, -1}, {a.count, -1});
    else require_counts(a, name, {a.count}, {a.count, -1});
  }
  const double sum = unscale_square_piece(static_cast<float*>(a.outputs[0]) + from,
                                          static_cast<const float*>(a.inputs[0]) + from, to - from,
                                          static_cast<float>(a.scalars[0]), static_cast<double*>(state), last);
  if (!last) return;
  const double before = acc ? static_cast<double>(*static_cast<const float*>(a.inputs[1])) : 0.0;
  *static_cast<float*>(a.outputs[1]) = static_cast<float>(acc ? before + sum : sum);
}

// inputs {g, m, v, p, total}, outputs {m', v', p'}: AdamW with the gradients clipped by the global
// norm sqrt(total), as the trainer's optimizer computes it; nothing changes when total is not finite.
void adamw(const KernelArgs& a) {
  require_float(a, "zero.adamw");
  require_counts(a, "zero.adamw", {a.count, a.count, a.count, a.count, -1}, {a.count, a.count, a.count});
  const auto* g = static_cast<const float*>(a.inputs[0]);
  const auto* m_in = static_cast<const float*>(a.inputs[1]);
  const auto* v_in = static_cast<const float*>(a.inputs[2]);
  const auto* p_in = static_cast<const float*>(a.inputs[3]);
  const float total = *static_cast<const float*>(a.inputs[4]);
  auto* m = static_cast<float*>(a.outputs[0]);
  auto* v = static_cast<float*>(a.outputs[1]);
  auto* p = static_cast<float*>(a.outputs[2]);
  const int64_t n = a.count;
  if (!std::isfinite(total)) {  // a skipped step: the outputs keep their inputs
    for (int64_t i = 0; i < n; ++i) m[i] = m_in[i], v[i] = v_in[i], p[i] = p_in[i];
    return;
  }
  const float lr = static_cast<float>(a.scalars[0]), beta1 = static_cast<float>(a.scalars[1]),
              beta2 = static_cast<float>(a.scalars[2]), eps = static_cast<float>(a.scalars[3]),
              wd = static_cast<float>(a.scalars[4]), max_norm = static_cast<float>(a.scalars[6]);
  const double step = a.scalars[5];
  const float norm = std::sqrt(total);
  const float clip = max_norm > 0 ? std::min(1.0f, max_norm / (norm + 1e-6f)) : 1.0f;
  const double c1 = 1.0 - std::pow(static_cast<double>(beta1), step);
  const double c2 = 1.0 - std::pow(static_cast<double>(beta2), step);
  AdamwArgs args{g, m_in, v_in, p_in, m, v, p, clip, beta1, beta2, eps, 1.0f - lr * wd,
                 static_cast<float>(static_cast<double>(lr) / c1), static_cast<float>(std::sqrt(c2))};
  adamw_update(args, n);
}

// inputs {g, m, v, p, decay}, outputs {m', v', p'}: AdamW with the gradients times the call's
// clip and per-parameter weight decay (decay[i] multiplies weight_decay): update()'s kernel.
void adamw_masked(const KernelArgs& a) {
  require_float(a, "zero.adamw_masked");
  const float lr = static_cast<float>(a.scalars[0]), beta1 = static_cast<float>(a.scalars[1]),
              beta2 = static_cast<float>(a.scalars[2]), eps = static_cast<float>(a.scalars[3]),
              wd = static_cast<float>(a.scalars[4]), clip = static_cast<float>(a.scalars[6]);
  const double step = a.scalars[5];
  const double c1 = 1.0 - std::pow(static_cast<double>(beta1), step);
  const double c2 = 1.0 - std::pow(static_cast<double>(beta2), step);
  AdamwArgs args{static_cast<const float*>(a.inputs[0]), static_cast<const float*>(a.inputs[1]),
                 static_cast<const float*>(a.inputs[2]), static_cast<const float*>(a.inputs[3]),
                 static_cast<float*>(a.outputs[0]), static_cast<float*>(a.outputs[1]), static_cast<float*>(a.outputs[2]),
                 clip, beta1, beta2, eps, 1.0f - lr * wd, static_cast<float>(static_cast<double>(lr) / c1),
                 static_cast<float>(std::sqrt(c2)), static_cast<const float*>(a.inputs[4]), lr * wd};
  adamw_update(args, a.count);
}

// inputs {g, m, v, p, total}, outputs {m', v', p', p16}: adamw, then p' rounded to bfloat16 (the
// model's copy; output 3 holds count bf16 values in count / 2 float32 elements).
void adamw_cast(const KernelArgs& a) {
  // Checked before anything is written: an error leaves the step undone, not half done.
  if (a.output_counts && a.output_counts[3] * 2 != a.count)
    throw InvalidArgument(fmt::format("kernel 'zero.adamw_cast': {} parameters but room for {} bfloat16 values", a.count,
                                      a.output_counts[3] * 2));
  adamw(a);
  to_bf16(static_cast<uint16_t*>(a.outputs[3]), static_cast<const float*>(a.outputs[2]), a.count);
}

struct KernelIds {
  KernelId unscale_sumsq, unscale_sumsq_acc, adamw, adamw_masked, adamw_cast;
};

const KernelIds& ids() {
  static const KernelIds k = [] {
    KernelIds out;
    // Costs: passes over the chunk's bytes, as a copy's (one read, one write) is 1.
    // Mixed units: operands include a statistic (a state buffer of unit 1).
    const std::vector<std::string> adamw_scalars = {"lr", "beta1", "beta2", "eps", "weight_decay", "step", "max_norm"};
    // Device forms (runtime/device/kernels.hpp): every ZeRO kernel.
    auto streamed = [](KernelDef d) {
      d.stream = d.inputs == 2 ? unscale_sumsq_stream<true> : unscale_sumsq_stream<false>;
      d.stream_state = unscale_square_state_bytes();
      return d;
    };
    out.unscale_sumsq = register_once(streamed({"zero.unscale_sumsq", {"grad_scale"}, unscale_sumsq, 1.0, 1, 2}), true,
                                      DeviceKernel::kUnscaleSumsq);
    out.unscale_sumsq_acc =
        register_once(streamed({"zero.unscale_sumsq_acc", {"grad_scale"}, unscale_sumsq_acc, 1.0, 2, 2}), true,
                      DeviceKernel::kUnscaleSumsqAcc);
    out.adamw = register_once({"zero.adamw", adamw_scalars, adamw, 3.5, 5, 3}, true, DeviceKernel::kAdamw);
    out.adamw_masked = register_once(
        {"zero.adamw_masked", {"lr", "beta1", "beta2", "eps", "weight_decay", "step", "clip"}, adamw_masked, 4.0, 5, 3},
        false, DeviceKernel::kAdamwMasked);
    out.adamw_cast = register_once({"zero.adamw_cast", adamw_scalars, adamw_cast, 4.0, 5, 4}, true,
                                   DeviceKernel::kAdamwCast);
    return out;
  }();
  return k;
}

std::vector<ScalarArg> adamw_scalars() {
  std::vector<ScalarArg> s;
  for (int slot = kLr; slot <= kMaxNorm; ++slot) s.push_back(ScalarArg::per_call(slot));
  return s;
}

std::vector<double> call_scalars(const AdamW& o) {
  std::vector<double> s(kSlots);
  s[kGradScale] = o.grad_scale;
  s[kLr] = o.lr;
  s[kBeta1] = o.beta1;
  s[kBeta2] = o.beta2;
  s[kEps] = o.eps;
  s[kWeightDecay] = o.weight_decay;
  s[kStep] = static_cast<double>(o.step);
  s[kMaxNorm] = o.max_norm;
  return s;
}

// State buffers of the program, in order.
enum State : int { kParams, kM, kV, kStats };

}  // namespace

void register_kernels() { (void)ids(); }

void adamw(float* p, const float* g, float* m, float* v, int64_t n, const AdamW& opt, float clip) {
  const double c1 = 1.0 - std::pow(static_cast<double>(opt.beta1), static_cast<double>(opt.step));
  const double c2 = 1.0 - std::pow(static_cast<double>(opt.beta2), static_cast<double>(opt.step));
  AdamwArgs args{g, m, v, p, m, v, p, clip, opt.beta1, opt.beta2, opt.eps, 1.0f - opt.lr * opt.weight_decay,
                 static_cast<float>(static_cast<double>(opt.lr) / c1), static_cast<float>(std::sqrt(c2))};
  adamw_update(args, n);
}

namespace {

// The terms both whole-step programs prove: each chunk of rank q's shard summed over the ranks and
// unscaled, and the global sum of squares.
struct ReducedTerms {
  std::vector<std::vector<Content>> unscaled;  // [q][j]
  std::vector<Content> sums;                   // [q]: rank q's sum of squares
  Content total;
};

ReducedTerms reduced_terms(int n, int K) {
  const KernelIds& k = ids();
  const ScalarArg scale = ScalarArg::per_call(kGradScale);
  ReducedTerms t;
  t.unscaled.resize(static_cast<size_t>(n));
  for (int q = 0; q < n; ++q) {
    Content running;
    for (int j = 0; j < K; ++j) {
      Content sum;
      for (int r = 0; r < n; ++r) sum.merge(Content::of(r, q * K + j));
      std::vector<Content> args = {sum};
      if (j > 0) args.push_back(running);
      const KernelId kernel = j == 0 ? k.unscale_sumsq : k.unscale_sumsq_acc;
      t.unscaled[static_cast<size_t>(q)].push_back(Content::apply(kernel, args, {scale}, 0));
      running = Content::apply(kernel, args, {scale}, 1);
    }
    t.total.merge(running);
    t.sums.push_back(running);
  }
  return t;
}

// The in-place reduce-scatter with the unscale and sum of squares on each chunk as it is reduced;
// rank q's sum goes to stats[first + q]. Every program of the step starts with it.
void emit_reduce(dsl::Program& p, int n, int K, int first) {
  const KernelIds& k = ids();
  const ScalarArg scale = ScalarArg::per_call(kGradScale);
  const dsl::Buffer in = dsl::Buffer::input(), stats = dsl::Buffer::state("stats");
  for (int q = 0; q < n; ++q)
    for (int j = 0; j < K; ++j) {
      auto g = p.chunk(q, in, q * K + j);
      for (int r = 0; r < n; ++r)
        if (r != q) g.reduce(p.chunk(r, in, q * K + j));
      auto own = p.chunk(q, stats, first + q);  // unscale and sum the squares while the chunk is in cache
      if (j == 0) g.then(k.unscale_sumsq, {scale}, {}, {g, own});
      else g.then(k.unscale_sumsq_acc, {scale}, {own}, {g, own});
    }
}

// The first half of both whole-step programs: emit_reduce, then every rank's sum to every rank and
// the total, in rank order, in stats[0] (so all ranks clip by the same float).
void emit_reduce_and_norm(dsl::Program& p, int n, int K) {
  emit_reduce(p, n, K, 1);
  const dsl::Buffer stats = dsl::Buffer::state("stats");
  for (int q = 0; q < n; ++q)
    for (int r = 0; r < n; ++r)
      if (r != q) p.chunk(q, stats, 1 + q).copy(r, stats, 1 + q);
  for (int q = 0; q < n; ++q) {
    auto t = p.chunk(q, stats, 1).copy(q, stats, 0);
    for (int r = 1; r < n; ++r) t.reduce(p.chunk(q, stats, 1 + r));
  }
}

}  // namespace

std::vector<double> zero_step_scalars(const AdamW& opt) { return call_scalars(opt); }

dsl::Program zero_step_program(int n, int K) {
  TUTTI_CHECK(n >= 1 && K >= 1, InvalidArgument, "zero_step_program: {} ranks and {} pieces per shard", n, K);
  const KernelIds& k = ids();
  const std::vector<ScalarArg> opt = adamw_scalars();
  // What the plan must compute, as terms over the call's leaves: the gradients (input chunks) and
  // the state buffers as the call finds them. Built once; the postconditions share them.
  auto t = std::make_shared<ReducedTerms>(reduced_terms(n, K));
  auto updated = [t, opt, adamw = k.adamw](int q, int j, int output) {
    std::vector<Content> args = {t->unscaled[static_cast<size_t>(q)][static_cast<size_t>(j)],
                                 Content::of_state(q, kM, j), Content::of_state(q, kV, j),
                                 Content::of_state(q, kParams, q * static_cast<int>(t->unscaled[0].size()) + j), t->total};
    return std::optional<Content>(Content::apply(adamw, args, opt, output));
  };
  CollectiveSpec s;
  s.kind = Collective::kCustom;
  s.nranks = n;
  s.chunk_factor = K;
  s.custom_input_chunks = n * K;
  s.custom_output_chunks = 0;
  s.states = {
      StateBufferSpec{"params", n * K, 0, [=](int, int i) { return updated(i / K, i % K, 2); }},
      StateBufferSpec{"m", K, 0, [=](int q, int j) { return updated(q, j, 0); }},
      StateBufferSpec{"v", K, 0, [=](int q, int j) { return updated(q, j, 1); }},
      StateBufferSpec{"stats", n + 1, 1,
                      [t](int, int i) { return i == 0 ? std::optional<Content>(t->total) : std::nullopt; }},
  };
  dsl::Program p(fmt::format("zero_step_n{}_k{}", n, K), s);
  emit_reduce_and_norm(p, n, K);
  const dsl::Buffer in = dsl::Buffer::input(), params = dsl::Buffer::state("params"), m = dsl::Buffer::state("m"),
                    v = dsl::Buffer::state("v"), stats = dsl::Buffer::state("stats");
  // AdamW on the owned shard, each chunk all-gathered as soon as it is updated.
  for (int q = 0; q < n; ++q)
    for (int j = 0; j < K; ++j) {
      auto pj = p.chunk(q, params, q * K + j);
      p.apply(k.adamw, {p.chunk(q, in, q * K + j), p.chunk(q, m, j), p.chunk(q, v, j), pj, p.chunk(q, stats, 0)},
              {p.chunk(q, m, j), p.chunk(q, v, j), pj}, opt);
      for (int r = 0; r < n; ++r)
        if (r != q) pj.copy(r, params, q * K + j);
    }
  return p;
}

dsl::Program zero_step_bf16_program(int n, int K, int64_t piece) {
  TUTTI_CHECK(n >= 1 && K >= 1 && piece >= 2 && piece % 2 == 0, InvalidArgument,
              "zero_step_bf16_program: {} ranks, {} pieces of {} (an even number) per shard", n, K, piece);
  const KernelIds& k = ids();
  const std::vector<ScalarArg> opt = adamw_scalars();
  auto t = std::make_shared<ReducedTerms>(reduced_terms(n, K));
  // State buffers: 0 master (this rank's fp32 shard), 1 m, 2 v, 3 stats, 4 params16 (everyone's
  // bf16 parameters: a piece of bf16 values is piece / 2 float32 elements).
  auto updated = [t, opt, cast = k.adamw_cast](int q, int j, int output) {
    std::vector<Content> args = {t->unscaled[static_cast<size_t>(q)][static_cast<size_t>(j)], Content::of_state(q, 1, j),
                                 Content::of_state(q, 2, j), Content::of_state(q, 0, j), t->total};
    return std::optional<Content>(Content::apply(cast, args, opt, output));
  };
  CollectiveSpec s;
  s.kind = Collective::kCustom;
  s.nranks = n;
  s.chunk_factor = K;
  s.custom_input_chunks = n * K;
  s.states = {
      StateBufferSpec{"master", K, 0, [=](int q, int j) { return updated(q, j, 2); }},
      StateBufferSpec{"m", K, 0, [=](int q, int j) { return updated(q, j, 0); }},
      StateBufferSpec{"v", K, 0, [=](int q, int j) { return updated(q, j, 1); }},
      StateBufferSpec{"stats", n + 1, 1,
                      [t](int, int i) { return i == 0 ? std::optional<Content>(t->total) : std::nullopt; }},
      StateBufferSpec{"params16", n * K, piece / 2, [=](int, int i) { return updated(i / K, i % K, 3); }},
  };
  dsl::Program p(fmt::format("zero_step_bf16_n{}_k{}", n, K), s);
  emit_reduce_and_norm(p, n, K);
  const dsl::Buffer in = dsl::Buffer::input(), master = dsl::Buffer::state("master"), m = dsl::Buffer::state("m"),
                    v = dsl::Buffer::state("v"), stats = dsl::Buffer::state("stats"),
                    params16 = dsl::Buffer::state("params16");
  // AdamW on the owned shard writes the fp32 master and its bf16 cast; the cast (half the bytes) is
  // what is all-gathered, chunk by chunk.
  for (int q = 0; q < n; ++q)
    for (int j = 0; j < K; ++j) {
      auto w = p.chunk(q, master, j), w16 = p.chunk(q, params16, q * K + j);
      p.apply(k.adamw_cast, {p.chunk(q, in, q * K + j), p.chunk(q, m, j), p.chunk(q, v, j), w, p.chunk(q, stats, 0)},
              {p.chunk(q, m, j), p.chunk(q, v, j), w, w16}, opt);
      for (int r = 0; r < n; ++r)
        if (r != q) w16.copy(r, params16, q * K + j);
    }
  return p;
}

dsl::Program zero_reduce_program(int n, int K) {
  TUTTI_CHECK(n >= 1 && K >= 1, InvalidArgument, "zero_reduce_program: {} ranks and {} pieces per shard", n, K);
  // Rank q's stats[q]: the running sum of squares over its slice; the slice itself unscaled.
  auto t = std::make_shared<ReducedTerms>(reduced_terms(n, K));
  CollectiveSpec s;
  s.kind = Collective::kCustom;
  s.nranks = n;
  s.chunk_factor = K;
  s.custom_input_chunks = n * K;
  s.states = {StateBufferSpec{"stats", n, 1, [t](int q, int i) {
                                return i == q ? std::optional<Content>(t->sums[static_cast<size_t>(q)]) : std::nullopt;
                              }}};
  dsl::Program p(fmt::format("zero_reduce_n{}_k{}", n, K), s);
  emit_reduce(p, n, K, 0);
  return p;
}

dsl::Program zero_update_program(int n, int K) {
  TUTTI_CHECK(n >= 1 && K >= 1, InvalidArgument, "zero_update_program: {} ranks and {} pieces per shard", n, K);
  const KernelIds& k = ids();
  std::vector<ScalarArg> opt;
  for (int slot = 0; slot < 7; ++slot) opt.push_back(ScalarArg::per_call(slot));  // lr ... step, clip
  enum { kMaster, kMom, kVel, kParams, kDecay };
  auto updated = [=](int q, int j, int output) {
    return Content::apply(k.adamw_masked,
                          {Content::of(q, q * K + j), Content::of_state(q, kMom, j), Content::of_state(q, kVel, j),
                           Content::of_state(q, kMaster, j), Content::of_state(q, kDecay, j)},
                          opt, output);
  };
  CollectiveSpec s;
  s.kind = Collective::kCustom;
  s.nranks = n;
  s.chunk_factor = K;
  s.custom_input_chunks = n * K;  // the gradients, as reduce() left them (this rank's slice is read)
  s.states = {StateBufferSpec{"master", K, 0, [=](int q, int j) { return std::optional<Content>(updated(q, j, 2)); }},
              StateBufferSpec{"m", K, 0, [=](int q, int j) { return std::optional<Content>(updated(q, j, 0)); }},
              StateBufferSpec{"v", K, 0, [=](int q, int j) { return std::optional<Content>(updated(q, j, 1)); }},
              StateBufferSpec{"params", n * K, 0,
                              [=](int, int i) { return std::optional<Content>(updated(i / K, i % K, 2)); }},
              StateBufferSpec{"decay", K, 0, {}}};
  dsl::Program p(fmt::format("zero_update_n{}_k{}", n, K), s);
  const dsl::Buffer in = dsl::Buffer::input(), master = dsl::Buffer::state("master"), m = dsl::Buffer::state("m"),
                    v = dsl::Buffer::state("v"), params = dsl::Buffer::state("params"), decay = dsl::Buffer::state("decay");
  for (int q = 0; q < n; ++q)
    for (int j = 0; j < K; ++j) {
      auto w = p.chunk(q, master, j);
      p.apply(k.adamw_masked, {p.chunk(q, in, q * K + j), p.chunk(q, m, j), p.chunk(q, v, j), w, p.chunk(q, decay, j)},
              {p.chunk(q, m, j), p.chunk(q, v, j), w}, opt);
      for (int r = 0; r < n; ++r) w.copy(r, params, q * K + j);  // every rank's parameters, this one's included
    }
  return p;
}

namespace {

// About 256 KiB a piece, at most 1024 (the verifier's work grows with the steps).
int default_pieces(int64_t shard) { return pieces_for(shard, sizeof(float), 256 << 10, 1024); }

}  // namespace

ZeroStep::ZeroStep(Comm& comm, int64_t shard, int pieces)
    : comm_(comm), shard_(shard), pieces_(pieces > 0 ? pieces : default_pieces(shard)),
      stats_(std::make_unique<float[]>(static_cast<size_t>(comm.size()) + 1)) {
  TUTTI_CHECK(shard >= 1, InvalidArgument, "rank {}: ZeroStep: shard {} must be at least 1", comm.rank(), shard);
  TUTTI_CHECK(shard % pieces_ == 0, InvalidArgument, "rank {}: ZeroStep: a shard of {} does not split into {} pieces",
              comm.rank(), shard, pieces_);
  plan_ = compile_plan(zero_step_program(comm.size(), pieces_));
}

Work ZeroStep::run(float* grads, float* params, float* m, float* v, const AdamW& opt) {
  TUTTI_CHECK(grads && params && m && v, InvalidArgument, "rank {}: ZeroStep::run: a null buffer", comm_.rank());
  PlanCall call;
  call.input = grads;
  call.count = static_cast<size_t>(shard_);
  call.type = DataType::kFloat32;
  call.states = {params, m, v, stats_.get()};
  call.scalars = call_scalars(opt);
  return run_plan(comm_, plan_, call);
}

std::vector<double> ZeroStep::unfused_to_optimizer(float* grads, const AdamW& opt, Unfused form) {
  const KernelIds& k = ids();
  const int n = comm_.size(), q = comm_.rank();
  const int64_t piece = shard_ / pieces_;
  float* mine = grads + q * shard_;
  comm_.reduce_scatter(grads, mine, static_cast<size_t>(shard_), DataType::kFloat32, RedOp::kSum).wait();
  // Every pass over the same pieces as the fused plan, so the results agree bit for bit.
  float* own = stats_.get() + 1 + q;
  std::vector<double> all = call_scalars(opt);
  if (form == Unfused::kOnePass) {
    const double scale = opt.grad_scale;
    for (int j = 0; j < pieces_; ++j) {
      float* g = mine + j * piece;
      const void* ins[2] = {g, own};
      void* outs[2] = {g, own};
      kernel_def(j == 0 ? k.unscale_sumsq : k.unscale_sumsq_acc)
          .cpu(KernelArgs{ins, outs, piece, DataType::kFloat32, &scale});
    }
  } else {
    int32_t finite = 1, all_finite = 1;
    for (int j = 0; j < pieces_; ++j)
      finite &= scale_check(mine + j * piece, piece, opt.grad_scale) ? 1 : 0;
    comm_.all_reduce(&finite, &all_finite, 1, DataType::kInt32, RedOp::kMin).wait();
    for (int j = 0; j < pieces_; ++j) {
      const double sum = sum_squares(mine + j * piece, piece);
      *own = static_cast<float>(j == 0 ? sum : static_cast<double>(*own) + sum);
    }
    if (!all_finite) *own = std::numeric_limits<float>::infinity();
  }
  comm_.all_gather(own, stats_.get() + 1, 1, DataType::kFloat32).wait();
  float total = stats_[1];
  for (int r = 1; r < n; ++r) total += stats_[static_cast<size_t>(1 + r)];
  stats_[0] = total;
  if (form == Unfused::kTorch && std::isfinite(total) && opt.max_norm > 0) {
    // clip_grad_norm_: the gradients scaled in place, then an optimizer that does not clip.
    const float clip = std::min(1.0f, opt.max_norm / (std::sqrt(total) + 1e-6f));
    for (int j = 0; j < pieces_; ++j) scale_check(mine + j * piece, piece, clip);
    all[kMaxNorm] = 0;
  }
  return all;
}

void ZeroStep::unfused_adamw(const float* mine, float* master, float* m, float* v, const std::vector<double>& all) {
  const int64_t piece = shard_ / pieces_;
  for (int j = 0; j < pieces_; ++j) {
    const int64_t at = j * piece;
    const void* ins[5] = {mine + at, m + at, v + at, master + at, stats_.get()};
    void* outs[3] = {m + at, v + at, master + at};
    kernel_def(ids().adamw).cpu(KernelArgs{ins, outs, piece, DataType::kFloat32, all.data() + kLr});
  }
}

void ZeroStep::run_unfused(float* grads, float* params, float* m, float* v, const AdamW& opt, Unfused form) {
  const int q = comm_.rank();
  const std::vector<double> all = unfused_to_optimizer(grads, opt, form);
  unfused_adamw(grads + q * shard_, params + q * shard_, m, v, all);
  comm_.all_gather(params + q * shard_, params, static_cast<size_t>(shard_), DataType::kFloat32).wait();
}

Work ZeroStep::run_bf16(float* grads, float* master, float* m, float* v, uint16_t* params16, const AdamW& opt) {
  TUTTI_CHECK(grads && master && m && v && params16, InvalidArgument, "rank {}: ZeroStep::run_bf16: a null buffer",
              comm_.rank());
  const int64_t piece = shard_ / pieces_;
  TUTTI_CHECK(piece % 2 == 0, InvalidArgument,
              "rank {}: ZeroStep::run_bf16: pieces of {} parameters: bf16 pieces need an even number", comm_.rank(), piece);
  if (!bf16_plan_.prepared()) bf16_plan_ = compile_plan(zero_step_bf16_program(comm_.size(), pieces_, piece));
  PlanCall call;
  call.input = grads;
  call.count = static_cast<size_t>(shard_);
  call.states = {master, m, v, stats_.get(), params16};
  call.scalars = call_scalars(opt);
  return run_plan(comm_, bf16_plan_, call);
}

void ZeroStep::run_bf16_unfused(float* grads, float* master, float* m, float* v, uint16_t* params16, const AdamW& opt) {
  const int q = comm_.rank();
  const std::vector<double> all = unfused_to_optimizer(grads, opt, Unfused::kTorch);
  unfused_adamw(grads + q * shard_, master, m, v, all);
  // The cast pass (skipped steps leave master as it was; the cast of it is the same bf16).
  to_bf16(params16 + q * shard_, master, shard_);
  comm_.all_gather(params16 + q * shard_, params16, static_cast<size_t>(shard_), DataType::kBfloat16).wait();
}

Work ZeroStep::reduce(float* grads, float grad_scale) {
  TUTTI_CHECK(grads, InvalidArgument, "rank {}: ZeroStep::reduce: a null buffer", comm_.rank());
  if (!reduce_plan_.prepared()) reduce_plan_ = compile_plan(zero_reduce_program(comm_.size(), pieces_));
  PlanCall call;
  call.input = grads;
  call.count = static_cast<size_t>(shard_);
  call.states = {stats_.get() + 1};
  call.scalars = {grad_scale};
  return run_plan(comm_, reduce_plan_, call);
}

double ZeroStep::local_sum_squares() const { return stats_[static_cast<size_t>(1 + comm_.rank())]; }

Work ZeroStep::update(const float* grads, float* master, float* m, float* v, float* params, const float* decay,
                      const AdamW& opt, float clip) {
  TUTTI_CHECK(grads && master && m && v && params, InvalidArgument, "rank {}: ZeroStep::update: a null buffer",
              comm_.rank());
  if (!update_plan_.prepared()) update_plan_ = compile_plan(zero_update_program(comm_.size(), pieces_));
  if (!decay) {
    if (ones_.empty()) ones_.assign(static_cast<size_t>(shard_), 1.0f);
    decay = ones_.data();
  }
  PlanCall call;
  call.input = grads;
  call.count = static_cast<size_t>(shard_);
  call.states = {master, m, v, params, const_cast<float*>(decay)};  // decay is only read
  call.scalars = {opt.lr, opt.beta1, opt.beta2, opt.eps, opt.weight_decay, static_cast<double>(opt.step), clip};
  return run_plan(comm_, update_plan_, call);
}

double ZeroStep::last_norm() const { return std::sqrt(static_cast<double>(stats_[0])); }
bool ZeroStep::last_finite() const { return std::isfinite(stats_[0]); }

}  // namespace tutti::fused
