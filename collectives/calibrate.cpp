#include "collectives/calibrate.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "collectives/algorithms/registry.hpp"
#include "collectives/oneshot.hpp"
#include "collectives/tuner.hpp"
#include "compiler/compile.hpp"
#include "compiler/verify.hpp"
#include "core/env.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/reduce.hpp"
#include "runtime/cpu_executor.hpp"
#include "runtime/wire.hpp"

namespace tutti::tuning {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

double us_since(Clock::time_point t0) { return std::chrono::duration<double, std::micro>(Clock::now() - t0).count(); }

// The median of `rounds` values: what a run of calls typically sees (tutti-perf reports means), not
// the luckiest round.
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}
constexpr int kRounds = 5;

// One-way time of `bytes` between this rank and its partner (rank ^ 1), median of a few rounds of
// `iters` round trips; ranks without a partner return 0.
double pingpong(Communicator& comm, uint64_t bytes, int iters) {
  const int me = comm.rank(), peer = me ^ 1;
  std::vector<unsigned char> buf(std::max<uint64_t>(bytes, 1));
  std::vector<double> rounds;
  for (int round = 0; round < kRounds; ++round) {
    comm.barrier();
    if (peer >= comm.size()) continue;
    auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) {
      if (me < peer) {
        comm.send(peer, buf.data(), bytes);
        comm.recv(peer, buf.data(), bytes);
      } else {
        comm.recv(peer, buf.data(), bytes);
        comm.send(peer, buf.data(), bytes);
      }
    }
    rounds.push_back(us_since(t0) / iters / 2);
  }
  return peer >= comm.size() ? 0 : median(rounds);
}

// Per-direction bandwidth (GB/s) while every rank sends `bytes` to the next rank and receives as
// much from the previous one at the same time, as the steps of a ring do (with 2 ranks: its
// partner both ways). Receives as large as the executor's streaming threshold are streamed, as the
// executor's are.
// With `reduce`, the receive sums what arrives with a local float array (recv_reduce), as a
// reduce-scatter step does.
double exchange_rate(Communicator& comm, uint64_t bytes, int iters, bool reduce = false) {
  const int n = comm.size(), me = comm.rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  std::vector<unsigned char> out(bytes, 1), in(bytes), local(reduce ? bytes : 0, 0);
  const uint64_t threshold = CpuExecutorOptions::from_env().stream_threshold.value_or(default_stream_threshold(comm.local_ranks()));
  const bool stream = threshold > 0 && bytes >= threshold;
  std::vector<double> rounds;
  Connection& tx = comm.connection(next, 0);
  Connection& rx = comm.connection(prev, 0);
  for (int round = 0; round < kRounds; ++round) {
    comm.barrier();
    auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) {
      Ticket s = tx.send(out.data(), bytes);
      Ticket r = reduce ? rx.recv_reduce(in.data(), local.data(), bytes, RedOp::kSum, DataType::kFloat32)
                        : rx.recv(in.data(), bytes, stream);
      comm.wait_send(next, s);
      comm.wait_recv(prev, r);
    }
    rounds.push_back(us_since(t0) / iters);
  }
  return static_cast<double>(bytes) / median(rounds) / 1e3;
}

// A rank's rate (GB/s of output) per size while every rank copies, or sums two float arrays, at
// once: (bytes a rank touches, rate); a copy touches twice its size, a sum three times. A round
// lasts from the first rank's start to the last rank's end on the host's monotonic clock, which all
// ranks share, so a rank that the scheduler holds back (more ranks than cores) lengthens the round
// instead of hiding; the median round counts.
std::vector<std::pair<uint64_t, double>> rates_at_once(Communicator& comm, bool sum) {
  using Ns = std::chrono::nanoseconds;
  const std::vector<uint64_t> sizes = {32u << 10, 128u << 10, 512u << 10, 2u << 20, 8u << 20, 32u << 20};
  std::vector<float> a(sizes.back() / sizeof(float), 1.0f), b(a.size(), 2.0f), c(a.size(), 0.0f);
  auto once = [&](uint64_t bytes, int i) {
    float* dst = i % 2 ? a.data() : b.data();
    const float* src = i % 2 ? b.data() : a.data();
    if (sum)
      combine(RedOp::kSum, DataType::kFloat32, c.data(), dst, src, bytes / sizeof(float));
    else
      std::memcpy(dst, src, bytes);
  };
  std::vector<int> iters(sizes.size());
  wire::Writer w;
  for (size_t k = 0; k < sizes.size(); ++k) {
    const uint64_t bytes = sizes[k];
    iters[k] = static_cast<int>(std::max<uint64_t>(1, (16u << 20) / bytes));
    once(bytes, 0);  // fault in and warm
    for (int round = 0; round < kRounds; ++round) {
      comm.barrier();
      const auto t0 = Clock::now();
      for (int i = 0; i < iters[k]; ++i) once(bytes, i);
      const auto t1 = Clock::now();
      w.put<int64_t>(std::chrono::duration_cast<Ns>(t0.time_since_epoch()).count())
          .put<int64_t>(std::chrono::duration_cast<Ns>(t1.time_since_epoch()).count());
    }
  }
  auto all = comm.bootstrap().allgather(w.bytes());
  std::vector<wire::Reader> readers;
  for (auto& bytes : all) readers.emplace_back(bytes, "calibration copy rates");
  std::vector<std::pair<uint64_t, double>> out;
  for (size_t k = 0; k < sizes.size(); ++k) {
    std::vector<double> rates;
    for (int round = 0; round < kRounds; ++round) {
      int64_t first = INT64_MAX, last = INT64_MIN;
      for (auto& rd : readers) {
        first = std::min(first, rd.get<int64_t>());
        last = std::max(last, rd.get<int64_t>());
      }
      rates.push_back(static_cast<double>(sizes[k]) * iters[k] / std::max<double>(1, static_cast<double>(last - first)));
    }
    out.emplace_back((sum ? 3 : 2) * sizes[k], median(rates));  // bytes per ns = GB/s
  }
  return out;
}

