// The trainer: the one-rank model against PyTorch (tests/data/gpt_golden.bin, written by
// tools/trainer/make_golden.py), every parallel layout against the one-rank run, the rank -> group
// table, data and checkpoints.
//
// Tolerances. Float32 sums taken in another order (OpenBLAS's blocking against PyTorch's, a sum
// over ranks against a sum inside one GEMM) differ by a few units in the last place of the largest
// terms, so values are compared relative to the largest magnitude of their tensor: |a - b| <=
// 1e-5 * max |b|. Where the order cannot change the comparison is bit for bit (said at the test).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include "trainer/data.hpp"
#include "trainer/gpt.hpp"
#include "trainer/groups.hpp"
#include "trainer/trainer.hpp"

using namespace tutti;
using namespace tutti::train;

namespace {

constexpr double kRel = 1e-5;

// The golden file's records by name.
std::map<std::string, std::vector<float>> read_golden() {
  std::ifstream in(TUTTI_SOURCE_DIR "/tests/data/gpt_golden.bin", std::ios::binary);
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

// |a - b| <= rel * max |b| element by element.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double rel, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0;
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

TEST(Golden, OneRankMatchesPyTorch) {
  auto g = read_golden();
  ASSERT_FALSE(g.empty());
  const auto& c = g["config"];
  ModelConfig mc;
  mc.vocab = static_cast<int>(c[0]);
  mc.seq = static_cast<int>(c[1]);
  mc.layers = static_cast<int>(c[2]);
  mc.heads = static_cast<int>(c[3]);
  mc.channels = static_cast<int>(c[4]);
  const int B = static_cast<int>(c[5]), steps = static_cast<int>(c[6]);
  OptimConfig oc;
  oc.lr = oc.min_lr = c[7];
  oc.weight_decay = c[8];
  oc.beta1 = c[9];
  oc.beta2 = c[10];
  oc.eps = c[11];
  oc.grad_clip = c[12];
  oc.steps = steps;
  std::vector<int32_t> tokens(g["tokens"].begin(), g["tokens"].end());

  auto ops = make_cpu_ops(1);
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

}  // namespace
