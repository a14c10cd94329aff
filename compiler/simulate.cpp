#include "compiler/simulate.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>

#include "core/error.hpp"

namespace tutti::plan {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Transfer {
  std::vector<std::pair<int, int>> links;  // (link id, direction)
  double start = 0;    // when bytes begin to flow (after latency)
  double left = 0;     // bytes
  double done = kInf;  // completion time, once known
  double rate = 0;     // bytes/us now
  double eta = kInf;   // when it would finish at this rate
  int curve_link = 0;  // a shared-memory link with a measured curve (0: none)
  double curve_rate = 0;  // that link's capacity for this message's size (bytes/us)
};

// A measured time curve of a device's shared-memory path (attr "shm_curve": "size:us,size:us,...",
// from collectives/calibrate.hpp): one-way time per message size while `flows` messages move at
// once (attr "shm_curve_flows"). Linear between points, the last slope beyond them.
struct Curve {
  std::vector<std::pair<double, double>> points;
  double flows = 1;
  double time_us(double bytes) const {
    if (points.size() == 1 || bytes <= points.front().first) return points.front().second;
    size_t k = 1;
    while (k + 1 < points.size() && points[k].first < bytes) ++k;
    auto [s0, t0] = points[k - 1];
    auto [s1, t1] = points[k];
    return t0 + (bytes - s0) * (t1 - t0) / (s1 - s0);
  }
};

Curve parse_curve(const topo::Device& d, const std::string& attr) {
  Curve c;
  auto it = d.attrs.find(attr);
  if (it == d.attrs.end()) return c;
  std::string text = it->second;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t comma = text.find(',', pos);
    std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    size_t colon = item.find(':');
    TUTTI_CHECK(colon != std::string::npos, InvalidArgument, "device {}: {} item '{}' is not size:us", d.name, attr, item);
    c.points.emplace_back(std::atof(item.substr(0, colon).c_str()), std::atof(item.substr(colon + 1).c_str()));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  std::sort(c.points.begin(), c.points.end());
  auto f = d.attrs.find("shm_curve_flows");
  if (f != d.attrs.end()) c.flows = std::max(1.0, std::atof(f->second.c_str()));
  return c;
}

// The curve's time for a message of `msg` bytes on a rank whose plan touches `touched` bytes. The
// measurement of a message touched twice its size per rank; a plan whose buffers are larger (out
// of cache where the measurement was not) moves its bytes no faster than the measured message that
// touched as much.
double measured_us(const Curve& c, double msg, double touched) {
  double us = c.time_us(msg);
  if (touched > 2 * msg) us = std::max(us, msg * c.time_us(touched / 2) / (touched / 2));
  return us;
}

}  // namespace

namespace {

// GPU ranks. Measured on the lent H200 (2026-12, `tools/gpu/check.sh bench`), several ranks sharing
// the one GPU as threads of one process (copy rate and all-reduce times: docs/PERFORMANCE.md;
// reduction: tutti-device-reduce-bench's "/ copy" column):
// - device-to-device cudaMemcpy of 1 GiB: 4271 GB/s counting bytes read and written, so 2135 GB/s
//   of bytes copied (what a copy instruction's time is charged at);
// - the device interpreter's float32 reduction (out = a + b, 3 bytes moved per byte of output) at
//   85 % of that rate: 1210 GB/s of output, 1.76 copies' time rather than the CPU's reduce_factor;
// - all_reduce of 8 B (allpairs, LL): 8.8 us with 2 ranks, 24.5 us with 4.
constexpr double kH200CopyReadWriteGbps = 4271;
constexpr double kH200CopyGbps = kH200CopyReadWriteGbps / 2;
constexpr double kH200ReduceGbps = 0.85 * kH200CopyReadWriteGbps / 3;
// Other generations were not measured: the H200's rates scaled by datasheet HBM bandwidth (A100
// SXM 80 GB 2039 GB/s, V100 900 GB/s, H200 4800 GB/s), i.e. the same fraction of the peak. sm 90
// also covers the H100, whose HBM3 (3350 GB/s) is 30 % slower; the model does not tell them apart.
constexpr double kH200HbmGbps = 4800, kA100HbmGbps = 2039, kV100HbmGbps = 900;
// Cost of each instruction of a GPU rank that shares its GPU with other ranks, in place of the CPU
// executor's instruction_us: the interpreter's barriers and flag polling around every step, a share
// of the launch, and the other ranks' kernels competing for the same SMs. One figure fitted to the
// 8 B all-reduces above (their critical paths have 2 and 5 instructions, plus 0.3 us of latency):
// the model gives 9.3 us (+6 %) and 22.8 us (-7 %). Ranks on GPUs of their own were not measured
// (one GPU was lent), so they keep instruction_us rather than a figure that includes the sharing.
constexpr double kSharedGpuInstructionUs = 4.5;

struct GpuRates {
  double copy_gbps, reduce_gbps;  // bytes copied, bytes of reduction output
};

GpuRates gpu_rates(int sm) {
  const double hbm = sm >= 90 ? kH200HbmGbps : sm >= 80 ? kA100HbmGbps : kV100HbmGbps;
  return {kH200CopyGbps * hbm / kH200HbmGbps, kH200ReduceGbps * hbm / kH200HbmGbps};
}

// Log-linear in the working set between measured points, flat beyond them; `fallback` without any.
double rate_at(const std::vector<std::pair<uint64_t, double>>& curve, double working_set, double fallback) {
  if (curve.empty()) return fallback;
  if (working_set <= static_cast<double>(curve.front().first)) return curve.front().second;
  for (size_t k = 1; k < curve.size(); ++k) {
    auto [s1, g1] = curve[k];
    if (working_set > static_cast<double>(s1)) continue;
    auto [s0, g0] = curve[k - 1];
    const double f = std::log(working_set / static_cast<double>(s0)) / std::log(static_cast<double>(s1) / static_cast<double>(s0));
    return g0 + f * (g1 - g0);
  }
  return curve.back().second;
}
}  // namespace