// The ring all-reduce (out of place) the calibration times the executor with.
std::shared_ptr<const PreparedPlan> ring_allreduce(int nranks) {
  return PreparedPlan::make(plan::compile(algorithms::build("ring_allreduce", nranks, {{"inplace", 0}})).plan);
}

// Each way's time relative to the fastest way, as the geometric mean over the rows (workloads or
// sizes) of times[row][way] / that row's fastest.
std::vector<double> relative_times(const std::vector<std::vector<double>>& times) {
  std::vector<double> rel(times.empty() ? 0 : times[0].size(), 0.0);
  for (const auto& row : times) {
    const double best = *std::min_element(row.begin(), row.end());
    for (size_t i = 0; i < rel.size(); ++i) rel[i] += std::log(row[i] / best);
  }
  for (double& r : rel) r = std::exp(r / static_cast<double>(times.size()));
  return rel;
}

// The polling window: a ring all-reduce of 8 B (2(n-1) dependent hops: what sleeping between
// messages costs) and of 256 KiB (a pipeline of tiles) under each window, interleaved. Fills
// spin_points (relative to the fastest window, the geometric mean over the two) and wake_us.
void measure_spin(Communicator& comm, Calibration& c) {
  const int n = comm.size();
  const std::vector<int> windows = {0, 20, 50, 100, 200, 500, 1000};
  auto ring = ring_allreduce(n);
  CpuExecutor ex(comm, CpuExecutorOptions::from_env());
  const int64_t small = std::max<int64_t>(2, ring->plan.chunk_factor);
  const int64_t large = std::max<int64_t>((256 << 10) / 4 / ring->plan.chunk_factor, 1) * ring->plan.chunk_factor;
  std::vector<float> in(static_cast<size_t>(large), 1.0f), out(static_cast<size_t>(large));
  ExecArgs a;
  a.input = in.data();
  a.output = out.data();
  a.reduction.op = RedOp::kSum;
  a.reduction.type = DataType::kFloat32;
  const int was = *comm.options().spin;
  std::vector<std::vector<std::function<void()>>> runs(2);
  for (int w : windows) {
    runs[0].push_back([&, w] {
      comm.set_spin(w);
      ExecArgs x = a;
      x.count = small;
      ex.run(*ring, x);
    });
    runs[1].push_back([&, w] {
      comm.set_spin(w);
      ExecArgs x = a;
      x.count = large;
      ex.run(*ring, x);
    });
  }
  std::vector<std::vector<FunctionRef<void()>>> ways(2);
  for (size_t k = 0; k < 2; ++k)
    for (auto& r : runs[k]) {
      r();
      ways[k].emplace_back(r);
    }
  auto times = interleaved_sweep(comm, ways, kRounds, {100, 10});
  comm.set_spin(was);
  const std::vector<double> rel = relative_times(times);
  c.spin_points.clear();
  for (size_t i = 0; i < windows.size(); ++i) c.spin_points.push_back({windows[i], rel[i]});
  // Sleeping at every wait (window 0) against the best window, per hop of the 8 B ring.
  const double best = *std::min_element(times[0].begin(), times[0].end());
  c.wake_us = std::max(0.0, (times[0][0] - best) / (2.0 * (n - 1)));
  c.spin_us = choose_spin(c.spin_points, c.wake_us);
}

