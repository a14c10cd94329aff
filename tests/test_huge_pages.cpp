// runtime/huge_pages.hpp: moving the user's large buffers onto huge pages changes nothing the user
// can see, never reaches outside the buffer, and stops asking where the kernel refuses or the
// buffer keeps being mapped anew.
#include <sys/mman.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "runtime/huge_pages.hpp"
#include "runtime/shm_segment.hpp"

namespace tutti {
namespace {

using std::chrono::microseconds;

// An anonymous private mapping of `bytes`, starting on a huge-page boundary, unmapped at the end.
struct Mapping {
  unsigned char* base = nullptr;
  size_t bytes = 0;
  unsigned char* raw = nullptr;
  size_t raw_bytes = 0;
  explicit Mapping(size_t n) : bytes(n), raw_bytes(n + kHugePageBytes) {
    void* p = mmap(nullptr, raw_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
    raw = static_cast<unsigned char*>(p);
    const auto at = reinterpret_cast<uintptr_t>(raw);
    base = reinterpret_cast<unsigned char*>((at + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes);
  }
  ~Mapping() {
    if (raw) munmap(raw, raw_bytes);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
};

unsigned char pattern(size_t i) { return static_cast<unsigned char>(i * 131 + (i >> 12)); }

// The kB that /proc/self/smaps reports under `field` for the mapping that holds `at`.
long smaps_kb(const void* at, const std::string& field) {
  std::ifstream smaps("/proc/self/smaps");
  const auto want = reinterpret_cast<uintptr_t>(at);
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
      inside = lo <= want && want < hi;
      continue;
    }
    if (inside && line.rfind(field + ":", 0) == 0) return std::stol(line.substr(field.size() + 1));
  }
  return -1;
}
// Private memory on huge pages, and shared memory mapped by huge pages (PMD entries).
long anon_huge_kb(const void* at) { return smaps_kb(at, "AnonHugePages"); }
long shmem_huge_kb(const void* at) { return smaps_kb(at, "ShmemPmdMapped"); }

TEST(HugePages, RangeIsTheWholeHugePagesInsideTheBuffer) {
  const auto* at = reinterpret_cast<const void*>(uintptr_t{7} * kHugePageBytes + 16);
  const HugePageRange r = HugePageRange::inside(at, 3 * kHugePageBytes);
  EXPECT_EQ(r.begin, 8 * kHugePageBytes);
  EXPECT_EQ(r.end, 10 * kHugePageBytes);
  EXPECT_EQ(r.pages(), 2u);
  // Two huge pages' worth that straddles three holds one whole page; less than that may hold none.
  EXPECT_EQ(HugePageRange::inside(at, 2 * kHugePageBytes).pages(), 1u);
  EXPECT_EQ(HugePageRange::inside(at, kHugePageBytes + 4096).pages(), 0u);
  EXPECT_EQ(HugePageRange::inside(reinterpret_cast<const void*>(8 * kHugePageBytes), kHugePageBytes).pages(), 1u);
  EXPECT_EQ(HugePageRange::inside(at, 0).pages(), 0u);
  EXPECT_EQ(HugePageRange::inside(nullptr, 8 * kHugePageBytes).pages(), 0u);
}

TEST(HugePages, ContentsAndMemoryAroundTheBufferStay) {
  Mapping m(4 * kHugePageBytes);
  ASSERT_NE(m.base, nullptr);
  for (size_t i = 0; i < m.raw_bytes; ++i) m.raw[i] = pattern(i);
  // A buffer that starts and ends mid-page: only the two whole huge pages inside it may move.
  unsigned char* buffer = m.base + 4096 * 3;
  const size_t bytes = 3 * kHugePageBytes;
  const size_t granted = back_with_huge_pages(buffer, bytes);
  EXPECT_LE(granted, 2u);
  RecordProperty("huge_pages_granted", static_cast<int>(granted));
  for (size_t i = 0; i < m.raw_bytes; ++i) ASSERT_EQ(m.raw[i], pattern(i)) << "byte " << i << " of the mapping changed";
  // Granted pages are huge pages now (the kernel's own account of the mapping).
  if (granted > 0) {
    EXPECT_GE(anon_huge_kb(buffer), static_cast<long>(granted * kHugePageBytes / 1024));
  }
  // Asking again finds them and changes nothing either.
  EXPECT_EQ(back_with_huge_pages(buffer, bytes), granted);
  for (size_t i = 0; i < m.raw_bytes; ++i) ASSERT_EQ(m.raw[i], pattern(i)) << "byte " << i << " changed on the second request";
}

TEST(HugePages, AMappingThatRefusesHugePagesIsLeftAlone) {
  Mapping m(2 * kHugePageBytes);
  ASSERT_NE(m.base, nullptr);
  ASSERT_EQ(madvise(m.raw, m.raw_bytes, MADV_NOHUGEPAGE), 0);
  std::memset(m.raw, 7, m.raw_bytes);
  EXPECT_EQ(back_with_huge_pages(m.base, 2 * kHugePageBytes), 0u);
  EXPECT_EQ(back_with_huge_pages(m.base, 2 * kHugePageBytes), 0u);
  EXPECT_EQ(anon_huge_kb(m.base), 0);
  for (size_t i = 0; i < m.raw_bytes; ++i) ASSERT_EQ(m.raw[i], 7) << "byte " << i;
}

TEST(HugePages, ABufferWithoutAWholeHugePageIsNotAskedFor) {
  Mapping m(2 * kHugePageBytes);
  ASSERT_NE(m.base, nullptr);
  std::memset(m.raw, 1, m.raw_bytes);
  EXPECT_EQ(back_with_huge_pages(m.base + 4096, kHugePageBytes), 0u);
  EXPECT_EQ(anon_huge_kb(m.base), 0);
}

TEST(HugePageLedger, PagesFoundInPlaceAreAskedForever) {
  HugePageLedger l;
  const HugePageRange r{4 * kHugePageBytes, 8 * kHugePageBytes};
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(l.should_ask(r));
    l.asked(r, true, microseconds(2));
  }
  EXPECT_FALSE(l.should_ask(HugePageRange{}));
}

TEST(HugePageLedger, PagesCollapsedAgainAndAgainAreLeftAloneAfterTheStrikes) {
  HugePageLedger l;
  const HugePageRange r{4 * kHugePageBytes, 6 * kHugePageBytes};
  const auto work = HugePageLedger::kCollapseWork * 2 * 3;  // two pages, each moved
  for (int i = 0; i < HugePageLedger::kStrikes; ++i) {
    ASSERT_TRUE(l.should_ask(r)) << "strike " << i;
    l.asked(r, true, work);
    l.asked(r, true, microseconds(1));  // found in place in between: no strike
  }
  EXPECT_FALSE(l.should_ask(r));
  // A buffer that overlaps a churned page is not asked for either; one beside it is.
  EXPECT_FALSE(l.should_ask(HugePageRange{5 * kHugePageBytes, 9 * kHugePageBytes}));
  EXPECT_TRUE(l.should_ask(HugePageRange{6 * kHugePageBytes, 9 * kHugePageBytes}));
}

TEST(HugePageLedger, ARefusedRangeIsNeverAskedAgain) {
  HugePageLedger l;
  const HugePageRange r{2 * kHugePageBytes, 3 * kHugePageBytes};
  l.asked(r, false, microseconds(1));
  EXPECT_FALSE(l.should_ask(r));
  EXPECT_TRUE(l.should_ask(HugePageRange{3 * kHugePageBytes, 4 * kHugePageBytes}));
}

TEST(SharedSegments, LargeOnesAreMappedAtAHugePageBoundary) {
  for (size_t bytes : {kHugePageBytes, 3 * kHugePageBytes + 4096, 5 * kHugePageBytes + 100}) {
    ShmSegment s = ShmSegment::create("hugetest", bytes);
    ASSERT_NE(s.data(), nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(s.data()) % kHugePageBytes, 0u) << bytes << " bytes";
    auto* p = static_cast<unsigned char*>(s.data());
    EXPECT_EQ(p[0], 0);
    EXPECT_EQ(p[bytes - 1], 0);  // zero-filled to the last byte, and mapped there
    p[bytes - 1] = 9;
    EXPECT_EQ(p[bytes - 1], 9);
  }
  ShmSegment small = ShmSegment::create("hugetest", 4096);  // small ones go anywhere
  ASSERT_NE(small.data(), nullptr);
  static_cast<unsigned char*>(small.data())[4095] = 1;
}

TEST(HugePages, ASegmentRangeGetsTheHugePagesItOverlapsWithinTheSegment) {
  {  // Whether this kernel gives shared memory huge pages at all (MADV_COLLAPSE, Linux 6.1).
    ShmSegment probe = ShmSegment::create("hugeprobe", kHugePageBytes);
    if (madvise(probe.data(), kHugePageBytes, 25 /* MADV_COLLAPSE */) != 0)
      GTEST_SKIP() << "this kernel gives shared memory no huge pages: " << std::strerror(errno);
  }
  const size_t bytes = 3 * kHugePageBytes + 8192;  // the last 8 KiB hold no whole huge page
  ShmSegment s = ShmSegment::create("hugetest", bytes);
  auto* p = static_cast<unsigned char*>(s.data());
  ASSERT_EQ(reinterpret_cast<uintptr_t>(p) % kHugePageBytes, 0u);
  for (size_t i = 0; i < bytes; ++i) p[i] = pattern(i);
  // Outside the segment, or only in its tail: nothing is asked for.
  EXPECT_EQ(back_segment_with_huge_pages(p, bytes, p + bytes - 4096, 8192), 0u);
  EXPECT_EQ(back_segment_with_huge_pages(p, bytes, p + 3 * kHugePageBytes + 100, 4096), 0u);
  EXPECT_EQ(back_segment_with_huge_pages(p, bytes, nullptr, 4096), 0u);
  EXPECT_EQ(shmem_huge_kb(p), 0);
  // A range that straddles the first boundary gets both pages it touches, and no other.
  const size_t granted = back_segment_with_huge_pages(p, bytes, p + kHugePageBytes - 4096, 8192);
  RecordProperty("huge_pages_granted", static_cast<int>(granted));
  for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(p[i], pattern(i)) << "byte " << i << " changed";
  EXPECT_EQ(granted, 2u);
  EXPECT_EQ(shmem_huge_kb(p), static_cast<long>(2 * kHugePageBytes / 1024));
  // Another mapping of the same segment finds them: asking there moves nothing.
  ShmSegment again = ShmSegment::open(s.name(), 0);
  EXPECT_EQ(again.data(), s.data());  // one mapping per process (shm_segment.hpp)
}

}  // namespace
}  // namespace tutti
