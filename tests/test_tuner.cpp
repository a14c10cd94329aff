// The tuner (collectives/tuner.hpp) and calibration (collectives/calibrate.hpp): decision tables, their JSON, the checked-in tables of the
// presets (current and sane), and the dispatcher's use of a table (TUTTI_TUNING_FILE, TUTTI_TUNE).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <thread>

#include "collectives/algorithms/registry.hpp"
#include "collectives/calibrate.hpp"
#include "collectives/dispatcher.hpp"
#include "compiler/compile.hpp"
#include "collectives/tuner.hpp"
#include "core/error.hpp"
#include "support/env.hpp"
#include "tests/support/ranks.hpp"

using namespace tutti;
using test_support::on_ranks;
using tuning::Candidate;
using tuning::Entry;
using tuning::Table;

namespace {

const std::vector<uint64_t>& preset_sizes() {
  static const auto s = tuning::sweep(8, uint64_t{1} << 30, 4);  // what tools/tune/preset_tables.sh uses
  return s;
}

std::string checked_in(const std::string& preset) {
  return std::string(TUTTI_SOURCE_DIR) + "/topologies/tuning/" + preset + ".json";
}

const Collective kTuned[] = {Collective::kAllReduce, Collective::kAllGather, Collective::kReduceScatter,
                             Collective::kBroadcast, Collective::kReduce,    Collective::kAllToAll};

// Entries of one collective, in window order.
std::vector<Entry> of(const Table& t, Collective c) {
  std::vector<Entry> v;
  for (auto& e : t.entries)
    if (e.collective == c) v.push_back(e);
  return v;
}


// One float all-reduce of `count` on a dispatcher; returns the plan it ran.
std::string allreduce(Dispatcher& d, int64_t count) {
  std::vector<float> in(static_cast<size_t>(count), 1.f), out(static_cast<size_t>(count));
  CollectiveCall call;
  call.input = in.data();
  call.output = out.data();
  call.count = count;
  d.run(call);
  return d.last_plan();
}

}  // namespace

