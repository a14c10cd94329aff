// tutti-demo: what tutti is for, end to end. A collective schedule written in the DSL (a ring
// all-reduce in a dozen lines), proved correct and deadlock-free by the compiler, saved as a plan,
// and run through the NCCL API on every rank, with nccl-tests' line per size and every element of
// every result checked.
//
//   tutti-run -n 4 tutti-demo      one rank per process (what `make demo` runs)
//   tutti-demo [N]                 N ranks as threads of this process (default 4)
//
// The plan reaches the library the way a user's would: written to a directory named by
// TUTTI_PLAN_DIR and chosen with TUTTI_ALGO (both set here unless already set).

#include <nccl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "compiler/compile.hpp"
#include "compiler/plan_file.hpp"
#include "core/error.hpp"
#include "tutti/dsl.hpp"

namespace {

constexpr const char* kPlanName = "demo_ring_allreduce";

// The schedule: chunk k starts at rank k, is reduced by every rank along the ring, and the finished
// sum travels the ring once more so every rank ends with it.
tutti::dsl::Program ring_allreduce(int n) {
  using tutti::dsl::Buffer;
  tutti::CollectiveSpec spec;
  spec.kind = tutti::Collective::kAllReduce;
  spec.nranks = n;
  spec.chunk_factor = n;  // one chunk per rank
  tutti::dsl::Program p(kPlanName, spec);
  for (int r = 0; r < n; ++r)
    for (int k = 0; k < n; ++k) p.chunk(r, Buffer::input(), k).copy(r, Buffer::output(), k);
  for (int k = 0; k < n; ++k) {
    auto c = p.chunk(k, Buffer::output(), k);
    for (int step = 1; step < n; ++step) c = p.chunk((k + step) % n, Buffer::output(), k).reduce(c);
    for (int step = 0; step < n - 1; ++step) c = c.copy((k + step) % n, Buffer::output(), k);
  }
  return p;
}

// Compiles and verifies the schedule, writes it where the library looks for plans, and says what the
// verifier proved. Every process does this itself (it is deterministic).
std::string prepare_plan(int n, bool speak) {
  tutti::plan::Compiled c = tutti::plan::compile(ring_allreduce(n));
  char dir[] = "/tmp/tutti-demo-XXXXXX";
  if (!mkdtemp(dir)) throw tutti::SystemError("tutti-demo: cannot make a temporary directory", errno);
  tutti::plan::save_file(c.plan, std::string(dir) + "/" + kPlanName + ".json");
  setenv("TUTTI_PLAN_DIR", dir, 0);
  setenv("TUTTI_ALGO", kPlanName, 0);
  if (speak) {
    std::printf("# DSL program '%s' for %d ranks: %lld steps in %lld blocks after fusion (%lld before)\n", kPlanName, n,
                static_cast<long long>(c.plan.steps()), static_cast<long long>(c.plan.blocks()),
                static_cast<long long>(c.steps_before_fusion));
    std::printf("# %s\n# plan written to %s, used through TUTTI_PLAN_DIR and TUTTI_ALGO=%s\n#\n",
                c.report.summary(c.plan).c_str(), dir, std::getenv("TUTTI_ALGO"));
  }
  return dir;
}

// nccl-tests' data: small integers, so every order of summation is exact in float.
float value(int rank, size_t i) { return static_cast<float>((rank + 1) * (1 + static_cast<int>(i % 7))); }

// Runs the sweep on one rank; rank 0 prints the table. Returns the number of wrong elements.
long run_rank(ncclComm_t comm, int rank, int n) {
  if (rank == 0) {
    std::printf("#       size         count      type   redop     time   algbw   busbw  #wrong\n");
    std::printf("#        (B)    (elements)                       (us)  (GB/s)  (GB/s)\n");
  }
  long wrong_total = 0;
  for (size_t bytes = 8; bytes <= (16u << 20); bytes *= 8) {
    const size_t count = bytes / sizeof(float);
    std::vector<float> in(count), out(count);
    for (size_t i = 0; i < count; ++i) in[i] = value(rank, i);
    const int iters = bytes <= (64u << 10) ? 50 : 5;
    if (ncclAllReduce(in.data(), out.data(), count, ncclFloat, ncclSum, comm, nullptr) != ncclSuccess)
      throw tutti::InternalError(std::string("ncclAllReduce failed: ") + ncclGetLastError(comm));
    auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < iters; ++k) ncclAllReduce(in.data(), out.data(), count, ncclFloat, ncclSum, comm, nullptr);
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
    long wrong = 0;
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int r = 0; r < n; ++r) want += value(r, i);
      wrong += out[i] != want;
    }
    wrong_total += wrong;
    if (rank == 0) {
      const double algbw = bytes / us / 1e3, busbw = algbw * 2.0 * (n - 1) / n;
      std::printf("%12zu  %12zu     float     sum %8.2f %7.2f %7.2f  %6ld\n", bytes, count, us, algbw, busbw, wrong);
      std::fflush(stdout);
    }
  }
  return wrong_total;
}

int finish(long wrong, int n, const std::string& dir) {
  std::filesystem::remove_all(dir);
  std::printf("# %d rank(s): %s\n", n, wrong == 0 ? "every element of every result is exact (0 wrong)" : "WRONG RESULTS");
  return wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const char* env_rank = std::getenv("TUTTI_RANK");
    if (env_rank && std::getenv("TUTTI_SIZE")) {  // one rank per process, under tutti-run
      const int rank = std::atoi(env_rank), n = std::atoi(std::getenv("TUTTI_SIZE"));
      const std::string dir = prepare_plan(n, rank == 0);
      ncclUniqueId id;
      ncclComm_t comm;
      if (ncclGetUniqueId(&id) != ncclSuccess || ncclCommInitRank(&comm, n, id, rank) != ncclSuccess) {
        std::fprintf(stderr, "tutti-demo: rank %d: %s\n", rank, ncclGetLastError(nullptr));
        return 1;
      }
      long wrong = run_rank(comm, rank, n);
      ncclCommDestroy(comm);
      if (rank != 0) {
        std::filesystem::remove_all(dir);
        return wrong == 0 ? 0 : 1;
      }
      return finish(wrong, n, dir);
    }
    const int n = argc > 1 ? std::atoi(argv[1]) : 4;
    if (n < 1) {
      std::fprintf(stderr, "usage: tutti-demo [ranks]   (or under tutti-run -n N)\n");
      return 2;
    }
    std::printf("# tutti-demo: %d ranks as threads of pid %d\n", n, getpid());
    const std::string dir = prepare_plan(n, true);
    std::vector<ncclComm_t> comms(n);
    if (ncclCommInitAll(comms.data(), n, nullptr) != ncclSuccess) {
      std::fprintf(stderr, "tutti-demo: %s\n", ncclGetLastError(nullptr));
      return 1;
    }
    std::vector<long> wrong(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        try {
          wrong[r] = run_rank(comms[r], r, n);
        } catch (const tutti::Error& e) {
          std::fprintf(stderr, "tutti-demo: rank %d: %s\n", r, e.what());
          wrong[r] = 1;
        }
      });
    for (auto& t : threads) t.join();
    for (auto c : comms) ncclCommDestroy(c);
    long total = 0;
    for (long w : wrong) total += w;
    return finish(total, n, dir);
  } catch (const tutti::Error& e) {
    std::fprintf(stderr, "tutti-demo: %s\n", e.what());
    return 1;
  }
}
