#include "runtime/shared_buffers.hpp"

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <shared_mutex>

#include "runtime/shm_segment.hpp"

namespace tutti {
namespace {

struct Entry {
  size_t bytes;
  std::string segment;
};

struct Registry {
  std::shared_mutex mutex;
  std::map<uintptr_t, Entry> by_base;
  std::atomic<size_t> count{0};
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void register_shared_buffer(const void* base, size_t bytes, const std::string& segment) {
  Registry& r = registry();
  std::unique_lock lock(r.mutex);
  r.by_base[reinterpret_cast<uintptr_t>(base)] = {bytes, segment};
  r.count.store(r.by_base.size(), std::memory_order_release);
}

void unregister_shared_buffer(const void* base) {
  Registry& r = registry();
  std::unique_lock lock(r.mutex);
  r.by_base.erase(reinterpret_cast<uintptr_t>(base));
  r.count.store(r.by_base.size(), std::memory_order_release);
}

bool find_shared_buffer(const void* p, size_t bytes, SharedBufferRef& out) {
  Registry& r = registry();
  if (r.count.load(std::memory_order_acquire) == 0) return false;
  auto a = reinterpret_cast<uintptr_t>(p);
  std::shared_lock lock(r.mutex);
  auto it = r.by_base.upper_bound(a);
  if (it == r.by_base.begin()) return false;
  --it;
  if (a + bytes > it->first + it->second.bytes) return false;
  out.segment = it->second.segment;
  out.segment_bytes = it->second.bytes;
  out.offset = a - it->first;
  return true;
}

namespace {
std::mutex g_owned_mutex;
std::map<void*, ShmSegment>& owned() {
  static std::map<void*, ShmSegment> m;  // guarded by g_owned_mutex
  return m;
}
}  // namespace

void* allocate_shared_buffer(size_t bytes) {
  ShmSegment seg = ShmSegment::create("mem", std::max<size_t>(bytes, 1));
  void* p = seg.data();
  register_shared_buffer(p, seg.size(), seg.name());
  std::lock_guard lock(g_owned_mutex);
  owned().emplace(p, std::move(seg));
  return p;
}

bool free_shared_buffer(void* p) {
  std::lock_guard lock(g_owned_mutex);
  auto it = owned().find(p);
  if (it == owned().end()) return false;
  unregister_shared_buffer(p);
  owned().erase(it);
  return true;
}

}  // namespace tutti
