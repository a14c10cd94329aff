#include "runtime/doorbell.hpp"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

namespace tutti {

void ring(Doorbell& bell) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (bell.sleepers.load(std::memory_order_relaxed) == 0) return;
  bell.seq.fetch_add(1, std::memory_order_seq_cst);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&bell.seq), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

uint32_t prepare_sleep(Doorbell& bell) {
  bell.sleepers.fetch_add(1, std::memory_order_seq_cst);
  return bell.seq.load(std::memory_order_seq_cst);
}

void sleep_prepared(Doorbell& bell, uint32_t seen, int timeout_ms) {
  if (bell.seq.load(std::memory_order_seq_cst) != seen) return;
  timespec ts{timeout_ms / 1000, static_cast<long>(timeout_ms % 1000) * 1000000L};
  // Not FUTEX_PRIVATE: the word is shared between processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&bell.seq), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void finish_sleep(Doorbell& bell) { bell.sleepers.fetch_sub(1, std::memory_order_seq_cst); }

}  // namespace tutti
