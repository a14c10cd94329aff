// Fused plans on the device interpreter, on the emulated device (the CUDA kernel's source compiled
// for the host): the ZeRO step's plan, with its state buffers, per-call scalars and kernels, runs in
// one pass and gives the CPU executor's floats bit for bit (the data's sums of squares are exact, so
// both add them to the same double); a non-finite gradient skips the step on every rank; plans the
// device cannot run are refused by name before anything collective happens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "compiler/compile.hpp"
#include "runtime/device/device_executor.hpp"
#include "support/ranks.hpp"
#include "support/zero_data.hpp"
#include "tutti/fused.hpp"

using namespace tutti;
using namespace tutti::device;

namespace {

using Prepared = std::shared_ptr<const PreparedPlan>;

Prepared zero_plan(int n, int pieces) {
  fused::register_kernels();
  return PreparedPlan::make(plan::compile(fused::zero_step_program(n, pieces)).plan);
}

using test_support::ZeroBuffers;
using test_support::zero_inputs;

ExecArgs zero_args(ZeroBuffers& x, int64_t shard, const fused::AdamW& opt) {
  ExecArgs a;
  a.input = x.grads.data();
  a.output = nullptr;
  a.count = shard;
  a.reduction.type = DataType::kFloat32;
  a.scalars = fused::zero_step_scalars(opt);
  a.states = {x.params.data(), x.m.data(), x.v.data(), x.stats.data()};
  return a;
}

DeviceOptions small_slots() {
  DeviceOptions d;
  d.slot_bytes = 4096;
  d.ll_slot_bytes = 2048;
  d.instances = 1;
  d.timeout_s = 120;  // a deadlock fails the test instead of hanging it
  return d;
}

// Runs the plan on both executors from the same inputs; returns (device, cpu) buffers.
std::pair<std::vector<ZeroBuffers>, std::vector<ZeroBuffers>> run_both(int n, int pieces, int64_t piece, bool poison,
                                                                        int32_t protocol) {
  const int64_t shard = pieces * piece;
  Prepared plan = zero_plan(n, pieces);
  auto dev = zero_inputs(n, shard, poison), cpu = dev;
  const fused::AdamW opt = test_support::zero_step_options();
  auto comms = Communicator::create_local(n);
  std::vector<std::unique_ptr<DeviceExecutor>> executors;
  DeviceOptions d = small_slots();
  d.protocol = protocol;
  for (int r = 0; r < n; ++r) executors.push_back(std::make_unique<DeviceExecutor>(*comms[r], make_emulated_backend(), d));
  test_support::on_ranks(comms, [&](int r, Communicator& c) {
    executors[static_cast<size_t>(r)]->run(*plan, zero_args(dev[static_cast<size_t>(r)], shard, opt));
    CpuExecutor cpu_executor(c, CpuExecutorOptions{});
    cpu_executor.run(*plan, zero_args(cpu[static_cast<size_t>(r)], shard, opt));
    executors[static_cast<size_t>(r)]->close();
  });
  return {std::move(dev), std::move(cpu)};
}

void expect_same(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(float)), 0)
        << what << " element " << i << ": device " << got[i] << ", CPU " << want[i];
}

class ZeroStepOnTheDevice : public testing::TestWithParam<std::tuple<int, int32_t>> {};

TEST_P(ZeroStepOnTheDevice, GivesTheCpuExecutorsFloats) {
  const auto [n, protocol] = GetParam();
  auto [dev, cpu] = run_both(n, 4, 96, false, protocol);
  for (int r = 0; r < n; ++r) {
    SCOPED_TRACE(fmt::format("rank {} of {}", r, n));
    const ZeroBuffers &d = dev[static_cast<size_t>(r)], &c = cpu[static_cast<size_t>(r)];
    expect_same(d.params, c.params, "params");
    expect_same(d.m, c.m, "m");
    expect_same(d.v, c.v, "v");
    expect_same(d.stats, c.stats, "stats");
    // The step did something: the parameters moved, the same on every rank.
    EXPECT_NE(std::memcmp(d.params.data(), zero_inputs(n, 4 * 96, false)[0].params.data(), d.params.size() * 4), 0);
    expect_same(d.params, dev[0].params, "params against rank 0's");
    EXPECT_TRUE(std::isfinite(d.stats[0]) && d.stats[0] > 1.0f) << d.stats[0];
  }
}

