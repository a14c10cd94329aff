// tuttiRunPlan (collectives/include/tutti_nccl.h): verified plans run through the NCCL API on a
// communicator's buffers. The fused ZeRO step's plan, with its state buffers and per-call scalars,
// gives the same floats on device buffers (the emulated device, which runs the CUDA interpreter's
// code on CPU threads) as on host buffers (the CPU executor), bit for bit, and the norm it reports
// is the one computed here from the inputs; an MSCCL algorithm file runs as mscclRunAlgo would run
// it; calls sit in groups beside NCCL's collectives; ranks run as threads and as processes under
// tutti-run; bad calls are refused with the plan's name and what is wrong.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "collectives/include/nccl.h"
#include "collectives/include/tutti_nccl.h"
#include "support/env.hpp"
#include "support/nccl_ranks.hpp"
#include "support/zero_data.hpp"
#include "tutti/fused.hpp"
#include "tutti/plan.hpp"

namespace {

using tutti::test_support::ZeroBuffers;

using tutti::test_support::on_nccl_ranks;

// The ZeRO step's plan for n ranks as the NCCL API takes it: compiled, verified, its JSON text
// parsed (and verified) again.
tuttiPlan_t zero_plan(int n, int pieces) {
  tutti::fused::register_kernels();
  const tutti::CompiledPlan compiled = tutti::compile_plan(tutti::fused::zero_step_program(n, pieces));
  tuttiPlan_t plan = nullptr;
  EXPECT_EQ(tuttiPlanParse(compiled.json().c_str(), &plan), ncclSuccess) << ncclGetLastError(nullptr);
  return plan;
}

ncclResult_t run_zero(tuttiPlan_t plan, ZeroBuffers& x, int64_t shard, const std::vector<double>& scalars,
                      ncclComm_t comm) {
  void* states[] = {x.params.data(), x.m.data(), x.v.data(), x.stats.data()};
  return tuttiRunPlan(plan, x.grads.data(), nullptr, static_cast<size_t>(shard), ncclFloat32, ncclSum, states, 4,
                      scalars.data(), static_cast<int>(scalars.size()), comm, nullptr);
}

// Every rank's buffers after one step through tuttiRunPlan, on device buffers (emulated) or host.
std::vector<ZeroBuffers> zero_step(int n, int pieces, int64_t shard, bool device) {
  tutti::test_support::ScopedEnv env({{"TUTTI_DEVICE", device ? "emulated" : "auto"}});
  tuttiPlan_t plan = zero_plan(n, pieces);
  auto buffers = tutti::test_support::zero_inputs(n, shard, false);
  const std::vector<double> scalars = tutti::fused::zero_step_scalars(tutti::test_support::zero_step_options());
  on_nccl_ranks(n, [&](int r, ncclComm_t comm) {
    ASSERT_EQ(run_zero(plan, buffers[static_cast<size_t>(r)], shard, scalars, comm), ncclSuccess)
        << ncclGetLastError(comm);
  });
  EXPECT_EQ(tuttiPlanFree(plan), ncclSuccess);
  return buffers;
}

void expect_same(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(float)), 0)
        << what << " element " << i << ": " << got[i] << " vs " << want[i];
}

// The global sum of squares of the unscaled summed gradients, from the inputs (exact: small integers
// times 0.5).
double expected_sum_squares(int n, int64_t shard) {
  const auto in = tutti::test_support::zero_inputs(n, shard, false);
  const double scale = tutti::test_support::zero_step_options().grad_scale;
  double sum = 0;
  for (size_t i = 0; i < in[0].grads.size(); ++i) {
    double g = 0;
    for (const ZeroBuffers& x : in) g += x.grads[i];
    sum += (g * scale) * (g * scale);
  }
  return sum;
}

class ZeroStepThroughTheNcclApi : public testing::TestWithParam<int> {};

