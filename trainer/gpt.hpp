#pragma once
// A GPT-2-style decoder, forward and backward written out by hand (llm.c's plan): token and
// position embeddings; pre-LayerNorm blocks of causal multi-head attention and a tanh-GELU MLP,
// each added to the residual stream; a final LayerNorm; the LM head tied to the token embedding;
// cross-entropy. One parameter arena and one gradient arena (trainer/params.hpp), activations
// allocated once for a batch size.
//
// Tensor parallel (Megatron-LM), over the tp group of `tp.size()` ranks: QKV and the MLP's first
// layer are column-parallel (each rank its heads / its quarter of the hidden units), the attention
// output and MLP's second layer row-parallel (partial sums, all-reduced), the token embedding and
// the loss vocabulary-parallel (each rank its slice of the vocabulary: embeddings all-reduced,
// softmax statistics all-reduced). With sequence parallelism the residual stream and LayerNorms
// are split along the sequence (rows): all-gather before a column-parallel layer, reduce-scatter
// after a row-parallel one, and the gradients of the parameters every tp rank holds whole
// (LayerNorms, wpe, row-parallel biases) all-reduced over the tp group.

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "trainer/config.hpp"
#include "trainer/groups.hpp"
#include "trainer/moe.hpp"
#include "trainer/ops.hpp"
#include "trainer/params.hpp"

namespace tutti::train {

// Called by forward/backward at group boundaries (trainer/params.hpp's groups): data parallelism
// reduces a group's gradients as soon as they are complete; ZeRO-3 gathers a group's parameters
// before use and releases them after.
struct GroupHooks {
  std::function<void(int group)> need;         // before reading the group's parameters
  std::function<void(int group)> done_with;    // after a pass's last read of them
  std::function<void(int group)> grads_ready;  // its gradients are complete on this rank
};

class Gpt {
 public:
  // `batch`: sequences per forward on this rank (a micro-batch's); `pp_rank`: this rank's place in
  // the pipeline (its layers: trainer/params.hpp's part_of). Gradients are scaled for the mean over
  // layout.microbatches forwards.
  // `ep`: the expert-parallel group (null: one rank holding every expert).
  Gpt(const ModelConfig& model, const Layout& layout, int tp_rank, int pp_rank, int batch, Ops& ops, Collectives& tp,
      Collectives* ep = nullptr);
  Gpt(const ModelConfig& model, const Layout& layout, int tp_rank, int batch, Ops& ops, Collectives& tp)
      : Gpt(model, layout, tp_rank, 0, batch, ops, tp) {}
  ~Gpt();
  Gpt(const Gpt&) = delete;
  Gpt& operator=(const Gpt&) = delete;

  const ModelConfig& model() const { return model_; }
  const ParamLayout& layout() const { return layout_; }
  Ops& ops() { return ops_; }
  float* params() { return params_; }  // layout().size() floats of the backend's memory
  float* grads() { return grads_; }
  int batch() const { return batch_; }

  // Every rank of every layout calls it with the same seed: the whole model's initial values, from
  // which each rank keeps its shard (GPT-2's: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)),
  // biases 0, LayerNorms 1 and 0).
  void init(uint64_t seed);
  // Sets tensor `name` from its whole value (host memory, rows x cols); this rank keeps its shard.
  void set_whole(const std::string& name, const float* whole);
  // This rank's part of tensor `name` written into the whole value (host memory); others untouched.
  void get_whole(const std::string& name, const float* arena, float* whole);

  // The whole model on one micro-batch (no pipeline): batch: `batch()` sequences of T + 1 tokens
  // (host memory): inputs are positions 0..T-1, targets 1..T. Returns the mean cross-entropy over
  // this rank's sequences. Keeps what backward needs.
  double forward(const int32_t* batch, const GroupHooks* hooks = nullptr);
  void zero_grads();
  // Adds the gradients of the last forward's loss to grads(), handing each group over (hooks) as
  // soon as it is complete.
  void backward(const GroupHooks* hooks = nullptr);
  // The last forward's logits of this rank's vocabulary slice: rows t * batch + b, columns
  // [v0, v0 + V / tp) of the vocabulary (backend memory; overwritten by backward).
  const float* logits() const;

