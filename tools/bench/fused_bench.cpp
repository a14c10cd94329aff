// tutti-fused-bench: each fused operation against its unfused reference, in the same run, on the
// ranks tutti-run starts (processes, host memory). Prints, per size, the time of each and the
// ratio unfused / fused (> 1: the fused plan is faster), and the simulator's prediction for the
// fused plan beside the measurement.
//
//   tutti-run -n 2 tutti-fused-bench --op zero --mib 64
//   tutti-run -n 2 tutti-fused-bench --op epilogue --rows 8192 --hidden 768 [--sp] [--ln]
//   OPENBLAS_NUM_THREADS=1 tutti-run -n 2 tutti-fused-bench --op gemm_rs --rows 2048 --k 3072 --n 768
//   OPENBLAS_NUM_THREADS=1 tutti-run -n 2 tutti-fused-bench --op ag_gemm --rows 2048 --k 768 --n 3072
//   tutti-run -n 2 tutti-fused-bench --op moe --rows 4096 --hidden 768     (dispatch + combine)
// The GEMM overlaps also print how much of the collective's own time the fused run hid: (GEMM alone
// + collective alone - fused) / collective alone.
//
// Times are the median over --iters runs of the slowest rank (each run starts after a barrier).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <span>
#include <functional>
#include <string>
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

// A float buffer in plain memory or, with --shared, in tutti::alloc_shared memory that the peers
// read in place (ncclMemAlloc's).
struct Floats {
  std::vector<float> plain;
  float* shared = nullptr;
  size_t n = 0;
  Floats(size_t count, bool in_shared) : n(count) {
    if (in_shared) shared = static_cast<float*>(tutti::alloc_shared(count * sizeof(float)));
    else plain.resize(count);
  }
  Floats(const Floats&) = delete;
  Floats& operator=(const Floats&) = delete;
  ~Floats() {
    if (shared) tutti::free_shared(shared);
  }
  float* data() { return shared ? shared : plain.data(); }
  size_t size() const { return n; }
  float& operator[](size_t i) { return data()[i]; }
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;  // --check times nothing
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tutti-fused-bench: fused operations against their unfused references"};
  std::string op = "zero";
  double mib = 64;
  int iters = 5, warmup = 1, pieces = 0;
  int64_t rows = 8192, hidden = 768;
  bool sp = false, ln = false;
  app.add_option("--op", op, "operation: zero (the ZeRO optimizer step), epilogue (all-reduce -> bias + dropout + residual)")
      ->check(CLI::IsMember({"zero", "epilogue", "gemm_rs", "ag_gemm", "moe"}));
  int64_t gk = 3072, gn = 768;
  app.add_option("--k", gk, "gemm_rs / ag_gemm: the GEMM's inner size (this rank's slice for gemm_rs)");
  app.add_option("--n", gn, "gemm_rs / ag_gemm: the GEMM's columns (this rank's slice for ag_gemm)");
  app.add_option("--rows", rows, "epilogue: rows (tokens: batch x sequence)");
  app.add_option("--hidden", hidden, "epilogue: hidden size");
  app.add_flag("--sp", sp, "epilogue: the sequence-parallel form (reduce-scatter)");
  app.add_flag("--ln", ln, "epilogue: with LayerNorm");
  app.add_option("--mib", mib, "gradient bytes over all ranks, MiB (the ZeRO step: float32 gradients)");
  app.add_option("--iters", iters, "timed runs of each")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed runs of each first");
  bool shared = false, check = false, bf16 = false;
  app.add_flag("--bf16", bf16, "zero: mixed precision (fp32 master shard, bf16 parameters all-gathered)");
  app.add_flag("--check", check,
               "run each form once from the same inputs and state, compare the results bit for bit, exit 1 if they "
               "differ (a test: the ranks are processes)");
  app.add_flag("--shared", shared, "zero: gradients and parameters in tutti::alloc_shared memory (read in place by peers)");
  app.add_option("--pieces", pieces, "chunks per shard in the fused pipeline (0: about 256 KiB each)");
  CLI11_PARSE(app, argc, argv);

