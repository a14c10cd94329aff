#include "trainer/schedule.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <deque>
#include <map>
#include <utility>

#include "tutti/types.hpp"

namespace tutti::train {

ScheduleKind parse_schedule(std::string_view name) {
  if (name == "gpipe") return ScheduleKind::kGpipe;
  if (name == "1f1b") return ScheduleKind::k1F1B;
  if (name == "interleaved") return ScheduleKind::kInterleaved;
  if (name == "zb-h1" || name == "zbh1" || name == "zero-bubble") return ScheduleKind::kZeroBubble;
  throw InvalidArgument(fmt::format("pipeline schedule '{}' is not one of gpipe, 1f1b, interleaved, zb-h1", name));
}

const char* to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGpipe:
      return "gpipe";
    case ScheduleKind::k1F1B:
      return "1f1b";
    case ScheduleKind::kInterleaved:
      return "interleaved";
    case ScheduleKind::kZeroBubble:
      return "zb-h1";
  }
  return "?";
}

const char* to_string(PipeOp op) {
  switch (op) {
    case PipeOp::kForward:
      return "forward";
    case PipeOp::kBackward:
      return "backward";
    case PipeOp::kBackwardInput:
      return "backward-input";
    case PipeOp::kBackwardWeight:
      return "backward-weight";
    case PipeOp::kSendActivation:
      return "send-activation";
    case PipeOp::kRecvActivation:
      return "recv-activation";
    case PipeOp::kSendGrad:
      return "send-grad";
    case PipeOp::kRecvGrad:
      return "recv-grad";
  }
  return "?";
}

bool is_communication(PipeOp op) { return op >= PipeOp::kSendActivation; }

int Schedule::peer_of(int rank, const PipeAction& a) const {
  const int s = stage_of(rank, a.chunk);
  switch (a.op) {
    case PipeOp::kSendActivation:
    case PipeOp::kRecvGrad:
      return s + 1 < stages() ? rank_of_stage(s + 1) : -1;
    case PipeOp::kRecvActivation:
    case PipeOp::kSendGrad:
      return s > 0 ? rank_of_stage(s - 1) : -1;
    default:
      return -1;
  }
}

std::string Schedule::describe(int rank, size_t index) const {
  const PipeAction& a = ranks[static_cast<size_t>(rank)][index];
  std::string s =
      fmt::format("rank {} action {} ({} mb {} chunk {}", rank, index, to_string(a.op), a.microbatch, a.chunk);
  if (is_communication(a.op)) {
    const bool send = a.op == PipeOp::kSendActivation || a.op == PipeOp::kSendGrad;
    s += fmt::format(" {} rank {}", send ? "to" : "from", peer_of(rank, a));
  }
  return s + ")";
}

