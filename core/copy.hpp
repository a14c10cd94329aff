#pragma once
// Bulk copies for collective buffers.
//
// copy_streaming writes around the caches (non-temporal stores): the destination lines are not
// read first and do not evict the data the rank works on. That is what a large collective output
// wants on a CPU: on our 2-core test machine an out-of-place 16 MiB all-gather moves about a third
// less memory traffic with it (no read-for-ownership of the output), and the call is up to 1.5x
// faster (docs/PERFORMANCE.md). A destination that is read again soon (a forwarded tile, scratch)
// should use memcpy instead: streamed lines come back from memory.
//
// Memory ordering: non-temporal stores are weakly ordered, so copy_streaming ends with a store
// fence. Every byte it wrote is visible to another thread or process before any store this thread
// makes after it returns (in particular before a release store that publishes completion).
// dst and src must not overlap. No alignment is required.

#include <cstddef>
#include <cstring>

namespace tutti {

void copy_streaming(void* dst, const void* src, size_t bytes);

// copy_streaming when `stream`, memcpy otherwise.
inline void copy_bytes(void* dst, const void* src, size_t bytes, bool stream) {
  if (stream) copy_streaming(dst, src, bytes);
  else std::memcpy(dst, src, bytes);
}

}  // namespace tutti