// FIFO layouts, then tiles (calibrate.hpp). The default layout and tile come first in their lists.
void measure_fifo_and_tile(Communicator& comm, Calibration& c) {
  struct Layout {
    uint32_t slots;
    uint64_t slot_bytes;
  };
  const std::vector<Layout> layouts = {{CommOptions::kDefaultShmSlots, CommOptions::kDefaultShmSlotSize},
                                       {16, 32u << 10},
                                       {16, 64u << 10},
                                       {32, 64u << 10},
                                       {8, 256u << 10},
                                       {4, 512u << 10}};
  // Ranks that are threads of one process pass messages of 32 KiB and more by address: the FIFO
  // carries only small ones there, and a layout chosen on them would be noise.
  bool processes = false;
  for (int p = 0; p < comm.size(); ++p) processes |= comm.peer_info(p).pid != comm.peer_info(comm.rank()).pid;
  std::vector<std::unique_ptr<Communicator>> children;
  for (const Layout& l : layouts) {
    if (!processes && !children.empty()) break;  // the default layout only, for the tiles
    CommOptions o = comm.options();
    o.shm_slots = l.slots;
    o.shm_slot_size = l.slot_bytes;
    // As the runtime will move them: by single copy from the calibrated size.
    if (c.single_copy_threshold != 0) o.shm_single_copy_threshold = c.single_copy_threshold;
    children.push_back(comm.split(0, comm.rank(), o));
  }
  size_t chosen = 0;
  if (processes) {
    const std::vector<uint64_t> sizes = {64u << 10, 1u << 20, 16u << 20};
    std::vector<unsigned char> out(sizes.back(), 1), in(sizes.back());
    std::vector<std::vector<std::function<void()>>> runs(sizes.size());
    for (size_t k = 0; k < sizes.size(); ++k)
      for (auto& child : children) {
        Communicator* ch = child.get();
        const uint64_t bytes = sizes[k];
        runs[k].push_back([ch, bytes, &out, &in] {
          const int n = ch->size(), me = ch->rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
          Ticket s = ch->connection(next, 0).send(out.data(), bytes);
          Ticket r = ch->connection(prev, 0).recv(in.data(), bytes, false);
          ch->wait_send(next, s);
          ch->wait_recv(prev, r);
        });
      }
    std::vector<std::vector<FunctionRef<void()>>> ways(sizes.size());
    for (size_t k = 0; k < sizes.size(); ++k)
      for (auto& r : runs[k]) {
        r();  // fault the FIFO in
        ways[k].emplace_back(r);
      }
    auto times = interleaved_sweep(comm, ways, kRounds, {100, 10, 2});
    const std::vector<double> relative = relative_times(times);
    c.fifo_points.clear();
    for (size_t i = 0; i < layouts.size(); ++i) c.fifo_points.push_back({layouts[i].slots, layouts[i].slot_bytes, relative[i]});
    chosen = choose_setting(relative, 0);
    c.fifo_slots = layouts[chosen].slots;
    c.fifo_slot_bytes = layouts[chosen].slot_bytes;
  }

  // Tiles, on the chosen layout: a ring all-reduce of 16 MiB.
  Communicator& on = *children[chosen];
  const std::vector<int64_t> tiles = {CpuExecutorOptions::kDefaultTileBytes, 256 << 10, 512 << 10, 2 << 20, 4 << 20};
  auto ring = ring_allreduce(on.size());
  const int64_t factor = ring->plan.chunk_factor;
  const int64_t count = (16 << 20) / 4 / factor * factor;
  std::vector<float> a(static_cast<size_t>(count), 1.0f), b(static_cast<size_t>(count));
  CpuExecutor ex(on, CpuExecutorOptions::from_env());
  ExecArgs args;
  args.input = a.data();
  args.output = b.data();
  args.count = count;
  args.reduction.op = RedOp::kSum;
  args.reduction.type = DataType::kFloat32;
  std::vector<std::function<void()>> tile_runs;
  for (int64_t t : tiles)
    tile_runs.push_back([&ex, &ring, &args, t] {
      ex.set_tile_bytes(t);
      ex.run(*ring, args);
    });
  std::vector<FunctionRef<void()>> tile_ways;
  for (auto& r : tile_runs) {
    r();
    tile_ways.emplace_back(r);
  }
  const std::vector<double> tile_rel = relative_times({interleaved_medians(comm, tile_ways, kRounds, 2)});
  c.tile_points.clear();
  for (size_t i = 0; i < tiles.size(); ++i) c.tile_points.push_back({tiles[i], tile_rel[i]});
  c.tile_bytes = tiles[choose_setting(tile_rel, 0)];
}

// The one-shot mailbox against the dispatcher's default plan, per collective, at sizes that fit.
void measure_oneshot(Communicator& comm, Calibration& c) {
  Mailbox* mb = comm.mailbox();
  if (!mb) return;
  const int n = comm.size();
  c.oneshot.clear();
  for (Collective coll : {Collective::kAllReduce, Collective::kAllGather, Collective::kReduceScatter,
                          Collective::kBroadcast, Collective::kReduce, Collective::kAllToAll}) {
    std::vector<uint64_t> sizes;
    std::vector<std::vector<Candidate>> cands;
    std::vector<int> iters;
    for (uint64_t s = 64; s <= (128u << 10); s *= s < (16u << 10) ? 4 : 2) {
      // nccl-tests' size is the whole input or output; a scaled collective's count is one rank's piece.
      const bool scaled = coll == Collective::kAllGather || coll == Collective::kReduceScatter || coll == Collective::kAllToAll;
      const uint64_t count = (scaled ? s / static_cast<uint64_t>(n) : s) / 4;
      if (count == 0) continue;
      if (!oneshot_fits(*mb, coll, static_cast<int64_t>(count), 4)) break;
      sizes.push_back(s);
      cands.push_back({Candidate{kOneShot, {}}, Candidate{algorithms::default_algorithm(coll, s, n, comm.crowded_host()), {}}});
      iters.push_back(s <= (4u << 10) ? 100 : 20);
    }
    if (sizes.empty()) continue;
    auto ranked = measure_sweep(comm, coll, sizes, cands, iters, 2, kRounds);
    Calibration::OneShotCut cut;
    cut.collective = coll;
    for (size_t i = 0; i < sizes.size(); ++i) {
      double one = 0, plan = 0;
      for (auto& r : ranked[i]) (r.candidate.algorithm == kOneShot ? one : plan) = r.time_us;
      if (one >= 1e300 || plan >= 1e300) continue;  // a path that cannot take this size
      cut.points.push_back({sizes[i], {one, plan}});
    }
    cut.threshold = choose_oneshot_threshold(cut.points);
    c.oneshot.push_back(std::move(cut));
  }
}