namespace {

// Compute orders -> full action lists: each compute action's input is received right before it and
// its output sent right after it.
void add_communication(Schedule& s, const std::vector<std::vector<PipeAction>>& compute) {
  s.ranks.assign(static_cast<size_t>(s.pp), {});
  for (int r = 0; r < s.pp; ++r) {
    auto& out = s.ranks[static_cast<size_t>(r)];
    for (const PipeAction& a : compute[static_cast<size_t>(r)]) {
      const int stage = s.stage_of(r, a.chunk);
      const bool first = stage == 0, last = stage == s.stages() - 1;
      const bool backward = a.op == PipeOp::kBackward || a.op == PipeOp::kBackwardInput;
      if (a.op == PipeOp::kForward && !first) out.push_back({PipeOp::kRecvActivation, a.microbatch, a.chunk});
      if (backward && !last) out.push_back({PipeOp::kRecvGrad, a.microbatch, a.chunk});
      out.push_back(a);
      if (a.op == PipeOp::kForward && !last) out.push_back({PipeOp::kSendActivation, a.microbatch, a.chunk});
      if (backward && !first) out.push_back({PipeOp::kSendGrad, a.microbatch, a.chunk});
    }
  }
}

// ZB-H1 by list scheduling with unit costs: each rank, when free, runs the first ready of: the next
// backward-input (its gradient has arrived), the next forward (its input has arrived and fewer than
// pp - rank micro-batches hold activations, 1F1B's bound), a deferred weight half. The weight halves
// thus fill the time 1F1B spends waiting for gradients.
std::vector<std::vector<PipeAction>> zero_bubble_order(int pp, int m) {
  constexpr int64_t kNever = INT64_MAX;
  const auto P = static_cast<size_t>(pp);
  std::vector<std::vector<int64_t>> f_done(P, std::vector<int64_t>(static_cast<size_t>(m), kNever)), b_done = f_done;
  std::vector<int> next_f(P, 0), next_b(P, 0), live(P, 0);
  std::vector<std::deque<int>> pending_w(P);
  std::vector<std::vector<PipeAction>> order(P);
  int64_t remaining = 3 * static_cast<int64_t>(m) * pp;
  for (int64_t t = 0; remaining > 0; ++t) {
    for (size_t r = 0; r < P; ++r) {
      const int b = next_b[r], f = next_f[r];
      const auto B = static_cast<size_t>(b), F = static_cast<size_t>(f);
      const bool b_ready = b < m && f_done[r][B] <= t && (r + 1 == P || b_done[r + 1][B] <= t);
      const bool f_ready = f < m && live[r] < pp - static_cast<int>(r) && (r == 0 || f_done[r - 1][F] <= t);
      if (b_ready) {
        order[r].push_back({PipeOp::kBackwardInput, b, 0});
        b_done[r][B] = t + 1;
        pending_w[r].push_back(b);
        ++next_b[r];
      } else if (f_ready) {
        order[r].push_back({PipeOp::kForward, f, 0});
        f_done[r][F] = t + 1;
        ++live[r];
        ++next_f[r];
      } else if (!pending_w[r].empty()) {
        order[r].push_back({PipeOp::kBackwardWeight, pending_w[r].front(), 0});
        pending_w[r].pop_front();
        --live[r];
      } else {
        continue;
      }
      --remaining;
    }
  }
  return order;
}

}  // namespace

Schedule make_schedule(ScheduleKind kind, int pp, int microbatches, int vp) {
  if (pp < 1) throw InvalidArgument(fmt::format("pipeline schedule: --pp {} must be at least 1", pp));
  if (microbatches < 1)
    throw InvalidArgument(fmt::format("pipeline schedule: --microbatches {} must be at least 1", microbatches));
  if (kind == ScheduleKind::kInterleaved) {
    if (vp < 2) throw InvalidArgument(fmt::format("pipeline schedule interleaved: --vp {} must be at least 2", vp));
    if (microbatches % pp != 0)
      throw InvalidArgument(fmt::format(
          "pipeline schedule interleaved: --microbatches {} must be a multiple of --pp {} (micro-batches go round "
          "the ranks in groups of pp)",
          microbatches, pp));
  } else if (vp != 1) {
    throw InvalidArgument(
        fmt::format("pipeline schedule {}: --vp {} needs the interleaved schedule", to_string(kind), vp));
  }
  Schedule s;
  s.kind = kind;
  s.pp = pp;
  s.vp = vp;
  s.microbatches = microbatches;
  s.split_backward = kind == ScheduleKind::kZeroBubble;
  const int m = microbatches;
  std::vector<std::vector<PipeAction>> compute(static_cast<size_t>(pp));
  for (int r = 0; r < pp && kind != ScheduleKind::kZeroBubble; ++r) {
    auto& o = compute[static_cast<size_t>(r)];
    auto F = [&](int mb, int chunk) { o.push_back({PipeOp::kForward, mb, chunk}); };
    auto B = [&](int mb, int chunk) { o.push_back({PipeOp::kBackward, mb, chunk}); };
    if (kind == ScheduleKind::kGpipe) {
      for (int i = 0; i < m; ++i) F(i, 0);
      for (int i = 0; i < m; ++i) B(i, 0);
    } else if (kind == ScheduleKind::k1F1B) {
      const int warmup = std::min(pp - r - 1, m);
      for (int i = 0; i < warmup; ++i) F(i, 0);
      for (int j = 0; j < m - warmup; ++j) F(warmup + j, 0), B(j, 0);
      for (int j = m - warmup; j < m; ++j) B(j, 0);
    } else {
      // Megatron-LM's interleaved 1F1B: virtual micro-batch k is micro-batch
      // (k / (pp vp)) pp + k % pp of chunk (k / pp) % vp forward, vp - 1 minus that backward.
      const int total = m * vp;
      auto mb_of = [&](int k) { return (k / (pp * vp)) * pp + k % pp; };
      auto chunk_of = [&](int k, bool forward) {
        const int c = (k / pp) % vp;
        return forward ? c : vp - 1 - c;
      };
      const int warmup = std::min((pp - r - 1) * 2 + (vp - 1) * pp, total);
      for (int k = 0; k < warmup; ++k) F(mb_of(k), chunk_of(k, true));
      for (int k = 0; k < total - warmup; ++k) {
        F(mb_of(warmup + k), chunk_of(warmup + k, true));
        B(mb_of(k), chunk_of(k, false));
      }
      for (int k = total - warmup; k < total; ++k) B(mb_of(k), chunk_of(k, false));
    }
  }
  if (kind == ScheduleKind::kZeroBubble) compute = zero_bubble_order(pp, m);
  add_communication(s, compute);
  return s;
}

