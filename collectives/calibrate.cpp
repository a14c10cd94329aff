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
#include "compiler/compile.hpp"
#include "compiler/verify.hpp"
#include "core/env.hpp"
#include "core/error.hpp"
#include "core/reduce.hpp"
#include "runtime/executor.hpp"
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
  const uint64_t threshold = env::get_size("TUTTI_STREAM_THRESHOLD");
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

Calibration calibrate(Communicator& comm) {
  const int n = comm.size();
  TUTTI_CHECK(n >= 2, InvalidArgument, "calibration needs at least 2 ranks, the communicator has {}", n);
  Calibration c;
  c.transport = comm.transport_to(comm.rank() == 0 ? 1 : 0);
  c.nranks = n;
  c.cores = static_cast<int>(std::thread::hardware_concurrency());
  for (uint64_t s = 8; s <= (4u << 20); s *= 8) {
    const int iters = s <= (32u << 10) ? 1000 : s <= (512u << 10) ? 50 : 10;
    c.pingpong.emplace_back(s, pingpong(comm, s, iters));
  }
  c.pingpong.emplace_back(4u << 20, pingpong(comm, 4u << 20, 10));
  c.memory_curve = rates_at_once(comm, false);
  c.reduce_curve = rates_at_once(comm, true);
  double mem = 0;  // the 8 MiB copy's rate: the collective's buffers out of cache
  for (auto& [touched, gbps] : c.memory_curve)
    if (touched == (16u << 20)) mem = gbps;
  const double both_ways = exchange_rate(comm, 4u << 20, 10);
  // Single copy against the FIFO, under a ring's load, where process ranks can use it (every rank
  // must agree to measure: the exchange is collective).
  bool single_copy = true;
  for (int p = 0; p < n; ++p)
    if (p != comm.rank() && !comm.connection(p, 0).can_single_copy()) single_copy = false;
  {
    wire::Writer v;
    v.put<uint8_t>(single_copy ? 1 : 0);
    for (auto& bytes : comm.bootstrap().allgather(v.bytes())) single_copy &= bytes.at(0) == 1;
  }
  std::vector<std::pair<uint64_t, std::pair<double, double>>> copy_points;
  if (single_copy) {
    const uint64_t was = comm.options().shm_single_copy_threshold;
    for (uint64_t s = 64u << 10; s <= (64u << 20); s *= 4) {
      const int iters = std::max<int>(2, static_cast<int>((32u << 20) / s));
      comm.set_single_copy_threshold(UINT64_MAX);
      const double fifo = exchange_rate(comm, s, iters);
      comm.set_single_copy_threshold(s);
      const double direct = exchange_rate(comm, s, iters);
      copy_points.push_back({s, {fifo, direct}});
    }
    comm.set_single_copy_threshold(was);
  }
  // The curve under a collective's load: ping-pong times up to 512 B (latency-bound, one message
  // each way looks the same), exchange times from 4 KiB.
  std::vector<std::pair<uint64_t, double>> load;
  std::vector<std::pair<uint64_t, double>> reducing;
  for (uint64_t s = 4096; s <= (16u << 20); s *= 2) {
    const int iters = s <= (64u << 10) ? 200 : s <= (1u << 20) ? 20 : 5;
    load.emplace_back(s, static_cast<double>(s) / (exchange_rate(comm, s, iters) * 1e3));
    reducing.emplace_back(s, static_cast<double>(s) / (exchange_rate(comm, s, iters, true) * 1e3));
  }
  // The executor: 2(n-1) dependent messages of a ring all-reduce of 8 bytes.
  auto ring = PreparedPlan::make(plan::compile(algorithms::build("ring_allreduce", n, {{"inplace", 0}})).plan);
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
  double ring_us = median(rounds);
  // Instructions that wait on no peer: a plan of k local copies of one element each, timed at
  // k = 1 and k = 17; the difference per copy is what the executor spends on such an instruction
  // (a tiny share of a receive's, whose time includes waking up for its message).
  auto copies = [&](int k) {
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
  };
  const double local_us = std::max(0.0, (copies(17) - copies(1)) / 16);
  // Every rank gets rank 0's transport fit and ring time, and the slowest memory rate and local
  // instruction.
  wire::Writer w;
  w.put<double>(mem).put<double>(ring_us).put<double>(both_ways).put<double>(local_us);
  for (auto& [sz, t] : load) w.put<double>(t);
  for (auto& [sz, t] : reducing) w.put<double>(t);
  for (auto& [s, t] : c.pingpong) w.put<double>(t);
  for (auto& [s, r] : copy_points) w.put<double>(r.first).put<double>(r.second);
  auto all = comm.bootstrap().allgather(w.bytes());
  double slowest_mem = 1e300;
  for (int r = 0; r < n; ++r) {
    wire::Reader rd(all[r], "calibration");
    slowest_mem = std::min(slowest_mem, rd.get<double>());
    double ring_r = rd.get<double>(), both_r = rd.get<double>();
    c.local_instruction_us = std::max(c.local_instruction_us, rd.get<double>());
    if (r == 0) {
      ring_us = ring_r;
      c.exchange_gbps = both_r;
      for (auto& p : load) p.second = rd.get<double>();
      for (auto& p : reducing) p.second = rd.get<double>();
      for (auto& p : c.pingpong) p.second = rd.get<double>();
      for (auto& p : copy_points) p.second.first = rd.get<double>(), p.second.second = rd.get<double>();
    }
  }
  for (auto& p : c.pingpong)
    if (p.first <= 512) c.curve.push_back(p);
  for (auto& p : load) c.curve.push_back(p);
  for (auto& p : c.pingpong)
    if (p.first <= 512) c.reduce_exchange.push_back(p);
  for (auto& p : reducing) c.reduce_exchange.push_back(p);
  auto [alpha, beta] = fit_alpha_beta(c.pingpong);
  c.alpha_us = alpha;
  c.beta_gbps = beta;
  c.memory_gbps = slowest_mem;
  c.instruction_us = std::max(0.0, ring_us / (2.0 * (n - 1)) - alpha);
  if (!copy_points.empty()) {
    c.single_copy = copy_points;
    c.single_copy_threshold = choose_single_copy_threshold(copy_points);
  }
  return c;
}

std::string calibration_path() {
  if (auto p = env::raw("TUTTI_CALIBRATION_FILE"); p && !p->empty()) return *p;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/tutti/calibration.json";
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : "/tmp") + "/.cache/tutti/calibration.json";
}

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
