// Fused plans on the device interpreter, on the emulated device (the CUDA kernel's source compiled
// for the host): the ZeRO step's plan, with its state buffers, per-call scalars and kernels, runs in
// one pass and gives the CPU executor's floats bit for bit (the data's sums of squares are exact, so
// both add them to the same double); a non-finite gradient skips the step on every rank; plans the
// device cannot run are refused by name before anything collective happens.
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <bit>
#include <random>
#include <thread>
#include <cmath>
#include <cstring>
#include <limits>

#include "compiler/compile.hpp"
#include "runtime/cpu_executor.hpp"
#include "runtime/device/device_executor.hpp"
#include "runtime/device/kernels.hpp"
#include "support/ranks.hpp"
#include "support/fused_cases.hpp"
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

// Runs a case on the emulated device and the CPU executor and compares the results bit for bit;
// every output element written, replicated results the same on every rank.
void expect_case_matches(const test_support::FusedCase& c, int n) {
  auto [dev, cpu] = run_plans(c.plans, n, c.buffers, [&](int r, Arrays& b, size_t k) {
    return c.args(r, test_support::addresses(b), k);
  });
  for (int r = 0; r < n; ++r)
    for (size_t k : c.results) {
      SCOPED_TRACE(fmt::format("{}: rank {}, array {}", c.name, r, k));
      const std::vector<float>& d = dev[static_cast<size_t>(r)][k];
      expect_same(d, cpu[static_cast<size_t>(r)][k], "device against CPU");
      EXPECT_EQ(std::count(d.begin(), d.end(), test_support::kUnwritten), 0) << "elements left unwritten";
      if (!d.empty()) {
        EXPECT_GT(std::count_if(d.begin(), d.end(), [](float x) { return x != 0.0f; }), 0) << "all zero";
      }
      if (c.same_on_every_rank) expect_same(d, dev[0][k], "against rank 0's");
    }
}

// The row-parallel linear layer's epilogue (bias + dropout + residual, + LayerNorm), in its
// all-reduce and sequence-parallel forms. The dropout mask depends on each element's position in
// the rows x hidden tensor, so a wrong offset of a chunk shows.
struct EpilogueCase {
  const char* name;
  fused::EpilogueOptions options;
};
void PrintTo(const EpilogueCase& c, std::ostream* os) { *os << c.name; }

class EpilogueOnTheDevice : public testing::TestWithParam<std::tuple<int, EpilogueCase>> {};

TEST_P(EpilogueOnTheDevice, GivesTheCpuExecutorsFloats) {
  const auto [n, c] = GetParam();
  expect_case_matches(test_support::epilogue_case(n, c.options), n);
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
  for (int n : {2, 3}) {
    expect_case_matches(test_support::gemm_reduce_scatter_case(n), n);
    expect_case_matches(test_support::all_gather_gemm_case(n), n);
  }
}

// The device GEMM's tiles, run by teams of real threads as a GPU block runs them (a barrier for
// __syncthreads, one shared scratch): every team size and shape, tile edges included, gives the
// plain loop's floats bit for bit, since each output's sum runs over k in the same order.
namespace {
struct ThreadTeam {
  int r, n;
  std::barrier<>* bar;
  float* shared;
  int rank() const { return r; }
  int size() const { return n; }
  void sync() const { bar->arrive_and_wait(); }
  float* scratch() const { return shared; }
};
}  // namespace

