// tutti-tune: decision tables for the dispatcher (collectives/tuner.hpp).
//
// On the live machine, one process per rank under tutti-run (or -t N threads in one process):
//   tutti-run -n 4 tutti-tune [--collective all_reduce|...|all] [-b 8] [-e 64M] [-f 2] [--top 4] [-n ITERS] [-o table.json]
// measures, at each size, the cost model's best candidates and every fixed algorithm, keeps the
// fastest (slowest rank's time), and writes the table (default: TUTTI_TUNING_FILE). The rounds run
// over the whole sweep (tuning::measure_sweep), so a size is not judged in one phase of the machine.
//
// Calibration of the cost model (collectives/calibrate.hpp), stored for tutti-sim --topo live and
// the tuner:
//   tutti-run -n 2 tutti-tune --calibrate [--calibration FILE]
//
// The tuned dispatcher against the fixed windows and every fixed all-reduce algorithm, in one run:
//   tutti-run -n 2 tutti-tune --compare table.json [-b 8] [-e 64M] [--rounds 7]
// Every configuration is a dispatcher of its own on the same communicator, all sharing one executor
// and plan cache (so the same choice runs on the same memory). In each of `rounds` rounds, over every
// size, they take turns (tuning::interleaved_sweep: a shuffled order each time; an untimed call, a
// barrier, then timed calls), and each one's time is the median over rounds of the slowest rank's
// mean. Prints every configuration's time and the ratio tuned / best fixed per size.
//
// From the model alone, for a machine we do not have:
//   tutti-tune --topo dgx-h100 [--nodes N] [--ranks N] [--collective all_reduce] [-b 8] [-e 1G] [-f 2] [-o table.json]

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <functional>
#include <cstdio>
#include <thread>

#include "collectives/calibrate.hpp"
#include "collectives/dispatcher.hpp"
#include "collectives/tuner.hpp"
#include "core/env.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

using namespace tutti;

