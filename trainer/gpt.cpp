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

struct Gpt::Acts {
  // Per layer of the chunk (x has one more: x[0] is the chunk's input, x[layers] its output).
  std::vector<float*> x, ln1, ln1_full, mean1, rstd1, qkv, atty, att, x2, ln2, ln2_full, mean2, rstd2, fch, fch_gelu;
  // The head's, on the rank holding the last stage.
  float *lnf = nullptr, *lnf_full = nullptr, *meanf = nullptr, *rstdf = nullptr, *logits = nullptr, *maxv = nullptr,
        *sum = nullptr, *target = nullptr;
  // Zero-bubble: the output gradients the deferred weight GEMMs read, per layer.
  std::vector<float*> d_qkv, d_proj, d_fc, d_fcproj;
  float *dout = nullptr, *din = nullptr;  // gradients crossing the stage boundary
  int32_t *inputs = nullptr, *targets = nullptr;
  std::vector<Moe::Acts> moe;  // per layer, with experts
};

Gpt::Gpt(const ModelConfig& model, const Layout& layout, int tp_rank, int pp_rank, int batch, Ops& ops,
         Collectives& tp, Collectives* ep)
    : model_(model),
      parallel_(layout),
      tp_rank_(tp_rank),
      pp_rank_(pp_rank),
      batch_(batch),
      ops_(ops),
      tp_(tp),
      layout_(model, layout.tp, tp_rank, layout.dp, part_of(model, layout, pp_rank, ep ? ep->rank() : 0)) {
  if (tp.size() != layout.tp)
    throw InvalidArgument(fmt::format("GPT: the tp group has {} ranks, the layout says {}", tp.size(), layout.tp));
  if (pp_rank < 0 || pp_rank >= layout.pp || model.layers % (layout.pp * layout.vp) != 0)
    throw InvalidArgument(fmt::format("GPT: pipeline rank {} of {} ({} layers, {} chunks per rank)", pp_rank, layout.pp,
                                      model.layers, layout.vp));
  const int64_t B = batch, T = model.seq, P = layout.tp;
  layers_per_chunk_ = model.layers / (layout.pp * layout.vp);
  N_ = T * B;
  // The mean over the micro-batches' rows: each micro-batch's loss gradient carries 1 / (N m).
  loss_scale_ = 1.0f / static_cast<float>(N_ * layout.microbatches);
  Nl_ = layout.sp ? N_ / P : N_;
  row0_ = layout.sp ? tp_rank * Nl_ : 0;
  t0_ = layout.sp ? tp_rank * (T / P) : 0;
  heads_ = model.heads / P;
  head_size_ = model.channels / model.heads;
  Cl_ = heads_ * head_size_;
  Vl_ = model.vocab / P;
  v0_ = tp_rank * Vl_;

  params_ = alloc(layout_.size());
  grads_ = alloc(layout_.size());
  p_ = bind(layout_, params_);
  g_ = bind(layout_, grads_);
  const int64_t C = model.channels;
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
  drouter_ = alloc(Nl_ * C);
  if (model.experts > 0) moe_ = std::make_unique<Moe>(model, layout, tp_rank, B, N_, Nl_, row0_, ops, tp, ep ? *ep : solo_);
}

Gpt::~Gpt() {
  for (float* p : owned_) ops_.release(p);
  for (auto& a : slots_) {
    ops_.release_tokens(a->inputs);
    ops_.release_tokens(a->targets);
  }
}

float* Gpt::alloc(int64_t n) {
  owned_.push_back(ops_.alloc(std::max<int64_t>(n, 1)));
  return owned_.back();
}