TEST(DeviceFused, TiledGemmGivesThePlainLoopsFloatsForAnyTeam) {
  struct Shape {
    int64_t rows, k, n;
  };
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  for (const Shape sh : {Shape{1, 1, 1}, Shape{37, 19, 45}, Shape{64, 16, 32}, Shape{5, 40, 3}, Shape{130, 33, 70}}) {
    std::vector<float> a(static_cast<size_t>(sh.rows * sh.k)), b(static_cast<size_t>(sh.k * sh.n)),
        want(static_cast<size_t>(sh.rows * sh.n));
    for (float& x : a) x = dist(gen);
    for (float& x : b) x = dist(gen);
    for (int64_t i = 0; i < sh.rows; ++i)
      for (int64_t j = 0; j < sh.n; ++j) {
        float acc = 0.0f;
        for (int64_t q = 0; q < sh.k; ++q) {
          const volatile float prod = a[static_cast<size_t>(i * sh.k + q)] * b[static_cast<size_t>(q * sh.n + j)];
          acc += prod;  // one rounding for the product, one for the sum, as the device's
        }
        want[static_cast<size_t>(i * sh.n + j)] = acc;
      }
    for (int threads : {1, 3, 32, 64, 96}) {
      std::vector<float> got(want.size(), std::numeric_limits<float>::quiet_NaN());
      std::vector<float> shared(device::kGemmScratchFloats);
      std::barrier<> bar(threads);
      std::vector<std::thread> team;
      for (int r = 0; r < threads; ++r)
        team.emplace_back([&, r] {
          device::gemm(ThreadTeam{r, threads, &bar, shared.data()}, a.data(), b.data(), got.data(), sh.rows, sh.k, sh.n);
        });
      for (auto& th : team) th.join();
      for (size_t e = 0; e < want.size(); ++e)
        ASSERT_EQ(std::bit_cast<uint32_t>(got[e]), std::bit_cast<uint32_t>(want[e]))
            << sh.rows << "x" << sh.k << "x" << sh.n << ", " << threads << " threads, element " << e;
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
// scatter on receipt), with empty slots and tokens sent to several experts.
TEST(DeviceFused, MoeDispatchAndCombineGiveTheCpuExecutorsFloats) {
  for (int n : {2, 3}) expect_case_matches(test_support::moe_case(n), n);
}

// A slot naming a token outside the table: the device form cannot throw, so rank 0's launch stops
// at that gather and the host reports the slot and the token; rank 1, whose data is good, stops
// too, naming rank 0: when rank 0's failure reaches it (the communicator fails and sets its stop
// word), or, had it not, after its timeout waiting for rank 0.
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
    Arrays b = test_support::moe_case(n, tokens, hidden, capacity).buffers[static_cast<size_t>(r)];
    const int32_t outside = 10;
    if (r == 0) std::memcpy(&b[1][static_cast<size_t>(capacity) + 2], &outside, 4);  // slot 2 of the block for rank 1
    ExecArgs a;
    a.output = b[2].data();
    a.count = n * capacity * hidden;
    a.states = {b[0].data(), b[1].data()};
    try {
      ex.run(*plan, a);
      ex.check();
    } catch (const Error& e) {
      errors[static_cast<size_t>(r)] = e.what();
    }
  });
  EXPECT_NE(errors[0].find("moe_dispatch_n2"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("slot 2 names token 10, outside its token table"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rank 0"), std::string::npos) << errors[1];
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

// A user kernel given as an element-wise program (tutti/kernel.hpp, ElementProgram) runs on the
// device interpreter (support/fused_cases.hpp, user_kernel_case): the emulated device gives the CPU
// executor's floats bit for bit, and the CPU form gives what the formula gives.
TEST(DeviceFused, UserElementwiseKernelsRunOnTheDevice) {
  const test_support::FusedCase c = test_support::user_kernel_case();
  expect_case_matches(c, 2);
  auto cpu = c.buffers;
  auto comms = Communicator::create_local(2);
  test_support::on_ranks(comms, [&](int r, Communicator& comm) {
    CpuExecutor host(comm, CpuExecutorOptions{});
    host.run(*c.plans[0], c.args(r, test_support::addresses(cpu[static_cast<size_t>(r)]), 0));
  });
  const float bias = test_support::kUserKernelBias;
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const Arrays& got = cpu[static_cast<size_t>(r)];
    for (size_t k = 0; k < got[1].size(); ++k) {  // the formula, written out in the program's order
      const float x = c.buffers[0][0][k] + c.buffers[1][0][k], res = c.buffers[static_cast<size_t>(r)][2][k];
      const float y = x + bias;
      const float gelu = ((y * 0.5f) * (1.0f + tanhf(0.7978845608f * (y + ((0.044715f * y) * y) * y))));
      const float want = gelu + 0.25f * res;
      ASSERT_EQ(std::memcmp(&got[1][k], &want, 4), 0) << "element " << k << ": " << got[1][k] << " vs " << want;
      const float sel = x > 0 ? sqrtf(fabsf(x)) : expf(0.5f < x ? 0.5f : x);
      const float aux = ((sel + fmaf(x, res, 1.0f)) + (x < res ? res : x)) - x / (1.0f + fabsf(res));
      ASSERT_EQ(std::memcmp(&got[3][k], &aux, 4), 0) << "element " << k << ": " << got[3][k] << " vs " << aux;
    }
  }
}

TEST(DeviceFused, KernelsWithoutADeviceFormAndOtherTypesAreRefused) {
  // A kernel registered without a device form (a user kernel with only a CPU function).
  fused::register_kernels();
  static const KernelId host_only = register_kernel(
      {"test.host_only_double", {}, [](const KernelArgs& k) {
         auto* o = static_cast<float*>(k.outputs[0]);
         const auto* i = static_cast<const float*>(k.inputs[0]);
         for (int64_t e = 0; e < k.count; ++e) o[e] = 2 * i[e];
       }});
  CollectiveSpec spec = test_support::custom_spec(2, 1, 1);
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
