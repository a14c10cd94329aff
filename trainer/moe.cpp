#include "trainer/moe.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace tutti::train {

Moe::Moe(const ModelConfig& model, const Layout& layout, int tp_rank, int64_t batch, int64_t N, int64_t Nl,
         int64_t row0, Ops& ops, Collectives& tp, Collectives& ep)
    : model_(model),
      E_(model.experts),
      k_(model.top_k),
      ep_(layout.ep),
      ep_rank_(ep.rank()),
      local_experts_(model.experts / layout.ep),
      B_(batch),
      T_(model.seq),
      C_(model.channels),
      H_(4 * model.channels / layout.tp),
      N_(N),
      Nl_(Nl),
      row0_(row0),
      sp_(layout.sp),
      ops_(ops),
      host_ops_(std::string(ops.name()) == "cpu" ? nullptr : make_cpu_ops(1)),
      cpu_(host_ops_ ? *host_ops_ : ops),
      tp_(tp),
      ep_group_(ep) {
  (void)tp_rank;
  if (ep.size() != layout.ep)
    throw InvalidArgument(fmt::format("mixture of experts: the ep group has {} ranks, the layout says {}", ep.size(), layout.ep));
  group_seqs_ = model.moe_group > 0 ? model.moe_group : batch;
  if (batch % group_seqs_ != 0)
    throw InvalidArgument(fmt::format("mixture of experts: {} sequences do not split into routing groups of {}", batch,
                                      group_seqs_));
  groups_ = batch / group_seqs_;
  const int64_t group_tokens = group_seqs_ * T_;
  // An expert can take a group's token at most once, so a group never needs more slots per expert
  // than it has tokens.
  per_group_ = model.capacity > 0
                   ? std::clamp<int64_t>(static_cast<int64_t>(std::ceil(static_cast<double>(model.capacity) *
                                                                        static_cast<double>(group_tokens * k_) / E_)),
                                         1, group_tokens)
                   : group_tokens;
  block_ = local_experts_ * groups_ * per_group_;
  if (ep_ > 1) exchange_ = std::make_unique<tutti::fused::MoeExchange>(*ep.comm(), N_, C_, block_);
}

Moe::~Moe() = default;

void Moe::exchange_out(Acts& a, const float* rows, float* slots) {
  if (exchange_) {
    tutti::Work w = exchange_->dispatch(rows, a.index.data(), slots);
    ep_group_.wait(w);
    return;
  }
  for (int64_t s = 0; s < block_; ++s) {
    const int32_t r = a.index[static_cast<size_t>(s)];
    if (r < 0) std::memset(slots + s * C_, 0, static_cast<size_t>(C_) * sizeof(float));
    else std::memcpy(slots + s * C_, rows + r * C_, static_cast<size_t>(C_) * sizeof(float));
  }
}

struct Moe::HostCopy {
  std::vector<float> router;
  std::vector<std::vector<float>> fc_w, fc_b, proj_w;
  LayerView view;
};

// The router and this rank's experts in host memory: their values (zeros: zeros of their sizes).
Moe::HostCopy Moe::to_host(const LayerView& w, bool zeros) {
  HostCopy h;
  auto take = [&](std::vector<float>& v, const float* src, int64_t n) {
    v.assign(static_cast<size_t>(n), 0.0f);
    if (!zeros) ops_.download(v.data(), src, n);
    return v.data();
  };
  h.view.router = take(h.router, w.router, E_ * C_);
  h.fc_w.resize(static_cast<size_t>(local_experts_));
  h.fc_b.resize(h.fc_w.size());
  h.proj_w.resize(h.fc_w.size());
  for (size_t j = 0; j < h.fc_w.size(); ++j) {
    h.view.expert_fc_w.push_back(take(h.fc_w[j], w.expert_fc_w[j], H_ * C_));
    h.view.expert_fc_b.push_back(take(h.fc_b[j], w.expert_fc_b[j], H_));
    h.view.expert_proj_w.push_back(take(h.proj_w[j], w.expert_proj_w[j], C_ * H_));
  }
  return h;
}

double Moe::forward(Acts& a, const float* ln_local, const float* ln_full, const LayerView& w, float* out) {
  if (!host_ops_) return forward_host(a, ln_local, ln_full, w, out);
  std::vector<float> local(static_cast<size_t>(Nl_ * C_)), full(static_cast<size_t>(N_ * C_)), y(full.size());
  ops_.download(local.data(), ln_local, Nl_ * C_);
  ops_.download(full.data(), ln_full, N_ * C_);
  const HostCopy hw = to_host(w, false);
  const double aux = forward_host(a, local.data(), full.data(), hw.view, y.data());
  ops_.upload(out, y.data(), N_ * C_);
  return aux;
}