double pipeline_bubble_formula(int pp, int microbatches) {
  return static_cast<double>(pp - 1) / static_cast<double>(microbatches + pp - 1);
}

namespace {

// Where each op of one (micro-batch, chunk) sits in a rank's list: its index, -1 where absent.
constexpr int kOps = 8;
using OpPositions = std::array<int64_t, kOps>;

[[noreturn]] void fail_action(const Schedule& s, int r, size_t i, const std::string& why) {
  throw InvalidArgument(fmt::format("schedule {}: {}: {}", to_string(s.kind), s.describe(r, i), why));
}

void check_shape(const Schedule& s) {
  const int pp = s.pp, vp = s.vp, m = s.microbatches;
  if (pp < 1 || vp < 1 || m < 1 || static_cast<int>(s.ranks.size()) != pp)
    throw InvalidArgument(fmt::format("schedule: pp {}, vp {}, {} micro-batches and {} rank lists do not fit", pp, vp,
                                      m, s.ranks.size()));
}

// Action i of rank r: its fields, and whether the schedule's kind and the stage allow its op.
void check_action(const Schedule& s, int r, size_t i) {
  const PipeAction& a = s.ranks[static_cast<size_t>(r)][i];
  if (a.microbatch < 0 || a.microbatch >= s.microbatches || a.chunk < 0 || a.chunk >= s.vp) {
    throw InvalidArgument(
        fmt::format("schedule {}: rank {} action {}: micro-batch {} or chunk {} is outside {} "
                    "micro-batches of {} chunks",
                    to_string(s.kind), r, i, a.microbatch, a.chunk, s.microbatches, s.vp));
  }
  if (static_cast<int>(a.op) >= kOps) fail_action(s, r, i, "unknown action");
  const bool split_op = a.op == PipeOp::kBackwardInput || a.op == PipeOp::kBackwardWeight;
  if (a.op == PipeOp::kBackward && s.split_backward)
    fail_action(s, r, i, "this schedule splits the backward into input and weight halves");
  if (split_op && !s.split_backward) fail_action(s, r, i, "this schedule does not split the backward");
  if (is_communication(a.op) && s.peer_of(r, a) < 0)
    fail_action(s, r, i, fmt::format("stage {} has no neighbour on that side", s.stage_of(r, a.chunk)));
}

// Checks rank r's actions one by one, each (micro-batch, chunk, op) at most once, and returns their
// positions, indexed by micro-batch * vp + chunk.
std::vector<OpPositions> locate_actions(const Schedule& s, int r) {
  const auto& list = s.ranks[static_cast<size_t>(r)];
  std::vector<OpPositions> at(static_cast<size_t>(s.microbatches * s.vp));
  for (auto& x : at) x.fill(-1);
  for (size_t i = 0; i < list.size(); ++i) {
    check_action(s, r, i);
    const PipeAction& a = list[i];
    int64_t& slot = at[static_cast<size_t>(a.microbatch * s.vp + a.chunk)][static_cast<size_t>(a.op)];
    if (slot >= 0) fail_action(s, r, i, fmt::format("repeats action {}", slot));
    slot = static_cast<int64_t>(i);
  }
  return at;
}

// One micro-batch through one chunk of rank r: forward, then backward (its halves in order), each
// with its input received before it and its output sent after it, and no messages past the ends.
void check_order(const Schedule& s, int r, int mb, int c, const OpPositions& p) {
  auto pos = [&](PipeOp op) { return p[static_cast<size_t>(op)]; };
  const int stage = s.stage_of(r, c);
  const std::string what = fmt::format("rank {}: micro-batch {} of chunk {} (stage {})", r, mb, c, stage);
  auto need = [&](bool cond, const std::string& why) {
    if (!cond) throw InvalidArgument(fmt::format("schedule {}: {}: {}", to_string(s.kind), what, why));
  };
  const int64_t f = pos(PipeOp::kForward);
  const int64_t b = s.split_backward ? pos(PipeOp::kBackwardInput) : pos(PipeOp::kBackward);
  need(f >= 0, "has no forward");
  need(b >= 0, "has no backward");
  need(f < b, "runs backward before forward");
  if (s.split_backward) need(pos(PipeOp::kBackwardWeight) > b, "has no weight gradient after its backward-input");
  if (stage > 0) {
    need(pos(PipeOp::kRecvActivation) >= 0 && pos(PipeOp::kRecvActivation) < f,
         "forward before its input is received");
    need(pos(PipeOp::kSendGrad) > b, "never sends its input gradient back after the backward");
  } else {
    need(pos(PipeOp::kRecvActivation) < 0 && pos(PipeOp::kSendGrad) < 0, "the first stage has no previous stage");
  }
  if (stage < s.stages() - 1) {
    need(pos(PipeOp::kSendActivation) > f, "never sends its output on after the forward");
    need(pos(PipeOp::kRecvGrad) >= 0 && pos(PipeOp::kRecvGrad) < b, "backward before its output gradient is received");
  } else {
    need(pos(PipeOp::kSendActivation) < 0 && pos(PipeOp::kRecvGrad) < 0, "the last stage has no next stage");
  }
}

// 1. Fields, and each (micro-batch, chunk, op) once per rank, in order.
void check_actions(const Schedule& s) {
  for (int r = 0; r < s.pp; ++r) {
    const std::vector<OpPositions> at = locate_actions(s, r);
    for (int mb = 0; mb < s.microbatches; ++mb)
      for (int c = 0; c < s.vp; ++c) check_order(s, r, mb, c, at[static_cast<size_t>(mb * s.vp + c)]);
  }
}

// 2. Matching: per ordered pair of ranks, sends and receives in the same order. A message is
// (gradient?, micro-batch, the stage it leaves).
struct Msg {
  bool grad;
  int mb, from_stage;
  bool operator==(const Msg&) const = default;
};
using MessageQueues = std::map<std::pair<int, int>, std::vector<std::pair<Msg, size_t>>>;  // (from, to)

// Every send and receive of the schedule, with its action's index, per (from, to) in list order.
void collect_messages(const Schedule& s, MessageQueues& sends, MessageQueues& recvs) {
  for (int r = 0; r < s.pp; ++r) {
    const auto& list = s.ranks[static_cast<size_t>(r)];
    for (size_t i = 0; i < list.size(); ++i) {
      const PipeAction& a = list[i];
      const int stage = s.stage_of(r, a.chunk), peer = s.peer_of(r, a);
      switch (a.op) {
        case PipeOp::kSendActivation:
          sends[{r, peer}].push_back({{false, a.microbatch, stage}, i});
          break;
        case PipeOp::kSendGrad:
          sends[{r, peer}].push_back({{true, a.microbatch, stage}, i});
          break;
        case PipeOp::kRecvActivation:
          recvs[{peer, r}].push_back({{false, a.microbatch, stage - 1}, i});
          break;
        case PipeOp::kRecvGrad:
          recvs[{peer, r}].push_back({{true, a.microbatch, stage + 1}, i});
          break;
        default:
          break;
      }
    }
  }
}

// match[r][i]: the peer's action index of communication action i of rank r.
using Matches = std::vector<std::vector<size_t>>;

Matches match_messages(const Schedule& s) {
  MessageQueues sends, recvs;
  collect_messages(s, sends, recvs);
  Matches match(static_cast<size_t>(s.pp));
  for (int r = 0; r < s.pp; ++r) match[static_cast<size_t>(r)].assign(s.ranks[static_cast<size_t>(r)].size(), 0);
  for (const auto& [pair, rs] : recvs) {
    const auto& ss = sends[pair];
    for (size_t k = 0; k < rs.size(); ++k) {
      if (k >= ss.size())
        fail_action(s, pair.second, rs[k].second,
                    fmt::format("expects message {} from rank {}, which sends only {}", k + 1, pair.first, ss.size()));
      if (!(ss[k].first == rs[k].first))
        fail_action(s, pair.second, rs[k].second,
                    fmt::format("is the receive of message {} from rank {}, but that message is {}", k + 1,
                                pair.first, s.describe(pair.first, ss[k].second)));
      match[static_cast<size_t>(pair.second)][rs[k].second] = ss[k].second;
      match[static_cast<size_t>(pair.first)][ss[k].second] = rs[k].second;
    }
    if (ss.size() > rs.size())
      fail_action(s, pair.first, ss[rs.size()].second, fmt::format("rank {} never receives it", pair.second));
  }
  for (const auto& [pair, ss] : sends)
    if (!recvs.contains(pair))
      fail_action(s, pair.first, ss.front().second, fmt::format("rank {} never receives it", pair.second));
  return match;
}

// 3. Dry run: compute takes its cost; a send is posted and the rank goes on (the trainer sends
// asynchronously, on a communicator per direction); a receive waits for its message's send.
struct DryRun {
  const Schedule& s;
  const Matches& match;
  ScheduleReport rep;
  std::vector<size_t> pc;
  std::vector<int64_t> clock;
  std::vector<int> live;
  std::vector<std::vector<int64_t>> sent;

