// tutti-single-copy-pages: how fast one process reads another's buffer with process_vm_readv (the
// shared-memory transport's single copy) when that buffer lies on 4 KiB pages and when it lies on
// 2 MiB huge pages (runtime/huge_pages.hpp), next to memcpy in the same run.
//
//   tutti-single-copy-pages [MiB (8)] [rounds (5)]
//
// A forked child holds two source buffers, one left on 4 KiB pages (MADV_NOHUGEPAGE) and one moved
// onto huge pages; the parent reads each into its own buffer `rounds` times and prints the best and
// the median rate of each. The kernel pins the source page by page, so the page size is most of the
// difference.

#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "runtime/huge_pages.hpp"

namespace {

using Clock = std::chrono::steady_clock;

// `bytes` of anonymous memory starting on a huge-page boundary, filled (so every page is mapped). A
// huge one spans whole huge pages, so that a buffer smaller than one still lies on a huge page.
unsigned char* aligned_buffer(size_t bytes, bool huge) {
  if (huge) bytes = (bytes + tutti::kHugePageBytes - 1) / tutti::kHugePageBytes * tutti::kHugePageBytes;
  void* p = mmap(nullptr, bytes + tutti::kHugePageBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  const auto at = reinterpret_cast<uintptr_t>(p);
  auto* b = reinterpret_cast<unsigned char*>((at + tutti::kHugePageBytes - 1) / tutti::kHugePageBytes * tutti::kHugePageBytes);
  if (!huge) madvise(b, bytes, MADV_NOHUGEPAGE);
  std::memset(b, 1, bytes);
  if (huge && tutti::back_with_huge_pages(b, bytes) == 0) std::fprintf(stderr, "the kernel gave no huge pages\n");
  return b;
}

double gbps(size_t bytes, double seconds) { return static_cast<double>(bytes) / seconds / 1e9; }

}  // namespace

int main(int argc, char** argv) {
  const size_t bytes = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 8) << 20;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 5;
  if (bytes == 0 || rounds < 1) {
    std::fprintf(stderr, "usage: tutti-single-copy-pages [MiB] [rounds]\n");
    return 2;
  }
  int pipefd[2];
  if (pipe(pipefd) != 0) return 1;
  const pid_t child = fork();
  if (child == 0) {
    unsigned char* sources[2] = {aligned_buffer(bytes, false), aligned_buffer(bytes, true)};
    if (write(pipefd[1], sources, sizeof(sources)) != static_cast<ssize_t>(sizeof(sources))) _exit(1);
    pause();
    _exit(0);
  }
  unsigned char* sources[2];
  if (read(pipefd[0], sources, sizeof(sources)) != static_cast<ssize_t>(sizeof(sources))) return 1;
  unsigned char* local = aligned_buffer(bytes, false);
  unsigned char* into = aligned_buffer(bytes, false);
  const char* names[3] = {"process_vm_readv from 4 KiB pages", "process_vm_readv from 2 MiB pages", "memcpy (4 KiB pages)"};
  std::vector<double> rates[3];
  for (int r = 0; r < rounds; ++r) {
    for (int k = 0; k < 3; ++k) {
      const auto t0 = Clock::now();
      if (k < 2) {
        iovec to{into, bytes}, from{sources[k], bytes};
        if (process_vm_readv(child, &to, 1, &from, 1, 0) != static_cast<ssize_t>(bytes)) {
          std::perror("process_vm_readv");
          kill(child, SIGKILL);
          return 1;
        }
      } else {
        std::memcpy(into, local, bytes);
      }
      rates[k].push_back(gbps(bytes, std::chrono::duration<double>(Clock::now() - t0).count()));
    }
  }
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  std::printf("%zu MiB, %d rounds: GB/s best / median\n", bytes >> 20, rounds);
  for (int k = 0; k < 3; ++k) {
    std::sort(rates[k].begin(), rates[k].end());
    std::printf("  %-36s %6.1f / %6.1f\n", names[k], rates[k].back(), rates[k][rates[k].size() / 2]);
  }
  return 0;
}
