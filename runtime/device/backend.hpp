#pragma once
// What a device executor needs from a device: memory, sharing it with other processes, launching
// the interpreter, and the small stream operations around a collective (copies, premulsum's scale,
// avg's division). Two implementations: CUDA (runtime/cuda/cuda_backend.cu) and the emulated device
// (runtime/device/emulated.cpp: host memory, one CPU thread per plan block, launches complete
// before launch() returns).
//
// Streams are opaque (a cudaStream_t on CUDA, ignored by the emulated device). Memory from alloc()
// is zero-filled.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/datatype.hpp"
#include "runtime/device/abi.hpp"

namespace tutti::device {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual int device() const = 0;  // CUDA ordinal; -1 for the emulated device

  virtual void* alloc(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  // Host memory the device can read and write (failure records, the abort flag).
  virtual void* alloc_host(size_t bytes, void** device_view) = 0;
  virtual void release_host(void* p) = 0;
  virtual void upload(void* dst, const void* src, size_t bytes) = 0;  // synchronous
  // Stream-ordered memory and uploads. Ranks that are threads sharing one GPU must never make a
  // device-wide synchronizing call (cudaFree, cudaMalloc may) between another rank's launch of a
  // collective and their own: the other rank's kernel waits for theirs, and the call waits for that
  // kernel. Everything a run does before its launch therefore goes through these; `src` of
  // upload_async may be reused once it returns.
  virtual void* alloc_async(size_t bytes, void* stream) = 0;  // zero-filled
  virtual void release_async(void* p, void* stream) = 0;
  virtual void upload_async(void* dst, const void* src, size_t bytes, void* stream) = 0;

  // Lets a process other than this one map memory from alloc(); open() maps a peer's handle.
  virtual std::vector<unsigned char> share(void* p) = 0;
  virtual void* open(const std::vector<unsigned char>& handle, int owner_device) = 0;
  virtual void close(void* p) = 0;
  // Makes memory of `owner_device` reachable from this device in this process (peer access).
  virtual void reach(int owner_device) = 0;

  virtual void launch(const LaunchArgs& args, int threads, void* stream) = 0;
  // Several launches that may depend on each other, ordered after what `stream` holds and before
  // what follows on it; launches of one lane (lanes[i]) run in order, lanes run concurrently.
  virtual void launch_group(const std::vector<LaunchArgs>& launches, const std::vector<int>& lanes, int threads,
                            void* stream) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes, void* stream) = 0;
  virtual void scale(DataType type, void* dst, const void* src, const void* scalar, size_t count, void* stream) = 0;
  virtual void divide(DataType type, void* dst, const void* src, uint64_t divisor, size_t count, void* stream) = 0;
  virtual void synchronize(void* stream) = 0;
  // Runs fn(arg) on a host thread once the work `stream` holds before it is done
  // (cudaLaunchHostFunc; the emulated device calls it at once). fn must neither block nor call the
  // device API.
  virtual void host_callback(void* stream, void (*fn)(void*), void* arg) = 0;
  // Holds the work `stream` gets after this until *flag >= target or *abort != 0 (both device views
  // of alloc_host memory; the host writes the flag with a release store). The emulated device
  // waits in the caller.
  virtual void wait_flag(void* stream, const uint64_t* flag, uint64_t target, const volatile int32_t* abort) = 0;
  // Whether `stream` is being captured into a CUDA graph (where uploads from host memory and freeing
  // memory from outside the graph are not allowed).
  virtual bool capturing(void* stream) = 0;
  // How many thread blocks of `threads` threads can run at once (all blocks of a launch must).
  virtual int resident_blocks(int threads) = 0;
  virtual int processors() = 0;  // multiprocessors (1 for the emulated device)
};

std::unique_ptr<Backend> make_emulated_backend();

// Only in CUDA builds (TUTTI_HAVE_CUDA):
std::unique_ptr<Backend> make_cuda_backend(int device);
int cuda_device_count();    // 0 without a driver or a device
int cuda_current_device();  // -1 when there is none
enum class MemoryKind { kHost, kDevice };
// kDevice for cudaMalloc'd and managed memory (cudaPointerGetAttributes); host, pinned or unknown
// pointers are kHost.
MemoryKind memory_kind(const void* p);

}  // namespace tutti::device
