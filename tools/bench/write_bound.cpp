// tutti-write-bound: how fast this machine can write a collective's output at all. N threads, one
// per core, each write `bytes` per iteration with the non-temporal stores tutti uses for large
// outputs (core/copy.hpp), from a small cache-resident source, so nothing but the memory writes is
// timed. All threads start each iteration together; the time is the average per iteration.
//
//   tutti-write-bound [--threads N] [--bytes B] [--iters I]
//
// An out-of-place all-gather of `bytes` output on N ranks must write N x bytes in total, so no
// implementation on this machine can finish it faster than this figure: Open MPI's time divided by
// it is the largest ratio any all-gather can show against Open MPI here (docs/PERFORMANCE.md).

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/copy.hpp"
#include "core/env.hpp"

namespace {

using Clock = std::chrono::steady_clock;

void pin_to_core(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core % std::max(1u, std::thread::hardware_concurrency()), &set);
  (void)pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2, iters = 20;
  uint64_t bytes = 16u << 20;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "tutti-write-bound: %s needs a value\n", a.c_str());
      return 2;
    }
    try {
      if (a == "--threads") threads = std::stoi(argv[++i]);
      else if (a == "--bytes") bytes = tutti::env::parse_size(argv[++i]);
      else if (a == "--iters") iters = std::stoi(argv[++i]);
      else throw std::invalid_argument("unknown flag");
    } catch (const std::exception&) {
      std::fprintf(stderr, "tutti-write-bound: bad argument '%s %s' (flags: --threads N --bytes B --iters I)\n",
                   a.c_str(), argv[i]);
      return 2;
    }
  }
  if (threads < 1 || iters < 1 || bytes == 0) {
    std::fprintf(stderr, "tutti-write-bound: --threads, --iters and --bytes must be positive\n");
    return 2;
  }
  constexpr size_t kSource = 128u << 10;  // stays in L2: the loads cost next to nothing
  std::vector<double> us(static_cast<size_t>(iters));
  std::barrier sync(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      pin_to_core(t);
      std::vector<unsigned char> src(kSource, static_cast<unsigned char>(t + 1)), dst(bytes);
      for (int it = -1; it < iters; ++it) {  // iteration -1 faults the pages in, untimed
        sync.arrive_and_wait();
        auto t0 = Clock::now();
        for (uint64_t at = 0; at < bytes; at += kSource)
          tutti::copy_streaming(dst.data() + at, src.data(), static_cast<size_t>(std::min<uint64_t>(kSource, bytes - at)));
        sync.arrive_and_wait();
        if (t == 0 && it >= 0) us[static_cast<size_t>(it)] = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      }
    });
  for (auto& th : pool) th.join();
  double sum = 0;
  for (double x : us) sum += x;
  std::printf("%d threads x %llu bytes: %.2f us per iteration (%.2f GB/s in all)\n", threads,
              static_cast<unsigned long long>(bytes), sum / iters, threads * static_cast<double>(bytes) / (sum / iters) / 1e3);
  return 0;
}
