#include "collectives/tuner.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "collectives/oneshot.hpp"
#include "compiler/compile.hpp"
#include "core/error.hpp"
#include "core/function_ref.hpp"
#include "core/log.hpp"
#include "runtime/cpu_executor.hpp"
#include "runtime/wire.hpp"

namespace tutti::tuning {
namespace {

using nlohmann::json;

bool scaled(Collective c) {
  return c == Collective::kAllGather || c == Collective::kReduceScatter || c == Collective::kAllToAll;
}
// NCCL's per-rank piece (count x element size) for nccl-tests' size.
uint64_t piece_of(Collective c, uint64_t bytes, int n) { return scaled(c) ? bytes / n : bytes; }

// The values each tuned parameter takes.
std::vector<int> values_of(const std::string& param, const std::string& algorithm, int nranks) {
  if (param == "channels") return {1, 2, 4};
  if (param == "chunks") return algorithm == "chain_broadcast" ? std::vector<int>{1, 4, 16} : std::vector<int>{1, 2, 4, 8};
  if (param == "local") {
    std::vector<int> v;
    for (int d = 2; d < nranks; ++d)
      if (nranks % d == 0) v.push_back(d);
    return v;
  }
  return {};
}

std::optional<Protocol> parse_protocol(const std::string& s) {
  for (auto p : {Protocol::kAuto, Protocol::kSimple, Protocol::kLL, Protocol::kLL128})
    if (s == to_string(p)) return p;
  return std::nullopt;
}

bool gpu_ranks(const topo::Topology& t) {
  for (int d : t.rank_device)
    if (t.devices[d].type == topo::DeviceType::kGpu) return true;
  return false;
}

}  // namespace

std::string Candidate::describe() const {
  std::string s = algorithm;
  for (auto& [k, v] : params) s += fmt::format(" {}={}", k, v);
  if (protocol != Protocol::kAuto) s += fmt::format(" protocol={}", to_string(protocol));
  return s;
}

const Entry* Table::find(Collective c, int nranks, uint64_t bytes) const {
  for (const Entry& e : entries)
    if (e.collective == c && e.nranks == nranks && e.min_bytes <= bytes && bytes <= e.max_bytes) return &e;
  return nullptr;
}

void Table::put(const Entry& e) {
  // Carve [min, max] out of the windows it overlaps, then insert it.
  std::vector<Entry> kept;
  for (const Entry& o : entries) {
    if (o.collective != e.collective || o.nranks != e.nranks || o.max_bytes < e.min_bytes || o.min_bytes > e.max_bytes) {
      kept.push_back(o);
      continue;
    }
    if (o.min_bytes < e.min_bytes) {
      Entry lo = o;
      lo.max_bytes = e.min_bytes - 1;
      kept.push_back(lo);
    }
    if (o.max_bytes > e.max_bytes) {
      Entry hi = o;
      hi.min_bytes = e.max_bytes + 1;
      kept.push_back(hi);
    }
  }
  kept.push_back(e);
  std::sort(kept.begin(), kept.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.collective, a.nranks, a.min_bytes) < std::tie(b.collective, b.nranks, b.min_bytes);
  });
  entries = std::move(kept);
}

std::string Table::to_json() const {
  json j;
  j["version"] = kVersion;
  j["topology"] = topology;
  j["source"] = source;
  j["entries"] = json::array();
  for (const Entry& e : entries) {
    json x;
    x["collective"] = to_string(e.collective);
    x["nranks"] = e.nranks;
    x["min_bytes"] = e.min_bytes;
    x["max_bytes"] = e.max_bytes;
    x["algorithm"] = e.choice.algorithm;
    x["params"] = e.choice.params;
    if (e.choice.protocol != Protocol::kAuto) x["protocol"] = to_string(e.choice.protocol);
    x["time_us"] = e.time_us;
    j["entries"].push_back(x);
  }
  return j.dump(1) + "\n";
}

