// tutti-fused-device-bench: the fused ZeRO step on device buffers against its unfused form, ranks
// as threads sharing device 0 (issue 20's GPU comparison), through the NCCL API.
//
//   fused:   tuttiRunPlan of zero_step_program (reduce-scatter, unscale + sum of squares, the
//            norm's exchange, clipped AdamW and the all-gather, pipelined in one plan)
//   unfused: ncclReduceScatter in place; a grid-wide unscale + sum of squares; ncclAllReduce of the
//            sums; a grid-wide clipped AdamW; ncclAllGather in place (the library's one-pass
//            kernels: only the collectives and the pipelining are unfused)
//
// Both from the same inputs each iteration; prints median times and fused/unfused. --check runs one
// step of each and compares parameters and moments (to rounding: the two add the norm's partial
// sums in different orders). With TUTTI_DEVICE=emulated the buffers are host memory and the
// unfused passes run on the host (a functional check in CI, not a timing).
//
//   tutti-fused-device-bench [--ranks N] [--mib M] [--iters I] [--warmup W] [--check]
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "collectives/include/nccl.h"
#include "collectives/include/tutti_nccl.h"
#include "tools/bench/zero_unfused_kernels.hpp"
#include "tutti/fused.hpp"
#include "tutti/plan.hpp"

namespace {

bool g_cuda = true;

void cuda_ok(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) throw std::runtime_error(fmt::format("{}: {}", what, cudaGetErrorString(rc)));
}
void nccl_ok(ncclResult_t rc, const char* what) {
  if (rc != ncclSuccess) throw std::runtime_error(fmt::format("{}: {}", what, ncclGetLastError(nullptr)));
}

