// How far apart two cores are right now: the round trip of a cache line between two threads pinned
// to them. On our VM the hypervisor moves the vCPUs between neighbouring hardware threads (about
// 50 ns), cores of one cache (about 100 ns) and distant cores (about 500 ns) from one minute to the
// next, and which of the FIFO and single copy is faster follows it (docs/PERFORMANCE.md), so the
// comparison scripts print it beside their figures.
//   tutti-core-distance [cpu_a cpu_b]   (default: the first two CPUs this process may use)
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

bool pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
}

struct alignas(64) Line {
  std::atomic<long> value{0};
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> cpus;
  if (argc != 1 && argc != 3) {
    std::fprintf(stderr, "usage: tutti-core-distance [cpu_a cpu_b]\n");
    return 2;
  }
  if (argc == 3) {
    cpus = {std::atoi(argv[1]), std::atoi(argv[2])};
  } else {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    sched_getaffinity(0, sizeof(allowed), &allowed);
    for (int c = 0; c < CPU_SETSIZE && cpus.size() < 2; ++c)
      if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  }
  if (cpus.size() < 2) {
    std::fprintf(stderr, "tutti-core-distance: needs two CPUs (usage: tutti-core-distance [cpu_a cpu_b])\n");
    return 2;
  }
  constexpr long kRounds = 200000;
  Line ping, pong;
  bool pinned = true;
  std::thread other([&] {
    pinned &= pin(cpus[1]);
    for (long i = 1; i <= kRounds; ++i) {
      while (ping.value.load(std::memory_order_acquire) != i) {
      }
      pong.value.store(i, std::memory_order_release);
    }
  });
  pinned &= pin(cpus[0]);
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 1; i <= kRounds; ++i) {
    ping.value.store(i, std::memory_order_release);
    while (pong.value.load(std::memory_order_acquire) != i) {
    }
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / kRounds;
  other.join();
  if (!pinned) {
    std::fprintf(stderr, "tutti-core-distance: cannot pin threads to CPUs %d and %d\n", cpus[0], cpus[1]);
    return 1;
  }
  std::printf("cpu %d <-> cpu %d: cache-line round trip %.0f ns\n", cpus[0], cpus[1], ns);
  return 0;
}