namespace {

// One entry of a table file; InvalidArgument naming the entry for values that make no sense.
Entry entry_from_json(const json& x, int index) {
  Entry e;
  std::string coll = x.at("collective").get<std::string>();
  auto c = parse_collective(coll);
  TUTTI_CHECK(c.has_value(), InvalidArgument, "tuning table: entry {}: unknown collective '{}'", index, coll);
  e.collective = *c;
  e.nranks = x.at("nranks").get<int>();
  e.min_bytes = x.at("min_bytes").get<uint64_t>();
  e.max_bytes = x.at("max_bytes").get<uint64_t>();
  e.choice.algorithm = x.at("algorithm").get<std::string>();
  e.choice.params = x.value("params", algorithms::Params{});
  std::string proto = x.value("protocol", std::string("auto"));
  auto pr = parse_protocol(proto);
  TUTTI_CHECK(pr.has_value(), InvalidArgument, "tuning table: entry {}: unknown protocol '{}' (Simple, LL, LL128)",
              index, proto);
  e.choice.protocol = *pr;
  e.time_us = x.value("time_us", 0.0);
  if (e.choice.algorithm != kOneShot) {
    const algorithms::Builtin& b = algorithms::find_builtin(e.choice.algorithm);
    TUTTI_CHECK(b.collective == e.collective, InvalidArgument, "tuning table: entry {}: {} is not a {} algorithm", index,
                e.choice.algorithm, coll);
  }
  TUTTI_CHECK(e.min_bytes <= e.max_bytes, InvalidArgument, "tuning table: entry {}: min_bytes {} > max_bytes {}",
              index, e.min_bytes, e.max_bytes);
  return e;
}

}  // namespace

Table Table::from_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw InvalidArgument(fmt::format("tuning table: not JSON: {}", e.what()));
  }
  try {
    TUTTI_CHECK(j.value("version", 0) == kVersion, InvalidArgument, "tuning table: version {} (this build reads {})",
                j.value("version", 0), kVersion);
    Table t;
    t.topology = j.value("topology", "");
    t.source = j.value("source", "");
    int index = 0;
    for (const json& x : j.at("entries")) {
      try {
        t.entries.push_back(entry_from_json(x, index));
      } catch (const json::exception& e) {
        throw InvalidArgument(fmt::format("tuning table: entry {}: {}", index, e.what()));
      }
      ++index;
    }
    return t;
  } catch (const json::exception& e) {
    throw InvalidArgument(fmt::format("tuning table: {}", e.what()));
  }
}

Table Table::load(const std::string& path) {
  std::ifstream in(path);
  TUTTI_CHECK(in.good(), InvalidArgument, "tuning table {} cannot be read", path);
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return from_json(ss.str());
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("{}: {}", path, e.what()));
  }
}

void Table::save(const std::string& path) const {
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    TUTTI_CHECK(out.good(), InvalidArgument, "tuning table {} cannot be written", path);
    out << to_json();
  }
  TUTTI_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, InvalidArgument, "tuning table {} cannot be written", path);
}

std::vector<Candidate> candidates(Collective c, int nranks, bool protocols) {
  std::vector<Candidate> out;
  for (const algorithms::Builtin& b : algorithms::builtins()) {
    if (b.collective != c) continue;
    std::vector<algorithms::Params> grid{{}};
    for (const algorithms::Param& p : b.params) {
      std::vector<int> vals = values_of(p.name, b.name, nranks);
      if (vals.empty()) continue;
      std::vector<algorithms::Params> next;
      for (auto& g : grid)
        for (int v : vals) {
          auto x = g;
          x[p.name] = v;
          next.push_back(x);
        }
      grid = std::move(next);
    }
    for (auto& g : grid) {
      algorithms::Params full = g;
      for (const algorithms::Param& q : b.params)
        if (q.name == "inplace" || q.name == "root") full[q.name] = 0;
      try {
        algorithms::resolve(b, nranks, full);
      } catch (const InvalidArgument&) {
        continue;
      }
      if (!protocols) {
        out.push_back({b.name, g});
        continue;
      }
      for (auto pr : {Protocol::kSimple, Protocol::kLL, Protocol::kLL128}) out.push_back({b.name, g, pr});
    }
  }
  return out;
}

std::vector<Candidate> defaults(Collective c, int nranks) {
  std::vector<Candidate> out;
  for (const algorithms::Builtin& b : algorithms::builtins()) {
    if (b.collective != c) continue;
    algorithms::Params full;
    try {
      full = algorithms::resolve(b, nranks, {});
    } catch (const InvalidArgument&) {
      continue;
    }
    // Spelled like candidates() spells them (the tuned parameters at their defaults), so the same
    // plan is one candidate.
    Candidate d{b.name, {}};
    for (auto& [k, v] : full)
      if (!values_of(k, b.name, nranks).empty()) d.params[k] = v;
    out.push_back(d);
  }
  return out;
}

plan::Plan plan_of(const Candidate& cand, Collective, int nranks) {
  algorithms::Params p = cand.params;
  const algorithms::Builtin& b = algorithms::find_builtin(cand.algorithm);
  for (auto& q : b.params)
    if (q.name == "inplace" || q.name == "root") p.emplace(q.name, 0);
  plan::Plan plan = plan::compile(algorithms::build(cand.algorithm, nranks, p)).plan;
  if (cand.protocol != Protocol::kAuto) plan.protocol = cand.protocol;
  return plan;
}