// A measured (bytes, value) curve in the calibration file; rates (GB/s) must be > 0.
json curve_json(const std::vector<std::pair<uint64_t, double>>& curve) {
  json x = json::array();
  for (auto& [s, v] : curve) x.push_back({s, v});
  return x;
}
std::vector<std::pair<uint64_t, double>> curve_from_json(const json& x, const char* field, bool rates) {
  std::vector<std::pair<uint64_t, double>> out;
  for (auto& p : x.value(field, json::array())) {
    out.emplace_back(p.at(0).get<uint64_t>(), p.at(1).get<double>());
    TUTTI_CHECK(!rates || out.back().second > 0, InvalidArgument, "{}: rate at {} bytes must be > 0", field, out.back().first);
  }
  return out;
}

json to_json(const Calibration& c) {
  json x;
  x["transport"] = c.transport;
  x["nranks"] = c.nranks;
  x["cores"] = c.cores;
  x["alpha_us"] = c.alpha_us;
  x["beta_gbps"] = c.beta_gbps;
  x["memory_gbps"] = c.memory_gbps;
  x["instruction_us"] = c.instruction_us;
  x["local_instruction_us"] = c.local_instruction_us;
  x["exchange_gbps"] = c.exchange_gbps;
  x["curve"] = curve_json(c.curve);
  x["pingpong"] = curve_json(c.pingpong);
  x["memory_curve"] = curve_json(c.memory_curve);
  x["reduce_curve"] = curve_json(c.reduce_curve);
  x["reduce_exchange"] = curve_json(c.reduce_exchange);
  if (!c.spin_points.empty()) {  // a window of 0 (sleep at once) is a valid choice
    x["spin_us"] = c.spin_us;
    x["wake_us"] = c.wake_us;
    json points = json::array();
    for (auto& [us, rel] : c.spin_points) points.push_back(json::array({us, rel}));
    x["spin"] = points;
  }
  if (c.fifo_slots > 0) {
    x["fifo_slots"] = c.fifo_slots;
    x["fifo_slot_bytes"] = c.fifo_slot_bytes;
    json points = json::array();
    for (auto& f : c.fifo_points) points.push_back(json::array({f.slots, f.slot_bytes, f.relative}));
    x["fifo"] = points;
  }
  if (c.tile_bytes > 0) {
    x["tile_bytes"] = c.tile_bytes;
    json points = json::array();
    for (auto& [t, rel] : c.tile_points) points.push_back(json::array({t, rel}));
    x["tile"] = points;
  }
  if (!c.oneshot.empty()) {
    json cuts = json::object();
    for (auto& cut : c.oneshot) {
      json points = json::array();
      for (auto& [s, t] : cut.points) points.push_back(json::array({s, t.first, t.second}));
      cuts[to_string(cut.collective)] = json{{"threshold", cut.threshold}, {"points", points}};
    }
    x["oneshot"] = cuts;
  }
  if (c.single_copy_threshold) {
    x["single_copy_threshold"] = c.single_copy_threshold;
    json points = json::array();
    for (auto& [s, r] : c.single_copy) points.push_back(json::array({s, r.first, r.second}));
    x["single_copy"] = points;
  }
  return x;
}

