// A custom all-reduce written in tutti's DSL: reduce-scatter along a ring, then all-gather by every
// rank sending its finished chunk straight to all others (one step instead of n - 1). The compiler
// verifies it; it is saved as a tutti plan and exported to MSCCL XML; and a program that knows only
// the NCCL API runs it with ncclAllReduce, found through TUTTI_PLAN_DIR and forced by TUTTI_ALGO.
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <unistd.h>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <tutti/dsl.hpp>
#include <tutti/plan.hpp>

namespace {

tutti::dsl::Program ring_then_direct(int n) {
  using tutti::dsl::Buffer;
  tutti::CollectiveSpec spec;
  spec.kind = tutti::Collective::kAllReduce;
  spec.nranks = n;
  spec.chunk_factor = n;  // chunk k ends up reduced on rank k
  tutti::dsl::Program p("ring_then_direct", spec);
  for (int r = 0; r < n; ++r)
    for (int k = 0; k < n; ++k) p.chunk(r, Buffer::input(), k).copy(r, Buffer::output(), k);
  for (int k = 0; k < n; ++k) {
    // Chunk k travels the ring from rank k + 1 and is complete when it reaches rank k.
    auto c = p.chunk((k + 1) % n, Buffer::output(), k);
    for (int step = 2; step <= n; ++step) c = p.chunk((k + step) % n, Buffer::output(), k).reduce(c);
    // The finished chunk, straight to every rank: to the rank d places ahead on channel d, so each
    // channel's connections carry one direction of one distance (as MSCCL's threadblocks need).
    for (int d = 1; d < n; ++d) {
      tutti::dsl::Annotations a;
      a.channel = d;
      c.copy((k + d) % n, Buffer::output(), k, a);
    }
  }
  return p;
}

}  // namespace

int main() {
  const int n = 4;
  const auto dir = std::filesystem::temp_directory_path() / ("tutti-custom-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  tutti::dsl::Program program = ring_then_direct(n);
  std::string summary = tutti::save_plan(program, (dir / "ring_then_direct.json").string());
  std::printf("%s\n", summary.c_str());
  std::fflush(stdout);
  // MSCCL's format too (another tool, or MSCCL itself, can read it); kept outside the plan
  // directory so the same plan is not loaded twice.
  tutti::save_plan(program, (dir.parent_path() / ("ring_then_direct-" + std::to_string(getpid()) + ".xml")).string());

  setenv("TUTTI_PLAN_DIR", dir.c_str(), 1);
  setenv("TUTTI_ALGO", "ring_then_direct", 1);
  std::vector<ncclComm_t> comms(n);
  if (ncclCommInitAll(comms.data(), n, nullptr) != ncclSuccess) return 1;
  const size_t count = 100000;
  std::vector<long> wrong(n, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      std::vector<float> in(count), out(count);
      for (size_t i = 0; i < count; ++i) in[i] = static_cast<float>((r + 1) * (i % 9));
      if (ncclAllReduce(in.data(), out.data(), count, ncclFloat, ncclSum, comms[r], nullptr) != ncclSuccess) {
        wrong[r] = -1;
        return;
      }
      for (size_t i = 0; i < count; ++i) wrong[r] += out[i] != static_cast<float>(10 * (i % 9));
    });
  for (auto& t : threads) t.join();
  for (auto c : comms) ncclCommDestroy(c);
  std::filesystem::remove_all(dir);
  std::filesystem::remove(dir.parent_path() / ("ring_then_direct-" + std::to_string(getpid()) + ".xml"));
  long total = 0;
  for (long w : wrong) total += w;
  std::printf("custom_collective_example: ring_then_direct through ncclAllReduce on %d ranks: %ld wrong\n", n, total);
  return total != 0;
}
