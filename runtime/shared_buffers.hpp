#pragma once
// User buffers that live in named shared-memory segments (ncclMemAlloc): a peer on the same host
// can map the segment and read the data where it is, so the shared-memory transport sends a
// descriptor (segment name, offset) instead of the bytes, and the receiver copies or reduces
// straight out of the sender's buffer: one pass over the data instead of two (FIFO) and no system
// call (process_vm_readv). Like NCCL's user buffer registration, which this backs.
//
// Thread-safe. Lookups are cheap when nothing is registered (one atomic load).

#include <cstddef>
#include <string>

namespace tutti {

struct SharedBufferRef {
  std::string segment;       // POSIX shared-memory name
  size_t segment_bytes = 0;  // its size (to map it)
  size_t offset = 0;         // of the looked-up address in the segment
};

void register_shared_buffer(const void* base, size_t bytes, const std::string& segment);
void unregister_shared_buffer(const void* base);
// Whether [p, p + bytes) lies inside one registered segment; fills `out` if so.
bool find_shared_buffer(const void* p, size_t bytes, SharedBufferRef& out);

// A new registered segment of at least `bytes` (ncclMemAlloc's host memory, tutti::alloc_shared).
// Throws a system Error naming the size when it cannot be made.
void* allocate_shared_buffer(size_t bytes);
// Frees what allocate_shared_buffer returned; false (and nothing done) for any other pointer.
bool free_shared_buffer(void* p);

}  // namespace tutti