int Gpt::acquire_slot() {
  if (!free_slots_.empty()) {
    const int s = free_slots_.back();
    free_slots_.pop_back();
    return s;
  }
  auto a = std::make_unique<Acts>();
  const int64_t B = batch_, T = model_.seq, C = model_.channels;
  const bool sp = parallel_.sp;
  for (int64_t l = 0; l <= layers_per_chunk_; ++l) a->x.push_back(alloc(Nl_ * C));
  for (int64_t l = 0; l < layers_per_chunk_; ++l) {
    a->ln1.push_back(alloc(Nl_ * C));
    a->ln1_full.push_back(sp ? alloc(N_ * C) : a->ln1.back());
    a->mean1.push_back(alloc(Nl_));
    a->rstd1.push_back(alloc(Nl_));
    a->qkv.push_back(alloc(N_ * 3 * Cl_));
    a->atty.push_back(alloc(N_ * Cl_));
    a->att.push_back(alloc(B * heads_ * T * T));
    a->x2.push_back(alloc(Nl_ * C));
    a->ln2.push_back(alloc(Nl_ * C));
    a->ln2_full.push_back(sp ? alloc(N_ * C) : a->ln2.back());
    a->mean2.push_back(alloc(Nl_));
    a->rstd2.push_back(alloc(Nl_));
    a->fch.push_back(alloc(N_ * 4 * Cl_));
    a->fch_gelu.push_back(alloc(N_ * 4 * Cl_));
    if (parallel_.pipelined() && parallel_.schedule == ScheduleKind::kZeroBubble) {
      a->d_qkv.push_back(alloc(N_ * 3 * Cl_));
      a->d_proj.push_back(alloc(N_ * C));
      a->d_fc.push_back(alloc(N_ * 4 * Cl_));
      a->d_fcproj.push_back(alloc(N_ * C));
    }
  }
  if (layout_.part().head) {
    a->lnf = alloc(Nl_ * C);
    a->lnf_full = sp ? alloc(N_ * C) : a->lnf;
    a->meanf = alloc(Nl_);
    a->rstdf = alloc(Nl_);
    a->logits = alloc(N_ * Vl_);
    a->maxv = alloc(N_);
    a->sum = alloc(N_);
    a->target = alloc(N_);
  }
  if (parallel_.pp > 1) {
    a->dout = alloc(Nl_ * C);
    a->din = alloc(Nl_ * C);
  }
  a->inputs = ops_.alloc_tokens(N_);
  a->targets = ops_.alloc_tokens(N_);
  if (moe_) a->moe.resize(static_cast<size_t>(layers_per_chunk_));
  slots_.push_back(std::move(a));
  return static_cast<int>(slots_.size()) - 1;
}

void Gpt::release_slot(int slot) { free_slots_.push_back(slot); }

int64_t Gpt::boundary_size() const { return Nl_ * model_.channels; }
float* Gpt::stage_input(int slot) { return slots_.at(static_cast<size_t>(slot))->x.front(); }
float* Gpt::stage_output(int slot) { return slots_.at(static_cast<size_t>(slot))->x.back(); }
float* Gpt::output_grad(int slot) { return slots_.at(static_cast<size_t>(slot))->dout; }
float* Gpt::input_grad(int slot) { return slots_.at(static_cast<size_t>(slot))->din; }

const float* Gpt::logits() const {
  if (slots_.empty() || !layout_.part().head) throw InvalidUsage("GPT: logits() before a forward of the last stage");
  return slots_[static_cast<size_t>(last_slot_)]->logits;
}

