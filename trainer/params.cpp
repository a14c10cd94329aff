#include "trainer/params.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "tutti/types.hpp"

namespace tutti::train {

ModelPart ModelPart::whole(const ModelConfig& model) {
  ModelPart p;
  for (int l = 0; l < model.layers; ++l) p.layers.push_back(l);
  for (int e = 0; e < model.experts; ++e) p.experts.push_back(e);
  return p;
}

ModelPart part_of(const ModelConfig& model, const Layout& layout, int pp_rank, int ep_rank) {
  const int stages = layout.pp * layout.vp, per = model.layers / stages;
  ModelPart p;
  for (int c = 0; c < layout.vp; ++c)
    for (int l = 0; l < per; ++l) p.layers.push_back((c * layout.pp + pp_rank) * per + l);
  p.embeddings = pp_rank == 0 || pp_rank == layout.pp - 1;
  p.head = pp_rank == layout.pp - 1;
  const int per_rank = model.experts / layout.ep;
  for (int e = 0; e < per_rank; ++e) p.experts.push_back(ep_rank * per_rank + e);
  return p;
}

ParamLayout::ParamLayout(const ModelConfig& model, int tp, int tp_rank, int dp)
    : ParamLayout(model, tp, tp_rank, dp, ModelPart::whole(model)) {}

ParamLayout::ParamLayout(const ModelConfig& model, int tp, int tp_rank, int dp, ModelPart part)
    : model_(model), part_(std::move(part)), tp_(tp), tp_rank_(tp_rank) {
  model.validate();
  if (tp < 1 || tp_rank < 0 || tp_rank >= tp || dp < 1)
    throw InvalidArgument(fmt::format("parameter layout: tp rank {} of {}, dp {}", tp_rank, tp, dp));
  const int64_t V = model.vocab, T = model.seq, C = model.channels;
  int group = -1;
  std::vector<int> expert_groups;
  auto add = [&](std::string name, int64_t rows, int64_t cols, Split split) {
    Tensor t;
    t.name = std::move(name);
    t.rows = rows;
    t.cols = cols;
    t.split = split;
    t.group = group;
    t.decay = cols > 1;
    t.replicated = split == Split::kWhole;
    t.local_rows = split == Split::kRows || split == Split::kHeadRows ? rows / tp : rows;
    t.local_cols = split == Split::kColumns ? cols / tp : cols;
    tensors_.push_back(std::move(t));
  };
  if (part_.embeddings) {
    ++group;
    add("wpe", T, C, Split::kWhole);
    add("wte", V, C, Split::kRows);
  }
  for (int l : part_.layers) {
    if (l < 0 || l >= model.layers)
      throw InvalidArgument(fmt::format("parameter layout: layer {} of a model of {}", l, model.layers));
    ++group;
    const std::string h = fmt::format("h.{}.", l);
    add(h + "ln1.weight", C, 1, Split::kWhole);
    add(h + "ln1.bias", C, 1, Split::kWhole);
    add(h + "attn.proj.bias", C, 1, Split::kWhole);
    add(h + "ln2.weight", C, 1, Split::kWhole);
    add(h + "ln2.bias", C, 1, Split::kWhole);
    if (model.experts == 0) add(h + "mlp.proj.bias", C, 1, Split::kWhole);
    else add(h + "moe.router.weight", model.experts, C, Split::kWhole);
    add(h + "attn.qkv.weight", 3 * C, C, Split::kHeadRows);
    add(h + "attn.qkv.bias", 3 * C, 1, Split::kHeadRows);
    add(h + "attn.proj.weight", C, C, Split::kColumns);
    if (model.experts == 0) {
      add(h + "mlp.fc.weight", 4 * C, C, Split::kRows);
      add(h + "mlp.fc.bias", 4 * C, 1, Split::kRows);
      add(h + "mlp.proj.weight", C, 4 * C, Split::kColumns);
      continue;
    }
    // The rank's experts, a group of their own (reduced over the ranks holding the same experts).
    ++group;
    expert_groups.push_back(group);
    for (int e : part_.experts) {
      const std::string x = fmt::format("{}moe.expert.{}.", h, e);
      add(x + "fc.weight", 4 * C, C, Split::kRows);
      add(x + "fc.bias", 4 * C, 1, Split::kRows);
      add(x + "proj.weight", C, 4 * C, Split::kColumns);
    }
  }
  if (part_.head) {
    ++group;
    add("lnf.weight", C, 1, Split::kWhole);
    add("lnf.bias", C, 1, Split::kWhole);
  }
  // Groups: contiguous, each padded to a multiple of 16 * dp floats (equal dp shards, 64-byte
  // aligned starts).
  const int64_t quantum = 16 * static_cast<int64_t>(dp);
  groups_.assign(static_cast<size_t>(group + 1), Group{});
  int64_t at = 0;
  for (int g = 0; g <= group; ++g) {
    Group& gr = groups_[g];
    gr.offset = at;
    gr.dp = dp;
    gr.expert = std::find(expert_groups.begin(), expert_groups.end(), g) != expert_groups.end();
    for (Tensor& t : tensors_)
      if (t.group == g) {
        t.offset = at;
        at += t.size();
        if (t.replicated) gr.replicated = at - gr.offset;
      }
    at = (at + quantum - 1) / quantum * quantum;
    gr.size = at - gr.offset;
  }
  size_ = at;
}

const Tensor& ParamLayout::find(const std::string& name) const {
  if (const Tensor* t = find_if(name)) return *t;
  throw InvalidArgument(fmt::format("the model part has no parameter '{}'", name));
}

const Tensor* ParamLayout::find_if(const std::string& name) const {
  for (const Tensor& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

int ParamLayout::layer_group(int l) const {
  const auto it = std::find(part_.layers.begin(), part_.layers.end(), l);
  if (it == part_.layers.end()) return -1;
  const int per_layer = model_.experts > 0 ? 2 : 1;
  return static_cast<int>(it - part_.layers.begin()) * per_layer + (part_.embeddings ? 1 : 0);
}

int ParamLayout::expert_group(int l) const {
  const int g = layer_group(l);
  return g < 0 || model_.experts == 0 ? -1 : g + 1;
}


void ParamLayout::shard(const Tensor& t, std::span<const float> whole, std::span<float> local) const {
  if (static_cast<int64_t>(whole.size()) != t.rows * t.cols || static_cast<int64_t>(local.size()) != t.size())
    throw InvalidArgument(fmt::format("sharding '{}': {} whole and {} local values, expected {} and {}", t.name,
                                      whole.size(), local.size(), t.rows * t.cols, t.size()));
  for (int64_t l = 0; l < t.size(); ++l) local[l] = whole[whole_index(t, l)];
}

void ParamLayout::unshard(const Tensor& t, std::span<const float> local, std::span<float> whole) const {
  if (static_cast<int64_t>(whole.size()) != t.rows * t.cols || static_cast<int64_t>(local.size()) != t.size())
    throw InvalidArgument(fmt::format("unsharding '{}': {} whole and {} local values, expected {} and {}", t.name,
                                      whole.size(), local.size(), t.rows * t.cols, t.size()));
  for (int64_t l = 0; l < t.size(); ++l) whole[whole_index(t, l)] = local[l];
}

const Tensor* ParamLayout::tensor_at(int64_t offset) const {
  // Tensors are stored in arena order.
  auto it = std::upper_bound(tensors_.begin(), tensors_.end(), offset,
                             [](int64_t o, const Tensor& t) { return o < t.offset; });
  if (it == tensors_.begin()) return nullptr;
  const Tensor& t = *(it - 1);
  return offset < t.offset + t.size() ? &t : nullptr;
}

int64_t ParamLayout::whole_index(const Tensor& t, int64_t local) const {
  const int64_t r = local / t.local_cols, c = local % t.local_cols;
  int64_t whole_row = r;
  if (t.split == Split::kRows) whole_row = tp_rank_ * t.local_rows + r;
  if (t.split == Split::kHeadRows) {
    const int64_t block = t.rows / 3, per = block / tp_;
    whole_row = (r / per) * block + tp_rank_ * per + r % per;
  }
  const int64_t col0 = t.split == Split::kColumns ? tp_rank_ * t.local_cols : 0;
  return whole_row * t.cols + col0 + c;
}

std::vector<std::pair<int64_t, int64_t>> ParamLayout::optimizer_ranges(int zero, int dp_rank) const {
  if (zero == 0) return {{0, size_}};
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const Group& g : groups_) out.emplace_back(g.offset + dp_rank * g.shard(), g.shard());
  return out;
}

ParamView bind(const ParamLayout& layout, float* arena) {
  auto at = [&](const std::string& name) -> float* {
    const Tensor* t = layout.find_if(name);
    return t ? arena + t->offset : nullptr;
  };
  ParamView v;
  v.wte = at("wte");
  v.wpe = at("wpe");
  v.layers.resize(static_cast<size_t>(layout.model().layers));
  for (int l : layout.part().layers) {
    const std::string h = fmt::format("h.{}.", l);
    LayerView& lv = v.layers[static_cast<size_t>(l)];
    lv.ln1_w = at(h + "ln1.weight");
    lv.ln1_b = at(h + "ln1.bias");
    lv.qkv_w = at(h + "attn.qkv.weight");
    lv.qkv_b = at(h + "attn.qkv.bias");
    lv.proj_w = at(h + "attn.proj.weight");
    lv.proj_b = at(h + "attn.proj.bias");
    lv.ln2_w = at(h + "ln2.weight");
    lv.ln2_b = at(h + "ln2.bias");
    lv.fc_w = at(h + "mlp.fc.weight");
    lv.fc_b = at(h + "mlp.fc.bias");
    lv.fcproj_w = at(h + "mlp.proj.weight");
    lv.fcproj_b = at(h + "mlp.proj.bias");
    lv.router = at(h + "moe.router.weight");
    for (int e : layout.part().experts) {
      const std::string x = fmt::format("{}moe.expert.{}.", h, e);
      lv.expert_fc_w.push_back(at(x + "fc.weight"));
      lv.expert_fc_b.push_back(at(x + "fc.bias"));
      lv.expert_proj_w.push_back(at(x + "proj.weight"));
    }
  }
  v.lnf_w = at("lnf.weight");
  v.lnf_b = at("lnf.bias");
  return v;
}

}  // namespace tutti::train
