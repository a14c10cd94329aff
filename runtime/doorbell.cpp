#include "runtime/doorbell.hpp"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

namespace tutti {

void ring(Doorbell& bell) {
  bell.seq.fetch_add(1, std::memory_order_seq_cst);
  if (bell.sleepers.load(std::memory_order_seq_cst) > 0)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&bell.seq), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void sleep_on(Doorbell& bell, uint32_t seen, int timeout_ms) {
  bell.sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (bell.seq.load(std::memory_order_seq_cst) == seen) {
    timespec ts{timeout_ms / 1000, static_cast<long>(timeout_ms % 1000) * 1000000L};
    // Not FUTEX_PRIVATE: the word is shared between processes.
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&bell.seq), FUTEX_WAIT, seen, &ts, nullptr, 0);
  }
  bell.sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

}  // namespace tutti