void Moe::backward(Acts& a, const float* dy, const float* ln_local, const float* ln_full, const LayerView& w,
                   LayerView& g, float* dpartial, float* drouter, float aux_scale) {
  (void)ln_full;
  if (!host_ops_) return backward_host(a, dy, ln_local, w, g, dpartial, drouter, aux_scale);
  std::vector<float> hdy(static_cast<size_t>(N_ * C_)), local(static_cast<size_t>(Nl_ * C_)), dp(hdy.size()),
      dr(local.size());
  ops_.download(hdy.data(), dy, N_ * C_);
  ops_.download(local.data(), ln_local, Nl_ * C_);
  const HostCopy hw = to_host(w, false);
  HostCopy hg = to_host(g, true);
  backward_host(a, hdy.data(), local.data(), hw.view, hg.view, dp.data(), dr.data(), aux_scale);
  ops_.upload(dpartial, dp.data(), N_ * C_);
  ops_.upload(drouter, dr.data(), Nl_ * C_);
  // The gradients accumulate: add the host's contributions on the device.
  auto add = [&](float* grad, const std::vector<float>& delta) {
    const auto n = static_cast<int64_t>(delta.size());
    float* tmp = ops_.alloc(n);
    ops_.upload(tmp, delta.data(), n);
    ops_.accumulate(grad, tmp, n);
    ops_.release(tmp);
  };
  add(g.router, hg.router);
  for (size_t j = 0; j < hg.fc_w.size(); ++j) {
    add(g.expert_fc_w[j], hg.fc_w[j]);
    add(g.expert_fc_b[j], hg.fc_b[j]);
    add(g.expert_proj_w[j], hg.proj_w[j]);
  }
}

