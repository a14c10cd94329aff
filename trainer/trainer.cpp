#include "trainer/trainer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <deque>

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
  model_ = std::make_unique<Gpt>(model, lay, groups.at.tp_rank, groups.at.pp_rank, batch / lay.dp / lay.microbatches,
                                 ops, groups.tp, &groups.ep);
  model_->init(seed);
  if (lay.pipelined()) {
    schedule_ = make_schedule(lay.schedule, lay.pp, lay.microbatches, lay.vp);
    schedule_report_ = check_schedule(schedule_);  // refused before any step if it could deadlock
  }
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
  wait_pending_quietly();
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
bool Trainer::counts_for_norm(int g) const {
  return !(groups_.layout.pp > 1 && groups_.at.pp_rank == groups_.layout.pp - 1 &&
           g == model_->layout().embedding_group());
}

double Trainer::grad_norm() {
  const ParamLayout& pl = model_->layout();
  const float* grads = model_->grads();
  const bool whole_here = groups_.at.tp_rank == 0;
  double local = 0, experts = 0;
  for (int gi = 0; gi < static_cast<int>(pl.groups().size()); ++gi) {
    if (!counts_for_norm(gi)) continue;
    const Group& g = pl.groups()[static_cast<size_t>(gi)];
    int64_t lo = g.offset, hi = g.offset + g.size;
    if (zero()) lo = g.offset + groups_.at.dp_rank * g.shard(), hi = lo + g.shard();
    const int64_t split = std::clamp(g.offset + g.replicated, lo, hi);  // whole tensors come first
    double& sum = g.expert ? experts : local;
    if (whole_here) sum += ops_.sum_squares(grads + lo, split - lo);
    sum += ops_.sum_squares(grads + split, hi - split);
  }
  // The ep ranks hold different experts.
  local += groups_.ep.all_reduce_value(experts);
  double total = groups_.tp.all_reduce_value(local);
  if (zero()) total = groups_.dp.all_reduce_value(total);
  return std::sqrt(groups_.pp.all_reduce_value(total));
}

// Waits for the reductions in flight, whatever their outcome: a failed one's error was reported
// where it happened (by the step that launched it).
void Trainer::wait_pending_quietly() {
  for (tutti::Work& w : pending_) {
    try {
      w.wait();
    } catch (...) {
    }
  }
}

void Trainer::clear_pending() {
  pending_.clear();
  pending_group_.clear();
  retired_.clear();
}

double Trainer::comm_seconds() const {
  return groups_.tp.wait_seconds() + groups_.dp.wait_seconds() + groups_.ep.wait_seconds() +
         groups_.edp.wait_seconds() + groups_.pp.wait_seconds() + groups_.embedding.wait_seconds() +
         groups_.pipe.wait_seconds;
}

// ZeRO-2/3 keep only their shards of the gradients: the rest of a group goes once it is reduced.
void Trainer::retire_reductions(bool block) {
  const Layout& lay = groups_.layout;
  const auto& gs = model_->layout().groups();
  float* grads = model_->grads();
  const int d = groups_.at.dp_rank;
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (retired_[i]) continue;
    if (block) groups_.dp.wait(pending_[i]);
    else if (!pending_[i].test()) continue;
    retired_[i] = true;
    if (lay.zero >= 2) {
      const Group& g = gs[static_cast<size_t>(pending_group_[i])];
      ops_.discard(grads + g.offset, d * g.shard());
      ops_.discard(grads + g.offset + (d + 1) * g.shard(), (lay.dp - d - 1) * g.shard());
    }
  }
}

// Group g's gradients are complete on this rank: their reduction over the data-parallel ranks starts.
void Trainer::reduce_group(int g) {
  const Layout& lay = groups_.layout;
  const Group& gr = model_->layout().groups()[static_cast<size_t>(g)];
  float* grads = model_->grads();
  const int d = groups_.at.dp_rank;
  if (gr.expert && lay.ep > 1) {
    // Each expert's gradient holds the tokens of its ep group's ranks: summed over the ranks
    // holding the same experts and divided by dp, it is the mean over the global batch.
    ops_.scale(grads + gr.offset, 1.0f / static_cast<float>(lay.dp), gr.size);
    if (lay.dp > lay.ep) {
      pending_.push_back(groups_.edp.all_reduce_async(grads + gr.offset, gr.size, RedOp::kSum));
      pending_group_.push_back(g);
      retired_.push_back(false);
    }
    return;
  }
  if (lay.dp > 1) {
    if (!fused_.empty())  // the mean over dp as the reduction's scale (exact for powers of two)
      pending_.push_back(fused_[static_cast<size_t>(g)]->reduce(grads + gr.offset, 1.0f / static_cast<float>(lay.dp)));
    else
      pending_.push_back(zero() ? groups_.dp.reduce_scatter_async(grads + gr.offset, grads + gr.offset + d * gr.shard(),
                                                                  gr.shard(), RedOp::kAvg)
                                : groups_.dp.all_reduce_async(grads + gr.offset, gr.size, RedOp::kAvg));
    pending_group_.push_back(g);
    retired_.push_back(false);
    retire_reductions(false);
  }
}

