// The fused operations' plans on a real GPU (the CUDA backend of the device executor): the ZeRO
// step, the epilogues, the GEMM blocks and MoE's dispatch and combine. The ZeRO step's plan (the CUDA backend of the device executor), 2 and 4 ranks
// as threads sharing device 0, against the CPU executor on the same inputs. A GPU contracts
// multiplies and adds and rounds pow differently, so parameters and moments agree to a few ulps;
// the norm's sum of squares is exact (small integer gradients). Needs a GPU: without one the tests
// skip with a message (the build proves the CUDA code compiles; test_device_fused runs the same
// interpreter on the emulated device in CI).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <thread>

#include "collectives/include/nccl.h"
#include "collectives/include/tutti_nccl.h"
#include "compiler/compile.hpp"
#include "runtime/cuda/cuda_reduce.hpp"
#include "runtime/cpu_executor.hpp"
#include "runtime/device/device_executor.hpp"
#include "support/ranks.hpp"
#include "support/fused_cases.hpp"
#include "support/zero_data.hpp"
#include "tutti/fused.hpp"
#include "tutti/plan.hpp"

using namespace tutti;
using namespace tutti::device;

namespace {

using test_support::ZeroBuffers;

ExecArgs args_of(float* grads, float* params, float* m, float* v, float* stats, int64_t shard, const fused::AdamW& opt) {
  ExecArgs a;
  a.input = grads;
  a.count = shard;
  a.reduction.type = DataType::kFloat32;
  a.scalars = fused::zero_step_scalars(opt);
  a.states = {params, m, v, stats};
  return a;
}

// Each rank's work goes to a stream of its own that does not wait for the legacy default stream:
// ranks sharing the GPU run their plans concurrently and each waits for the others' messages, so a
// launch or copy queued behind another rank's running kernel (one shared default stream, or a
// blocking stream behind a cudaMemcpy) would never start.
struct RankStream {
  cudaStream_t s = nullptr;
  RankStream() { EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess); }
  ~RankStream() { cudaStreamDestroy(s); }
  RankStream(const RankStream&) = delete;
  RankStream& operator=(const RankStream&) = delete;
};