Calibration from_json(const json& x) {
  Calibration c;
  c.transport = x.at("transport").get<std::string>();
  c.nranks = x.at("nranks").get<int>();
  c.cores = x.value("cores", 0);
  c.alpha_us = x.at("alpha_us").get<double>();
  c.beta_gbps = x.at("beta_gbps").get<double>();
  c.memory_gbps = x.at("memory_gbps").get<double>();
  c.instruction_us = x.at("instruction_us").get<double>();
  c.local_instruction_us = x.value("local_instruction_us", c.instruction_us);
  c.exchange_gbps = x.value("exchange_gbps", 0.0);
  c.curve = curve_from_json(x, "curve", false);
  c.pingpong = curve_from_json(x, "pingpong", false);
  c.memory_curve = curve_from_json(x, "memory_curve", true);
  c.reduce_curve = curve_from_json(x, "reduce_curve", true);
  c.reduce_exchange = curve_from_json(x, "reduce_exchange", false);
  c.single_copy_threshold = x.value("single_copy_threshold", uint64_t{0});
  if (x.contains("single_copy"))
    for (auto& p : x.at("single_copy"))
      c.single_copy.push_back({p.at(0).get<uint64_t>(), {p.at(1).get<double>(), p.at(2).get<double>()}});
  c.spin_us = x.value("spin_us", 0);
  c.wake_us = x.value("wake_us", 0.0);
  TUTTI_CHECK(c.spin_us >= 0, InvalidArgument, "spin_us must be >= 0, not {}", c.spin_us);
  for (auto& p : x.value("spin", json::array())) c.spin_points.push_back({p.at(0).get<int>(), p.at(1).get<double>()});
  c.fifo_slots = x.value("fifo_slots", uint32_t{0});
  c.fifo_slot_bytes = x.value("fifo_slot_bytes", uint64_t{0});
  TUTTI_CHECK(c.fifo_slots == 0 || c.fifo_slot_bytes >= 64, InvalidArgument,
              "fifo_slot_bytes must be at least 64 with fifo_slots, not {}", c.fifo_slot_bytes);
  for (auto& p : x.value("fifo", json::array()))
    c.fifo_points.push_back({p.at(0).get<uint32_t>(), p.at(1).get<uint64_t>(), p.at(2).get<double>()});
  c.tile_bytes = x.value("tile_bytes", int64_t{0});
  TUTTI_CHECK(c.tile_bytes == 0 || c.tile_bytes >= 64, InvalidArgument, "tile_bytes must be at least 64, not {}",
              c.tile_bytes);
  for (auto& p : x.value("tile", json::array())) c.tile_points.push_back({p.at(0).get<int64_t>(), p.at(1).get<double>()});
  const json cuts = x.value("oneshot", json::object());  // items() must not outlive it
  for (auto& [name, cut] : cuts.items()) {
    Calibration::OneShotCut k;
    auto coll = parse_collective(name);
    TUTTI_CHECK(coll.has_value(), InvalidArgument, "oneshot: '{}' is not a collective", name);
    k.collective = *coll;
    k.threshold = cut.at("threshold").get<uint64_t>();
    for (auto& p : cut.value("points", json::array()))
      k.points.push_back({p.at(0).get<uint64_t>(), {p.at(1).get<double>(), p.at(2).get<double>()}});
    c.oneshot.push_back(std::move(k));
  }
  TUTTI_CHECK(c.alpha_us >= 0 && c.beta_gbps > 0 && c.memory_gbps > 0 && c.instruction_us >= 0 && c.local_instruction_us >= 0,
              InvalidArgument, "alpha_us, instruction_us and local_instruction_us must be >= 0, beta_gbps and memory_gbps > 0");
  return c;
}

}  // namespace

uint64_t choose_single_copy_threshold(const std::vector<std::pair<uint64_t, std::pair<double, double>>>& points) {
  auto sorted = points;
  std::sort(sorted.begin(), sorted.end());
  uint64_t threshold = UINT64_MAX;
  // From the largest size down, as long as single copy keeps up.
  for (auto it = sorted.rbegin(); it != sorted.rend() && it->second.second >= it->second.first; ++it) threshold = it->first;
  return threshold;
}

uint64_t choose_oneshot_threshold(const std::vector<std::pair<uint64_t, std::pair<double, double>>>& points) {
  auto sorted = points;
  std::sort(sorted.begin(), sorted.end());
  uint64_t threshold = 0;
  // Within 3 % is a tie, which the mailbox keeps: it also checks every call's arguments. Sizes
  // above the largest measured are not the mailbox's even where they would fit.
  for (auto& [size, t] : sorted) {
    if (t.first > t.second * 1.03) return threshold;
    threshold = size;
  }
  return threshold;
}

size_t choose_setting(const std::vector<double>& relative, size_t default_index) {
  TUTTI_CHECK(default_index < relative.size(), InvalidArgument, "choose_setting: default {} of {} settings",
              default_index, relative.size());
  size_t best = 0;
  for (size_t i = 1; i < relative.size(); ++i)
    if (relative[i] < relative[best]) best = i;
  return relative[default_index] <= relative[best] * 1.05 ? default_index : best;
}

int choose_spin(const std::vector<std::pair<int, double>>& points, double wake_us) {
  auto sorted = points;
  std::sort(sorted.begin(), sorted.end());
  if (sorted.empty()) return 0;
  double best = 1e300;
  for (auto& p : sorted) best = std::min(best, p.second);
  for (auto& [us, rel] : sorted)
    if (us >= wake_us && rel <= best * 1.05) return us;
  return sorted.back().first;
}

std::pair<double, double> fit_alpha_beta(const std::vector<std::pair<uint64_t, double>>& points) {
  // Minimise sum(((alpha + S * g) - t) / t)^2 over alpha and g = 1 / beta: linear least squares in
  // the rows (1/t, S/t) . (alpha, g) = 1.
  double a11 = 0, a12 = 0, a22 = 0, b1 = 0, b2 = 0;
  std::vector<uint64_t> sizes;
  for (auto& [s, t] : points) {
    if (t <= 0) continue;
    const double x1 = 1 / t, x2 = static_cast<double>(s) / t;
    a11 += x1 * x1, a12 += x1 * x2, a22 += x2 * x2, b1 += x1, b2 += x2;
    sizes.push_back(s);
  }
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  TUTTI_CHECK(sizes.size() >= 2, InvalidArgument, "calibration: {} distinct message sizes, at least 2 needed to fit alpha and beta",
              sizes.size());
  const double det = a11 * a22 - a12 * a12;
  double alpha = (b1 * a22 - b2 * a12) / det, g = (a11 * b2 - a12 * b1) / det;
  if (alpha < 0) {  // a negative latency fits noise: refit the bandwidth alone
    alpha = 0;
    g = b2 / a22;
  }
  TUTTI_CHECK(g > 0, InvalidArgument, "calibration: the times do not grow with the size (no bandwidth to fit)");
  return {alpha, 1e-3 / g};  // bytes/us -> GB/s
}

