#pragma once
// The shape of a GPT and the layout it is trained in. Plain structs; validate() throws
// tutti::InvalidArgument naming the field and the rule it breaks, before any work is done.

#include <cstdint>
#include <string>

#include "trainer/schedule.hpp"

namespace tutti::train {

// GPT-2-style decoder (trainer/gpt.hpp).
struct ModelConfig {
  int vocab = 256;     // V: byte-level tokens by default
  int seq = 64;        // T: tokens per sequence
  int layers = 4;      // L
  int heads = 4;       // NH
  int channels = 128;  // C: the residual stream's width (a multiple of heads)
  // Mixture of experts (trainer/moe.hpp): every layer's MLP becomes `experts` expert MLPs behind a
  // softmax router; 0 keeps the dense MLP.
  int experts = 0;
  int top_k = 1;          // experts per token: 1 (Switch) or 2
  float capacity = 0;     // capacity factor: an expert takes ceil(capacity * tokens * k / experts) of a
                          // routing group's tokens, the rest are dropped; 0: dropless
  float aux_loss = 0.01f; // the Switch load-balancing loss's coefficient
  int moe_group = 0;      // sequences per routing group (capacity and the auxiliary loss count per
                          // group); 0: each forward's batch. Layouts that cut batches differently
                          // route alike when this is the same.
  void validate() const;
  std::string describe() const;  // "L4 C128 NH4 T64 V256" (" E4 top2 cap1.25" with experts)
  int64_t parameters() const;    // of the whole model (the LM head is the tied token embedding)
  // Floating-point operations of one training step per token (forward and backward), as in the
  // PaLM paper's appendix B: 6 * parameters + 12 * L * C * T (attention).
  double flops_per_token() const;
};

// How the world's ranks are arranged (trainer/groups.hpp documents the order: tp, dp, pp).
struct Layout {
  int tp = 1;         // tensor-parallel ranks (Megatron: heads, MLP columns and the vocabulary split)
  int dp = 1;         // data-parallel ranks
  bool sp = false;    // sequence parallel on top of tp: LayerNorm regions split along the sequence
  int zero = 0;       // 0: all-reduce of gradients; 1, 2, 3: ZeRO stages over the dp ranks
  int pp = 1;         // pipeline-parallel ranks (stages of consecutive layers)
  int ep = 1;         // expert-parallel ranks: a model's experts split over ep of the dp ranks
  int vp = 1;         // model chunks per pipeline rank (the interleaved schedule)
  int microbatches = 1;  // a dp rank's sequences are cut into this many micro-batches
  ScheduleKind schedule = ScheduleKind::k1F1B;
  int world() const { return tp * dp * pp; }
  // Whether steps run a pipeline schedule (trainer/schedule.hpp) instead of one forward and backward.
  bool pipelined() const { return pp > 1 || microbatches > 1; }
  std::string describe() const;  // "tp2 dp2 ep2 sp zero1 pp2 1f1b m4"
  // Throws InvalidArgument when the layout cannot split this model over `world` ranks (tp not
  // dividing heads or vocabulary, sp with a sequence tp does not divide, world != tp * dp * pp,
  // layers not splitting into pp * vp stages, ...).
  void validate(const ModelConfig& model, int world, int batch) const;
};

struct OptimConfig {
  float lr = 3e-4f;          // peak learning rate
  float min_lr = 3e-5f;      // the cosine schedule's floor
  int warmup = 0;            // steps of linear warmup from lr / warmup
  int steps = 100;           // the schedule's length
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  float weight_decay = 0.1f;  // decoupled (AdamW), on 2-D tensors only (matrices and embeddings; as nanoGPT)
  float grad_clip = 1.0f;     // the global gradient norm is scaled down to this (0: no clipping)
  float lr_at(int step) const;  // warmup, then cosine from lr to min_lr over `steps`
};

}  // namespace tutti::train