double Moe::forward_host(Acts& a, const float* ln_local, const float* ln_full, const LayerView& w, float* out) {
  const auto E = static_cast<size_t>(E_), K = static_cast<size_t>(k_);
  const int64_t slots = ep_ * block_;
  // Router on this rank's rows, the probabilities of every row on every tp rank.
  std::vector<float> logits(static_cast<size_t>(Nl_) * E);
  cpu_.matmul(logits.data(), ln_local, w.router, nullptr, Nl_, C_, E_);
  for (int64_t r = 0; r < Nl_; ++r) {
    float* row = logits.data() + r * E_;
    const float m = *std::max_element(row, row + E_);
    float sum = 0;
    for (size_t e = 0; e < E; ++e) sum += row[e] = std::exp(row[e] - m);
    for (size_t e = 0; e < E; ++e) row[e] /= sum;
  }
  a.probs.resize(static_cast<size_t>(N_) * E);
  if (sp_) tp_.all_gather(logits.data(), a.probs.data(), Nl_ * E_);
  else a.probs = logits;

  // Top-k choices, then capacity per (group, expert): first choices of every token before second
  // choices, tokens in row order within the group.
  a.choice.assign(static_cast<size_t>(N_) * K, -1);
  a.gate.assign(static_cast<size_t>(N_) * K, 0.0f);
  a.slot.assign(static_cast<size_t>(N_) * K, -1);
  a.index.assign(static_cast<size_t>(slots), -1);
  a.gate_slot.assign(static_cast<size_t>(slots), 0.0f);
  a.routed.assign(static_cast<size_t>(groups_) * E, 0.0f);
  std::vector<int32_t> top(static_cast<size_t>(N_) * K);
  for (int64_t r = 0; r < N_; ++r) {
    const float* p = a.probs.data() + r * E_;
    int32_t first = 0;
    for (int32_t e = 1; e < E_; ++e)
      if (p[e] > p[first]) first = e;
    top[static_cast<size_t>(r) * K] = first;
    if (k_ == 2) {
      int32_t second = first == 0 ? 1 : 0;
      for (int32_t e = 0; e < E_; ++e)
        if (e != first && p[e] > p[second]) second = e;
      top[static_cast<size_t>(r) * K + 1] = second;
    }
  }
  const double group_tokens = static_cast<double>(group_seqs_ * T_);
  double aux = 0;
  for (int64_t g = 0; g < groups_; ++g) {
    std::vector<int64_t> taken(E, 0);
    std::vector<double> mean_p(E, 0.0);
    for (size_t j = 0; j < K; ++j)
      for (int64_t t = 0; t < T_; ++t)
        for (int64_t b = g * group_seqs_; b < (g + 1) * group_seqs_; ++b) {
          const int64_t r = t * B_ + b;
          const size_t c = static_cast<size_t>(r) * K + j;
          const int32_t e = top[c];
          a.routed[static_cast<size_t>(g) * E + static_cast<size_t>(e)] += 1.0f;
          if (j == 0)
            for (size_t x = 0; x < E; ++x) mean_p[x] += a.probs[static_cast<size_t>(r) * E + x];
          a.gate[c] = a.probs[static_cast<size_t>(r) * E + static_cast<size_t>(e)];
          if (taken[static_cast<size_t>(e)] >= per_group_) continue;  // over capacity: dropped
          const int64_t q = e / local_experts_, local = e % local_experts_;
          const int64_t s = q * block_ + (local * groups_ + g) * per_group_ + taken[static_cast<size_t>(e)]++;
          a.choice[c] = e;
          a.slot[c] = s;
          a.index[static_cast<size_t>(s)] = static_cast<int32_t>(r);
          a.gate_slot[static_cast<size_t>(s)] = a.gate[c];
        }
    double sum = 0;
    for (size_t e = 0; e < E; ++e) {
      float& f = a.routed[static_cast<size_t>(g) * E + e];
      f = static_cast<float>(f / (group_tokens * k_));
      sum += f * (mean_p[e] / group_tokens);
    }
    aux += model_.aux_loss * E_ * sum;
  }

  // Tokens to their experts' slots, gates with them.
  a.ein.resize(static_cast<size_t>(slots * C_));
  exchange_out(a, ln_full, a.ein.data());
  a.gate_recv.resize(static_cast<size_t>(slots));
  if (exchange_) {
    tutti::Work w = ep_group_.comm()->all_to_all(a.gate_slot.data(), a.gate_recv.data(), static_cast<size_t>(block_),
                                                 DataType::kFloat32);
    ep_group_.wait(w);
  } else
    a.gate_recv = a.gate_slot;

  // The experts, a GEMM per (source rank, local expert) block of slots.
  a.h.resize(static_cast<size_t>(slots * H_));
  a.hg.resize(a.h.size());
  a.eout.resize(static_cast<size_t>(slots * C_));
  const int64_t rows = groups_ * per_group_;
  for (int64_t q = 0; q < ep_; ++q)
    for (int j = 0; j < local_experts_; ++j) {
      const int64_t off = q * block_ + j * rows;
      cpu_.matmul(a.h.data() + off * H_, a.ein.data() + off * C_, w.expert_fc_w[static_cast<size_t>(j)],
                  w.expert_fc_b[static_cast<size_t>(j)], rows, C_, H_);
    }
  cpu_.gelu(a.hg.data(), a.h.data(), slots * H_);
  for (int64_t q = 0; q < ep_; ++q)
    for (int j = 0; j < local_experts_; ++j) {
      const int64_t off = q * block_ + j * rows;
      cpu_.matmul(a.eout.data() + off * C_, a.hg.data() + off * H_, w.expert_proj_w[static_cast<size_t>(j)], nullptr,
                  rows, H_, C_);
    }

  // Outputs back to the tokens' ranks, kept for the gates' gradient, weighted and summed per token.
  if (exchange_) {
    a.eback.resize(a.eout.size());
    tutti::Work w = ep_group_.comm()->all_to_all(a.eout.data(), a.eback.data(), static_cast<size_t>(block_ * C_),
                                                 DataType::kFloat32);
    ep_group_.wait(w);
  } else {
    a.eback = a.eout;
  }
  std::memset(out, 0, static_cast<size_t>(N_ * C_) * sizeof(float));
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t r = a.index[static_cast<size_t>(s)];
    if (r < 0) continue;
    const float g = a.gate_slot[static_cast<size_t>(s)];
    const float* y = a.eback.data() + s * C_;
    float* o = out + r * C_;
    for (int64_t c = 0; c < C_; ++c) o[c] += g * y[c];
  }
  return aux / static_cast<double>(groups_);
}