TEST_P(ZeroStepThroughTheNcclApi, DeviceBuffersGiveTheHostFloats) {
  const int n = GetParam();
  const int pieces = 4;
  const int64_t shard = pieces * 96;
  const auto dev = zero_step(n, pieces, shard, true);
  const auto host = zero_step(n, pieces, shard, false);
  const auto before = tutti::test_support::zero_inputs(n, shard, false);
  for (int r = 0; r < n; ++r) {
    SCOPED_TRACE(fmt::format("rank {} of {}", r, n));
    const ZeroBuffers &d = dev[static_cast<size_t>(r)], &h = host[static_cast<size_t>(r)];
    expect_same(d.params, h.params, "params");
    expect_same(d.m, h.m, "m");
    expect_same(d.v, h.v, "v");
    expect_same(d.stats, h.stats, "stats");
    expect_same(d.params, dev[0].params, "params against rank 0's");
    EXPECT_NE(std::memcmp(d.params.data(), before[0].params.data(), d.params.size() * sizeof(float)), 0)
        << "the step left the parameters as they were";
    EXPECT_EQ(static_cast<double>(d.stats[0]), static_cast<double>(static_cast<float>(expected_sum_squares(n, shard))));
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ZeroStepThroughTheNcclApi, testing::Values(2, 3),
                         [](const auto& info) { return fmt::format("{}ranks", info.param); });

// An MSCCL algorithm file (public, nobody here wrote it) loaded and run as mscclLoadAlgo and
// mscclRunAlgo would: 4 ranks, host buffers and then device buffers.
TEST(TuttiRunPlan, RunsAnMscclAlgorithmFileOnHostAndDeviceBuffers) {
  tuttiPlan_t plan = nullptr;
  ASSERT_EQ(tuttiPlanLoad(TUTTI_TESTDATA "/msccl/ncv4-ag_hier_4_LL.xml", &plan), ncclSuccess) << ncclGetLastError(nullptr);
  const char* name = nullptr;
  ASSERT_EQ(tuttiPlanName(plan, &name), ncclSuccess);
  EXPECT_STREQ(name, "allgather_hierarchical");
  for (const char* device : {"auto", "emulated"}) {
    SCOPED_TRACE(device);
    tutti::test_support::ScopedEnv env({{"TUTTI_DEVICE", device}});
    const int n = 4;
    const size_t count = 64;
    on_nccl_ranks(n, [&](int r, ncclComm_t comm) {
      std::vector<float> in(count), out(count * n, -1.0f);
      for (size_t i = 0; i < count; ++i) in[i] = static_cast<float>(r * 1000 + static_cast<int>(i));
      ASSERT_EQ(tuttiRunPlan(plan, in.data(), out.data(), count, ncclFloat32, ncclSum, nullptr, 0, nullptr, 0, comm,
                             nullptr),
                ncclSuccess)
          << ncclGetLastError(comm);
      for (int q = 0; q < n; ++q)
        for (size_t i = 0; i < count; ++i)
          ASSERT_EQ(out[static_cast<size_t>(q) * count + i], static_cast<float>(q * 1000 + static_cast<int>(i)))
              << "rank " << r << ", block of rank " << q << ", element " << i;
    });
  }
  EXPECT_EQ(tuttiPlanFree(plan), ncclSuccess);
}

// In a group beside an NCCL collective, and called from one thread for every rank, as NCCL's
// collectives may be.
TEST(TuttiRunPlan, RunsInAGroupBesideACollective) {
  const int n = 2, pieces = 2;
  const int64_t shard = pieces * 64;
  tuttiPlan_t plan = zero_plan(n, pieces);
  std::vector<ncclComm_t> comms(n);
  ASSERT_EQ(ncclCommInitAll(comms.data(), n, nullptr), ncclSuccess) << ncclGetLastError(nullptr);
  auto buffers = tutti::test_support::zero_inputs(n, shard, false);
  const std::vector<double> scalars = tutti::fused::zero_step_scalars(tutti::test_support::zero_step_options());
  std::vector<std::vector<float>> sums(n, std::vector<float>(100));
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < 100; ++i) sums[static_cast<size_t>(r)][i] = static_cast<float>(r + static_cast<int>(i));
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  for (int r = 0; r < n; ++r) {
    std::vector<float>& s = sums[static_cast<size_t>(r)];
    ASSERT_EQ(ncclAllReduce(s.data(), s.data(), s.size(), ncclFloat32, ncclSum, comms[static_cast<size_t>(r)], nullptr),
              ncclSuccess);
    ASSERT_EQ(run_zero(plan, buffers[static_cast<size_t>(r)], shard, scalars, comms[static_cast<size_t>(r)]), ncclSuccess);
  }
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess) << ncclGetLastError(nullptr);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(sums[static_cast<size_t>(r)][7], 2.0f * 7 + 1);
    EXPECT_EQ(static_cast<double>(buffers[static_cast<size_t>(r)].stats[0]),
              static_cast<double>(static_cast<float>(expected_sum_squares(n, shard))));
  }
  expect_same(buffers[1].params, buffers[0].params, "params of rank 1 against rank 0's");
  for (ncclComm_t c : comms) EXPECT_EQ(ncclCommDestroy(c), ncclSuccess);
  EXPECT_EQ(tuttiPlanFree(plan), ncclSuccess);
}

