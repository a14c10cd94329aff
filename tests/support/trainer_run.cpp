#include "support/trainer_run.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "trainer/checkpoint.hpp"
#include "trainer/groups.hpp"
#include "trainer/trainer.hpp"

namespace tutti::train::test_support {

ModelConfig tiny(int layers) {
  ModelConfig m;
  m.vocab = 64;
  m.seq = 16;
  m.layers = layers;
  m.heads = 4;
  m.channels = 32;
  return m;
}

TokenStream synthetic_tokens(int vocab, int64_t n) {
  TokenStream s;
  s.vocab = vocab;
  s.source = "synthetic";
  uint64_t x = 12345;
  for (int64_t i = 0; i < n; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    s.tokens.push_back(static_cast<uint16_t>((i / 3 + ((x >> 60) == 0 ? (x >> 40) : 0)) % vocab));
  }
  return s;
}

Layout make_layout(int tp, int dp, bool sp, int zero) {
  Layout l;
  l.tp = tp;
  l.dp = dp;
  l.sp = sp;
  l.zero = zero;
  return l;
}

namespace {
class StagedOps final : public Ops {
 public:
  StagedOps() : cpu_(make_cpu_ops(1)) {}
  const char* name() const override { return "staged"; }
  float* alloc(int64_t n) override { return cpu_->alloc(n); }
  void release(float* p) override { cpu_->release(p); }
  void upload(float* d, const float* h, int64_t n) override { cpu_->upload(d, h, n); }
  void download(float* h, const float* s, int64_t n) override { cpu_->download(h, s, n); }
  void zero(float* p, int64_t n) override { cpu_->zero(p, n); }
  void copy(float* d, const float* s, int64_t n) override { cpu_->copy(d, s, n); }
  void discard(float* p, int64_t n) override { cpu_->discard(p, n); }
  void matmul(float* o, const float* i, const float* w, const float* b, int64_t N, int64_t C, int64_t OC) override {
    cpu_->matmul(o, i, w, b, N, C, OC);
  }
  void matmul_backward(float* di, float* dw, float* db, const float* d, const float* i, const float* w, int64_t N,
                       int64_t C, int64_t OC) override {
    cpu_->matmul_backward(di, dw, db, d, i, w, N, C, OC);
  }
  void layernorm(float* o, float* m, float* r, const float* i, const float* w, const float* b, int64_t N,
                 int64_t C) override {
    cpu_->layernorm(o, m, r, i, w, b, N, C);
  }
  void layernorm_backward(float* di, float* dw, float* db, const float* d, const float* i, const float* w,
                          const float* m, const float* r, int64_t N, int64_t C) override {
    cpu_->layernorm_backward(di, dw, db, d, i, w, m, r, N, C);
  }
  void attention(float* o, float* a, const float* q, int64_t T, int64_t B, int64_t NH, int64_t hs) override {
    cpu_->attention(o, a, q, T, B, NH, hs);
  }
  void attention_backward(float* dq, float* da, const float* d, const float* q, const float* a, int64_t T, int64_t B,
                          int64_t NH, int64_t hs) override {
    cpu_->attention_backward(dq, da, d, q, a, T, B, NH, hs);
  }
  void gelu(float* o, const float* i, int64_t n) override { cpu_->gelu(o, i, n); }
  void gelu_backward(float* di, const float* i, const float* d, int64_t n) override { cpu_->gelu_backward(di, i, d, n); }
  void add(float* o, const float* a, const float* b, int64_t n) override { cpu_->add(o, a, b, n); }
  void accumulate(float* o, const float* a, int64_t n) override { cpu_->accumulate(o, a, n); }
  void add_bias(float* o, const float* b, int64_t N, int64_t C) override { cpu_->add_bias(o, b, N, C); }
  void bias_backward(float* db, const float* d, int64_t N, int64_t C) override { cpu_->bias_backward(db, d, N, C); }
  void scale(float* p, float s, int64_t n) override { cpu_->scale(p, s, n); }
  void embed(float* o, const int32_t* t, const float* wte, int64_t v0, int64_t Vl, const float* wpe, int64_t t0,
             int64_t N, int64_t B, int64_t C) override {
    cpu_->embed(o, t, wte, v0, Vl, wpe, t0, N, B, C);
  }
  void embed_backward(float* d, const int32_t* t, const float* g, int64_t v0, int64_t Vl, int64_t N,
                      int64_t C) override {
    cpu_->embed_backward(d, t, g, v0, Vl, N, C);
  }
  void position_backward(float* d, const float* g, int64_t t0, int64_t N, int64_t B, int64_t C) override {
    cpu_->position_backward(d, g, t0, N, B, C);
  }
  void row_max(float* m, const float* l, int64_t N, int64_t Vl) override { cpu_->row_max(m, l, N, Vl); }
  void row_sum_exp(float* s, const float* l, const float* m, int64_t N, int64_t Vl) override {
    cpu_->row_sum_exp(s, l, m, N, Vl);
  }
  void target_logit(float* o, const float* l, const int32_t* t, int64_t v0, int64_t N, int64_t Vl) override {
    cpu_->target_logit(o, l, t, v0, N, Vl);
  }
  double mean_loss(const float* m, const float* s, const float* t, int64_t N) override {
    return cpu_->mean_loss(m, s, t, N);
  }
  void cross_entropy_backward(float* d, const float* l, const float* m, const float* s, const int32_t* t, int64_t v0,
                              float sc, int64_t N, int64_t Vl) override {
    cpu_->cross_entropy_backward(d, l, m, s, t, v0, sc, N, Vl);
  }
  double sum_squares(const float* p, int64_t n) override { return cpu_->sum_squares(p, n); }
  void adamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float b1, float b2, float eps,
             float wd, int step, float gs) override {
    cpu_->adamw(p, g, m, v, n, lr, b1, b2, eps, wd, step, gs);
  }
  int32_t* alloc_tokens(int64_t n) override { return cpu_->alloc_tokens(n); }
  void release_tokens(int32_t* p) override { cpu_->release_tokens(p); }
  void upload_tokens(int32_t* d, const int32_t* h, int64_t n) override { cpu_->upload_tokens(d, h, n); }

