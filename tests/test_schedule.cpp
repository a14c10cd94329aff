// Pipeline schedules (trainer/schedule.hpp): the generators against their formulas, and the
// checker against schedules broken on purpose, one rule at a time and at random.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>

#include "trainer/schedule.hpp"
#include "tutti/types.hpp"

namespace {

using namespace tutti;
using namespace tutti::train;

std::string refusal(const Schedule& s) {
  try {
    check_schedule(s);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

size_t find(const Schedule& s, int rank, PipeAction a) {
  const auto& list = s.ranks[static_cast<size_t>(rank)];
  for (size_t i = 0; i < list.size(); ++i)
    if (list[i] == a) return i;
  ADD_FAILURE() << "rank " << rank << " has no " << to_string(a.op) << " of micro-batch " << a.microbatch;
  return 0;
}

// GPipe and 1F1B idle (p - 1) / (m + p - 1) of the time with unit costs; GPipe holds every
// micro-batch's activations, 1F1B at most pp - rank.
TEST(Schedule, GpipeAnd1F1BMatchTheirBubbleFormulaAndMemory) {
  for (int pp : {1, 2, 4, 8})
    for (int m : {1, 4, 8, 16}) {
      const ScheduleReport g = check_schedule(make_schedule(ScheduleKind::kGpipe, pp, m));
      const ScheduleReport f = check_schedule(make_schedule(ScheduleKind::k1F1B, pp, m));
      EXPECT_NEAR(g.bubble, pipeline_bubble_formula(pp, m), 1e-12) << "gpipe pp " << pp << " m " << m;
      EXPECT_NEAR(f.bubble, pipeline_bubble_formula(pp, m), 1e-12) << "1f1b pp " << pp << " m " << m;
      for (int r = 0; r < pp; ++r) {
        EXPECT_EQ(g.peak_activations[static_cast<size_t>(r)], m);
        EXPECT_EQ(f.peak_activations[static_cast<size_t>(r)], std::min(pp - r, m)) << "pp " << pp << " m " << m;
      }
    }
}

// Interleaving v chunks cuts the bubble to (p - 1) / (v m + p - 1); the zero-bubble split fills
// part of 1F1B's with weight gradients at no more memory.
TEST(Schedule, InterleavedAndZeroBubbleIdleLessThan1F1B) {
  for (int pp : {2, 4})
    for (int m : {4, 8, 16}) {
      const ScheduleReport f = check_schedule(make_schedule(ScheduleKind::k1F1B, pp, m));
      const ScheduleReport i = check_schedule(make_schedule(ScheduleKind::kInterleaved, pp, m, 2));
      const ScheduleReport z = check_schedule(make_schedule(ScheduleKind::kZeroBubble, pp, m));
      EXPECT_NEAR(i.bubble, static_cast<double>(pp - 1) / (2.0 * m + pp - 1), 1e-12) << "pp " << pp << " m " << m;
      EXPECT_LT(i.bubble, f.bubble);
      EXPECT_LT(z.bubble, f.bubble) << "pp " << pp << " m " << m;
      for (int r = 0; r < pp; ++r)
        EXPECT_LE(z.peak_activations[static_cast<size_t>(r)], f.peak_activations[static_cast<size_t>(r)]);
    }
}

TEST(Schedule, ImpossibleRequestsAreNamed) {
  auto message = [](auto make) {
    try {
      make();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message([] { make_schedule(ScheduleKind::kInterleaved, 4, 6, 2); }).find("multiple of --pp 4"),
            std::string::npos);
  EXPECT_NE(message([] { make_schedule(ScheduleKind::kInterleaved, 2, 4, 1); }).find("--vp 1 must be at least 2"),
            std::string::npos);
  EXPECT_NE(message([] { make_schedule(ScheduleKind::k1F1B, 2, 4, 2); }).find("needs the interleaved"),
            std::string::npos);
  EXPECT_NE(message([] { make_schedule(ScheduleKind::kGpipe, 0, 4); }).find("--pp 0"), std::string::npos);
  EXPECT_NE(message([] { parse_schedule("pipedream"); }).find("'pipedream'"), std::string::npos);
  EXPECT_EQ(parse_schedule("zb-h1"), ScheduleKind::kZeroBubble);
}

// Each rule broken once; the message names the rank, the action and the reason.
TEST(Schedule, BrokenSchedulesAreRefusedNamingRankActionAndReason) {
  const Schedule good = make_schedule(ScheduleKind::k1F1B, 2, 4);
  ASSERT_EQ(refusal(good), "");
  using enum PipeOp;
  {  // two sends to the same peer swapped: the receiver would take micro-batch 1's activation as 0's
    Schedule s = good;
    auto& r0 = s.ranks[0];
    std::swap(r0[find(s, 0, {kSendActivation, 0, 0})], r0[find(s, 0, {kSendActivation, 1, 0})]);
    EXPECT_NE(refusal(s).find("never sends its output on after the forward"), std::string::npos) << refusal(s);
  }
  {  // the same with both sends after both forwards: only the order of messages is wrong
    Schedule s = make_schedule(ScheduleKind::kGpipe, 2, 4);
    auto& r0 = s.ranks[0];
    const size_t a = find(s, 0, {kSendActivation, 2, 0}), b = find(s, 0, {kSendActivation, 3, 0});
    std::swap(r0[a], r0[b]);
    std::swap(r0[a - 1], r0[b - 1]);  // the forwards too, so each send still follows its forward
    EXPECT_NE(refusal(s).find("rank 1 action"), std::string::npos) << refusal(s);
    EXPECT_NE(refusal(s).find("is the receive of message 3 from rank 0, but that message is rank 0 action"),
              std::string::npos)
        << refusal(s);
  }
  {  // a receive removed
    Schedule s = good;
    auto& r1 = s.ranks[1];
    r1.erase(r1.begin() + static_cast<std::ptrdiff_t>(find(s, 1, {kRecvActivation, 2, 0})));
    EXPECT_NE(refusal(s).find("rank 1: micro-batch 2 of chunk 0 (stage 1): forward before its input is received"),
              std::string::npos)
        << refusal(s);
  }
  {  // an action repeated
    Schedule s = good;
    s.ranks[0].push_back(s.ranks[0].front());
    EXPECT_NE(refusal(s).find("repeats action 0"), std::string::npos) << refusal(s);
  }
  {  // backward before forward
    Schedule s = good;
    auto& r1 = s.ranks[1];
    std::swap(r1[find(s, 1, {kForward, 3, 0})], r1[find(s, 1, {kBackward, 3, 0})]);
    EXPECT_NE(refusal(s).find("runs backward before forward"), std::string::npos) << refusal(s);
  }
  {  // out of range
    Schedule s = good;
    s.ranks[1][0].microbatch = 9;
    EXPECT_NE(refusal(s).find("rank 1 action 0: micro-batch 9 or chunk 0 is outside 4 micro-batches of 1 chunks"),
              std::string::npos)
        << refusal(s);
  }
  {  // a deadlock every structural rule allows: rank 0 waits for a gradient before sending the
     // activation it comes from
    Schedule s = good;
    auto& r0 = s.ranks[0];
    const PipeAction recv = r0[find(s, 0, {kRecvGrad, 0, 0})];
    r0.erase(r0.begin() + static_cast<std::ptrdiff_t>(find(s, 0, {kRecvGrad, 0, 0})));
    r0.insert(r0.begin() + static_cast<std::ptrdiff_t>(find(s, 0, {kSendActivation, 0, 0})), recv);
    EXPECT_EQ(refusal(s),
              "schedule 1f1b: deadlock: rank 0 action 1 (recv-grad mb 0 chunk 0 from rank 1) waits for rank 1; "
              "rank 1 action 0 (recv-activation mb 0 chunk 0 from rank 0) waits for rank 0");
  }
  {  // the zero-bubble split without its weight half
    Schedule s = make_schedule(ScheduleKind::kZeroBubble, 2, 4);
    auto& r0 = s.ranks[0];
    r0.erase(r0.begin() + static_cast<std::ptrdiff_t>(find(s, 0, {kBackwardWeight, 1, 0})));
    EXPECT_NE(refusal(s).find("has no weight gradient after its backward-input"), std::string::npos) << refusal(s);
  }
  {  // a send the first stage has no neighbour for
    Schedule s = good;
    s.ranks[0].push_back({kSendGrad, 0, 0});
    EXPECT_NE(refusal(s).find("stage 0 has no neighbour on that side"), std::string::npos) << refusal(s);
  }
}

// Random damage to every kind of schedule: the checker refuses with InvalidArgument naming a rank,
// or accepts a schedule that still has every micro-batch forward and backward on every stage;
// nothing else escapes.
TEST(Schedule, RandomDamageIsRefusedOrHarmless) {
  std::mt19937 rng(2026);
  int refused = 0, accepted = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const auto kind = static_cast<ScheduleKind>(trial % 4);
    const int pp = 2 + (trial / 4) % 3, vp = kind == ScheduleKind::kInterleaved ? 2 : 1;
    Schedule s = make_schedule(kind, pp, 2 * pp, vp);
    auto& list = s.ranks[rng() % s.ranks.size()];
    const size_t i = rng() % list.size(), j = rng() % list.size();
    switch (rng() % 4) {
      case 0: std::swap(list[i], list[j]); break;
      case 1: list.erase(list.begin() + static_cast<std::ptrdiff_t>(i)); break;
      case 2: list.insert(list.begin() + static_cast<std::ptrdiff_t>(j), list[i]); break;
      default: list[i].microbatch = static_cast<int>(rng() % 5) - 1; break;
    }
    try {
      const ScheduleReport rep = check_schedule(s);
      ++accepted;
      int64_t busy = 0;
      for (int64_t b : rep.busy) busy += b;
      EXPECT_EQ(busy, 3LL * s.microbatches * s.stages()) << "trial " << trial;
    } catch (const InvalidArgument& e) {
      ++refused;
      EXPECT_NE(std::string(e.what()).find("rank "), std::string::npos) << e.what();
    }
  }
  EXPECT_GT(refused, 1000);
  EXPECT_GT(accepted, 0);  // swapping two independent actions is harmless
}

TEST(Schedule, TimelineRendersEveryRankAndUnit) {
  const Schedule s = make_schedule(ScheduleKind::kInterleaved, 2, 4, 2);
  const ScheduleReport rep = check_schedule(s);
  const std::string text = render_timeline(s, rep);
  EXPECT_NE(text.find("rank  0 |F0F1f0f1"), std::string::npos) << text;
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 2);
  const std::string svg = render_svg(s, rep);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  size_t rects = 0;
  for (size_t at = svg.find("<rect"); at != std::string::npos; at = svg.find("<rect", at + 1)) ++rects;
  EXPECT_EQ(rects, rep.timeline[0].size() + rep.timeline[1].size());
}

}  // namespace