TEST(Tuner, TablesRoundTripThroughJsonAndNameWhatIsWrong) {
  Table t;
  t.topology = "dgx-h100";
  t.source = "model";
  t.put({Collective::kAllReduce, 8, 0, 4096, {"allpairs_allreduce", {{"chunks", 2}}, Protocol::kLL}, 3.5});
  t.put({Collective::kAllReduce, 8, 4097, UINT64_MAX, {"ring_allreduce", {{"channels", 4}}}, 99});
  t.put({Collective::kAllReduce, 2, 0, 1024, {tuning::kOneShot, {}}, 0.2});
  Table back = Table::from_json(t.to_json());
  ASSERT_EQ(back.entries.size(), 3u);
  EXPECT_EQ(back.to_json(), t.to_json());
  EXPECT_EQ(back.find(Collective::kAllReduce, 8, 5000)->choice.algorithm, "ring_allreduce");
  EXPECT_EQ(back.find(Collective::kAllReduce, 8, 100)->choice.protocol, Protocol::kLL);
  EXPECT_EQ(back.find(Collective::kAllGather, 8, 100), nullptr);

  auto error_of = [](const std::string& text) {
    try {
      Table::from_json(text);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string head = R"({"version": 1, "entries": [{"collective": "allreduce", "nranks": 2, )";
  EXPECT_NE(error_of("{").find("not JSON"), std::string::npos);
  EXPECT_NE(error_of(R"({"version": 7, "entries": []})").find("version 7"), std::string::npos);
  EXPECT_NE(error_of(head + R"("min_bytes": 0, "max_bytes": 8, "algorithm": "ring_allgather"}]})")
                .find("entry 0: ring_allgather is not a allreduce algorithm"),
            std::string::npos);
  EXPECT_NE(error_of(head + R"("min_bytes": 9, "max_bytes": 8, "algorithm": "ring_allreduce"}]})").find("min_bytes 9 > max_bytes 8"),
            std::string::npos);
  EXPECT_NE(error_of(head + R"("min_bytes": 0, "max_bytes": 8, "algorithm": "ring_allreduce", "protocol": "LL64"}]})")
                .find("unknown protocol 'LL64'"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"version": 1, "entries": [{"collective": "allsum", "nranks": 2}]})").find("unknown collective 'allsum'"),
            std::string::npos);
}

TEST(Tuner, PutCarvesOverlappingWindows) {
  Table t;
  t.put({Collective::kAllReduce, 4, 0, UINT64_MAX, {"ring_allreduce", {}}, 0});
  t.put({Collective::kAllReduce, 4, 100, 200, {"rhd_allreduce", {}}, 0});
  ASSERT_EQ(t.entries.size(), 3u);
  EXPECT_EQ(t.find(Collective::kAllReduce, 4, 99)->choice.algorithm, "ring_allreduce");
  EXPECT_EQ(t.find(Collective::kAllReduce, 4, 150)->choice.algorithm, "rhd_allreduce");
  EXPECT_EQ(t.find(Collective::kAllReduce, 4, 201)->choice.algorithm, "ring_allreduce");
}

TEST(Tuner, CandidatesCoverTheParameterGrid) {
  auto cands = tuning::candidates(Collective::kAllReduce, 8);
  auto has = [&](const Candidate& c) { return std::find(cands.begin(), cands.end(), c) != cands.end(); };
  EXPECT_TRUE(has({"ring_allreduce", {{"channels", 4}}}));
  EXPECT_TRUE(has({"hier_allreduce", {{"local", 4}}}));
  EXPECT_FALSE(has({"hier_allreduce", {{"local", 3}}}));  // not a divisor of 8
  auto with_protocols = tuning::candidates(Collective::kAllReduce, 8, true);
  EXPECT_EQ(with_protocols.size(), 3 * cands.size());
  for (Collective c : kTuned) EXPECT_FALSE(tuning::candidates(c, 5).empty()) << to_string(c);
}

class PresetTable : public ::testing::TestWithParam<std::string> {};

TEST_P(PresetTable, IsCurrentCoversEverySizeAndChoosesSensibly) {
  const std::string preset = GetParam();
  const topo::Topology topo = topo::preset(preset);
  const Table file = Table::load(checked_in(preset));
  EXPECT_EQ(file.source, "model");
  for (Collective c : kTuned) {
    // Current: the model today makes the same choices (regenerate with tools/tune/preset_tables.sh).
    const Table now = tuning::tune_model(topo, c, topo.nranks(), preset_sizes());
    auto mine = of(file, c), theirs = of(now, c);
    ASSERT_EQ(mine.size(), theirs.size()) << preset << " " << to_string(c)
                                          << ": checked-in table is stale; run tools/tune/preset_tables.sh";
    for (size_t k = 0; k < mine.size(); ++k) {
      EXPECT_EQ(mine[k].choice, theirs[k].choice) << preset << " " << to_string(c) << " window " << k;
      EXPECT_EQ(mine[k].min_bytes, theirs[k].min_bytes);
      EXPECT_EQ(mine[k].max_bytes, theirs[k].max_bytes);
      EXPECT_NEAR(mine[k].time_us, theirs[k].time_us, 1e-6 * std::max(1.0, theirs[k].time_us));
    }
    // Every size has exactly one choice: windows from 0 to the end, each starting where the last ended.
    ASSERT_FALSE(mine.empty());
    EXPECT_EQ(mine.front().min_bytes, 0u);
    EXPECT_EQ(mine.back().max_bytes, UINT64_MAX);
    for (size_t k = 1; k < mine.size(); ++k) EXPECT_EQ(mine[k].min_bytes, mine[k - 1].max_bytes + 1);
    // Neighbouring windows differ (else they would be one), and larger sizes never predict less time.
    for (size_t k = 1; k < mine.size(); ++k) {
      EXPECT_FALSE(mine[k].choice == mine[k - 1].choice);
      EXPECT_GE(mine[k].time_us, mine[k - 1].time_us) << preset << " " << to_string(c) << " window " << k;
    }
  }
  // All-reduce: few steps for small messages, every byte over each link once for large ones.
  auto ar = of(file, Collective::kAllReduce);
  EXPECT_NE(ar.front().choice.algorithm, "ring_allreduce") << preset;
  const std::string large = ar.back().choice.algorithm;
  EXPECT_TRUE(large == "ring_allreduce" || large == "hier_allreduce") << preset << ": " << large;
  const bool nvswitch = topo.count(topo::DeviceType::kNvSwitch) > 0;
  if (nvswitch) {
    EXPECT_EQ(ar.front().choice.algorithm, "allpairs_allreduce") << preset;
    EXPECT_EQ(large, "ring_allreduce") << preset;
  }
  // GPU presets: LL while latency dominates, Simple at the largest sizes, as NCCL does.
  if (topo.count(topo::DeviceType::kGpu) > 0)
    for (Collective c : kTuned) {
      auto v = of(file, c);
      EXPECT_EQ(v.front().choice.protocol, Protocol::kLL) << preset << " " << to_string(c);
      EXPECT_EQ(v.back().choice.protocol, Protocol::kSimple) << preset << " " << to_string(c);
    }
}

INSTANTIATE_TEST_SUITE_P(Presets, PresetTable,
                         ::testing::Values("dgx1", "dgx-a100", "ndv4", "dgx-h100", "ndv5", "ncv4", "pcie8", "cpu-tcp"),
                         [](const auto& info) {
                           std::string s = info.param;
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

TEST(Tuner, DispatcherFollowsTheTuningFile) {
  const std::string path = testing::TempDir() + "tutti_tuning_" + std::to_string(getpid()) + ".json";
  Table t;
  t.put({Collective::kAllReduce, 2, 0, 1024, {"ring_allreduce", {{"channels", 2}}}, 0});
  t.put({Collective::kAllReduce, 2, 1025, 4096, {tuning::kOneShot, {}}, 0});
  t.put({Collective::kAllReduce, 2, 4097, UINT64_MAX, {"hier_allreduce", {{"local", 3}}}, 0});  // not for 2 ranks
  t.save(path);
  test_support::ScopedEnv env({{"TUTTI_TUNING_FILE", path.c_str()}});
  auto comms = Communicator::create_local(2);
  std::vector<std::vector<std::string>> plans(2);
  on_ranks(comms, [&](int rank, Communicator& comm) {
    Dispatcher d(comm);
    for (int64_t count : {16, 512, 8192}) plans[rank].push_back(allreduce(d, count));
  });
  std::remove(path.c_str());
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(plans[r][0].find("ring"), std::string::npos) << plans[r][0];
    EXPECT_EQ(plans[r][1], "oneshot");
    // An entry that does not apply falls back to the fixed windows (with a warning).
    EXPECT_EQ(plans[r][2].find("hier"), std::string::npos) << plans[r][2];
  }
}

// Without a table: a broadcast past the tree's sizes is a chain and a 32 KiB call runs a plan, unless
// every rank shares one host with fewer cores than ranks, where a plan's stages wait for ranks that
// are not running: then the tree, and the mailbox up to 128 KiB.
TEST(Dispatcher, CrowdedHostsTakeTheMailboxFurtherAndBroadcastByTree) {
  const int n = 4;
  const bool crowded = n > static_cast<int>(std::thread::hardware_concurrency());
  auto comms = Communicator::create_local(n);
  std::vector<std::string> plans(n);
  std::vector<int> wrong(n, 0);
  on_ranks(comms, [&](int rank, Communicator& comm) {
    EXPECT_EQ(comm.crowded_host(), crowded) << "rank " << rank;
    Dispatcher d(comm);
    const int64_t count = (1 << 20) / 4;  // 1 MiB
    std::vector<float> buf(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) buf[static_cast<size_t>(i)] = rank == 2 ? static_cast<float>(i % 1000) : -1.f;
    CollectiveCall call;
    call.collective = Collective::kBroadcast;
    call.input = call.output = buf.data();
    call.count = count;
    call.root = 2;
    d.run(call);
    plans[rank] = d.last_plan();
    for (int64_t i = 0; i < count; ++i) wrong[rank] += buf[static_cast<size_t>(i)] != static_cast<float>(i % 1000);
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(wrong[r], 0) << "rank " << r;
    EXPECT_NE(plans[r].find(crowded ? "tree_broadcast" : "chain_broadcast"), std::string::npos) << plans[r];
  }
  EXPECT_EQ(algorithms::default_algorithm(Collective::kBroadcast, 1 << 20, n, true), "tree_broadcast");
  EXPECT_EQ(algorithms::default_algorithm(Collective::kBroadcast, 1 << 20, n, false), "chain_broadcast");
  EXPECT_EQ(algorithms::default_algorithm(Collective::kBroadcast, 4 << 10, n, false), "tree_broadcast");
  // Small enough for the mailbox: one shot up to kCrowdedOneshotThreshold on a crowded host.
  std::vector<std::string> mid(n);
  on_ranks(comms, [&](int rank, Communicator& comm) {
    Dispatcher d(comm);
    mid[rank] = allreduce(d, (32 << 10) / 4);
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(mid[r] == tuning::kOneShot, crowded) << "rank " << r << ": " << mid[r];
}

// tutti-tune --compare runs every configuration on one set of resources: a plan that two of them
// choose is compiled once and runs on the same executor memory.
TEST(Tuner, DispatchersOfOneCommunicatorShareResources) {
  auto comms = Communicator::create_local(2);
  auto other = Communicator::create_local(1);
  std::vector<size_t> compiled(2);
  std::vector<std::vector<float>> results(2);
  on_ranks(comms, [&](int rank, Communicator& comm) {
    DispatcherOptions ring;
    ring.algo = "ring";
    DispatcherOptions windows;  // chooses the ring too for 2 ranks at 256 KiB
    Dispatcher first(comm, ring);
    Dispatcher second(comm, windows, first.resources());
    const int64_t count = 64 << 10;
    std::vector<float> in(static_cast<size_t>(count), static_cast<float>(rank + 1)), out(static_cast<size_t>(count));
    CollectiveCall call;
    call.input = in.data();
    call.output = out.data();
    call.count = count;
    for (Dispatcher* d : {&first, &second, &first}) {
      std::fill(out.begin(), out.end(), -1.f);
      d->run(call);
      results[rank].push_back(out.front());
      results[rank].push_back(out.back());
    }
    EXPECT_EQ(first.last_plan(), second.last_plan());
    compiled[rank] = first.resources()->plans.size();
    EXPECT_EQ(first.resources(), second.resources());
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(compiled[r], 1u) << "rank " << r;
    for (float v : results[r]) EXPECT_EQ(v, 3.f) << "rank " << r;
  }
  // Resources belong to one communicator.
  auto mine = std::make_shared<DispatchResources>(*other[0], CpuExecutorOptions::from_env());
  try {
    Dispatcher d(*comms[0], DispatcherOptions{}, mine);
    ADD_FAILURE() << "a dispatcher accepted another communicator's resources";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("own communicator"), std::string::npos) << e.what();
  }
}

TEST(Tuner, TuneMeasuresOnFirstUseAgreesOnEveryRankAndSavesTheTable) {
  const std::string path = testing::TempDir() + "tutti_tuned_" + std::to_string(getpid()) + ".json";
  std::remove(path.c_str());
  test_support::ScopedEnv env({{"TUTTI_TUNING_FILE", path.c_str()}, {"TUTTI_TUNE", "1"}});
  auto comms = Communicator::create_local(3);
  std::vector<std::vector<std::string>> plans(3);
  on_ranks(comms, [&](int rank, Communicator& comm) {
    Dispatcher d(comm);
    for (int64_t count : {2, 3000, 100000, 3000}) plans[rank].push_back(allreduce(d, count));
    EXPECT_NE(d.table().find(Collective::kAllReduce, 3, 12000), nullptr);
  });
  EXPECT_EQ(plans[0], plans[1]);
  EXPECT_EQ(plans[0], plans[2]);
  EXPECT_EQ(plans[0][1], plans[0][3]);  // measured once, then reused
  Table saved = Table::load(path);
  std::remove(path.c_str());
  EXPECT_EQ(saved.source, "measured");
  for (uint64_t bytes : {8u, 12000u, 400000u}) {
    const Entry* e = saved.find(Collective::kAllReduce, 3, bytes);
    ASSERT_NE(e, nullptr) << bytes;
    EXPECT_GT(e->time_us, 0);
  }
}

TEST(Tuner, InterleavedSweepTimesEveryWayOfEverySizeInEveryRound) {
  auto comms = Communicator::create_local(2);
  std::vector<std::vector<std::vector<double>>> times(2);
  std::vector<std::vector<int>> calls(2, std::vector<int>(5, 0));
  on_ranks(comms, [&](int rank, Communicator& comm) {
    std::vector<std::function<void()>> fs;
    for (int j = 0; j < 5; ++j) fs.push_back([&calls, rank, j] { ++calls[rank][j]; });
    // Three ways at the first size, two at the second.
    std::vector<std::vector<FunctionRef<void()>>> ways{{fs[0], fs[1], fs[2]}, {fs[3], fs[4]}};
    times[rank] = tuning::interleaved_sweep(comm, ways, 4, {3, 1});
    EXPECT_THROW(tuning::interleaved_sweep(comm, ways, 4, {3}), InvalidArgument);
  });
  for (int r = 0; r < 2; ++r) {
    // Each round: one untimed call and the timed ones.
    EXPECT_EQ(calls[r], (std::vector<int>{16, 16, 16, 8, 8})) << "rank " << r;
    ASSERT_EQ(times[r].size(), 2u);
    EXPECT_EQ(times[r][0].size(), 3u);
    EXPECT_EQ(times[r][1].size(), 2u);
  }
  EXPECT_EQ(times[0], times[1]);  // the slowest rank's time, the same everywhere
}

TEST(Tuner, PairedMediansCancelTheMachinesPhase) {
  // Three ways, seven rounds; rounds 1, 3 and 4 ran in a phase 3x slower. Way 0 is always 10 %
  // faster than way 1 and way 2 is 2x slower: the ratios come out exact, whatever the phases.
  std::vector<double> phase{1, 3, 1, 3, 3, 1, 1};
  std::vector<std::vector<double>> t(3);
  for (size_t r = 0; r < phase.size(); ++r) {
    t[0].push_back(0.9 * phase[r]);
    t[1].push_back(1.0 * phase[r]);
    t[2].push_back(2.0 * phase[r]);
  }
  auto m = tuning::paired_medians(t);
  ASSERT_EQ(m.size(), 3u);
  EXPECT_DOUBLE_EQ(m[0] / m[1], 0.9);
  EXPECT_DOUBLE_EQ(m[2] / m[1], 2.0);
  EXPECT_DOUBLE_EQ(m[1], 1.0);  // the reference's median round
  t[2].pop_back();
  EXPECT_THROW(tuning::paired_medians(t), InvalidArgument);
}

TEST(Tuner, MeasuredSweepRanksEveryCandidateAtEverySizeAlikeOnEveryRank) {
  auto comms = Communicator::create_local(2);
  std::vector<std::vector<std::vector<tuning::Ranked>>> ranked(2);
  const std::vector<uint64_t> sizes{4096, 1 << 20};
  const std::vector<Candidate> cands{{"ring_allreduce", {}}, {"rhd_allreduce", {}}, {"allpairs_allreduce", {}}};
  on_ranks(comms, [&](int rank, Communicator& comm) {
    ranked[rank] = tuning::measure_sweep(comm, Collective::kAllReduce, sizes, {cands, cands}, {5, 2}, 1, 3);
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(ranked[r].size(), sizes.size());
    for (auto& at : ranked[r]) {
      ASSERT_EQ(at.size(), cands.size());
      for (size_t k = 0; k < at.size(); ++k) {
        EXPECT_GT(at[k].time_us, 0);
        EXPECT_LT(at[k].time_us, 1e299) << at[k].candidate.describe();
        if (k > 0) {
          EXPECT_LE(at[k - 1].time_us, at[k].time_us);  // fastest first
        }
      }
    }
  }
  for (size_t i = 0; i < sizes.size(); ++i)
    for (size_t k = 0; k < cands.size(); ++k) {
      EXPECT_EQ(ranked[0][i][k].candidate, ranked[1][i][k].candidate);
      EXPECT_EQ(ranked[0][i][k].time_us, ranked[1][i][k].time_us);
    }
}

TEST(Tuner, SmoothedChoiceIgnoresOneNoisyMeasurement) {
  auto at = [](double ring, double rhd) {
    return std::vector<tuning::Ranked>{{{"ring_allreduce", {}}, ring}, {{"rhd_allreduce", {}}, rhd}};
  };
  auto sorted = [](std::vector<tuning::Ranked> v) {
    std::sort(v.begin(), v.end(), [](auto& a, auto& b) { return a.time_us < b.time_us; });
    return v;
  };
  // rhd looks 3.5 % faster at the middle size only (within the 5 % tolerance); ring is 30 % faster
  // on both sides.
  std::vector<std::vector<tuning::Ranked>> m = {sorted(at(10, 13)), sorted(at(20, 19.3)), sorted(at(40, 52))};
  auto best = tuning::choose_smoothed(m);
  for (auto& b : best) EXPECT_EQ(b.candidate.algorithm, "ring_allreduce");
  // A real change of regime (rhd faster on two sizes in a row) is kept.
  m = {sorted(at(10, 16)), sorted(at(20, 15)), sorted(at(40, 30))};
  best = tuning::choose_smoothed(m);
  EXPECT_EQ(best[0].candidate.algorithm, "ring_allreduce");
  EXPECT_EQ(best[2].candidate.algorithm, "rhd_allreduce");
  // A crossover: rhd wins well on the left, ring from the middle on. The neighbours' votes for rhd
  // must not pick it where it is 50 % slower.
  m = {sorted(at(14.3, 10)), sorted(at(10, 15)), sorted(at(20, 20.6))};
  best = tuning::choose_smoothed(m);
  EXPECT_EQ(best[0].candidate.algorithm, "rhd_allreduce");
  EXPECT_EQ(best[1].candidate.algorithm, "ring_allreduce");
}

TEST(Calibration, FitRecoversAlphaAndBetaAndNamesBadInput) {
  std::vector<std::pair<uint64_t, double>> pts;
  for (uint64_t s = 8; s <= (4u << 20); s *= 8) pts.emplace_back(s, 0.7 + static_cast<double>(s) / (12.5 * 1e3));
  auto [alpha, beta] = tuning::fit_alpha_beta(pts);
  EXPECT_NEAR(alpha, 0.7, 1e-9);
  EXPECT_NEAR(beta, 12.5, 1e-9);
  try {
    tuning::fit_alpha_beta({{64, 1.0}, {64, 1.1}});
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("1 distinct message sizes"), std::string::npos) << e.what();
  }
}

TEST(Calibration, IsStoredReusedAndAppliedToTheModel) {
  const std::string path = testing::TempDir() + "tutti_cal_" + std::to_string(getpid()) + "/calibration.json";
  tuning::Calibration a;
  a.transport = "shm";
  a.nranks = 2;
  a.alpha_us = 1.0;
  a.beta_gbps = 4.0;
  a.memory_gbps = 8.0;
  a.instruction_us = 0.5;
  a.pingpong = {{8, 1.0}, {4096, 2.0}};
  a.memory_curve = {{1 << 20, 30.0}, {64 << 20, 5.0}};
  a.reduce_curve = {{1 << 20, 20.0}};
  a.curve = {{4096, 2.0}, {1 << 20, 300.0}};
  a.reduce_exchange = {{4096, 3.0}, {1 << 20, 400.0}};
  tuning::save_calibration(path, a);
  tuning::Calibration b = a;
  b.transport = "tcp";
  b.alpha_us = 9;
  tuning::save_calibration(path, b);
  a.alpha_us = 2.0;  // replaces the shm entry
  tuning::save_calibration(path, a);
  auto all = tuning::load_calibrations(path);
  ASSERT_EQ(all.size(), 2u);
  auto shm = tuning::find_calibration(path, "shm", 2);
  ASSERT_TRUE(shm.has_value());
  EXPECT_EQ(shm->alpha_us, 2.0);
  EXPECT_EQ(shm->pingpong.size(), 2u);
  EXPECT_EQ(shm->memory_curve, a.memory_curve);
  EXPECT_EQ(shm->reduce_curve, a.reduce_curve);
  EXPECT_EQ(shm->reduce_exchange, a.reduce_exchange);
  EXPECT_FALSE(tuning::find_calibration(path, "shm", 4).has_value());
  // Applied: a 2-rank ring all-reduce costs 2 (alpha + S/2 / beta + instruction) plus the local
  // reduction, and the calibrated numbers move it.
  topo::Topology t = tuning::host_topology(2);
  plan::CostModel m;
  tuning::apply(*shm, t, m);
  EXPECT_EQ(m.memory_gbps, 8.0);
  EXPECT_EQ(m.memory_rate_gbps(1 << 20), 30.0);
  EXPECT_EQ(m.reduce_rate_gbps(1 << 20), 20.0);
  EXPECT_EQ(t.devices[t.rank_device[0]].attrs.at("shm_reduce_curve"), "4096:3,1048576:400");
  EXPECT_EQ(t.path(0, 1).latency_us, 2.0);
  plan::Plan ring = plan::compile(algorithms::build("ring_allreduce", 2, {{"inplace", 0}})).plan;
  double slow = plan::simulate(ring, t, 1 << 20, m).time_us;
  for (auto& p : shm->curve) p.second /= 2;  // a transport twice as fast
  tuning::apply(*shm, t, m);
  EXPECT_LT(plan::simulate(ring, t, 1 << 20, m).time_us, slow);
  // Without measured curves, the fitted alpha-beta: a faster beta moves it too.
  shm->curve.clear();
  tuning::apply(*shm, t = tuning::host_topology(2), m);
  slow = plan::simulate(ring, t, 1 << 20, m).time_us;
  shm->beta_gbps *= 2;
  tuning::apply(*shm, t = tuning::host_topology(2), m);
  EXPECT_LT(plan::simulate(ring, t, 1 << 20, m).time_us, slow);
  // A damaged file is an error that names it and the entry.
  {
    std::ofstream(path) << R"({"version": 1, "entries": [{"transport": "shm", "nranks": 2, "alpha_us": 1, "beta_gbps": -3,
                            "memory_gbps": 1, "instruction_us": 0}]})";
  }
  try {
    tuning::load_calibrations(path);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("entry 0"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST(Calibration, MeasuresTheLiveCommunicator) {
  auto comms = Communicator::create_local(2);
  std::vector<tuning::Calibration> got(2);
  on_ranks(comms, [&](int rank, Communicator& comm) { got[rank] = tuning::calibrate(comm); });
  for (auto& c : got) {
    EXPECT_EQ(c.transport, "shm");
    EXPECT_EQ(c.nranks, 2);
    EXPECT_GT(c.beta_gbps, 0);
    EXPECT_GT(c.memory_gbps, 0);
    EXPECT_GE(c.alpha_us, 0);
    EXPECT_EQ(c.pingpong.size(), 8u);
    EXPECT_EQ(c.memory_curve.size(), 6u);
    EXPECT_EQ(c.reduce_curve.size(), 6u);
    EXPECT_EQ(c.reduce_exchange.size(), c.curve.size());
    for (auto& [bytes, gbps] : c.memory_curve) EXPECT_GT(gbps, 0) << bytes;
  }
  EXPECT_EQ(got[0].memory_curve, got[1].memory_curve);  // one measurement of all ranks at once
  EXPECT_EQ(got[0].alpha_us, got[1].alpha_us);  // every rank reaches the same model
  EXPECT_EQ(got[0].beta_gbps, got[1].beta_gbps);
  // The polling window and the one-shot thresholds: one choice on every rank, from every window
  // and every collective, and consistent with the measurements stored beside them.
  EXPECT_EQ(got[0].spin_us, got[1].spin_us);
  EXPECT_EQ(got[0].spin_points.size(), 7u);
  EXPECT_EQ(got[0].spin_us, tuning::choose_spin(got[0].spin_points, got[0].wake_us));
  ASSERT_EQ(got[0].oneshot.size(), 6u);
  ASSERT_EQ(got[1].oneshot.size(), 6u);
  for (size_t k = 0; k < 6; ++k) {
    const auto& cut = got[0].oneshot[k];
    EXPECT_EQ(cut.threshold, got[1].oneshot[k].threshold) << to_string(cut.collective);
    EXPECT_GE(cut.points.size(), 7u) << to_string(cut.collective);  // 64 B .. 64 KiB fit a 256 KiB mailbox
    EXPECT_EQ(cut.threshold, tuning::choose_oneshot_threshold(cut.points)) << to_string(cut.collective);
  }
  // Threads of one process keep the default FIFO layout (tests/CMakeLists.txt's calibrate_2_processes
  // covers process ranks); tiles are chosen alike on every rank.
  EXPECT_TRUE(got[0].fifo_points.empty());
  EXPECT_EQ(got[0].fifo_slots, 0u);
  std::vector<double> rel;
  ASSERT_EQ(got[0].tile_points.size(), 5u);
  EXPECT_EQ(got[0].tile_bytes, got[1].tile_bytes);
  rel.clear();
  for (auto& [t, r] : got[0].tile_points) rel.push_back(r);
  EXPECT_EQ(got[0].tile_bytes, got[0].tile_points[tuning::choose_setting(rel, 0)].first);
}

TEST(Tuner, LiveTopologyPutsRanksOfOneHostOnIt) {
  auto comms = Communicator::create_local(3);
  std::vector<topo::Topology> views(3);
  on_ranks(comms, [&](int rank, Communicator& comm) { views[rank] = tuning::live_topology(comm); });
  for (auto& v : views) {
    EXPECT_EQ(v, views[0]);  // every rank builds the same world
    EXPECT_EQ(v.count(topo::DeviceType::kHost), 1);
    EXPECT_EQ(v.nranks(), 3);
  }
}

TEST(Calibration, AMeasuredCurveSetsSharedMemoryTransferTimes) {
  // With a curve, a 2-rank ring's two 512 KiB messages each take the curve's time at 512 KiB (both
  // directions at once, as measured), on top of the executor's local work.
  tuning::Calibration c;
  c.transport = "shm";
  c.nranks = 2;
  c.alpha_us = 0.5;
  c.beta_gbps = 10;
  c.memory_gbps = 1e6;  // local work free, so the transfers are the time
  c.instruction_us = 0;
  c.curve = {{1024, 1.0}, {1 << 20, 101.0}};
  topo::Topology t = tuning::host_topology(2);
  plan::CostModel m;
  tuning::apply(c, t, m);
  plan::Plan ring = plan::compile(algorithms::build("ring_allreduce", 2, {{"inplace", 0}})).plan;
  const double per_message = 1.0 + (512.0 * 1024 - 1024) * 100.0 / ((1 << 20) - 1024);
  EXPECT_NEAR(plan::simulate(ring, t, 1 << 20, m).time_us, 2 * per_message, 0.05 * per_message);
  // A slower measurement predicts a slower collective.
  for (auto& p : c.curve) p.second *= 2;
  tuning::apply(c, t, m);
  EXPECT_NEAR(plan::simulate(ring, t, 1 << 20, m).time_us, 4 * per_message, 0.1 * per_message);
}

namespace tutti::tuning {
namespace {

// The smallest valid entry for 2 ranks over shared memory; tests add the settings they check.
Calibration shm_pair() {
  Calibration c;
  c.transport = "shm";
  c.nranks = 2;
  c.alpha_us = 1;
  c.beta_gbps = 1;
  c.memory_gbps = 1;
  return c;
}

// The single-copy threshold a calibration stores: the smallest size from which single copy keeps
// up with the FIFO at that size and every larger one.
TEST(SingleCopyThreshold, IsWhereSingleCopyStartsToWinForGood) {
  using P = std::vector<std::pair<uint64_t, std::pair<double, double>>>;
  EXPECT_EQ(choose_single_copy_threshold(P{{1 << 16, {2, 1}}, {1 << 20, {4, 5}}, {1 << 24, {4, 8}}}), 1u << 20);
  // A win at a small size that is lost again at a larger one does not count.
  EXPECT_EQ(choose_single_copy_threshold(P{{1 << 16, {2, 3}}, {1 << 20, {5, 4}}, {1 << 24, {4, 8}}}), 1u << 24);
  EXPECT_EQ(choose_single_copy_threshold(P{{1 << 16, {2, 1}}, {1 << 24, {5, 4}}}), UINT64_MAX);
  EXPECT_EQ(choose_single_copy_threshold(P{{1 << 24, {1, 2}}, {1 << 16, {1, 2}}}), 1u << 16);  // any order
  EXPECT_EQ(choose_single_copy_threshold(P{}), UINT64_MAX);
}

// A calibration's threshold reaches the communicators of that many ranks over shared memory, unless
// TUTTI_SHM_CMA_THRESHOLD says otherwise; it survives the file's round trip.
TEST(SingleCopyThreshold, CalibratedValueIsAppliedUnlessTheUserSetOne) {
  const std::string path = ::testing::TempDir() + "single_copy_calibration.json";
  std::remove(path.c_str());
  Calibration c = shm_pair();
  c.single_copy_threshold = 3 << 20;
  c.single_copy = {{1 << 20, {2.0, 1.0}}, {4 << 20, {2.0, 3.0}}};
  save_calibration(path, c);
  auto back = find_calibration(path, "shm", 2);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->single_copy_threshold, 3u << 20);
  EXPECT_EQ(back->single_copy, c.single_copy);
  for (bool user_set : {false, true}) {
    test_support::ScopedEnv env({{"TUTTI_CALIBRATION_FILE", path.c_str()},
                                 {"TUTTI_SHM_CMA_THRESHOLD", user_set ? "8M" : nullptr},
                                 {"TUTTI_TRANSPORT", "shm"}});
    auto comms = Communicator::create_local(2);
    test_support::on_ranks(comms, [&](int, Communicator& comm) {
      Dispatcher d(comm);
      EXPECT_EQ(comm.options().shm_single_copy_threshold, user_set ? (8u << 20) : (3u << 20));
    });
  }
  std::remove(path.c_str());
}

// The one-shot threshold: the largest size up to which the mailbox is at least as fast (a tie
// within 3 % keeps it) at every measured size.
TEST(OneShotThreshold, IsTheLargestSizeUpToWhichTheMailboxKeepsWinning) {
  using P = std::vector<std::pair<uint64_t, std::pair<double, double>>>;
  EXPECT_EQ(choose_oneshot_threshold(P{{64, {1, 2}}, {1024, {1, 2}}, {16384, {3, 2}}}), 1024u);
  // A loss at a small size ends it, even if the mailbox wins again above.
  EXPECT_EQ(choose_oneshot_threshold(P{{64, {1, 2}}, {1024, {3, 2}}, {16384, {1, 2}}}), 64u);
  // Any order; winning everywhere stops at the largest size measured.
  EXPECT_EQ(choose_oneshot_threshold(P{{1024, {1, 2}}, {64, {1, 2}}}), 1024u);
  EXPECT_EQ(choose_oneshot_threshold(P{{64, {2.05, 2}}, {1024, {3, 2}}}), 64u);      // 2.5 % slower is a tie
  EXPECT_EQ(choose_oneshot_threshold(P{{64, {2.2, 2}}}), 0u);                       // never
  EXPECT_EQ(choose_oneshot_threshold(P{}), 0u);
}

// The polling window: the shortest one within 5 % of the best that lasts at least a wake-up.
TEST(SpinWindow, IsTheShortestCompetitiveWindowThatOutlastsAWakeUp) {
  using P = std::vector<std::pair<int, double>>;
  const P points{{0, 5.0}, {20, 1.04}, {50, 1.0}, {200, 1.01}, {1000, 1.3}};
  EXPECT_EQ(choose_spin(points, 10), 20);
  EXPECT_EQ(choose_spin(points, 30), 50);   // 20 us would sleep before a wake-up's worth of polling
  EXPECT_EQ(choose_spin(points, 100), 200);
  EXPECT_EQ(choose_spin(points, 5000), 1000);  // none lasts that long: the longest
  EXPECT_EQ(choose_spin(P{{1000, 1.0}, {20, 1.2}}, 0), 1000);  // any order
  EXPECT_EQ(choose_spin(P{}, 10), 0);
}

TEST(CalibratedSetting, IsTheDefaultUnlessAnotherWinsByMoreThanFivePercent) {
  EXPECT_EQ(choose_setting({1.04, 1.0, 1.2}, 0), 0u);
  EXPECT_EQ(choose_setting({1.06, 1.0, 1.2}, 0), 1u);
  EXPECT_EQ(choose_setting({1.3, 1.1, 1.0}, 1), 2u);
  EXPECT_EQ(choose_setting({1.0}, 0), 0u);
  EXPECT_THROW(choose_setting({1.0}, 1), InvalidArgument);
}

// A calibration's polling window, one-shot thresholds, FIFO layout and tile size reach the
// communicators and dispatchers of that many ranks over shared memory, unless TUTTI_SPIN,
// TUTTI_ONESHOT_THRESHOLD, TUTTI_SHM_SLOTS / TUTTI_SHM_SLOT_SIZE and TUTTI_TILE_SIZE say otherwise;
// they survive the file's round trip, and plans run correctly on channels of the calibrated layout.
TEST(CalibratedSetting, AreAppliedUnlessTheUserSetThem) {
  const std::string path = ::testing::TempDir() + "settings_calibration.json";
  std::remove(path.c_str());
  Calibration c = shm_pair();
  c.spin_us = 37;
  c.wake_us = 9.5;
  c.spin_points = {{0, 4.0}, {37, 1.0}};
  c.oneshot = {{Collective::kAllReduce, 0, {{64, {2.0, 1.0}}}}, {Collective::kBroadcast, UINT64_MAX, {{64, {1.0, 2.0}}}}};
  c.fifo_slots = 3;
  c.fifo_slot_bytes = 8 << 10;
  c.fifo_points = {{16, 128 << 10, 1.2}, {3, 8 << 10, 1.0}};
  c.tile_bytes = 64 << 10;
  c.tile_points = {{1 << 20, 1.1}, {64 << 10, 1.0}};
  save_calibration(path, c);
  auto back = find_calibration(path, "shm", 2);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->spin_us, 37);
  EXPECT_EQ(back->wake_us, 9.5);
  EXPECT_EQ(back->spin_points, c.spin_points);
  EXPECT_EQ(back->fifo_slots, 3u);
  EXPECT_EQ(back->fifo_slot_bytes, 8u << 10);
  EXPECT_EQ(back->fifo_points, c.fifo_points);
  EXPECT_EQ(back->tile_bytes, 64 << 10);
  EXPECT_EQ(back->tile_points, c.tile_points);
  ASSERT_EQ(back->oneshot.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(back->oneshot[i].collective, c.oneshot[i].collective);
    EXPECT_EQ(back->oneshot[i].threshold, c.oneshot[i].threshold);
    EXPECT_EQ(back->oneshot[i].points, c.oneshot[i].points);
  }
  for (bool user_set : {false, true}) {
    test_support::ScopedEnv env({{"TUTTI_CALIBRATION_FILE", path.c_str()},
                                 {"TUTTI_SPIN", user_set ? "300" : nullptr},
                                 {"TUTTI_ONESHOT_THRESHOLD", user_set ? "8K" : nullptr},
                                 {"TUTTI_SHM_SLOTS", user_set ? "5" : nullptr},
                                 {"TUTTI_TILE_SIZE", user_set ? "256K" : nullptr},
                                 {"TUTTI_TRANSPORT", "shm"}});
    auto comms = Communicator::create_local(2);
    test_support::on_ranks(comms, [&](int rank, Communicator& comm) {
      Dispatcher d(comm);
      EXPECT_EQ(comm.options().spin, user_set ? 300 : 37);
      EXPECT_EQ(comm.options().shm_slots, user_set ? 5u : 3u);
      EXPECT_EQ(comm.options().shm_slot_size, user_set ? (128u << 10) : (8u << 10));
      EXPECT_EQ(d.resources()->executor.tile_bytes(), user_set ? (256 << 10) : (64 << 10));
      // 64 B: the calibration sends all-reduce to a plan and keeps broadcast on the mailbox. 1 MiB:
      // a plan, through FIFOs of the calibrated layout, tile by tile.
      for (int64_t count : {int64_t{16}, int64_t{1} << 18}) {
        std::vector<float> in(static_cast<size_t>(count)), out(static_cast<size_t>(count));
        for (int64_t i = 0; i < count; ++i) in[static_cast<size_t>(i)] = static_cast<float>((rank + 1) * (i % 7));
        for (Collective coll : {Collective::kAllReduce, Collective::kBroadcast}) {
          CollectiveCall call;
          call.collective = coll;
          call.input = in.data();
          call.output = out.data();
          call.count = count;
          call.reduction.type = DataType::kFloat32;
          d.run(call);
          if (count == 16) {
            const bool oneshot = user_set || coll == Collective::kBroadcast;
            EXPECT_EQ(d.last_plan() == "oneshot", oneshot) << to_string(coll) << ": " << d.last_plan();
          }
          int wrong = 0;
          for (int64_t i = 0; i < count; ++i)
            wrong += out[static_cast<size_t>(i)] != static_cast<float>((coll == Collective::kAllReduce ? 3 : 1) * (i % 7));
          EXPECT_EQ(wrong, 0) << to_string(coll) << " of " << count;
        }
      }
    });
  }
  // Options given in code count as chosen too.
  {
    test_support::ScopedEnv env({{"TUTTI_CALIBRATION_FILE", path.c_str()}, {"TUTTI_TRANSPORT", "shm"}});
    CommOptions o = CommOptions::from_env();
    o.spin = 99;
    o.shm_slots = 7;
    auto comms = Communicator::create_local(2, o);
    test_support::on_ranks(comms, [&](int, Communicator& comm) {
      Dispatcher d(comm);
      EXPECT_EQ(comm.options().spin, 99);
      EXPECT_EQ(comm.options().shm_slots, 7u);
      EXPECT_EQ(d.resources()->executor.tile_bytes(), 64 << 10);  // not given: calibrated
    });
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace tutti::tuning