double CostModel::memory_rate_gbps(double working_set) const { return rate_at(memory_curve, working_set, memory_gbps); }

double CostModel::reduce_rate_gbps(double working_set) const {
  return rate_at(reduce_curve, working_set, memory_rate_gbps(working_set) / reduce_factor);
}

namespace {

using Route = std::vector<std::pair<int, int>>;  // (link id, direction) of each hop
using Connection = std::tuple<int, int, int>;     // (sender, receiver, channel)

// The discrete-event simulation of one plan on one topology (simulate.hpp): each rank's rates and
// each block's progress, then events until every instruction of every block has finished.
struct Simulator {
  struct BlockState {
    const plan::Block* block;
    size_t pc = 0;
    double busy_until = 0;
    int waiting = -1;  // transfer this block's current send waits for
    bool running = false;
  };

  const Plan& p;
  const topo::Topology& t;
  const CostModel& m;
  const double chunk_bytes;
  const ProtocolCost& proto;
  std::vector<double> mem, red;  // copy and reduction rates, bytes per us, per rank
  std::vector<double> touched;   // bytes of buffers a rank's plan touches
  std::vector<bool> gpu, shares_gpu;
  std::map<int, Curve> curves, reduce_curves;  // virtual shm link id -> measured curves (plain, reducing receive)
  // Links of a rank-to-rank path; shared memory inside one device is a virtual link of that device.
  std::map<std::pair<int, int>, Route> route;
  std::map<int, double> link_rate;  // bytes per us, per link id (virtual ids are negative)
  std::vector<std::vector<BlockState>> blocks;
  std::vector<std::map<int64_t, size_t>> index;
  std::vector<Transfer> transfers;
  std::map<Connection, std::vector<int>> sent;  // connection -> transfers in order
  std::map<Connection, size_t> received;        // connection -> receives started
  Prediction out;
  double now = 0;
  size_t total = 0, finished = 0;

  Simulator(const Plan& plan, const topo::Topology& topology, uint64_t bytes, const CostModel& model)
      : p(plan),
        t(topology),
        m(model),
        chunk_bytes(static_cast<double>(bytes) / plan.chunk_factor),
        proto(model.protocol(plan.protocol)),
        mem(plan.nranks),
        red(plan.nranks),
        touched(plan.nranks),
        gpu(plan.nranks, false),
        shares_gpu(plan.nranks, false),
        blocks(plan.nranks),
        index(plan.nranks) {
    set_up_ranks();
    set_up_blocks();
  }