INSTANTIATE_TEST_SUITE_P(RanksAndProtocols, ZeroStepOnTheDevice,
                         testing::Combine(testing::Values(2, 3), testing::Values(kProtoSimple, kProtoLL)),
                         [](const auto& info) {
                           return fmt::format("{}ranks_{}", std::get<0>(info.param),
                                              std::get<1>(info.param) == kProtoLL ? "LL" : "Simple");
                         });

TEST(DeviceFused, ANonFiniteGradientSkipsTheStepOnEveryRank) {
  const int n = 2;
  auto [dev, cpu] = run_both(n, 4, 64, true, kProtoSimple);
  const auto before = zero_inputs(n, 4 * 64, true);
  for (int r = 0; r < n; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const ZeroBuffers& d = dev[static_cast<size_t>(r)];
    EXPECT_FALSE(std::isfinite(d.stats[0]));
    expect_same(d.params, before[static_cast<size_t>(r)].params, "params (unchanged)");
    expect_same(d.m, before[static_cast<size_t>(r)].m, "m (unchanged)");
    expect_same(d.v, before[static_cast<size_t>(r)].v, "v (unchanged)");
    expect_same(d.params, cpu[static_cast<size_t>(r)].params, "params against the CPU's");
  }
}

// Runs `plans` in turn on both executors, each rank from its own copy of `buffers` (float arrays,
// the same for both executors); `args(r, buffers, plan index)` makes a rank's call. Returns the
// (device, CPU) buffers afterwards.
using Arrays = std::vector<std::vector<float>>;
template <class MakeArgs>
std::pair<std::vector<Arrays>, std::vector<Arrays>> run_plans(const std::vector<Prepared>& plans, int n,
                                                              const std::vector<Arrays>& buffers, MakeArgs args) {
  auto dev = buffers, cpu = buffers;
  auto comms = Communicator::create_local(n);
  test_support::on_ranks(comms, [&](int r, Communicator& c) {
    DeviceExecutor ex(c, make_emulated_backend(), small_slots());
    CpuExecutor host(c, CpuExecutorOptions{});
    for (size_t k = 0; k < plans.size(); ++k) {
      ex.run(*plans[k], args(r, dev[static_cast<size_t>(r)], k));
      host.run(*plans[k], args(r, cpu[static_cast<size_t>(r)], k));
    }
    ex.close();
  });
  return {std::move(dev), std::move(cpu)};
}

