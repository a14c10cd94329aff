// The emulated device: the CUDA interpreter's source compiled as host code. A launch runs every
// plan block of the rank as its own CPU thread (a team of one) over host memory, with the FIFO and
// flag protocol of runtime/device/fifo.hpp through std::atomic_ref, and returns when all are done.
// Sharing memory between processes is not emulated: ranks are threads of one process.

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "core/reduce.hpp"
#include "runtime/device/backend.hpp"
#include "runtime/device/interpreter.hpp"

namespace tutti::device {
namespace {

struct RunBlock {
  const LaunchArgs& a;
  int32_t block;
  template <class E>
  void operator()() {
    run_block<E>(a, block);
  }
};

class Emulated final : public Backend {
 public:
  const char* name() const override { return "emulated"; }
  int device() const override { return -1; }
  void* alloc(size_t bytes) override {
    void* p = std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
    if (!p) throw Error(ErrorKind::kSystem, fmt::format("emulated device: out of memory allocating {} bytes", bytes));
    std::memset(p, 0, bytes);
    return p;
  }
  void release(void* p) override { std::free(p); }
  void* alloc_host(size_t bytes, void** device_view) override { return *device_view = alloc(bytes); }
  void release_host(void* p) override { std::free(p); }
  void upload(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void* alloc_async(size_t bytes, void*) override { return alloc(bytes); }
  void release_async(void* p, void*) override { release(p); }
  void upload_async(void* dst, const void* src, size_t bytes, void*) override { upload(dst, src, bytes); }
  std::vector<unsigned char> share(void*) override { return {}; }
  void* open(const std::vector<unsigned char>&, int) override {
    throw InvalidUsage("the emulated device cannot share memory between processes: run its ranks as threads");
  }
  void close(void*) override {}
  void reach(int) override {}
  void launch(const LaunchArgs& args, int, void*) override {
    std::vector<std::thread> threads;
    threads.reserve(static_cast<size_t>(args.nblocks * args.instances));
    for (int32_t b = 0; b < args.nblocks * args.instances; ++b)
      threads.emplace_back([&args, b] { with_elem(args.type, RunBlock{args, b}); });
    for (auto& t : threads) t.join();
  }
  void launch_group(const std::vector<LaunchArgs>& launches, const std::vector<int>& lanes, int threads,
                    void* stream) override {
    int nlanes = 0;
    for (int l : lanes) nlanes = std::max(nlanes, l + 1);
    std::vector<std::thread> threads_of_lanes;
    for (int l = 0; l < nlanes; ++l)
      threads_of_lanes.emplace_back([&, l] {
        for (size_t i = 0; i < launches.size(); ++i)
          if (lanes[i] == l) launch(launches[i], threads, stream);
      });
    for (auto& t : threads_of_lanes) t.join();
  }
  void copy(void* dst, const void* src, size_t bytes, void*) override {
    if (bytes && dst != src) std::memmove(dst, src, bytes);
  }
  void scale(DataType type, void* dst, const void* src, const void* scalar, size_t count, void*) override {
    tutti::scale(type, dst, src, scalar, count);
  }
  void divide(DataType type, void* dst, const void* src, uint64_t divisor, size_t count, void*) override {
    tutti::divide(type, dst, src, divisor, count);
  }
  void synchronize(void*) override {}
  void host_callback(void*, void (*fn)(void*), void* arg) override { fn(arg); }
  void wait_flag(void*, const uint64_t* flag, uint64_t target, const volatile int32_t* abort) override {
    for (int spins = 1;; ++spins) {
      const uint64_t v = mem::load_acquire(flag);
      if (v >= target || mem::load_volatile(abort) != 0) return;
      mem::pause(flag, static_cast<uint32_t>(v), spins);
    }
  }
  bool capturing(void*) override { return false; }
  int resident_blocks(int) override { return 1 << 20; }
  int processors() override { return 1; }
};

}  // namespace

std::unique_ptr<Backend> make_emulated_backend() { return std::make_unique<Emulated>(); }

}  // namespace tutti::device