namespace {

// What a rank measured that the ranks then agree on (calibrate): every rank takes rank 0's
// transport and ring times, and the slowest memory rate and local instruction.
struct RankMeasurements {
  double mem = 0;  // the 8 MiB copy's rate: the collective's buffers out of cache
  double both_ways = 0;
  double ring_us = 0;
  double local_us = 0;
  // One-way times under a collective's load, without and with reducing receives.
  std::vector<std::pair<uint64_t, double>> load;
  std::vector<std::pair<uint64_t, double>> reducing;
  // Single copy against the FIFO: size -> (FIFO GB/s, single-copy GB/s); empty where not measured.
  std::vector<std::pair<uint64_t, std::pair<double, double>>> copy_points;
};

std::vector<std::pair<uint64_t, double>> measure_pingpong(Communicator& comm) {
  std::vector<std::pair<uint64_t, double>> points;
  for (uint64_t s = 8; s <= (4u << 20); s *= 8) {
    const int iters = s <= (32u << 10) ? 1000 : s <= (512u << 10) ? 50 : 10;
    points.emplace_back(s, pingpong(comm, s, iters));
  }
  points.emplace_back(4u << 20, pingpong(comm, 4u << 20, 10));
  return points;
}

// Whether process ranks can use single copy between every pair (every rank must agree to measure:
// the exchange is collective).
bool every_rank_can_single_copy(Communicator& comm) {
  bool single_copy = true;
  for (int p = 0; p < comm.size(); ++p)
    if (p != comm.rank() && !comm.connection(p, 0).can_single_copy()) single_copy = false;
  wire::Writer v;
  v.put<uint8_t>(single_copy ? 1 : 0);
  for (auto& bytes : comm.bootstrap().allgather(v.bytes())) single_copy &= bytes.at(0) == 1;
  return single_copy;
}

// Single copy against the FIFO, under a ring's load.
std::vector<std::pair<uint64_t, std::pair<double, double>>> measure_single_copy(Communicator& comm) {
  std::vector<std::pair<uint64_t, std::pair<double, double>>> copy_points;
  const uint64_t was = *comm.options().shm_single_copy_threshold;
  const bool adaptive = comm.options().shm_single_copy_adaptive;
  for (uint64_t s = 64u << 10; s <= (64u << 20); s *= 4) {  // each mode alone, not chosen by rates
    const int iters = std::max<int>(2, static_cast<int>((32u << 20) / s));
    comm.set_single_copy(UINT64_MAX, false);
    const double fifo = exchange_rate(comm, s, iters);
    comm.set_single_copy(s, false);
    const double direct = exchange_rate(comm, s, iters);
    copy_points.push_back({s, {fifo, direct}});
  }
  comm.set_single_copy(was, adaptive);
  return copy_points;
}

// Exchange times from 4 KiB, without and with reducing receives (the curve under a collective's load).
void measure_load(Communicator& comm, RankMeasurements& m) {
  for (uint64_t s = 4096; s <= (16u << 20); s *= 2) {
    const int iters = s <= (64u << 10) ? 200 : s <= (1u << 20) ? 20 : 5;
    m.load.emplace_back(s, static_cast<double>(s) / (exchange_rate(comm, s, iters) * 1e3));
    m.reducing.emplace_back(s, static_cast<double>(s) / (exchange_rate(comm, s, iters, true) * 1e3));
  }
}

// The time of a plan of `k` local copies of one element each on every rank.
double local_copies_us(int n, CpuExecutor& ex, const ExecArgs& args, int k) {
  plan::Plan local;
  local.name = "calibration_copies";
  local.collective = Collective::kCustom;  // each rank copies its own input: no standard collective
  local.nranks = n;
  local.chunk_factor = k;
  local.ranks.resize(static_cast<size_t>(n));
  for (auto& rp : local.ranks) {
    rp.input_chunks = rp.output_chunks = k;
    rp.blocks.push_back(plan::Block{0, 0, {}});
    for (int i = 0; i < k; ++i) {
      plan::Instruction in;
      in.op = plan::Opcode::kCopy;
      in.srcs = {plan::Ref{BufferKind::kInput, i, 1}};
      in.dst = plan::Ref{BufferKind::kOutput, i, 1};
      rp.blocks[0].steps.push_back(in);
    }
  }
  plan::certify(local);
  auto pp = PreparedPlan::make(std::move(local));
  ExecArgs a = args;
  a.count = k;
  for (int i = 0; i < 20; ++i) ex.run(*pp, a);
  std::vector<double> times;
  for (int r = 0; r < 9; ++r) {
    auto t0 = Clock::now();
    for (int i = 0; i < 100; ++i) ex.run(*pp, a);
    times.push_back(us_since(t0) / 100);
  }
  return median(times);
}

// The executor's overheads: per dependent receive (the ring time) and per instruction that waits
// on no peer.
void measure_executor(Communicator& comm, RankMeasurements& m) {
  const int n = comm.size();
  // The executor: 2(n-1) dependent messages of a ring all-reduce of 8 bytes.
  auto ring = ring_allreduce(n);
  float in[64] = {}, out[64] = {};
  CpuExecutor ex(comm, CpuExecutorOptions::from_env());
  ExecArgs args;
  args.input = in;
  args.output = out;
  args.count = std::max<int64_t>(2, ring->plan.chunk_factor);
  for (int i = 0; i < 50; ++i) ex.run(*ring, args);
  std::vector<double> rounds;  // the median of several rounds: one preempted round does not count
  for (int r = 0; r < 9; ++r) {
    comm.barrier();
    auto t0 = Clock::now();
    for (int i = 0; i < 100; ++i) ex.run(*ring, args);
    rounds.push_back(us_since(t0) / 100);
  }
  m.ring_us = median(rounds);
  // Instructions that wait on no peer: a plan of k local copies of one element each, timed at
  // k = 1 and k = 17; the difference per copy is what the executor spends on such an instruction
  // (a tiny share of a receive's, whose time includes waking up for its message).
  m.local_us = std::max(0.0, (local_copies_us(n, ex, args, 17) - local_copies_us(n, ex, args, 1)) / 16);
}

// Every rank gets rank 0's transport fit and ring time, and the slowest memory rate and local
// instruction: into `c` (pingpong, exchange_gbps, local_instruction_us) and `m` (the rest).
void agree(Communicator& comm, RankMeasurements& m, Calibration& c) {
  wire::Writer w;
  w.put<double>(m.mem).put<double>(m.ring_us).put<double>(m.both_ways).put<double>(m.local_us);
  for (auto& [sz, t] : m.load) w.put<double>(t);
  for (auto& [sz, t] : m.reducing) w.put<double>(t);
  for (auto& [s, t] : c.pingpong) w.put<double>(t);
  for (auto& [s, r] : m.copy_points) w.put<double>(r.first).put<double>(r.second);
  auto all = comm.bootstrap().allgather(w.bytes());
  double slowest_mem = 1e300;
  for (int r = 0; r < comm.size(); ++r) {
    wire::Reader rd(all[r], "calibration");
    slowest_mem = std::min(slowest_mem, rd.get<double>());
    double ring_r = rd.get<double>(), both_r = rd.get<double>();
    c.local_instruction_us = std::max(c.local_instruction_us, rd.get<double>());
    if (r == 0) {
      m.ring_us = ring_r;
      c.exchange_gbps = both_r;
      for (auto& p : m.load) p.second = rd.get<double>();
      for (auto& p : m.reducing) p.second = rd.get<double>();
      for (auto& p : c.pingpong) p.second = rd.get<double>();
      for (auto& p : m.copy_points) p.second.first = rd.get<double>(), p.second.second = rd.get<double>();
    }
  }
  m.mem = slowest_mem;
}

// The calibration's model from the agreed measurements: the curves under load, the transport fit,
// the instruction overhead and the single-copy threshold.
void fit_model(const RankMeasurements& m, Calibration& c) {
  // The curve under a collective's load: ping-pong times up to 512 B (latency-bound, one message
  // each way looks the same), exchange times from 4 KiB.
  for (auto& p : c.pingpong)
    if (p.first <= 512) c.curve.push_back(p);
  for (auto& p : m.load) c.curve.push_back(p);
  for (auto& p : c.pingpong)
    if (p.first <= 512) c.reduce_exchange.push_back(p);
  for (auto& p : m.reducing) c.reduce_exchange.push_back(p);
  auto [alpha, beta] = fit_alpha_beta(c.pingpong);
  c.alpha_us = alpha;
  c.beta_gbps = beta;
  c.memory_gbps = m.mem;
  c.instruction_us = std::max(0.0, m.ring_us / (2.0 * (c.nranks - 1)) - alpha);
  if (!m.copy_points.empty()) {
    c.single_copy = m.copy_points;
    c.single_copy_threshold = choose_single_copy_threshold(m.copy_points);
  }
}

// Both are the same on every rank: interleaved_sweep returns the slowest rank's times everywhere.
// Waits, the mailbox, FIFOs and tiles are shared-memory settings (dispatchers apply them there).
void measure_shm_settings(Communicator& comm, Calibration& c) {
  measure_spin(comm, c);
  const int was = *comm.options().spin;
  comm.set_spin(c.spin_us);  // the mailbox as it will run
  measure_oneshot(comm, c);
  comm.set_spin(was);
  measure_fifo_and_tile(comm, c);
}

}  // namespace