namespace {

std::vector<Collective> collectives_of(const std::string& name) {
  if (name == "all")
    return {Collective::kAllReduce, Collective::kAllGather, Collective::kReduceScatter,
            Collective::kBroadcast, Collective::kReduce, Collective::kAllToAll};
  std::string n = name;
  std::erase(n, '_');
  auto c = parse_collective(n);
  TUTTI_CHECK(c.has_value(), InvalidArgument, "unknown collective '{}' (all_reduce, all_gather, reduce_scatter, "
              "broadcast, reduce, alltoall, all)", name);
  return {*c};
}

void print(const tuning::Table& t) {
  std::printf("# decision table (%s, %s)\n", t.source.c_str(), t.topology.c_str());
  std::printf("# %-14s %6s %12s %12s  %-34s %12s\n", "collective", "ranks", "min_bytes", "max_bytes", "choice", "time_us");
  for (auto& e : t.entries)
    std::printf("  %-14s %6d %12llu %12s  %-34s %12.2f\n", to_string(e.collective), e.nranks,
                static_cast<unsigned long long>(e.min_bytes),
                e.max_bytes == UINT64_MAX ? "inf" : std::to_string(e.max_bytes).c_str(), e.choice.describe().c_str(),
                e.time_us);
}

// Timed calls per round: enough to rise above the clock at small sizes, few at large ones.
int calls_per_round(uint64_t bytes) { return bytes <= (64u << 10) ? 100 : bytes <= (4u << 20) ? 10 : 4; }

// See the header comment: --compare.
void compare(Communicator& comm, const std::string& table, const std::vector<uint64_t>& sizes, int rounds, int iters) {
  const int n = comm.size();
  std::vector<std::pair<std::string, DispatcherOptions>> configs;
  DispatcherOptions base = DispatcherOptions::from_env();
  base.algo.reset();
  base.tune = false;
  base.tuning_file.reset();
  DispatcherOptions tuned = base;
  tuned.tuning_file = table;
  tuning::Table::load(table);  // a missing or damaged table is an error, not an untuned run
  configs.push_back({"tuned", tuned});
  configs.push_back({"windows", base});
  DispatcherOptions online = base;  // TUTTI_TUNE=1: measured in this process on first use
  online.tune = true;
  configs.push_back({"online", online});
  for (const char* a : {"ring", "rhd", "allpairs", "tree", "hier"}) {
    try {
      algorithms::resolve(algorithms::find_builtin(std::string(a) + "_allreduce"), n, {});
    } catch (const InvalidArgument&) {
      continue;  // not for this rank count
    }
    DispatcherOptions o = base;
    o.algo = a;
    configs.push_back({a, o});
  }
  // One executor and plan cache for all: configurations that choose the same plan run it on the
  // same memory, so what differs between them is the choice alone.
  auto shared = std::make_shared<DispatchResources>(comm, base.executor);
  std::vector<std::unique_ptr<Dispatcher>> ds;
  for (auto& [name, o] : configs) ds.push_back(std::make_unique<Dispatcher>(comm, o, shared));
  const size_t k = configs.size();
  std::vector<std::vector<double>> median(k);  // [config][size]
  if (comm.rank() == 0) {
    std::printf("# all_reduce, %d ranks, float sum, out of place; median of %d interleaved rounds (us)\n%10s", n, rounds,
                "size");
    for (auto& c : configs) std::printf(" %9s", c.first.c_str());
    std::printf(" %10s %10s %11s\n", "best_fixed", "tuned/best", "online/best");
  }
  double worst = 0, worst_online = 0;
  constexpr size_t kFixed = 3;  // configs before this are tuned, windows, online
  // Every size's call with its buffers, alive for the whole sweep: rounds run over all sizes
  // (tuning::interleaved_sweep), so each median spans the run, not one phase of the machine.
  struct AtSize {
    std::vector<float> in, out;
    CollectiveCall call;
    std::vector<std::function<void()>> runs;
  };
  std::vector<std::unique_ptr<AtSize>> at;
  std::vector<std::vector<FunctionRef<void()>>> ways;
  std::vector<int> calls;
  for (uint64_t s : sizes) {
    auto& a = *at.emplace_back(std::make_unique<AtSize>());
    const int64_t count = static_cast<int64_t>(std::max<uint64_t>(s / 4, 1));
    a.in.assign(static_cast<size_t>(count), 1.f);
    a.out.assign(static_cast<size_t>(count), 0.f);
    a.call.input = a.in.data();
    a.call.output = a.out.data();
    a.call.count = count;
    for (auto& d : ds) d->run(a.call);  // warm-up: plans compiled (and tuned, online), pages touched
    for (auto& d : ds) a.runs.push_back([&a, dp = d.get()] { dp->run(a.call); });
    ways.emplace_back(a.runs.begin(), a.runs.end());
    calls.push_back(iters > 0 ? iters : calls_per_round(s));
  }
  auto times = tuning::interleaved_sweep(comm, ways, rounds, calls);
  for (size_t i = 0; i < sizes.size(); ++i) {
    const auto& t = times[i];
    for (size_t j = 0; j < k; ++j) median[j].push_back(t[j]);
    size_t best = kFixed;
    for (size_t j = kFixed; j < k; ++j)
      if (median[j].back() < median[best].back()) best = j;
    double ratio = median[0].back() / median[best].back(), online_ratio = median[2].back() / median[best].back();
    worst = std::max(worst, ratio);
    worst_online = std::max(worst_online, online_ratio);
    if (comm.rank() == 0) {
      std::printf("%10llu", static_cast<unsigned long long>(sizes[i]));
      for (size_t j = 0; j < k; ++j) std::printf(" %9.2f", median[j].back());
      std::printf(" %10s %10.3f %11.3f\n", configs[best].first.c_str(), ratio, online_ratio);
    }
  }
  if (comm.rank() != 0) return;
  std::printf("worst tuned / best fixed: %.3f, online / best fixed: %.3f\n", worst, worst_online);
  // Over the whole sweep: the geometric mean of time ratios (every size counts alike), the sum of
  // times (the largest sizes dominate) and nccl-tests' "Avg bus bandwidth" (mean busbw over sizes).
  std::printf("%-10s %16s %17s %12s %12s %12s %14s %14s %14s\n", "against", "geomean tuned/x", "geomean online/x",
              "sum x (us)", "sum tuned", "sum online", "avg busbw x", "avg bw tuned", "avg bw online");
  auto total = [&](size_t j) {
    double sum = 0;
    for (double t : median[j]) sum += t;
    return sum;
  };
  auto geomean = [&](size_t a, size_t b) {
    double g = 0;
    for (size_t i = 0; i < sizes.size(); ++i) g += std::log(median[a][i] / median[b][i]);
    return std::exp(g / static_cast<double>(sizes.size()));
  };
  auto avg_busbw = [&](size_t j) {  // GB/s, all-reduce's factor 2(n-1)/n
    double sum = 0;
    for (size_t i = 0; i < sizes.size(); ++i)
      sum += static_cast<double>(sizes[i]) / (median[j][i] * 1e3) * 2.0 * (n - 1) / n;
    return sum / static_cast<double>(sizes.size());
  };
  for (size_t j = 1; j < k; ++j)
    if (j != 2)
      std::printf("%-10s %16.3f %17.3f %12.1f %12.1f %12.1f %14.3f %14.3f %14.3f\n", configs[j].first.c_str(),
                  geomean(0, j), geomean(2, j), total(j), total(0), total(2), avg_busbw(j), avg_busbw(0), avg_busbw(2));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tutti-tune: decision tables for the dispatcher, measured on this machine or predicted for a preset"};
  std::string coll = "all_reduce", topo_name, output, min_s = "8", max_s = "64M";
  double factor = 2;
  int top = 4, iters = 0, warmup = 2, ranks = 0, nodes = 1, threads = 0;
  bool calibrate = false;
  std::string calibration, compare_table;
  int rounds = 7, tune_rounds = 9;
  app.add_option("--collective", coll, "collective (all_reduce, ...), or all");
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
  app.add_flag("--calibrate", calibrate, "live: measure alpha, beta, memory rate and instruction overhead, and store them");
  app.add_option("--calibration", calibration, "calibration file (default: TUTTI_CALIBRATION_FILE or the cache)");
  app.add_option("--compare", compare_table, "live: compare this decision table with every fixed all-reduce algorithm");
  app.add_option("--rounds", rounds, "--compare: interleaved rounds per size");
  app.add_option("--tune-rounds", tune_rounds, "live tuning: interleaved rounds per size");
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
      // Progress on stderr as each collective is done (the model of a 1 GiB sweep takes seconds each);
      // stdout keeps only the table.
      const auto start = std::chrono::steady_clock::now();
      for (size_t k = 0; k < colls.size(); ++k) {
        auto part = tuning::tune_model(t, colls[k], ranks, sizes);
        for (auto& e : part.entries) table.put(e);
        std::fprintf(stderr, "tutti-tune: [%zu/%zu] %s: %zu size window(s), %.1f s\n", k + 1, colls.size(),
                     to_string(colls[k]), part.entries.size(),
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      print(table);
      if (!output.empty()) table.save(output);
      return 0;
    }
    auto tune_rank = [&](Communicator& comm) {
      if (!compare_table.empty()) {
        compare(comm, compare_table, sizes, rounds, iters);
        return;
      }
      if (calibrate) {
        tuning::Calibration cal = tuning::calibrate(comm);
        if (comm.rank() == 0) {
          const std::string path = calibration.empty() ? tuning::calibration_path() : calibration;
          tuning::save_calibration(path, cal);
          std::printf("# calibration (%s, %d ranks, %d cores) -> %s\n", cal.transport.c_str(), cal.nranks, cal.cores,
                      path.c_str());
          std::printf("alpha %.3f us, beta %.3f GB/s, both ways %.3f GB/s, memory %.3f GB/s, instruction %.3f us (local %.3f us)\n",
                      cal.alpha_us, cal.beta_gbps, cal.exchange_gbps, cal.memory_gbps, cal.instruction_us,
                      cal.local_instruction_us);
          for (auto& [s, t] : cal.pingpong)
            std::printf("  %10llu B  %10.2f us  (fit %.2f us)\n", static_cast<unsigned long long>(s), t,
                        cal.alpha_us + static_cast<double>(s) / (cal.beta_gbps * 1e3));
          std::printf("copy rate per bytes touched, every rank at once:");
          for (auto& [s, g] : cal.memory_curve)
            std::printf(" %lluK %.1f GB/s", static_cast<unsigned long long>(s >> 10), g);
          std::printf("\n");
          if (!cal.single_copy.empty()) {
            std::printf("single copy vs FIFO under a ring's load (GB/s per direction):");
            for (auto& [s, r] : cal.single_copy)
              std::printf(" %lluK %.2f/%.2f", static_cast<unsigned long long>(s >> 10), r.second, r.first);
            if (cal.single_copy_threshold == UINT64_MAX) std::printf("; single copy never (it loses at every size)\n");
            else std::printf("; single copy from %llu bytes\n", static_cast<unsigned long long>(cal.single_copy_threshold));
          }
          if (cal.spin_us > 0) {
            std::printf("waits: time relative to the best, per polling window:");
            for (auto& [us, rel] : cal.spin_points) std::printf(" %d us %.2f", us, rel);
            std::printf("; a sleep costs %.1f us a hop; poll %d us\n", cal.wake_us, cal.spin_us);
          }
          if (cal.fifo_slots > 0) {
            std::printf("FIFO layouts, time relative to the best:");
            for (auto& f : cal.fifo_points)
              std::printf(" %ux%lluK %.2f", f.slots, static_cast<unsigned long long>(f.slot_bytes >> 10), f.relative);
            std::printf("; %u slots of %llu bytes\n", cal.fifo_slots, static_cast<unsigned long long>(cal.fifo_slot_bytes));
          }
          if (cal.tile_bytes > 0) {
            std::printf("tiles (ring all-reduce of 16 MiB), time relative to the best:");
            for (auto& [t, rel] : cal.tile_points) std::printf(" %lldK %.2f", static_cast<long long>(t >> 10), rel);
            std::printf("; tiles of %lld bytes\n", static_cast<long long>(cal.tile_bytes));
          }
          for (auto& cut : cal.oneshot) {
            std::printf("one-shot vs %s (us):", to_string(cut.collective));
            for (auto& [s, t] : cut.points)
              std::printf(" %llu B %.2f/%.2f", static_cast<unsigned long long>(s), t.first, t.second);
            if (cut.threshold == UINT64_MAX) std::printf("; one-shot wherever it fits\n");
            else if (cut.threshold == 0) std::printf("; the plan at every size\n");
            else std::printf("; one-shot up to %llu B\n", static_cast<unsigned long long>(cut.threshold));
          }
        }
        return;
      }
      tuning::Table table;
      table.topology = "live";
      table.source = "measured";
      topo::Topology t = tuning::live_topology(comm);
      for (auto c : colls) {
        std::vector<std::vector<tuning::Candidate>> cands;
        std::vector<int> calls;
        for (uint64_t s : sizes) {
          calls.push_back(iters > 0 ? iters : calls_per_round(s));
          cands.push_back(tuning::shortlist(c, comm.size(), s, t, top));
          // The one-shot path where every rank shares memory; measure_sweep() rules it out where
          // the call does not fit the mailbox.
          if (comm.mailbox()) cands.back().push_back({tuning::kOneShot, {}});
        }
        auto rankings = tuning::measure_sweep(comm, c, sizes, cands, calls, warmup, tune_rounds);
        auto best = tuning::choose_smoothed(rankings);
        if (comm.rank() == 0)
          for (size_t i = 0; i < sizes.size(); ++i)
            TUTTI_INFO(log::kTuning, "{} {} B: {} {:.2f} us (fastest {} {:.2f} us)", to_string(c), sizes[i],
                       best[i].candidate.describe(), best[i].time_us, rankings[i].front().candidate.describe(),
                       rankings[i].front().time_us);
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