  try {
    tutti::Comm comm = tutti::Comm::from_env();
    const int n = comm.size(), q = comm.rank();
    std::vector<double> fused, unfused;
    std::string what;      // the case, for the header line
    double predicted = 0;  // the simulator's time for the fused plan, us
    int used = 0;          // pieces
    std::string extra;     // a line more (GEMM overlaps)
    std::function<double(double)> hidden_of;
    // Runs both forms `warmup + iters` times, alternating; `prepare` restores the inputs first.
    // With --check: the op's results and mutable state, restored between the two forms.
    std::vector<std::span<float>> state;
    int mismatches = 0;
    auto measure = [&](const std::function<void()>& prepare, const std::function<void()>& run_fused,
                       const std::function<void()>& run_unfused) {
      if (check) {
        auto snapshot = [&] {
          std::vector<std::vector<float>> v;
          for (auto s : state) v.emplace_back(s.begin(), s.end());
          return v;
        };
        auto restore = [&](const std::vector<std::vector<float>>& v) {
          for (size_t b = 0; b < state.size(); ++b) std::copy(v[b].begin(), v[b].end(), state[b].begin());
        };
        prepare();
        const auto before = snapshot();
        run_fused();
        const auto fused_result = snapshot();
        prepare();
        restore(before);
        run_unfused();
        const auto unfused_result = snapshot();
        for (size_t b = 0; b < state.size(); ++b) {
          const auto& x = fused_result[b];
          const auto& y = unfused_result[b];
          if (std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0) continue;
          size_t i = 0;
          while (std::memcmp(&x[i], &y[i], sizeof(float)) == 0) ++i;
          std::fprintf(stderr, "tutti-fused-bench --check: rank %d, %s, buffer %zu: fused and unfused differ at %zu (%g vs %g)\n",
                       q, op.c_str(), b, i, static_cast<double>(x[i]), static_cast<double>(y[i]));
          ++mismatches;
        }
        return;
      }
      for (int it = 0; it < warmup + iters; ++it) {
        prepare();
        const double tf = timed(comm, run_fused);
        prepare();
        const double tu = timed(comm, run_unfused);
        if (it >= warmup) fused.push_back(tf), unfused.push_back(tu);
      }
    };
    if (op == "zero") {
      int64_t shard = static_cast<int64_t>(mib * (1 << 20) / sizeof(float)) / n;
      shard -= shard % 1024;  // pieces of whole cache lines
      tutti::fused::ZeroStep step(comm, shard, pieces);
      Floats grads(static_cast<size_t>(n * shard), shared), params(grads.size(), shared);
      std::vector<float> m(static_cast<size_t>(shard)), v(m.size());
      for (size_t i = 0; i < params.size(); ++i) params[i] = static_cast<float>(i % 13) * 0.01f;
      tutti::fused::AdamW opt;
      opt.lr = 1e-4f;
      opt.max_norm = 1.0f;
      opt.step = 0;
      auto prepare = [&] {
        if (!check || opt.step == 0) ++opt.step;  // --check: both forms take the same step
        for (size_t i = 0; i < grads.size(); ++i) grads[i] = static_cast<float>((i * 7 + static_cast<size_t>(q)) % 17) - 8;
      };
      // --check: the optimizer's state (the gradients afterwards differ: PyTorch's order clips them in place).
      state = {std::span<float>(params.data(), params.size()), std::span<float>(m), std::span<float>(v)};
      // --bf16: the fp32 master is this rank's shard; the bf16 parameters fill the first half of params.
      std::vector<float> master(static_cast<size_t>(shard), 0.5f);
      auto* params16 = reinterpret_cast<uint16_t*>(params.data());
      if (bf16)
        state = {std::span<float>(params.data(), params.size() / 2), std::span<float>(master), std::span<float>(m),
                 std::span<float>(v)};
      if (bf16)
        measure(prepare, [&] { step.run_bf16(grads.data(), master.data(), m.data(), v.data(), params16, opt).wait(); },
                [&] { step.run_bf16_unfused(grads.data(), master.data(), m.data(), v.data(), params16, opt); });
      else
        measure(prepare, [&] { step.run(grads.data(), params.data(), m.data(), v.data(), opt).wait(); },
                [&] { step.run_unfused(grads.data(), params.data(), m.data(), v.data(), opt); });
      // The stronger reference too: the library's one-pass kernels, only the collectives unfused.
      std::vector<double> one_pass;
      for (int it = 0; it < (check || bf16 ? 0 : warmup + iters); ++it) {
        prepare();
        const double t = timed(comm, [&] {
          step.run_unfused(grads.data(), params.data(), m.data(), v.data(), opt,
                           tutti::fused::ZeroStep::Unfused::kOnePass);
        });
        if (it >= warmup) one_pass.push_back(t);
      }
      extra = fmt::format("  unfused with one-pass kernels (kOnePass) {:.2f} ms: ratio {:.2f}", median(one_pass) * 1e3,
                          0.0);
      if (!check && !bf16) hidden_of = [op = median(one_pass)](double fused_s) { return op / fused_s; };
      predicted = tutti::predict_plan_us(comm, step.plan(), static_cast<size_t>(shard), tutti::DataType::kFloat32);
      what = fmt::format("{} ranks, {:.1f} MiB of float32 gradients, {} per shard, {} pieces, clipping{}{}; unfused as "
                         "PyTorch runs it (kTorch)", n,
                         static_cast<double>(n * shard * 4) / (1 << 20), shard, step.pieces(),
                         shared ? ", shared buffers" : "", bf16 ? ", bf16 parameters (cast, then all-gather)" : "");
    } else if (op == "gemm_rs" || op == "ag_gemm") {
      const bool rs = op == "gemm_rs";
      const int64_t per = rows / n;
      std::vector<float> x(static_cast<size_t>((rs ? rows : per) * gk), 0.5f), w(static_cast<size_t>(gk * gn), 0.25f),
          out(static_cast<size_t>(rs ? per * gn : rows * gn)), gathered(rs ? 0 : static_cast<size_t>(rows * gk)),
          product(static_cast<size_t>(rows * gn));
      std::vector<double> gemm_alone, comm_alone;
      auto nothing = [] {};
      state = {std::span<float>(out)};
      if (!rs) state.push_back(std::span<float>(gathered));
      if (rs) {
        tutti::fused::GemmReduceScatter g(comm, rows, gk, gn, pieces);
        measure(nothing, [&] { g.run(x.data(), w.data(), out.data()).wait(); },
                [&] { g.run_unfused(x.data(), w.data(), out.data()); });
        predicted = tutti::predict_plan_us(comm, g.plan(), static_cast<size_t>(per * gn), tutti::DataType::kFloat32);
        used = g.pieces();
      } else {
        tutti::fused::AllGatherGemm g(comm, rows, gk, gn, pieces);
        measure(nothing, [&] { g.run(x.data(), w.data(), gathered.data(), out.data()).wait(); },
                [&] { g.run_unfused(x.data(), w.data(), gathered.data(), out.data()); });
        predicted = tutti::predict_plan_us(comm, g.plan(), static_cast<size_t>(per * gk), tutti::DataType::kFloat32);
        used = g.pieces();
      }
      // The two halves alone: the whole GEMM of the unfused form, and its collective.
      for (int it = 0; it < (check ? 0 : warmup + iters); ++it) {
        const double tg = timed(comm, [&] {
          tutti::fused::gemm(rs ? x.data() : gathered.data(), w.data(), rs ? product.data() : out.data(), rows, gk, gn);
        });
        const double tc = timed(comm, [&] {
          if (rs)
            comm.reduce_scatter(product.data(), out.data(), static_cast<size_t>(per * gn), tutti::DataType::kFloat32,
                                tutti::RedOp::kSum).wait();
          else
            comm.all_gather(x.data(), gathered.data(), static_cast<size_t>(per * gk), tutti::DataType::kFloat32).wait();
        });
        if (it >= warmup) gemm_alone.push_back(tg), comm_alone.push_back(tc);
      }
      extra = fmt::format("  gemm alone {:.2f} ms, {} alone {:.2f} ms, hidden {:.0f}% of it", median(gemm_alone) * 1e3,
                          rs ? "reduce_scatter" : "all_gather", median(comm_alone) * 1e3, 0.0);
      if (!check)
        hidden_of = [gemm = median(gemm_alone), coll = median(comm_alone)](double fused_s) {
          return std::clamp((gemm + coll - fused_s) / coll, 0.0, 1.0);
        };
      what = fmt::format("{} ranks, GEMM {} x {} by {} x {} float32 per rank, {} pieces", n, rows, gk, gk, gn, used);
    } else if (op == "moe") {
      // Top-1 routing, token t of rank q to rank (t * 7 + q) % n, capacity 1.25 x the even share.
      const int64_t capacity = rows / n + rows / n / 4;
      tutti::fused::MoeExchange moe(comm, rows, hidden, capacity);
      std::vector<float> x(static_cast<size_t>(rows * hidden), 1.0f), y(x.size()),
          expert(static_cast<size_t>(n * capacity * hidden)), gate(static_cast<size_t>(n * capacity), 0.5f);
      std::vector<int32_t> index(static_cast<size_t>(n * capacity), -1);
      std::vector<int64_t> used(static_cast<size_t>(n), 0);
      for (int64_t t = 0; t < rows; ++t) {
        const int d = static_cast<int>((t * 7 + q) % n);
        if (used[static_cast<size_t>(d)] < capacity) index[static_cast<size_t>(d * capacity + used[static_cast<size_t>(d)]++)] = static_cast<int32_t>(t);
      }
      state = {std::span<float>(expert), std::span<float>(y)};
      measure([] {},
              [&] {
                moe.dispatch(x.data(), index.data(), expert.data()).wait();
                moe.combine(expert.data(), gate.data(), index.data(), y.data()).wait();
              },
              [&] {
                moe.dispatch_unfused(x.data(), index.data(), expert.data());
                moe.combine_unfused(expert.data(), gate.data(), index.data(), y.data());
              });
      const size_t count = static_cast<size_t>(n * capacity * hidden);
      predicted = tutti::predict_plan_us(comm, moe.dispatch_plan(), count, tutti::DataType::kFloat32) +
                  tutti::predict_plan_us(comm, moe.combine_plan(), count, tutti::DataType::kFloat32);
      what = fmt::format("{} ranks, {} tokens x {} float32 per rank, capacity {} per destination, dispatch + combine", n,
                         rows, hidden, capacity);
    } else {
      tutti::fused::EpilogueOptions o;
      o.dropout = 0.1f;
      o.sequence_parallel = sp;
      o.layer_norm = ln;
      tutti::fused::BiasDropoutResidual epi(comm, rows, hidden, o, pieces);
      const int64_t total = rows * hidden, mine = sp ? total / n : total;
      std::vector<float> partial(static_cast<size_t>(total)), bias(static_cast<size_t>(hidden), 0.5f), gamma(bias),
          beta(bias), residual(static_cast<size_t>(mine), 1.0f), out(residual.size()), lnv(ln ? residual.size() : 0);
      state = {std::span<float>(out)};
      if (ln) state.push_back(std::span<float>(lnv));
      measure(
          [&] {
            if (!check || o.seed == 0) ++o.seed;
            for (size_t i = 0; i < partial.size(); ++i) partial[i] = static_cast<float>((i + static_cast<size_t>(q)) % 9);
          },
          [&] { epi.run(partial.data(), bias.data(), residual.data(), out.data(), gamma.data(), beta.data(), lnv.data()).wait(); },
          [&] { epi.run_unfused(partial.data(), bias.data(), residual.data(), out.data(), gamma.data(), beta.data(), lnv.data()); });
      predicted = tutti::predict_plan_us(comm, epi.plan(), static_cast<size_t>(total), tutti::DataType::kFloat32);
      what = fmt::format("{} ranks, {} x {} float32 activations ({:.1f} MiB), {}{}, dropout 0.1, {} pieces", n, rows, hidden,
                         static_cast<double>(total * 4) / (1 << 20), sp ? "reduce-scatter" : "all-reduce",
                         ln ? " + LayerNorm" : "", epi.pieces());
    }
    if (check) {
      if (q == 0 && mismatches == 0) std::printf("tutti-fused-bench --check %s: fused == unfused bit for bit on rank 0\n", op.c_str());
      return mismatches == 0 ? 0 : 1;
    }
    if (q == 0) {
      const double f = median(fused), u = median(unfused);
      std::printf("# tutti-fused-bench --op %s: %s\n", op.c_str(), what.c_str());
      std::printf("%-10s %12s %12s %8s %14s\n", "op", "fused_ms", "unfused_ms", "ratio", "predicted_ms");
      std::printf("%-10s %12.2f %12.2f %8.2f %14.2f\n", op.c_str(), f * 1e3, u * 1e3, u / f, predicted / 1e3);
      if (hidden_of) {  // the figure that needs the fused time
        const size_t at = extra.find("hidden 0%");
        if (at != std::string::npos) extra.replace(at, 9, fmt::format("hidden {:.0f}%", hidden_of(f) * 100));
        else extra.replace(extra.find("ratio 0.00"), 10, fmt::format("ratio {:.2f}", hidden_of(f)));
        std::printf("%s\n", extra.c_str());
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tutti-fused-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