Calibration calibrate(Communicator& comm) {
  const int n = comm.size();
  TUTTI_CHECK(n >= 2, InvalidArgument, "calibration needs at least 2 ranks, the communicator has {}", n);
  Calibration c;
  c.transport = comm.transport_to(comm.rank() == 0 ? 1 : 0);
  c.nranks = n;
  c.cores = static_cast<int>(std::thread::hardware_concurrency());
  c.pingpong = measure_pingpong(comm);
  c.memory_curve = rates_at_once(comm, false);
  c.reduce_curve = rates_at_once(comm, true);
  RankMeasurements m;
  for (auto& [touched, gbps] : c.memory_curve)
    if (touched == (16u << 20)) m.mem = gbps;
  m.both_ways = exchange_rate(comm, 4u << 20, 10);
  if (every_rank_can_single_copy(comm)) m.copy_points = measure_single_copy(comm);
  measure_load(comm, m);
  measure_executor(comm, m);
  agree(comm, m, c);
  fit_model(m, c);
  if (c.transport == "shm") measure_shm_settings(comm, c);
  return c;
}

std::string calibration_path() { return CommOptions::from_env().calibration_file; }

std::vector<Calibration> load_calibrations(const std::string& path) {
  std::ifstream in(path);
  if (!in.good()) return {};
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    json j = json::parse(ss.str());
    TUTTI_CHECK(j.value("version", 0) == 1, InvalidArgument, "version {} (this build reads 1)", j.value("version", 0));
    std::vector<Calibration> out;
    int index = 0;
    for (auto& x : j.at("entries")) {
      try {
        out.push_back(from_json(x));
      } catch (const std::exception& e) {
        throw InvalidArgument(fmt::format("entry {}: {}", index, e.what()));
      }
      ++index;
    }
    return out;
  } catch (const std::exception& e) {
    throw InvalidArgument(fmt::format("calibration file {}: {}", path, e.what()));
  }
}

