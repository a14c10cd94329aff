#pragma once
// A mixture-of-experts MLP (Switch Transformer / GShard), experts sharded over an expert-parallel
// group.
//
// Router: probabilities p = softmax(ln2 . Wr^T) over E experts. Each token takes its top-k experts
// (k = 1 or 2; ties to the lower index) with gate = p of that expert (no renormalisation). Tokens
// are routed in groups (ModelConfig::moe_group sequences): an expert takes at most
// ceil(capacity * group tokens * k / E) of a group's choices, first choices of every token before
// second choices, tokens in row order; the rest are dropped (their gate contributes nothing).
// Dropless (capacity 0) keeps every choice. The Switch auxiliary loss per group,
// aux_loss * E * sum_e f_e P_e (f_e: the fraction of the group's k choices per token routed to e,
// before capacity; P_e: the mean of p_e over the group's tokens), is added to the loss, averaged
// over groups.
//
// Experts: gelu(x W1^T + b1) W2^T, each expert's W1 rows and W2 columns split over the tp ranks
// like the dense MLP's (the output is a tp partial sum, reduced with the other row-parallel
// layers). Expert e lives on ep rank e / (E / ep).
//
// Exchange: every (source rank, destination rank) pair has a fixed block of slots, grouped by the
// destination's expert, then routing group, then position (capacity slots each; dropless: a
// group's tokens). Forward: the tokens go out with tutti::fused::MoeExchange::dispatch and the
// gates with an all-to-all, the expert outputs come back with an all-to-all (kept for the gates'
// gradient) and are weighted and summed per token. Backward: the output gradient goes out with
// dispatch and is weighted by the gate on arrival; the input gradients come back summed per token
// with MoeExchange::combine. With one ep rank the same slots are filled by local copies.
//
// Host code. On the CPU backend it works in place; on a device backend the layer's inputs, weights
// and gradients go through host copies (correct, not fast: the device path of the exchange comes
// with device buffers in the C++ API).

#include <cstdint>
#include <memory>
#include <vector>

#include "trainer/config.hpp"
#include "trainer/groups.hpp"
#include "trainer/ops.hpp"
#include "trainer/params.hpp"
#include "tutti/fused.hpp"

namespace tutti::train {

class Moe {
 public:
  // One micro-batch of one layer: what backward needs.
  struct Acts {
    std::vector<float> probs;        // N x E, every row
    std::vector<int32_t> choice;     // N x k: the expert of each choice, -1 where capacity dropped it
    std::vector<float> gate;         // N x k
    std::vector<int64_t> slot;       // N x k: the choice's slot in the exchange, -1 when dropped
    std::vector<int32_t> index;      // ep x cap: the token row of each slot this rank sends, -1 empty
    std::vector<float> gate_slot;    // ep x cap: their gates
    std::vector<float> gate_recv;    // ep x cap: the gates of the slots this rank's experts serve
    std::vector<float> ein, h, hg;   // the slots' inputs, hidden pre-GELU and after (expert side)
    std::vector<float> eout, eback;  // expert outputs: computed here, and those of this rank's tokens
    std::vector<float> routed;       // groups x E: the fraction f_e of each group's choices routed to e
  };

  // N rows (T x batch), Nl of them this rank's (with sequence parallelism), from row0.
  Moe(const ModelConfig& model, const Layout& layout, int tp_rank, int64_t batch, int64_t N, int64_t Nl, int64_t row0,
      Ops& ops, Collectives& tp, Collectives& ep);
  ~Moe();

  // ln_local: Nl x C (this rank's rows), ln_full: N x C. Writes out (N x C, this tp rank's partial
  // sum of the expert outputs). Returns the auxiliary loss (coefficient included, mean over groups).
  double forward(Acts& a, const float* ln_local, const float* ln_full, const LayerView& w, float* out);
  // dy: N x C, the gradient of forward's output (whole, not partial). Adds to the router's and the
  // experts' gradients in g; writes dpartial (N x C, the tp partial gradient of ln_full through the
  // experts) and drouter (Nl x C, the gradient of ln_local through the router, complete).
  // aux_scale: the weight of this forward's auxiliary loss in the step's objective.
  void backward(Acts& a, const float* dy, const float* ln_local, const float* ln_full, const LayerView& w,
                LayerView& g, float* dpartial, float* drouter, float aux_scale);

  int64_t capacity() const { return per_group_; }  // slots per (expert, routing group)

 private:
  struct HostCopy;  // a LayerView's router and experts in host memory
  HostCopy to_host(const LayerView& w, bool zeros);
  double forward_host(Acts& a, const float* ln_local, const float* ln_full, const LayerView& w, float* out);
  void backward_host(Acts& a, const float* dy, const float* ln_local, const LayerView& w, LayerView& g,
                     float* dpartial, float* drouter, float aux_scale);
  void exchange_out(Acts& a, const float* rows, float* slots);  // token rows -> the experts' slots
  ModelConfig model_;
  int E_, k_, ep_, ep_rank_, local_experts_;
  int64_t B_, T_, C_, H_, N_, Nl_, row0_, group_seqs_, groups_, per_group_, block_;
  bool sp_;
  Ops& ops_;     // the model's backend: inputs, outputs, weights and gradients live there
  std::unique_ptr<Ops> host_ops_;  // a device backend's: the layer's GEMMs on host copies
  Ops& cpu_;
  Collectives& tp_;
  Collectives& ep_group_;
  std::unique_ptr<tutti::fused::MoeExchange> exchange_;  // ep > 1
};

}  // namespace tutti::train
