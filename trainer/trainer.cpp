#include "trainer/trainer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace tutti::train {

Trainer::Trainer(const ModelConfig& model, const OptimConfig& optim, Groups& groups, Ops& ops, int batch,
                 uint64_t seed)
    : model_config_(model), optim_(optim), groups_(groups), ops_(ops), batch_(batch) {
  const Layout& lay = groups.layout;
  lay.validate(model, lay.world(), batch);
  // The C++ API's collectives take host buffers: a device's go through host copies.
  if (std::string(ops.name()) != "cpu") {
    groups.tp.stage_through_host(&ops);
    groups.dp.stage_through_host(&ops);
  }
  model_ = std::make_unique<Gpt>(model, lay, groups.at.tp_rank, batch / lay.dp, ops, groups.tp);
  model_->init(seed);
  const auto& gs = model_->layout().groups();
  if (zero()) {
    for (const Group& g : gs) {
      shard_start_.push_back(opt_size_);
      opt_size_ += g.shard();
    }
    master_ = ops_.alloc(opt_size_);
    for (size_t g = 0; g < gs.size(); ++g)
      ops_.copy(master_ + shard_start_[g], model_->params() + gs[g].offset + groups.at.dp_rank * gs[g].shard(),
                gs[g].shard());
  } else {
    opt_size_ = model_->layout().size();
  }
  m_ = ops_.alloc(opt_size_);
  v_ = ops_.alloc(opt_size_);
  // ZeRO-1/2 with host buffers run the fused step (ZeRO-3 gathers groups as the model uses them).
  if (zero() && lay.zero <= 2 && groups.dp.comm() && std::string(ops.name()) == "cpu") {
    const int d = groups.at.dp_rank;
    for (const Group& g : gs) {
      fused_.push_back(std::make_unique<tutti::fused::ZeroStep>(*groups.dp.comm(), g.shard()));
      std::vector<float> decay(static_cast<size_t>(g.shard()), 0.0f);
      const int64_t lo = g.offset + d * g.shard(), hi = lo + g.shard();
      for (const Tensor& t : model_->layout().tensors())
        if (t.decay)
          for (int64_t i = std::max(lo, t.offset); i < std::min(hi, t.offset + t.size()); ++i)
            decay[static_cast<size_t>(i - lo)] = 1.0f;
      decay_.push_back(std::move(decay));
    }
  }
  resident_.assign(gs.size(), true);
  if (lay.zero == 3)
    for (size_t g = 0; g < gs.size(); ++g) {
      ops_.discard(model_->params() + gs[g].offset, gs[g].size);
      resident_[g] = false;
    }
}

Trainer::~Trainer() {
  for (tutti::Work& w : pending_) {
    try {
      w.wait();
    } catch (...) {  // the communicator's error was reported where it happened
    }
  }
  ops_.release(m_);
  ops_.release(v_);
  if (master_) ops_.release(master_);
}

int64_t Trainer::arena_offset(int64_t i) const {
  if (!zero()) return i;
  const auto& gs = model_->layout().groups();
  const auto it = std::upper_bound(shard_start_.begin(), shard_start_.end(), i);
  const size_t g = static_cast<size_t>(it - shard_start_.begin()) - 1;
  return gs[g].offset + groups_.at.dp_rank * gs[g].shard() + (i - shard_start_[g]);
}

double Trainer::mean_over_dp(double v) { return groups_.dp.all_reduce_value(v) / groups_.layout.dp; }

// ZeRO-3: the group's parameters from every dp rank's shard.
void Trainer::gather_group(int g) {
  if (resident_[static_cast<size_t>(g)]) return;
  const Group& gr = model_->layout().groups()[static_cast<size_t>(g)];
  groups_.dp.all_gather(master_ + shard_start_[static_cast<size_t>(g)], model_->params() + gr.offset, gr.shard());
  resident_[static_cast<size_t>(g)] = true;
}