// ZeroStep::reduce() then update(), the trainer's halves (the norm spans several groups there, so
// the clip is given to update): gradients, statistics, master weights, moments and parameters.
TEST(DeviceFused, TheTrainersHalvesGiveTheCpuExecutorsFloats) {
  fused::register_kernels();
  for (int n : {2, 3}) {
    SCOPED_TRACE(fmt::format("{} ranks", n));
    const int pieces = 4;
    const int64_t shard = pieces * 80;
    const std::vector<Prepared> plans = {
        PreparedPlan::make(plan::compile(fused::zero_reduce_program(n, pieces)).plan),
        PreparedPlan::make(plan::compile(fused::zero_update_program(n, pieces)).plan)};
    enum { kGrads, kStats, kMaster, kM, kV, kParams, kDecay };
    std::vector<Arrays> buffers;
    for (int r = 0; r < n; ++r) {
      const ZeroBuffers z = zero_inputs(n, shard, false)[static_cast<size_t>(r)];
      std::vector<float> master(z.params.begin() + r * shard, z.params.begin() + (r + 1) * shard), decay(master.size());
      for (size_t i = 0; i < decay.size(); ++i) decay[i] = (i / 50) % 2 ? 1.0f : 0.0f;  // tensors that decay or not
      buffers.push_back({z.grads, std::vector<float>(static_cast<size_t>(n), -1.0f), master, z.m, z.v, z.params, decay});
    }
    const fused::AdamW opt = test_support::zero_step_options();
    auto [dev, cpu] = run_plans(plans, n, buffers, [&](int, Arrays& b, size_t k) {
      ExecArgs a;
      a.input = b[kGrads].data();
      a.count = shard;
      a.reduction.type = DataType::kFloat32;
      if (k == 0) {
        a.scalars = {0.25};
        a.states = {b[kStats].data()};
      } else {
        a.scalars = {opt.lr, opt.beta1, opt.beta2, opt.eps, opt.weight_decay, static_cast<double>(opt.step), 0.125};
        a.states = {b[kMaster].data(), b[kM].data(), b[kV].data(), b[kParams].data(), b[kDecay].data()};
      }
      return a;
    });
    for (int r = 0; r < n; ++r) {
      SCOPED_TRACE(fmt::format("rank {}", r));
      const Arrays &d = dev[static_cast<size_t>(r)], &c = cpu[static_cast<size_t>(r)];
      const std::vector<float> mine_d(d[kGrads].begin() + r * shard, d[kGrads].begin() + (r + 1) * shard),
          mine_c(c[kGrads].begin() + r * shard, c[kGrads].begin() + (r + 1) * shard);
      expect_same(mine_d, mine_c, "this rank's reduced gradients");
      EXPECT_EQ(d[kStats][static_cast<size_t>(r)], c[kStats][static_cast<size_t>(r)]);
      EXPECT_GT(d[kStats][static_cast<size_t>(r)], 1.0f);
      for (int b : {kMaster, kM, kV, kParams}) expect_same(d[static_cast<size_t>(b)], c[static_cast<size_t>(b)], fmt::format("buffer {}", b));
      expect_same(d[kParams], dev[0][kParams], "params against rank 0's");
      EXPECT_NE(d[kMaster], buffers[static_cast<size_t>(r)][kMaster]);  // the update did something
    }
  }
}

// The mixed-precision step: AdamW on the fp32 master shard, each updated chunk cast to bfloat16
// and the bf16 parameters all-gathered (a state buffer whose unit is half a chunk of floats).
TEST(DeviceFused, TheBf16StepGivesTheCpuExecutorsBits) {
  fused::register_kernels();
  for (int n : {2, 3}) {
    SCOPED_TRACE(fmt::format("{} ranks", n));
    const int pieces = 4;
    const int64_t piece = 96, shard = pieces * piece;
    const std::vector<Prepared> plans = {
        PreparedPlan::make(plan::compile(fused::zero_step_bf16_program(n, pieces, piece)).plan)};
    enum { kGrads, kMaster, kM, kV, kStats, kParams16 };
    std::vector<Arrays> buffers;
    for (int r = 0; r < n; ++r) {
      const ZeroBuffers z = zero_inputs(n, shard, false)[static_cast<size_t>(r)];
      std::vector<float> master(z.params.begin() + r * shard, z.params.begin() + (r + 1) * shard);
      buffers.push_back({z.grads, master, z.m, z.v, z.stats, std::vector<float>(static_cast<size_t>(n * shard / 2), 7.0f)});
    }
    const fused::AdamW opt = test_support::zero_step_options();
    auto [dev, cpu] = run_plans(plans, n, buffers, [&](int, Arrays& b, size_t) {
      ExecArgs a;
      a.input = b[kGrads].data();
      a.count = shard;
      a.reduction.type = DataType::kFloat32;
      a.scalars = fused::zero_step_scalars(opt);
      a.states = {b[kMaster].data(), b[kM].data(), b[kV].data(), b[kStats].data(), b[kParams16].data()};
      return a;
    });
    for (int r = 0; r < n; ++r) {
      SCOPED_TRACE(fmt::format("rank {}", r));
      const Arrays &d = dev[static_cast<size_t>(r)], &c = cpu[static_cast<size_t>(r)];
      for (int b : {kMaster, kM, kV, kStats, kParams16})
        expect_same(d[static_cast<size_t>(b)], c[static_cast<size_t>(b)], fmt::format("buffer {}", b));
      expect_same(d[kParams16], dev[0][kParams16], "bf16 parameters against rank 0's");
      EXPECT_NE(d[kParams16], buffers[static_cast<size_t>(r)][kParams16]);  // every value written
    }
  }
}