// ncclGroupSimulateEnd predicts a group's plans without running them (the simulator on this host's
// topology): a time above zero, and the buffers untouched.
TEST(TuttiRunPlan, GroupSimulateEndPredictsAPlanWithoutRunningIt) {
  const int n = 2, pieces = 2;
  const int64_t shard = pieces * 64;
  tuttiPlan_t plan = zero_plan(n, pieces);
  const std::vector<double> scalars = tutti::fused::zero_step_scalars(tutti::test_support::zero_step_options());
  on_nccl_ranks(n, [&](int r, ncclComm_t comm) {
    ZeroBuffers x = tutti::test_support::zero_rank_inputs(n, r, shard);
    ncclSimInfo_t sim = NCCL_SIM_INFO_INITIALIZER;
    ASSERT_EQ(ncclGroupStart(), ncclSuccess);
    ASSERT_EQ(run_zero(plan, x, shard, scalars, comm), ncclSuccess);
    ASSERT_EQ(ncclGroupSimulateEnd(&sim), ncclSuccess) << ncclGetLastError(comm);
    EXPECT_GT(sim.estimatedTime, 0.0f);
    EXPECT_EQ(x.stats[0], -1.0f) << "the simulated group ran";
    EXPECT_EQ(x.params, tutti::test_support::zero_rank_inputs(n, r, shard).params);
  });
  EXPECT_EQ(tuttiPlanFree(plan), ncclSuccess);
}

void expect_refused(ncclResult_t rc, ncclComm_t comm, const std::vector<std::string>& words) {
  EXPECT_EQ(rc, ncclInvalidArgument);
  const std::string why = ncclGetLastError(comm);
  for (const std::string& w : words) EXPECT_NE(why.find(w), std::string::npos) << "'" << w << "' not in: " << why;
}

// Refusals that every rank makes alone, before anything collective, so the test needs no peer to
// fail with it: each names the plan (or the file) and what is wrong.
TEST(TuttiRunPlan, RefusesBadCallsNamingWhatIsWrong) {
  tuttiPlan_t plan = nullptr;
  expect_refused(tuttiPlanLoad("/nonexistent/zero.json", &plan), nullptr, {"/nonexistent/zero.json"});
  EXPECT_EQ(plan, nullptr);
  expect_refused(tuttiPlanParse("{\"not\": \"a plan\"}", &plan), nullptr, {"plan text"});
  expect_refused(tuttiPlanLoad(nullptr, &plan), nullptr, {"path is NULL"});
  expect_refused(tuttiPlanParse("{}", nullptr), nullptr, {"plan is NULL"});

  tuttiPlan_t three = zero_plan(3, 2);
  tuttiPlan_t two = zero_plan(2, 2);
  const int64_t shard = 2 * 64;
  const std::vector<double> scalars = tutti::fused::zero_step_scalars(tutti::test_support::zero_step_options());
  on_nccl_ranks(2, [&](int r, ncclComm_t comm) {
    ZeroBuffers x = tutti::test_support::zero_rank_inputs(2, r, shard);
    void* states[] = {x.params.data(), x.m.data(), x.v.data(), x.stats.data()};
    expect_refused(tuttiRunPlan(nullptr, x.grads.data(), nullptr, shard, ncclFloat32, ncclSum, states, 4, scalars.data(),
                                static_cast<int>(scalars.size()), comm, nullptr),
                   comm, {"plan is NULL"});
    expect_refused(run_zero(three, x, shard, scalars, comm), comm, {"zero_step", "3 ranks", "has 2"});
    expect_refused(tuttiRunPlan(two, x.grads.data(), nullptr, shard, ncclFloat32, ncclSum, states, 3, scalars.data(),
                                static_cast<int>(scalars.size()), comm, nullptr),
                   comm, {"zero_step", "4 state buffer(s), the call passes 3"});
    void* with_null[] = {x.params.data(), nullptr, x.v.data(), x.stats.data()};
    expect_refused(tuttiRunPlan(two, x.grads.data(), nullptr, shard, ncclFloat32, ncclSum, with_null, 4, scalars.data(),
                                static_cast<int>(scalars.size()), comm, nullptr),
                   comm, {"zero_step", "state buffer 1", "is null"});
    expect_refused(tuttiRunPlan(two, nullptr, nullptr, shard, ncclFloat32, ncclSum, states, 4, scalars.data(),
                                static_cast<int>(scalars.size()), comm, nullptr),
                   comm, {"zero_step", "sendbuff is NULL"});
    expect_refused(tuttiRunPlan(two, x.grads.data(), nullptr, shard, ncclFloat32, ncclSum, states, -1, scalars.data(),
                                static_cast<int>(scalars.size()), comm, nullptr),
                   comm, {"zero_step", "-1 state buffers"});
    expect_refused(tuttiRunPlan(two, x.grads.data(), nullptr, shard, static_cast<ncclDataType_t>(99), ncclSum, states, 4,
                                scalars.data(), static_cast<int>(scalars.size()), comm, nullptr),
                   comm, {"invalid datatype 99"});
    // Nothing ran: the buffers are as they were, and a good call still works.
    EXPECT_EQ(x.stats[0], -1.0f);
    ASSERT_EQ(run_zero(two, x, shard, scalars, comm), ncclSuccess) << ncclGetLastError(comm);
    EXPECT_EQ(static_cast<double>(x.stats[0]), static_cast<double>(static_cast<float>(expected_sum_squares(2, shard))));
  });
  EXPECT_EQ(tuttiPlanFree(three), ncclSuccess);
  EXPECT_EQ(tuttiPlanFree(two), ncclSuccess);
}

