#pragma once
// The memory-ordering contract of device FIFOs and dependency flags, and the few primitives that
// implement it, for the CUDA device and for the emulated device (CPU threads over host memory).
//
// Simple protocol (one message per slot):
//   sender:   every thread of the block writes its part of the slot with plain stores;
//             __syncthreads();  thread 0: st.release.sys tail = seq
//   receiver: thread 0: ld.acquire.sys tail until >= seq;  __syncthreads();
//             every thread reads its part (ld.global.cg: never a stale L1 line from the slot's
//             previous message);  __syncthreads();  thread 0: st.release.sys head = seq
//   The barrier makes the other threads' stores (loads) part of what thread 0's release orders
//   (PTX memory model: release is cumulative over what the barrier made it observe).
// LL protocol (no fence at all): 16-byte lines {data0, flag, data1, flag}, each written with one
//   16-byte volatile store and read with one 16-byte volatile load; a line is valid when both flags
//   equal the message's sequence number, so a torn line is simply not valid yet. The receiver
//   releases the slot with head as in Simple (after a barrier that orders every thread's reads).
// Direct reads (Simple, registered buffers, abi.hpp): thread 0 of the sender writes the slot's
//   descriptor, then st.release.sys tail as above; the data it names was written before (by earlier
//   work on the stream, or by steps ordered before the send through the barrier and dependency
//   flags), so the same release orders it. The receiver reads the descriptor (ld.acquire.sys) and
//   the data in the sender's memory after its acquire of tail, then releases head as usual. The
//   sender's block ends only after ld.acquire.sys head >= its last message on each connection it
//   sent in place over, so the call is not complete, and the caller cannot reuse the buffer, before
//   every peer has read it. (Every message writes a descriptor: {0, 0} when the data is in the slot.)
// Slot reuse: the sender waits (thread 0, ld.acquire.sys) until head >= seq - depth.
// Dependencies between blocks of a rank: after a step other blocks depend on, __syncthreads() and
//   thread 0 st.release.sys progress[block] = (epoch << 32) | steps done; the dependent block's
//   thread 0 ld.acquire.sys's it, then __syncthreads().
// System scope everywhere: peers may be other processes or other GPUs.
//
// The emulated device runs a block as one CPU thread, so the barriers vanish and the same orders
// come from release stores and acquire loads (GCC's __atomic builtins, which nvcc's host pass also takes); 8-byte halves of an LL line are each
// one relaxed atomic (data and flag in one word, so the rule "valid when both flags match" holds).
// Waiting spins briefly, then sleeps on a futex with a short timeout (several ranks on 2 cores).

#include <cstdint>

#include "core/element.hpp"  // TUTTI_HD

#if !defined(__CUDA_ARCH__)
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstring>
#include <ctime>
#endif

namespace tutti::device::mem {

struct alignas(16) Pack16 {
  uint64_t w[2];
};

#if defined(__CUDA_ARCH__)

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ Pack16 load_slot(const unsigned char* p) {
  Pack16 r;
  asm volatile("ld.global.cg.v2.u64 {%0, %1}, [%2];" : "=l"(r.w[0]), "=l"(r.w[1]) : "l"(p) : "memory");
  return r;
}
__device__ __forceinline__ void store_slot(unsigned char* p, Pack16 v) {
  asm volatile("st.global.cg.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(v.w[0]), "l"(v.w[1]) : "memory");
}
// One LL line: 8 data bytes with the flag twice.
__device__ __forceinline__ void ll_store(unsigned char* line, uint64_t data, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(line), "r"(static_cast<uint32_t>(data)),
               "r"(flag), "r"(static_cast<uint32_t>(data >> 32)), "r"(flag)
               : "memory");
}
__device__ __forceinline__ bool ll_load(const unsigned char* line, uint32_t flag, uint64_t* data) {
  uint32_t d0, f0, d1, f1;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(d0), "=r"(f0), "=r"(d1), "=r"(f1)
               : "l"(line)
               : "memory");
  *data = static_cast<uint64_t>(d0) | (static_cast<uint64_t>(d1) << 32);
  return f0 == flag && f1 == flag;
}
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void wake(const void*) {}
__device__ __forceinline__ void pause(const void*, uint32_t, int) {}
__device__ __forceinline__ void pause_word(const void*, int) {}
__device__ __forceinline__ int32_t load_volatile(const volatile int32_t* p) { return *p; }
__device__ __forceinline__ bool claim(int32_t* p, int32_t v) { return atomicCAS(p, 0, v) == 0; }
__device__ __forceinline__ uint64_t fetch_add(uint64_t* p, uint64_t v) {
  return atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}
constexpr int kSpinsPerCheck = 4096;

#else

inline uint64_t load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
// Futex on the low half of a 64-bit word (little endian): a sleeper wakes on any store, or after
// its timeout if a store left the low half unchanged.
inline void wake(const void* p) {
  syscall(SYS_futex, p, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}
inline void pause(const void* p, uint32_t seen, int spins) {
  if (spins < 64) {
    sched_yield();
    return;
  }
  timespec ts{0, 1000000};  // 1 ms at most: a missed wake-up costs time, never correctness
  syscall(SYS_futex, p, FUTEX_WAIT_PRIVATE, seen, &ts, nullptr, 0);
}
// Sleeps on whatever the 32-bit word at p holds now (LL flags, which nobody else reports).
inline void pause_word(const void* p, int spins) {
  pause(p, __atomic_load_n(static_cast<const uint32_t*>(p), __ATOMIC_RELAXED), spins);
}
inline void store_release(uint64_t* p, uint64_t v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
  wake(p);
}
inline Pack16 load_slot(const unsigned char* p) {
  Pack16 r;
  std::memcpy(&r, p, 16);
  return r;
}
inline void store_slot(unsigned char* p, Pack16 v) { std::memcpy(p, &v, 16); }
inline void ll_store(unsigned char* line, uint64_t data, uint32_t flag) {
  auto* w = reinterpret_cast<uint64_t*>(line);
  __atomic_store_n(&w[0], (data & 0xffffffffull) | (static_cast<uint64_t>(flag) << 32), __ATOMIC_RELAXED);
  __atomic_store_n(&w[1], (data >> 32) | (static_cast<uint64_t>(flag) << 32), __ATOMIC_RELAXED);
  wake(line + 12);  // waiters sleep on the second flag
}
inline bool ll_load(const unsigned char* line, uint32_t flag, uint64_t* data) {
  auto* w = reinterpret_cast<const uint64_t*>(line);
  uint64_t a = __atomic_load_n(&w[0], __ATOMIC_RELAXED);
  uint64_t b = __atomic_load_n(&w[1], __ATOMIC_RELAXED);
  *data = (a & 0xffffffffull) | (b << 32);
  return static_cast<uint32_t>(a >> 32) == flag && static_cast<uint32_t>(b >> 32) == flag;
}
inline uint64_t now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}
inline int32_t load_volatile(const volatile int32_t* p) {
  return __atomic_load_n(const_cast<const int32_t*>(p), __ATOMIC_ACQUIRE);
}
inline bool claim(int32_t* p, int32_t v) {
  int32_t zero = 0;
  return __atomic_compare_exchange_n(p, &zero, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
inline uint64_t fetch_add(uint64_t* p, uint64_t v) { return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }
constexpr int kSpinsPerCheck = 1;

#endif

}  // namespace tutti::device::mem