void Gpt::init(uint64_t seed) {
  // Each tensor's random numbers come from its index in the whole model, so every layout and
  // pipeline part draws the same values.
  const ParamLayout whole(model_, 1, 0, 1);
  const double residual_std = 0.02 / std::sqrt(2.0 * model_.layers);
  for (size_t i = 0; i < whole.tensors().size(); ++i) {
    const Tensor& t = whole.tensors()[i];
    if (!layout_.find_if(t.name)) continue;
    std::vector<float> values(static_cast<size_t>(t.rows * t.cols));
    if (ends_with(t.name, "ln1.weight") || ends_with(t.name, "ln2.weight") || t.name == "lnf.weight") {
      std::fill(values.begin(), values.end(), 1.0f);
    } else if (t.cols > 1) {  // matrices and embeddings
      Normal rng{seed * 0x100000001b3ull + i};
      const double std = ends_with(t.name, "proj.weight") ? residual_std : 0.02;
      for (float& w : values) w = rng(std);
    }  // biases and LayerNorm biases: 0
    set_whole(t.name, values.data());
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

void Gpt::set_tokens(Acts& a, const int32_t* batch) {
  const int64_t B = batch_, T = model_.seq;
  if (!batch) throw InvalidArgument("GPT: the first and last stages need the micro-batch's tokens");
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
  ops_.upload_tokens(a.inputs, in.data(), N_);
  ops_.upload_tokens(a.targets, tg.data(), N_);
}

double Gpt::forward(const int32_t* batch, const GroupHooks* hooks) {
  if (parallel_.pp * parallel_.vp != 1) throw InvalidUsage("GPT: forward() of the whole model on a pipeline stage");
  if (slots_.empty()) acquire_slot();
  last_slot_ = 0;
  return forward_chunk(0, 0, batch, hooks);
}

void Gpt::backward(const GroupHooks* hooks) { backward_chunk(0, last_slot_, false, true, hooks); }

double Gpt::forward_chunk(int chunk, int slot, const int32_t* sequences, const GroupHooks* hooks) {
  auto need = [&](int g) {
    if (hooks && hooks->need) hooks->need(g);
  };
  auto done_with = [&](int g) {
    if (hooks && hooks->done_with) hooks->done_with(g);
  };
  Acts& a = *slots_.at(static_cast<size_t>(slot));
  const int64_t B = batch_, T = model_.seq, C = model_.channels;
  const bool first = first_stage(chunk), last = last_stage(chunk);
  if (first || last) set_tokens(a, sequences);
  last_slot_ = slot;

  // Embeddings: this rank's vocabulary slice of every row, summed over the tp group, plus the
  // positions of this rank's rows.
  if (first) {
    need(layout_.embedding_group());
    if (parallel_.tp == 1) {
      ops_.embed(a.x[0], a.inputs, p_.wte, 0, model_.vocab, p_.wpe, 0, N_, B, C);
    } else {
      ops_.embed(partial_, a.inputs, p_.wte, v0_, Vl_, nullptr, 0, N_, B, C);
      float* summed = reduce_rows(partial_, a.x[0]);
      ops_.embed(local_, a.inputs + row0_, p_.wte, v0_, 0, p_.wpe, t0_, Nl_, B, C);  // positions only
      ops_.add(a.x[0], summed, local_, Nl_ * C);
    }
  }

  double aux = 0;  // the mixture of experts' auxiliary losses
  for (int64_t i = 0; i < layers_per_chunk_; ++i) {
    const int l = first_layer(chunk) + static_cast<int>(i);
    need(layout_.layer_group(l));
    if (moe_) need(layout_.expert_group(l));
    const LayerView& w = p_.layers[static_cast<size_t>(l)];
    // Attention: x2 = x + proj(attention(qkv(ln1(x))))
    ops_.layernorm(a.ln1[i], a.mean1[i], a.rstd1[i], a.x[i], w.ln1_w, w.ln1_b, Nl_, C);
    float* ln1 = gather_rows(a.ln1[i], a.ln1_full[i]);
    ops_.matmul(a.qkv[i], ln1, w.qkv_w, w.qkv_b, N_, C, 3 * Cl_);
    ops_.attention(a.atty[i], a.att[i], a.qkv[i], T, B, heads_, head_size_);
    ops_.matmul(partial_, a.atty[i], w.proj_w, nullptr, N_, Cl_, C);
    float* proj = reduce_rows(partial_, local_);
    ops_.add_bias(proj, w.proj_b, Nl_, C);
    ops_.add(a.x2[i], a.x[i], proj, Nl_ * C);
    // MLP: x' = x2 + proj(gelu(fc(ln2(x2)))), or the mixture of experts on ln2(x2)
    ops_.layernorm(a.ln2[i], a.mean2[i], a.rstd2[i], a.x2[i], w.ln2_w, w.ln2_b, Nl_, C);
    float* ln2 = gather_rows(a.ln2[i], a.ln2_full[i]);
    if (moe_) {
      aux += moe_->forward(a.moe[static_cast<size_t>(i)], a.ln2[i], ln2, w, partial_);
      float* y = reduce_rows(partial_, local_);
      ops_.add(a.x[i + 1], a.x2[i], y, Nl_ * C);
      done_with(layout_.expert_group(l));
      done_with(layout_.layer_group(l));
      continue;
    }
    ops_.matmul(a.fch[i], ln2, w.fc_w, w.fc_b, N_, C, 4 * Cl_);
    ops_.gelu(a.fch_gelu[i], a.fch[i], N_ * 4 * Cl_);
    ops_.matmul(partial_, a.fch_gelu[i], w.fcproj_w, nullptr, N_, 4 * Cl_, C);
    float* mlp = reduce_rows(partial_, local_);
    ops_.add_bias(mlp, w.fcproj_b, Nl_, C);
    ops_.add(a.x[i + 1], a.x2[i], mlp, Nl_ * C);
    done_with(layout_.layer_group(l));
  }
  if (!last) return aux;

  // Final LayerNorm, the tied LM head on this rank's vocabulary slice, and the loss from softmax
  // statistics summed over the slices.
  need(layout_.head_group());
  ops_.layernorm(a.lnf, a.meanf, a.rstdf, a.x.back(), p_.lnf_w, p_.lnf_b, Nl_, C);
  float* lnf = gather_rows(a.lnf, a.lnf_full);
  ops_.matmul(a.logits, lnf, p_.wte, nullptr, N_, C, Vl_);
  ops_.row_max(a.maxv, a.logits, N_, Vl_);
  tp_.all_reduce(a.maxv, N_, RedOp::kMax);
  ops_.row_sum_exp(a.sum, a.logits, a.maxv, N_, Vl_);
  tp_.all_reduce(a.sum, N_);
  ops_.target_logit(a.target, a.logits, a.targets, v0_, N_, Vl_);
  tp_.all_reduce(a.target, N_);
  return ops_.mean_loss(a.maxv, a.sum, a.target, N_) + aux;
}

void Gpt::zero_grads() { ops_.zero(grads_, layout_.size()); }

void Gpt::reduce_replicated(int group) {
  if (!parallel_.sp || group < 0) return;
  const Group& gr = layout_.groups()[static_cast<size_t>(group)];
  tp_.all_reduce(grads_ + gr.offset, gr.replicated);
}

void Gpt::backward_chunk(int chunk, int slot, bool input_only, bool hand_over, const GroupHooks* hooks) {
  if (input_only && hand_over) throw InvalidUsage("GPT: hand_over needs the whole backward, not its input half");
  auto need = [&](int g) {
    if (hooks && hooks->need) hooks->need(g);
  };
  auto done_with = [&](int g) {
    if (hooks && hooks->done_with) hooks->done_with(g);
  };
  auto grads_ready = [&](int g) {
    if (!hand_over) return;
    reduce_replicated(g);
    if (hooks && hooks->grads_ready) hooks->grads_ready(g);
  };
  Acts& a = *slots_.at(static_cast<size_t>(slot));
  const int64_t B = batch_, T = model_.seq, C = model_.channels;
  const bool first = first_stage(chunk), last = last_stage(chunk);

  if (last) {
    // Loss and LM head: each micro-batch's loss is the mean over its N rows, the step's the mean
    // over micro-batches (loss_scale_).
    need(layout_.embedding_group());
    need(layout_.head_group());
    float* dlogits = a.logits;
    ops_.cross_entropy_backward(dlogits, a.logits, a.maxv, a.sum, a.targets, v0_, loss_scale_, N_, Vl_);
    ops_.matmul_backward(dpartial_, g_.wte, nullptr, dlogits, a.lnf_full, p_.wte, N_, C, Vl_);
    float* dlnf = reduce_rows(dpartial_, dlocal_);
    ops_.zero(dx_, Nl_ * C);
    ops_.layernorm_backward(dx_, g_.lnf_w, g_.lnf_b, dlnf, a.x.back(), p_.lnf_w, a.meanf, a.rstdf, Nl_, C);
    grads_ready(layout_.head_group());
  } else {
    ops_.copy(dx_, a.dout, Nl_ * C);
  }

  for (int64_t i = layers_per_chunk_ - 1; i >= 0; --i) {
    const int l = first_layer(chunk) + static_cast<int>(i);
    need(layout_.layer_group(l));
    const LayerView& w = p_.layers[static_cast<size_t>(l)];
    LayerView& d = g_.layers[static_cast<size_t>(l)];
    // The zero-bubble split keeps each weight GEMM's output gradient for backward_weights.
    auto keep = [&](std::vector<float*>& saved, const float* grad, int64_t n) {
      if (input_only) ops_.copy(saved[static_cast<size_t>(i)], grad, n);
    };
    if (moe_) {
      need(layout_.expert_group(l));
      // dx is d(x[l+1]); x[l+1] = x2 + experts(ln2(x2)): the experts' part is a tp partial sum, the
      // router's is complete on this rank's rows.
      float* dy = gather_rows(dx_, dfull_);
      moe_->backward(a.moe[static_cast<size_t>(i)], dy, a.ln2[i], a.ln2_full[i], w, d, dpartial_, drouter_,
                     loss_scale_ * static_cast<float>(N_));
      float* dln2 = reduce_rows(dpartial_, dlocal_);
      ops_.add(dln2, dln2, drouter_, Nl_ * C);
      ops_.layernorm_backward(dx_, d.ln2_w, d.ln2_b, dln2, a.x2[i], w.ln2_w, a.mean2[i], a.rstd2[i], Nl_, C);
      grads_ready(layout_.expert_group(l));
      done_with(layout_.expert_group(l));
    } else {
    // dx is d(x[l+1]). MLP: x[l+1] = x2 + fcproj(gelu(fc(ln2(x2)))) + bias.
    ops_.bias_backward(d.fcproj_b, dx_, Nl_, C);
    float* dmlp = gather_rows(dx_, dfull_);
    keep(a.d_fcproj, dmlp, N_ * C);
    ops_.matmul_backward(dfch_, input_only ? nullptr : d.fcproj_w, nullptr, dmlp, a.fch_gelu[i], w.fcproj_w, N_,
                         4 * Cl_, C);
    ops_.gelu_backward(dfch_, a.fch[i], dfch_, N_ * 4 * Cl_);
    keep(a.d_fc, dfch_, N_ * 4 * Cl_);
    ops_.matmul_backward(dpartial_, input_only ? nullptr : d.fc_w, d.fc_b, dfch_, a.ln2_full[i], w.fc_w, N_, C, 4 * Cl_);
    float* dln2 = reduce_rows(dpartial_, dlocal_);
    ops_.layernorm_backward(dx_, d.ln2_w, d.ln2_b, dln2, a.x2[i], w.ln2_w, a.mean2[i], a.rstd2[i], Nl_, C);
    }
    // dx is now d(x2). Attention: x2 = x + proj(attention(qkv(ln1(x)))) + bias.
    ops_.bias_backward(d.proj_b, dx_, Nl_, C);
    float* dproj = gather_rows(dx_, dfull_);
    keep(a.d_proj, dproj, N_ * C);
    ops_.matmul_backward(datty_, input_only ? nullptr : d.proj_w, nullptr, dproj, a.atty[i], w.proj_w, N_, Cl_, C);
    ops_.attention_backward(dqkv_, datt_, datty_, a.qkv[i], a.att[i], T, B, heads_, head_size_);
    keep(a.d_qkv, dqkv_, N_ * 3 * Cl_);
    ops_.matmul_backward(dpartial_, input_only ? nullptr : d.qkv_w, d.qkv_b, dqkv_, a.ln1_full[i], w.qkv_w, N_, C,
                         3 * Cl_);
    float* dln1 = reduce_rows(dpartial_, dlocal_);
    ops_.layernorm_backward(dx_, d.ln1_w, d.ln1_b, dln1, a.x[i], w.ln1_w, a.mean1[i], a.rstd1[i], Nl_, C);
    done_with(layout_.layer_group(l));
    grads_ready(layout_.layer_group(l));
  }

  if (!first) {
    ops_.copy(a.din, dx_, Nl_ * C);
    return;
  }
  // Embeddings: positions of this rank's rows; the token rows of this rank's vocabulary slice
  // from every row.
  ops_.position_backward(g_.wpe, dx_, t0_, Nl_, B, C);
  float* demb = gather_rows(dx_, dfull_);
  ops_.embed_backward(g_.wte, a.inputs, demb, v0_, Vl_, N_, C);
  grads_ready(layout_.embedding_group());
}

void Gpt::backward_weights(int chunk, int slot) {
  Acts& a = *slots_.at(static_cast<size_t>(slot));
  if (a.d_qkv.empty()) throw InvalidUsage("GPT: backward_weights outside a zero-bubble schedule");
  const int64_t C = model_.channels;
  for (int64_t i = layers_per_chunk_ - 1; i >= 0; --i) {
    const int l = first_layer(chunk) + static_cast<int>(i);
    const LayerView& w = p_.layers[static_cast<size_t>(l)];
    LayerView& d = g_.layers[static_cast<size_t>(l)];
    if (!moe_) {  // the experts' weight gradients are not deferred
      ops_.matmul_backward(nullptr, d.fcproj_w, nullptr, a.d_fcproj[i], a.fch_gelu[i], w.fcproj_w, N_, 4 * Cl_, C);
      ops_.matmul_backward(nullptr, d.fc_w, nullptr, a.d_fc[i], a.ln2_full[i], w.fc_w, N_, C, 4 * Cl_);
    }
    ops_.matmul_backward(nullptr, d.proj_w, nullptr, a.d_proj[i], a.atty[i], w.proj_w, N_, Cl_, C);
    ops_.matmul_backward(nullptr, d.qkv_w, nullptr, a.d_qkv[i], a.ln1_full[i], w.qkv_w, N_, C, 3 * Cl_);
  }
}

}  // namespace tutti::train
