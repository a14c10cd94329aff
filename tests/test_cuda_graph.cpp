// Collectives on device buffers captured in a CUDA graph and replayed (DESIGN.md §4): nothing an
// enqueued collective does synchronizes with the host and its flags carry epochs kept in device
// memory, so every replay must give the result of a fresh call. Ranks are threads sharing GPU 0
// through tutti's libnccl. Needs a GPU: without one the test skips with a message (the build proves
// it compiles against the NCCL API).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <string>
#include <thread>
#include <vector>

namespace {

int gpus() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x
#define NCCL_OK(x) ASSERT_EQ((x), ncclSuccess) << #x << ": " << ncclGetLastError(nullptr)

// Rank r's element i in replay k: small integers, so any order of summation is exact in float.
float value(int r, size_t i, int k) { return static_cast<float>((r + 1) * (k + 1) + static_cast<int>(i % 13)); }

void rank_main(ncclComm_t comm, int rank, int nranks, size_t count) {
  CUDA_OK(cudaSetDevice(0));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  float *in = nullptr, *out = nullptr, *gathered = nullptr;
  CUDA_OK(cudaMalloc(&in, count * sizeof(float)));
  CUDA_OK(cudaMalloc(&out, count * sizeof(float)));
  CUDA_OK(cudaMalloc(&gathered, count * nranks * sizeof(float)));
  std::vector<float> host(count);
  // A first call of each collective uploads its plan (refused inside a capture).
  NCCL_OK(ncclAllReduce(in, out, count, ncclFloat32, ncclSum, comm, stream));
  NCCL_OK(ncclAllGather(in, gathered, count, ncclFloat32, comm, stream));
  CUDA_OK(cudaStreamSynchronize(stream));

  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  NCCL_OK(ncclAllReduce(in, out, count, ncclFloat32, ncclSum, comm, stream));
  NCCL_OK(ncclAllGather(in, gathered, count, ncclFloat32, comm, stream));
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  for (int k = 0; k < 3; ++k) {
    for (size_t i = 0; i < count; ++i) host[i] = value(rank, i, k);
    CUDA_OK(cudaMemcpyAsync(in, host.data(), count * sizeof(float), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaMemcpy(host.data(), out, count * sizeof(float), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int q = 0; q < nranks; ++q) want += value(q, i, k);
      ASSERT_EQ(host[i], want) << "all_reduce, replay " << k << ", rank " << rank << ", element " << i;
    }
    std::vector<float> all(count * nranks);
    CUDA_OK(cudaMemcpy(all.data(), gathered, all.size() * sizeof(float), cudaMemcpyDeviceToHost));
    for (int q = 0; q < nranks; ++q)
      for (size_t i = 0; i < count; ++i)
        ASSERT_EQ(all[q * count + i], value(q, i, k)) << "all_gather, replay " << k << ", rank " << rank;
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaFree(in));
  CUDA_OK(cudaFree(out));
  CUDA_OK(cudaFree(gathered));
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST(CudaGraph, CapturedCollectivesReplayWithFreshResults) {
  if (gpus() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  const int nranks = 2;
  // LL-sized and Simple-sized calls (the dispatcher picks LL up to 64 KiB on a device).
  for (size_t count : {size_t{1000}, size_t{1} << 20}) {
    SCOPED_TRACE("count " + std::to_string(count));
    std::vector<ncclComm_t> comms(nranks);
    std::vector<int> devs(nranks, 0);  // tutti lets ranks share a GPU
    NCCL_OK(ncclCommInitAll(comms.data(), nranks, devs.data()));
    std::vector<std::thread> threads;
    for (int r = 0; r < nranks; ++r) threads.emplace_back([&, r] { rank_main(comms[r], r, nranks, count); });
    for (auto& t : threads) t.join();
    for (auto c : comms) NCCL_OK(ncclCommDestroy(c));
  }
}

}  // namespace
