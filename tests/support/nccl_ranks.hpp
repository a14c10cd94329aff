#pragma once
// Ranks of an NCCL-API communicator as threads of this test process.
#include <gtest/gtest.h>

#include <functional>
#include <thread>
#include <vector>

#include "collectives/include/nccl.h"

namespace tutti::test_support {

// Runs fn(rank, comm) on one thread per rank over a fresh communicator, destroyed afterwards.
inline void on_nccl_ranks(int n, const std::function<void(int, ncclComm_t)>& fn) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      ncclComm_t comm;
      ASSERT_EQ(ncclCommInitRank(&comm, n, id, r), ncclSuccess) << ncclGetLastError(nullptr);
      fn(r, comm);
      EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
    });
  for (auto& t : threads) t.join();
}

}  // namespace tutti::test_support
