// The trainer: the one-rank model against PyTorch (tests/data/gpt_golden.bin, written by
// tools/trainer/make_golden.py), every parallel layout against the one-rank run, the rank -> group
// table, data and checkpoints.
//
// Tolerances. Float32 sums taken in another order (OpenBLAS's blocking against PyTorch's, a sum
// over ranks against a sum inside one GEMM) differ by a few units in the last place of the largest
// terms, so values are compared relative to the largest magnitude of their tensor: |a - b| <=
// 1e-5 * max |b|. Where the order cannot change the comparison is bit for bit (said at the test).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <numeric>
#include <random>
#include <thread>

#include "trainer/checkpoint.hpp"
#include "trainer/data.hpp"
#include "trainer/gpt.hpp"
#include "trainer/groups.hpp"
#include "trainer/trainer.hpp"
#include "support/trainer_run.hpp"

using namespace tutti;
using namespace tutti::train;

namespace {

constexpr double kRel = 1e-5;

// The golden file's records by name.
std::map<std::string, std::vector<float>> read_golden() {
  // TUTTI_GOLDEN: the file elsewhere (the GPU machine runs this binary outside the source tree).
  const char* path = std::getenv("TUTTI_GOLDEN");
  std::ifstream in(path ? path : TUTTI_SOURCE_DIR "/tests/data/gpt_golden.bin", std::ios::binary);
  EXPECT_TRUE(in) << "tests/data/gpt_golden.bin is missing (tools/trainer/make_golden.py writes it)";
  char magic[4];
  uint32_t version = 0, count = 0;
  in.read(magic, 4);
  in.read(reinterpret_cast<char*>(&version), 4);
  in.read(reinterpret_cast<char*>(&count), 4);
  EXPECT_EQ(std::string(magic, 4), "TGLD");
  EXPECT_EQ(version, 1u);
  std::map<std::string, std::vector<float>> out;
  for (uint32_t i = 0; i < count && in; ++i) {
    uint32_t len = 0;
    uint64_t n = 0;
    in.read(reinterpret_cast<char*>(&len), 4);
    std::string name(len, '\0');
    in.read(name.data(), len);
    in.read(reinterpret_cast<char*>(&n), 8);
    std::vector<float> v(n);
    in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * 4));
    out[name] = std::move(v);
  }
  return out;
}

// |a - b| <= rel * scale element by element; scale: max |b| unless given.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double rel, const std::string& what,
                  double scale = 0) {
  ASSERT_EQ(got.size(), want.size()) << what;
  if (scale == 0)
    for (float w : want) scale = std::max(scale, std::fabs(static_cast<double>(w)));
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_LE(std::fabs(static_cast<double>(got[i]) - want[i]), rel * scale)
        << what << " element " << i << ": " << got[i] << " vs " << want[i] << " (largest " << scale << ")";
}

std::vector<float> whole(Gpt& m, const float* arena, const Tensor& t) {
  std::vector<float> w(static_cast<size_t>(t.rows * t.cols));
  m.get_whole(t.name, arena, w.data());
  return w;
}

// The kernels of a backend, or a skip saying why there are none (no CUDA device, no CUDA build).
std::unique_ptr<Ops> backend_or_skip(const std::string& name, std::string* why) {
  if (name == "cpu") return make_cpu_ops(1);
  try {
    return make_cuda_ops(0);
  } catch (const Error& e) {
    *why = e.what();
    return nullptr;
  }
}

// The golden file's model and optimizer settings, its batch size and step count.
struct GoldenConfig {
  ModelConfig model;
  OptimConfig optim;
  int batch = 0, steps = 0;
};
GoldenConfig golden_config(std::map<std::string, std::vector<float>>& g) {
  const auto& c = g["config"];
  GoldenConfig out;
  out.model.vocab = static_cast<int>(c[0]);
  out.model.seq = static_cast<int>(c[1]);
  out.model.layers = static_cast<int>(c[2]);
  out.model.heads = static_cast<int>(c[3]);
  out.model.channels = static_cast<int>(c[4]);
  out.batch = static_cast<int>(c[5]);
  out.steps = static_cast<int>(c[6]);
  out.optim.lr = out.optim.min_lr = c[7];  // constant
  out.optim.weight_decay = c[8];
  out.optim.beta1 = c[9];
  out.optim.beta2 = c[10];
  out.optim.eps = c[11];
  out.optim.grad_clip = c[12];
  out.optim.steps = out.steps;
  return out;
}

class Golden : public testing::TestWithParam<std::string> {};

TEST_P(Golden, OneRankMatchesPyTorch) {
  std::string why;
  auto ops = backend_or_skip(GetParam(), &why);
  if (!ops) GTEST_SKIP() << why;
  auto g = read_golden();
  ASSERT_FALSE(g.empty());
  const GoldenConfig gc = golden_config(g);
  const ModelConfig& mc = gc.model;
  const OptimConfig& oc = gc.optim;
  const int B = gc.batch, steps = gc.steps;
  std::vector<int32_t> tokens(g["tokens"].begin(), g["tokens"].end());

  Groups groups = Groups::single(Layout{});
  Trainer trainer(mc, oc, groups, *ops, B, 1);
  Gpt& m = trainer.model();
  for (const Tensor& t : m.layout().tensors()) m.set_whole(t.name, g["init." + t.name].data());
  trainer.params_changed();

  // One forward and backward.
  const double loss = m.forward(tokens.data());
  EXPECT_NEAR(loss, g["loss"][0], kRel * std::fabs(g["loss"][0]));
  // Logits: ours are rows t * B + b, PyTorch's (b, t, v).
  const int64_t T = mc.seq, V = mc.vocab;
  std::vector<float> logits(static_cast<size_t>(T * B * V)), want(logits.size());
  ops->download(logits.data(), m.logits(), T * B * V);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t v = 0; v < V; ++v) want[(t * B + b) * V + v] = g["logits"][(b * T + t) * V + v];
  expect_close(logits, want, kRel, "logits");
  m.zero_grads();
  m.backward();
  for (const Tensor& t : m.layout().tensors()) expect_close(whole(m, m.grads(), t), g["grad." + t.name], kRel, "grad of " + t.name);

  // Ten AdamW steps with clipping on the same batch, from the initial weights again.
  for (const Tensor& t : m.layout().tensors()) m.set_whole(t.name, g["init." + t.name].data());
  trainer.params_changed();
  for (int s = 0; s < steps; ++s) {
    StepResult r = trainer.step(tokens.data());
    EXPECT_NEAR(r.loss, g["losses"][static_cast<size_t>(s)], kRel * g["losses"][static_cast<size_t>(s)]) << "step " << s;
  }
  // The key bias is left out: its gradient is 0 in exact arithmetic (adding it shifts every score
  // of a query by the same amount, which softmax ignores), so what both runs compute is rounding
  // noise, and AdamW's m / sqrt(v) turns noise of any size into steps of the learning rate's size.
  for (const Tensor& t : m.layout().tensors()) {
    std::vector<float> got = whole(m, m.params(), t), want = g["final." + t.name];
    if (t.name.ends_with("attn.qkv.bias"))
      for (int64_t i = mc.channels; i < 2 * mc.channels; ++i) got[static_cast<size_t>(i)] = want[static_cast<size_t>(i)];
    expect_close(got, want, kRel, "after 10 steps: " + t.name);
  }
}

