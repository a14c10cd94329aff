// tutti-tune: decision tables for the dispatcher (collectives/tuner.hpp).
//
// On the live machine, one process per rank under tutti-run (or -t N threads in one process):
//   tutti-run -n 4 tutti-tune [-c all_reduce|...|all] [-b 8] [-e 64M] [-f 2] [--top 4] [-n ITERS] [-o table.json]
// measures, at each size, the cost model's best candidates and every fixed algorithm, keeps the
// fastest (slowest rank's time), and writes the table (default: TUTTI_TUNING_FILE).
//
// From the model alone, for a machine we do not have:
//   tutti-tune --topo dgx-h100 [--nodes N] [--ranks N] [-c all_reduce] [-b 8] [-e 1G] [-f 2] [-o table.json]

#include <CLI/CLI.hpp>
#include <cstdio>
#include <thread>

#include "collectives/tuner.hpp"
#include "core/env.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

using namespace tutti;

namespace {

std::vector<dsl::Collective> collectives_of(const std::string& name) {
  if (name == "all")
    return {dsl::Collective::kAllReduce, dsl::Collective::kAllGather, dsl::Collective::kReduceScatter,
            dsl::Collective::kBroadcast, dsl::Collective::kReduce, dsl::Collective::kAllToAll};
  std::string n = name;
  std::erase(n, '_');
  auto c = dsl::parse_collective(n);
  TUTTI_CHECK(c.has_value(), InvalidArgument, "unknown collective '{}' (all_reduce, all_gather, reduce_scatter, "
              "broadcast, reduce, alltoall, all)", name);
  return {*c};
}

void print(const tuning::Table& t) {
  std::printf("# decision table (%s, %s)\n", t.source.c_str(), t.topology.c_str());
  std::printf("# %-14s %6s %12s %12s  %-34s %12s\n", "collective", "ranks", "min_bytes", "max_bytes", "choice", "time_us");
  for (auto& e : t.entries)
    std::printf("  %-14s %6d %12llu %12s  %-34s %12.2f\n", dsl::to_string(e.collective), e.nranks,
                static_cast<unsigned long long>(e.min_bytes),
                e.max_bytes == UINT64_MAX ? "inf" : std::to_string(e.max_bytes).c_str(), e.choice.describe().c_str(),
                e.time_us);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tutti-tune: decision tables for the dispatcher, measured on this machine or predicted for a preset"};
  std::string coll = "all_reduce", topo_name, output, min_s = "8", max_s = "64M";
  double factor = 2;
  int top = 4, iters = 0, warmup = 2, ranks = 0, nodes = 1, threads = 0;
  app.add_option("-c,--collective", coll, "collective, or all");
  app.add_option("-b", min_s, "smallest size (nccl-tests' size)");
  app.add_option("-e", max_s, "largest size");
  app.add_option("-f", factor, "size factor");
  app.add_option("--top", top, "model candidates to measure at each size (besides every fixed algorithm)");
  app.add_option("-n,--iters", iters, "timed calls per candidate (default: by size)");
  app.add_option("-w,--warmup", warmup, "untimed calls per candidate");
  app.add_option("-o,--output", output, "table file (default: TUTTI_TUNING_FILE)");
  app.add_option("--topo", topo_name, "preset or topology file: tune from the model alone");
  app.add_option("--nodes", nodes, "nodes of a preset");
  app.add_option("--ranks", ranks, "ranks (model: default all of the topology)");
  app.add_option("-t,--threads", threads, "live: run this many ranks as threads of this process");
  CLI11_PARSE(app, argc, argv);
  try {
    if (output.empty())
      if (auto f = env::raw("TUTTI_TUNING_FILE")) output = *f;
    auto sizes = tuning::sweep(env::parse_size(min_s), env::parse_size(max_s), factor);
    auto colls = collectives_of(coll);
    if (!topo_name.empty()) {
      topo::Topology t = topo_name.find('.') != std::string::npos ? topo::load_file(topo_name) : topo::preset(topo_name, nodes);
      if (ranks == 0) ranks = t.nranks();
      tuning::Table table;
      table.topology = topo_name + (nodes > 1 ? fmt::format("x{}", nodes) : "");
      table.source = "model";
      for (auto c : colls) {
        auto part = tuning::tune_model(t, c, ranks, sizes);
        for (auto& e : part.entries) table.put(e);
      }
      print(table);
      if (!output.empty()) table.save(output);
      return 0;
    }
    auto tune_rank = [&](Communicator& comm) {
      tuning::Table table;
      table.topology = "live";
      table.source = "measured";
      topo::Topology t = tuning::live_topology(comm);
      for (auto c : colls) {
        std::vector<tuning::Ranked> best;
        for (uint64_t s : sizes) {
          int n = iters > 0 ? iters : s <= (64u << 10) ? 200 : s <= (4u << 20) ? 20 : 5;
          auto ranked = tuning::measure(comm, c, s, tuning::shortlist(c, comm.size(), s, t, top), n, warmup);
          if (comm.rank() == 0)
            TUTTI_INFO(log::kTuning, "{} {} B: {} {:.2f} us", dsl::to_string(c), s, ranked.front().candidate.describe(),
                       ranked.front().time_us);
          best.push_back(ranked.front());
        }
        tuning::add_windows(table, c, comm.size(), sizes, best);
      }
      if (comm.rank() == 0) {
        print(table);
        if (!output.empty()) table.save(output);
      }
    };
    if (threads > 0) {
      auto comms = Communicator::create_local(threads);
      std::vector<std::thread> ts;
      std::vector<std::exception_ptr> errors(threads);
      for (int r = 0; r < threads; ++r)
        ts.emplace_back([&, r] {
          try {
            log::set_thread_rank(r);
            tune_rank(*comms[r]);
          } catch (...) {
            errors[r] = std::current_exception();
          }
        });
      for (auto& x : ts) x.join();
      for (auto& e : errors)
        if (e) std::rethrow_exception(e);
    } else {
      auto comm = Communicator::create_from_env();
      tune_rank(*comm);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "tutti-tune: %s\n", e.what());
    return 1;
  }
  return 0;
}