// The row-parallel linear layer's epilogue (bias + dropout + residual, + LayerNorm), in its
// all-reduce and sequence-parallel forms: the same floats as the CPU executor, bit for bit
// (partial sums are small integers, so every order of adding them is exact), and in the all-reduce
// form the same rows on every rank. The dropout mask depends on each element's position in the
// rows x hidden tensor, so a wrong offset of a chunk shows.
struct EpilogueCase {
  const char* name;
  fused::EpilogueOptions options;
};
void PrintTo(const EpilogueCase& c, std::ostream* os) { *os << c.name; }

class EpilogueOnTheDevice : public testing::TestWithParam<std::tuple<int, EpilogueCase>> {};

TEST_P(EpilogueOnTheDevice, GivesTheCpuExecutorsFloats) {
  fused::register_kernels();
  const auto [n, c] = GetParam();
  const fused::EpilogueOptions& o = c.options;
  const int pieces = 2;
  const int64_t hidden = 40, rows = static_cast<int64_t>(n) * pieces * 3;
  const int64_t total = rows * hidden, mine = o.sequence_parallel ? total / n : total;
  const std::vector<Prepared> plans = {
      PreparedPlan::make(plan::compile(fused::bias_dropout_residual_program(n, pieces, hidden, o)).plan)};
  enum { kPartial, kOut, kBias, kResidual, kLn, kGamma, kBeta };
  std::vector<Arrays> buffers;
  for (int r = 0; r < n; ++r) {
    Arrays b(7);
    b[kPartial].resize(static_cast<size_t>(total));
    for (size_t i = 0; i < b[kPartial].size(); ++i)
      b[kPartial][i] = static_cast<float>(static_cast<int>((i * 5 + static_cast<size_t>(r) * 3) % 7) - 3);
    b[kOut].assign(static_cast<size_t>(mine), -9.0f);
    b[kBias].resize(static_cast<size_t>(hidden));
    b[kGamma].resize(b[kBias].size());
    b[kBeta].resize(b[kBias].size());
    for (size_t i = 0; i < b[kBias].size(); ++i) {
      b[kBias][i] = 0.03f * static_cast<float>(i % 11) - 0.1f;
      b[kGamma][i] = 1.0f + 0.01f * static_cast<float>(i % 5);
      b[kBeta][i] = 0.02f * static_cast<float>(i % 3);
    }
    b[kResidual].resize(static_cast<size_t>(mine));
    for (size_t i = 0; i < b[kResidual].size(); ++i)
      b[kResidual][i] = 0.5f * static_cast<float>((i + (o.sequence_parallel ? static_cast<size_t>(r * mine) : 0)) % 13);
    b[kLn].assign(o.layer_norm ? static_cast<size_t>(mine) : 0, -9.0f);
    buffers.push_back(std::move(b));
  }
  auto [dev, cpu] = run_plans(plans, n, buffers, [&](int, Arrays& b, size_t) {
    ExecArgs a;
    a.input = b[kPartial].data();
    a.output = b[kOut].data();
    a.count = total;
    a.reduction.type = DataType::kFloat32;
    a.scalars = {o.dropout, static_cast<double>(o.seed >> 32), static_cast<double>(o.seed & 0xFFFFFFFFu), o.ln_eps};
    a.states = {b[kBias].data(), b[kResidual].data(), b[kLn].data()};
    if (o.layer_norm) a.states.push_back(b[kGamma].data()), a.states.push_back(b[kBeta].data());
    return a;
  });
  for (int r = 0; r < n; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const Arrays &d = dev[static_cast<size_t>(r)], &h = cpu[static_cast<size_t>(r)];
    expect_same(d[kOut], h[kOut], "out");
    expect_same(d[kLn], h[kLn], "ln");
    EXPECT_EQ(std::count(d[kOut].begin(), d[kOut].end(), -9.0f), 0) << "rows left unwritten";
    if (!o.sequence_parallel) expect_same(d[kOut], dev[0][kOut], "out against rank 0's");
  }
}