 private:
  std::unique_ptr<Ops> cpu_;
};
}  // namespace

std::unique_ptr<Ops> staged_ops() { return std::make_unique<StagedOps>(); }

Layout with_pipeline(Layout base, int pp, ScheduleKind schedule, int microbatches, int vp) {
  base.pp = pp;
  base.schedule = schedule;
  base.microbatches = microbatches;
  base.vp = vp;
  return base;
}

RunResult train_rank(tutti::Comm* world, const Layout& layout, const RunOptions& options) {
  ModelConfig mc = tiny(options.layers);
  mc.experts = options.experts;
  mc.top_k = options.top_k;
  mc.moe_group = options.moe_group;
  mc.capacity = options.capacity;
  OptimConfig oc;
  oc.lr = 1e-3f;
  oc.min_lr = 1e-4f;
  oc.warmup = 2;
  oc.steps = kSteps;
  oc.grad_clip = options.grad_clip;
  const TokenStream data = synthetic_tokens(mc.vocab, 20000);
  Groups groups = world ? Groups::make(*world, layout) : Groups::single(layout);
  auto ops = options.cuda ? make_cuda_ops(0) : options.staged ? staged_ops() : make_cpu_ops(1);
  Trainer trainer(mc, oc, groups, *ops, kBatch, 7);
  const int per = kBatch / layout.dp;
  std::vector<int32_t> seqs(static_cast<size_t>(per * (mc.seq + 1)));
  RunResult out;
  out.fused_zero = trainer.fused_zero();
  int first = 0;
  if (!options.resume_dir.empty()) first = load_checkpoint(options.resume_dir, trainer).step;
  for (int s = first; s < kSteps; ++s) {
    cut_batch(data, s, kBatch, groups.at.dp_rank * per, per, mc.seq, seqs.data());
    const StepResult r = trainer.step(seqs.data());
    out.losses.push_back(r.loss);
    out.activation_slots = r.activation_slots;
    if (s + 1 == options.save_at) {
      CheckpointInfo info;
      info.model = mc;
      info.layout = layout;
      info.optim = oc;
      info.step = s + 1;
      info.seed = 7;
      info.batch = kBatch;
      info.data = data.source;
      save_checkpoint(options.save_dir, trainer, world, info);
    }
  }
  if (layout.pipelined())
    out.predicted_slots = trainer.schedule_report().peak_activations[static_cast<size_t>(groups.at.pp_rank)];
  trainer.gather_all();
  Gpt& m = trainer.model();
  // The tied embeddings live on the first and the last stage: the first's count.
  const bool embeddings_elsewhere = layout.pp > 1 && groups.at.pp_rank == layout.pp - 1;
  // Every tensor of the model, zero where another rank holds it, so every rank's map has the same
  // keys (the process test sums them with one all-reduce each).
  const ParamLayout whole(mc, 1, 0, 1);
  for (const Tensor& t : whole.tensors())
    out.params[t.name].assign(static_cast<size_t>(t.rows * t.cols), 0.0f);
  for (const Tensor& t : m.layout().tensors()) {
    auto& w = out.params[t.name];
    // Experts: the ep rank holding them (edp rank 0) counts them.
    const bool expert = m.layout().groups()[static_cast<size_t>(t.group)].expert;
    const bool dp_owner = expert ? groups.at.edp_rank == 0 : groups.at.dp_rank == 0;
    const bool mine = dp_owner && (!t.replicated || groups.at.tp_rank == 0) &&
                      !(embeddings_elsewhere && t.group == m.layout().embedding_group());
    if (mine) m.get_whole(t.name, m.params(), w.data());
  }
  return out;
}

