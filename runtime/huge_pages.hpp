#pragma once
// Moving the user's large host buffers onto huge pages.
//
// Why: a collective on large host buffers streams through more 4 KiB pages than the TLB holds, and
// under a hypervisor each miss walks two page tables. On our 2-core VM a 16 MiB all-gather between
// two processes touches 26 MiB per rank; with the user's buffers on 2 MiB pages it took a median of
// 2.0 ms against 3.1 (8 alternating rounds, docs/PERFORMANCE.md). A single-copy read
// (process_vm_readv) gains most: it pins the sender's pages one by one, 4-6 GB/s from 4 KiB pages
// against 13-16 GB/s from 2 MiB pages. Buffers from malloc get 4 KiB pages wherever the kernel's
// transparent huge pages are set to "madvise" (Debian's default), so tutti asks for huge pages:
// MADV_COLLAPSE (Linux 6.1) moves the whole 2 MiB pages inside a buffer onto huge pages, at once.
//
// What it changes: the backing only. Contents and addresses stay, as when the kernel's khugepaged
// does the same on its own; other threads may use the memory meanwhile. Memory outside the buffer
// is never asked for, and the buffer's pages are all used by the call anyway, so nothing is added.
//
// Cost, and when it stops asking: the first call for a buffer copies it (2-20 ms for 8 MiB); later
// calls find the huge pages and return in a microsecond. A buffer that is unmapped and mapped
// again at the same address before every call (glibc does so for blocks of 32 MiB and more) would
// pay the copy every time, so a huge page that had to be collapsed kStrikes times is left alone
// after. So is one the kernel refused (memory pinned for CUDA, a mapping marked MADV_NOHUGEPAGE, no
// free huge page, a kernel before 6.1). TUTTI_HUGE_PAGES=0 turns it off.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>

namespace tutti {

inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;
// Smaller buffers are not asked for: they may hold no whole huge page, and most calls on them are
// too short to pay for a system call.
inline constexpr std::size_t kHugePageBufferMin = 2 * kHugePageBytes;

// The whole huge pages inside [data, data + bytes): [begin, end), empty where there is none.
struct HugePageRange {
  std::uintptr_t begin = 0, end = 0;
  static HugePageRange inside(const void* data, std::size_t bytes);
  std::size_t pages() const { return end > begin ? (end - begin) / kHugePageBytes : 0; }
};

// What was learned of each huge page asked for: which not to ask again. Not thread-safe.
class HugePageLedger {
 public:
  static constexpr int kStrikes = 3;  // collapses that moved memory before a page is left alone
  // A request slower than this per huge page moved memory; one that finds huge pages takes ~1 us.
  static constexpr std::chrono::microseconds kCollapseWork{100};

  // Whether to ask for the range: no page of it was refused or churned.
  bool should_ask(const HugePageRange& r) const;
  // What the request did: refused (!ok), or done in `took`.
  void asked(const HugePageRange& r, bool ok, std::chrono::nanoseconds took);

 private:
  std::map<std::uintptr_t, int> strikes_;  // page start -> collapses that moved memory (kStrikes: refused)
};

// Asks for huge pages under the whole huge pages inside [data, data + bytes) of a buffer of at
// least kHugePageBufferMin bytes (none for a null one), unless the process's ledger says not to.
// Thread-safe; never throws. Returns how many huge pages were granted.
std::size_t back_with_huge_pages(const void* data, std::size_t bytes);

// The same for a range of a shared segment (runtime/shm_segment.hpp maps those of a huge page or
// more at a huge-page boundary): the huge pages that overlap [data, data + bytes) and lie wholly
// inside the segment [segment, segment + segment_bytes), so a range that straddles a boundary
// gets both pages (its neighbour's memory is the same file, reserved anyway). For the transport's
// FIFOs, which a message of many slots streams through over and over: a 2 MiB FIFO in 4 KiB pages
// costs 512 TLB entries per direction. The first process to ask moves the file's pages (tmpfs
// gives huge pages this way even where its own setting, shmem_enabled, says never); a process
// that maps them later finds them in place. Never throws; returns the huge pages granted.
std::size_t back_segment_with_huge_pages(const void* segment, std::size_t segment_bytes, const void* data,
                                         std::size_t bytes);

}  // namespace tutti
