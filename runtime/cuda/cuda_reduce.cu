#include <cuda_runtime.h>

#include "core/element.hpp"
#include "core/error.hpp"
#include "runtime/cuda/cuda_reduce.hpp"

namespace tutti::cuda {
namespace {

void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) throw Error(ErrorKind::kSystem, fmt::format("{}: {}", what, cudaGetErrorString(rc)));
}

template <class T>
__device__ T apply(int op, T a, T b) {
  switch (static_cast<RedOp>(op)) {
    case RedOp::kProd: return element::op_prod(a, b);
    case RedOp::kMin: return element::op_min(a, b);
    case RedOp::kMax: return element::op_max(a, b);
    default: return element::op_sum(a, b);
  }
}

template <class T>
__global__ void combine_native(int op, T* dst, const T* a, const T* b, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = apply(op, a[i], b[i]);
}

template <class F>
__global__ void combine_mini(int op, typename F::Bits* dst, const typename F::Bits* a, const typename F::Bits* b,
                             size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = F::store(apply<float>(op, F::load(a[i]), F::load(b[i])));
}

template <class T>
void launch_native(int op, void* dst, const void* a, const void* b, size_t n) {
  unsigned blocks = static_cast<unsigned>(std::min<size_t>((n + 255) / 256, 4096));
  combine_native<T><<<blocks, 256>>>(op, static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b), n);
}

template <class F>
void launch_mini(int op, void* dst, const void* a, const void* b, size_t n) {
  using Bits = typename F::Bits;
  unsigned blocks = static_cast<unsigned>(std::min<size_t>((n + 255) / 256, 4096));
  combine_mini<F><<<blocks, 256>>>(op, static_cast<Bits*>(dst), static_cast<const Bits*>(a),
                                   static_cast<const Bits*>(b), n);
}

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

void combine(RedOp op, DataType type, void* dst, const void* a, const void* b, size_t count) {
  TUTTI_CHECK(is_valid(type), InvalidArgument, "cuda combine: invalid datatype {}", static_cast<int>(type));
  TUTTI_CHECK(is_valid(op), InvalidArgument, "cuda combine: invalid operator {}", static_cast<int>(op));
  if (count == 0) return;
  int o = static_cast<int>(op);
  switch (type) {
    case DataType::kInt8: launch_native<int8_t>(o, dst, a, b, count); break;
    case DataType::kUint8: launch_native<uint8_t>(o, dst, a, b, count); break;
    case DataType::kInt32: launch_native<int32_t>(o, dst, a, b, count); break;
    case DataType::kUint32: launch_native<uint32_t>(o, dst, a, b, count); break;
    case DataType::kInt64: launch_native<int64_t>(o, dst, a, b, count); break;
    case DataType::kUint64: launch_native<uint64_t>(o, dst, a, b, count); break;
    case DataType::kFloat32: launch_native<float>(o, dst, a, b, count); break;
    case DataType::kFloat64: launch_native<double>(o, dst, a, b, count); break;
    case DataType::kFloat16: launch_mini<element::HalfT>(o, dst, a, b, count); break;
    case DataType::kBfloat16: launch_mini<element::Bf16T>(o, dst, a, b, count); break;
    case DataType::kFp8E4M3: launch_mini<element::E4M3T>(o, dst, a, b, count); break;
    case DataType::kFp8E5M2: launch_mini<element::E5M2T>(o, dst, a, b, count); break;
  }
  check(cudaGetLastError(), "cuda combine: kernel launch");
  check(cudaDeviceSynchronize(), "cuda combine: kernel");
}

}  // namespace tutti::cuda