// The model's hooks for one step: each group reduced once complete; ZeRO-3 gathers a group's
// parameters before use and drops them after.
GroupHooks Trainer::step_hooks() {
  GroupHooks hooks;
  hooks.grads_ready = [this](int g) { reduce_group(g); };
  if (groups_.layout.zero == 3) {
    hooks.need = [this](int g) { gather_group(g); };
    hooks.done_with = [this](int g) {
      const auto& gs = model_->layout().groups();
      if (g == 0 || g == static_cast<int>(gs.size()) - 1) return;  // the embeddings and final LayerNorm serve both ends
      ops_.discard(model_->params() + gs[static_cast<size_t>(g)].offset, gs[static_cast<size_t>(g)].size);
      resident_[static_cast<size_t>(g)] = false;
    };
  }
  return hooks;
}

// Forward and backward over this rank's micro-batches; each group's gradients go to reduce_group()
// as they are complete. Sets the loss and the pipeline's measurements.
void Trainer::forward_backward(const int32_t* sequences, const GroupHooks& hooks, StepResult& out) {
  const Layout& lay = groups_.layout;
  const ParamLayout& pl = model_->layout();
  const auto& gs = pl.groups();
  float* grads = model_->grads();
  if (lay.zero >= 2) ops_.discard(grads, pl.size());
  else model_->zero_grads();
  if (!lay.pipelined()) {
    out.loss = model_->forward(sequences, &hooks);
    model_->backward(&hooks);
    return;
  }
  const double pipe0 = groups_.pipe.wait_seconds;
  out.loss = run_schedule(sequences);
  // Every group's gradients are complete: hand them over, the last layer's first (as backward does).
  const int G = static_cast<int>(gs.size());
  for (int g = G - 1; g >= 0; --g) {
    model_->reduce_replicated(g);
    if (lay.pp > 1 && g == pl.embedding_group()) groups_.embedding.all_reduce(grads + gs[static_cast<size_t>(g)].offset, gs[static_cast<size_t>(g)].size);
    hooks.grads_ready(g);
  }
  out.pipeline_wait_s = groups_.pipe.wait_seconds - pipe0;
  out.activation_slots = model_->slots_made();
}

// The fused step's norm: the reductions summed the squares of each chunk as it arrived.
double Trainer::fused_grad_norm() {
  double local = 0;
  for (size_t g = 0; g < fused_.size(); ++g)
    if (counts_for_norm(static_cast<int>(g))) local += fused_[g]->local_sum_squares();
  return std::sqrt(groups_.pp.all_reduce_value(groups_.dp.all_reduce_value(local)));
}

// ZeRO-1/2's fused AdamW: each group's owned shard updated and all-gathered into the parameters.
void Trainer::fused_update(float lr, float clip) {
  const auto& gs = model_->layout().groups();
  float* grads = model_->grads();
  tutti::fused::AdamW opt;
  opt.lr = lr;
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
}

// AdamW over the parameters this rank updates, tensor by tensor (weight decay is per tensor).
void Trainer::adamw_update(float lr, float clip) {
  const ParamLayout& pl = model_->layout();
  const auto& gs = pl.groups();
  const float* grads = model_->grads();
  const int d = groups_.at.dp_rank;
  for (const Tensor& t : pl.tensors()) {
    const Group& g = gs[static_cast<size_t>(t.group)];
    int64_t lo = t.offset, hi = t.offset + t.size();
    if (zero()) lo = std::max(lo, g.offset + d * g.shard()), hi = std::min(hi, g.offset + (d + 1) * g.shard());
    if (hi <= lo) continue;
    const int64_t at = zero() ? shard_start_[static_cast<size_t>(t.group)] + (lo - g.offset - d * g.shard()) : lo;
    float* p = zero() ? master_ + at : model_->params() + at;
    ops_.adamw(p, grads + lo, m_ + at, v_ + at, hi - lo, lr, optim_.beta1, optim_.beta2, optim_.eps,
               t.decay ? optim_.weight_decay : 0.0f, step_, clip);
  }
}

StepResult Trainer::step(const int32_t* sequences) {
  const Layout& lay = groups_.layout;
  // A step that failed may have left reductions in flight: they finish (or fail) before anything
  // else touches the gradients.
  wait_pending_quietly();
  clear_pending();
  const double wait0 = comm_seconds();
  const GroupHooks hooks = step_hooks();

  StepResult out;
  forward_backward(sequences, hooks, out);
  retire_reductions(true);
  clear_pending();
  out.loss = mean_over_dp(out.loss);
  if (lay.pp > 1) out.loss = groups_.pp.all_reduce_value(out.loss);  // only the last stage's is not 0
  out.grad_norm = !fused_.empty() && lay.tp == 1 ? fused_grad_norm() : grad_norm();
  const float clip =
      optim_.grad_clip > 0 ? std::min(1.0f, optim_.grad_clip / static_cast<float>(out.grad_norm + 1e-6)) : 1.0f;
  out.lr = optim_.lr_at(step_);
  ++step_;

  if (!fused_.empty()) {
    fused_update(out.lr, clip);
  } else {
    adamw_update(out.lr, clip);
    publish_params();
  }
  out.comm_wait_s = comm_seconds() - wait0;
  return out;
}