std::vector<Ranked> rank_by_model(Collective c, int nranks, uint64_t bytes, const topo::Topology& t,
                                  const plan::CostModel& model) {
  std::vector<Ranked> out;
  for (const Candidate& cand : candidates(c, nranks, gpu_ranks(t))) {
    plan::Plan p = plan_of(cand, c, nranks);
    out.push_back({cand, plan::simulate(p, t, piece_of(c, bytes, nranks), model).time_us});
  }
  TUTTI_CHECK(!out.empty(), InvalidArgument, "tuner: no built-in {} algorithm applies to {} ranks", to_string(c),
              nranks);
  std::stable_sort(out.begin(), out.end(), [](const Ranked& a, const Ranked& b) { return a.time_us < b.time_us; });
  return out;
}

std::vector<uint64_t> sweep(uint64_t min_bytes, uint64_t max_bytes, double factor) {
  TUTTI_CHECK(factor > 1, InvalidArgument, "size factor must be > 1, not {}", factor);
  std::vector<uint64_t> v;
  for (double s = static_cast<double>(std::max<uint64_t>(min_bytes, 1)); s <= static_cast<double>(max_bytes) * (1 + 1e-12);
       s *= factor)
    v.push_back(static_cast<uint64_t>(std::llround(s)));
  return v;
}

void add_windows(Table& table, Collective c, int nranks, const std::vector<uint64_t>& sizes, const std::vector<Ranked>& best) {
  TUTTI_CHECK(sizes.size() == best.size() && !sizes.empty(), InvalidArgument, "add_windows: {} sizes, {} choices",
              sizes.size(), best.size());
  size_t start = 0;
  for (size_t i = 1; i <= sizes.size(); ++i) {
    if (i < sizes.size() && best[i].candidate == best[start].candidate) continue;
    Entry e;
    e.collective = c;
    e.nranks = nranks;
    auto mid = [&](size_t k) {  // geometric midpoint between sizes k-1 and k
      return static_cast<uint64_t>(std::sqrt(static_cast<double>(sizes[k - 1]) * static_cast<double>(sizes[k])));
    };
    e.min_bytes = start == 0 ? 0 : mid(start) + 1;
    e.max_bytes = i == sizes.size() ? UINT64_MAX : mid(i);
    e.choice = best[start].candidate;
    e.time_us = best[start].time_us;
    table.put(e);
    start = i;
  }
}

std::vector<Ranked> choose_smoothed(const std::vector<std::vector<Ranked>>& rankings, double tolerance) {
  std::vector<Ranked> out;
  for (size_t i = 0; i < rankings.size(); ++i) {
    TUTTI_CHECK(!rankings[i].empty(), InvalidArgument, "tuner: nothing was measured at size {}", i);
    const double fastest_here = rankings[i].front().time_us;
    const Ranked* best = nullptr;
    double best_score = 0;
    for (const Ranked& cand : rankings[i]) {
      if (cand.time_us >= 1e299) continue;  // could not run here
      // The neighbours may only choose among what is close to the fastest here: at a real
      // crossover they would otherwise keep a plan past the size where it stops winning.
      if (cand.time_us > fastest_here * (1 + tolerance)) continue;
      double sum = 0;
      int terms = 0;
      for (size_t j = i == 0 ? 0 : i - 1; j <= i + 1 && j < rankings.size(); ++j) {
        const double fastest = rankings[j].front().time_us;
        for (const Ranked& r : rankings[j])
          if (r.candidate == cand.candidate && r.time_us < 1e299) {
            sum += r.time_us / fastest;
            ++terms;
          }
      }
      const double score = sum / terms;
      if (!best || score < best_score) best = &cand, best_score = score;
    }
    out.push_back(best ? *best : rankings[i].front());
  }
  return out;
}

Table tune_model(const topo::Topology& t, Collective c, int nranks, const std::vector<uint64_t>& sizes,
                 const plan::CostModel& model) {
  Table table;
  table.topology = t.name;
  table.source = "model";
  std::vector<Ranked> best;
  for (uint64_t s : sizes) best.push_back(rank_by_model(c, nranks, s, t, model).front());
  add_windows(table, c, nranks, sizes, best);
  return table;
}