  // --- pipeline stages (trainer/schedule.hpp). A slot holds one micro-batch's activations of one
  // chunk; slots are made as the schedule needs them and reused once released.
  int chunks() const { return parallel_.vp; }
  bool first_stage(int chunk) const { return stage_of(chunk) == 0; }
  bool last_stage(int chunk) const { return stage_of(chunk) == parallel_.pp * parallel_.vp - 1; }
  int acquire_slot();
  void release_slot(int slot);
  int slots_made() const { return static_cast<int>(slots_.size()); }  // the peak of slots in use
  int64_t boundary_size() const;  // floats of an activation or gradient passed between stages
  float* stage_input(int slot);   // receive the chunk's input here (not on the first stage)
  float* stage_output(int slot);  // send from here after forward (not on the last stage)
  float* output_grad(int slot);   // receive the gradient of the chunk's output here (not on the last stage)
  float* input_grad(int slot);    // send from here after backward (not on the first stage)
  // Forward of the chunk: embeddings first on the first stage (from `sequences`), the loss last on
  // the last (from `sequences` too; returned, else 0).
  double forward_chunk(int chunk, int slot, const int32_t* sequences, const GroupHooks* hooks = nullptr);
  // Backward of the chunk. input_only: the weight-matrix gradients wait for backward_weights (the
  // zero-bubble split). hand_over: each group's gradients are complete after this call (the last
  // micro-batch): sequence parallelism's tp reduction runs and hooks->grads_ready is called.
  void backward_chunk(int chunk, int slot, bool input_only, bool hand_over, const GroupHooks* hooks = nullptr);
  void backward_weights(int chunk, int slot);
  // Sequence parallelism leaves each tp rank part of a group's whole tensors' gradients: sums them
  // over the tp group (hand_over does it; a pipeline's trainer calls it once all micro-batches are in).
  void reduce_replicated(int group);

 private:
  struct Acts;
  float* gather_rows(float* local, float* full);
  float* reduce_rows(float* partial, float* local);
  int stage_of(int chunk) const { return chunk * parallel_.pp + pp_rank_; }
  int first_layer(int chunk) const { return stage_of(chunk) * layers_per_chunk_; }
  void set_tokens(Acts& a, const int32_t* sequences);

  ModelConfig model_;
  Layout parallel_;
  Collectives solo_;  // the ep group when there is none
  int tp_rank_, pp_rank_;
  int batch_;
  Ops& ops_;
  Collectives& tp_;
  ParamLayout layout_;
  int layers_per_chunk_;
  float loss_scale_;
  float* params_ = nullptr;
  float* grads_ = nullptr;
  ParamView p_, g_;
  // Shapes: N rows (T * batch), Nl of them on this rank (N / tp with sequence parallelism), the
  // rank's heads, channels of its heads, vocabulary slice.
  int64_t N_, Nl_, row0_, t0_, heads_, head_size_, Cl_, Vl_, v0_;
  std::vector<float*> owned_;  // every buffer, released at the end
  float* alloc(int64_t n);
  std::vector<std::unique_ptr<Acts>> slots_;
  std::vector<int> free_slots_;
  int last_slot_ = 0;  // forward()'s
  // Scratch: a row-parallel layer's partial output (N x C), this rank's rows of it (Nl x C), and
  // backward's buffers.
  float *partial_, *local_, *dx_, *dfull_, *dpartial_, *dlocal_, *dqkv_, *datty_, *datt_, *dfch_, *drouter_;
  std::unique_ptr<Moe> moe_;  // with experts
};

}  // namespace tutti::train
