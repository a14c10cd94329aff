// The CUDA reduction kernels against the CPU kernels, bit for bit. Needs a GPU: without one the
// tests skip with a message (the build itself proves the CUDA code compiles).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/element.hpp"
#include "core/reduce.hpp"
#include "runtime/cuda/cuda_reduce.hpp"

using namespace tutti;

TEST(Cuda, CombineMatchesCpuForEveryTypeAndOp) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  const size_t n = 100003;
  std::mt19937_64 rng(3);
  for (int t = 0; t < kNumDataTypes; ++t) {
    auto type = static_cast<DataType>(t);
    size_t bytes = n * size_of(type);
    std::vector<unsigned char> a(bytes), b(bytes), want(bytes), got(bytes);
    for (size_t i = 0; i < n; ++i) {
      // Small exactly representable values in every type.
      float x = static_cast<float>(static_cast<int>(rng() % 15) - 7), y = static_cast<float>(static_cast<int>(rng() % 15) - 7);
      auto put = [&](std::vector<unsigned char>& v, float f) {
        switch (type) {
          case DataType::kFloat32: std::memcpy(&v[i * 4], &f, 4); break;
          case DataType::kFloat64: { double d = f; std::memcpy(&v[i * 8], &d, 8); break; }
          case DataType::kFloat16: { uint16_t h = element::float_to_half(f); std::memcpy(&v[i * 2], &h, 2); break; }
          case DataType::kBfloat16: { uint16_t h = element::float_to_bf16(f); std::memcpy(&v[i * 2], &h, 2); break; }
          case DataType::kFp8E4M3: v[i] = element::float_to_e4m3(f); break;
          case DataType::kFp8E5M2: v[i] = element::float_to_e5m2(f); break;
          default: { int64_t k = static_cast<int64_t>(f); std::memcpy(&v[i * size_of(type)], &k, size_of(type)); }
        }
      };
      put(a, x);
      put(b, y);
    }
    for (RedOp op : {RedOp::kSum, RedOp::kProd, RedOp::kMin, RedOp::kMax}) {
      combine(op, type, want.data(), a.data(), b.data(), n);
      void *da, *db, *dd;
      ASSERT_EQ(cudaMalloc(&da, bytes), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&db, bytes), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&dd, bytes), cudaSuccess);
      cudaMemcpy(da, a.data(), bytes, cudaMemcpyHostToDevice);
      cudaMemcpy(db, b.data(), bytes, cudaMemcpyHostToDevice);
      cuda::combine(op, type, dd, da, db, n);
      cudaMemcpy(got.data(), dd, bytes, cudaMemcpyDeviceToHost);
      cudaFree(da);
      cudaFree(db);
      cudaFree(dd);
      ASSERT_EQ(std::memcmp(got.data(), want.data(), bytes), 0) << name(type) << " " << name(op);
    }
  }
}