void add_parts(RunResult& sum, const RunResult& part) {
  if (sum.losses.empty()) sum.losses = part.losses, sum.fused_zero = part.fused_zero;
  sum.activation_slots = std::max(sum.activation_slots, part.activation_slots);
  sum.predicted_slots = std::max(sum.predicted_slots, part.predicted_slots);
  for (const auto& [name, w] : part.params) {
    auto& s = sum.params[name];
    if (s.empty()) s.assign(w.size(), 0.0f);
    for (size_t i = 0; i < w.size(); ++i) s[i] += w[i];
  }
}

std::string compare_training(const RunResult& got, const RunResult& want) {
  constexpr double kRel = 1e-5;
  if (got.losses.size() != want.losses.size())
    return fmt::format("{} losses, expected {}", got.losses.size(), want.losses.size());
  for (size_t s = 0; s < got.losses.size(); ++s)
    if (std::fabs(got.losses[s] - want.losses[s]) > kRel * want.losses[s])
      return fmt::format("loss of step {}: {} vs {}", s, got.losses[s], want.losses[s]);
  double scale = 0;
  for (const auto& [name, w] : want.params)
    for (float x : w) scale = std::max(scale, std::fabs(static_cast<double>(x)));
  const int64_t C = tiny().channels;
  if (got.params.size() != want.params.size())
    return fmt::format("{} tensors, expected {}", got.params.size(), want.params.size());
  for (const auto& [name, w] : want.params) {
    auto it = got.params.find(name);
    if (it == got.params.end() || it->second.size() != w.size()) return fmt::format("{}: missing or resized", name);
    for (size_t i = 0; i < w.size(); ++i) {
      const bool key_bias = name.ends_with("attn.qkv.bias") && static_cast<int64_t>(i) >= C &&
                            static_cast<int64_t>(i) < 2 * C;
      if (!key_bias && std::fabs(static_cast<double>(it->second[i]) - w[i]) > kRel * scale)
        return fmt::format("{} element {} after {} steps: {} vs {} (bound {})", name, i, kSteps, it->second[i], w[i],
                           kRel * scale);
    }
  }
  return "";
}

}  // namespace tutti::train::test_support