double Trainer::run_schedule(const int32_t* sequences) {
  const Layout& lay = groups_.layout;
  Gpt& m = *model_;
  const int r = groups_.at.pp_rank;
  const int64_t stride = static_cast<int64_t>(m.batch()) * (model_config_.seq + 1);  // a micro-batch's tokens
  const int64_t n = m.boundary_size();
  std::vector<int> slot(static_cast<size_t>(lay.microbatches * lay.vp), -1);
  // Sends in flight with the host copies they read; checked off as they finish.
  std::deque<std::pair<tutti::Work, std::vector<float>>> sending;
  std::vector<float> host(static_cast<size_t>(n));
  double loss = 0;
  for (const PipeAction& a : schedule_.ranks[static_cast<size_t>(r)]) {
    int& s = slot[static_cast<size_t>(a.microbatch * lay.vp + a.chunk)];
    if (s < 0 && (a.op == PipeOp::kForward || a.op == PipeOp::kRecvActivation)) s = m.acquire_slot();
    const int peer = schedule_.peer_of(r, a);
    switch (a.op) {
      case PipeOp::kRecvActivation:
        groups_.pipe.recv(host.data(), n, peer);
        ops_.upload(m.stage_input(s), host.data(), n);
        break;
      case PipeOp::kRecvGrad:
        groups_.pipe.recv(host.data(), n, peer);
        ops_.upload(m.output_grad(s), host.data(), n);
        break;
      case PipeOp::kSendActivation:
      case PipeOp::kSendGrad: {
        while (!sending.empty() && sending.front().first.test()) sending.pop_front();
        std::vector<float> copy(static_cast<size_t>(n));
        ops_.download(copy.data(), a.op == PipeOp::kSendActivation ? m.stage_output(s) : m.input_grad(s), n);
        sending.emplace_back(tutti::Work{}, std::move(copy));
        sending.back().first = groups_.pipe.send(sending.back().second.data(), n, peer);
        if (a.op == PipeOp::kSendGrad && !schedule_.split_backward) m.release_slot(s), s = -1;
        break;
      }
      case PipeOp::kForward:
        loss += m.forward_chunk(a.chunk, s, sequences + a.microbatch * stride);
        break;
      case PipeOp::kBackward:
        m.backward_chunk(a.chunk, s, false, false);
        if (m.first_stage(a.chunk)) m.release_slot(s), s = -1;  // elsewhere once its input gradient is sent
        break;
      case PipeOp::kBackwardInput:
        m.backward_chunk(a.chunk, s, true, false);
        break;
      case PipeOp::kBackwardWeight:
        m.backward_weights(a.chunk, s);
        m.release_slot(s), s = -1;
        break;
    }
  }
  for (auto& [work, buffer] : sending) groups_.pipe.wait(work);
  return loss / lay.microbatches;
}

// Forward only (evaluation): each micro-batch through the stages in order.
double Trainer::forward_only(const int32_t* sequences) {
  const Layout& lay = groups_.layout;
  Gpt& m = *model_;
  const int r = groups_.at.pp_rank;
  const int64_t stride = static_cast<int64_t>(m.batch()) * (model_config_.seq + 1);
  const int64_t n = m.boundary_size();
  std::vector<float> in(static_cast<size_t>(n)), out(static_cast<size_t>(n));
  double loss = 0;
  for (int mb = 0; mb < lay.microbatches; ++mb)
    for (int c = 0; c < lay.vp; ++c) {
      const int stage = c * lay.pp + r, stages = lay.pp * lay.vp;
      const int s = m.acquire_slot();
      if (stage > 0) {
        groups_.pipe.recv(in.data(), n, (stage - 1) % lay.pp);
        ops_.upload(m.stage_input(s), in.data(), n);
      }
      loss += m.forward_chunk(c, s, sequences + mb * stride);
      if (stage + 1 < stages) {
        ops_.download(out.data(), m.stage_output(s), n);
        tutti::Work w = groups_.pipe.send(out.data(), n, (stage + 1) % lay.pp);
        groups_.pipe.wait(w);
      }
      m.release_slot(s);
    }
  return loss / lay.microbatches;
}

double Trainer::evaluate(const int32_t* sequences) {
  if (groups_.layout.pipelined()) {
    const double loss = mean_over_dp(forward_only(sequences));
    return groups_.layout.pp > 1 ? groups_.pp.all_reduce_value(loss) : loss;
  }
  GroupHooks hooks;
  if (groups_.layout.zero == 3) hooks.need = [&](int g) { gather_group(g); };
  return mean_over_dp(model_->forward(sequences, &hooks));
}

}  // namespace tutti::train