// bfloat16 GEMMs round every operand to 8 significant bits (relative 2^-9): the loss stays within a
// percent of float32 PyTorch's over the 10 steps.
TEST(GoldenBf16, StaysWithinAPercentOfPyTorch) {
  std::unique_ptr<Ops> ops;
  try {
    ops = make_cuda_ops(0, true);
  } catch (const Error& e) {
    GTEST_SKIP() << e.what();
  }
  auto g = read_golden();
  const GoldenConfig gc = golden_config(g);
  Groups groups = Groups::single(Layout{});
  Trainer trainer(gc.model, gc.optim, groups, *ops, gc.batch, 1);
  for (const Tensor& t : trainer.model().layout().tensors()) trainer.model().set_whole(t.name, g["init." + t.name].data());
  trainer.params_changed();
  std::vector<int32_t> tokens(g["tokens"].begin(), g["tokens"].end());
  for (size_t s = 0; s < g["losses"].size(); ++s)
    EXPECT_NEAR(trainer.step(tokens.data()).loss, g["losses"][s], 1e-2 * g["losses"][s]) << "step " << s;
}

INSTANTIATE_TEST_SUITE_P(Backends, Golden, testing::Values("cpu", "cuda"), [](const auto& info) { return info.param; });

// --- every layout equals the one-rank run --------------------------------------------------------

using test_support::kSteps;
using test_support::make_layout;
using test_support::RunResult;