fused::EpilogueOptions epilogue(float dropout, bool ln, bool sp) {
  fused::EpilogueOptions o;
  o.dropout = dropout;
  o.seed = 0x1234567890abcdefull;
  o.layer_norm = ln;
  o.sequence_parallel = sp;
  return o;
}

INSTANTIATE_TEST_SUITE_P(
    Forms, EpilogueOnTheDevice,
    testing::Combine(testing::Values(2, 3),
                     testing::Values(EpilogueCase{"plain", epilogue(0, false, false)},
                                     EpilogueCase{"dropout", epilogue(0.25f, false, false)},
                                     EpilogueCase{"dropout_ln", epilogue(0.25f, true, false)},
                                     EpilogueCase{"sp_dropout", epilogue(0.25f, false, true)},
                                     EpilogueCase{"sp_dropout_ln", epilogue(0.25f, true, true)})),
    [](const auto& info) { return fmt::format("{}ranks_{}", std::get<0>(info.param), std::get<1>(info.param).name); });

TEST(DeviceFused, EpilogueCallsOfPartRowsAreRefused) {
  fused::register_kernels();
  // Chunks of 4 * 40 + 8 elements would cut rows of 40.
  Prepared plan =
      PreparedPlan::make(plan::compile(fused::bias_dropout_residual_program(2, 2, 40, fused::EpilogueOptions{})).plan);
  auto comms = Communicator::create_local(2);
  DeviceExecutor ex(*comms[0], make_emulated_backend(), small_slots());
  std::vector<float> in(4 * 168), out(in.size()), bias(40), residual(in.size());
  ExecArgs a;
  a.input = in.data();
  a.output = out.data();
  a.count = static_cast<int64_t>(in.size());
  a.scalars = {0, 0, 0, 0};
  a.states = {bias.data(), residual.data(), nullptr};
  try {
    ex.run(*plan, a);
    ADD_FAILURE() << "ran chunks of part rows";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("rows of 40"), std::string::npos) << e.what();
  }
}

