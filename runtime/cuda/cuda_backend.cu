// The CUDA device behind runtime/device/backend.hpp: the plan interpreter as one kernel (a thread
// block per plan block), device memory shared between processes with CUDA IPC, and the stream
// operations around a collective.

#include <cuda_runtime.h>

#include <cstring>
#include <mutex>

#include "core/by_type.hpp"
#include "core/element.hpp"
#include "core/error.hpp"
#include "runtime/device/backend.hpp"
#include "runtime/device/interpreter.hpp"

namespace tutti::device {
namespace {

void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) {
    cudaGetLastError();
    throw Error(ErrorKind::kSystem, fmt::format("CUDA: {}: {}", what, cudaGetErrorString(rc)));
  }
}

// One interpreter kernel per element type, picked on the host, rather than one kernel that
// switches on the type: ptxas took 7 minutes of the build on the one kernel's huge body (2 as
// twelve kernels), and that kernel needed a 2384-byte stack frame with 108 bytes of spills, where
// each of the twelve needs 768-784 bytes and spills nothing (16 bytes for 64-bit integers); all
// use 128 registers, the cap __launch_bounds__ sets (nvcc --resource-usage, sm_90).
template <class E>
__global__ void __launch_bounds__(kMaxBlockThreads) interpret(LaunchArgs a) {
  run_block<E>(a, static_cast<int32_t>(blockIdx.x));
}

using InterpretKernel = void (*)(LaunchArgs);

struct PickInterpreter {
  InterpretKernel kernel = nullptr;
  template <class E>
  void operator()() {
    kernel = &interpret<E>;
  }
};

InterpretKernel interpreter_for(int32_t type) {
  PickInterpreter pick;
  with_elem(type, pick);
  return pick.kernel;
}

// One thread holds the stream until the host's flag reaches the target (host staging's proxy).
__global__ void wait_flag_kernel(const uint64_t* flag, uint64_t target, const volatile int32_t* abort) {
  while (mem::load_acquire(flag) < target && *abort == 0) __nanosleep(2000);
}

template <class T>
__global__ void scale_native(T* dst, const T* src, T s, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = element::op_prod(src[i], s);
}
template <class F>
__global__ void scale_mini(typename F::Bits* dst, const typename F::Bits* src, float s, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = F::store(F::load(src[i]) * s);
}
template <class T>
__global__ void divide_native(T* dst, const T* src, uint64_t d, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = element::op_div(src[i], d);
}
template <class F>
__global__ void divide_mini(typename F::Bits* dst, const typename F::Bits* src, uint64_t d, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = F::store(F::load(src[i]) / static_cast<float>(d));
}

unsigned grid_for(size_t n) { return static_cast<unsigned>(std::min<size_t>((n + 255) / 256, 4096)); }

// Runs with this backend's device current, and restores the caller's.
class OnDevice {
 public:
  explicit OnDevice(int dev) {
    cudaGetDevice(&saved_);
    if (saved_ != dev) check(cudaSetDevice(dev), "cudaSetDevice");
  }
  ~OnDevice() {
    int now = -1;
    cudaGetDevice(&now);
    if (now != saved_) cudaSetDevice(saved_);
  }

 private:
  int saved_ = 0;
};

