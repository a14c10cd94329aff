// The fused ZeRO step's plan on a real GPU (the CUDA backend of the device executor), 2 and 4 ranks
// as threads sharing device 0, against the CPU executor on the same inputs. A GPU contracts
// multiplies and adds and rounds pow differently, so parameters and moments agree to a few ulps;
// the norm's sum of squares is exact (small integer gradients). Needs a GPU: without one the tests
// skip with a message (the build proves the CUDA code compiles; test_device_fused runs the same
// interpreter on the emulated device in CI).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "compiler/compile.hpp"
#include "runtime/cuda/cuda_reduce.hpp"
#include "runtime/device/device_executor.hpp"
#include "support/ranks.hpp"
#include "support/zero_data.hpp"
#include "tutti/fused.hpp"

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

void* to_device(const std::vector<float>& h) {
  void* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, h.size() * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

std::vector<float> to_host(void* d, size_t n) {
  std::vector<float> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
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
      DeviceExecutor ex(c, make_cuda_backend(0), DeviceOptions::from_env());
      void *g = to_device(h.grads), *p = to_device(h.params), *m = to_device(h.m), *v = to_device(h.v),
           *s = to_device(h.stats);
      ex.run(*plan, args_of(static_cast<float*>(g), static_cast<float*>(p), static_cast<float*>(m),
                            static_cast<float*>(v), static_cast<float*>(s), shard, opt));
      ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
      ex.check();
      ZeroBuffers& out = gpu[static_cast<size_t>(r)];
      out.params = to_host(p, h.params.size());
      out.m = to_host(m, h.m.size());
      out.v = to_host(v, h.v.size());
      out.stats = to_host(s, h.stats.size());
      ex.close();
      for (void* d : {g, p, m, v, s}) cudaFree(d);
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

}  // namespace
