#pragma once
// Predicted time of a Plan on a Topology: a discrete-event simulation of every block of every rank.
// An instruction starts when its dependencies are done, its block is free and (for a receive) its
// message has arrived; it costs the executor's per-instruction overhead, plus local work at memory
// bandwidth (copies, reductions), plus for a send a transfer along the topology path. A transfer
// delivers its bytes into the receiver's destination (what the calibration's exchange measures:
// the sender's copy in and the receiver's copy out), so a receive costs local work only for what it
// adds: a reduction reads one more operand, (reduce_factor - 1) copies. A transfer
// waits the path's latency, then moves its bytes at the path's bottleneck bandwidth, shared equally
// with every other transfer crossing the same link in the same direction at that moment (so two
// flows on one link each get half). Messages are store-and-forward per instruction (the model does
// not pipeline tiles), which makes a ring all-reduce cost exactly 2(n-1)/n * S/beta + 2(n-1)*alpha on
// a uniform fully connected topology.

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "plan/plan.hpp"
#include "topologies/topology.hpp"

namespace tutti::plan {

// What a protocol does to a message between GPU ranks (NCCL's model): the fraction of the link's
// bandwidth that carries data, and a fixed cost per message on top of the path's latency. LL sends
// 4 data bytes with every 4-byte flag and needs no handshake; LL128 carries 120 of every 128 bytes;
// Simple uses the whole bandwidth but pays a flag/fence handshake per message. CPU ranks have one
// protocol (the executor's FIFO), so the plan's protocol does not change their cost.
struct ProtocolCost {
  double bandwidth = 1.0;
  double latency_us = 0.0;
};

struct CostModel {
  ProtocolCost simple{1.0, 2.0}, ll{0.5, 0.0}, ll128{120.0 / 128.0, 0.6};
  const ProtocolCost& protocol(Protocol p) const {
    return p == Protocol::kLL ? ll : p == Protocol::kLL128 ? ll128 : simple;
  }
  double instruction_us = 1.0;  // executor overhead per instruction that receives
  // Per instruction that waits on no peer (local work, sends). With more ranks than cores a
  // receive's overhead includes being woken for its message, which these do not pay. Unset: the
  // same as instruction_us.
  std::optional<double> local_instruction_us;
  double memory_gbps = 10.0;    // local copies and reductions on CPU ranks; GPU ranks use copy and
                                // reduce rates measured on an H200 (simulate.cpp), scaled by HBM
                                // bandwidth for older generations
  // A CPU rank's copy rate depends on whether its buffers stay in cache: measured points (bytes a
  // rank touches -> GB/s, collectives/calibrate.hpp), log-linear between them and flat beyond.
  // Empty: memory_gbps at every size.
  std::vector<std::pair<uint64_t, double>> memory_curve;
  // The same for a reduction of two operands (GB/s of output). Empty: reduce_factor copies.
  std::vector<std::pair<uint64_t, double>> reduce_curve;
  double reduce_factor = 1.5;   // CPU ranks without a reduce curve: a reduction costs this many copies

  // The copy rate of a CPU rank whose plan touches `working_set` bytes.
  double memory_rate_gbps(double working_set) const;
  // Its reduction rate (GB/s of output).
  double reduce_rate_gbps(double working_set) const;
};

struct Prediction {
  double time_us = 0;
  int64_t transfers = 0;
  double bytes_moved = 0;
};

// `bytes` is the per-rank piece (NCCL's count x element size). Plan rank r runs on topology rank r,
// so the topology needs at least plan.nranks ranks. Throws InvalidArgument otherwise, or if the
// simulated plan stops (a deadlock the verifier would also report).
Prediction simulate(const Plan& plan, const topo::Topology& topology, uint64_t bytes, const CostModel& model = {});

}  // namespace tutti::plan
