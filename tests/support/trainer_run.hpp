#pragma once
// Training runs of the tiny GPT for the trainer's parity tests, shared by the in-process test
// (tests/test_trainer.cpp, ranks as threads) and the one run under tutti-run (tests/trainer_parity.cpp,
// ranks as processes).

#include <map>
#include <string>
#include <vector>

#include "trainer/config.hpp"
#include "trainer/data.hpp"
#include "trainer/ops.hpp"
#include "tutti/tutti.hpp"

namespace tutti::train::test_support {

constexpr int kBatch = 8;
constexpr int kSteps = 10;

ModelConfig tiny(int layers = 2);  // L2 C32 NH4 T16 V64
// A token stream with some structure to learn (a noisy counter), the same everywhere.
TokenStream synthetic_tokens(int vocab, int64_t n);
Layout make_layout(int tp, int dp, bool sp = false, int zero = 0);
// `base` with a pipeline of pp ranks running `schedule` over `microbatches` (vp chunks per rank).
Layout with_pipeline(Layout base, int pp, ScheduleKind schedule, int microbatches, int vp = 1);

struct RunResult {
  std::vector<double> losses;  // mean over the global batch, per step
  // Whole tensors after the last step. A rank fills only the parts it alone holds (dp rank 0; whole
  // tensors on tp rank 0), zeros elsewhere, so the ranks' results add up to the model exactly.
  std::map<std::string, std::vector<float>> params;
  bool fused_zero = false;  // the trainer ran the fused ZeRO step (tutti/fused.hpp)
  int activation_slots = 0;  // the pipeline's peak on this rank (max over ranks when added)
  int predicted_slots = 0;   // the schedule checker's prediction for this rank (max over ranks)
};

struct RunOptions {
  float grad_clip = 1.0f;
  std::string save_dir;  // save a checkpoint here after step `save_at` steps
  int save_at = -1;
  std::string resume_dir;  // start from this checkpoint (losses then cover the steps run)
  bool cuda = false;       // the CUDA kernels on device 0 instead of the CPU's
  bool staged = false;     // the CPU's kernels behind a backend that calls itself a device (staged_ops)
  int layers = 2;          // the tiny model's (pipelines need one per stage)
  // A mixture of experts instead of the MLPs (trainer/moe.hpp); experts 0: dense.
  int experts = 0, top_k = 1, moe_group = 0;
  float capacity = 0;
};
// The CPU kernels under another name: the trainer then takes every path it takes for a device
// backend (collectives and pipeline boundaries through host copies, the experts on host copies).
std::unique_ptr<Ops> staged_ops();

// Trains up to kSteps steps as one rank of `layout` (world: null for a single rank).
RunResult train_rank(tutti::Comm* world, const Layout& layout, const RunOptions& options = {});
// Adds `part` into `sum` (the ranks' parts make the whole model).
void add_parts(RunResult& sum, const RunResult& part);
// "" when `got` trained like `want` (losses within 1e-5 of themselves; parameters within 1e-5 of
// the model's largest value, key biases aside: test_trainer.cpp says why), else what differs first.
std::string compare_training(const RunResult& got, const RunResult& want);

}  // namespace tutti::train::test_support
