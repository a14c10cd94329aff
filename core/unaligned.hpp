#pragma once
// Element i of a buffer that may not be aligned to T. Buffers are byte ranges (a chunk of a
// float32 call can start at any byte offset a plan gives it), so scalar loops read and write
// through memcpy, which compiles to one plain load or store where the target allows it.

#include <cstddef>
#include <cstring>

namespace tutti::unaligned {

template <class T>
inline T load(const void* p, size_t i) {
  T v;
  std::memcpy(&v, static_cast<const char*>(p) + i * sizeof(T), sizeof(T));
  return v;
}

template <class T>
inline void store(void* p, size_t i, T v) {
  std::memcpy(static_cast<char*>(p) + i * sizeof(T), &v, sizeof(T));
}

}  // namespace tutti::unaligned