// GEMM blocks under sequence parallelism: GEMM -> reduce-scatter and all-gather -> GEMM. Small
// integer operands keep every product and sum exact, so the device's plain GEMM and OpenBLAS's
// (on the CPU executor) agree bit for bit however each orders its sums.
TEST(DeviceFused, GemmPlansGiveTheCpuExecutorsFloats) {
  fused::register_kernels();
  auto small = [](size_t i, int r, int mod) { return static_cast<float>(static_cast<int>((i * 7 + static_cast<size_t>(r) * 5) % static_cast<size_t>(mod)) - mod / 2); };
  for (int n : {2, 3}) {
    SCOPED_TRACE(fmt::format("{} ranks", n));
    const int pieces = 2;
    const int64_t rows = static_cast<int64_t>(n) * pieces * 3, k = 12, cols = 10;
    {
      SCOPED_TRACE("gemm -> reduce-scatter");
      const std::vector<Prepared> plans = {
          PreparedPlan::make(plan::compile(fused::gemm_reduce_scatter_program(n, pieces, rows, k, cols)).plan)};
      enum { kX, kW, kOut };
      std::vector<Arrays> buffers;
      for (int r = 0; r < n; ++r) {
        Arrays b(3);
        b[kX].resize(static_cast<size_t>(rows * k));
        for (size_t i = 0; i < b[kX].size(); ++i) b[kX][i] = small(i, r, 5);
        b[kW].resize(static_cast<size_t>(k * cols));
        for (size_t i = 0; i < b[kW].size(); ++i) b[kW][i] = small(i, r + 1, 7);
        b[kOut].assign(static_cast<size_t>(rows / n * cols), -999.0f);
        buffers.push_back(std::move(b));
      }
      auto [dev, cpu] = run_plans(plans, n, buffers, [&](int, Arrays& b, size_t) {
        ExecArgs a;
        a.output = b[kOut].data();
        a.count = rows / n * cols;
        a.reduction.type = DataType::kFloat32;
        a.states = {b[kX].data(), b[kW].data()};
        return a;
      });
      for (int r = 0; r < n; ++r) {
        expect_same(dev[static_cast<size_t>(r)][kOut], cpu[static_cast<size_t>(r)][kOut], fmt::format("rank {} out", r));
        EXPECT_EQ(std::count(dev[static_cast<size_t>(r)][kOut].begin(), dev[static_cast<size_t>(r)][kOut].end(), -999.0f), 0);
      }
    }
    {
      SCOPED_TRACE("all-gather -> gemm");
      const std::vector<Prepared> plans = {
          PreparedPlan::make(plan::compile(fused::all_gather_gemm_program(n, pieces, rows, k, cols)).plan)};
      enum { kX, kGathered, kW, kY };
      std::vector<Arrays> buffers;
      for (int r = 0; r < n; ++r) {
        Arrays b(4);
        b[kX].resize(static_cast<size_t>(rows / n * k));
        for (size_t i = 0; i < b[kX].size(); ++i) b[kX][i] = small(i, r, 5);
        b[kGathered].assign(static_cast<size_t>(rows * k), -999.0f);
        b[kW].resize(static_cast<size_t>(k * cols));
        for (size_t i = 0; i < b[kW].size(); ++i) b[kW][i] = small(i, r + 1, 7);
        b[kY].assign(static_cast<size_t>(rows * cols), -999.0f);
        buffers.push_back(std::move(b));
      }
      auto [dev, cpu] = run_plans(plans, n, buffers, [&](int, Arrays& b, size_t) {
        ExecArgs a;
        a.input = b[kX].data();
        a.output = b[kGathered].data();
        a.count = rows / n * k;
        a.reduction.type = DataType::kFloat32;
        a.states = {b[kW].data(), b[kY].data()};
        return a;
      });
      for (int r = 0; r < n; ++r) {
        expect_same(dev[static_cast<size_t>(r)][kGathered], cpu[static_cast<size_t>(r)][kGathered], "gathered");
        expect_same(dev[static_cast<size_t>(r)][kY], cpu[static_cast<size_t>(r)][kY], fmt::format("rank {} y", r));
        EXPECT_EQ(std::count(dev[static_cast<size_t>(r)][kY].begin(), dev[static_cast<size_t>(r)][kY].end(), -999.0f), 0);
      }
    }
  }
}

TEST(DeviceFused, GemmCallsOfAnotherShapeAreRefused) {
  fused::register_kernels();
  // The plan's blocks are 3 x 12 rows of x; a call whose output chunks are not 3 x 10 is refused.
  Prepared plan = PreparedPlan::make(plan::compile(fused::gemm_reduce_scatter_program(2, 2, 12, 12, 10)).plan);
  auto comms = Communicator::create_local(2);
  DeviceExecutor ex(*comms[0], make_emulated_backend(), small_slots());
  std::vector<float> x(12 * 12), w(12 * 10), out(2 * 40);
  ExecArgs a;
  a.output = out.data();
  a.count = 2 * 40;  // chunks of 40, not 30
  a.states = {x.data(), w.data()};
  try {
    ex.run(*plan, a);
    ADD_FAILURE() << "ran a GEMM into chunks of the wrong length";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'fused.gemm' on operand 2 of 30 elements"), std::string::npos) << e.what();
  }
}

// MoE dispatch (gather each destination's tokens, send) and combine (send back, gate-weight and
// scatter on receipt), with empty slots and tokens sent to several experts: the CPU executor's
// floats bit for bit.
struct MoeTables {
  std::vector<float> x, gate;
  std::vector<int32_t> index;
};
MoeTables moe_tables(int n, int r, int64_t tokens, int64_t hidden, int64_t capacity) {
  MoeTables t;
  t.x.resize(static_cast<size_t>(tokens * hidden));
  for (size_t i = 0; i < t.x.size(); ++i) t.x[i] = static_cast<float>(static_cast<int>((i * 3 + static_cast<size_t>(r)) % 11) - 5);
  t.index.resize(static_cast<size_t>(n * capacity));
  t.gate.resize(t.index.size());
  for (size_t s = 0; s < t.index.size(); ++s) {
    t.index[s] = s % 4 == 3 ? -1 : static_cast<int32_t>((s * 5 + static_cast<size_t>(r)) % static_cast<size_t>(tokens));
    t.gate[s] = 0.25f * static_cast<float>(1 + (s + static_cast<size_t>(r)) % 3);
  }
  return t;
}

