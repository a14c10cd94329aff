#pragma once
// One rank's training loop around a Gpt: data-parallel gradient reduction, ZeRO, AdamW with
// global-norm clipping and the learning-rate schedule.
//
// Data parallel: as backward completes a parameter group (trainer/params.hpp: the final LayerNorm,
// then the layers in reverse, the embeddings last) its gradients go to the dp group at once,
// asynchronously, while backward goes on with the next group; the step waits for them all before
// the optimizer. Without ZeRO each group is all-reduced (averaged) and every rank updates every
// parameter. ZeRO shards each group over the dp ranks (rank d owns shard d):
//   1: gradients are reduce-scattered (averaged), AdamW updates the owned shards (moments only for
//      them), and the updated shards are all-gathered into every rank's parameters;
//   2: as 1, and the gradients of shards a rank does not own are discarded as soon as they are
//      reduced (Ops::discard);
//   3: as 2, and parameters too live only as owned shards: a group is all-gathered before forward
//      or backward reads it and discarded after.
// Pipeline parallel (layout.pp > 1, or micro-batches): the step runs this rank's list of the
// layout's schedule (trainer/schedule.hpp), checked when the trainer is made; activations and their
// gradients travel between stages through host buffers, sends asynchronous. Once the list is done
// each group's gradients are complete: sequence parallelism's tp sum, the tied embedding's sum over
// the first and last stage, then the data-parallel reduction as above.
// Every layout keeps AdamW's arithmetic per element, so the results differ from one rank's only by
// the order of the reductions (sums over ranks instead of within a GEMM).

#include <cstdint>
#include <vector>

#include "trainer/config.hpp"
#include "trainer/gpt.hpp"
#include "trainer/groups.hpp"
#include "trainer/ops.hpp"
#include "trainer/schedule.hpp"
#include "tutti/fused.hpp"

namespace tutti::train {

struct StepResult {
  double loss = 0;       // mean over the global batch
  double grad_norm = 0;  // before clipping
  float lr = 0;
  double comm_wait_s = 0;  // this step's time blocked on tp, dp and pp communication
  double pipeline_wait_s = 0;  // of which waiting for a neighbouring stage (the bubble, plus transfers)
  int activation_slots = 0;    // micro-batch chunks of activations this rank has held at once (its peak)
};

class Trainer {
 public:
  // `batch`: sequences per step over all dp ranks (each takes batch / dp). Initialises the model
  // from `seed` (every layout the same whole model).
  Trainer(const ModelConfig& model, const OptimConfig& optim, Groups& groups, Ops& ops, int batch, uint64_t seed);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // One step on this rank's sequences (batch / dp of them, T + 1 tokens each, host memory).
  StepResult step(const int32_t* sequences);
  // The mean loss over the global batch, without training (validation).
  double evaluate(const int32_t* sequences);
  int steps_done() const { return step_; }

  Gpt& model() { return *model_; }
  Groups& groups() { return groups_; }
  const OptimConfig& optim() const { return optim_; }
  // The optimizer's state of this rank: AdamW's moments over the parameters it updates (all of its
  // tp shard without ZeRO, its dp shard of every group with), and the master copy of the shards
  // (ZeRO). For checkpoints: the whole tensor values are recovered with whole_state().
  struct State {
    float* m;
    float* v;
    float* params;  // what the optimizer updates: model().params() without ZeRO, the master shards with
  };
  State state() { return {m_, v_, zero() ? master_ : model_->params()}; }
  // Sets the step counter (a resumed run's).
  void set_step(int step) { step_ = step; }
  // ZeRO: all-gathers the master shards into the parameters (ZeRO-3: drops them, to be gathered
  // when used). After the optimizer step, and after loading master shards.
  void publish_params();
  // Takes the model's parameters as they are now (set through model()) as the optimizer's: ZeRO
  // copies this rank's shards into the master copy. Collective over nothing; call on every rank.
  void params_changed();
  // ZeRO-3: gathers every group's parameters into model().params() (for reading them whole).
  void gather_all();

  // The pipeline schedule this rank runs and its check (empty without a pipeline).
  const Schedule& schedule() const { return schedule_; }
  const ScheduleReport& schedule_report() const { return schedule_report_; }

  // Whether ZeRO runs the fused step (ZeRO-1/2, data parallel, host buffers).
  bool fused_zero() const { return !fused_.empty(); }

  // Floats of the optimizer's region: layout().size() without ZeRO, sum of group shards with.
  int64_t optimizer_size() const { return opt_size_; }
  // Arena offset of the optimizer region's element i (ZeRO: the owned shards, group by group).
  int64_t arena_offset(int64_t i) const;

 private:
  bool zero() const { return groups_.layout.zero > 0; }
  // The pipeline: this rank's schedule list; returns the mean loss over micro-batches on the rank
  // holding the last stage, 0 elsewhere.
  double run_schedule(const int32_t* sequences);
  double forward_only(const int32_t* sequences);
  // Whether group g's gradients are counted here for the global norm (the tied embeddings are held
  // by the first and the last stage; the first counts them).
  bool counts_for_norm(int g) const;
  double mean_over_dp(double v);
  void gather_group(int g);
  double grad_norm();
  // The phases of step().
  void wait_pending_quietly();
  void clear_pending();
  double comm_seconds() const;  // blocked on communication so far, over every group
  GroupHooks step_hooks();
  void forward_backward(const int32_t* sequences, const GroupHooks& hooks, StepResult& out);
  void reduce_group(int g);
  void retire_reductions(bool block);
  double fused_grad_norm();
  void fused_update(float lr, float clip);
  void adamw_update(float lr, float clip);

  ModelConfig model_config_;
  OptimConfig optim_;
  Groups& groups_;
  Ops& ops_;
  int batch_;
  std::unique_ptr<Gpt> model_;
  int step_ = 0;
  int64_t opt_size_ = 0;
  std::vector<int64_t> shard_start_;  // per group: start of its owned shard in the optimizer region
  float* m_ = nullptr;
  float* v_ = nullptr;
  float* master_ = nullptr;  // ZeRO: the owned shards of the parameters
  std::vector<bool> resident_;  // ZeRO-3: groups whose parameters are gathered now
  // The gradient reductions in flight: the group of each, and whether it is retired (finished, and
  // with ZeRO-2/3 the gradients this rank does not own discarded).
  std::vector<tutti::Work> pending_;
  std::vector<int> pending_group_;
  std::vector<bool> retired_;
  // ZeRO-1/2 on host buffers: the fused ZeRO step per group (tutti/fused.hpp), in its two halves
  // (the norm spans every group and the tp ranks): reduce() as backward finishes a group, update()
  // after the norm, each updated chunk all-gathered as it is done.
  std::vector<std::unique_ptr<tutti::fused::ZeroStep>> fused_;
  std::vector<std::vector<float>> decay_;  // per group: 1 where this rank's shard decays, else 0
  Schedule schedule_;
  ScheduleReport schedule_report_;
};

}  // namespace tutti::train
