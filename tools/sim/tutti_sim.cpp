// tutti-sim: predicted time of plans on a topology (compiler/simulate.hpp).
//
//   tutti-sim --builtin ring_allreduce [--ranks N] [-p k=v] --topo dgx-h100|FILE [--nodes N] [--sizes 1K:1G]
//   tutti-sim --plan FILE.{json,xml} --topo ...
//   tutti-sim --compare allreduce --topo ...      every built-in for the collective, fastest first per size
//   tutti-sim --builtin ring_allreduce --ranks 4 --topo live [--transport shm|tcp] [--calibration FILE]
//       this host, with the cost model calibrated by `tutti-tune --calibrate` (collectives/calibrate.hpp)

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>

#include "collectives/algorithms/registry.hpp"
#include "collectives/calibrate.hpp"
#include "collectives/tuner.hpp"
#include "compiler/compile.hpp"
#include "compiler/plan_file.hpp"
#include "compiler/simulate.hpp"
#include "core/env.hpp"
#include "core/error.hpp"

using namespace tutti;

namespace {
double bus_factor(Collective c, int n) {
  switch (c) {
    case Collective::kAllReduce: return 2.0 * (n - 1) / n;
    case Collective::kAllGather:
    case Collective::kReduceScatter:
    case Collective::kAllToAll: return static_cast<double>(n - 1) / n;
    default: return 1;
  }
}
// nccl-tests' size (the larger buffer) for a per-rank piece of `piece` bytes.
uint64_t total_bytes(Collective c, uint64_t piece, int n) {
  bool scaled = c == Collective::kAllGather || c == Collective::kReduceScatter || c == Collective::kAllToAll;
  return scaled ? piece * n : piece;
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tutti-sim: predicted time, algbw and busbw of a plan on a topology"};
  std::string builtin, plan_file, topo_name, sizes = "1K:1G", compare, transport, calibration;
  int ranks = 0, nodes = 1;
  double factor = 4;
  std::vector<std::string> params;
  app.add_option("--builtin", builtin, "built-in algorithm");
  app.add_option("--plan", plan_file, "plan file (.json or MSCCL .xml)");
  app.add_option("--compare", compare, "rank every built-in of this collective (allreduce, allgather, ...)");
  app.add_option("--ranks", ranks, "ranks (default: all ranks of the topology)");
  app.add_option("--param,-p", params, "algorithm parameter k=v");
  app.add_option("--topo", topo_name, "preset name, topology file, or live (this host, calibrated)")->required();
  app.add_option("--transport", transport, "live: the calibration of shm or tcp (default: TUTTI_TRANSPORT, else shm)");
  app.add_option("--calibration", calibration, "live: calibration file (default: TUTTI_CALIBRATION_FILE or the cache)");
  app.add_option("-f,--factor", factor, "size step factor");
  app.add_option("--nodes", nodes, "nodes of a preset");
  app.add_option("--sizes", sizes, "MIN:MAX sizes in bytes (nccl-tests' size), steps of --factor");
  CLI11_PARSE(app, argc, argv);
  try {
    topo::Topology t;
    plan::CostModel model;
    if (topo_name == "live") {
      if (ranks == 0) ranks = 2;
      if (transport.empty()) transport = env::get_string("TUTTI_TRANSPORT") == "tcp" ? "tcp" : "shm";
      if (calibration.empty()) calibration = tuning::calibration_path();
      auto cal = tuning::find_calibration(calibration, transport, ranks);
      TUTTI_CHECK(cal.has_value(), InvalidArgument,
                  "no calibration for {} ranks over {} in {}: run tutti-run -n {} tutti-tune --calibrate{}", ranks, transport,
                  calibration, ranks, transport == "tcp" ? " (with TUTTI_TRANSPORT=tcp)" : "");
      t = tuning::host_topology(ranks);
      tuning::apply(*cal, t, model);
    } else {
      t = topo_name.find('.') != std::string::npos ? topo::load_file(topo_name) : topo::preset(topo_name, nodes);
    }
    if (ranks == 0) ranks = t.nranks();
    auto colon = sizes.find(':');
    TUTTI_CHECK(colon != std::string::npos, InvalidArgument, "--sizes '{}' is not MIN:MAX", sizes);
    uint64_t lo = env::parse_size(sizes.substr(0, colon)), hi = env::parse_size(sizes.substr(colon + 1));
    std::vector<uint64_t> list;
    list = tuning::sweep(lo, hi, factor);
    std::vector<std::pair<std::string, plan::Plan>> candidates;
    if (!compare.empty()) {
      auto c = parse_collective(compare);
      TUTTI_CHECK(c.has_value(), InvalidArgument, "--compare: unknown collective '{}'", compare);
      for (const auto& b : algorithms::builtins()) {
        if (b.collective != *c) continue;
        try {
          candidates.push_back({b.name, plan::compile(b.build(ranks, algorithms::resolve(b, ranks, {}))).plan});
        } catch (const InvalidArgument&) {
        }
      }
    } else if (!plan_file.empty()) {
      candidates.push_back({plan_file, plan::load_file(plan_file)});
    } else {
      TUTTI_CHECK(!builtin.empty(), InvalidArgument, "give --builtin, --plan or --compare");
      algorithms::Params given = algorithms::parse_params(params);
      candidates.push_back({builtin, plan::compile(algorithms::build(builtin, ranks, given)).plan});
    }
    TUTTI_CHECK(!candidates.empty(), InvalidArgument, "no built-in applies to {} ranks", ranks);
    std::printf("# topology %s, %d ranks; times predicted by the alpha-beta model with link sharing\n", t.name.c_str(), ranks);
    std::printf("%12s  %-22s %12s %10s %10s\n", "size (B)", "plan", "time (us)", "algbw", "busbw");
    for (uint64_t size : list) {
      std::vector<std::pair<double, std::string>> rows;
      for (auto& [name, p] : candidates) {
        uint64_t piece = size / (total_bytes(p.collective, 1, p.nranks));
        double us = plan::simulate(p, t, piece, model).time_us;
        rows.push_back({us, name});
      }
      std::sort(rows.begin(), rows.end());
      for (auto& [us, name] : rows) {
        double algbw = size / (us * 1e-6) / 1e9;
        std::printf("%12llu  %-22s %12.2f %10.2f %10.2f\n", static_cast<unsigned long long>(size), name.c_str(), us, algbw,
                    algbw * bus_factor(candidates[0].second.collective, ranks));
      }
    }
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "tutti-sim: %s\n", e.what());
    return 1;
  }
}
