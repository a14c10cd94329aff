// Overlapping communication with compute through tutti's C++ API: each of 4 ranks (threads here;
// under tutti-run, use tutti::Comm::from_env()) starts an all-reduce of its "gradients", does other
// work while it runs, then waits and checks the sum.
#include <cstdio>
#include <thread>
#include <vector>

#include <tutti/tutti.hpp>

int main() {
  const int n = 4;
  const size_t count = 1 << 16;
  std::vector<tutti::Comm> comms = tutti::Comm::create_local(n);
  std::vector<long> wrong(n, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      tutti::Comm& comm = comms[r];
      std::vector<float> grad(count, static_cast<float>(r + 1)), sum(count);
      tutti::Work pending = comm.all_reduce<float>(grad, sum);  // returns at once
      double busy = 0;  // compute that touches neither buffer
      for (int i = 1; i < 100000; ++i) busy += 1.0 / i;
      pending.wait();
      for (float v : sum) wrong[r] += v != static_cast<float>(n * (n + 1) / 2);
      if (busy <= 0) wrong[r] += 1;
    });
  for (auto& t : threads) t.join();
  long total = 0;
  for (long w : wrong) total += w;
  std::printf("cpp_api_example: tutti %s, all-reduce of %zu floats on %d ranks: %ld wrong\n", tutti::version(), count,
              n, total);
  return total != 0;
}