  DryRun(const Schedule& schedule, const Matches& matches) : s(schedule), match(matches) {
    const auto P = static_cast<size_t>(s.pp);
    rep.busy.assign(P, 0);
    rep.peak_activations.assign(P, 0);
    rep.timeline.assign(P, {});
    pc.assign(P, 0);
    clock.assign(P, 0);
    live.assign(P, 0);
    sent.resize(P);
    for (int r = 0; r < s.pp; ++r) sent[static_cast<size_t>(r)].assign(s.ranks[static_cast<size_t>(r)].size(), -1);
  }

  void run() {
    for (bool progress = true; progress;) {
      progress = false;
      for (int r = 0; r < s.pp; ++r)
        if (advance(r)) progress = true;
    }
  }

  // Runs rank r's list until a receive whose message is not sent yet; whether it ran anything.
  bool advance(int r) {
    const auto R = static_cast<size_t>(r);
    const auto& list = s.ranks[R];
    bool progress = false;
    for (; pc[R] < list.size(); ++pc[R], progress = true) {
      const PipeAction& a = list[pc[R]];
      if (a.op == PipeOp::kSendActivation || a.op == PipeOp::kSendGrad) {
        sent[R][pc[R]] = clock[R];
      } else if (is_communication(a.op)) {
        const int64_t at = sent[static_cast<size_t>(s.peer_of(r, a))][match[R][pc[R]]];
        if (at < 0) break;
        clock[R] = std::max(clock[R], at);
      } else {
        compute(R, a);
      }
    }
    return progress;
  }

