#include "trainer/config.hpp"

#include <fmt/format.h>

#include <cmath>

#include "tutti/types.hpp"

namespace tutti::train {

void ModelConfig::validate() const {
  auto positive = [](const char* what, int v) {
    if (v < 1) throw InvalidArgument(fmt::format("model: {} must be at least 1, not {}", what, v));
  };
  positive("vocab", vocab);
  positive("seq", seq);
  positive("layers", layers);
  positive("heads", heads);
  positive("channels", channels);
  if (channels % heads != 0)
    throw InvalidArgument(fmt::format("model: {} channels do not split into {} heads", channels, heads));
  if (experts < 0) throw InvalidArgument(fmt::format("model: --experts {} must be 0 (dense) or more", experts));
  if (experts > 0) {
    if (top_k < 1 || top_k > 2 || top_k > experts)
      throw InvalidArgument(fmt::format("model: --top-k {} must be 1 or 2 and at most --experts {}", top_k, experts));
    if (!(capacity == 0 || capacity > 0))
      throw InvalidArgument(fmt::format("model: --capacity {} must be 0 (dropless) or positive", capacity));
    if (!(aux_loss >= 0)) throw InvalidArgument(fmt::format("model: --aux-loss {} must be 0 or more", aux_loss));
    if (moe_group < 0) throw InvalidArgument(fmt::format("model: --moe-group {} must be 0 or more", moe_group));
  }
}

std::string ModelConfig::describe() const {
  std::string s = fmt::format("L{} C{} NH{} T{} V{}", layers, channels, heads, seq, vocab);
  if (experts > 0) s += fmt::format(" E{} top{} {}", experts, top_k, capacity > 0 ? fmt::format("cap{}", capacity) : "dropless");
  return s;
}

int64_t ModelConfig::parameters() const {
  const int64_t V = vocab, T = seq, C = channels, L = layers;
  const int64_t mlp = 4 * C * C + 4 * C + 4 * C * C + C;  // fc, its bias, proj, its bias
  const int64_t expert = 4 * C * C + 4 * C + 4 * C * C;    // the same without proj's bias
  const int64_t ffn = experts > 0 ? experts * expert + experts * C : mlp;  // experts and their router
  const int64_t per_layer = 2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C + ffn;
  return V * C + T * C + L * per_layer + 2 * C;
}

double ModelConfig::flops_per_token() const {
  // A token runs through k of the experts: the others' parameters do no work for it.
  const double C = channels, idle = experts > 0 ? static_cast<double>(experts - top_k) * (8 * C * C + 4 * C) * layers : 0;
  return 6.0 * (static_cast<double>(parameters()) - idle) + 12.0 * layers * channels * static_cast<double>(seq);
}

std::string Layout::describe() const {
  std::string s = fmt::format("tp{} dp{}", tp, dp);
  if (sp) s += " sp";
  if (ep > 1) s += fmt::format(" ep{}", ep);
  if (zero) s += fmt::format(" zero{}", zero);
  if (pipelined()) {
    s += fmt::format(" pp{} {}", pp, to_string(schedule));
    if (vp > 1) s += fmt::format(" vp{}", vp);
    s += fmt::format(" m{}", microbatches);
  }
  return s;
}

void Layout::validate(const ModelConfig& m, int world, int batch) const {
  m.validate();
  if (tp < 1 || dp < 1 || pp < 1)
    throw InvalidArgument(fmt::format("layout: --tp {}, --dp {} and --pp {} must be at least 1", tp, dp, pp));
  if (tp * dp * pp != world)
    throw InvalidArgument(
        fmt::format("layout: {} ranks, but --tp {} x --dp {} x --pp {} = {}", world, tp, dp, pp, tp * dp * pp));
  if (m.heads % tp != 0) throw InvalidArgument(fmt::format("layout: --tp {} does not divide {} heads", tp, m.heads));
  if (m.vocab % tp != 0)
    throw InvalidArgument(fmt::format("layout: --tp {} does not divide the vocabulary of {} tokens", tp, m.vocab));
  if (sp && tp == 1) throw InvalidArgument("layout: --sp needs --tp of 2 or more");
  if (sp && m.seq % tp != 0)
    throw InvalidArgument(fmt::format("layout: --sp: --tp {} does not divide the sequence length {}", tp, m.seq));
  if (zero < 0 || zero > 3) throw InvalidArgument(fmt::format("layout: --zero {} is not 0, 1, 2 or 3", zero));
  if (zero > 0 && dp == 1) throw InvalidArgument(fmt::format("layout: --zero {} needs --dp of 2 or more", zero));
  if (batch < 1 || batch % dp != 0)
    throw InvalidArgument(fmt::format("layout: the batch of {} sequences does not split over --dp {}", batch, dp));
  if (microbatches < 1 || (batch / dp) % microbatches != 0)
    throw InvalidArgument(fmt::format("layout: a dp rank's {} sequences do not split into --microbatches {}", batch / dp,
                                      microbatches));
  if (vp < 1 || m.layers % (pp * vp) != 0)
    throw InvalidArgument(
        fmt::format("layout: {} layers do not split into --pp {} x --vp {} stages", m.layers, pp, vp));
  if (pipelined()) make_schedule(schedule, pp, microbatches, vp);  // its own rules (interleaved: vp, micro-batches)
  if (ep < 1 || dp % ep != 0)
    throw InvalidArgument(fmt::format("layout: --ep {} must divide --dp {} (expert parallelism splits the dp ranks)", ep, dp));
  if (ep > 1 && m.experts == 0) throw InvalidArgument(fmt::format("layout: --ep {} needs --experts", ep));
  if (m.experts > 0 && m.experts % ep != 0)
    throw InvalidArgument(fmt::format("layout: --ep {} does not divide --experts {}", ep, m.experts));
  if (ep > 1 && zero > 0)
    throw InvalidArgument(fmt::format("layout: --zero {} with --ep {} is not supported (expert shards would need the "
                                      "expert-data-parallel group's ZeRO); use --zero 0",
                                      zero, ep));
  const int forward_batch = batch / dp / std::max(1, microbatches);
  if (m.experts > 0 && m.moe_group > 0 && forward_batch % m.moe_group != 0)
    throw InvalidArgument(fmt::format("layout: a forward's {} sequences do not split into routing groups of --moe-group {}",
                                      forward_batch, m.moe_group));
  if (pipelined() && zero == 3)
    throw InvalidArgument("layout: --zero 3 with a pipeline (--pp or --microbatches) is not supported; use --zero 1 or 2");
}

float OptimConfig::lr_at(int step) const {
  if (warmup > 0 && step < warmup) return lr * static_cast<float>(step + 1) / static_cast<float>(warmup);
  if (steps <= warmup) return lr;
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / static_cast<double>(steps - warmup));
  return min_lr + static_cast<float>(0.5 * (1.0 + std::cos(M_PI * progress))) * (lr - min_lr);
}

}  // namespace tutti::train
