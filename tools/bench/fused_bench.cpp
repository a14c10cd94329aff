// tutti-fused-bench: each fused operation against its unfused reference, in the same run, on the
// ranks tutti-run starts (processes, host memory). Prints, per size, the time of each and the
// ratio unfused / fused (> 1: the fused plan is faster), and the simulator's prediction for the
// fused plan beside the measurement.
//
//   tutti-run -n 2 tutti-fused-bench --op zero --mib 64
//
// Times are the median over --iters runs of the slowest rank (each run starts after a barrier).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "tutti/fused.hpp"
#include "tutti/tutti.hpp"

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The slowest rank's time of f, after a barrier (a one-element all-reduce).
double timed(tutti::Comm& comm, const std::function<void()>& f) {
  float one = 1, sum = 0;
  comm.all_reduce(&one, &sum, 1, tutti::DataType::kFloat32, tutti::RedOp::kSum).wait();
  const double t0 = now_s();
  f();
  double dt = now_s() - t0, slowest = 0;
  comm.all_reduce(&dt, &slowest, 1, tutti::DataType::kFloat64, tutti::RedOp::kMax).wait();
  return slowest;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tutti-fused-bench: fused operations against their unfused references"};
  std::string op = "zero";
  double mib = 64;
  int iters = 5, warmup = 1, pieces = 0;
  app.add_option("--op", op, "operation: zero (the ZeRO optimizer step)")->check(CLI::IsMember({"zero"}));
  app.add_option("--mib", mib, "gradient bytes over all ranks, MiB (the ZeRO step: float32 gradients)");
  app.add_option("--iters", iters, "timed runs of each")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed runs of each first");
  app.add_option("--pieces", pieces, "chunks per shard in the fused pipeline (0: about 256 KiB each)");
  CLI11_PARSE(app, argc, argv);

  try {
    tutti::Comm comm = tutti::Comm::from_env();
    const int n = comm.size(), q = comm.rank();
    int64_t shard = static_cast<int64_t>(mib * (1 << 20) / sizeof(float)) / n;
    shard -= shard % 1024;  // pieces of whole cache lines
    tutti::fused::ZeroStep step(comm, shard, pieces);
    std::vector<float> grads(static_cast<size_t>(n * shard)), params(grads.size()), m(static_cast<size_t>(shard)),
        v(m.size());
    auto fill = [&] {
      for (size_t i = 0; i < grads.size(); ++i) grads[i] = static_cast<float>((i * 7 + static_cast<size_t>(q)) % 17) - 8;
    };
    for (size_t i = 0; i < params.size(); ++i) params[i] = static_cast<float>(i % 13) * 0.01f;
    tutti::fused::AdamW opt;
    opt.lr = 1e-4f;
    opt.max_norm = 1.0f;
    std::vector<double> fused, unfused;
    for (int it = 0; it < warmup + iters; ++it) {
      opt.step = it + 1;
      fill();
      const double tf = timed(comm, [&] { step.run(grads.data(), params.data(), m.data(), v.data(), opt).wait(); });
      fill();
      const double tu = timed(comm, [&] { step.run_unfused(grads.data(), params.data(), m.data(), v.data(), opt); });
      if (it >= warmup) fused.push_back(tf), unfused.push_back(tu);
    }
    if (q == 0) {
      const double f = median(fused), u = median(unfused);
      const double predicted =
          tutti::predict_plan_us(comm, step.plan(), static_cast<size_t>(shard), tutti::DataType::kFloat32);
      std::printf("# tutti-fused-bench --op %s: %d ranks, %.1f MiB of float32 gradients, %lld per shard, %d pieces\n",
                  op.c_str(), n, static_cast<double>(n * shard * 4) / (1 << 20), static_cast<long long>(shard),
                  step.pieces());
      std::printf("%-10s %12s %12s %8s %14s\n", "op", "fused_ms", "unfused_ms", "ratio", "predicted_ms");
      std::printf("%-10s %12.2f %12.2f %8.2f %14.2f\n", op.c_str(), f * 1e3, u * 1e3, u / f, predicted / 1e3);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tutti-fused-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