  void compute(size_t R, const PipeAction& a) {
    const int64_t cost = a.op == PipeOp::kBackward ? 2 : 1;
    rep.timeline[R].push_back({clock[R], clock[R] + cost, a});
    clock[R] += cost;
    rep.busy[R] += cost;
    if (a.op == PipeOp::kForward) rep.peak_activations[R] = std::max(rep.peak_activations[R], ++live[R]);
    if (a.op == PipeOp::kBackward || a.op == PipeOp::kBackwardWeight) --live[R];
  }

  // A rank that did not reach the end of its list waits on a receive: names every such rank.
  void check_finished() const {
    std::string stuck;
    for (int r = 0; r < s.pp; ++r) {
      const size_t p = pc[static_cast<size_t>(r)];
      if (p == s.ranks[static_cast<size_t>(r)].size()) continue;
      stuck += fmt::format("{}{} waits for rank {}", stuck.empty() ? "" : "; ", s.describe(r, p),
                           s.peer_of(r, s.ranks[static_cast<size_t>(r)][p]));
    }
    if (!stuck.empty()) throw InvalidArgument(fmt::format("schedule {}: deadlock: {}", to_string(s.kind), stuck));
  }

  ScheduleReport report() {
    rep.makespan = *std::max_element(clock.begin(), clock.end());
    double idle = 0;
    for (int r = 0; r < s.pp; ++r)
      idle += rep.makespan > 0
                  ? 1.0 - static_cast<double>(rep.busy[static_cast<size_t>(r)]) / static_cast<double>(rep.makespan)
                  : 0;
    rep.bubble = idle / s.pp;
    return std::move(rep);
  }
};

}  // namespace