  // Set-up: each rank's copy and reduction rates, from its device (GPU) or from the cost model at
  // the bytes its plan touches (CPU).
  void set_up_ranks() {
    int64_t state_chunks = 0;  // the user's buffers of the call's chunk size (statistics are tiny)
    for (const StateBuffer& sb : p.states) state_chunks += sb.unit ? 0 : sb.chunks;
    for (int r = 0; r < p.nranks; ++r) {
      const topo::Device& d = t.devices[t.rank_device[r]];
      const RankPlan& rp = p.ranks[r];
      touched[r] =
          static_cast<double>((p.inplace ? std::max(rp.input_chunks, rp.output_chunks) : rp.input_chunks + rp.output_chunks) +
                              rp.scratch_chunks + state_chunks) * chunk_bytes;
      double gbps = m.memory_rate_gbps(touched[r]);
      double reduce_gbps = m.reduce_rate_gbps(touched[r]);
      if (d.type == topo::DeviceType::kGpu) {
        gpu[r] = true;
        for (int q = 0; q < p.nranks; ++q) shares_gpu[r] = shares_gpu[r] || (q != r && t.rank_device[q] == t.rank_device[r]);
        auto it = d.attrs.find("sm");
        const GpuRates g = gpu_rates(it == d.attrs.end() ? 80 : std::atoi(it->second.c_str()));
        gbps = g.copy_gbps;
        reduce_gbps = g.reduce_gbps;
      }
      mem[r] = gbps * 1e3;
      red[r] = reduce_gbps * 1e3;
    }
  }

  // Set-up: every block at its first instruction, and where each block id sits in its rank.
  void set_up_blocks() {
    for (int r = 0; r < p.nranks; ++r)
      for (size_t b = 0; b < p.ranks[r].blocks.size(); ++b) {
        blocks[r].push_back({&p.ranks[r].blocks[b]});
        index[r][p.ranks[r].blocks[b].id] = b;
        total += p.ranks[r].blocks[b].steps.size();
      }
  }

  // The widest link between devices u and v (-1: none).
  int widest_link(int u, int v) const {
    int best = -1;
    for (size_t li = 0; li < t.links.size(); ++li) {
      const topo::Link& l = t.links[li];
      if (((l.a == u && l.b == v) || (l.a == v && l.b == u)) && (best < 0 || l.gbps > t.links[best].gbps))
        best = static_cast<int>(li);
    }
    return best;
  }

  // The route from rank a to rank b, worked out on its first use.
  const Route& links_of(int a, int b) {
    auto key = std::make_pair(a, b);
    auto it = route.find(key);
    if (it != route.end()) return it->second;
    topo::Path path = t.path(a, b);
    Route ls;
    if (path.devices.size() == 1) {
      int id = -1 - path.devices[0];
      link_rate[id] = path.gbps * 1e3;
      ls.push_back({id, 0});
      Curve c = parse_curve(t.devices[path.devices[0]], "shm_curve");
      if (!c.points.empty()) curves[id] = c;
      Curve rc = parse_curve(t.devices[path.devices[0]], "shm_reduce_curve");
      if (!rc.points.empty()) reduce_curves[id] = rc;
    }
    for (size_t h = 0; h + 1 < path.devices.size(); ++h) {
      int u = path.devices[h], v = path.devices[h + 1];
      int best = widest_link(u, v);
      link_rate[best] = t.links[best].gbps * 1e3;
      ls.push_back({best, u < v ? 0 : 1});
    }
    // A path between GPUs on the same NVSwitches uses all of them: the sender's egress into the
    // switch fabric and the receiver's ingress, each that wide and shared by every flow through it
    // (so an all-pairs step splits a GPU's NVLink bandwidth among its peers).
    if (path.hops.size() == 2 && path.hops[0] == topo::LinkType::kNvLink && path.gbps * 1e3 > link_rate[ls[0].first]) {
      int egress = -1000000 - 2 * t.rank_device[a], ingress = -1000000 - 2 * t.rank_device[b] - 1;
      link_rate[egress] = link_rate[ingress] = path.gbps * 1e3;
      ls = {{egress, 0}, {ingress, 0}};
    }
    return route.emplace(key, ls).first->second;
  }

  double latency_of(int a, int b) const { return t.path(a, b).latency_us; }

  // Event loop: start what can start, move to the next event, until every instruction finished.
  void run() {
    while (finished < total) {
      // Start whatever can start now.
      while (start_ready()) {
      }
      advance(next_event());
    }
  }

  // One pass over every block, starting each instruction that can start now; true if any did
  // (which may let another start).
  bool start_ready() {
    bool started = false;
    for (int r = 0; r < p.nranks; ++r)
      for (BlockState& b : blocks[r])
        if (try_start(r, b)) started = true;
    return started;
  }

