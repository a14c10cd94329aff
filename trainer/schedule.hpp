#pragma once
// Pipeline schedules as data, checked before they run (as plans are).
//
// A schedule gives each pipeline rank an ordered list of actions: forward or backward of one
// micro-batch through one of the rank's model chunks, the backward's weight-gradient half where the
// schedule splits it (zero-bubble), and the sends and receives of activations and their gradients
// between neighbouring stages. The model's layers are cut into pp * vp stages; stage s lives on rank
// s % pp as its chunk s / pp (Megatron-LM's interleaving; vp = 1 is one contiguous range per rank).
//
// The trainer runs the list in order. A send is started and the rank goes on (each direction between
// two ranks has a communicator of its own, so a send never holds up a receive); a receive waits for
// its message. Only a chain of receives can then deadlock, and the dry run finds such chains.
//
// check_schedule() proves, without running anything:
//   - every field is in range, every micro-batch passes every stage forward once and then backward
//     once (the backward's two halves in order where split);
//   - every compute action has its input received before it and its output sent after it;
//   - the k-th message from rank a to rank b is the one b's k-th receive from a expects (same kind,
//     micro-batch and stage boundary), so no two messages of the same size can be swapped;
//   - a dry run with these semantics finishes (no deadlock); where it does not, the message names
//     every rank's blocked receive.
// and measures, with unit costs (forward 1, backward 2, or 1 + 1 when split), the time line, the
// bubble fraction and each rank's peak of live activations (micro-batch chunks whose forward ran and
// whose backward has not yet released them).

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tutti::train {

enum class ScheduleKind { kGpipe, k1F1B, kInterleaved, kZeroBubble };
ScheduleKind parse_schedule(std::string_view name);  // gpipe, 1f1b, interleaved, zb-h1; InvalidArgument otherwise
const char* to_string(ScheduleKind kind);

enum class PipeOp : uint8_t {
  kForward,         // the chunk's layers on the micro-batch (embeddings first on stage 0; loss last on the last)
  kBackward,        // the whole backward of the chunk
  kBackwardInput,   // zero-bubble: the backward's input gradients (and the small parameters' gradients)
  kBackwardWeight,  // zero-bubble: the deferred weight-gradient GEMMs; releases the activations
  kSendActivation,  // the chunk's output to the next stage's rank
  kRecvActivation,  // the chunk's input from the previous stage's rank
  kSendGrad,        // the gradient of the chunk's input to the previous stage's rank
  kRecvGrad,        // the gradient of the chunk's output from the next stage's rank
};
const char* to_string(PipeOp op);
bool is_communication(PipeOp op);

struct PipeAction {
  PipeOp op = PipeOp::kForward;
  int microbatch = 0;
  int chunk = 0;  // the rank's model chunk (0 .. vp-1)
  bool operator==(const PipeAction&) const = default;
};

struct Schedule {
  ScheduleKind kind = ScheduleKind::k1F1B;
  int pp = 1, vp = 1, microbatches = 1;
  bool split_backward = false;  // backward as kBackwardInput + kBackwardWeight
  std::vector<std::vector<PipeAction>> ranks;

  int stages() const { return pp * vp; }
  int stage_of(int rank, int chunk) const { return chunk * pp + rank; }
  int rank_of_stage(int stage) const { return stage % pp; }
  // The peer of a send or receive made by `rank`.
  int peer_of(int rank, const PipeAction& a) const;
  std::string describe(int rank, size_t index) const;  // "rank 1 action 4 (recv-grad mb 2 chunk 0 from rank 0)"
};

// pp ranks, `microbatches` micro-batches, vp chunks per rank (interleaved only; 1 otherwise).
// InvalidArgument names the rule broken (interleaved needs vp >= 2 and microbatches a multiple of pp).
Schedule make_schedule(ScheduleKind kind, int pp, int microbatches, int vp = 1);

struct ScheduleReport {
  int64_t makespan = 0;               // time units, forward = 1
  std::vector<int64_t> busy;          // per rank
  double bubble = 0;                  // mean over ranks of idle / makespan
  std::vector<int> peak_activations;  // per rank, in micro-batch chunks
  struct Span {
    int64_t start, end;
    PipeAction action;
  };
  std::vector<std::vector<Span>> timeline;  // per rank, compute only
};
// The formula the bubble of GPipe and 1F1B follows with these costs: (p - 1) / (m + p - 1).
double pipeline_bubble_formula(int pp, int microbatches);

// Throws InvalidArgument naming the rank, the action and the reason.
ScheduleReport check_schedule(const Schedule& schedule);

// The time line as text (a row per rank, two characters per time unit: F/B/W then the micro-batch's
// last digit, lower case for odd chunks, ".." idle) and as an SVG picture.
std::string render_timeline(const Schedule& schedule, const ScheduleReport& report);
std::string render_svg(const Schedule& schedule, const ScheduleReport& report);

}  // namespace tutti::train
