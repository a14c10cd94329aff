#include "trainer/gpt.hpp"

#include <fmt/format.h>

#include <cmath>
#include <vector>

namespace tutti::train {

namespace {

// SplitMix64 and Box-Muller: the same numbers on every machine and every layout.
struct Normal {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  float operator()(double std) {
    const double u1 = uniform(), u2 = uniform();
    return static_cast<float>(std * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
  }
};

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

Gpt::Gpt(const ModelConfig& model, const Layout& layout, int tp_rank, int batch, Ops& ops, Collectives& tp)
    : model_(model),
      parallel_(layout),
      tp_rank_(tp_rank),
      batch_(batch),
      ops_(ops),
      tp_(tp),
      layout_(model, layout.tp, tp_rank, layout.dp) {
  if (tp.size() != layout.tp)
    throw InvalidArgument(fmt::format("GPT: the tp group has {} ranks, the layout says {}", tp.size(), layout.tp));
  const int64_t B = batch, T = model.seq, C = model.channels, P = layout.tp, L = model.layers;
  N_ = T * B;
  Nl_ = layout.sp ? N_ / P : N_;
  row0_ = layout.sp ? tp_rank * Nl_ : 0;
  t0_ = layout.sp ? tp_rank * (T / P) : 0;
  heads_ = model.heads / P;
  head_size_ = C / model.heads;
  Cl_ = heads_ * head_size_;
  Vl_ = model.vocab / P;
  v0_ = tp_rank * Vl_;

  params_ = alloc(layout_.size());
  grads_ = alloc(layout_.size());
  p_ = bind(layout_, params_);
  g_ = bind(layout_, grads_);
  const bool sp = layout.sp;
  for (int64_t l = 0; l <= L; ++l) x_.push_back(alloc(Nl_ * C));
  for (int64_t l = 0; l < L; ++l) {
    ln1_.push_back(alloc(Nl_ * C));
    ln1_full_.push_back(sp ? alloc(N_ * C) : ln1_.back());
    mean1_.push_back(alloc(Nl_));
    rstd1_.push_back(alloc(Nl_));
    qkv_.push_back(alloc(N_ * 3 * Cl_));
    atty_.push_back(alloc(N_ * Cl_));
    att_.push_back(alloc(B * heads_ * T * T));
    x2_.push_back(alloc(Nl_ * C));
    ln2_.push_back(alloc(Nl_ * C));
    ln2_full_.push_back(sp ? alloc(N_ * C) : ln2_.back());
    mean2_.push_back(alloc(Nl_));
    rstd2_.push_back(alloc(Nl_));
    fch_.push_back(alloc(N_ * 4 * Cl_));
    fch_gelu_.push_back(alloc(N_ * 4 * Cl_));
  }
  lnf_ = alloc(Nl_ * C);
  lnf_full_ = sp ? alloc(N_ * C) : lnf_;
  meanf_ = alloc(Nl_);
  rstdf_ = alloc(Nl_);
  logits_ = alloc(N_ * Vl_);
  maxv_ = alloc(N_);
  sum_ = alloc(N_);
  target_ = alloc(N_);
  partial_ = alloc(N_ * C);
  local_ = alloc(Nl_ * C);
  dx_ = alloc(Nl_ * C);
  dfull_ = alloc(N_ * C);
  dpartial_ = alloc(N_ * C);
  dlocal_ = alloc(Nl_ * C);
  dqkv_ = alloc(N_ * 3 * Cl_);
  datty_ = alloc(N_ * Cl_);
  datt_ = alloc(B * heads_ * T * T);
  dfch_ = alloc(N_ * 4 * Cl_);
  inputs_ = ops_.alloc_tokens(N_);
  targets_ = ops_.alloc_tokens(N_);
}

Gpt::~Gpt() {
  for (float* p : owned_) ops_.release(p);
  ops_.release_tokens(inputs_);
  ops_.release_tokens(targets_);
}

float* Gpt::alloc(int64_t n) {
  owned_.push_back(ops_.alloc(std::max<int64_t>(n, 1)));
  return owned_.back();
}

void Gpt::init(uint64_t seed) {
  const double residual_std = 0.02 / std::sqrt(2.0 * model_.layers);
  for (size_t i = 0; i < layout_.tensors().size(); ++i) {
    const Tensor& t = layout_.tensors()[i];
    std::vector<float> whole(static_cast<size_t>(t.rows * t.cols));
    if (ends_with(t.name, "ln1.weight") || ends_with(t.name, "ln2.weight") || t.name == "lnf.weight") {
      std::fill(whole.begin(), whole.end(), 1.0f);
    } else if (t.cols > 1) {  // matrices and embeddings
      Normal rng{seed * 0x100000001b3ull + i};
      const double std = ends_with(t.name, "proj.weight") ? residual_std : 0.02;
      for (float& w : whole) w = rng(std);
    }  // biases and LayerNorm biases: 0
    set_whole(t.name, whole.data());
  }
}

void Gpt::set_whole(const std::string& name, const float* whole) {
  const Tensor& t = layout_.find(name);
  std::vector<float> local(static_cast<size_t>(t.size()));
  layout_.shard(t, {whole, static_cast<size_t>(t.rows * t.cols)}, local);
  ops_.upload(params_ + t.offset, local.data(), t.size());
}

void Gpt::get_whole(const std::string& name, const float* arena, float* whole) {
  const Tensor& t = layout_.find(name);
  std::vector<float> local(static_cast<size_t>(t.size()));
  ops_.download(local.data(), arena + t.offset, t.size());
  layout_.unshard(t, local, {whole, static_cast<size_t>(t.rows * t.cols)});
}

// With sequence parallelism, the whole sequence's rows from every rank's (an all-gather);
// otherwise the rows are whole already.
float* Gpt::gather_rows(float* local, float* full) {
  if (!parallel_.sp) return local;
  tp_.all_gather(local, full, Nl_ * model_.channels);
  return full;
}

// A row-parallel layer's partial sums, summed over the tp group: this rank's rows of the result
// (a reduce-scatter with sequence parallelism, an all-reduce without).
float* Gpt::reduce_rows(float* partial, float* local) {
  if (parallel_.tp == 1) return partial;
  if (parallel_.sp) {
    tp_.reduce_scatter(partial, local, Nl_ * model_.channels);
    return local;
  }
  tp_.all_reduce(partial, N_ * model_.channels);
  return partial;
}

double Gpt::forward(const int32_t* batch, const GroupHooks* hooks) {
  auto need = [&](int g) {
    if (hooks && hooks->need) hooks->need(g);
  };
  auto done_with = [&](int g) {
    if (hooks && hooks->done_with) hooks->done_with(g);
  };
  const int64_t B = batch_, T = model_.seq, C = model_.channels, L = model_.layers;
  // Tokens to rows t * B + b.
  std::vector<int32_t> in(static_cast<size_t>(N_)), tg(static_cast<size_t>(N_));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int32_t tok = batch[b * (T + 1) + t], next = batch[b * (T + 1) + t + 1];
      if (tok < 0 || tok >= model_.vocab || next < 0 || next >= model_.vocab)
        throw InvalidArgument(fmt::format("batch: sequence {} position {} holds token {}, outside the vocabulary of {}",
                                          b, tok < 0 || tok >= model_.vocab ? t : t + 1,
                                          tok < 0 || tok >= model_.vocab ? tok : next, model_.vocab));
      in[static_cast<size_t>(t * B + b)] = tok;
      tg[static_cast<size_t>(t * B + b)] = next;
    }
  ops_.upload_tokens(inputs_, in.data(), N_);
  ops_.upload_tokens(targets_, tg.data(), N_);

