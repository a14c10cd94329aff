// Fused operations (tutti/fused.hpp): the compiler's proof of each fused plan, mutations of it that
// the verifier catches, and each fused run against its unfused reference, bit for bit, and against
// plain arithmetic.
#include <gtest/gtest.h>

#include <cmath>
#include <bit>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <thread>

#include "compiler/compile.hpp"
#include "compiler/msccl_xml.hpp"
#include "compiler/verify.hpp"
#include "core/element.hpp"
#include "core/error.hpp"
#include "fused_kernels/epilogue_kernels.hpp"
#include "fused_kernels/optimizer_kernels.hpp"
#include "runtime/device/kernels.hpp"
#include "runtime/cpu_executor.hpp"
#include "tutti/fused.hpp"
#include "support/errors.hpp"
#include "support/ranks.hpp"

using namespace tutti;
using test_support::error_of;

namespace {

// Runs f(comm) on `n` ranks as threads; rethrows the first failure.
void on_ranks(int n, const std::function<void(Comm&)>& f) {
  auto comms = Comm::create_local(n);
  test_support::on_ranks(comms, [&](int, Comm& c) { f(c); });
}

// nccl-tests style data: small integers (and halves), so every sum is exact in any order.
float grad_value(int rank, int64_t i, int step) { return static_cast<float>(((rank + 1) * 7 + i * 3 + step) % 17 - 8); }
float param_value(int64_t i) { return static_cast<float>(i % 13 - 6) * 0.125f; }

struct Buffers {
  std::vector<float> grads, params, m, v;
  Buffers(int n, int64_t shard, int rank, int step)
      : grads(static_cast<size_t>(n * shard)), params(static_cast<size_t>(n * shard)), m(static_cast<size_t>(shard)),
        v(static_cast<size_t>(shard)) {
    for (int64_t i = 0; i < n * shard; ++i) {
      grads[static_cast<size_t>(i)] = grad_value(rank, i, step);
      params[static_cast<size_t>(i)] = param_value(i);
    }
  }
  void next_grads(int n, int rank, int step) {
    for (size_t i = 0; i < grads.size(); ++i) grads[i] = grad_value(rank, static_cast<int64_t>(i), step);
    (void)n;
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST(ZeroStep, TheFusedProgramIsProvedAgainstAdamwOfTheSummedGradients) {
  for (auto [n, k] : {std::pair{2, 1}, {2, 4}, {3, 2}, {4, 3}}) {
    plan::Compiled c = plan::compile(fused::zero_step_program(n, k));
    EXPECT_EQ(c.plan.states.size(), 4u);
    EXPECT_EQ(c.plan.states[3].unit, 1);  // the statistics: one element per chunk
    // The proof is in terms of the leaves; the description names the kernels.
    const CollectiveSpec spec = fused::zero_step_program(n, k).spec();
    const std::string post = spec.state_postcondition(0, 0, 0)->describe();
    EXPECT_NE(post.find("zero.adamw.2[$1, $2, $3, $4, $5, $6, $7]"), std::string::npos) << post;
    EXPECT_NE(post.find("zero.unscale_sumsq[$0]({r0:i0, r1:i0"), std::string::npos) << post;
  }
}

TEST(ZeroStep, MutationsOfTheFusedPlanAreCaught) {
  dsl::Program program = fused::zero_step_program(2, 2);
  const CollectiveSpec spec = program.spec();
  plan::Compiled c = plan::compile(program);
  plan::VerifyOptions options;
  options.spec = &spec;
  options.check_hazards = true;
  auto find = [&](int rank, const std::function<bool(const plan::Instruction&)>& pred) -> plan::Instruction& {
    for (auto& b : c.plan.ranks[static_cast<size_t>(rank)].blocks)
      for (auto& in : b.steps)
        if (pred(in)) return in;
    throw std::runtime_error("no such instruction");
  };
  const KernelId adamw = *find_kernel("zero.adamw"), unscale = *find_kernel("zero.unscale_sumsq");
  auto is = [](KernelId k) { return [k](const plan::Instruction& in) { return in.op == plan::Opcode::kCompute && in.kernel == k; }; };
  {  // AdamW on the other piece's gradients
    plan::Plan saved = c.plan;
    plan::Instruction& in = find(0, is(adamw));
    in.srcs[0].index += 1;
    EXPECT_NE(error_of([&] { plan::verify(c.plan, options); }).find("postcondition"), std::string::npos);
    c.plan = saved;
  }
  {  // the unscale with a fixed factor instead of the call's
    plan::Plan saved = c.plan;
    find(1, is(unscale)).scalars[0] = ScalarArg(1.0);
    EXPECT_NE(error_of([&] { plan::verify(c.plan, options); }).find("postcondition"), std::string::npos);
    c.plan = saved;
  }
  {  // AdamW before the norm is complete: moved before the step that adds the peer's sum of squares
    plan::Plan saved = c.plan;
    bool moved = false;
    for (auto& b : c.plan.ranks[0].blocks)
      for (size_t s = 1; s < b.steps.size() && !moved; ++s)
        if (is(adamw)(b.steps[s]) && b.steps[s - 1].op == plan::Opcode::kReduce) {
          std::swap(b.steps[s], b.steps[s - 1]);
          std::swap(b.steps[s].deps, b.steps[s - 1].deps);
          moved = true;
        }
    ASSERT_TRUE(moved);
    EXPECT_NE(error_of([&] { plan::verify(c.plan, options); }).find("postcondition"), std::string::npos);
    c.plan = saved;
  }
  {  // the sum of squares sent as if it were a chunk of gradients
    plan::Plan saved = c.plan;
    plan::Instruction& in = find(0, [](const plan::Instruction& x) {
      return x.op == plan::Opcode::kSend && is_state(x.srcs[0].buffer) && state_index(x.srcs[0].buffer) == 3;
    });
    in.srcs[0].buffer = BufferKind::kInput;
    EXPECT_NE(error_of([&] { plan::verify(c.plan, options); }).find("element(s)"), std::string::npos);
    c.plan = saved;
  }
  EXPECT_EQ(error_of([&] { plan::verify(c.plan, options); }), "");
}

TEST(ZeroStep, ADslMistakeInAStatisticIsReportedAtTheOperation) {
  CollectiveSpec s;
  s.kind = Collective::kCustom;
  s.nranks = 2;
  s.custom_input_chunks = 2;
  s.states = {StateBufferSpec{"stats", 2, 1, {}}};
  dsl::Program p("bad", s);
  const std::string e = error_of([&] { p.chunk(0, dsl::Buffer::input(), 0).copy(1, dsl::Buffer::state("stats"), 0); });
  EXPECT_NE(e.find("state 'stats' chunks hold 1 element(s): a copy"), std::string::npos) << e;
  EXPECT_NE(error_of([&] { p.chunk(0, dsl::Buffer::state("nope"), 0); }).find("no state buffer is named 'nope'"),
            std::string::npos);
}

class ZeroStepRanks : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(ZeroStepRanks, FusedEqualsUnfusedBitForBitAndPlainArithmetic) {
  const auto [n, pieces] = GetParam();
  const int64_t shard = 1024;  // divisible by the pieces of every case
  on_ranks(n, [&, n = n, pieces = pieces](Comm& comm) {
    const int q = comm.rank();
    fused::ZeroStep step(comm, shard, pieces);
    Buffers fused(n, shard, q, 0), unfused(n, shard, q, 0);
    std::vector<float> m_ref(static_cast<size_t>(shard), 0.0f), v_ref(m_ref), p_ref(fused.params);
    std::fill(fused.m.begin(), fused.m.end(), 0.0f);
    std::fill(fused.v.begin(), fused.v.end(), 0.0f);
    unfused.m = fused.m;
    unfused.v = fused.v;
    for (int t = 1; t <= 3; ++t) {
      fused::AdamW opt;
      opt.lr = 0.01f * static_cast<float>(t);
      opt.weight_decay = 0.1f;
      opt.step = t;
      opt.grad_scale = 0.5f;
      opt.max_norm = t == 2 ? 0.0f : 50.0f;  // clipping in steps 1 and 3 (the norm is in the hundreds)
      fused.next_grads(n, q, t);
      unfused.next_grads(n, q, t);
      step.run(fused.grads.data(), fused.params.data(), fused.m.data(), fused.v.data(), opt).wait();
      const double norm = step.last_norm();
      // Both unfused forms, alternating steps, on the same state.
      const auto form = t % 2 ? fused::ZeroStep::Unfused::kTorch : fused::ZeroStep::Unfused::kOnePass;
      step.run_unfused(unfused.grads.data(), unfused.params.data(), unfused.m.data(), unfused.v.data(), opt, form);
      EXPECT_EQ(step.last_norm(), norm);
      EXPECT_TRUE(step.last_finite());
      EXPECT_TRUE(same_bits(fused.params, unfused.params)) << "step " << t;
      EXPECT_TRUE(same_bits(fused.m, unfused.m)) << "step " << t;
      EXPECT_TRUE(same_bits(fused.v, unfused.v)) << "step " << t;
      // Plain arithmetic in double: the summed gradients, the norm, clipping, AdamW.
      double sumsq = 0;
      std::vector<double> g(static_cast<size_t>(n * shard));
      for (int64_t i = 0; i < n * shard; ++i) {
        for (int r = 0; r < n; ++r) g[static_cast<size_t>(i)] += grad_value(r, i, t);
        g[static_cast<size_t>(i)] *= opt.grad_scale;
        sumsq += g[static_cast<size_t>(i)] * g[static_cast<size_t>(i)];
      }
      EXPECT_NEAR(norm, std::sqrt(sumsq), 1e-5 * std::sqrt(sumsq));
      const double clip = opt.max_norm > 0 ? std::min(1.0, opt.max_norm / (std::sqrt(sumsq) + 1e-6)) : 1.0;
      // This rank's shard (the others' come from their owners, which the bitwise check covers).
      for (int64_t i = q * shard; i < (q + 1) * shard; ++i) {
        const size_t o = static_cast<size_t>(i - q * shard);
        double mi = m_ref[o], vi = v_ref[o];
        const double gi = g[static_cast<size_t>(i)] * clip;
        mi = 0.9 * mi + 0.1 * gi;
        vi = 0.999 * vi + 0.001 * gi * gi;
        const double mhat = mi / (1 - std::pow(0.9, t)), vhat = vi / (1 - std::pow(0.999, t));
        double p = p_ref[static_cast<size_t>(i)] * (1 - opt.lr * opt.weight_decay) - opt.lr * mhat / (std::sqrt(vhat) + 1e-8);
        p_ref[static_cast<size_t>(i)] = static_cast<float>(p);
      }
      for (int64_t i = q * shard; i < (q + 1) * shard; ++i)
        ASSERT_NEAR(fused.params[static_cast<size_t>(i)], p_ref[static_cast<size_t>(i)], 2e-5)
            << "rank " << q << " step " << t << " parameter " << i;
      p_ref = fused.params;  // the next step starts from the library's floats
      m_ref = fused.m;
      v_ref = fused.v;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Sizes, ZeroStepRanks, ::testing::Values(std::pair{2, 4}, std::pair{3, 1}, std::pair{4, 8}),
                         [](const auto& info) {
                           return "n" + std::to_string(info.param.first) + "_pieces" + std::to_string(info.param.second);
                         });

TEST(ZeroStep, ANonFiniteGradientSkipsTheStepOnEveryRank) {
  const int n = 2;
  const int64_t shard = 64;
  on_ranks(n, [&](Comm& comm) {
    fused::ZeroStep step(comm, shard, 2);
    for (int form : {0, 1, 2}) {  // fused, unfused as PyTorch, unfused in one pass
      const bool use_fused = form == 0;
      Buffers b(n, shard, comm.rank(), 0);
      std::fill(b.m.begin(), b.m.end(), 0.25f);
      std::fill(b.v.begin(), b.v.end(), 0.5f);
      const Buffers before = b;
      // One gradient of rank 1, in rank 0's shard: only rank 0 sees it, both must skip.
      if (comm.rank() == 1) b.grads[5] = std::numeric_limits<float>::infinity();
      fused::AdamW opt;
      if (use_fused) step.run(b.grads.data(), b.params.data(), b.m.data(), b.v.data(), opt).wait();
      else
        step.run_unfused(b.grads.data(), b.params.data(), b.m.data(), b.v.data(), opt,
                         form == 1 ? fused::ZeroStep::Unfused::kTorch : fused::ZeroStep::Unfused::kOnePass);
      EXPECT_FALSE(step.last_finite());
      EXPECT_TRUE(same_bits(b.params, before.params)) << "form " << form;
      EXPECT_TRUE(same_bits(b.m, before.m));
      EXPECT_TRUE(same_bits(b.v, before.v));
    }
  });
}

TEST(ZeroStep, BadCallsAreNamed) {
  on_ranks(2, [&](Comm& comm) {
    EXPECT_NE(error_of([&] { fused::ZeroStep(comm, 10, 3); }).find("a shard of 10 does not split into 3 pieces"),
              std::string::npos);
    fused::ZeroStep step(comm, 8, 2);
    std::vector<float> x(16);
    EXPECT_NE(error_of([&] { step.run(x.data(), nullptr, x.data(), x.data(), {}); }).find("null buffer"),
              std::string::npos);
    // A plan with state buffers run without them.
    PlanCall call;
    call.input = x.data();
    call.count = 8;
    EXPECT_NE(error_of([&] { run_plan(comm, step.plan(), call); }).find("names 4 state buffer(s), the call passes 0"),
              std::string::npos);
  });
}

// --- all-reduce / reduce-scatter -> bias + dropout + residual (+ LayerNorm) ----------------------

TEST(BiasDropoutResidual, EveryFormIsProvedAgainstTheEpilogueOfTheSum) {
  for (bool sp : {false, true})
    for (bool ln : {false, true}) {
      fused::EpilogueOptions o;
      o.sequence_parallel = sp;
      o.layer_norm = ln;
      plan::Compiled c = plan::compile(fused::bias_dropout_residual_program(3, 2, 8, o));
      EXPECT_EQ(c.plan.states[0].unit, 8);  // the bias: one row
      const std::string post = fused::bias_dropout_residual_program(3, 2, 8, o).spec().postcondition(1, 1)->describe();
      EXPECT_NE(post.find(ln ? "fused.bias_dropout_residual_ln[$0, $1, $2, $3]({r0:i" : "fused.bias_dropout_residual[$0, $1, $2]({r0:i"),
                std::string::npos)
          << post;
    }
}

class EpilogueForms : public ::testing::TestWithParam<std::tuple<int, bool, bool>> {};

TEST_P(EpilogueForms, FusedEqualsUnfusedBitForBitAndTheArithmetic) {
  const auto [n, sp, ln] = GetParam();
  const int64_t hidden = 24, rows = 12 * n;
  fused::EpilogueOptions o;
  o.sequence_parallel = sp;
  o.layer_norm = ln;
  o.dropout = 0.25f;
  o.seed = 1234;
  on_ranks(n, [&, n = n, sp = sp, ln = ln](Comm& comm) {
    const int q = comm.rank();
    fused::BiasDropoutResidual op(comm, rows, hidden, o, 3);
    const int64_t total = rows * hidden, mine = sp ? total / n : total, first = sp ? q * mine : 0;
    auto partial_of = [&](int r, int64_t i) { return static_cast<float>((i * 5 + r * 3) % 11 - 5); };
    std::vector<float> partial(static_cast<size_t>(total)), bias(static_cast<size_t>(hidden)), gamma(bias), beta(bias),
        residual(static_cast<size_t>(mine));
    for (int64_t i = 0; i < total; ++i) partial[static_cast<size_t>(i)] = partial_of(q, i);
    for (int64_t c = 0; c < hidden; ++c)
      bias[static_cast<size_t>(c)] = static_cast<float>(c % 3) - 1, gamma[static_cast<size_t>(c)] = 1.0f + 0.125f * static_cast<float>(c % 4),
          beta[static_cast<size_t>(c)] = 0.5f * static_cast<float>(c % 2);
    for (int64_t i = 0; i < mine; ++i) residual[static_cast<size_t>(i)] = static_cast<float>((first + i) % 7);
    std::vector<float> partial2 = partial, out(static_cast<size_t>(mine)), out2(out), lnv(out), ln2(out);
    op.run(partial.data(), bias.data(), residual.data(), out.data(), gamma.data(), beta.data(), ln ? lnv.data() : nullptr)
        .wait();
    op.run_unfused(partial2.data(), bias.data(), residual.data(), out2.data(), gamma.data(), beta.data(),
                   ln ? ln2.data() : nullptr);
    EXPECT_TRUE(same_bits(out, out2));
    if (ln) {
      EXPECT_TRUE(same_bits(lnv, ln2));
    }
    // out is the residual plus either nothing (dropped) or (sum + bias) / (1 - p), exactly for
    // these small integers; about a quarter dropped.
    int64_t dropped = 0;
    for (int64_t i = 0; i < mine; ++i) {
      float sum = 0;
      for (int r = 0; r < n; ++r) sum += partial_of(r, first + i);
      const float kept = (sum + bias[static_cast<size_t>((first + i) % hidden)]) / 0.75f;
      const float got = out[static_cast<size_t>(i)] - residual[static_cast<size_t>(i)];
      if (got == 0.0f && kept != 0.0f) ++dropped;
      else ASSERT_FLOAT_EQ(got, kept) << "element " << first + i;
    }
    EXPECT_GT(dropped, mine / 8);
    EXPECT_LT(dropped, mine * 3 / 8);
    if (ln) {  // each row of (ln - beta) / gamma has mean 0 and variance 1
      for (int64_t r = 0; r < mine; r += hidden) {
        double s = 0, s2 = 0;
        for (int64_t c = 0; c < hidden; ++c) {
          const double x = (lnv[static_cast<size_t>(r + c)] - beta[static_cast<size_t>(c)]) / gamma[static_cast<size_t>(c)];
          s += x, s2 += x * x;
        }
        EXPECT_NEAR(s / hidden, 0.0, 1e-5);
        EXPECT_NEAR(s2 / hidden, 1.0, 1e-3);
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Forms, EpilogueForms,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return "n" + std::to_string(std::get<0>(info.param)) + (std::get<1>(info.param) ? "_sp" : "_ar") +
                                  (std::get<2>(info.param) ? "_ln" : "");
                         });

TEST(BiasDropoutResidual, BadShapesAreNamed) {
  on_ranks(2, [&](Comm& comm) {
    EXPECT_NE(error_of([&] { fused::BiasDropoutResidual(comm, 7, 4, {}); }).find("7 rows of 4 do not split over 2 ranks"),
              std::string::npos);
    fused::EpilogueOptions o;
    o.dropout = 1.0f;
    EXPECT_NE(error_of([&] { fused::BiasDropoutResidual(comm, 8, 4, o); }).find("dropout 1 is not in [0, 1)"),
              std::string::npos);
  });
}

// --- GEMM overlapped with reduce-scatter / all-gather --------------------------------------------

TEST(GemmOverlap, BothProgramsAreProved) {
  for (int n : {2, 3}) {
    plan::Compiled a = plan::compile(fused::gemm_reduce_scatter_program(n, 2, 12 * n, 5, 7));
    plan::Compiled b = plan::compile(fused::all_gather_gemm_program(n, 2, 12 * n, 5, 7));
    EXPECT_EQ(a.plan.states[0].unit, 6 * 5);  // x's blocks: 6 rows of 5
    EXPECT_EQ(b.plan.states[1].unit, 6 * 7);  // y's blocks: 6 rows of 7
  }
  // The proof names each rank's product: a block sent to the wrong owner fails it.
  plan::Compiled a = plan::compile(fused::gemm_reduce_scatter_program(2, 1, 4, 3, 3));
  const CollectiveSpec spec = fused::gemm_reduce_scatter_program(2, 1, 4, 3, 3).spec();
  for (auto& b : a.plan.ranks[0].blocks)
    for (auto& in : b.steps)
      if (in.op == plan::Opcode::kCompute && is_state(in.srcs[0].buffer)) in.srcs[0].index = 1 - in.srcs[0].index;
  plan::VerifyOptions o;
  o.spec = &spec;
  EXPECT_NE(error_of([&] { plan::verify(a.plan, o); }).find("postcondition"), std::string::npos);
}

class GemmRanks : public ::testing::TestWithParam<int> {};

// Small integers: every product and sum is exact, so any blocking and order give the same floats.
TEST_P(GemmRanks, FusedEqualsUnfusedAndTheArithmetic) {
  const int n = GetParam();
  const int64_t rows = 8 * n, k = 6, cols = 5;
  on_ranks(n, [&](Comm& comm) {
    const int q = comm.rank();
    std::vector<float> x(static_cast<size_t>(rows * k)), w(static_cast<size_t>(k * cols));
    auto xv = [](int r, int64_t i, int64_t c) { return static_cast<float>((i * 3 + c + r) % 5 - 2); };
    auto wv = [](int r, int64_t c, int64_t j) { return static_cast<float>((c * 2 + j * 3 + r) % 7 - 3); };
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t c = 0; c < k; ++c) x[static_cast<size_t>(i * k + c)] = xv(q, i, c);
    for (int64_t c = 0; c < k; ++c)
      for (int64_t j = 0; j < cols; ++j) w[static_cast<size_t>(c * cols + j)] = wv(q, c, j);
    {  // row-parallel: out = reduce_scatter(x @ w)
      fused::GemmReduceScatter op(comm, rows, k, cols, 2);
      const int64_t mine = rows / n * cols;
      std::vector<float> out(static_cast<size_t>(mine)), out2(out);
      op.run(x.data(), w.data(), out.data()).wait();
      op.run_unfused(x.data(), w.data(), out2.data());
      EXPECT_TRUE(same_bits(out, out2));
      for (int64_t i = 0; i < rows / n; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          float want = 0;
          for (int r = 0; r < n; ++r)
            for (int64_t c = 0; c < k; ++c) want += xv(r, q * (rows / n) + i, c) * wv(r, c, j);
          ASSERT_EQ(out[static_cast<size_t>(i * cols + j)], want) << "row " << i << " col " << j;
        }
    }
    {  // column-parallel: gathered = all_gather(x rows); y = gathered @ w
      fused::AllGatherGemm op(comm, rows, k, cols, 2);
      const float* xs = x.data() + q * (rows / n) * k;  // this rank's rows
      std::vector<float> g(static_cast<size_t>(rows * k)), g2(g), y(static_cast<size_t>(rows * cols)), y2(y);
      op.run(xs, w.data(), g.data(), y.data()).wait();
      op.run_unfused(xs, w.data(), g2.data(), y2.data());
      EXPECT_TRUE(same_bits(g, g2));
      EXPECT_TRUE(same_bits(y, y2));
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          float want = 0;
          for (int64_t c = 0; c < k; ++c) want += xv(static_cast<int>(i / (rows / n)), i, c) * wv(q, c, j);
          ASSERT_EQ(y[static_cast<size_t>(i * cols + j)], want) << "row " << i << " col " << j;
        }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, GemmRanks, ::testing::Values(2, 3, 4));

// --- MoE dispatch and combine ------------------------------------------------------------------

TEST(Moe, DispatchAndCombineAreProved) {
  for (int n : {2, 4}) {
    plan::Compiled d = plan::compile(fused::moe_dispatch_program(n, 10, 4, 3));
    plan::Compiled c = plan::compile(fused::moe_combine_program(n, 10, 4, 3));
    EXPECT_EQ(d.plan.states[1].unit, 3);  // the slot indices: one per slot
    const std::string post = fused::moe_combine_program(n, 10, 4, 3).spec().state_postcondition(1, 0, 0)->describe();
    EXPECT_NE(post.find("moe.combine_first[4]({r1:i1}, {r1:s1[1]}, {r1:s2[1]})"), std::string::npos) << post;
  }
}

class MoeRanks : public ::testing::TestWithParam<int> {};

// Each rank routes token t to rank (t + rank) % n, at most `capacity` per destination (the rest
// dropped, as with a capacity factor); the experts multiply by (rank + 2); gates are quarters.
TEST_P(MoeRanks, FusedEqualsUnfusedAndTheArithmetic) {
  const int n = GetParam();
  const int64_t tokens = 11, hidden = 6, capacity = 4;
  on_ranks(n, [&](Comm& comm) {
    const int r = comm.rank();
    fused::MoeExchange moe(comm, tokens, hidden, capacity);
    std::vector<float> x(static_cast<size_t>(tokens * hidden));
    for (int64_t i = 0; i < tokens * hidden; ++i) x[static_cast<size_t>(i)] = static_cast<float>((i + 3 * r) % 13 - 6);
    std::vector<int32_t> index(static_cast<size_t>(n * capacity), -1);
    std::vector<float> gate(index.size(), 0.0f);
    std::vector<int64_t> used(static_cast<size_t>(n), 0);
    std::vector<float> want(x.size(), 0.0f);
    for (int64_t t = 0; t < tokens; ++t) {
      const int q = static_cast<int>((t + r) % n);
      if (used[static_cast<size_t>(q)] == capacity) continue;  // over capacity: dropped, y row stays 0
      const int64_t s = q * capacity + used[static_cast<size_t>(q)]++;
      index[static_cast<size_t>(s)] = static_cast<int32_t>(t);
      gate[static_cast<size_t>(s)] = 0.25f * static_cast<float>(1 + t % 3);
      for (int64_t c = 0; c < hidden; ++c)
        want[static_cast<size_t>(t * hidden + c)] = gate[static_cast<size_t>(s)] * (x[static_cast<size_t>(t * hidden + c)] * static_cast<float>(q + 2));
    }
    const size_t slots = static_cast<size_t>(n * capacity * hidden);
    std::vector<float> in(slots), in2(slots), y(x.size(), -1.0f), y2(x.size(), -1.0f);
    moe.dispatch(x.data(), index.data(), in.data()).wait();
    moe.dispatch_unfused(x.data(), index.data(), in2.data());
    EXPECT_TRUE(same_bits(in, in2));
    std::vector<float> expert_out(in);
    for (float& v : expert_out) v *= static_cast<float>(r + 2);  // this rank's expert
    moe.combine(expert_out.data(), gate.data(), index.data(), y.data()).wait();
    moe.combine_unfused(expert_out.data(), gate.data(), index.data(), y2.data());
    EXPECT_TRUE(same_bits(y, y2));
    EXPECT_TRUE(same_bits(y, want));
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, MoeRanks, ::testing::Values(2, 3, 4));

TEST(Moe, AnIndexOutOfRangeIsNamed) {
  on_ranks(2, [&](Comm& comm) {
    fused::MoeExchange moe(comm, 4, 2, 2);
    std::vector<float> x(8), out(8);
    std::vector<int32_t> index = {0, 1, 7, -1};  // token 7 of 4
    const std::string e = error_of([&] { moe.dispatch_unfused(x.data(), index.data(), out.data()); });
    EXPECT_NE(e.find("kernel 'moe.gather': slot 0 names token 7 of 4"), std::string::npos) << e;
    const std::string f = error_of([&] { moe.dispatch(x.data(), index.data(), out.data()); });
    EXPECT_NE(f.find("MoeExchange::dispatch: slot 2 (destination 1) names token 7 of 4"), std::string::npos) << f;
  });
}

// --- the ZeRO step in halves (a trainer's norm spans several groups) ------------------------------

TEST(ZeroStep, TheHalvesAreProved) {
  for (auto [n, k] : {std::pair{2, 3}, {3, 1}}) {
    plan::compile(fused::zero_reduce_program(n, k));
    plan::compile(fused::zero_update_program(n, k));
  }
}

TEST(ZeroStep, ReduceThenUpdateEqualsTheWholeStepBitForBit) {
  for (int n : {2, 3}) {
    const int64_t shard = 96;
    on_ranks(n, [&](Comm& comm) {
      const int q = comm.rank();
      fused::ZeroStep step(comm, shard, 4);
      Buffers whole(n, shard, q, 1), halves(n, shard, q, 1);
      std::vector<float> master(halves.params.begin() + q * shard, halves.params.begin() + (q + 1) * shard);
      fused::AdamW opt;
      opt.lr = 0.02f;
      opt.weight_decay = 0.1f;
      opt.max_norm = 20.0f;
      opt.grad_scale = 0.5f;
      step.run(whole.grads.data(), whole.params.data(), whole.m.data(), whole.v.data(), opt).wait();
      step.reduce(halves.grads.data(), opt.grad_scale).wait();
      // The caller's norm: every rank's sum in rank order, as the whole step adds them.
      std::vector<float> sums(static_cast<size_t>(n));
      const float mine = static_cast<float>(step.local_sum_squares());
      comm.all_gather(&mine, sums.data(), 1, DataType::kFloat32).wait();
      float total = sums[0];
      for (int r = 1; r < n; ++r) total += sums[static_cast<size_t>(r)];
      EXPECT_NEAR(std::sqrt(total), step.last_norm(), 1e-6 * step.last_norm());  // run()'s norm
      const float clip = std::min(1.0f, opt.max_norm / (std::sqrt(total) + 1e-6f));
      EXPECT_LT(clip, 1.0f);  // the case clips
      step.update(halves.grads.data(), master.data(), halves.m.data(), halves.v.data(), halves.params.data(), nullptr,
                  opt, clip)
          .wait();
      EXPECT_TRUE(same_bits(halves.params, whole.params));
      EXPECT_TRUE(same_bits(halves.m, whole.m));
      EXPECT_TRUE(same_bits(halves.v, whole.v));
      EXPECT_TRUE(same_bits(master, std::vector<float>(whole.params.begin() + q * shard, whole.params.begin() + (q + 1) * shard)));
      // Per-parameter decay: zero multipliers leave weight decay out for those parameters.
      std::vector<float> no_decay(static_cast<size_t>(shard), 0.0f), m2(halves.m), v2(halves.v), master2(master);
      std::vector<float> params2(halves.params);
      step.update(halves.grads.data(), master2.data(), m2.data(), v2.data(), params2.data(), no_decay.data(), opt, clip)
          .wait();
      fused::AdamW plain = opt;
      plain.weight_decay = 0;
      step.update(halves.grads.data(), master.data(), halves.m.data(), halves.v.data(), halves.params.data(), nullptr,
                  plain, clip)
          .wait();
      EXPECT_TRUE(same_bits(params2, halves.params));
    });
  }
}

TEST(StateBuffers, OnlyCustomCollectivesHaveThemAndMscclXmlRefusesThem) {
  plan::Compiled c = plan::compile(fused::zero_step_program(2, 1));
  EXPECT_NE(error_of([&] { plan::export_msccl_xml(c.plan); }).find("names state buffers ('params', ...): MSCCL XML"),
            std::string::npos);
  plan::Plan wrong = c.plan;
  wrong.collective = Collective::kAllReduce;
  EXPECT_NE(error_of([&] { plan::verify(wrong); }).find("the all_reduce plan names state buffers"), std::string::npos);
  // And the JSON round trip keeps them.
  EXPECT_EQ(plan::parse_json(plan::to_json(c.plan)), c.plan);
}

// Mixed precision: the fp32 master shard and the all-gathered bf16 parameters, fused == unfused.
TEST(ZeroStep, TheBf16StepEqualsItsUnfusedFormAndCastsTheMaster) {
  for (int n : {2, 3}) {
    const int64_t shard = 128;
    on_ranks(n, [&](Comm& comm) {
      const int q = comm.rank();
      fused::ZeroStep step(comm, shard, 4);
      Buffers a(n, shard, q, 2), b(n, shard, q, 2);
      std::vector<float> master_a(a.params.begin() + q * shard, a.params.begin() + (q + 1) * shard), master_b(master_a);
      std::vector<uint16_t> p16_a(static_cast<size_t>(n * shard), 0xFFFF), p16_b(p16_a);
      fused::AdamW opt;
      opt.lr = 0.01f;
      opt.max_norm = 30.0f;
      opt.grad_scale = 0.25f;
      for (int t = 1; t <= 2; ++t) {
        opt.step = t;
        a.next_grads(n, q, t);
        b.next_grads(n, q, t);
        step.run_bf16(a.grads.data(), master_a.data(), a.m.data(), a.v.data(), p16_a.data(), opt).wait();
        step.run_bf16_unfused(b.grads.data(), master_b.data(), b.m.data(), b.v.data(), p16_b.data(), opt);
        EXPECT_TRUE(same_bits(master_a, master_b)) << "step " << t;
        EXPECT_TRUE(same_bits(a.m, b.m));
        EXPECT_EQ(p16_a, p16_b);
        // This rank's bf16 parameters are its master rounded (bf16 keeps float's top 16 bits, rounded).
        for (int64_t i = 0; i < shard; ++i) {
          const float back = [&] {
            uint32_t bits = static_cast<uint32_t>(p16_a[static_cast<size_t>(q * shard + i)]) << 16;
            float f;
            std::memcpy(&f, &bits, 4);
            return f;
          }();
          ASSERT_NEAR(back, master_a[static_cast<size_t>(i)], std::fabs(master_a[static_cast<size_t>(i)]) / 128.0f) << i;
        }
      }
      // Odd pieces cannot hold bf16 pairs.
      fused::ZeroStep odd(comm, 6, 2);
      std::vector<float> g(static_cast<size_t>(6 * n)), mm(6), vv(6), w(6);
      std::vector<uint16_t> h(static_cast<size_t>(6 * n));
      EXPECT_NE(error_of([&] { odd.run_bf16(g.data(), w.data(), mm.data(), vv.data(), h.data(), opt); })
                    .find("pieces of 3 parameters: bf16 pieces need an even number"),
                std::string::npos);
    });
  }
}

TEST(ZeroStep, TheBf16CastIsCoreElementsRoundToNearestEven) {
  // Every float whose top bits vary, plus the halfway cases, infinities, NaNs and denormals.
  std::vector<float> values;
  for (uint32_t hi = 0; hi < 0x10000u; hi += 7)
    for (uint32_t lo : {0x0000u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu}) {
      const uint32_t bits = (hi << 16) | lo;
      float f;
      std::memcpy(&f, &bits, 4);
      values.push_back(f);
    }
  std::vector<uint16_t> got(values.size());
  fused::to_bf16(got.data(), values.data(), static_cast<int64_t>(values.size()));
  for (size_t i = 0; i < values.size(); ++i)
    ASSERT_EQ(got[i], element::float_to_bf16(values[i])) << "value " << i;
}

// A kernel gets operands of one unit unless it declares mixed units, and one that does checks each
// operand's length: a plan that hands it a statistic where it writes data is refused when it runs.
TEST(StateBuffers, KernelsGetOperandsTheyCanHold) {
  CollectiveSpec s;
  s.kind = Collective::kCustom;
  s.nranks = 1;
  s.custom_input_chunks = 1;
  s.states = {StateBufferSpec{"stats", 1, 1, {}}};
  {  // scale (one unit) on a statistic and a chunk of data: refused by the DSL
    dsl::Program p("mixed", s);
    const std::string e = error_of([&] {
      p.apply(kernels::kScale, {p.chunk(0, dsl::Buffer::input(), 0)}, {p.chunk(0, dsl::Buffer::state("stats"), 0)}, {2.0});
    });
    EXPECT_NE(e.find("kernel 'scale' takes operands of one size"), std::string::npos) << e;
  }
  // unscale_sumsq with its outputs swapped: the data into the statistic. It verifies (the kernel
  // declares mixed units) and the kernel refuses it by operand.
  fused::register_kernels();
  dsl::Program p("swapped", s);
  auto g = p.chunk(0, dsl::Buffer::input(), 0);
  g.then(*find_kernel("zero.unscale_sumsq"), {1.0}, {}, {p.chunk(0, dsl::Buffer::state("stats"), 0), g});
  CompiledPlan plan = compile_plan(p);
  on_ranks(1, [&](Comm& comm) {
    std::vector<float> x(64, 1.0f), stat(1);
    PlanCall call;
    call.input = x.data();
    call.count = 64;
    call.states = {stat.data()};
    const std::string e = error_of([&] { run_plan(comm, plan, call).wait(); });
    EXPECT_NE(e.find("kernel 'zero.unscale_sumsq': output 0 holds 1 element(s), 64 needed"), std::string::npos) << e;
  });
  EXPECT_NE(error_of([&] { dsl::Program q("noname", s); q.chunk(0, dsl::Buffer::state(""), 0); }).find("a state buffer is named"),
            std::string::npos);
}

// Seeds above 2^53 keep their low bits: consecutive seeds draw different masks.
TEST(BiasDropoutResidual, EverySeedBitCounts) {
  on_ranks(2, [&](Comm& comm) {
    fused::EpilogueOptions o;
    o.dropout = 0.5f;
    const uint64_t base = uint64_t{1} << 60;
    std::vector<std::vector<float>> outs;
    for (uint64_t seed : {base, base + 1}) {
      o.seed = seed;
      fused::BiasDropoutResidual op(comm, 8, 16, o, 1);
      std::vector<float> partial(128, 1.0f), bias(16, 0.0f), residual(128, 0.0f), out(128);
      op.run(partial.data(), bias.data(), residual.data(), out.data()).wait();
      outs.push_back(out);
    }
    EXPECT_NE(outs[0], outs[1]);
  });
}

namespace {
struct OneThread {  // a device team of one thread, as the emulated device runs kernels
  int rank() const { return 0; }
  int size() const { return 1; }
  void sync() const {}
  double sum(double v) const { return v; }
};
}  // namespace

// The vectorised epilogue loops draw the device form's mask and compute its floats, element by
// element (LayerNorm's row sums in its order): rows whose length is no multiple of any vector width
// (a scalar tail), offsets into the tensor, seeds of 64 bits, and dropout 0 (nothing drawn), 0.1,
// 0.5 and 1 (everything dropped).
TEST(BiasDropoutResidual, VectorisedLoopIsTheDeviceFormBitForBit) {
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  for (int64_t hidden : {1, 7, 16, 37, 768})
    for (double p : {0.0, 0.1, 0.5, 1.0})
      for (uint64_t seed : {uint64_t{0}, uint64_t{0x9E3779B97F4A7C15ull}})
        for (int64_t offset_rows : {0, 5}) {
          const int64_t rows = 3, n = rows * hidden, offset = offset_rows * hidden;
          std::vector<float> y(static_cast<size_t>(n)), bias(static_cast<size_t>(hidden)), residual(y.size()), out(y.size());
          for (float& x : y) x = dist(gen);
          for (float& x : bias) x = dist(gen);
          for (float& x : residual) x = dist(gen);
          const double scalars[3] = {p, static_cast<double>(seed >> 32), static_cast<double>(seed & 0xFFFFFFFFu)};
          const device::Dropout d = device::dropout_of(scalars);
          fused::bias_dropout_add_rows({y.data(), bias.data(), residual.data(), out.data(), n, hidden, d.on, d.seed,
                                        static_cast<uint64_t>(offset), d.threshold, d.scale});
          int64_t kept = 0;
          for (int64_t i = 0; i < n; ++i) {
            const float want = device::bias_dropout_add(d, y[static_cast<size_t>(i)], bias[static_cast<size_t>(i % hidden)],
                                                        residual[static_cast<size_t>(i)], static_cast<uint64_t>(offset + i));
            ASSERT_EQ(std::bit_cast<uint32_t>(out[static_cast<size_t>(i)]), std::bit_cast<uint32_t>(want))
                << "hidden " << hidden << ", dropout " << p << ", seed " << seed << ", offset " << offset << ", element " << i;
            kept += out[static_cast<size_t>(i)] != residual[static_cast<size_t>(i)];
          }
          // With LayerNorm: the same floats as the device form on a team of one thread (the emulated
          // device), whose row sums follow the CPU's eight vector lanes.
          std::vector<float> gamma(static_cast<size_t>(hidden)), beta(gamma.size()), ln(y.size()), dev_out(y.size()),
              dev_ln(y.size());
          for (float& x : gamma) x = dist(gen);
          for (float& x : beta) x = dist(gen);
          fused::layer_norm_rows(out.data(), gamma.data(), beta.data(), ln.data(), n, hidden, 1e-5f);
          const double ln_scalars[4] = {scalars[0], scalars[1], scalars[2], 1e-5};
          device::bias_dropout_residual_ln(OneThread{}, y.data(), bias.data(), residual.data(), gamma.data(), beta.data(),
                                           dev_out.data(), dev_ln.data(), n, hidden, offset, ln_scalars);
          ASSERT_EQ(std::memcmp(dev_out.data(), out.data(), out.size() * sizeof(float)), 0) << hidden;
          for (int64_t i = 0; i < n; ++i)
            ASSERT_EQ(std::bit_cast<uint32_t>(ln[static_cast<size_t>(i)]), std::bit_cast<uint32_t>(dev_ln[static_cast<size_t>(i)]))
                << "LayerNorm, hidden " << hidden << ", dropout " << p << ", element " << i;
          if (p == 0.5 && n >= 1000) {  // and the mask is not trivial: about half kept
            EXPECT_GT(kept, n * 4 / 10) << hidden;
            EXPECT_LT(kept, n * 6 / 10) << hidden;
          }
        }
}

// The reduce-scatter's unscale and sum of squares stream over its receives (KernelDef::stream):
// every piece a rank owns, and the same floats and sum however the receive cuts the piece.
TEST(ZeroStep, TheUnscaleStreamsOverEveryReceiveAndEqualsItsOwnPass) {
  for (int n : {2, 4}) {
    auto prepared = compile_plan(fused::zero_step_program(n, 8)).prepared();
    for (int r = 0; r < n; ++r) EXPECT_EQ(streamed_epilogues(*prepared, r).size(), 8u) << n << " ranks, rank " << r;
  }
  std::mt19937 rng(7);
  const int64_t count = 10000 + 37;
  std::vector<float> in(static_cast<size_t>(count));
  for (float& x : in) x = std::uniform_real_distribution<float>(-100, 100)(rng);
  std::vector<float> whole(in.size());
  const double want = fused::unscale_square(whole.data(), in.data(), count, 0.125f);
  // Squares are summed in float within each group of 64 and in double across groups: close to the
  // exact sum, and the unfused norm pass gives the same double.
  long double exact = 0;
  for (float x : whole) exact += static_cast<long double>(x) * x;
  EXPECT_NEAR(want, static_cast<double>(exact), 1e-6 * static_cast<double>(exact));
  EXPECT_EQ(std::bit_cast<uint64_t>(fused::sum_squares(whole.data(), count)), std::bit_cast<uint64_t>(want));
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> out(in.size());
    std::vector<unsigned char> state(fused::unscale_square_state_bytes(), 0);
    auto* acc = reinterpret_cast<double*>(state.data());
    int64_t at = 0;
    while (true) {
      const int64_t next = at + 64 * std::uniform_int_distribution<int64_t>(0, 40)(rng);
      if (next >= count) break;
      fused::unscale_square_piece(out.data() + at, in.data() + at, next - at, 0.125f, acc, false);
      at = next;
    }
    const double got = fused::unscale_square_piece(out.data() + at, in.data() + at, count - at, 0.125f, acc, true);
    EXPECT_EQ(std::bit_cast<uint64_t>(got), std::bit_cast<uint64_t>(want)) << "trial " << trial;
    EXPECT_TRUE(same_bits(out, whole)) << "trial " << trial;
  }
  // A piece before the last that is not whole groups would leave elements out: refused.
  std::vector<unsigned char> state(fused::unscale_square_state_bytes(), 0);
  std::vector<float> out(in.size());
  EXPECT_NE(error_of([&] {
              fused::unscale_square_piece(out.data(), in.data(), 63, 0.125f, reinterpret_cast<double*>(state.data()), false);
            }).find("not a multiple of"),
            std::string::npos);
}