void* to_device(const std::vector<float>& h, cudaStream_t s) {
  void* d = nullptr;
  EXPECT_EQ(cudaMallocAsync(&d, h.size() * sizeof(float), s), cudaSuccess);
  EXPECT_EQ(cudaMemcpyAsync(d, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice, s), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  return d;
}

std::vector<float> to_host(void* d, size_t n, cudaStream_t s) {
  std::vector<float> h(n);
  EXPECT_EQ(cudaMemcpyAsync(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost, s), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  return h;
}

void free_on(cudaStream_t s, std::initializer_list<void*> ds) {
  for (void* d : ds) cudaFreeAsync(d, s);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_LE(std::fabs(got[i] - want[i]), 1e-5f * std::fabs(want[i]) + 1e-7f)
        << what << " element " << i << ": GPU " << got[i] << ", CPU " << want[i];
}

TEST(CudaFused, ZeroStepPlanMatchesTheCpuExecutor) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  fused::register_kernels();
  const fused::AdamW opt = test_support::zero_step_options();
  for (int n : {2, 4}) {
    SCOPED_TRACE(fmt::format("{} ranks", n));
    const int pieces = 8;
    const int64_t shard = pieces * 4096;  // 16 KiB pieces: one pass needs slots that hold them
    auto plan = PreparedPlan::make(plan::compile(fused::zero_step_program(n, pieces)).plan);
    auto comms = Communicator::create_local(n);
    std::vector<ZeroBuffers> gpu(static_cast<size_t>(n)), cpu(static_cast<size_t>(n));
    test_support::on_ranks(comms, [&](int r, Communicator& c) {
      ZeroBuffers h = test_support::zero_rank_inputs(n, r, shard);
      cpu[static_cast<size_t>(r)] = h;
      RankStream rs;
      DeviceExecutor ex(c, make_cuda_backend(0), DeviceOptions::from_env());
      void *g = to_device(h.grads, rs.s), *p = to_device(h.params, rs.s), *m = to_device(h.m, rs.s),
           *v = to_device(h.v, rs.s), *s = to_device(h.stats, rs.s);
      ExecArgs a = args_of(static_cast<float*>(g), static_cast<float*>(p), static_cast<float*>(m),
                           static_cast<float*>(v), static_cast<float*>(s), shard, opt);
      a.stream = rs.s;
      ex.run(*plan, a);
      ASSERT_EQ(cudaStreamSynchronize(rs.s), cudaSuccess);
      ex.check();
      ZeroBuffers& out = gpu[static_cast<size_t>(r)];
      out.params = to_host(p, h.params.size(), rs.s);
      out.m = to_host(m, h.m.size(), rs.s);
      out.v = to_host(v, h.v.size(), rs.s);
      out.stats = to_host(s, h.stats.size(), rs.s);
      ex.close();
      free_on(rs.s, {g, p, m, v, s});
      ZeroBuffers& ref = cpu[static_cast<size_t>(r)];
      CpuExecutor host(c, CpuExecutorOptions{});
      host.run(*plan, args_of(ref.grads.data(), ref.params.data(), ref.m.data(), ref.v.data(), ref.stats.data(), shard, opt));
    });
    for (int r = 0; r < n; ++r) {
      SCOPED_TRACE(fmt::format("rank {}", r));
      const ZeroBuffers &d = gpu[static_cast<size_t>(r)], &c = cpu[static_cast<size_t>(r)];
      EXPECT_EQ(std::memcmp(d.stats.data(), c.stats.data(), c.stats.size() * sizeof(float)), 0)
          << "sums of squares: GPU " << d.stats[0] << ", CPU " << c.stats[0];
      expect_close(d.params, c.params, "params");
      expect_close(d.m, c.m, "m");
      expect_close(d.v, c.v, "v");
    }
  }
}

// Runs a case's plans on the GPU (ranks as threads sharing device 0) and on the CPU executor from
// the same inputs; results agree bit for bit on exact data, to rounding where the case says a GPU
// rounds differently (a contracted multiply-add, LayerNorm's square root), and every output element
// is written.
void expect_case_on_gpu(const test_support::FusedCase& c, int n) {
  SCOPED_TRACE(fmt::format("{}, {} ranks", c.name, n));
  std::vector<test_support::Arrays> gpu = c.buffers, cpu = c.buffers;
  auto comms = Communicator::create_local(n);
  test_support::on_ranks(comms, [&](int r, Communicator& comm) {
    test_support::Arrays& g = gpu[static_cast<size_t>(r)];
    RankStream rs;
    std::vector<float*> dev;
    for (const auto& a : g) dev.push_back(static_cast<float*>(to_device(a, rs.s)));
    {
      DeviceExecutor ex(comm, make_cuda_backend(0), DeviceOptions::from_env());
      for (size_t k = 0; k < c.plans.size(); ++k) {
        ExecArgs a = c.args(r, dev, k);
        a.stream = rs.s;
        ex.run(*c.plans[k], a);
      }
      ASSERT_EQ(cudaStreamSynchronize(rs.s), cudaSuccess);
      ex.check();
      ex.close();
    }
    for (size_t k = 0; k < g.size(); ++k) {
      g[k] = to_host(dev[k], g[k].size(), rs.s);
      free_on(rs.s, {dev[k]});
    }
    CpuExecutor host(comm, CpuExecutorOptions{});
    for (size_t k = 0; k < c.plans.size(); ++k) host.run(*c.plans[k], c.args(r, test_support::addresses(cpu[static_cast<size_t>(r)]), k));
  });
  for (int r = 0; r < n; ++r)
    for (size_t k : c.results) {
      SCOPED_TRACE(fmt::format("rank {}, array {}", r, k));
      const std::vector<float>&d = gpu[static_cast<size_t>(r)][k], &h = cpu[static_cast<size_t>(r)][k];
      if (c.rounded) {
        ASSERT_EQ(d.size(), h.size());
        for (size_t i = 0; i < d.size(); ++i)
          ASSERT_LE(std::fabs(d[i] - h[i]), 1e-5f * std::fabs(h[i]) + 1e-5f) << "element " << i << ": GPU " << d[i] << ", CPU " << h[i];
      } else {
        ASSERT_EQ(std::memcmp(d.data(), h.data(), d.size() * sizeof(float)), 0) << "GPU and CPU differ";
      }
      EXPECT_EQ(std::count(d.begin(), d.end(), test_support::kUnwritten), 0) << "elements left unwritten";
    }
}

TEST(CudaFused, EveryFusedPlanMatchesTheCpuExecutor) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  for (int n : {2, 4}) {
    for (bool sp : {false, true}) {
      fused::EpilogueOptions o;
      o.dropout = 0.25f;
      o.seed = 0x1234567890abcdefull;
      o.layer_norm = true;
      o.sequence_parallel = sp;
      // Rows of 768 (GPT-2 small): a row spans more than one warp of a thread block.
      expect_case_on_gpu(test_support::epilogue_case(n, o, 768, 4), n);
    }
    expect_case_on_gpu(test_support::gemm_reduce_scatter_case(n), n);
    expect_case_on_gpu(test_support::all_gather_gemm_case(n), n);
    expect_case_on_gpu(test_support::moe_case(n), n);
  }
  expect_case_on_gpu(test_support::user_kernel_case(), 2);  // a user kernel's element-wise program
}

