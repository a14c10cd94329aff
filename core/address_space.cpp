#include "core/address_space.hpp"

#include <cinttypes>
#include <cstdio>
#include <limits>

namespace tutti {

std::optional<uint64_t> checked_bytes(uint64_t count, uint64_t element_bytes, uint64_t multiple) {
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(count, element_bytes, &bytes) || __builtin_mul_overflow(bytes, multiple, &bytes))
    return std::nullopt;
  if (bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
  return bytes;
}

namespace {

// The end of the highest user mapping (kernel-side entries such as [vsyscall] excluded).
uint64_t highest_mapping_end() {
  std::FILE* f = std::fopen("/proc/self/maps", "r");
  if (!f) return UINT64_MAX;  // cannot tell: do not refuse
  uint64_t highest = 0, begin = 0, end = 0;
  char line[512];
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "%" SCNx64 "-%" SCNx64, &begin, &end) == 2 && end <= (uint64_t{1} << 63) && end > highest)
      highest = end;
  std::fclose(f);
  return highest;
}

}  // namespace

bool addressable(const void* p, uint64_t bytes) {
  const auto begin = reinterpret_cast<uintptr_t>(p);
  if (bytes > UINTPTR_MAX - begin) return false;
  const uint64_t end = begin + bytes;
  if (end <= uint64_t{1} << 47) return true;
  return end <= highest_mapping_end();
}

}  // namespace tutti