// A float buffer in device memory (host memory on the emulated device).
struct Buffer {
  float* p = nullptr;
  size_t n = 0;
  explicit Buffer(size_t count) : n(count) {
    if (g_cuda) cuda_ok(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(n, 1) * sizeof(float)), "cudaMalloc");
    else p = static_cast<float*>(std::calloc(std::max<size_t>(n, 1), sizeof(float)));
  }
  ~Buffer() { g_cuda ? (void)cudaFree(p) : std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void set(const std::vector<float>& h, cudaStream_t s) {
    if (g_cuda) cuda_ok(cudaMemcpyAsync(p, h.data(), n * sizeof(float), cudaMemcpyHostToDevice, s), "upload");
    else std::memcpy(p, h.data(), n * sizeof(float));
  }
  std::vector<float> get() const {
    std::vector<float> h(n);
    if (g_cuda) cuda_ok(cudaMemcpy(h.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost), "download");
    else std::memcpy(h.data(), p, n * sizeof(float));
    return h;
  }
};

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tutti-fused-device-bench: the fused ZeRO step on device buffers against its unfused form"};
  int ranks = 2, iters = 10, warmup = 2;
  double mib = 64;
  bool check = false;
  app.add_option("--ranks", ranks, "ranks, as threads sharing device 0")->check(CLI::Range(1, 64));
  app.add_option("--mib", mib, "gradient bytes over all ranks, MiB (float32)")->check(CLI::PositiveNumber);
  app.add_option("--iters", iters, "timed steps of each form")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed steps of each form first")->check(CLI::NonNegativeNumber);
  app.add_flag("--check", check, "one step of each form, compared (exit 1 if they differ beyond rounding)");
  CLI11_PARSE(app, argc, argv);
  const char* mode = std::getenv("TUTTI_DEVICE");
  g_cuda = !(mode && std::string(mode) == "emulated");
  int devices = 0;
  if (g_cuda && (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)) {
    std::fprintf(stderr, "tutti-fused-device-bench: no CUDA device (TUTTI_DEVICE=emulated runs it on the host)\n");
    return 2;
  }
  try {
    tutti::fused::register_kernels();
    const int n = ranks;
    int64_t shard = static_cast<int64_t>(mib * (1 << 20) / sizeof(float)) / n;
    shard -= shard % 4096;
    const int pieces = static_cast<int>(std::max<int64_t>(1, shard / 65536));  // 256 KiB pieces, as ZeroStep's
    shard -= shard % pieces;
    tuttiPlan_t plan = nullptr;
    nccl_ok(tuttiPlanParse(tutti::compile_plan(tutti::fused::zero_step_program(n, pieces)).json().c_str(), &plan),
            "tuttiPlanParse");
    tutti::fused::AdamW opt;
    opt.lr = 1e-4f;
    opt.max_norm = 1.0f;
    std::vector<ncclComm_t> comms(static_cast<size_t>(n));
    std::vector<int> devlist(static_cast<size_t>(n), 0);
    nccl_ok(ncclCommInitAll(comms.data(), n, devlist.data()), "ncclCommInitAll");
    std::barrier sync(n);
    std::vector<double> fused_s, unfused_s;
    std::vector<std::string> errors(static_cast<size_t>(n));
    std::atomic<int> mismatches{0};
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        try {
          if (g_cuda) cuda_ok(cudaSetDevice(0), "cudaSetDevice");
          cudaStream_t stream = nullptr;
          if (g_cuda) cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate");
          ncclComm_t comm = comms[static_cast<size_t>(r)];
          const size_t all = static_cast<size_t>(n * shard), mine = static_cast<size_t>(shard);
          Buffer grads(all), params(all), m(mine), v(mine), stats(static_cast<size_t>(n + 1)), total(1), scratch(
              static_cast<size_t>(tutti::bench::unscale_scratch_bytes() / sizeof(float)));
          std::vector<float> g0(all), p0(all), zeros(mine, 0.0f);
          for (size_t i = 0; i < all; ++i) {
            g0[i] = static_cast<float>(static_cast<int>((i * 7 + static_cast<size_t>(r)) % 17) - 8);
            p0[i] = static_cast<float>(i % 13) * 0.01f;
          }
          auto reset = [&] {
            grads.set(g0, stream);
            params.set(p0, stream);
            m.set(zeros, stream);
            v.set(zeros, stream);
          };
          auto sync_stream = [&] {
            if (g_cuda) cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
          };
          int64_t step = 0;
          tutti::fused::AdamW o = opt;  // this rank's (the step advances per call)
          auto fused = [&] {
            o.step = ++step;
            const std::vector<double> s = tutti::fused::zero_step_scalars(o);
            void* states[] = {params.p, m.p, v.p, stats.p};
            nccl_ok(tuttiRunPlan(plan, grads.p, nullptr, mine, ncclFloat32, ncclSum, states, 4, s.data(),
                                 static_cast<int>(s.size()), comm, stream),
                    "tuttiRunPlan");
          };
          auto unfused = [&] {
            o.step = ++step;
            const std::vector<double> s = tutti::fused::zero_step_scalars(o);  // grad_scale, lr, ..., max_norm
            float* my_grads = grads.p + r * shard;
            float* my_params = params.p + r * shard;
            nccl_ok(ncclReduceScatter(grads.p, my_grads, mine, ncclFloat32, ncclSum, comm, stream), "ncclReduceScatter");
            tutti::bench::unscale_sumsq(my_grads, shard, static_cast<float>(s[0]), total.p, scratch.p, stream, g_cuda);
            nccl_ok(ncclAllReduce(total.p, total.p, 1, ncclFloat32, ncclSum, comm, stream), "ncclAllReduce");
            tutti::bench::adamw(my_grads, m.p, v.p, my_params, shard, total.p, s.data() + 1, stream, g_cuda);
            nccl_ok(ncclAllGather(my_params, params.p, mine, ncclFloat32, comm, stream), "ncclAllGather");
          };
          auto timed = [&](auto&& form) {
            reset();
            sync_stream();
            sync.arrive_and_wait();
            const double t0 = now();
            form();
            sync_stream();
            sync.arrive_and_wait();
            return now() - t0;
          };
          if (check) {
            step = 0;
            reset();
            fused();
            sync_stream();
            const auto fp = params.get(), fm = m.get(), fv = v.get();
            step = 0;
            reset();
            unfused();
            sync_stream();
            const auto up = params.get(), um = m.get(), uv = v.get();
            int bad = 0;
            auto cmp = [&](const std::vector<float>& a, const std::vector<float>& b, const char* what) {
              for (size_t i = 0; i < a.size() && bad < 5; ++i)
                if (!(std::fabs(a[i] - b[i]) <= 1e-5f * std::fabs(b[i]) + 1e-6f)) {
                  std::fprintf(stderr, "rank %d: %s[%zu]: fused %g, unfused %g\n", r, what, i, a[i], b[i]);
                  ++bad;
                }
            };
            cmp(fp, up, "params");
            cmp(fm, um, "m");
            cmp(fv, uv, "v");
            if (fp == p0) std::fprintf(stderr, "rank %d: the step left the parameters as they were\n", r), ++bad;
            sync.arrive_and_wait();
            mismatches += bad;
          } else {
            for (int it = 0; it < warmup + iters; ++it) {
              const double tf = timed(fused), tu = timed(unfused);
              if (r == 0 && it >= warmup) fused_s.push_back(tf), unfused_s.push_back(tu);
            }
          }
          if (g_cuda) cudaStreamDestroy(stream);
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(r)] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    for (ncclComm_t c : comms) ncclCommDestroy(c);
    tuttiPlanFree(plan);
    for (int r = 0; r < n; ++r)
      if (!errors[static_cast<size_t>(r)].empty()) throw std::runtime_error(fmt::format("rank {}: {}", r, errors[static_cast<size_t>(r)]));
    const char* where = g_cuda ? "device 0" : "the emulated device";
    if (check) {
      std::printf("tutti-fused-device-bench --check: %d ranks on %s, %lld per shard, %d pieces: %s\n", n, where,
                  static_cast<long long>(shard), pieces, mismatches.load() ? "fused and unfused DIFFER" : "fused == unfused to rounding");
      return mismatches.load() ? 1 : 0;
    }
    const double f = median(fused_s), u = median(unfused_s);
    std::printf("# ZeRO step, %d ranks as threads on %s, %.1f MiB of float32 gradients, %d pieces of %lld\n", n, where,
                static_cast<double>(n * shard * 4) / (1 << 20), pieces, static_cast<long long>(shard / pieces));
    std::printf("%-6s %10s %12s %8s\n", "op", "fused_ms", "unfused_ms", "ratio");
    std::printf("%-6s %10.3f %12.3f %8.2f\n", "zero", f * 1e3, u * 1e3, u / f);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tutti-fused-device-bench: %s\n", e.what());
    return 1;
  }
}