void Moe::backward_host(Acts& a, const float* dy, const float* ln_local, const LayerView& w, LayerView& g,
                        float* dpartial, float* drouter, float aux_scale) {
  const auto E = static_cast<size_t>(E_), K = static_cast<size_t>(k_);
  const int64_t slots = ep_ * block_, rows = groups_ * per_group_;
  // The gates' gradient: dy . (the expert's output), summed over the tp ranks' partial outputs.
  std::vector<float> dgate(static_cast<size_t>(N_) * K, 0.0f);
  for (int64_t r = 0; r < N_; ++r)
    for (size_t j = 0; j < K; ++j) {
      const int64_t s = a.slot[static_cast<size_t>(r) * K + j];
      if (s < 0) continue;
      float d = 0;
      for (int64_t c = 0; c < C_; ++c) d += dy[r * C_ + c] * a.eback[static_cast<size_t>(s * C_ + c)];
      dgate[static_cast<size_t>(r) * K + j] = d;
    }
  tp_.all_reduce(dgate.data(), N_ * k_);

  // The experts' output gradient: dy of each slot's token, times its gate, on the expert's rank.
  std::vector<float> deo(static_cast<size_t>(slots * C_)), dh(static_cast<size_t>(slots * H_)), dein(deo.size());
  exchange_out(a, dy, deo.data());
  for (int64_t s = 0; s < slots; ++s) {
    const float gt = a.gate_recv[static_cast<size_t>(s)];
    for (int64_t c = 0; c < C_; ++c) deo[static_cast<size_t>(s * C_ + c)] *= gt;
  }
  for (int64_t q = 0; q < ep_; ++q)
    for (int j = 0; j < local_experts_; ++j) {
      const int64_t off = q * block_ + j * rows;
      cpu_.matmul_backward(dh.data() + off * H_, g.expert_proj_w[static_cast<size_t>(j)], nullptr, deo.data() + off * C_,
                           a.hg.data() + off * H_, w.expert_proj_w[static_cast<size_t>(j)], rows, H_, C_);
    }
  cpu_.gelu_backward(dh.data(), a.h.data(), dh.data(), slots * H_);
  for (int64_t q = 0; q < ep_; ++q)
    for (int j = 0; j < local_experts_; ++j) {
      const int64_t off = q * block_ + j * rows;
      cpu_.matmul_backward(dein.data() + off * C_, g.expert_fc_w[static_cast<size_t>(j)],
                           g.expert_fc_b[static_cast<size_t>(j)], dh.data() + off * H_, a.ein.data() + off * C_,
                           w.expert_fc_w[static_cast<size_t>(j)], rows, C_, H_);
    }
  // Back to the tokens, summed per token (the gate is already in).
  if (exchange_) {
    const std::vector<float> ones(static_cast<size_t>(slots), 1.0f);
    tutti::Work w = exchange_->combine(dein.data(), ones.data(), a.index.data(), dpartial);
    ep_group_.wait(w);
  } else {
    std::memset(dpartial, 0, static_cast<size_t>(N_ * C_) * sizeof(float));
    for (int64_t s = 0; s < slots; ++s) {
      const int32_t r = a.index[static_cast<size_t>(s)];
      if (r < 0) continue;
      for (int64_t c = 0; c < C_; ++c) dpartial[r * C_ + c] += dein[static_cast<size_t>(s * C_ + c)];
    }
  }

  // Router: the kept gates' gradient plus the auxiliary loss's (through P_e), then softmax backward
  // on this rank's rows.
  std::vector<float> dprobs(static_cast<size_t>(N_) * E, 0.0f);
  for (int64_t r = 0; r < N_; ++r)
    for (size_t j = 0; j < K; ++j) {
      const int32_t e = a.choice[static_cast<size_t>(r) * K + j];
      if (e >= 0) dprobs[static_cast<size_t>(r) * E + static_cast<size_t>(e)] += dgate[static_cast<size_t>(r) * K + j];
    }
  const double per_token = aux_scale * model_.aux_loss * E_ / (static_cast<double>(group_seqs_ * T_) * groups_);
  for (int64_t gr = 0; gr < groups_; ++gr)
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t b = gr * group_seqs_; b < (gr + 1) * group_seqs_; ++b)
        for (size_t e = 0; e < E; ++e)
          dprobs[static_cast<size_t>(t * B_ + b) * E + e] +=
              static_cast<float>(per_token * a.routed[static_cast<size_t>(gr) * E + e]);
  std::vector<float> dlogits(static_cast<size_t>(Nl_) * E);
  for (int64_t l = 0; l < Nl_; ++l) {
    const size_t r = static_cast<size_t>(sp_ ? row0_ + l : l);
    const float* p = a.probs.data() + r * E;
    const float* dp = dprobs.data() + r * E;
    float dot = 0;
    for (size_t e = 0; e < E; ++e) dot += p[e] * dp[e];
    for (size_t e = 0; e < E; ++e) dlogits[static_cast<size_t>(l) * E + e] = p[e] * (dp[e] - dot);
  }
  cpu_.matmul_backward(drouter, g.router, nullptr, dlogits.data(), ln_local, w.router, Nl_, C_, E_);
}

}  // namespace tutti::train
