#pragma once
// Sizes that callers hand us, checked before anything uses them: a count times an element size (times
// the ranks whose parts a buffer holds) that overflows 64 bits, or a buffer whose end lies past any
// memory this process has, would otherwise wrap to a small size (a call that "succeeds" moving
// nothing) or run a kernel over unmapped memory (a crash).

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>

namespace tutti {

// count * element_bytes * multiple, or nothing where it overflows 2^63 - 1 (sizes stay signed-safe:
// plans and the executor keep counts as int64_t). Inline: every call of both APIs runs it.
inline std::optional<uint64_t> checked_bytes(uint64_t count, uint64_t element_bytes, uint64_t multiple = 1) {
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(count, element_bytes, &bytes) || __builtin_mul_overflow(bytes, multiple, &bytes) ||
      bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    return std::nullopt;
  return bytes;
}

// The end of the highest user mapping of this process (/proc/self/maps).
uint64_t highest_mapping_end();

// Whether [p, p + bytes) can be memory of this process: false where the end wraps past 2^64 or lies
// beyond the end of the highest mapping. Costs two compares unless the end passes 2^47 (the top of
// user space with 4-level page tables); only then is /proc/self/maps read.
inline bool addressable(const void* p, uint64_t bytes) {
  const auto begin = reinterpret_cast<uintptr_t>(p);
  if (bytes > UINTPTR_MAX - begin) return false;
  const uint64_t end = begin + bytes;
  return end <= uint64_t{1} << 47 || end <= highest_mapping_end();
}

}  // namespace tutti