  // Embeddings: this rank's vocabulary slice of every row, summed over the tp group, plus the
  // positions of this rank's rows.
  need(0);
  if (parallel_.tp == 1) {
    ops_.embed(x_[0], inputs_, p_.wte, 0, model_.vocab, p_.wpe, 0, N_, B, C);
  } else {
    ops_.embed(partial_, inputs_, p_.wte, v0_, Vl_, nullptr, 0, N_, B, C);
    float* summed = reduce_rows(partial_, x_[0]);
    ops_.embed(local_, inputs_ + row0_, p_.wte, v0_, 0, p_.wpe, t0_, Nl_, B, C);  // positions only
    ops_.add(x_[0], summed, local_, Nl_ * C);
  }

  for (int64_t l = 0; l < L; ++l) {
    need(static_cast<int>(l + 1));
    const LayerView& w = p_.layers[l];
    // Attention: x2 = x + proj(attention(qkv(ln1(x))))
    ops_.layernorm(ln1_[l], mean1_[l], rstd1_[l], x_[l], w.ln1_w, w.ln1_b, Nl_, C);
    float* ln1 = gather_rows(ln1_[l], ln1_full_[l]);
    ops_.matmul(qkv_[l], ln1, w.qkv_w, w.qkv_b, N_, C, 3 * Cl_);
    ops_.attention(atty_[l], att_[l], qkv_[l], T, B, heads_, head_size_);
    ops_.matmul(partial_, atty_[l], w.proj_w, nullptr, N_, Cl_, C);
    float* proj = reduce_rows(partial_, local_);
    ops_.add_bias(proj, w.proj_b, Nl_, C);
    ops_.add(x2_[l], x_[l], proj, Nl_ * C);
    // MLP: x' = x2 + proj(gelu(fc(ln2(x2))))
    ops_.layernorm(ln2_[l], mean2_[l], rstd2_[l], x2_[l], w.ln2_w, w.ln2_b, Nl_, C);
    float* ln2 = gather_rows(ln2_[l], ln2_full_[l]);
    ops_.matmul(fch_[l], ln2, w.fc_w, w.fc_b, N_, C, 4 * Cl_);
    ops_.gelu(fch_gelu_[l], fch_[l], N_ * 4 * Cl_);
    ops_.matmul(partial_, fch_gelu_[l], w.fcproj_w, nullptr, N_, 4 * Cl_, C);
    float* mlp = reduce_rows(partial_, local_);
    ops_.add_bias(mlp, w.fcproj_b, Nl_, C);
    ops_.add(x_[l + 1], x2_[l], mlp, Nl_ * C);
    done_with(static_cast<int>(l + 1));
  }

