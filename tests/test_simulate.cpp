// The simulator against closed forms: a ring on a uniform fully connected topology, and two flows
// sharing one link.
#include <gtest/gtest.h>

#include "collectives/algorithms/registry.hpp"
#include "compiler/compile.hpp"
#include "compiler/simulate.hpp"
#include "core/error.hpp"

using namespace tutti;
using namespace tutti::plan;

namespace {

topo::Topology uniform(int n, double gbps, double latency_us) {
  topo::Topology t;
  t.name = "uniform";
  int host = t.add_device(topo::DeviceType::kHost, "host", -1, 0);
  for (int i = 0; i < n; ++i) t.rank_device.push_back(t.add_device(topo::DeviceType::kNuma, "r" + std::to_string(i), host, host));
  for (int i = 0; i < n; ++i)
    for (int j = i + 1; j < n; ++j) t.add_link(t.rank_device[i], t.rank_device[j], topo::LinkType::kNvLink, gbps, latency_us);
  return t;
}

// A ring all-reduce written step by step (every rank does step s for its chunk before step s+1), so
// each block's program order is the ring's schedule.
dsl::Program stepwise_ring(int n) {
  CollectiveSpec spec;
  spec.kind = Collective::kAllReduce;
  spec.nranks = n;
  spec.chunk_factor = n;
  spec.inplace = true;
  dsl::Program p("stepwise_ring", spec);
  const dsl::Buffer w = dsl::Buffer::input();
  for (int step = 1; step < n; ++step)
    for (int k = 0; k < n; ++k) p.chunk((k + step) % n, w, k).reduce(p.chunk((k + step - 1) % n, w, k));
  for (int step = 0; step < n - 1; ++step)
    for (int k = 0; k < n; ++k) p.chunk((k + n - 1 + step) % n, w, k).copy((k + step) % n, w, k);
  return p;
}

TEST(Simulator, RingAllReduceMatchesTheClosedForm) {
  const double beta = 50, alpha = 2;  // GB/s, us
  CostModel ideal;
  ideal.instruction_us = 0;
  ideal.memory_gbps = 1e12;  // local work free, as the closed form assumes (ranks are CPU ranks here)
  // Exact for every rank count, whether the program is written step by step or chunk by chunk (the
  // built-in ring): the compiler orders each block by dataflow depth, so both become the same schedule.
  for (int n : {2, 3, 4, 8}) {
    for (bool builtin : {false, true}) {
      Plan ring = builtin ? compile(algorithms::build("ring_allreduce", n, {})).plan : compile(stepwise_ring(n)).plan;
      topo::Topology t = uniform(n, beta, alpha);
      for (uint64_t bytes : {uint64_t{1} << 20, uint64_t{64} << 20}) {
        double s_us = static_cast<double>(bytes) / (beta * 1e3);
        double expect = 2.0 * (n - 1) / n * s_us + 2.0 * (n - 1) * alpha;
        double got = simulate(ring, t, bytes, ideal).time_us;
        EXPECT_NEAR(got, expect, expect * 1e-6) << n << " ranks, " << bytes << " bytes, " << ring.name;
      }
    }
  }
}

TEST(Simulator, TwoFlowsOnOneLinkShareIt) {
  // g0, g1 -- s0 ==== s1 -- g2, g3: the s0-s1 link carries both flows.
  topo::Topology t;
  t.name = "dumbbell";
  int host = t.add_device(topo::DeviceType::kHost, "host", -1, 0);
  int s0 = t.add_device(topo::DeviceType::kPciSwitch, "s0", host, host), s1 = t.add_device(topo::DeviceType::kPciSwitch, "s1", host, host);
  t.add_link(s0, s1, topo::LinkType::kPcie, 10, 0);
  for (int i = 0; i < 4; ++i) {
    int g = t.add_device(topo::DeviceType::kNuma, "r" + std::to_string(i), i < 2 ? s0 : s1, host);
    t.add_link(g, i < 2 ? s0 : s1, topo::LinkType::kPcie, 100, 0);
    t.rank_device.push_back(g);
  }
  auto flows = [&](int count) {
    Plan p;
    p.name = "flows";
    p.collective = Collective::kSendRecv;
    p.nranks = 4;
    p.ranks.resize(4);
    for (int r = 0; r < 4; ++r) {
      p.ranks[r].input_chunks = p.ranks[r].output_chunks = 1;
      p.ranks[r].blocks.push_back(Block{0, 0, {}});
    }
    for (int f = 0; f < count; ++f) {
      Instruction s, v;
      s.op = Opcode::kSend;
      s.srcs = {Ref{BufferKind::kInput, 0, 1}};
      s.send_peer = 2 + f;
      v.op = Opcode::kRecv;
      v.dst = Ref{BufferKind::kOutput, 0, 1};
      v.recv_peer = f;
      p.ranks[f].blocks[0].steps.push_back(s);
      p.ranks[2 + f].blocks[0].steps.push_back(v);
    }
    CostModel m;
    m.instruction_us = 0;
    m.memory_gbps = 1e12;
    return simulate(p, t, 10'000'000, m).time_us;
  };
  double one = flows(1), two = flows(2);
  EXPECT_NEAR(one, 1000, 1e-3);  // 10 MB at 10 GB/s
  EXPECT_NEAR(two / one, 2.0, 1e-6);
}

TEST(Simulator, PresetsPredictFasterNvSwitchThanPcie) {
  Plan ring = compile(algorithms::build("ring_allreduce", 8)).plan;
  double nvs = simulate(ring, topo::preset("dgx-h100"), 256 << 20).time_us;
  double pcie = simulate(ring, topo::preset("pcie8"), 256 << 20).time_us;
  EXPECT_LT(nvs * 5, pcie);
  EXPECT_THROW(simulate(compile(algorithms::build("ring_allreduce", 16)).plan, topo::preset("dgx-h100"), 1024),
               InvalidArgument);
}

TEST(CostModel, CopyRateFollowsTheWorkingSetLogLinearly) {
  CostModel m;
  m.memory_gbps = 7;
  EXPECT_EQ(m.memory_rate_gbps(1 << 20), 7);  // no curve: the one rate
  m.memory_curve = {{1 << 10, 40}, {1 << 20, 10}};
  EXPECT_DOUBLE_EQ(m.memory_rate_gbps(100), 40);          // flat below the first point
  EXPECT_DOUBLE_EQ(m.memory_rate_gbps(1 << 30), 10);      // and beyond the last
  EXPECT_NEAR(m.memory_rate_gbps(32 << 10), 25, 1e-9);    // halfway in log size
  EXPECT_NEAR(m.reduce_rate_gbps(32 << 10), 25 / m.reduce_factor, 1e-9);  // no reduce curve
  m.reduce_curve = {{1 << 10, 20}};
  EXPECT_DOUBLE_EQ(m.reduce_rate_gbps(32 << 10), 20);
}

// Two ranks on one host whose shared-memory path has measured curves (as tuning::apply writes
// them): 1 us per KB up to 1 MiB, twice that per byte at 4 MiB (out of cache), 2 flows measured.
topo::Topology measured_host(const std::string& reduce_curve) {
  topo::Topology t;
  t.name = "measured";
  int host = t.add_device(topo::DeviceType::kHost, "host", -1, 0);
  int numa = t.add_device(topo::DeviceType::kNuma, "numa0", host, host);
  t.devices[numa].attrs["shm_gbps"] = "1";
  t.devices[numa].attrs["shm_curve"] = "4096:4.096,1048576:1048.576,4194304:8388.608";
  if (!reduce_curve.empty()) t.devices[numa].attrs["shm_reduce_curve"] = reduce_curve;
  t.devices[numa].attrs["shm_curve_flows"] = "2";
  t.rank_device = {numa, numa};
  return t;
}

TEST(Simulator, MeasuredCurveAtThePlansWorkingSet) {
  CostModel m;
  m.instruction_us = 0;
  m.memory_gbps = 1e12;
  const uint64_t bytes = 2u << 20;  // 1 MiB chunks
  // In place the plan touches 2 MiB per rank, as the 1 MiB measurement did: two steps of 1 MiB
  // at the curve's time.
  Plan inplace = compile(algorithms::build("ring_allreduce", 2, {{"inplace", 1}})).plan;
  EXPECT_NEAR(simulate(inplace, measured_host(""), bytes, m).time_us, 2 * 1048.576, 1e-3);
  // Out of place it touches 4 MiB, as the curve's 2 MiB message did (halfway between its points:
  // 3495.25 us), so each 1 MiB moves at that per-byte rate.
  Plan outofplace = compile(algorithms::build("ring_allreduce", 2, {{"inplace", 0}})).plan;
  const double step = (1048.576 + (8388.608 - 1048.576) / 3) / 2;
  EXPECT_NEAR(simulate(outofplace, measured_host(""), bytes, m).time_us, 2 * step, 1e-3);
  // A reducing receive adds what the reducing curve measured over the plain one (here 1.5x the
  // time at every size): the middle step's reduction costs half a step more.
  auto half_again = "4096:6.144,1048576:1572.864,4194304:12582.912";
  EXPECT_NEAR(simulate(outofplace, measured_host(half_again), bytes, m).time_us, 2.5 * step, 1e-3);
}

}  // namespace
