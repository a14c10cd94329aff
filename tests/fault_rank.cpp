// tutti-fault-rank: ranks that run a fixed sequence of all-reduces and report, per rank, whether
// every result was exact or which error ended them and how long after the faulty call began. The
// fault itself comes from TUTTI_FAULT (runtime/fault.hpp); tests/test_faults.cpp and
// tools/reliability/fault_trials.py run it.
//
//   tutti-fault-rank [--threads N] [--calls K] [--count C] [--fault-call F]
//
// Processes (under tests/support/spawn.hpp or tutti-run) read their rank from the environment;
// --threads N runs N ranks as threads of this process. Each rank prints exactly one line:
//   rank R: ok: K calls, every result exact
//   rank R: error in call N, S s after call F began: MESSAGE
//   rank R: WRONG result in call N at element J: got X, expected Y
// Exit status: 0 every rank ok, 3 every rank ended with an error and none saw wrong data,
// 1 otherwise (a wrong result, or some ranks ok and others failed).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/args.hpp"
#include "tutti/tutti.hpp"

namespace {

enum class Outcome { kOk, kError, kWrong };

struct Options {
  int threads = 0;
  int calls = 6;
  size_t count = 1 << 18;
  int fault_call = 3;
};

std::mutex g_print;

// Inputs are small integers, so every summation order gives the same float bits.
float input(int rank, int call, size_t j) { return static_cast<float>(rank + 1 + (j + static_cast<size_t>(call)) % 5); }
float expected(int n, int call, size_t j) {
  return static_cast<float>(n * (n + 1) / 2 + n * static_cast<int>((j + static_cast<size_t>(call)) % 5));
}

Outcome run_rank(tutti::Comm& comm, const Options& o, std::vector<float>& in, std::vector<float>& out) {
  using Clock = std::chrono::steady_clock;
  const int rank = comm.rank(), n = comm.size();
  Clock::time_point fault_began = Clock::now();
  for (int call = 1; call <= o.calls; ++call) {
    for (size_t j = 0; j < o.count; ++j) in[j] = input(rank, call, j);
    std::fill(out.begin(), out.end(), -1.0f);
    if (call == o.fault_call) fault_began = Clock::now();
    try {
      comm.all_reduce(in.data(), out.data(), o.count, tutti::DataType::kFloat32, tutti::RedOp::kSum).wait();
    } catch (const tutti::Error& e) {
      double s = std::chrono::duration<double>(Clock::now() - fault_began).count();
      std::lock_guard lock(g_print);
      std::printf("rank %d: error in call %d, %.4f s after call %d began: %s\n", rank, call, s, o.fault_call, e.what());
      return Outcome::kError;
    }
    for (size_t j = 0; j < o.count; ++j)
      if (const float want = expected(n, call, j); std::memcmp(&out[j], &want, sizeof(float)) != 0) {
        std::lock_guard lock(g_print);
        std::printf("rank %d: WRONG result in call %d at element %zu: got %g, expected %g\n", rank, call, j,
                    static_cast<double>(out[j]), static_cast<double>(expected(n, call, j)));
        return Outcome::kWrong;
      }
  }
  std::lock_guard lock(g_print);
  std::printf("rank %d: ok: %d calls, every result exact\n", rank, o.calls);
  return Outcome::kOk;
}

int status_of(const std::vector<Outcome>& outcomes) {
  bool all_ok = true, all_error = true;
  for (Outcome x : outcomes) {
    if (x == Outcome::kWrong) return 1;
    all_ok &= x == Outcome::kOk;
    all_error &= x == Outcome::kError;
  }
  return all_ok ? 0 : all_error ? 3 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (a != "--threads" && a != "--calls" && a != "--count" && a != "--fault-call") {
      std::fprintf(stderr, "tutti-fault-rank: unknown option %s\n", argv[i]);
      return 2;
    }
    auto v = tutti::test_support::whole_flag("tutti-fault-rank", a.c_str(), i + 1 < argc ? argv[i + 1] : nullptr,
                                             a == "--threads" ? 0 : 1);
    if (!v) return 2;
    if (a == "--threads") o.threads = static_cast<int>(*v);
    else if (a == "--calls") o.calls = static_cast<int>(*v);
    else if (a == "--count") o.count = static_cast<size_t>(*v);
    else o.fault_call = static_cast<int>(*v);
  }
  try {
    if (o.threads == 0) {
      tutti::Comm comm = tutti::Comm::from_env();
      std::vector<float> in(o.count), out(o.count);
      int status = status_of({run_rank(comm, o, in, out)});
      std::fflush(stdout);
      return status;
    }
    std::vector<tutti::Comm> comms = tutti::Comm::create_local(o.threads);
    // Every rank's buffers outlive every rank's calls: a peer may read them by reference.
    std::vector<std::vector<float>> ins(o.threads, std::vector<float>(o.count)), outs = ins;
    std::vector<Outcome> outcomes(o.threads);
    std::vector<std::thread> threads;
    for (int r = 0; r < o.threads; ++r)
      threads.emplace_back([&, r] { outcomes[r] = run_rank(comms[r], o, ins[r], outs[r]); });
    for (auto& t : threads) t.join();
    int status = status_of(outcomes);
    std::fflush(stdout);
    return status;
  } catch (const tutti::Error& e) {
    std::printf("setup failed: %s\n", e.what());
    return 1;
  }
}