// The public device entry point: tuttiRunPlan on cudaMalloc'd buffers of NCCL communicators (2
// ranks as threads sharing device 0), the ZeRO step's plan parsed from its JSON, against the same
// plan on host buffers through the same call (the CPU executor).
TEST(CudaFused, TuttiRunPlanRunsTheZeroStepOnDeviceBuffers) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  fused::register_kernels();
  const int n = 2, pieces = 8;
  const int64_t shard = pieces * 4096;
  tuttiPlan_t plan = nullptr;
  ASSERT_EQ(tuttiPlanParse(compile_plan(fused::zero_step_program(n, pieces)).json().c_str(), &plan), ncclSuccess)
      << ncclGetLastError(nullptr);
  const std::vector<double> scalars = fused::zero_step_scalars(test_support::zero_step_options());
  auto gpu = test_support::zero_inputs(n, shard, false), cpu = gpu;
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r)
    ranks.emplace_back([&, r] {
      ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
      ncclComm_t comm = nullptr;
      ASSERT_EQ(ncclCommInitRank(&comm, n, id, r), ncclSuccess) << ncclGetLastError(nullptr);
      ZeroBuffers& x = gpu[static_cast<size_t>(r)];
      RankStream rs;
      const cudaStream_t stream = rs.s;
      void *g = to_device(x.grads, stream), *p = to_device(x.params, stream), *m = to_device(x.m, stream),
           *v = to_device(x.v, stream), *st = to_device(x.stats, stream);
      void* states[] = {p, m, v, st};
      ASSERT_EQ(tuttiRunPlan(plan, g, nullptr, shard, ncclFloat32, ncclSum, states, 4, scalars.data(),
                             static_cast<int>(scalars.size()), comm, stream),
                ncclSuccess)
          << ncclGetLastError(comm);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      x.params = to_host(p, x.params.size(), stream);
      x.m = to_host(m, x.m.size(), stream);
      x.v = to_host(v, x.v.size(), stream);
      x.stats = to_host(st, x.stats.size(), stream);
      free_on(stream, {g, p, m, v, st});
      ZeroBuffers& h = cpu[static_cast<size_t>(r)];
      void* host_states[] = {h.params.data(), h.m.data(), h.v.data(), h.stats.data()};
      ASSERT_EQ(tuttiRunPlan(plan, h.grads.data(), nullptr, shard, ncclFloat32, ncclSum, host_states, 4, scalars.data(),
                             static_cast<int>(scalars.size()), comm, nullptr),
                ncclSuccess)
          << ncclGetLastError(comm);
      EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < n; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const ZeroBuffers &d = gpu[static_cast<size_t>(r)], &c = cpu[static_cast<size_t>(r)];
    EXPECT_EQ(std::memcmp(d.stats.data(), c.stats.data(), c.stats.size() * sizeof(float)), 0);
    expect_close(d.params, c.params, "params");
    expect_close(d.m, c.m, "m");
    expect_close(d.v, c.v, "v");
  }
  EXPECT_EQ(tuttiPlanFree(plan), ncclSuccess);
}

}  // namespace