  // Final LayerNorm, the tied LM head on this rank's vocabulary slice, and the loss from softmax
  // statistics summed over the slices.
  need(static_cast<int>(L + 1));
  ops_.layernorm(lnf_, meanf_, rstdf_, x_[L], p_.lnf_w, p_.lnf_b, Nl_, C);
  float* lnf = gather_rows(lnf_, lnf_full_);
  ops_.matmul(logits_, lnf, p_.wte, nullptr, N_, C, Vl_);
  ops_.row_max(maxv_, logits_, N_, Vl_);
  tp_.all_reduce(maxv_, N_, RedOp::kMax);
  ops_.row_sum_exp(sum_, logits_, maxv_, N_, Vl_);
  tp_.all_reduce(sum_, N_);
  ops_.target_logit(target_, logits_, targets_, v0_, N_, Vl_);
  tp_.all_reduce(target_, N_);
  return ops_.mean_loss(maxv_, sum_, target_, N_);
}

void Gpt::zero_grads() { ops_.zero(grads_, layout_.size()); }

void Gpt::backward(const GroupHooks* hooks) {
  auto need = [&](int g) {
    if (hooks && hooks->need) hooks->need(g);
  };
  auto done_with = [&](int g) {
    if (hooks && hooks->done_with) hooks->done_with(g);
  };
  auto grads_ready = [&](int g) {
    const Group& gr = layout_.groups()[static_cast<size_t>(g)];
    // Sequence parallelism leaves each tp rank part of the whole tensors' gradients.
    if (parallel_.sp) tp_.all_reduce(grads_ + gr.offset, gr.replicated);
    if (hooks && hooks->grads_ready) hooks->grads_ready(g);
  };
  const int64_t B = batch_, T = model_.seq, C = model_.channels, L = model_.layers;

  // Loss and LM head. The loss is the mean over this rank's N rows.
  need(0);
  need(static_cast<int>(L + 1));
  float* dlogits = logits_;
  ops_.cross_entropy_backward(dlogits, logits_, maxv_, sum_, targets_, v0_, 1.0f / static_cast<float>(N_), N_, Vl_);
  ops_.matmul_backward(dpartial_, g_.wte, nullptr, dlogits, lnf_full_, p_.wte, N_, C, Vl_);
  float* dlnf = reduce_rows(dpartial_, dlocal_);
  ops_.zero(dx_, Nl_ * C);
  ops_.layernorm_backward(dx_, g_.lnf_w, g_.lnf_b, dlnf, x_[L], p_.lnf_w, meanf_, rstdf_, Nl_, C);
  grads_ready(static_cast<int>(L + 1));

  for (int64_t l = L - 1; l >= 0; --l) {
    need(static_cast<int>(l + 1));
    const LayerView& w = p_.layers[l];
    LayerView& d = g_.layers[l];
    // dx is d(x[l+1]). MLP: x[l+1] = x2 + fcproj(gelu(fc(ln2(x2)))) + bias.
    ops_.bias_backward(d.fcproj_b, dx_, Nl_, C);
    float* dmlp = gather_rows(dx_, dfull_);
    ops_.matmul_backward(dfch_, d.fcproj_w, nullptr, dmlp, fch_gelu_[l], w.fcproj_w, N_, 4 * Cl_, C);
    ops_.gelu_backward(dfch_, fch_[l], dfch_, N_ * 4 * Cl_);
    ops_.matmul_backward(dpartial_, d.fc_w, d.fc_b, dfch_, ln2_full_[l], w.fc_w, N_, C, 4 * Cl_);
    float* dln2 = reduce_rows(dpartial_, dlocal_);
    ops_.layernorm_backward(dx_, d.ln2_w, d.ln2_b, dln2, x2_[l], w.ln2_w, mean2_[l], rstd2_[l], Nl_, C);
    // dx is now d(x2). Attention: x2 = x + proj(attention(qkv(ln1(x)))) + bias.
    ops_.bias_backward(d.proj_b, dx_, Nl_, C);
    float* dproj = gather_rows(dx_, dfull_);
    ops_.matmul_backward(datty_, d.proj_w, nullptr, dproj, atty_[l], w.proj_w, N_, Cl_, C);
    ops_.attention_backward(dqkv_, datt_, datty_, qkv_[l], att_[l], T, B, heads_, head_size_);
    ops_.matmul_backward(dpartial_, d.qkv_w, d.qkv_b, dqkv_, ln1_full_[l], w.qkv_w, N_, C, 3 * Cl_);
    float* dln1 = reduce_rows(dpartial_, dlocal_);
    ops_.layernorm_backward(dx_, d.ln1_w, d.ln1_b, dln1, x_[l], w.ln1_w, mean1_[l], rstd1_[l], Nl_, C);
    done_with(static_cast<int>(l + 1));
    grads_ready(static_cast<int>(l + 1));
  }

  // Embeddings: positions of this rank's rows; the token rows of this rank's vocabulary slice
  // from every row.
  ops_.position_backward(g_.wpe, dx_, t0_, Nl_, B, C);
  float* demb = gather_rows(dx_, dfull_);
  ops_.embed_backward(g_.wte, inputs_, demb, v0_, Vl_, N_, C);
  grads_ready(0);
}

}  // namespace tutti::train