std::vector<Candidate> shortlist(Collective c, int nranks, uint64_t bytes, const topo::Topology& t, int top) {
  std::vector<Candidate> out;
  auto ranked = rank_by_model(c, nranks, bytes, t);
  for (size_t k = 0; k < ranked.size() && static_cast<int>(k) < top; ++k) out.push_back(ranked[k].candidate);
  for (const Candidate& d : defaults(c, nranks))
    if (std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  return out;
}

std::vector<double> paired_medians(const std::vector<std::vector<double>>& t) {
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t m = v.size() / 2;
    return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
  };
  std::vector<double> out;
  if (t.empty()) return out;
  const size_t rounds = t[0].size();
  for (auto& w : t)
    TUTTI_CHECK(w.size() == rounds && rounds > 0, InvalidArgument, "paired_medians: ways with {} and {} rounds", rounds,
                w.size());
  std::vector<double> ref(rounds);
  for (size_t r = 0; r < rounds; ++r) {
    std::vector<double> round;
    for (auto& w : t) round.push_back(w[r]);
    ref[r] = median(round);
  }
  const double scale = median(ref);
  for (auto& w : t) {
    std::vector<double> ratio;
    for (size_t r = 0; r < rounds; ++r) ratio.push_back(ref[r] > 0 ? w[r] / ref[r] : 1.0);
    out.push_back(median(ratio) * scale);
  }
  return out;
}

std::vector<std::vector<double>> interleaved_sweep(Communicator& comm,
                                                   const std::vector<std::vector<FunctionRef<void()>>>& ways,
                                                   int rounds, const std::vector<int>& iters) {
  const size_t sizes = ways.size();
  const int n = comm.size();
  TUTTI_CHECK(iters.size() == sizes, InvalidArgument, "timing: {} sizes but {} call counts", sizes, iters.size());
  TUTTI_CHECK(rounds >= 1, InvalidArgument, "timing needs at least one round, not {}", rounds);
  for (size_t i = 0; i < sizes; ++i)
    TUTTI_CHECK(iters[i] >= 1, InvalidArgument, "timing needs at least one call per round at size {}, not {}", i, iters[i]);
  // Each round runs the ways in a fresh order (the same on every rank: a fixed seed). A rotation
  // gave every way the same predecessor in all but one round, and a way that follows a
  // cache-hungry one (hier_allreduce) ran 5-25 % slower all through its batch, which a fixed
  // predecessor turned into a bias instead of noise.
  std::mt19937 shuffler(12345);
  std::vector<std::vector<std::vector<size_t>>> order(static_cast<size_t>(rounds), std::vector<std::vector<size_t>>(sizes));
  for (auto& round : order)
    for (size_t i = 0; i < sizes; ++i) {
      for (size_t j = 0; j < ways[i].size(); ++j) round[i].push_back(j);
      std::shuffle(round[i].begin(), round[i].end(), shuffler);
    }
  wire::Writer w;
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < sizes; ++i)
      for (size_t j : order[static_cast<size_t>(r)][i]) {
        auto& way = ways[i][j];
        // One untimed call first: the switch from the previous way (another plan's layout, caches
        // holding another plan's buffers) is not what a loop of identical calls pays.
        way();
        comm.barrier();
        auto t0 = std::chrono::steady_clock::now();
        for (int k = 0; k < iters[i]; ++k) way();
        w.put<double>(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters[i]);
      }
  auto all = comm.bootstrap().allgather(w.bytes());
  // per[size][way][round]: the slowest rank's time.
  std::vector<std::vector<std::vector<double>>> per(sizes);
  for (size_t i = 0; i < sizes; ++i)
    per[i].assign(ways[i].size(), std::vector<double>(static_cast<size_t>(rounds), 0.0));
  for (int q = 0; q < n; ++q) {
    wire::Reader rd(all[q], "timings");
    for (int r = 0; r < rounds; ++r)
      for (size_t i = 0; i < sizes; ++i)
        for (size_t j : order[static_cast<size_t>(r)][i]) {
          double& slot = per[i][j][static_cast<size_t>(r)];
          slot = std::max(slot, rd.get<double>());
        }
  }
  std::vector<std::vector<double>> out;
  for (auto& t : per) out.push_back(paired_medians(t));
  return out;
}

std::vector<double> interleaved_medians(Communicator& comm, const std::vector<FunctionRef<void()>>& ways, int rounds,
                                        int iters) {
  return interleaved_sweep(comm, {ways}, rounds, {iters})[0];
}