void Trainer::publish_params() {
  const auto& gs = model_->layout().groups();
  if (!zero()) return;
  if (groups_.layout.zero == 3) {
    for (size_t g = 0; g < gs.size(); ++g) {
      ops_.discard(model_->params() + gs[g].offset, gs[g].size);
      resident_[g] = false;
    }
    return;
  }
  std::vector<tutti::Work> works;
  for (size_t g = 0; g < gs.size(); ++g)
    works.push_back(
        groups_.dp.all_gather_async(master_ + shard_start_[g], model_->params() + gs[g].offset, gs[g].shard()));
  for (tutti::Work& w : works) groups_.dp.wait(w);
}

void Trainer::params_changed() {
  if (!zero()) return;
  const auto& gs = model_->layout().groups();
  for (size_t g = 0; g < gs.size(); ++g)
    ops_.copy(master_ + shard_start_[g], model_->params() + gs[g].offset + groups_.at.dp_rank * gs[g].shard(),
              gs[g].shard());
  publish_params();
}

void Trainer::gather_all() {
  if (groups_.layout.zero != 3) return;
  for (size_t g = 0; g < resident_.size(); ++g) gather_group(static_cast<int>(g));
}

// The global norm of the gradients: every element counted once over the world (tp shards are
// disjoint, whole tensors are counted on tp rank 0, ZeRO's dp shards are disjoint).
double Trainer::grad_norm() {
  const ParamLayout& pl = model_->layout();
  const float* grads = model_->grads();
  const bool whole_here = groups_.at.tp_rank == 0;
  double local = 0;
  for (const Group& g : pl.groups()) {
    int64_t lo = g.offset, hi = g.offset + g.size;
    if (zero()) lo = g.offset + groups_.at.dp_rank * g.shard(), hi = lo + g.shard();
    const int64_t split = std::clamp(g.offset + g.replicated, lo, hi);  // whole tensors come first
    if (whole_here) local += ops_.sum_squares(grads + lo, split - lo);
    local += ops_.sum_squares(grads + split, hi - split);
  }
  double total = groups_.tp.all_reduce_value(local);
  if (zero()) total = groups_.dp.all_reduce_value(total);
  return std::sqrt(total);
}

