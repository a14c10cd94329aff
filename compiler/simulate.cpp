#include "compiler/simulate.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

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

Prediction simulate(const Plan& p, const topo::Topology& t, uint64_t bytes, const CostModel& m) {
  TUTTI_CHECK(t.nranks() >= p.nranks, InvalidArgument, "simulate: plan '{}' needs {} ranks, topology '{}' maps {}", p.name,
              p.nranks, t.name, t.nranks());
  const double chunk_bytes = static_cast<double>(bytes) / p.chunk_factor;
  std::vector<double> mem(p.nranks), red(p.nranks);  // copy and reduction rates, bytes per us, per rank
  std::vector<double> touched(p.nranks);  // bytes of buffers a rank's plan touches
  std::vector<bool> gpu(p.nranks, false), shares_gpu(p.nranks, false);
  const ProtocolCost& proto = m.protocol(p.protocol);
  for (int r = 0; r < p.nranks; ++r) {
    const topo::Device& d = t.devices[t.rank_device[r]];
    const RankPlan& rp = p.ranks[r];
    int64_t state_chunks = 0;  // the user's buffers of the call's chunk size (statistics are tiny)
    for (const StateBuffer& sb : p.states) state_chunks += sb.unit ? 0 : sb.chunks;
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
  std::map<int, Curve> curves, reduce_curves;  // virtual shm link id -> measured curves (plain, reducing receive)
  // Links of a rank-to-rank path; shared memory inside one device is a virtual link of that device.
  std::map<std::pair<int, int>, std::vector<std::pair<int, int>>> route;
  std::map<int, double> link_rate;  // bytes per us, per link id (virtual ids are negative)
  auto links_of = [&](int a, int b) -> const std::vector<std::pair<int, int>>& {
    auto key = std::make_pair(a, b);
    auto it = route.find(key);
    if (it != route.end()) return it->second;
    topo::Path path = t.path(a, b);
    std::vector<std::pair<int, int>> ls;
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
      int best = -1;
      for (size_t li = 0; li < t.links.size(); ++li) {
        const topo::Link& l = t.links[li];
        if (((l.a == u && l.b == v) || (l.a == v && l.b == u)) && (best < 0 || l.gbps > t.links[best].gbps))
          best = static_cast<int>(li);
      }
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
  };
  auto latency_of = [&](int a, int b) { return t.path(a, b).latency_us; };

  struct Block {
    const plan::Block* block;
    size_t pc = 0;
    double busy_until = 0;
    int waiting = -1;  // transfer this block's current send waits for
    bool running = false;
  };
  std::vector<std::vector<Block>> blocks(p.nranks);
  std::vector<std::map<int64_t, size_t>> index(p.nranks);
  for (int r = 0; r < p.nranks; ++r)
    for (size_t b = 0; b < p.ranks[r].blocks.size(); ++b) {
      blocks[r].push_back({&p.ranks[r].blocks[b]});
      index[r][p.ranks[r].blocks[b].id] = b;
    }
  std::vector<Transfer> transfers;
  std::map<std::tuple<int, int, int>, std::vector<int>> sent;  // connection -> transfers in order
  std::map<std::tuple<int, int, int>, size_t> received;        // connection -> receives started
  Prediction out;
  double now = 0;
  size_t total = 0, finished = 0;
  for (auto& rb : blocks)
    for (auto& b : rb) total += b.block->steps.size();

  while (finished < total) {
    // Start whatever can start now.
    bool started = true;
    while (started) {
      started = false;
      for (int r = 0; r < p.nranks; ++r)
        for (auto& b : blocks[r]) {
          if (b.running || b.pc >= b.block->steps.size() || b.busy_until > now) continue;
          const Instruction& in = b.block->steps[b.pc];
          bool ready = true;
          for (auto& d : in.deps)
            if (blocks[r][index[r].at(d.block)].pc <= static_cast<size_t>(d.step)) ready = false;
          if (!ready) continue;
          double local = 0;
          if (receives(in.op)) {
            auto key = std::make_tuple(in.recv_peer, r, b.block->channel);
            size_t k = received[key];
            auto& list = sent[key];
            if (k >= list.size() || transfers[list[k]].done > now) continue;  // not here yet
            received[key] = k + 1;
          }
          // A statistic's chunk (a state buffer with a unit) is a few elements, 8 bytes each at most.
          const BufferKind payload = in.dst ? in.dst->buffer : in.srcs.empty() ? BufferKind::kInput : in.srcs[0].buffer;
          double msg = p.unit(payload) ? static_cast<double>(in.count() * p.unit(payload)) * 8.0
                                       : static_cast<double>(in.count()) * chunk_bytes;
          if (in.op == Opcode::kCompute && in.dst)  // a kernel is costed by its output 0, 4-byte elements for a unit
            msg = p.unit(in.dst->buffer) ? static_cast<double>(in.count() * p.unit(in.dst->buffer)) * 4.0
                                         : static_cast<double>(in.count()) * chunk_bytes;
          if (in.op == Opcode::kCopy) local = msg / mem[r];
          if (in.op == Opcode::kCompute) {  // its registered cost
            const KernelDef& k = kernel_def(in.kernel);
            double cost = k.copy_cost;
            if (k.cost_of) {
              std::vector<double> values;
              for (const ScalarArg& a : in.scalars) values.push_back(a.slot >= 0 ? 0.0 : a.value);
              cost = k.cost_of(values.data());
            }
            local = cost * msg / mem[r];
          }
          if (in.op == Opcode::kReduce) local = msg / red[r];
          if (in.op == Opcode::kRecvReduceCopy || in.op == Opcode::kRecvReduceSend || in.op == Opcode::kRecvReduceCopySend) {
            // A reduction instead of the copy out: measured under load where the path has a
            // reducing curve, else the local rates' difference.
            local = std::max(0.0, msg / red[r] - msg / mem[r]);
            const auto& ls = links_of(in.recv_peer, r);
            if (ls.size() == 1 && reduce_curves.count(ls[0].first) && curves.count(ls[0].first))
              local = std::max(0.0, measured_us(reduce_curves.at(ls[0].first), msg, touched[r]) -
                                        measured_us(curves.at(ls[0].first), msg, touched[r]));
          }
          const double overhead = in.op == Opcode::kNop ? 0
                                  : shares_gpu[r]       ? kSharedGpuInstructionUs
                                  : receives(in.op)     ? m.instruction_us
                                                        : m.local_instruction_us.value_or(m.instruction_us);
          double begin = now + overhead + local;
          b.running = true;
          started = true;
          if (sends(in.op)) {
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
          } else {
            b.busy_until = begin;
          }
        }
    }
    // Rates of flowing transfers: each link's bandwidth shared equally among its transfers.
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
    // Advance to the next event.
    double dt = next - now;
    for (auto& x : transfers)
      if (x.done == kInf && x.start <= now) {
        x.left -= x.rate * dt;
        if (x.eta <= next || x.left <= 1e-9 * std::max(1.0, chunk_bytes)) {
          x.left = 0;
          x.done = next;
        }
      }
    now = next;
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
  out.time_us = now;
  return out;
}

}  // namespace tutti::plan
