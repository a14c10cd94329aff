#pragma once
// A rank's doorbell: a 32-bit counter in shared memory that peers bump whenever they make progress
// that rank may be waiting for (data written into its FIFO, a slot freed, a single-copy read done).
// A waiter spins briefly, then sleeps on the counter with FUTEX_WAIT, so more ranks than cores do not
// burn each other's CPU time.
//
// Memory ordering: ring() is a seq_cst increment followed by a seq_cst load of `sleepers`; sleep()
// is a seq_cst increment of `sleepers` followed by FUTEX_WAIT on the value the waiter saw *before*
// it re-checked its condition. Either the ringer sees sleepers > 0 and wakes, or the sleeper's futex
// compare sees the new seq and returns at once: no wake-up is lost.

#include <atomic>
#include <cstdint>

namespace tutti {

struct alignas(64) Doorbell {
  std::atomic<uint32_t> seq{0};
  std::atomic<uint32_t> sleepers{0};
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "doorbells live in shared memory");

void ring(Doorbell& bell);
// Sleeps while bell.seq == seen, at most timeout_ms. Returns early on any ring.
void sleep_on(Doorbell& bell, uint32_t seen, int timeout_ms);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace tutti