  // Step issue: starts block b's next instruction on rank r if it is ready now.
  bool try_start(int r, BlockState& b) {
    if (b.running || b.pc >= b.block->steps.size() || b.busy_until > now) return false;
    const Instruction& in = b.block->steps[b.pc];
    if (!deps_done(r, in)) return false;
    if (receives(in.op) && !take_message(r, in, b.block->channel)) return false;
    const double msg = message_bytes(in);
    const double local = local_us(r, in, msg);
    double begin = now + overhead_us(r, in) + local;
    b.running = true;
    if (sends(in.op))
      send(r, b, in, begin, msg);
    else
      b.busy_until = begin;
    return true;
  }

  // Every dependency is looked up, even past one not yet done (an unknown block throws).
  bool deps_done(int r, const Instruction& in) const {
    bool ready = true;
    for (auto& d : in.deps)
      if (blocks[r][index[r].at(d.block)].pc <= static_cast<size_t>(d.step)) ready = false;
    return ready;
  }

  // A receive takes the next transfer sent on its connection, once that has arrived.
  bool take_message(int r, const Instruction& in, int channel) {
    auto key = std::make_tuple(in.recv_peer, r, channel);
    size_t k = received[key];
    auto& list = sent[key];
    if (k >= list.size() || transfers[list[k]].done > now) return false;  // not here yet
    received[key] = k + 1;
    return true;
  }

  // Bytes of `count` chunks of buffer `buffer`; a chunk of a state buffer with a unit is that many
  // elements of `element_bytes`.
  double chunks_bytes(BufferKind buffer, int64_t count, double element_bytes) const {
    return p.unit(buffer) ? static_cast<double>(count * p.unit(buffer)) * element_bytes
                          : static_cast<double>(count) * chunk_bytes;
  }

  double message_bytes(const Instruction& in) const {
    if (in.op == Opcode::kCompute && in.dst)  // a kernel is costed by its output 0, 4-byte elements for a unit
      return chunks_bytes(in.dst->buffer, in.count(), 4.0);
    // A statistic's chunk (a state buffer with a unit) is a few elements, 8 bytes each at most.
    const BufferKind payload = in.dst ? in.dst->buffer : in.srcs.empty() ? BufferKind::kInput : in.srcs[0].buffer;
    return chunks_bytes(payload, in.count(), 8.0);
  }

  // A compute instruction's registered cost, in copies of its output.
  static double compute_cost(const Instruction& in) {
    const KernelDef& k = kernel_def(in.kernel);
    double cost = k.copy_cost;
    if (k.cost_of) {
      std::vector<double> values;
      for (const ScalarArg& a : in.scalars) values.push_back(a.slot >= 0 ? 0.0 : a.value);
      cost = k.cost_of(values.data());
    }
    return cost;
  }

  // Local work at memory bandwidth of an instruction moving `msg` bytes on rank r.
  double local_us(int r, const Instruction& in, double msg) {
    if (in.op == Opcode::kCopy) return msg / mem[r];
    if (in.op == Opcode::kCompute) return compute_cost(in) * msg / mem[r];
    if (in.op == Opcode::kReduce) return msg / red[r];
    if (in.op == Opcode::kRecvReduceCopy || in.op == Opcode::kRecvReduceSend || in.op == Opcode::kRecvReduceCopySend) {
      // A reduction instead of the copy out: measured under load where the path has a
      // reducing curve, else the local rates' difference.
      double local = std::max(0.0, msg / red[r] - msg / mem[r]);
      const auto& ls = links_of(in.recv_peer, r);
      if (ls.size() == 1 && reduce_curves.count(ls[0].first) && curves.count(ls[0].first))
        local = std::max(0.0, measured_us(reduce_curves.at(ls[0].first), msg, touched[r]) -
                                  measured_us(curves.at(ls[0].first), msg, touched[r]));
      return local;
    }
    return 0;
  }

  // The executor's overhead for an instruction on rank r.
  double overhead_us(int r, const Instruction& in) const {
    return in.op == Opcode::kNop ? 0
           : shares_gpu[r]       ? kSharedGpuInstructionUs
           : receives(in.op)     ? m.instruction_us
                                 : m.local_instruction_us.value_or(m.instruction_us);
  }