class Cuda final : public Backend {
 public:
  explicit Cuda(int dev) : dev_(dev) {
    OnDevice on(dev_);
    load_kernels();
    check(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, dev_), "cudaDeviceGetAttribute");
  }
  const char* name() const override { return "cuda"; }
  int device() const override { return dev_; }
  void* alloc(size_t bytes) override {
    OnDevice on(dev_);
    void* p = nullptr;
    check(cudaMalloc(&p, std::max<size_t>(bytes, 1)), "cudaMalloc");
    check(cudaMemset(p, 0, std::max<size_t>(bytes, 1)), "cudaMemset");
    return p;
  }
  void release(void* p) override {
    if (!p) return;
    OnDevice on(dev_);
    cudaFree(p);
  }
  void* alloc_host(size_t bytes, void** device_view) override {
    OnDevice on(dev_);
    void* p = nullptr;
    check(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
    std::memset(p, 0, bytes);
    check(cudaHostGetDevicePointer(device_view, p, 0), "cudaHostGetDevicePointer");
    return p;
  }
  void release_host(void* p) override {
    if (p) cudaFreeHost(p);
  }
  void upload(void* dst, const void* src, size_t bytes) override {
    OnDevice on(dev_);
    check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy (plan upload)");
  }
  void* alloc_async(size_t bytes, void* stream) override {
    OnDevice on(dev_);
    auto s = static_cast<cudaStream_t>(stream);
    void* p = nullptr;
    check(cudaMallocAsync(&p, std::max<size_t>(bytes, 1), s), "cudaMallocAsync");
    check(cudaMemsetAsync(p, 0, std::max<size_t>(bytes, 1), s), "cudaMemsetAsync");
    return p;
  }
  void release_async(void* p, void* stream) override {
    if (!p) return;
    OnDevice on(dev_);
    check(cudaFreeAsync(p, static_cast<cudaStream_t>(stream)), "cudaFreeAsync");
  }
  void upload_async(void* dst, const void* src, size_t bytes, void* stream) override {
    OnDevice on(dev_);
    // From pageable memory: returns once `src` is staged, so the caller may reuse it.
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)),
          "cudaMemcpyAsync (plan upload)");
  }
  std::vector<unsigned char> share(void* p) override {
    OnDevice on(dev_);
    cudaIpcMemHandle_t h;
    check(cudaIpcGetMemHandle(&h, p), "cudaIpcGetMemHandle");
    std::vector<unsigned char> out(sizeof(h));
    std::memcpy(out.data(), &h, sizeof(h));
    return out;
  }
  void* open(const std::vector<unsigned char>& handle, int) override {
    TUTTI_CHECK(handle.size() == sizeof(cudaIpcMemHandle_t), InvalidUsage,
                "a peer's device memory handle has {} bytes, not a CUDA IPC handle's {}", handle.size(),
                sizeof(cudaIpcMemHandle_t));
    OnDevice on(dev_);
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* p = nullptr;
    check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle (a peer's FIFOs)");
    return p;
  }
  void close(void* p) override {
    OnDevice on(dev_);
    cudaIpcCloseMemHandle(p);
  }
  void reach(int owner) override {
    OnDevice on(dev_);
    int ok = 0;
    check(cudaDeviceCanAccessPeer(&ok, dev_, owner), "cudaDeviceCanAccessPeer");
    TUTTI_CHECK(ok, InvalidUsage,
                "GPU {} cannot access GPU {}'s memory (no peer access); host staging between them is not supported yet",
                dev_, owner);
    cudaError_t rc = cudaDeviceEnablePeerAccess(owner, 0);
    if (rc == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
    else check(rc, "cudaDeviceEnablePeerAccess");
  }
  void launch(const LaunchArgs& args, int threads, void* stream) override {
    OnDevice on(dev_);
    InterpretKernel kernel = interpreter_for(args.type);
    kernel<<<static_cast<unsigned>(args.nblocks * args.instances), static_cast<unsigned>(threads), 0,
             static_cast<cudaStream_t>(stream)>>>(args);
    check(cudaGetLastError(), "launching the plan interpreter");
  }
  void launch_group(const std::vector<LaunchArgs>& launches, const std::vector<int>& lanes, int threads,
                    void* stream) override {
    OnDevice on(dev_);
    auto user = static_cast<cudaStream_t>(stream);
    int nlanes = 0;
    for (int l : lanes) nlanes = std::max(nlanes, l + 1);
    // Fork and join through events (allowed inside CUDA graph capture).
    while (static_cast<int>(lanes_.size()) < nlanes) {
      Lane lane;
      check(cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking), "cudaStreamCreate");
      check(cudaEventCreateWithFlags(&lane.done, cudaEventDisableTiming), "cudaEventCreate");
      lanes_.push_back(lane);
    }
    if (!fork_) check(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming), "cudaEventCreate");
    check(cudaEventRecord(fork_, user), "cudaEventRecord");
    for (int l = 0; l < nlanes; ++l) check(cudaStreamWaitEvent(lanes_[l].stream, fork_, 0), "cudaStreamWaitEvent");
    for (size_t i = 0; i < launches.size(); ++i) launch(launches[i], threads, lanes_[lanes[i]].stream);
    for (int l = 0; l < nlanes; ++l) {
      check(cudaEventRecord(lanes_[l].done, lanes_[l].stream), "cudaEventRecord");
      check(cudaStreamWaitEvent(user, lanes_[l].done, 0), "cudaStreamWaitEvent");
    }
  }
  ~Cuda() override {
    for (Lane& l : lanes_) {
      cudaStreamDestroy(l.stream);
      cudaEventDestroy(l.done);
    }
    if (fork_) cudaEventDestroy(fork_);
  }
  void copy(void* dst, const void* src, size_t bytes, void* stream) override {
    if (!bytes || dst == src) return;
    OnDevice on(dev_);
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)), "cudaMemcpyAsync");
  }
  void scale(DataType type, void* dst, const void* src, const void* scalar, size_t n, void* stream) override {
    if (!n) return;
    OnDevice on(dev_);
    auto s = static_cast<cudaStream_t>(stream);
    auto native = [&](auto t) {
      using T = decltype(t);
      T v;
      std::memcpy(&v, scalar, sizeof(T));
      scale_native<T><<<grid_for(n), 256, 0, s>>>(static_cast<T*>(dst), static_cast<const T*>(src), v, n);
    };
    auto mini = [&](auto f) {
      using F = decltype(f);
      typename F::Bits b;
      std::memcpy(&b, scalar, sizeof(b));
      scale_mini<F><<<grid_for(n), 256, 0, s>>>(static_cast<typename F::Bits*>(dst),
                                                 static_cast<const typename F::Bits*>(src), F::load(b), n);
    };
    by_type(type, native, mini);
    check(cudaGetLastError(), "premulsum scale");
  }
  void divide(DataType type, void* dst, const void* src, uint64_t d, size_t n, void* stream) override {
    if (!n) return;
    OnDevice on(dev_);
    auto s = static_cast<cudaStream_t>(stream);
    auto native = [&](auto t) {
      using T = decltype(t);
      divide_native<T><<<grid_for(n), 256, 0, s>>>(static_cast<T*>(dst), static_cast<const T*>(src), d, n);
    };
    auto mini = [&](auto f) {
      using F = decltype(f);
      divide_mini<F><<<grid_for(n), 256, 0, s>>>(static_cast<typename F::Bits*>(dst),
                                                  static_cast<const typename F::Bits*>(src), d, n);
    };
    by_type(type, native, mini);
    check(cudaGetLastError(), "avg division");
  }
  void synchronize(void* stream) override {
    OnDevice on(dev_);
    if (stream) check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
    else check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  void host_callback(void* stream, void (*fn)(void*), void* arg) override {
    OnDevice on(dev_);
    check(cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), fn, arg), "cudaLaunchHostFunc");
  }
  void wait_flag(void* stream, const uint64_t* flag, uint64_t target, const volatile int32_t* abort) override {
    OnDevice on(dev_);
    wait_flag_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(flag, target, abort);
    check(cudaGetLastError(), "host staging's wait");
  }
  bool capturing(void* stream) override {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &st), "cudaStreamIsCapturing");
    return st != cudaStreamCaptureStatusNone;
  }
  int resident_blocks(int threads) override {
    // The fewest over the types: every block of a launch must be resident at once, whatever its type.
    int fewest = 0;
    for (int t = 0; t < kNumDataTypes; ++t) {
      int per_sm = 0;
      check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, interpreter_for(t), threads, 0), "occupancy");
      fewest = t == 0 ? per_sm : std::min(fewest, per_sm);
    }
    return fewest * sms_;
  }
  int processors() override { return sms_; }

 private:
  struct Lane {
    cudaStream_t stream = nullptr;
    cudaEvent_t done = nullptr;
  };
  // With CUDA's lazy loading (the default), the first launch of a kernel loads it, and loading
  // waits for the kernels running on the device. A rank's first scale or division would then wait
  // for another rank's interpreter, which waits for this rank: measured on an H200 as a hang at
  // the first avg of a type sweep, gone with CUDA_MODULE_LOADING=EAGER. So every kernel is loaded
  // when the backend is made, before any collective runs.
  static void load_kernels() {
    static std::once_flag once;
    std::call_once(once, [] {
      cudaFuncAttributes attr;
      auto load = [&](const void* f) { check(cudaFuncGetAttributes(&attr, f), "loading the kernels"); };
      for (int t = 0; t < kNumDataTypes; ++t) load(reinterpret_cast<const void*>(interpreter_for(t)));
      load(reinterpret_cast<const void*>(&wait_flag_kernel));
      auto native = [&](auto t) {
        using T = decltype(t);
        load(reinterpret_cast<const void*>(&scale_native<T>));
        load(reinterpret_cast<const void*>(&divide_native<T>));
      };
      auto mini = [&](auto f) {
        using F = decltype(f);
        load(reinterpret_cast<const void*>(&scale_mini<F>));
        load(reinterpret_cast<const void*>(&divide_mini<F>));
      };
      for (int t = 0; t < kNumDataTypes; ++t) by_type(static_cast<DataType>(t), native, mini);
    });
  }
  int dev_ = 0;
  int sms_ = 1;
  std::vector<Lane> lanes_;
  cudaEvent_t fork_ = nullptr;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device) { return std::make_unique<Cuda>(device); }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

int cuda_current_device() {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return d;
}

MemoryKind memory_kind(const void* p) {
  if (!p) return MemoryKind::kHost;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return MemoryKind::kHost;
  }
  if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) return MemoryKind::kDevice;
  return MemoryKind::kHost;
}

}  // namespace tutti::device
