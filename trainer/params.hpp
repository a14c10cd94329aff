#pragma once
// The parameters of a GPT as one arena of floats with named views, for one rank of a layout.
//
// Tensors are stored in groups: the embeddings (wte, wpe), then one group per layer, then the final
// LayerNorm; a pipeline rank holds the groups of its part only (ModelPart). A group is the unit of data-parallel communication: gradients
// are reduced a group at a time as backward finishes it (layers in reverse order, the embeddings
// last since the tied LM head and the embedding both write wte's gradient), and ZeRO-3 gathers a
// group's parameters before use. Each group is padded to a multiple of `dp` floats so it splits
// into dp equal shards; rank d of the dp group owns shard d of every group.
//
// Within a group the tensors that are whole on every tp rank come first, so one call reduces their
// gradients over the tp group (sequence parallelism makes them partial).
//
// Tensor parallelism shards some tensors (Megatron-LM):
//   wte              rows (the vocabulary) split: rank p holds tokens [p V/tp, (p+1) V/tp)
//   qkv.weight/bias  rows split by head: rank p holds the q, k and v rows of heads [p NH/tp, ...)
//   attn.proj.weight columns split (row-parallel layer); its bias is whole
//   fc.weight/bias   rows split (column-parallel layer)
//   fc.proj.weight   columns split (row-parallel layer); its bias is whole
// Everything else (wpe, LayerNorms, the two row-parallel biases) is whole on every rank.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "trainer/config.hpp"

namespace tutti::train {

enum class Split { kWhole, kRows, kColumns, kHeadRows };

struct Tensor {
  std::string name;    // "h.3.attn.qkv.weight"
  int64_t rows = 1, cols = 1;  // the whole tensor's shape (a vector is rows x 1)
  Split split = Split::kWhole;
  int group = 0;
  bool decay = false;       // AdamW's weight decay applies (2-D tensors)
  bool replicated = true;   // whole on every tp rank (kWhole)
  int64_t offset = 0;       // in the arena
  int64_t local_rows = 1, local_cols = 1;
  int64_t size() const { return local_rows * local_cols; }
};

// The part of the model one pipeline rank holds (trainer/config.hpp's Layout cuts the layers into
// pp * vp stages; stage s is chunk s / pp of rank s % pp). Without pipeline parallelism: everything.
struct ModelPart {
  std::vector<int> layers;  // global layer indices, ascending
  bool embeddings = true;   // wte and wpe: the first stage, and the last for the tied LM head
  bool head = true;         // the final LayerNorm: the last stage
  std::vector<int> experts; // global expert ids held (trainer/moe.hpp): those of the rank's ep rank
  static ModelPart whole(const ModelConfig& model);
};
ModelPart part_of(const ModelConfig& model, const Layout& layout, int pp_rank, int ep_rank = 0);

struct Group {
  int64_t offset = 0;      // in the arena
  int64_t size = 0;        // padded to a multiple of dp
  int64_t replicated = 0;  // floats at its start that are whole on every tp rank (they come first)
  int dp = 1;
  bool expert = false;     // a layer's experts: reduced over the expert-data-parallel group
  int64_t shard() const { return size / dp; }
};

class ParamLayout {
 public:
  ParamLayout(const ModelConfig& model, int tp, int tp_rank, int dp);  // the whole model
  ParamLayout(const ModelConfig& model, int tp, int tp_rank, int dp, ModelPart part);
  const ModelPart& part() const { return part_; }
  // Index in groups() of layer l's group, of the embeddings' and of the final LayerNorm's; -1 where
  // this part does not hold it.
  int layer_group(int l) const;
  int expert_group(int l) const;  // with experts: the group after layer_group(l)
  int embedding_group() const { return part_.embeddings ? 0 : -1; }
  int head_group() const { return part_.head ? static_cast<int>(groups_.size()) - 1 : -1; }
  const ModelConfig& model() const { return model_; }
  int tp() const { return tp_; }
  int tp_rank() const { return tp_rank_; }
  int64_t size() const { return size_; }  // floats in the arena
  const std::vector<Tensor>& tensors() const { return tensors_; }
  const std::vector<Group>& groups() const { return groups_; }
  const Tensor& find(const std::string& name) const;  // throws InvalidArgument naming it
  const Tensor* find_if(const std::string& name) const;  // null where this part does not hold it

  // The rank's part of a whole tensor (whole: rows x cols, row-major) written to `local`.
  void shard(const Tensor& t, std::span<const float> whole, std::span<float> local) const;
  // The inverse, for the parts this rank holds (the rest of `whole` is left alone).
  void unshard(const Tensor& t, std::span<const float> local, std::span<float> whole) const;
  // The tensor holding arena element `offset` (null for group padding) and the index in the whole
  // tensor of the tensor's local element `local`.
  const Tensor* tensor_at(int64_t offset) const;
  int64_t whole_index(const Tensor& t, int64_t local) const;
  // The arena ranges (offset, length) whose optimizer state a rank keeps, in the order it stores
  // them: the whole arena without ZeRO, its dp shard of every group with.
  std::vector<std::pair<int64_t, int64_t>> optimizer_ranges(int zero, int dp_rank) const;

 private:
  ModelConfig model_;
  ModelPart part_;
  int tp_, tp_rank_;
  int64_t size_ = 0;
  std::vector<Tensor> tensors_;
  std::vector<Group> groups_;
};

// Pointers into an arena laid out by a ParamLayout (parameters, gradients, or optimizer moments);
// null for what the part does not hold (layers has an entry for every layer of the model).
struct LayerView {
  float *ln1_w{}, *ln1_b{}, *qkv_w{}, *qkv_b{}, *proj_w{}, *proj_b{}, *ln2_w{}, *ln2_b{}, *fc_w{}, *fc_b{}, *fcproj_w{},
      *fcproj_b{};
  // Mixture of experts instead of fc/fcproj: the router and the rank's experts, in expert order.
  float* router{};
  std::vector<float*> expert_fc_w, expert_fc_b, expert_proj_w;
};
struct ParamView {
  float *wte{}, *wpe{};
  std::vector<LayerView> layers;
  float *lnf_w{}, *lnf_b{};
};
ParamView bind(const ParamLayout& layout, float* arena);

}  // namespace tutti::train