void save_calibration(const std::string& path, const Calibration& c) {
  auto all = load_calibrations(path);
  std::erase_if(all, [&](const Calibration& o) { return o.transport == c.transport && o.nranks == c.nranks; });
  all.push_back(c);
  json j;
  j["version"] = 1;
  j["entries"] = json::array();
  for (auto& x : all) j["entries"].push_back(to_json(x));
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  const std::string tmp = path + ".tmp" + std::to_string(getpid());
  {
    std::ofstream out(tmp);
    TUTTI_CHECK(out.good(), InvalidArgument, "calibration file {} cannot be written", path);
    out << j.dump(1) << "\n";
  }
  TUTTI_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, InvalidArgument, "calibration file {} cannot be written", path);
}

std::optional<Calibration> find_calibration(const std::string& path, const std::string& transport, int nranks) {
  for (auto& c : load_calibrations(path))
    if (c.transport == transport && c.nranks == nranks) return c;
  return std::nullopt;
}

std::optional<ShmCalibration> shm_settings(const Calibration& c) {
  ShmCalibration s;
  if (c.single_copy_threshold != 0) s.single_copy_threshold = c.single_copy_threshold;
  if (!c.spin_points.empty()) s.spin_us = c.spin_us;
  if (c.fifo_slots > 0) s.fifo_layout = std::make_pair(c.fifo_slots, c.fifo_slot_bytes);
  if (c.tile_bytes > 0) s.tile_bytes = c.tile_bytes;
  for (const auto& cut : c.oneshot) s.oneshot.emplace_back(cut.collective, cut.threshold);
  return s;
}

namespace {

// Communicators of n ranks on one host over shared memory take the settings measured for them
// (runtime/comm_options.hpp, ShmCalibration) when they are made: this is where they find them.
[[maybe_unused]] const bool g_source_installed = [] {
  set_calibration_source([](const std::string& file, int nranks) -> std::optional<ShmCalibration> {
    try {
      if (auto c = find_calibration(file, "shm", nranks)) return shm_settings(*c);
    } catch (const InvalidArgument& e) {
      TUTTI_WARN("{}; using the built-in transport settings", e.what());
    }
    return std::nullopt;
  });
  return true;
}();

}  // namespace

void apply(const Calibration& c, topo::Topology& t, plan::CostModel& m) {
  // The ranks' shared path carries every concurrent flow. In the exchange every rank sent one flow
  // (n flows at once, each at exchange_gbps), which is how collectives load it; without that
  // measurement, the ping-pong's floor(n/2) flows at beta.
  const double capacity = c.exchange_gbps > 0 ? c.exchange_gbps * c.nranks : c.beta_gbps * std::max(1, c.nranks / 2);
  for (int d : t.rank_device) {
    t.devices[d].attrs["shm_gbps"] = fmt::format("{:.6g}", capacity);
    t.devices[d].attrs["shm_latency_us"] = fmt::format("{:.6g}", c.alpha_us);
    auto text = [](const std::vector<std::pair<uint64_t, double>>& points) {
      std::string out;
      for (auto& [s, us] : points) out += fmt::format("{}{}:{:.6g}", out.empty() ? "" : ",", s, us);
      return out;
    };
    if (!c.curve.empty()) {
      t.devices[d].attrs["shm_curve"] = text(c.curve);
      if (!c.reduce_exchange.empty()) t.devices[d].attrs["shm_reduce_curve"] = text(c.reduce_exchange);
      t.devices[d].attrs["shm_curve_flows"] = std::to_string(c.nranks);
    }
  }
  m.memory_gbps = c.memory_gbps;
  m.memory_curve = c.memory_curve;
  m.reduce_curve = c.reduce_curve;
  std::sort(m.memory_curve.begin(), m.memory_curve.end());
  std::sort(m.reduce_curve.begin(), m.reduce_curve.end());
  m.instruction_us = c.instruction_us;
  m.local_instruction_us = c.local_instruction_us;
}

topo::Topology host_topology(int nranks) {
  topo::Topology t;
  t.name = fmt::format("host x{} ranks", nranks);
  int host = t.add_device(topo::DeviceType::kHost, "host0", -1, 0);
  int numa = t.add_device(topo::DeviceType::kNuma, "numa0", host, host);
  t.devices[numa].attrs["shm_gbps"] = "7";
  t.rank_device.assign(static_cast<size_t>(nranks), numa);
  return t;
}

}  // namespace tutti::tuning