  // A send's transfer of `msg` bytes, from when its local work ends (`begin`); its block waits for it.
  void send(int r, BlockState& b, const Instruction& in, double begin, double msg) {
    Transfer x;
    x.links = links_of(r, in.send_peer);
    x.start = begin + latency_of(r, in.send_peer) + (gpu[r] ? proto.latency_us : 0.0);
    x.left = gpu[r] ? msg / proto.bandwidth : msg;  // line overhead rides along with the data
    if (x.links.size() == 1 && curves.count(x.links[0].first)) {
      // Measured: the curve's time for this size when as many flows share the path as
      // during the measurement, latency included.
      const Curve& c = curves.at(x.links[0].first);
      x.start = begin;
      x.curve_link = x.links[0].first;
      x.curve_rate = c.flows * std::max(msg, 1.0) / std::max(measured_us(c, msg, touched[r]), 1e-6);
      x.left = std::max(msg, 1.0);
    }
    transfers.push_back(x);
    int id = static_cast<int>(transfers.size()) - 1;
    sent[{r, in.send_peer, b.block->channel}].push_back(id);
    b.waiting = id;
    ++out.transfers;
    out.bytes_moved += msg;
  }

  // Rates of flowing transfers: each link's bandwidth shared equally among its transfers. Returns
  // the earliest time a transfer starts flowing or would finish at these rates.
  double share_links() {
    std::map<std::pair<int, int>, int> users;
    for (auto& x : transfers)
      if (x.done == kInf && x.start <= now)
        for (auto& l : x.links) ++users[l];
    double next = kInf;
    for (auto& x : transfers) {
      if (x.done != kInf) continue;
      if (x.start > now) {
        next = std::min(next, x.start);
        continue;
      }
      x.rate = kInf;
      for (auto& l : x.links)
        x.rate = std::min(x.rate, (l.first == x.curve_link && x.curve_link != 0 ? x.curve_rate : link_rate[l.first]) / users[l]);
      // At tiny sizes now + left / rate can round to now: the completion time decides, not `left`.
      x.eta = x.left <= 0 ? now : now + x.left / x.rate;
      next = std::min(next, x.eta);
    }
    return next;
  }

  // The time of the next event; throws if there is none (the plan stops).
  double next_event() {
    double next = share_links();
    for (auto& rb : blocks)
      for (auto& b : rb)
        if (b.running && b.waiting < 0) next = std::min(next, b.busy_until);
    // Instructions whose send finished complete now.
    for (auto& rb : blocks)
      for (auto& b : rb)
        if (b.running && b.waiting >= 0 && transfers[b.waiting].done <= now) next = std::min(next, now);
    if (next == kInf)
      throw InvalidArgument(fmt::format("simulate: plan '{}' stops at {:.1f} us (unmatched receive or dependency cycle)",
                                        p.name, now));
    return next;
  }

  // Advance to the next event: transfers move their bytes, then instructions done by then complete.
  void advance(double next) {
    complete_transfers(next);
    now = next;
    complete_instructions();
  }

  // Transfer completion: bytes flowed until `next`, and the transfers that finish by then.
  void complete_transfers(double next) {
    double dt = next - now;
    for (auto& x : transfers)
      if (x.done == kInf && x.start <= now) {
        x.left -= x.rate * dt;
        if (x.eta <= next || x.left <= 1e-9 * std::max(1.0, chunk_bytes)) {
          x.left = 0;
          x.done = next;
        }
      }
  }

  void complete_instructions() {
    for (auto& rb : blocks)
      for (auto& b : rb) {
        if (!b.running) continue;
        bool done = b.waiting >= 0 ? transfers[b.waiting].done <= now : b.busy_until <= now;
        if (!done) continue;
        b.running = false;
        b.waiting = -1;
        b.busy_until = now;
        ++b.pc;
        ++finished;
      }
  }

  // The final report: when the last instruction finished, and what moved.
  Prediction report() {
    out.time_us = now;
    return out;
  }
};

}  // namespace

Prediction simulate(const Plan& p, const topo::Topology& t, uint64_t bytes, const CostModel& m) {
  TUTTI_CHECK(t.nranks() >= p.nranks, InvalidArgument, "simulate: plan '{}' needs {} ranks, topology '{}' maps {}", p.name,
              p.nranks, t.name, t.nranks());
  Simulator sim(p, t, bytes, m);
  sim.run();
  return sim.report();
}

}  // namespace tutti::plan
