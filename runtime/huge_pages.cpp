#include "runtime/huge_pages.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <mutex>

namespace tutti {

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1
#endif

HugePageRange HugePageRange::inside(const void* data, std::size_t bytes) {
  if (data == nullptr) return {};
  const auto at = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t begin = (at + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  const std::uintptr_t end = (at + bytes) / kHugePageBytes * kHugePageBytes;
  return end > begin ? HugePageRange{begin, end} : HugePageRange{};
}

bool HugePageLedger::should_ask(const HugePageRange& r) const {
  for (auto it = strikes_.lower_bound(r.begin); it != strikes_.end() && it->first < r.end; ++it)
    if (it->second >= kStrikes) return false;
  return r.pages() > 0;
}

void HugePageLedger::asked(const HugePageRange& r, bool ok, std::chrono::nanoseconds took) {
  if (ok && took < kCollapseWork * static_cast<long>(r.pages())) return;  // found huge pages in place
  for (std::uintptr_t page = r.begin; page < r.end; page += kHugePageBytes) {
    int& strikes = strikes_[page];
    strikes = ok ? strikes + 1 : kStrikes;
  }
}

std::size_t back_with_huge_pages(const void* data, std::size_t bytes) {
  static std::mutex mutex;
  static HugePageLedger ledger;
  if (bytes < kHugePageBufferMin) return 0;
  const HugePageRange r = HugePageRange::inside(data, bytes);
  {
    std::lock_guard lock(mutex);
    if (!ledger.should_ask(r)) return 0;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const bool ok = madvise(reinterpret_cast<void*>(r.begin), r.end - r.begin, MADV_COLLAPSE) == 0;
  const auto took = std::chrono::steady_clock::now() - t0;
  std::lock_guard lock(mutex);
  ledger.asked(r, ok, std::chrono::duration_cast<std::chrono::nanoseconds>(took));
  return ok ? r.pages() : 0;
}

std::size_t back_segment_with_huge_pages(const void* segment, std::size_t segment_bytes, const void* data,
                                         std::size_t bytes) {
  if (segment == nullptr || data == nullptr || bytes == 0) return 0;
  const auto seg = reinterpret_cast<std::uintptr_t>(segment), at = reinterpret_cast<std::uintptr_t>(data);
  if (at < seg || at + bytes > seg + segment_bytes) return 0;
  const HugePageRange inside = HugePageRange::inside(segment, segment_bytes);
  const std::uintptr_t begin = std::max(inside.begin, at / kHugePageBytes * kHugePageBytes);
  const std::uintptr_t end = std::min(inside.end, (at + bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes);
  if (end <= begin) return 0;
  return madvise(reinterpret_cast<void*>(begin), end - begin, MADV_COLLAPSE) == 0 ? (end - begin) / kHugePageBytes : 0;
}

}  // namespace tutti