TEST(DeviceFused, MoeDispatchAndCombineGiveTheCpuExecutorsFloats) {
  fused::register_kernels();
  for (int n : {2, 3}) {
    SCOPED_TRACE(fmt::format("{} ranks", n));
    const int64_t tokens = 10, hidden = 8, capacity = 6;
    const std::vector<Prepared> plans = {
        PreparedPlan::make(plan::compile(fused::moe_dispatch_program(n, tokens, hidden, capacity)).plan),
        PreparedPlan::make(plan::compile(fused::moe_combine_program(n, tokens, hidden, capacity)).plan)};
    enum { kX, kIndex, kExpertIn, kExpertOut, kY, kGate };
    std::vector<Arrays> buffers;
    for (int r = 0; r < n; ++r) {
      const MoeTables t = moe_tables(n, r, tokens, hidden, capacity);
      std::vector<float> index(t.index.size());
      std::memcpy(index.data(), t.index.data(), index.size() * sizeof(float));  // int32 in float storage
      std::vector<float> expert_out(static_cast<size_t>(n * capacity * hidden));
      for (size_t i = 0; i < expert_out.size(); ++i) expert_out[i] = static_cast<float>((i + static_cast<size_t>(r) * 7) % 9) - 4;
      buffers.push_back({t.x, index, std::vector<float>(expert_out.size(), -999.0f), expert_out,
                         std::vector<float>(static_cast<size_t>(tokens * hidden), -999.0f), t.gate});
    }
    auto [dev, cpu] = run_plans(plans, n, buffers, [&](int, Arrays& b, size_t k) {
      ExecArgs a;
      a.count = n * capacity * hidden;
      a.reduction.type = DataType::kFloat32;
      if (k == 0) {
        a.output = b[kExpertIn].data();
        a.states = {b[kX].data(), b[kIndex].data()};
      } else {
        a.input = b[kExpertOut].data();
        a.states = {b[kY].data(), b[kGate].data(), b[kIndex].data()};
      }
      return a;
    });
    for (int r = 0; r < n; ++r) {
      SCOPED_TRACE(fmt::format("rank {}", r));
      const Arrays &d = dev[static_cast<size_t>(r)], &c = cpu[static_cast<size_t>(r)];
      expect_same(d[kExpertIn], c[kExpertIn], "dispatched blocks");
      expect_same(d[kY], c[kY], "combined rows");
      EXPECT_EQ(std::count(d[kExpertIn].begin(), d[kExpertIn].end(), -999.0f), 0);
      EXPECT_EQ(std::count(d[kY].begin(), d[kY].end(), -999.0f), 0);
      EXPECT_NE(std::count(d[kY].begin(), d[kY].end(), 0.0f), static_cast<long>(d[kY].size()));
    }
  }
}

