#pragma once
// A POSIX shared-memory segment (RAII). Segments are named /tutti-<pid>-<n>-<what>: the creator's
// pid lets sweep_stale_segments() remove what a crashed process left. Communicators unlink their
// segments as soon as every peer has mapped them, so a crash after setup leaks nothing.

#include <cstddef>
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
  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  std::string name_;
  bool owner_ = false;
};

// Removes /dev/shm/tutti-<pid>-* for pids that no longer exist. Returns how many were removed.
int sweep_stale_segments();

}  // namespace tutti