StepResult Trainer::step(const int32_t* sequences) {
  const Layout& lay = groups_.layout;
  // A step that failed may have left reductions in flight: they finish (or fail) before anything
  // else touches the gradients.
  for (tutti::Work& w : pending_) {
    try {
      w.wait();
    } catch (...) {  // reported by the step that launched it
    }
  }
  pending_.clear();
  pending_group_.clear();
  const double wait0 = groups_.tp.wait_seconds() + groups_.dp.wait_seconds();
  const ParamLayout& pl = model_->layout();
  const auto& gs = pl.groups();
  float* grads = model_->grads();
  const int d = groups_.at.dp_rank;
  // ZeRO-2/3 keep only their shards of the gradients: the rest of a group goes once it is reduced.
  std::vector<bool> retired;
  auto retire_done = [&](bool block) {
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (retired[i]) continue;
      if (block) groups_.dp.wait(pending_[i]);
      else if (!pending_[i].test()) continue;
      retired[i] = true;
      if (lay.zero >= 2) {
        const Group& g = gs[static_cast<size_t>(pending_group_[i])];
        ops_.discard(grads + g.offset, d * g.shard());
        ops_.discard(grads + g.offset + (d + 1) * g.shard(), (lay.dp - d - 1) * g.shard());
      }
    }
  };
  GroupHooks hooks;
  hooks.grads_ready = [&](int g) {
    const Group& gr = gs[static_cast<size_t>(g)];
    if (lay.dp > 1) {
      if (!fused_.empty())  // the mean over dp as the reduction's scale (exact for powers of two)
        pending_.push_back(fused_[static_cast<size_t>(g)]->reduce(grads + gr.offset, 1.0f / static_cast<float>(lay.dp)));
      else
        pending_.push_back(zero() ? groups_.dp.reduce_scatter_async(grads + gr.offset, grads + gr.offset + d * gr.shard(),
                                                                    gr.shard(), RedOp::kAvg)
                                  : groups_.dp.all_reduce_async(grads + gr.offset, gr.size, RedOp::kAvg));
      pending_group_.push_back(g);
      retired.push_back(false);
      retire_done(false);
    }
  };
  if (lay.zero == 3) {
    hooks.need = [&](int g) { gather_group(g); };
    hooks.done_with = [&](int g) {
      if (g == 0 || g == static_cast<int>(gs.size()) - 1) return;  // the embeddings and final LayerNorm serve both ends
      ops_.discard(model_->params() + gs[static_cast<size_t>(g)].offset, gs[static_cast<size_t>(g)].size);
      resident_[static_cast<size_t>(g)] = false;
    };
  }

  if (lay.zero >= 2) ops_.discard(grads, pl.size());
  else model_->zero_grads();
  StepResult out;
  out.loss = model_->forward(sequences, &hooks);
  model_->backward(&hooks);
  retire_done(true);
  pending_.clear();
  pending_group_.clear();
  out.loss = mean_over_dp(out.loss);
  if (!fused_.empty() && lay.tp == 1) {
    // The reductions summed the squares of each chunk as it arrived.
    double local = 0;
    for (const auto& z : fused_) local += z->local_sum_squares();
    out.grad_norm = std::sqrt(groups_.dp.all_reduce_value(local));
  } else {
    out.grad_norm = grad_norm();
  }
  const float clip =
      optim_.grad_clip > 0 ? std::min(1.0f, optim_.grad_clip / static_cast<float>(out.grad_norm + 1e-6)) : 1.0f;
  out.lr = optim_.lr_at(step_);
  ++step_;

  if (!fused_.empty()) {
    tutti::fused::AdamW opt;
    opt.lr = out.lr;
    opt.beta1 = optim_.beta1;
    opt.beta2 = optim_.beta2;
    opt.eps = optim_.eps;
    opt.weight_decay = optim_.weight_decay;
    opt.step = step_;
    std::vector<tutti::Work> works;
    for (size_t g = 0; g < gs.size(); ++g)
      works.push_back(fused_[g]->update(grads + gs[g].offset, master_ + shard_start_[g], m_ + shard_start_[g],
                                        v_ + shard_start_[g], model_->params() + gs[g].offset, decay_[g].data(), opt,
                                        clip));
    // Every update finishes before the step returns or throws: a failed one must not leave the
    // others running on the optimizer's memory.
    std::exception_ptr first;
    for (tutti::Work& w : works) {
      try {
        groups_.dp.wait(w);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
    out.comm_wait_s = groups_.tp.wait_seconds() + groups_.dp.wait_seconds() - wait0;
    return out;
  }
  // AdamW over the parameters this rank updates, tensor by tensor (weight decay is per tensor).
  for (const Tensor& t : pl.tensors()) {
    const Group& g = gs[static_cast<size_t>(t.group)];
    int64_t lo = t.offset, hi = t.offset + t.size();
    if (zero()) lo = std::max(lo, g.offset + d * g.shard()), hi = std::min(hi, g.offset + (d + 1) * g.shard());
    if (hi <= lo) continue;
    const int64_t at = zero() ? shard_start_[static_cast<size_t>(t.group)] + (lo - g.offset - d * g.shard()) : lo;
    float* p = zero() ? master_ + at : model_->params() + at;
    ops_.adamw(p, grads + lo, m_ + at, v_ + at, hi - lo, out.lr, optim_.beta1, optim_.beta2, optim_.eps,
               t.decay ? optim_.weight_decay : 0.0f, step_, clip);
  }
  publish_params();
  out.comm_wait_s = groups_.tp.wait_seconds() + groups_.dp.wait_seconds() - wait0;
  return out;
}

double Trainer::evaluate(const int32_t* sequences) {
  GroupHooks hooks;
  if (groups_.layout.zero == 3) hooks.need = [&](int g) { gather_group(g); };
  return mean_over_dp(model_->forward(sequences, &hooks));
}

}  // namespace tutti::train