// Device calls refused by the device executor before its collective setup (every rank alone): too
// few per-call scalars, a type the plan's kernels do not take; and state buffers through host
// staging, which carries only a call's input and output.
TEST(TuttiRunPlan, RefusesDeviceCallsTheDeviceCannotRun) {
  tuttiPlan_t plan = zero_plan(2, 2);
  const int64_t shard = 2 * 64;
  const std::vector<double> scalars = tutti::fused::zero_step_scalars(tutti::test_support::zero_step_options());
  {
    tutti::test_support::ScopedEnv env({{"TUTTI_DEVICE", "emulated"}});
    on_nccl_ranks(2, [&](int r, ncclComm_t comm) {
      ZeroBuffers x = tutti::test_support::zero_rank_inputs(2, r, shard);
      const std::vector<double> few(scalars.begin(), scalars.begin() + 2);
      expect_refused(run_zero(plan, x, shard, few, comm), comm, {"zero_step", "scalar"});
      void* states[] = {x.params.data(), x.m.data(), x.v.data(), x.stats.data()};
      expect_refused(tuttiRunPlan(plan, x.grads.data(), nullptr, shard, ncclFloat64, ncclSum, states, 4, scalars.data(),
                                  static_cast<int>(scalars.size()), comm, nullptr),
                     comm, {"zero_step", "float"});
      EXPECT_EQ(x.stats[0], -1.0f);
    });
  }
  {
    tutti::test_support::ScopedEnv env({{"TUTTI_DEVICE", "emulated"}, {"TUTTI_DEVICE_STAGING", "1"}});
    on_nccl_ranks(2, [&](int r, ncclComm_t comm) {
      ZeroBuffers x = tutti::test_support::zero_rank_inputs(2, r, shard);
      expect_refused(run_zero(plan, x, shard, scalars, comm), comm, {"zero_step", "state buffers", "TUTTI_DEVICE_STAGING"});
    });
  }
  EXPECT_EQ(tuttiPlanFree(plan), ncclSuccess);
}

// One rank per process: the test runs itself under tutti-run (host buffers; the emulated device's
// memory is not shared between processes).
TEST(TuttiRunPlan, RanksAsProcessesUnderTuttiRun) {
  const char* rank = std::getenv("TUTTI_RANK");
  if (!rank) {
    const std::string cmd = std::string(TUTTI_RUN_PATH) + " -n 3 " + TUTTI_SELF_PATH +
                            " --gtest_filter=TuttiRunPlan.RanksAsProcessesUnderTuttiRun 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::string output;
    char buf[4096];
    while (size_t got = fread(buf, 1, sizeof buf, p)) output.append(buf, got);
    const int status = pclose(p);
    EXPECT_EQ(status, 0) << output;
    EXPECT_NE(output.find("[  PASSED  ] 1 test"), std::string::npos) << output;
    return;
  }
  const int r = std::atoi(rank), n = std::atoi(std::getenv("TUTTI_SIZE"));
  ASSERT_EQ(n, 3);
  const int pieces = 2;
  const int64_t shard = pieces * 64;
  tuttiPlan_t plan = zero_plan(n, pieces);
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  ncclComm_t comm;
  ASSERT_EQ(ncclCommInitRank(&comm, n, id, r), ncclSuccess) << ncclGetLastError(nullptr);
  ZeroBuffers x = tutti::test_support::zero_rank_inputs(n, r, shard);
  const std::vector<double> scalars = tutti::fused::zero_step_scalars(tutti::test_support::zero_step_options());
  ASSERT_EQ(run_zero(plan, x, shard, scalars, comm), ncclSuccess) << ncclGetLastError(comm);
  EXPECT_EQ(static_cast<double>(x.stats[0]), static_cast<double>(static_cast<float>(expected_sum_squares(n, shard))));
  // Every rank holds the same parameters afterwards: rank 0's, broadcast, compared here.
  std::vector<float> zeros(x.params.size());
  ASSERT_EQ(ncclBroadcast(x.params.data(), zeros.data(), zeros.size(), ncclFloat32, 0, comm, nullptr), ncclSuccess);
  expect_same(x.params, zeros, "params against rank 0's");
  EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
  EXPECT_EQ(tuttiPlanFree(plan), ncclSuccess);
}

}  // namespace