ScheduleReport check_schedule(const Schedule& s) {
  check_shape(s);
  check_actions(s);
  const Matches match = match_messages(s);
  DryRun dry(s, match);
  dry.run();
  dry.check_finished();
  return dry.report();
}

std::string render_timeline(const Schedule& s, const ScheduleReport& rep) {
  std::string out;
  for (int r = 0; r < s.pp; ++r) {
    std::string row(static_cast<size_t>(2 * rep.makespan), '.');
    for (const auto& span : rep.timeline[static_cast<size_t>(r)]) {
      char letter = span.action.op == PipeOp::kForward ? 'F' : span.action.op == PipeOp::kBackwardWeight ? 'W' : 'B';
      if (span.action.chunk % 2 == 1) letter = static_cast<char>(letter - 'A' + 'a');
      const char digit = static_cast<char>('0' + span.action.microbatch % 10);
      for (int64_t t = span.start; t < span.end; ++t) {
        row[static_cast<size_t>(2 * t)] = letter;
        row[static_cast<size_t>(2 * t + 1)] = digit;
      }
    }
    out += fmt::format("rank {:>2} |{}| busy {}/{}\n", r, row, rep.busy[static_cast<size_t>(r)], rep.makespan);
  }
  return out;
}

std::string render_svg(const Schedule& s, const ScheduleReport& rep) {
  constexpr int kUnit = 24, kRow = 28, kLeft = 64;
  const int64_t width = kLeft + rep.makespan * kUnit + 8, height = s.pp * kRow + 8;
  std::string out = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"monospace\" "
      "font-size=\"11\">\n<title>{} pp={} vp={} microbatches={} bubble={:.3f}</title>\n",
      width, height, to_string(s.kind), s.pp, s.vp, s.microbatches, rep.bubble);
  for (int r = 0; r < s.pp; ++r) {
    const int y = 4 + r * kRow;
    out += fmt::format("<text x=\"4\" y=\"{}\">rank {}</text>\n", y + 17, r);
    for (const auto& span : rep.timeline[static_cast<size_t>(r)]) {
      const PipeOp op = span.action.op;
      const char* colour = op == PipeOp::kForward ? "#4e79a7" : op == PipeOp::kBackwardWeight ? "#f28e2b" : "#59a14f";
      const int64_t x = kLeft + span.start * kUnit, w = (span.end - span.start) * kUnit;
      out += fmt::format(
          "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\" fill-opacity=\"{}\" stroke=\"white\"/>"
          "<text x=\"{}\" y=\"{}\" fill=\"white\">{}</text>\n",
          x, y, w, kRow - 4, colour, span.action.chunk % 2 ? "0.6" : "1", x + 4, y + 17, span.action.microbatch);
    }
  }
  return out + "</svg>\n";
}

}  // namespace tutti::train
