#pragma once
// A POSIX shared-memory segment (RAII). Segments are named /tutti-<pid>-<n>-<what>: the creator's
// pid lets sweep_stale_segments() remove what a crashed process left. Communicators unlink their
// segments as soon as every peer has mapped them, so a crash after setup leaks nothing.
//
// A process maps a segment once: ranks that are threads of one process share the creator's mapping
// (open() finds it by name) instead of mapping the pages again at another address. Besides saving
// mappings, this puts a FIFO's atomics at one address for every thread, which is what
// ThreadSanitizer needs to see the happens-before edges they carry (two mappings of one page look
// like two unrelated variables to it).
//
// Segments of a huge page or more are mapped at a huge-page boundary in every process, so that the
// whole huge pages of the file can each be mapped by one TLB entry once they are asked for
// (back_segment_with_huge_pages in runtime/huge_pages.hpp); the file offset and the address then
// agree modulo 2 MiB, which a huge mapping needs.

#include <cstddef>
#include <memory>
#include <string>

namespace tutti {

class ShmSegment {
 public:
  ShmSegment() = default;
  static ShmSegment create(const std::string& what, size_t bytes);  // zero-filled
  static ShmSegment open(const std::string& name, size_t bytes);  // bytes 0: the whole segment
  ShmSegment(ShmSegment&& o) noexcept { *this = std::move(o); }
  ShmSegment& operator=(ShmSegment&& o) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  void unlink();  // removes the name; mappings stay valid
  void* data() const { return mapping_ ? mapping_->data : nullptr; }
  size_t size() const { return mapping_ ? mapping_->size : 0; }
  const std::string& name() const { return name_; }

  struct Mapping {  // munmap when the last ShmSegment of this process using it goes
    void* data = nullptr;
    size_t size = 0;
    ~Mapping();
  };

 private:
  std::shared_ptr<Mapping> mapping_;
  std::string name_;
  bool owner_ = false;
};

// Removes /dev/shm/tutti-<pid>-* for pids that no longer exist. Returns how many were removed.
int sweep_stale_segments();

}  // namespace tutti