std::vector<std::vector<Ranked>> measure_sweep(Communicator& comm, Collective c, const std::vector<uint64_t>& sizes,
                                               const std::vector<std::vector<Candidate>>& cands,
                                               const std::vector<int>& iters, int warmup, int rounds) {
  const int n = comm.size();
  TUTTI_CHECK(cands.size() == sizes.size(), InvalidArgument, "measure: {} sizes but {} candidate lists", sizes.size(),
              cands.size());
  CpuExecutor ex(comm, CpuExecutorOptions::from_env());
  Mailbox* mb = comm.mailbox();
  // What each size runs: its buffers, arguments and candidates, alive for the whole sweep.
  struct AtSize {
    int64_t count = 0;
    std::vector<float> in, out;
    ExecArgs args;
    std::vector<std::function<void()>> runs;
    std::vector<size_t> usable;  // indices into cands[i] that can take this call
  };
  std::vector<std::unique_ptr<AtSize>> at;
  std::vector<std::vector<FunctionRef<void()>>> ways(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto& s = *at.emplace_back(std::make_unique<AtSize>());
    s.count = static_cast<int64_t>(piece_of(c, sizes[i], n) / 4);
    const int64_t in_elems = c == Collective::kReduceScatter || c == Collective::kAllToAll ? s.count * n : s.count;
    const int64_t out_elems = c == Collective::kAllGather || c == Collective::kAllToAll ? s.count * n : s.count;
    s.in.assign(static_cast<size_t>(std::max<int64_t>(in_elems, 1)), 1.0f);
    s.out.assign(static_cast<size_t>(std::max<int64_t>(out_elems, 1)), 0.0f);
    s.args.input = s.in.data();
    s.args.output = s.out.data();
    s.args.count = s.count;
    s.args.reduction.op = RedOp::kSum;
    s.args.reduction.type = DataType::kFloat32;
    // A candidate that cannot take this call is never chosen (the same on every rank, since the
    // reasons depend only on the arguments).
    for (size_t k = 0; k < cands[i].size(); ++k) {
      const Candidate& cand = cands[i][k];
      if (cand.algorithm == kOneShot) {
        if (!mb || !oneshot_fits(*mb, c, s.count, 4)) continue;
        s.runs.push_back([&s, c, mb] { run_oneshot(*mb, c, s.in.data(), s.out.data(), s.count, s.args.reduction, 0); });
      } else {
        auto pp = PreparedPlan::make(plan_of(cand, c, n));
        if (!pp->plan.any_count && s.count % pp->plan.chunk_factor != 0) continue;
        s.runs.push_back([&ex, &s, pp] { ex.run(*pp, s.args); });
      }
      s.usable.push_back(k);
    }
    for (auto& run : s.runs) {
      for (int w = 0; w < warmup; ++w) run();
      ways[i].emplace_back(run);
    }
  }
  auto times = interleaved_sweep(comm, ways, rounds, iters);
  std::vector<std::vector<Ranked>> out(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (const Candidate& cand : cands[i]) out[i].push_back({cand, 1e300});
    for (size_t j = 0; j < at[i]->usable.size(); ++j) out[i][at[i]->usable[j]].time_us = times[i][j];
    std::stable_sort(out[i].begin(), out[i].end(), [](const Ranked& a, const Ranked& b) { return a.time_us < b.time_us; });
  }
  return out;
}

std::vector<Ranked> measure(Communicator& comm, Collective c, uint64_t bytes, const std::vector<Candidate>& cands, int iters,
                            int warmup, int rounds) {
  return measure_sweep(comm, c, {bytes}, {cands}, {iters}, warmup, rounds)[0];
}

topo::Topology live_topology(Communicator& comm) {
  // Each rank's view of its own host, with the host's identity; one view per host is kept.
  wire::Writer w;
  w.put<uint64_t>(comm.peer_info(comm.rank()).host_hash).put_string(topo::to_json(topo::host_topology()));
  auto all = comm.bootstrap().allgather(w.bytes());
  std::vector<uint64_t> host_ids;
  std::vector<topo::Topology> hosts;
  std::vector<int> host_of_rank;
  for (int r = 0; r < comm.size(); ++r) {
    wire::Reader rd(all[r], "topology exchange");
    const uint64_t id = rd.get<uint64_t>();
    std::string text = rd.get_string();
    auto it = std::find(host_ids.begin(), host_ids.end(), id);
    if (it == host_ids.end()) {
      host_ids.push_back(id);
      hosts.push_back(topo::parse_json(text));
      it = host_ids.end() - 1;
    }
    host_of_rank.push_back(static_cast<int>(it - host_ids.begin()));
  }
  return topo::merge(hosts, host_of_rank);
}

}  // namespace tutti::tuning