// A slot naming a token outside the table: the device form cannot throw, so rank 0's launch stops
// at that gather and the host reports the slot and the token; rank 1, whose data is good, waits for
// rank 0's blocks and gives up after its timeout, naming rank 0.
TEST(DeviceFused, AMoeSlotOutsideTheTokenTableIsReported) {
  fused::register_kernels();
  const int n = 2;
  const int64_t tokens = 10, hidden = 8, capacity = 6;
  Prepared plan = PreparedPlan::make(plan::compile(fused::moe_dispatch_program(n, tokens, hidden, capacity)).plan);
  auto comms = Communicator::create_local(n);
  std::vector<std::string> errors(n);
  test_support::on_ranks(comms, [&](int r, Communicator& c) {
    DeviceOptions d = small_slots();
    d.timeout_s = 2;
    DeviceExecutor ex(c, make_emulated_backend(), d);
    MoeTables t = moe_tables(n, r, tokens, hidden, capacity);
    if (r == 0) t.index[static_cast<size_t>(capacity) + 2] = 10;  // slot 2 of the block for rank 1
    std::vector<float> out(static_cast<size_t>(n * capacity * hidden));
    ExecArgs a;
    a.output = out.data();
    a.count = n * capacity * hidden;
    a.states = {t.x.data(), t.index.data()};
    try {
      ex.run(*plan, a);
      ex.check();
    } catch (const Error& e) {
      errors[static_cast<size_t>(r)] = e.what();
    }
  });
  EXPECT_NE(errors[0].find("moe_dispatch_n2"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("slot 2 names token 10, outside its token table"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("waiting for rank 0"), std::string::npos) << errors[1];
}

// Runs `plan` on rank 0 alone and returns the InvalidArgument's text ("" if it ran).
std::string refusal(const Prepared& plan, int n, int64_t shard, DeviceOptions d, DataType type = DataType::kFloat32) {
  auto comms = Communicator::create_local(n);
  DeviceExecutor ex(*comms[0], make_emulated_backend(), d);
  auto buffers = zero_inputs(n, shard, false);
  ExecArgs a = zero_args(buffers[0], shard, test_support::zero_step_options());
  a.reduction.type = type;
  std::vector<float> more(static_cast<size_t>(n * shard));
  a.states.resize(plan->plan.states.size(), more.data());  // as many as the plan names
  try {
    ex.run(*plan, a);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(DeviceFused, MessagesThatDoNotFitASlotAreRefusedByThePlansName) {
  // One pass: a 4 KiB slot holds a chunk of 1024 floats, not one of 2048.
  const std::string why = refusal(zero_plan(2, 2), 2, 2 * 2048, small_slots());
  EXPECT_NE(why.find("zero_step_n2_k2"), std::string::npos) << why;
  EXPECT_NE(why.find("TUTTI_DEVICE_SLOT_SIZE"), std::string::npos) << why;
}

TEST(DeviceFused, KernelsWithoutADeviceFormAndOtherTypesAreRefused) {
  // A kernel registered without a device form (as user kernels are, so far).
  fused::register_kernels();
  static const KernelId host_only = register_kernel(
      {"test.host_only_double", {}, [](const KernelArgs& k) {
         auto* o = static_cast<float*>(k.outputs[0]);
         const auto* i = static_cast<const float*>(k.inputs[0]);
         for (int64_t e = 0; e < k.count; ++e) o[e] = 2 * i[e];
       }});
  CollectiveSpec spec;
  spec.kind = Collective::kCustom;
  spec.nranks = 2;
  spec.chunk_factor = 1;
  spec.custom_input_chunks = 1;
  spec.custom_output_chunks = 1;
  spec.custom_post = [](int q, int) { return std::optional<Content>(Content::apply(host_only, {Content::of(q, 0)}, {})); };
  spec.states = {StateBufferSpec{"unused", 1, 1, {}}};
  dsl::Program prog("host_only_kernel", spec);
  for (int q = 0; q < 2; ++q) prog.apply(host_only, {prog.chunk(q, dsl::Buffer::input(), 0)}, {prog.chunk(q, dsl::Buffer::output(), 0)}, {});
  const std::string why = refusal(PreparedPlan::make(plan::compile(prog).plan), 2, 64, small_slots());
  EXPECT_NE(why.find("no device form"), std::string::npos) << why;
  EXPECT_NE(why.find("test.host_only_double"), std::string::npos) << why;
  const std::string type = refusal(zero_plan(2, 4), 2, 4 * 64, small_slots(), DataType::kFloat64);
  EXPECT_NE(type.find("float32"), std::string::npos) << type;
  // A call that passes fewer per-call scalars than the kernels read (the CPU executor refuses it too).
  auto comms = Communicator::create_local(2);
  DeviceExecutor ex(*comms[0], make_emulated_backend(), small_slots());
  auto buffers = zero_inputs(2, 4 * 64, false);
  ExecArgs a = zero_args(buffers[0], 4 * 64, test_support::zero_step_options());
  a.scalars.resize(3);
  try {
    ex.run(*zero_plan(2, 4), a);
    ADD_FAILURE() << "ran with 3 of the plan's 8 scalars";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("per-call scalar 7"), std::string::npos) << e.what();
  }
}

}  // namespace