// Trains the tiny model in `layout`, its ranks as threads of this process.
RunResult run_layout(const Layout& layout, const test_support::RunOptions& options = {}) {
  if (layout.world() == 1) return test_support::train_rank(nullptr, layout, options);
  std::vector<Comm> comms = Comm::create_local(layout.world());
  std::vector<RunResult> parts(comms.size());
  std::vector<std::exception_ptr> errors(comms.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < comms.size(); ++r)
    threads.emplace_back([&, r] {
      try {
        parts[r] = test_support::train_rank(&comms[r], layout, options);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  RunResult whole;
  for (const RunResult& p : parts) test_support::add_parts(whole, p);
  return whole;
}

// Losses relative to themselves. Parameters relative to the model's largest (the LayerNorm weights,
// near 1): per tensor is too strict for the zero-initialised biases, whose values are nothing but
// their updates. Their gradients are sums over rows with cancellation, so reordering them changes
// the gradient by a relative amount far above 1e-5, and AdamW's m / sqrt(v) hands that relative
// error straight to the update. A real fault (a missing reduction, a wrong shard) moves a
// parameter by the learning rate, 1e-3 per step: two orders of magnitude above this bound.
TEST(Parity, EveryLayoutTrainsLikeOneRank) {
  const RunResult one = run_layout(make_layout(1, 1));
  ASSERT_EQ(one.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_LT(one.losses.back(), one.losses.front());  // it learns
  for (Layout l : {make_layout(1, 2), make_layout(1, 4), make_layout(2, 1), make_layout(4, 1), make_layout(2, 1, true),
                   make_layout(4, 1, true), make_layout(2, 2), make_layout(2, 2, true), make_layout(1, 2, false, 1),
                   make_layout(1, 2, false, 2), make_layout(1, 2, false, 3), make_layout(1, 4, false, 1),
                   make_layout(1, 4, false, 2), make_layout(1, 4, false, 3), make_layout(2, 2, false, 1)})
    EXPECT_EQ(test_support::compare_training(run_layout(l), one), "") << l.describe();
}

// Pipelines: each schedule at 2 and 4 stages, and combined with tensor, sequence and data
// parallelism, trains like one rank (the model of 4 layers, 8 for 4 ranks of 2 chunks each). The
// micro-batches change only the order in which gradients are summed. Each rank's activation peak is
// the schedule checker's prediction.
TEST(Pipeline, EveryScheduleTrainsLikeOneRank) {
  using test_support::with_pipeline;
  for (int layers : {4, 8}) {
    test_support::RunOptions o;
    o.layers = layers;
    const RunResult one = run_layout(make_layout(1, 1), o);
    std::vector<Layout> layouts;
    for (int pp : {2, 4})
      for (ScheduleKind k : {ScheduleKind::kGpipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved,
                             ScheduleKind::kZeroBubble}) {
        const int vp = k == ScheduleKind::kInterleaved ? 2 : 1;
        if ((layers == 8) != (pp * vp == 8)) continue;  // one layer per stage at 8 stages
        layouts.push_back(with_pipeline(make_layout(1, 1), pp, k, pp == 4 ? 4 : 8, vp));
      }
    if (layers == 4) {
      layouts.push_back(with_pipeline(make_layout(2, 1), 2, ScheduleKind::k1F1B, 4));        // TP2 x PP2
      layouts.push_back(with_pipeline(make_layout(2, 1, true), 2, ScheduleKind::kZeroBubble, 4));  // with SP
      layouts.push_back(with_pipeline(make_layout(1, 2), 2, ScheduleKind::kInterleaved, 2, 2));  // DP2 x PP2
      layouts.push_back(with_pipeline(make_layout(1, 1), 1, ScheduleKind::k1F1B, 4));        // micro-batches alone
    }
    for (const Layout& l : layouts) {
      const RunResult r = run_layout(l, o);
      ASSERT_EQ(r.losses.size(), one.losses.size()) << l.describe();
      EXPECT_EQ(test_support::compare_training(r, one), "") << l.describe() << " L" << layers;
      std::printf("%s L%d: loss %.6f -> %.6f (one rank %.6f), peak %d slots\n", l.describe().c_str(), layers,
                  r.losses.front(), r.losses.back(), one.losses.back(), r.activation_slots);
      EXPECT_EQ(r.activation_slots, r.predicted_slots) << l.describe();
    }
  }
}

// The pipeline with every other dimension, up to 8 ranks: ZeRO-1 over the dp ranks of each stage
// runs the fused step, the tied embedding's gradient crosses from the last stage to the first.
TEST(Pipeline, CombinedWithTensorDataParallelAndZeroTrainsLikeOneRank) {
  using test_support::with_pipeline;
  test_support::RunOptions o;
  o.layers = 4;
  const RunResult one = run_layout(make_layout(1, 1), o);
  for (const Layout& l : {with_pipeline(make_layout(1, 2, false, 1), 2, ScheduleKind::k1F1B, 4),
                          with_pipeline(make_layout(1, 2, false, 2), 2, ScheduleKind::kZeroBubble, 2),
                          with_pipeline(make_layout(2, 2), 2, ScheduleKind::k1F1B, 2),
                          with_pipeline(make_layout(2, 2, true, 1), 2, ScheduleKind::kInterleaved, 2, 2)}) {
    const RunResult r = run_layout(l, o);
    EXPECT_EQ(test_support::compare_training(r, one), "") << l.describe();
    EXPECT_EQ(r.fused_zero, l.zero > 0) << l.describe();
  }
}

// Experts split over ep ranks train like one rank holding them all: top-1 and top-2, dropless and
// with a capacity (routing groups of 2 sequences in every run, so the same tokens are dropped).
TEST(Experts, ExpertParallelLayoutsTrainLikeOneRank) {
  Layout ep2 = make_layout(1, 2), ep4 = make_layout(1, 4), ep2dp2 = make_layout(1, 4), tp2ep2 = make_layout(2, 2);
  ep2.ep = 2, ep4.ep = 4, ep2dp2.ep = 2, tp2ep2.ep = 2;
  Layout tp2sp_ep2 = tp2ep2;
  tp2sp_ep2.sp = true;
  // With a pipeline too: the auxiliary losses of the first stage's layers travel with the loss.
  Layout ep2pp2 = test_support::with_pipeline(make_layout(1, 2), 2, ScheduleKind::k1F1B, 2);
  ep2pp2.ep = 2;
  for (int k : {1, 2})
    for (float capacity : {0.0f, 1.0f}) {
      test_support::RunOptions o;
      o.experts = 4;
      o.top_k = k;
      o.capacity = capacity;
      o.moe_group = 2;
      const RunResult one = run_layout(make_layout(1, 1), o);
      EXPECT_LT(one.losses.back(), one.losses.front());
      for (const Layout& l : {ep2, ep4, ep2dp2, tp2ep2, tp2sp_ep2, make_layout(1, 2), ep2pp2}) {
        const RunResult r = run_layout(l, o);
        EXPECT_EQ(test_support::compare_training(r, one), "")
            << l.describe() << " top" << k << (capacity > 0 ? " capacity 1" : " dropless");
      }
    }
}

// The mixture's backward against finite differences of its loss (cross-entropy plus the auxiliary
// loss), for the router, the experts and the LayerNorm in front of them: the parity tests above
// compare layouts running the same code, this checks the code itself.
TEST(Experts, GradientsMatchFiniteDifferences) {
  struct Case {
    int k;
    float capacity;
  };
  for (const Case c : {Case{1, 0.0f}, Case{2, 0.0f}, Case{2, 1.0f}}) {
    ModelConfig m = test_support::tiny(1);
    m.experts = 4;
    m.top_k = c.k;
    m.capacity = c.capacity;
    m.aux_loss = 0.05f;  // large enough that its gradient matters
    auto ops = make_cpu_ops(1);
    Collectives solo;
    Gpt g(m, Layout{}, 0, 2, *ops, solo);
    g.init(11);
    const TokenStream data = test_support::synthetic_tokens(m.vocab, 4000);
    std::vector<int32_t> seqs(static_cast<size_t>(2 * (m.seq + 1)));
    cut_batch(data, 3, 2, 0, 2, m.seq, seqs.data());
    g.forward(seqs.data());
    g.zero_grads();
    g.backward();
    const std::vector<float> grads(g.grads(), g.grads() + g.layout().size());
    int checked = 0;
    for (const char* name : {"h.0.moe.router.weight", "h.0.moe.expert.1.fc.weight", "h.0.moe.expert.2.proj.weight",
                             "h.0.moe.expert.0.fc.bias", "h.0.ln2.weight"}) {
      const Tensor& t = g.layout().find(name);
      // The three largest gradients of the tensor.
      std::vector<int64_t> idx(static_cast<size_t>(t.size()));
      std::iota(idx.begin(), idx.end(), t.offset);
      std::partial_sort(idx.begin(), idx.begin() + 3, idx.end(), [&](int64_t a, int64_t b) {
        return std::fabs(grads[static_cast<size_t>(a)]) > std::fabs(grads[static_cast<size_t>(b)]);
      });
      for (int n = 0; n < 3; ++n) {
        float& p = g.params()[idx[static_cast<size_t>(n)]];
        const float keep = p, eps = 5e-4f;
        p = keep + eps;
        const double up = g.forward(seqs.data());
        p = keep - eps;
        const double down = g.forward(seqs.data());
        p = keep;
        const double fd = (up - down) / (2.0 * eps), an = grads[static_cast<size_t>(idx[static_cast<size_t>(n)])];
        EXPECT_NEAR(fd, an, 0.05 * std::fabs(an) + 1e-3) << name << " element " << idx[static_cast<size_t>(n)] - t.offset
                                                        << " top" << c.k << " capacity " << c.capacity;
        ++checked;
      }
    }
    EXPECT_EQ(checked, 15);
  }
}

// Capacity: an expert keeps at most capacity() of a routing group's choices, the first ones in row
// order; the others are dropped.
TEST(Experts, CapacityKeepsTheFirstChoicesInRowOrder) {
  ModelConfig m = test_support::tiny(1);
  m.experts = 4;
  m.capacity = 0.5f;
  m.moe_group = 2;
  const int64_t B = 4, T = m.seq, C = m.channels, N = B * T;
  auto ops = make_cpu_ops(1);
  Collectives solo;
  Moe moe(m, Layout{}, 0, B, N, N, 0, *ops, solo, solo);
  EXPECT_EQ(moe.capacity(), 4);  // ceil(0.5 * 32 tokens * 1 / 4 experts)
  std::vector<float> x(static_cast<size_t>(N * C)), router(static_cast<size_t>(4 * C)), fc(static_cast<size_t>(4 * C * C)),
      fcb(static_cast<size_t>(4 * C)), proj(static_cast<size_t>(4 * C * C)), out(static_cast<size_t>(N * C));
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0, 1);
  for (float& v : x) v = nd(rng);
  for (float& v : router) v = 0.3f * nd(rng);
  LayerView w;
  w.router = router.data();
  for (int e = 0; e < 4; ++e) {
    w.expert_fc_w.push_back(fc.data());
    w.expert_fc_b.push_back(fcb.data());
    w.expert_proj_w.push_back(proj.data());
  }
  Moe::Acts a;
  moe.forward(a, x.data(), x.data(), w, out.data());
  int dropped = 0;
  for (int64_t g = 0; g < 2; ++g)
    for (int e = 0; e < 4; ++e) {
      // The rows of group g choosing e, in row order: the first capacity() are kept.
      int seen = 0;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t b = 2 * g; b < 2 * g + 2; ++b) {
          const int64_t r = t * B + b;
          const float* p = a.probs.data() + r * 4;
          if (std::max_element(p, p + 4) - p != e) continue;
          const bool kept = a.choice[static_cast<size_t>(r)] == e;
          EXPECT_EQ(kept, seen < moe.capacity()) << "group " << g << " expert " << e << " row " << r;
          dropped += kept ? 0 : 1;
          ++seen;
        }
    }
  EXPECT_GT(dropped, 0);
}

// What a device backend does (host copies around collectives, pipeline boundaries and the
// experts), run on the CPU's kernels behind another name: a pipeline and expert parallelism still
// train like one rank.
TEST(Parity, DeviceBackendPathsTrainLikeOneRank) {
  test_support::RunOptions o;
  o.layers = 4;
  o.experts = 4;
  o.top_k = 2;
  o.moe_group = 2;
  const RunResult one = run_layout(make_layout(1, 1), o);
  o.staged = true;
  Layout ep2 = make_layout(1, 2);
  ep2.ep = 2;
  for (const Layout& l : {make_layout(1, 1), test_support::with_pipeline(make_layout(2, 1), 2, ScheduleKind::k1F1B, 4),
                          ep2})
    EXPECT_EQ(test_support::compare_training(run_layout(l, o), one), "") << l.describe() << " staged";
}

// On the GPU (when there is one): two ranks sharing it, data or tensor parallel, train like one.
TEST(Parity, OnTheGpuDp2AndTp2TrainLikeOneRank) {
  std::string why;
  if (!backend_or_skip("cuda", &why)) GTEST_SKIP() << why;
  test_support::RunOptions gpu;
  gpu.cuda = true;
  const RunResult one = run_layout(make_layout(1, 1), gpu);
  EXPECT_EQ(test_support::compare_training(one, run_layout(make_layout(1, 1))), "") << "GPU against CPU";
  for (Layout l : {make_layout(1, 2), make_layout(2, 1), make_layout(2, 1, true)})
    EXPECT_EQ(test_support::compare_training(run_layout(l, gpu), one), "") << l.describe() << " on the GPU";
  // A pipeline and expert parallelism with two ranks sharing the GPU.
  test_support::RunOptions moe = gpu;
  moe.layers = 4;
  moe.experts = 4;
  moe.top_k = 2;
  moe.moe_group = 2;
  test_support::RunOptions moe_cpu = moe;
  moe_cpu.cuda = false;
  const RunResult moe_one = run_layout(make_layout(1, 1), moe_cpu);
  Layout ep2 = make_layout(1, 2);
  ep2.ep = 2;
  for (const Layout& l : {test_support::with_pipeline(make_layout(1, 1), 2, ScheduleKind::k1F1B, 4), ep2})
    EXPECT_EQ(test_support::compare_training(run_layout(l, moe), moe_one), "") << l.describe() << " on the GPU";
}

// ZeRO changes where the optimizer runs, not the arithmetic: with two dp ranks the reduce-scatter
// and the all-reduce add the same two values (one order), the fused step's mean (times 1/2) is the
// all-reduce's (divided by 2), and every layout runs one AdamW loop (tutti::fused::adamw), so every
// stage equals plain data parallelism bit for bit. (Clipping is off: the norm is summed over
// shards in another order.)
TEST(Parity, ZeroStagesEqualPlainDataParallelBitForBit) {
  test_support::RunOptions no_clip;
  no_clip.grad_clip = 0;
  const RunResult dp = run_layout(make_layout(1, 2), no_clip);
  for (int zero : {1, 2, 3}) {
    const RunResult z = run_layout(make_layout(1, 2, false, zero), no_clip);
    EXPECT_EQ(z.fused_zero, zero <= 2) << "zero " << zero;  // ZeRO-1/2: the fused step (tutti/fused.hpp)
    EXPECT_EQ(z.losses, dp.losses) << "zero " << zero;
    for (const auto& [name, w] : dp.params) EXPECT_EQ(z.params.at(name), w) << "zero " << zero << ": " << name;
  }
}

// --- checkpoints ------------------------------------------------------------------------------

std::string temp_dir(const std::string& name) {
  std::string d = testing::TempDir() + "tutti_ckpt_" + name + "_" + std::to_string(getpid());
  std::filesystem::remove_all(d);
  return d;
}

// Saved at step 5 in one layout, resumed in another: the remaining steps' losses and the final
// parameters are those of an uninterrupted run.
TEST(Checkpoint, ResumesUnderAnotherLayoutWithTheSameLosses) {
  const RunResult one = run_layout(make_layout(1, 1));
  const std::string dir = temp_dir("tp2dp2");
  test_support::RunOptions save;
  save.save_dir = dir;
  save.save_at = 5;
  run_layout(make_layout(2, 2), save);
  ASSERT_TRUE(std::filesystem::exists(dir + "/manifest.json"));
  for (Layout l : {make_layout(1, 4), make_layout(1, 1), make_layout(2, 1, true), make_layout(1, 2, false, 3),
                   make_layout(4, 1)}) {
    test_support::RunOptions resume;
    resume.resume_dir = dir;
    RunResult r = run_layout(l, resume);
    ASSERT_EQ(r.losses.size(), static_cast<size_t>(kSteps - 5)) << l.describe();
    RunResult want = one;
    want.losses.erase(want.losses.begin(), want.losses.begin() + 5);
    EXPECT_EQ(test_support::compare_training(r, want), "") << "resumed at " << l.describe();
  }
  // And from a ZeRO-3 checkpoint, whose files hold dp shards.
  const std::string zdir = temp_dir("zero3");
  save.save_dir = zdir;
  run_layout(make_layout(1, 4, false, 3), save);
  test_support::RunOptions resume;
  resume.resume_dir = zdir;
  RunResult r = run_layout(make_layout(2, 1), resume);
  RunResult want = one;
  want.losses.erase(want.losses.begin(), want.losses.begin() + 5);
  EXPECT_EQ(test_support::compare_training(r, want), "") << "zero3 dp4 -> tp2";
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(zdir);
}

// Pipeline stages write their parts; any layout, pipelined or not, resumes from them, and a
// pipeline resumes from a checkpoint without one.
TEST(Checkpoint, PipelineCheckpointsLoadUnderOtherLayouts) {
  using test_support::with_pipeline;
  test_support::RunOptions o;
  o.layers = 4;
  const RunResult one = run_layout(make_layout(1, 1), o);
  RunResult want = one;
  want.losses.erase(want.losses.begin(), want.losses.begin() + 5);
  const std::string dir = temp_dir("tp2pp2"), flat = temp_dir("dp2zero1");
  test_support::RunOptions save = o;
  save.save_at = 5;
  save.save_dir = dir;
  run_layout(with_pipeline(make_layout(2, 1), 2, ScheduleKind::k1F1B, 4), save);
  save.save_dir = flat;
  run_layout(make_layout(1, 2, false, 1), save);
  for (const auto& [from, l] : {std::pair{dir, make_layout(1, 1)}, std::pair{dir, make_layout(1, 2, false, 2)},
                                std::pair{dir, with_pipeline(make_layout(1, 2), 2, ScheduleKind::kInterleaved, 2, 2)},
                                std::pair{dir, with_pipeline(make_layout(1, 1), 4, ScheduleKind::kZeroBubble, 4)},
                                std::pair{flat, with_pipeline(make_layout(2, 1, true), 2, ScheduleKind::kGpipe, 8)}}) {
    test_support::RunOptions resume = o;
    resume.resume_dir = from;
    const RunResult r = run_layout(l, resume);
    ASSERT_EQ(r.losses.size(), static_cast<size_t>(kSteps - 5)) << l.describe();
    EXPECT_EQ(test_support::compare_training(r, want), "") << "resumed at " << l.describe() << " from " << from;
  }
}

// Experts saved by the ep ranks holding them load under any other split of them.
TEST(Checkpoint, ExpertCheckpointsLoadUnderOtherExpertLayouts) {
  test_support::RunOptions o;
  o.experts = 4;
  o.top_k = 2;
  o.moe_group = 2;
  const RunResult one = run_layout(make_layout(1, 1), o);
  RunResult want = one;
  want.losses.erase(want.losses.begin(), want.losses.begin() + 5);
  const std::string dir = temp_dir("ep4");
  test_support::RunOptions save = o;
  save.save_at = 5;
  save.save_dir = dir;
  Layout ep4 = make_layout(1, 4), tp2ep2 = make_layout(2, 2);
  ep4.ep = 4, tp2ep2.ep = 2;
  run_layout(ep4, save);
  for (const Layout& l : {make_layout(1, 1), tp2ep2, make_layout(1, 2)}) {
    test_support::RunOptions resume = o;
    resume.resume_dir = dir;
    const RunResult r = run_layout(l, resume);
    EXPECT_EQ(test_support::compare_training(r, want), "") << "resumed at " << l.describe();
  }
}

TEST(Checkpoint, DamagedOrMismatchedCheckpointsNameTheFileAndField) {
  const std::string dir = temp_dir("bad");
  test_support::RunOptions save;
  save.save_dir = dir;
  save.save_at = 2;
  run_layout(make_layout(1, 2, false, 1), save);
  auto load_error = [&](const ModelConfig& mc) {
    try {
      Groups g = Groups::single(Layout{});
      auto ops = make_cpu_ops(1);
      Trainer t(mc, OptimConfig{}, g, *ops, test_support::kBatch, 1);
      load_checkpoint(dir, t);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(load_error(test_support::tiny()), "");
  ModelConfig other = test_support::tiny();
  other.layers = 3;
  EXPECT_NE(load_error(other).find("manifest.json: model.layers is 2, this run's is 3"), std::string::npos)
      << load_error(other);
  // A flipped byte in a rank file.
  {
    std::fstream f(dir + "/rank_00001.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x40);
    f.seekp(100);
    f.write(&c, 1);
  }
  EXPECT_NE(load_error(test_support::tiny()).find("rank_00001.bin does not match its CRC-32"), std::string::npos)
      << load_error(test_support::tiny());
  // A truncated rank file.
  std::filesystem::resize_file(dir + "/rank_00000.bin", 64);
  EXPECT_NE(load_error(test_support::tiny()).find("rank_00000.bin has 64 bytes"), std::string::npos)
      << load_error(test_support::tiny());
  // A manifest field gone.
  {
    std::ifstream in(dir + "/manifest.json");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t at = text.find("\"heads\"");
    ASSERT_NE(at, std::string::npos);
    text.replace(at, 7, "\"hedas\"");
    std::ofstream(dir + "/manifest.json") << text;
  }
  EXPECT_NE(load_error(test_support::tiny()).find("manifest.json: model.heads is missing"), std::string::npos)
      << load_error(test_support::tiny());
  std::filesystem::remove(dir + "/manifest.json");
  EXPECT_NE(load_error(test_support::tiny()).find("manifest.json is missing"), std::string::npos);
  std::filesystem::remove_all(dir);
}

// Data parallelism overlaps the reduction of a group's gradients with the rest of backward: the
// model reports each group as soon as it is complete, the final LayerNorm first, then the layers
// from the last, the embeddings (which the tied LM head also writes) last, all before backward
// returns.
TEST(Gpt, BackwardHandsOverEachGroupAsSoonAsItIsComplete) {
  const ModelConfig mc = test_support::tiny();
  auto ops = make_cpu_ops(1);
  Collectives none;
  Gpt m(mc, Layout{}, 0, 2, *ops, none);
  m.init(3);
  std::vector<int32_t> seqs(2 * (mc.seq + 1));
  for (size_t i = 0; i < seqs.size(); ++i) seqs[i] = static_cast<int32_t>((i * 7) % mc.vocab);
  std::vector<int> order;
  std::vector<float> snapshot;
  GroupHooks hooks;
  const Group last = m.layout().groups().back();
  hooks.grads_ready = [&](int g) {
    order.push_back(g);
    // What was handed over stays as it is while backward goes on: the final LayerNorm's gradients
    // at the moment they were reported equal those at the end.
    if (g == mc.layers + 1) snapshot.assign(m.grads() + last.offset, m.grads() + last.offset + last.size);
  };
  m.forward(seqs.data());
  m.zero_grads();
  m.backward(&hooks);
  std::vector<int> want;
  for (int g = mc.layers + 1; g >= 0; --g) want.push_back(g);
  EXPECT_EQ(order, want);
  EXPECT_EQ(snapshot, std::vector<float>(m.grads() + last.offset, m.grads() + last.offset + last.size));
}

// --- data ----------------------------------------------------------------------------------------

std::string write_bin(const std::string& name, int32_t magic, int32_t version, int32_t count,
                      const std::vector<uint16_t>& tokens) {
  const std::string path = testing::TempDir() + name;
  std::ofstream out(path, std::ios::binary);
  int32_t header[256] = {};
  header[0] = magic;
  header[1] = version;
  header[2] = count;
  out.write(reinterpret_cast<const char*>(header), sizeof header);
  out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
  return path;
}

TEST(Data, LlmcTokenFilesAreReadAndBadOnesNamed) {
  std::vector<uint16_t> toks = {1, 2, 3, 50256, 7};
  TokenStream s = load_tokens(write_bin("ok.bin", 20240520, 1, 5, toks));
  EXPECT_EQ(s.tokens, toks);
  auto error = [](const std::string& path) {
    try {
      load_tokens(path);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error(write_bin("magic.bin", 1234, 1, 5, toks)).find("magic.bin': header magic is 1234"), std::string::npos);
  EXPECT_NE(error(write_bin("version.bin", 20240520, 2, 5, toks)).find("header version is 2"), std::string::npos);
  EXPECT_NE(error(write_bin("count.bin", 20240520, 1, 9, toks)).find("the header says 9 tokens"), std::string::npos);
  EXPECT_NE(error(write_bin("vocab.bin", 20240520, 1, 2, {3, 60000})).find("token 1 is 60000"), std::string::npos);
  EXPECT_NE(error(testing::TempDir() + "missing.bin").find("cannot open"), std::string::npos);
}

// Batches depend only on the step: dp ranks cut disjoint parts of the same global batch, and a run
// resumed at step s reads what an uninterrupted one would.
TEST(Data, BatchesAreAFunctionOfTheStepSplitOverRanks) {
  const TokenStream s = test_support::synthetic_tokens(64, 5000);
  const int T = 16, batch = 8;
  std::vector<int32_t> whole(static_cast<size_t>(batch * (T + 1))), part(whole.size() / 4);
  for (int64_t step : {0, 3, 1000}) {
    cut_batch(s, step, batch, 0, batch, T, whole.data());
    for (int d = 0; d < 4; ++d) {
      cut_batch(s, step, batch, d * 2, 2, T, part.data());
      EXPECT_TRUE(std::equal(part.begin(), part.end(), whole.begin() + d * static_cast<int64_t>(part.size())))
          << "step " << step << " rank " << d;
    }
  }
  std::vector<int32_t> next(whole.size());
  cut_batch(s, 1, batch, 0, batch, T, whole.data());
  cut_batch(s, 2, batch, 0, batch, T, next.data());
  EXPECT_NE(whole, next);
  TokenStream train, val;
  split_train_val(s, train, val);
  EXPECT_EQ(train.tokens.size() + val.tokens.size(), s.tokens.size());
  EXPECT_EQ(val.tokens.size(), s.tokens.size() / 10);
  TokenStream tiny_stream;
  tiny_stream.tokens = {1, 2, 3};
  EXPECT_THROW(cut_batch(tiny_stream, 0, 1, 0, 1, T, whole.data()), InvalidArgument);
}

// Megatron's order: tp innermost, then dp. Checked in the table and in the groups' members.
TEST(Groups, RanksAreTensorParallelInnermostThenDataParallel) {
  const Layout l = make_layout(2, 3);
  const int want[6][2] = {{0, 0}, {1, 0}, {0, 1}, {1, 1}, {0, 2}, {1, 2}};
  for (int w = 0; w < 6; ++w) {
    const Coordinates c = coordinates_of(l, w);
    EXPECT_EQ(c.tp_rank, want[w][0]) << "world rank " << w;
    EXPECT_EQ(c.dp_rank, want[w][1]) << "world rank " << w;
    EXPECT_EQ(world_rank_of(l, c), w);
  }
  EXPECT_THROW(coordinates_of(l, 6), InvalidArgument);
  // Each group's members, by gathering world ranks in them.
  std::vector<Comm> comms = Comm::create_local(6);
  std::vector<std::vector<float>> tp_members(6), dp_members(6);
  std::vector<std::thread> threads;
  for (int r = 0; r < 6; ++r)
    threads.emplace_back([&, r] {
      Groups g = Groups::make(comms[static_cast<size_t>(r)], l);
      const float me = static_cast<float>(r);
      tp_members[r].resize(2);
      dp_members[r].resize(3);
      g.tp.all_gather(&me, tp_members[r].data(), 1);
      g.dp.all_gather(&me, dp_members[r].data(), 1);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 6; ++r) {
    const int tp0 = r - r % 2, d = r % 2;
    EXPECT_EQ(tp_members[r], (std::vector<float>{static_cast<float>(tp0), static_cast<float>(tp0 + 1)})) << "rank " << r;
    EXPECT_EQ(dp_members[r], (std::vector<float>{static_cast<float>(d), static_cast<float>(d + 2), static_cast<float>(d + 4)}))
        << "rank " << r;
  }
}

// With a pipeline: tp innermost, then dp, then pp; every group's members, and the embedding group
// of the first and last stage.
TEST(Groups, PipelineRanksAreOutermost) {
  const Layout l = test_support::with_pipeline(make_layout(2, 2), 3, ScheduleKind::k1F1B, 4);
  ASSERT_EQ(l.world(), 12);
  for (int w = 0; w < 12; ++w) {
    const Coordinates c = coordinates_of(l, w);
    EXPECT_EQ(c.tp_rank, w % 2) << "world rank " << w;
    EXPECT_EQ(c.dp_rank, (w / 2) % 2) << "world rank " << w;
    EXPECT_EQ(c.pp_rank, w / 4) << "world rank " << w;
    EXPECT_EQ(world_rank_of(l, c), w);
  }
  std::vector<Comm> comms = Comm::create_local(12);
  std::vector<std::vector<float>> tp(12), dp(12), pp(12), emb(12);
  std::vector<float> from_prev(12, -1);
  std::vector<std::thread> threads;
  for (int r = 0; r < 12; ++r)
    threads.emplace_back([&, r] {
      Groups g = Groups::make(comms[static_cast<size_t>(r)], l);
      const float me = static_cast<float>(r);
      tp[r].resize(2), dp[r].resize(2), pp[r].resize(3);
      g.tp.all_gather(&me, tp[r].data(), 1);
      g.dp.all_gather(&me, dp[r].data(), 1);
      g.pp.all_gather(&me, pp[r].data(), 1);
      if (g.embedding.size() == 2) {
        emb[r].resize(2);
        g.embedding.all_gather(&me, emb[r].data(), 1);
      }
      // Around the ring: each pp rank sends its world rank to the next.
      const int next = (g.at.pp_rank + 1) % 3, prev = (g.at.pp_rank + 2) % 3;
      tutti::Work w = g.pipe.send(&me, 1, next);
      g.pipe.recv(&from_prev[r], 1, prev);
      g.pipe.wait(w);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 12; ++r) {
    const float f = static_cast<float>(r);
    EXPECT_EQ(tp[r], (std::vector<float>{f - r % 2, f - r % 2 + 1})) << "rank " << r;
    const float d0 = static_cast<float>(r - (r / 2) % 2 * 2);
    EXPECT_EQ(dp[r], (std::vector<float>{d0, d0 + 2})) << "rank " << r;
    const float p0 = static_cast<float>(r % 4);
    EXPECT_EQ(pp[r], (std::vector<float>{p0, p0 + 4, p0 + 8})) << "rank " << r;
    if (r / 4 == 1) EXPECT_TRUE(emb[r].empty()) << "rank " << r << " holds no embedding";
    else EXPECT_EQ(emb[r], (std::vector<float>{p0, p0 + 8})) << "rank " << r;
    EXPECT_EQ(from_prev[r], static_cast<float>((r + 8) % 12)) << "rank " << r;
  }
}

// The documented order tp, ep, dp, pp (ep splits the dp ranks: dp_rank = ep_rank + ep * edp_rank):
// a golden table for tp2 x ep2 x dp4 x pp2, the round trip for every layout the tests use, and
// the members of the ep and expert-data-parallel groups.
TEST(Groups, ExpertRanksSplitTheDataParallelRanks) {
  Layout big = test_support::with_pipeline(make_layout(2, 4), 2, ScheduleKind::k1F1B, 2);
  big.ep = 2;
  const int golden[16][4] = {  // tp, ep, edp, pp
      {0, 0, 0, 0}, {1, 0, 0, 0}, {0, 1, 0, 0}, {1, 1, 0, 0}, {0, 0, 1, 0}, {1, 0, 1, 0}, {0, 1, 1, 0}, {1, 1, 1, 0},
      {0, 0, 0, 1}, {1, 0, 0, 1}, {0, 1, 0, 1}, {1, 1, 0, 1}, {0, 0, 1, 1}, {1, 0, 1, 1}, {0, 1, 1, 1}, {1, 1, 1, 1}};
  for (int w = 0; w < 16; ++w) {
    const Coordinates c = coordinates_of(big, w);
    EXPECT_EQ((std::vector<int>{c.tp_rank, c.ep_rank, c.edp_rank, c.pp_rank}),
              (std::vector<int>{golden[w][0], golden[w][1], golden[w][2], golden[w][3]}))
        << "world rank " << w;
  }
  // Every layout of the parity tests: coordinates are a bijection.
  auto with_ep = [](Layout l, int ep) { return l.ep = ep, l; };
  using test_support::with_pipeline;
  for (const Layout& l : {make_layout(2, 2, true, 1), with_pipeline(make_layout(2, 2), 2, ScheduleKind::k1F1B, 2),
                          with_ep(make_layout(1, 4), 2), with_ep(make_layout(2, 2), 2), with_ep(make_layout(1, 4), 4),
                          with_pipeline(make_layout(1, 4), 4, ScheduleKind::kZeroBubble, 2)}) {
    std::set<std::vector<int>> seen;
    for (int w = 0; w < l.world(); ++w) {
      const Coordinates c = coordinates_of(l, w);
      EXPECT_EQ(world_rank_of(l, c), w) << l.describe();
      EXPECT_EQ(c.dp_rank, c.ep_rank + l.ep * c.edp_rank) << l.describe();
      EXPECT_TRUE(seen.insert({c.tp_rank, c.dp_rank, c.pp_rank}).second) << l.describe() << " rank " << w;
    }
  }
  // Members: tp2 x dp4 with ep2.
  const Layout l = with_ep(make_layout(2, 4), 2);
  std::vector<Comm> comms = Comm::create_local(8);
  std::vector<std::vector<float>> ep(8), edp(8);
  std::vector<std::thread> threads;
  for (int r = 0; r < 8; ++r)
    threads.emplace_back([&, r] {
      Groups g = Groups::make(comms[static_cast<size_t>(r)], l);
      const float me = static_cast<float>(r);
      ep[r].resize(2), edp[r].resize(2);
      g.ep.all_gather(&me, ep[r].data(), 1);
      g.edp.all_gather(&me, edp[r].data(), 1);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 8; ++r) {
    const float e0 = static_cast<float>(r - (r / 2) % 2 * 2), d0 = static_cast<float>(r % 4);
    EXPECT_EQ(ep[r], (std::vector<float>{e0, e0 + 2})) << "rank " << r;
    EXPECT_EQ(edp[r], (std::vector<float>{d0, d0 + 4})) << "rank " << r;
  }
}

TEST(Layouts, ImpossibleLayoutsAreRefusedBeforeAnyWork) {
  const ModelConfig m = test_support::tiny();  // 4 heads, vocabulary 64, sequence 16
  auto message = [&](const Layout& l, int world, int batch) {
    try {
      l.validate(m, world, batch);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(make_layout(3, 1), 3, 8).find("does not divide 4 heads"), std::string::npos);
  EXPECT_NE(message(make_layout(2, 2), 8, 8).find("8 ranks, but --tp 2 x --dp 2 x --pp 1 = 4"), std::string::npos);
  EXPECT_NE(message(make_layout(1, 3), 3, 8).find("does not split over --dp 3"), std::string::npos);
  EXPECT_NE(message(make_layout(1, 1, true), 1, 8).find("--sp needs --tp"), std::string::npos);
  EXPECT_NE(message(make_layout(1, 1, false, 1), 1, 8).find("--zero 1 needs --dp"), std::string::npos);
  EXPECT_NE(message(make_layout(1, 2, false, 4), 2, 8).find("--zero 4"), std::string::npos);
  EXPECT_EQ(message(make_layout(2, 2, true, 1), 4, 8), "");
  using test_support::with_pipeline;
  EXPECT_NE(message(with_pipeline(make_layout(1, 1), 4, ScheduleKind::k1F1B, 4), 4, 8).find("2 layers do not split into --pp 4"),
            std::string::npos);
  EXPECT_NE(message(with_pipeline(make_layout(1, 2), 2, ScheduleKind::k1F1B, 3), 4, 8).find("4 sequences do not split into --microbatches 3"),
            std::string::npos);
  EXPECT_NE(message(with_pipeline(make_layout(1, 2, false, 3), 2, ScheduleKind::k1F1B, 2), 4, 8).find("--zero 3 with a pipeline"),
            std::string::npos);
  EXPECT_NE(message(with_pipeline(make_layout(1, 1), 2, ScheduleKind::kInterleaved, 4, 2), 2, 8).find("2 layers do not split into --pp 2 x --vp 2"),
            std::string::npos);
  EXPECT_EQ(message(with_pipeline(make_layout(2, 2, true, 1), 2, ScheduleKind::kZeroBubble, 2), 8, 8), "");
  Layout ep = make_layout(1, 4);
  ep.ep = 3;
  EXPECT_NE(message(ep, 4, 8).find("--ep 3 must divide --dp 4"), std::string::npos);
  ep.ep = 2;
  EXPECT_NE(message(ep, 4, 8).find("--ep 2 needs --experts"), std::string::npos);
  ModelConfig moe = m;
  moe.experts = 3;
  auto moe_message = [&](const Layout& l) {
    try {
      l.validate(moe, l.world(), 8);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(moe_message(ep).find("--ep 2 does not divide --experts 3"), std::string::npos);
  moe.experts = 4;
  moe.moe_group = 3;
  EXPECT_NE(moe_message(ep).find("do not split into routing groups of --moe-group 3"), std::string::npos);
  moe.moe_group = 1;
  ep.zero = 1;
  EXPECT_NE(moe_message(ep).find("--zero 1 with --ep 2"), std::string::npos);
  moe.top_k = 3;
  EXPECT_NE(moe_message(make_layout(1, 1)).find("--top-k 3"), std::string::npos);
}

}  // namespace
