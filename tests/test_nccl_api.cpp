// The NCCL API as NCCL documents its usage: one rank per thread, one thread driving several ranks,
// groups of send/recv for all-to-all, gather and scatter, in-place variants, reduction operators,
// bad calls, abort, non-blocking communicators, split, and memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <utility>
#include <latch>
#include <thread>
#include <vector>

#include "collectives/include/nccl.h"
#include "support/env.hpp"
#include "support/nccl_ranks.hpp"

namespace {

using tutti::test_support::on_nccl_ranks;

// n communicators made at once on threads, for tests that drive (or destroy) them unevenly.
std::vector<ncclComm_t> comms_made_on_threads(int n) {
  ncclUniqueId id;
  EXPECT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  std::vector<ncclComm_t> comms(n);
  std::vector<std::thread> init;
  for (int r = 0; r < n; ++r) init.emplace_back([&, r] { EXPECT_EQ(ncclCommInitRank(&comms[r], n, id, r), ncclSuccess); });
  for (auto& t : init) t.join();
  return comms;
}

TEST(NcclApi, VersionAndErrorStrings) {
  int v = 0;
  EXPECT_EQ(ncclGetVersion(&v), ncclSuccess);
  EXPECT_EQ(v, NCCL_VERSION_CODE);
  EXPECT_EQ(NCCL_VERSION_CODE, NCCL_VERSION(2, 28, 9));
  // NCCL 2.28's config layout, field for field (programs built against NVIDIA's header pass theirs).
  EXPECT_EQ(offsetof(ncclConfig_t, blocking), 16u);
  EXPECT_EQ(offsetof(ncclConfig_t, commName), 48u);
  EXPECT_EQ(offsetof(ncclConfig_t, nvlinkCentricSched), 76u);
  EXPECT_EQ(sizeof(ncclConfig_t), 80u);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  EXPECT_EQ(config.version, static_cast<unsigned>(NCCL_VERSION_CODE));
  EXPECT_EQ(config.nvlinkCentricSched, NCCL_CONFIG_UNDEF_INT);
  EXPECT_STREQ(ncclGetErrorString(ncclSuccess), "no error");
  EXPECT_STREQ(ncclGetErrorString(ncclInProgress), "NCCL operation in progress");
  EXPECT_STREQ(ncclGetErrorString(static_cast<ncclResult_t>(99)), "unknown result code");
  EXPECT_EQ(sizeof(ncclUniqueId), 128u);
  EXPECT_EQ(ncclGetVersion(nullptr), ncclInvalidArgument);
}

TEST(NcclApi, OneRankPerThreadEveryCollective) {
  const int n = 4, count = 1001;
  on_nccl_ranks(n, [&](int r, ncclComm_t comm) {
    std::vector<float> in(count * n), out(count * n);
    for (int i = 0; i < count * n; ++i) in[i] = static_cast<float>(r * 3 + i % 5);
    ASSERT_EQ(ncclAllReduce(in.data(), out.data(), count, ncclFloat, ncclSum, comm, nullptr), ncclSuccess);
    for (int i = 0; i < count; ++i) ASSERT_EQ(out[i], 3.0f * (n * (n - 1) / 2) + n * (i % 5));
    ASSERT_EQ(ncclBroadcast(in.data(), out.data(), count, ncclFloat, 2, comm, nullptr), ncclSuccess);
    for (int i = 0; i < count; ++i) ASSERT_EQ(out[i], static_cast<float>(6 + i % 5));
    std::vector<float> b(in.begin(), in.begin() + count);
    ASSERT_EQ(ncclBcast(b.data(), count, ncclFloat, 1, comm, nullptr), ncclSuccess);
    for (int i = 0; i < count; ++i) ASSERT_EQ(b[i], static_cast<float>(3 + i % 5));
    std::fill(out.begin(), out.end(), -1.0f);
    ASSERT_EQ(ncclReduce(in.data(), out.data(), count, ncclFloat, ncclMax, 3, comm, nullptr), ncclSuccess);
    if (r == 3) {
      for (int i = 0; i < count; ++i) ASSERT_EQ(out[i], static_cast<float>(9 + i % 5));
    } else {
      ASSERT_EQ(out[0], -1.0f);  // NCCL leaves non-root receive buffers alone
    }
    ASSERT_EQ(ncclAllGather(in.data(), out.data(), count, ncclFloat, comm, nullptr), ncclSuccess);
    for (int q = 0; q < n; ++q)
      for (int i = 0; i < count; ++i) ASSERT_EQ(out[q * count + i], static_cast<float>(q * 3 + i % 5));
    ASSERT_EQ(ncclReduceScatter(in.data(), out.data(), count, ncclFloat, ncclSum, comm, nullptr), ncclSuccess);
    for (int i = 0; i < count; ++i) ASSERT_EQ(out[i], 3.0f * (n * (n - 1) / 2) + n * ((r * count + i) % 5));
  });
}

TEST(NcclApi, InPlaceVariantsAsNcclDefinesThem) {
  const int n = 3, count = 77;
  on_nccl_ranks(n, [&](int r, ncclComm_t comm) {
    std::vector<int32_t> buf(count * n);
    for (int i = 0; i < count; ++i) buf[r * count + i] = r * 100 + i;
    // All-gather in place: sendbuff = recvbuff + rank * count.
    ASSERT_EQ(ncclAllGather(buf.data() + r * count, buf.data(), count, ncclInt32, comm, nullptr), ncclSuccess);
    for (int q = 0; q < n; ++q)
      for (int i = 0; i < count; ++i) ASSERT_EQ(buf[q * count + i], q * 100 + i);
    // Reduce-scatter in place: recvbuff = sendbuff + rank * recvcount.
    ASSERT_EQ(ncclReduceScatter(buf.data(), buf.data() + r * count, count, ncclInt32, ncclSum, comm, nullptr), ncclSuccess);
    for (int i = 0; i < count; ++i) ASSERT_EQ(buf[r * count + i], n * (r * 100 + i));
    // All-reduce in place.
    std::vector<int32_t> x(count, r + 1);
    ASSERT_EQ(ncclAllReduce(x.data(), x.data(), count, ncclInt32, ncclProd, comm, nullptr), ncclSuccess);
    for (int i = 0; i < count; ++i) ASSERT_EQ(x[i], 6);
  });
}

TEST(NcclApi, OneThreadDrivesSeveralRanksInAGroup) {
  const int n = 3;
  std::vector<ncclComm_t> comms(n);
  ASSERT_EQ(ncclCommInitAll(comms.data(), n, nullptr), ncclSuccess);
  std::vector<std::vector<double>> bufs(n, std::vector<double>(500));
  for (int r = 0; r < n; ++r) std::fill(bufs[r].begin(), bufs[r].end(), r + 0.5);
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  for (int r = 0; r < n; ++r)
    ASSERT_EQ(ncclAllReduce(bufs[r].data(), bufs[r].data(), 500, ncclDouble, ncclSum, comms[r], nullptr), ncclSuccess);
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
  for (int r = 0; r < n; ++r) EXPECT_EQ(bufs[r][499], 4.5);
  int dev = 7, count = 0;
  EXPECT_EQ(ncclCommCuDevice(comms[1], &dev), ncclSuccess);
  EXPECT_EQ(dev, 1);
  EXPECT_EQ(ncclCommCount(comms[2], &count), ncclSuccess);
  EXPECT_EQ(count, 3);
  for (auto c : comms) EXPECT_EQ(ncclCommDestroy(c), ncclSuccess);
}

// NCCL's documented pattern for one thread creating several ranks: ncclCommInitRank inside a group,
// connected together at ncclGroupEnd (called one by one, the first would wait for the others).
TEST(NcclApi, OneThreadInitsSeveralRanksWithInitRankInAGroup) {
  const int n = 3;
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  std::vector<ncclComm_t> comms(n, nullptr);
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  for (int r = 0; r < n; ++r) ASSERT_EQ(ncclCommInitRank(&comms[r], n, id, r), ncclSuccess) << ncclGetLastError(nullptr);
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess) << ncclGetLastError(nullptr);
  for (int r = 0; r < n; ++r) {
    int rank = -1;
    ASSERT_EQ(ncclCommUserRank(comms[r], &rank), ncclSuccess);
    EXPECT_EQ(rank, r);
    ncclResult_t async = ncclInternalError;
    ASSERT_EQ(ncclCommGetAsyncError(comms[r], &async), ncclSuccess);
    EXPECT_EQ(async, ncclSuccess);
  }
  std::vector<std::vector<float>> bufs(n, std::vector<float>(1000));
  for (int r = 0; r < n; ++r) std::fill(bufs[r].begin(), bufs[r].end(), static_cast<float>(r + 1));
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  for (int r = 0; r < n; ++r)
    ASSERT_EQ(ncclAllReduce(bufs[r].data(), bufs[r].data(), 1000, ncclFloat, ncclSum, comms[r], nullptr), ncclSuccess);
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
  for (int r = 0; r < n; ++r) EXPECT_EQ(bufs[r][999], 6.0f);
  for (auto c : comms) EXPECT_EQ(ncclCommDestroy(c), ncclSuccess);
}

// ncclCommShrink: the ranks that remain make a new communicator without the excluded one, which
// does not take part.
TEST(NcclApi, ShrinkMakesACommunicatorOfTheRemainingRanks) {
  const int n = 4, gone = 2;
  std::vector<ncclComm_t> comms(n), shrunk(n, nullptr);
  ASSERT_EQ(ncclCommInitAll(comms.data(), n, nullptr), ncclSuccess);
  std::vector<std::thread> threads;
  std::vector<float> result(n, -1);
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      if (r == gone) return;
      int exclude[] = {gone};
      ASSERT_EQ(ncclCommShrink(comms[r], exclude, 1, &shrunk[r], nullptr, NCCL_SHRINK_DEFAULT), ncclSuccess)
          << ncclGetLastError(nullptr);
      int size = 0, rank = -1;
      ncclCommCount(shrunk[r], &size);
      ncclCommUserRank(shrunk[r], &rank);
      EXPECT_EQ(size, n - 1);
      EXPECT_EQ(rank, r < gone ? r : r - 1);
      float x = static_cast<float>(r);
      ASSERT_EQ(ncclAllReduce(&x, &result[r], 1, ncclFloat, ncclSum, shrunk[r], nullptr), ncclSuccess);
      int self[] = {r};
      ncclComm_t none = nullptr;
      EXPECT_EQ(ncclCommShrink(shrunk[r], self, 1, &none, nullptr, NCCL_SHRINK_DEFAULT), ncclInvalidArgument);
      EXPECT_EQ(ncclCommShrink(shrunk[r], nullptr, 0, &none, nullptr, 0x10), ncclInvalidArgument);  // unknown flag
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    if (r != gone) {
      EXPECT_EQ(result[r], 0.0f + 1.0f + 3.0f) << "rank " << r;
    }
  }
  for (int r = 0; r < n; ++r) {
    if (shrunk[r]) {
      EXPECT_EQ(ncclCommDestroy(shrunk[r]), ncclSuccess);
    }
  }
  for (auto c : comms) EXPECT_EQ(ncclCommDestroy(c), ncclSuccess);
}

// NCCL_SHRINK_ABORT: after a rank is lost, the survivors stop what the parent was doing and make a
// new communicator of themselves, although the parent has recorded the failure.
TEST(NcclApi, ShrinkAfterAFailureLeavesTheLostRankBehind) {
  const int n = 3, lost = 1;
  std::vector<ncclComm_t> comms(n);
  ASSERT_EQ(ncclCommInitAll(comms.data(), n, nullptr), ncclSuccess);
  // The survivors are in an all-reduce the lost rank never joins; it aborts (as a crashed rank's
  // peers see it: the failure reaches them).
  std::vector<ncclResult_t> stuck_result(n, ncclSuccess);
  std::vector<std::thread> stuck;
  std::latch entering(n - 1);
  for (int r = 0; r < n; ++r)
    if (r != lost)
      stuck.emplace_back([&, r] {
        std::vector<float> x(1000);
        entering.count_down();
        stuck_result[r] = ncclAllReduce(x.data(), x.data(), 1000, ncclFloat, ncclSum, comms[r], nullptr);
      });
  entering.wait();
  ASSERT_EQ(ncclCommAbort(comms[lost]), ncclSuccess);
  for (auto& t : stuck) t.join();
  std::vector<ncclComm_t> shrunk(n, nullptr);
  std::vector<float> sums(n, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    if (r != lost)
      threads.emplace_back([&, r] {
        EXPECT_EQ(stuck_result[r], ncclRemoteError);
        int exclude[] = {lost};
        ASSERT_EQ(ncclCommShrink(comms[r], exclude, 1, &shrunk[r], nullptr, NCCL_SHRINK_ABORT), ncclSuccess)
            << ncclGetLastError(nullptr);
        float x = static_cast<float>(r + 1);
        ASSERT_EQ(ncclAllReduce(&x, &sums[r], 1, ncclFloat, ncclSum, shrunk[r], nullptr), ncclSuccess);
      });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    if (r == lost) continue;
    EXPECT_EQ(sums[r], 1.0f + 3.0f) << "rank " << r;
    EXPECT_EQ(ncclCommDestroy(shrunk[r]), ncclSuccess);
    EXPECT_EQ(ncclCommDestroy(comms[r]), ncclSuccess);
  }
}

// ncclCommRevoke: calls in progress give up, the communicator is good only for destroy, split and
// shrink, and a split of it works.
TEST(NcclApi, RevokeStopsCallsAndLeavesSplitWorking) {
  const int n = 3;
  std::vector<ncclComm_t> comms(n);
  ASSERT_EQ(ncclCommInitAll(comms.data(), n, nullptr), ncclSuccess);
  // Ranks 1 and 2 enter an all-reduce that rank 0 never joins.
  std::vector<ncclResult_t> results(n, ncclSuccess);
  std::vector<std::string> errors(n);
  std::vector<std::thread> stuck;
  std::latch entering(n - 1);  // usually the calls are waiting when the revoke comes; either way they fail
  for (int r = 1; r < n; ++r)
    stuck.emplace_back([&, r] {
      std::vector<float> x(1000);
      entering.count_down();
      results[r] = ncclAllReduce(x.data(), x.data(), 1000, ncclFloat, ncclSum, comms[r], nullptr);
      errors[r] = ncclGetLastError(comms[r]);
    });
  entering.wait();
  for (int r = 0; r < n; ++r) EXPECT_EQ(ncclCommRevoke(comms[r], NCCL_REVOKE_DEFAULT), ncclSuccess);
  for (auto& t : stuck) t.join();
  for (int r = 1; r < n; ++r) {
    EXPECT_NE(results[r], ncclSuccess);
    EXPECT_NE(errors[r].find("revoked"), std::string::npos) << errors[r];
  }
  for (int r = 0; r < n; ++r) {
    ncclResult_t state = ncclInProgress;
    ASSERT_EQ(ncclCommGetAsyncError(comms[r], &state), ncclSuccess);
    EXPECT_EQ(state, ncclSuccess);  // every call has left
    float x = 1;
    EXPECT_EQ(ncclAllReduce(&x, &x, 1, ncclFloat, ncclSum, comms[r], nullptr), ncclInvalidUsage);
  }
  EXPECT_EQ(ncclCommRevoke(comms[0], 7), ncclInvalidArgument);
  std::vector<ncclComm_t> fresh(n, nullptr);
  std::vector<float> sums(n, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      ASSERT_EQ(ncclCommSplit(comms[r], 0, r, &fresh[r], nullptr), ncclSuccess) << ncclGetLastError(nullptr);
      float x = static_cast<float>(r + 1);
      ASSERT_EQ(ncclAllReduce(&x, &sums[r], 1, ncclFloat, ncclSum, fresh[r], nullptr), ncclSuccess);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(sums[r], 6.0f);
  for (auto c : fresh) EXPECT_EQ(ncclCommDestroy(c), ncclSuccess);
  for (auto c : comms) EXPECT_EQ(ncclCommDestroy(c), ncclSuccess);
}

// ncclCommAbort stops a non-blocking init that waits in the rendezvous for a rank that never comes
// (the init timeout is set far beyond the test's own, so only the abort can end the wait).
TEST(NcclApi, AbortStopsANonBlockingInitWaitingForItsPeers) {
  tutti::test_support::ScopedEnv env({{"TUTTI_INIT_TIMEOUT", "3600"}});
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t comm = nullptr;
  ASSERT_EQ(ncclCommInitRankConfig(&comm, 2, id, 0, &cfg), ncclInProgress);  // rank 1 never inits
  ncclResult_t state = ncclSuccess;
  ASSERT_EQ(ncclCommGetAsyncError(comm, &state), ncclSuccess);
  EXPECT_EQ(state, ncclInProgress);
  EXPECT_EQ(ncclCommAbort(comm), ncclSuccess);
}

// One thread, one group, a non-blocking and a blocking communicator: the blocking one's call is done
// when ncclGroupEnd returns, the non-blocking one's when its async state says so.
TEST(NcclApi, AGroupMixingBlockingAndNonBlockingCommunicators) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  std::vector<ncclComm_t> comms(2);
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  ncclConfig_t nonblocking = NCCL_CONFIG_INITIALIZER;
  nonblocking.blocking = 0;
  ASSERT_EQ(ncclCommInitRankConfig(&comms[0], 2, id, 0, &nonblocking), ncclSuccess);
  ASSERT_EQ(ncclCommInitRank(&comms[1], 2, id, 1), ncclSuccess);
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
  std::vector<float> a(4096, 1.0f), b(4096, 2.0f);  // above the mailbox: plans, on threads
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  ASSERT_EQ(ncclAllReduce(a.data(), a.data(), a.size(), ncclFloat, ncclSum, comms[0], nullptr), ncclSuccess);
  ASSERT_EQ(ncclAllReduce(b.data(), b.data(), b.size(), ncclFloat, ncclSum, comms[1], nullptr), ncclSuccess);
  ncclResult_t end = ncclGroupEnd();
  ASSERT_TRUE(end == ncclSuccess || end == ncclInProgress) << end;
  EXPECT_EQ(b[4095], 3.0f);  // the blocking communicator's call is done
  ncclResult_t state;
  do ASSERT_EQ(ncclCommGetAsyncError(comms[0], &state), ncclSuccess);
  while (state == ncclInProgress);
  EXPECT_EQ(state, ncclSuccess);
  EXPECT_EQ(a[4095], 3.0f);
  for (auto c : comms) EXPECT_EQ(ncclCommDestroy(c), ncclSuccess);
}

// A call that fails inside a group fails the group: ncclGroupEnd returns the first failure and runs
// nothing, so no peer is left waiting for a call that was dropped.
TEST(NcclApi, AFailedCallInAGroupFailsTheGroup) {
  const int n = 2;
  std::vector<ncclComm_t> comms(n);
  ASSERT_EQ(ncclCommInitAll(comms.data(), n, nullptr), ncclSuccess);
  std::vector<float> x(16, 1.0f), y(16, 1.0f);
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  EXPECT_EQ(ncclAllReduce(x.data(), x.data(), 16, ncclFloat, ncclSum, comms[0], nullptr), ncclSuccess);
  EXPECT_EQ(ncclAllReduce(y.data(), y.data(), 16, static_cast<ncclDataType_t>(99), ncclSum, comms[1], nullptr),
            ncclInvalidArgument);
  EXPECT_EQ(ncclGroupEnd(), ncclInvalidArgument);
  EXPECT_EQ(x[0], 1.0f);  // rank 0's all-reduce did not run (it would have waited for rank 1 forever)
  // The next group starts clean.
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  ASSERT_EQ(ncclAllReduce(x.data(), x.data(), 16, ncclFloat, ncclSum, comms[0], nullptr), ncclSuccess);
  ASSERT_EQ(ncclAllReduce(y.data(), y.data(), 16, ncclFloat, ncclSum, comms[1], nullptr), ncclSuccess);
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
  EXPECT_EQ(x[0], 2.0f);
  EXPECT_EQ(y[15], 2.0f);
  for (auto c : comms) EXPECT_EQ(ncclCommDestroy(c), ncclSuccess);
}

// ncclGroupSimulateEnd: the group ends without running; its time is predicted by the cost model.
TEST(NcclApi, GroupSimulateEndPredictsWithoutRunning) {
  const int n = 2;
  std::vector<ncclComm_t> comms(n);
  ASSERT_EQ(ncclCommInitAll(comms.data(), n, nullptr), ncclSuccess);
  std::vector<std::vector<float>> bufs(n, std::vector<float>(1 << 18, 1.0f));
  ncclSimInfo_t small = NCCL_SIM_INFO_INITIALIZER, large = NCCL_SIM_INFO_INITIALIZER;
  for (auto [count, info] : {std::pair{size_t{16}, &small}, std::pair{size_t{1} << 18, &large}}) {
    ASSERT_EQ(ncclGroupStart(), ncclSuccess);
    for (int r = 0; r < n; ++r)
      ASSERT_EQ(ncclAllReduce(bufs[r].data(), bufs[r].data(), count, ncclFloat, ncclSum, comms[r], nullptr), ncclSuccess);
    ASSERT_EQ(ncclGroupSimulateEnd(info), ncclSuccess) << ncclGetLastError(nullptr);
  }
  EXPECT_GT(small.estimatedTime, 0.0f);
  EXPECT_GT(large.estimatedTime, small.estimatedTime);  // a megabyte takes longer than 64 bytes
  for (int r = 0; r < n; ++r) EXPECT_EQ(bufs[r][0], 1.0f);  // nothing ran
  // Sends and receives are predicted too.
  ncclSimInfo_t p2p = NCCL_SIM_INFO_INITIALIZER;
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  ASSERT_EQ(ncclSend(bufs[0].data(), 1000, ncclFloat, 1, comms[0], nullptr), ncclSuccess);
  ASSERT_EQ(ncclRecv(bufs[1].data(), 1000, ncclFloat, 0, comms[1], nullptr), ncclSuccess);
  ASSERT_EQ(ncclGroupSimulateEnd(&p2p), ncclSuccess) << ncclGetLastError(nullptr);
  EXPECT_GT(p2p.estimatedTime, 0.0f);
  // The calls after it run normally.
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  for (int r = 0; r < n; ++r)
    ASSERT_EQ(ncclAllReduce(bufs[r].data(), bufs[r].data(), 16, ncclFloat, ncclSum, comms[r], nullptr), ncclSuccess);
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
  EXPECT_EQ(bufs[0][0], 2.0f);
  for (auto c : comms) EXPECT_EQ(ncclCommDestroy(c), ncclSuccess);
}

TEST(NcclApi, AllToAllGatherScatterThroughGroupedSendRecv) {
  const int n = 4, count = 33;
  on_nccl_ranks(n, [&](int r, ncclComm_t comm) {
    std::vector<int64_t> send(count * n), recv(count * n, -1);
    for (int q = 0; q < n; ++q)
      for (int i = 0; i < count; ++i) send[q * count + i] = r * 1000 + q * 10 + i;
    // All-to-all.
    ASSERT_EQ(ncclGroupStart(), ncclSuccess);
    for (int q = 0; q < n; ++q) {
      ASSERT_EQ(ncclSend(send.data() + q * count, count, ncclInt64, q, comm, nullptr), ncclSuccess);
      ASSERT_EQ(ncclRecv(recv.data() + q * count, count, ncclInt64, q, comm, nullptr), ncclSuccess);
    }
    ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
    for (int q = 0; q < n; ++q)
      for (int i = 0; i < count; ++i) ASSERT_EQ(recv[q * count + i], q * 1000 + r * 10 + i);
    // Gather to root 1.
    std::fill(recv.begin(), recv.end(), -1);
    ASSERT_EQ(ncclGroupStart(), ncclSuccess);
    if (r == 1) {
      for (int q = 0; q < n; ++q) ASSERT_EQ(ncclRecv(recv.data() + q * count, count, ncclInt64, q, comm, nullptr), ncclSuccess);
    }
    ASSERT_EQ(ncclSend(send.data(), count, ncclInt64, 1, comm, nullptr), ncclSuccess);
    ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
    if (r == 1) {
      for (int q = 0; q < n; ++q) ASSERT_EQ(recv[q * count], q * 1000);
    }
    // Scatter from root 2.
    ASSERT_EQ(ncclGroupStart(), ncclSuccess);
    if (r == 2) {
      for (int q = 0; q < n; ++q) ASSERT_EQ(ncclSend(send.data() + q * count, count, ncclInt64, q, comm, nullptr), ncclSuccess);
    }
    ASSERT_EQ(ncclRecv(recv.data(), count, ncclInt64, 2, comm, nullptr), ncclSuccess);
    ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
    ASSERT_EQ(recv[5], 2000 + r * 10 + 5);
  });
}

// NCCL 2.28's gather, scatter and all-to-all spelling, and windows.
TEST(NcclApi, GatherScatterAndAlltoAllOfNccl228) {
  const int n = 3, count = 17;
  on_nccl_ranks(n, [&](int r, ncclComm_t comm) {
    std::vector<int32_t> send(count * n), recv(count * n, -1);
    for (int i = 0; i < count * n; ++i) send[i] = r * 1000 + i;
    ASSERT_EQ(ncclGather(send.data(), recv.data(), count, ncclInt32, 2, comm, nullptr), ncclSuccess);
    if (r == 2) {
      for (int q = 0; q < n; ++q)
        for (int i = 0; i < count; ++i) ASSERT_EQ(recv[q * count + i], q * 1000 + i);
    }
    std::fill(recv.begin(), recv.end(), -1);
    ASSERT_EQ(ncclScatter(send.data(), recv.data(), count, ncclInt32, 1, comm, nullptr), ncclSuccess);
    for (int i = 0; i < count; ++i) ASSERT_EQ(recv[i], 1000 + r * count + i);
    ASSERT_EQ(ncclAlltoAll(send.data(), recv.data(), count, ncclInt32, comm, nullptr), ncclSuccess);
    for (int q = 0; q < n; ++q) ASSERT_EQ(recv[q * count], q * 1000 + r * count);
    EXPECT_EQ(ncclGather(send.data(), recv.data(), count, ncclInt32, n, comm, nullptr), ncclInvalidArgument);
    ncclWindow_t win = nullptr;
    ASSERT_EQ(ncclCommWindowRegister(comm, send.data(), send.size() * 4, &win, 0), ncclSuccess);
    EXPECT_NE(win, nullptr);
    EXPECT_EQ(ncclCommWindowDeregister(comm, win), ncclSuccess);
  });
}

// Gather and scatter run as plans of the dispatcher (direct_gather, direct_scatter): from every
// root, with NULL buffers where NCCL does not read them (a gather's non-root receive buffer, a
// scatter's non-root send buffer), in place (the root's part already in place), at a count the
// chunks do not divide, over shared memory, TCP and the emulated device. Bit-exact integers.
TEST(NcclApi, GatherAndScatterFromEveryRootAsPlans) {
  const int n = 3, count = 1001;
  for (const char* where : {"shm", "tcp", "emulated"}) {
    const bool device = std::string(where) == "emulated";
    tutti::test_support::ScopedEnv env({{"TUTTI_TRANSPORT", device ? "shm" : where},
                                        {"TUTTI_DEVICE", device ? "emulated" : nullptr},
                                        {"TUTTI_TIMEOUT", "120"}});
    on_nccl_ranks(n, [&](int r, ncclComm_t comm) {
      for (int root = 0; root < n; ++root)
        for (bool inplace : {false, true}) {
          SCOPED_TRACE(::testing::Message() << where << " root " << root << (inplace ? " in place" : ""));
          std::vector<int32_t> mine(count), all(static_cast<size_t>(count) * n, -1);
          for (int i = 0; i < count; ++i) mine[i] = r * 100000 + i;
          // Gather: the root's part is already in its slice when in place.
          const bool root_here = r == root;
          if (inplace && root_here) std::copy(mine.begin(), mine.end(), all.begin() + r * count);
          const void* send = inplace && root_here ? static_cast<const void*>(all.data() + r * count) : mine.data();
          ASSERT_EQ(ncclGather(send, root_here ? all.data() : nullptr, count, ncclInt32, root, comm, nullptr),
                    ncclSuccess)
              << ncclGetLastError(comm);
          if (root_here) {
            for (int q = 0; q < n; ++q)
              for (int i = 0; i < count; ++i) ASSERT_EQ(all[q * count + i], q * 100000 + i) << q << " " << i;
          }
          // Scatter: part q of the root's buffer to rank q.
          for (int q = 0; q < n; ++q)
            for (int i = 0; i < count; ++i) all[q * count + i] = root * 100000 + q * 1000 + i % 1000;
          std::vector<int32_t> got(count, -1);
          void* recv = inplace && root_here ? static_cast<void*>(all.data() + r * count) : got.data();
          ASSERT_EQ(ncclScatter(root_here ? all.data() : nullptr, recv, count, ncclInt32, root, comm, nullptr),
                    ncclSuccess)
              << ncclGetLastError(comm);
          const int32_t* out = inplace && root_here ? all.data() + r * count : got.data();
          for (int i = 0; i < count; ++i) ASSERT_EQ(out[i], root * 100000 + r * 1000 + i % 1000) << i;
        }
    });
  }
}

TEST(NcclApi, PreMulSumAndAverage) {
  const int n = 3;
  on_nccl_ranks(n, [&](int r, ncclComm_t comm) {
    float scalar = 2.0f;
    ncclRedOp_t op;
    ASSERT_EQ(ncclRedOpCreatePreMulSum(&op, &scalar, ncclFloat, ncclScalarHostImmediate, comm), ncclSuccess);
    EXPECT_GE(static_cast<int>(op), static_cast<int>(ncclNumOps));
    std::vector<float> x(100, static_cast<float>(r + 1)), y(100);
    ASSERT_EQ(ncclAllReduce(x.data(), y.data(), 100, ncclFloat, op, comm, nullptr), ncclSuccess);
    EXPECT_EQ(y[99], 12.0f);
    EXPECT_EQ(ncclAllReduce(x.data(), y.data(), 100, ncclDouble, op, comm, nullptr), ncclInvalidArgument);
    ASSERT_EQ(ncclRedOpDestroy(op, comm), ncclSuccess);
    EXPECT_EQ(ncclAllReduce(x.data(), y.data(), 100, ncclFloat, op, comm, nullptr), ncclInvalidArgument);
    ASSERT_EQ(ncclAllReduce(x.data(), y.data(), 100, ncclFloat, ncclAvg, comm, nullptr), ncclSuccess);
    EXPECT_EQ(y[0], 2.0f);
  });
}

TEST(NcclApi, BadCallsReturnErrorsThatSayWhatWasWrong) {
  on_nccl_ranks(2, [&](int r, ncclComm_t comm) {
    float x[4] = {};
    EXPECT_EQ(ncclAllReduce(nullptr, x, 4, ncclFloat, ncclSum, comm, nullptr), ncclInvalidArgument);
    EXPECT_NE(std::string(ncclGetLastError(comm)).find("sendbuff is NULL with count 4"), std::string::npos);
    EXPECT_EQ(ncclAllReduce(x, x, 4, static_cast<ncclDataType_t>(42), ncclSum, comm, nullptr), ncclInvalidArgument);
    EXPECT_NE(std::string(ncclGetLastError(comm)).find("invalid datatype 42"), std::string::npos);
    EXPECT_EQ(ncclAllReduce(x, x, 4, ncclFloat, static_cast<ncclRedOp_t>(9), comm, nullptr), ncclInvalidArgument);
    EXPECT_NE(std::string(ncclGetLastError(comm)).find("invalid reduction operator 9"), std::string::npos);
    EXPECT_EQ(ncclBroadcast(x, x, 4, ncclFloat, 2, comm, nullptr), ncclInvalidArgument);
    EXPECT_NE(std::string(ncclGetLastError(comm)).find("root 2 is out of range"), std::string::npos);
    EXPECT_EQ(ncclSend(x, 4, ncclFloat, -1, comm, nullptr), ncclInvalidArgument);
    EXPECT_EQ(ncclAllReduce(x, x, 0, ncclFloat, ncclSum, comm, nullptr), ncclSuccess);  // count 0 is fine
    (void)r;
  });
  float x[4];
  ncclComm_t freed;
  {
    std::vector<ncclComm_t> comms(1);
    ASSERT_EQ(ncclCommInitAll(comms.data(), 1, nullptr), ncclSuccess);
    freed = comms[0];
    ASSERT_EQ(ncclCommDestroy(freed), ncclSuccess);
  }
  EXPECT_EQ(ncclAllReduce(x, x, 4, ncclFloat, ncclSum, freed, nullptr), ncclInvalidArgument);
  EXPECT_NE(std::string(ncclGetLastError(nullptr)).find("NULL, freed or aborted"), std::string::npos);
  EXPECT_EQ(ncclCommDestroy(freed), ncclInvalidArgument);
  EXPECT_EQ(ncclGroupEnd(), ncclInvalidUsage);
}

TEST(NcclApi, MismatchedCountsAreCaughtWithTuttiCheck) {
  std::vector<ncclResult_t> results(2);
  std::vector<std::string> errors(2);
  {
    tutti::test_support::ScopedEnv env({{"TUTTI_CHECK", "1"}});
    on_nccl_ranks(2, [&](int r, ncclComm_t comm) {
      std::vector<float> x(200);
      results[r] = ncclAllReduce(x.data(), x.data(), r == 0 ? 100 : 200, ncclFloat, ncclSum, comm, nullptr);
      errors[r] = ncclGetLastError(comm);
    });
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r], ncclInvalidArgument);
    EXPECT_NE(errors[r].find("with count"), std::string::npos) << errors[r];
  }
}

// Without TUTTI_CHECK, small calls still compare what every rank was called with (the one-shot
// mailbox carries it ahead of the data): each mismatch fails on every rank naming both calls, and
// the communicator goes on working for matching calls. A rank that reads the other's data in the
// mismatched call fails in it; a broadcast's root reads nobody (it does not wait for its
// receivers), so it fails at its next call that reads the other rank, after finishing that call.
TEST(NcclApi, MismatchedSmallCallsAreCaughtWithoutTuttiCheck) {
  struct Case {
    const char* what;
    std::function<ncclResult_t(int, ncclComm_t, float*)> call;
    const char* fragment;
    bool in_the_call;  // both ranks read each other in the mismatched call
  };
  const std::vector<Case> cases = {
      {"count",
       [](int r, ncclComm_t c, float* x) { return ncclAllReduce(x, x, r == 0 ? 4 : 6, ncclFloat, ncclSum, c, nullptr); },
       "all_reduce of 4 float (sum)", true},
      {"collective",
       [](int r, ncclComm_t c, float* x) {
         return r == 0 ? ncclAllReduce(x, x, 4, ncclFloat, ncclSum, c, nullptr)
                       : ncclBroadcast(x, x, 4, ncclFloat, 0, c, nullptr);
       },
       "broadcast of 4 float to root 0", true},
      {"op",
       [](int r, ncclComm_t c, float* x) { return ncclAllReduce(x, x, 4, ncclFloat, r == 0 ? ncclSum : ncclMax, c, nullptr); },
       "all_reduce of 4 float (max)", true},
      {"root",
       [](int r, ncclComm_t c, float* x) { return ncclBroadcast(x, x, 4, ncclFloat, r, c, nullptr); },
       "to root 1", false},
  };
  for (const Case& k : cases) {
    std::vector<ncclResult_t> results(2), next(2), after(2);
    std::vector<std::string> errors(2);
    std::vector<std::vector<float>> sums(2), later(2);
    on_nccl_ranks(2, [&](int r, ncclComm_t comm) {
      std::vector<float> x(64, 1.0f);
      results[r] = k.call(r, comm, x.data());
      if (results[r] != ncclSuccess) errors[r] = ncclGetLastError(comm);
      std::vector<float> y(4, static_cast<float>(r + 1));
      next[r] = ncclAllReduce(y.data(), y.data(), 4, ncclFloat, ncclSum, comm, nullptr);
      if (results[r] == ncclSuccess) errors[r] = ncclGetLastError(comm);
      sums[r] = y;
      std::vector<float> z(4, static_cast<float>(2 * r + 1));
      after[r] = ncclAllReduce(z.data(), z.data(), 4, ncclFloat, ncclSum, comm, nullptr);
      later[r] = z;
    });
    for (int r = 0; r < 2; ++r) {
      if (k.in_the_call) {
        EXPECT_EQ(results[r], ncclInvalidArgument) << k.what << " rank " << r;
        EXPECT_EQ(next[r], ncclSuccess) << k.what << ": the next matching call on rank " << r;
      } else {
        // Reported once, in the mismatched call or in the next one.
        EXPECT_NE(results[r] == ncclInvalidArgument, next[r] == ncclInvalidArgument) << k.what << " rank " << r;
        EXPECT_EQ(results[r] == ncclSuccess || results[r] == ncclInvalidArgument, true) << k.what;
        EXPECT_EQ(next[r] == ncclSuccess || next[r] == ncclInvalidArgument, true) << k.what;
      }
      EXPECT_NE(errors[r].find(k.fragment), std::string::npos) << k.what << " rank " << r << ": " << errors[r];
      EXPECT_NE(errors[r].find("every rank must make the same call"), std::string::npos) << errors[r];
      EXPECT_EQ(sums[r], std::vector<float>(4, 3.0f)) << k.what << ": the next call's result, reported or not";
      EXPECT_EQ(after[r], ncclSuccess) << k.what << ": the call after on rank " << r;
      EXPECT_EQ(later[r], std::vector<float>(4, 4.0f)) << k.what;
    }
  }
}

// Without the mailbox every call runs a plan, and every message carries the call it belongs to
// (runtime/call_stamp.hpp): mismatched calls fail on their first message, on both ranks, naming
// both calls, over shared memory and TCP, and no rank reports success with another call's data.
TEST(NcclApi, MismatchedPlanCallsFailOnTheFirstMessage) {
  struct Case {
    const char* what;
    std::function<ncclResult_t(int, ncclComm_t, float*)> call;
    const char* fragment;
  };
  const size_t n = 4096;  // op and datatype: the same bytes on both ranks, so only the stamp can tell
  const std::vector<Case> cases = {
      {"op",
       [n](int r, ncclComm_t c, float* x) { return ncclAllReduce(x, x, n, ncclFloat, r == 0 ? ncclSum : ncclMax, c, nullptr); },
       "all_reduce of 4096 float (max)"},
      {"datatype",
       [n](int r, ncclComm_t c, float* x) {
         return ncclAllReduce(x, x, n, r == 0 ? ncclFloat : ncclInt32, ncclSum, c, nullptr);
       },
       "all_reduce of 4096 int32 (sum)"},
      {"collective",
       [n](int r, ncclComm_t c, float* x) {
         return r == 0 ? ncclAllReduce(x, x, n, ncclFloat, ncclSum, c, nullptr)
                       : ncclAllGather(x, x + n, n / 2, ncclFloat, c, nullptr);
       },
       "all_gather of 2048 float"},
      // Roots are in the stamp too, but two ranks that each take themselves for the root of a
      // 2-rank reduce both wait to receive: no message flows, so only TUTTI_CHECK (or the timeout,
      // with its wait-for dump) finds that one.
  };
  for (const char* transport : {"shm", "tcp"})
    for (const Case& k : cases) {
      tutti::test_support::ScopedEnv env({{"TUTTI_MAILBOX_SIZE", "0"}, {"TUTTI_TRANSPORT", transport}, {"TUTTI_TIMEOUT", "60"}});
      std::vector<ncclResult_t> results(2);
      std::vector<std::string> errors(2);
      on_nccl_ranks(2, [&](int r, ncclComm_t comm) {
        std::vector<float> x(2 * n, 1.0f);
        results[r] = k.call(r, comm, x.data());
        errors[r] = ncclGetLastError(comm);
      });
      bool named = false;
      for (int r = 0; r < 2; ++r) {
        EXPECT_NE(results[r], ncclSuccess) << transport << " " << k.what << " rank " << r;
        named |= errors[r].find(k.fragment) != std::string::npos &&
                 errors[r].find("every rank must make the same calls") != std::string::npos;
      }
      EXPECT_TRUE(named) << transport << " " << k.what << ": " << errors[0] << " | " << errors[1];
    }
}

// A rank that skips a call and destroys its communicator: the one-shot path (a small all-reduce,
// every rank on this host) fails at once with an error naming it, as the plan path does, instead
// of waiting out TUTTI_TIMEOUT.
TEST(NcclApi, OneShotCallFailsAtOnceWhenAPeerHasLeft) {
  tutti::test_support::ScopedEnv env({{"TUTTI_TIMEOUT", "300"}});
  const int n = 3;
  std::vector<ncclComm_t> comms = comms_made_on_threads(n);
  std::vector<ncclResult_t> results(n, ncclSuccess);
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      if (r == 1) {
        EXPECT_EQ(ncclCommDestroy(comms[r]), ncclSuccess);
        return;
      }
      std::vector<float> x(64, 1.0f);
      results[r] = ncclAllReduce(x.data(), x.data(), x.size(), ncclFloat, ncclSum, comms[r], nullptr);
      errors[r] = ncclGetLastError(comms[r]);
    });
  for (auto& t : threads) t.join();
  for (int r : {0, 2}) {
    EXPECT_NE(results[r], ncclSuccess) << "rank " << r;
    EXPECT_NE(errors[r].find("rank 1 left the communicator"), std::string::npos) << errors[r];
    EXPECT_EQ(errors[r].find("timed out"), std::string::npos) << errors[r];
    ncclCommDestroy(comms[r]);
  }
}

TEST(NcclApi, AbortDuringACollectiveUnblocksEveryRank) {
  const int n = 3;
  std::vector<ncclComm_t> comms = comms_made_on_threads(n);
  // Ranks 1 and 2 enter an all-reduce that rank 0 never joins; rank 0 aborts.
  std::vector<ncclResult_t> results(n, ncclSuccess);
  std::vector<std::string> last_error(n);  // ncclGetLastError is per thread, as NCCL's
  std::vector<std::thread> threads;
  for (int r = 1; r < n; ++r)
    threads.emplace_back([&, r] {
      std::vector<float> x(1000);
      results[r] = ncclAllReduce(x.data(), x.data(), 1000, ncclFloat, ncclSum, comms[r], nullptr);
      last_error[r] = ncclGetLastError(comms[r]);
    });
  ASSERT_EQ(ncclCommAbort(comms[0]), ncclSuccess);
  for (auto& t : threads) t.join();
  for (int r = 1; r < n; ++r) {
    EXPECT_EQ(results[r], ncclRemoteError);
    EXPECT_NE(last_error[r].find("rank 0"), std::string::npos) << last_error[r];
    EXPECT_NE(last_error[r].find("abort"), std::string::npos) << last_error[r];
    ncclResult_t async;
    EXPECT_EQ(ncclCommGetAsyncError(comms[r], &async), ncclSuccess);
    EXPECT_EQ(async, ncclRemoteError);
    EXPECT_EQ(ncclCommAbort(comms[r]), ncclSuccess);
  }
}

// A small call on a non-blocking communicator starts in the caller: it publishes its contribution
// and finishes at once when every peer's is there; otherwise its waiting goes to the worker. One
// thread drives both ranks here, which only a call that never blocks allows.
TEST(NcclApi, NonBlockingSmallCallsStartInTheCallerAndLeaveOnlyTheWaiting) {
  const int n = 2;
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  std::vector<ncclComm_t> comms(n);
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  for (int r = 0; r < n; ++r) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ASSERT_EQ(ncclCommInitRankConfig(&comms[r], n, id, r, &cfg), ncclSuccess);
  }
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
  auto settle = [](ncclComm_t c) {
    ncclResult_t state;
    do EXPECT_EQ(ncclCommGetAsyncError(c, &state), ncclSuccess);
    while (state == ncclInProgress);
    return state;
  };
  for (auto c : comms) ASSERT_EQ(settle(c), ncclSuccess);
  for (int round = 0; round < 3; ++round) {
    float a[2] = {1, 2}, b[2] = {10, 20};
    // Rank 0 first: rank 1 has not published, so rank 0 cannot finish and says so.
    EXPECT_EQ(ncclAllReduce(a, a, 2, ncclFloat, ncclSum, comms[0], nullptr), ncclInProgress);
    // Rank 1 finds rank 0's contribution and finishes in the call.
    EXPECT_EQ(ncclAllReduce(b, b, 2, ncclFloat, ncclSum, comms[1], nullptr), ncclSuccess);
    EXPECT_EQ(b[0], 11.0f);
    EXPECT_EQ(b[1], 22.0f);
    ASSERT_EQ(settle(comms[0]), ncclSuccess);
    EXPECT_EQ(a[0], 11.0f);
    EXPECT_EQ(a[1], 22.0f);
  }
  for (auto c : comms) EXPECT_EQ(ncclCommDestroy(c), ncclSuccess);
}

TEST(NcclApi, NonBlockingCommunicatorsFollowTheInProgressProtocol) {
  const int n = 2;
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
      cfg.blocking = 0;
      ncclComm_t comm;
      ncclResult_t rc = ncclCommInitRankConfig(&comm, n, id, r, &cfg);
      ASSERT_TRUE(rc == ncclInProgress || rc == ncclSuccess);
      ncclResult_t state;
      do ASSERT_EQ(ncclCommGetAsyncError(comm, &state), ncclSuccess);
      while (state == ncclInProgress);
      ASSERT_EQ(state, ncclSuccess);
      std::vector<float> x(4096, 1.0f);
      rc = ncclAllReduce(x.data(), x.data(), x.size(), ncclFloat, ncclSum, comm, nullptr);
      ASSERT_TRUE(rc == ncclInProgress || rc == ncclSuccess);
      do ASSERT_EQ(ncclCommGetAsyncError(comm, &state), ncclSuccess);
      while (state == ncclInProgress);
      ASSERT_EQ(state, ncclSuccess);
      EXPECT_EQ(x[4095], 2.0f);
      EXPECT_EQ(ncclCommFinalize(comm), ncclSuccess);
      EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
    });
  for (auto& t : threads) t.join();
}

TEST(NcclApi, SplitMemAllocAndRegistration) {
  const int n = 4;
  std::vector<void*> freed(n, nullptr);
  on_nccl_ranks(n, [&](int r, ncclComm_t comm) {
    ncclComm_t half;
    ASSERT_EQ(ncclCommSplit(comm, r == 3 ? NCCL_SPLIT_NOCOLOR : r % 2, r, &half, nullptr), ncclSuccess);
    if (r == 3) {
      EXPECT_EQ(half, nullptr);
      return;
    }
    int size = 0;
    ASSERT_EQ(ncclCommCount(half, &size), ncclSuccess);
    EXPECT_EQ(size, r % 2 == 0 ? 2 : 1);
    void* mem = nullptr;
    ASSERT_EQ(ncclMemAlloc(&mem, 1024 * sizeof(float)), ncclSuccess);
    void* handle = nullptr;
    ASSERT_EQ(ncclCommRegister(half, mem, 1024 * sizeof(float), &handle), ncclSuccess);
    float* f = static_cast<float*>(mem);
    std::fill(f, f + 1024, 1.0f);
    ASSERT_EQ(ncclAllReduce(f, f, 1024, ncclFloat, ncclSum, half, nullptr), ncclSuccess);
    EXPECT_EQ(f[1023], static_cast<float>(size));
    EXPECT_EQ(ncclCommDeregister(half, handle), ncclSuccess);
    EXPECT_EQ(ncclMemFree(mem), ncclSuccess);
    freed[r] = mem;
    EXPECT_EQ(ncclCommDestroy(half), ncclSuccess);
  });
  // A second free is refused. Checked once every rank is done: while others still allocate, the
  // address may already belong to another rank's new allocation.
  EXPECT_EQ(ncclMemFree(freed[0]), ncclInvalidArgument);
}

}  // namespace

// Device buffers through the NCCL API (on the emulated device, which runs the CUDA interpreter's
// code on CPU threads): a rank whose peer stops calling fails after TUTTI_TIMEOUT with an error
// that names the plan, the block and the peer, and ncclCommGetAsyncError reports it afterwards.
TEST(NcclApi, DeviceCollectiveWithoutItsPeerTimesOutNamingIt) {
  // 2 s: no wait of the joint first call times out on a loaded machine.
  tutti::test_support::ScopedEnv env({{"TUTTI_DEVICE", "emulated"}, {"TUTTI_TIMEOUT", "2"}});
  on_nccl_ranks(2, [&](int r, ncclComm_t comm) {
    std::vector<float> buf(4096, 1.0f);
    ASSERT_EQ(ncclAllReduce(buf.data(), buf.data(), buf.size(), ncclFloat, ncclSum, comm, nullptr), ncclSuccess)
        << ncclGetLastError(comm);
    EXPECT_EQ(buf[17], 2.0f);
    if (r == 0) {
      EXPECT_EQ(ncclAllReduce(buf.data(), buf.data(), buf.size(), ncclFloat, ncclSum, comm, nullptr), ncclRemoteError);
      std::string why = ncclGetLastError(comm);
      EXPECT_NE(why.find("device plan 'allpairs_allreduce' stopped at block"), std::string::npos) << why;
      EXPECT_NE(why.find("waiting for "), std::string::npos) << why;
      EXPECT_NE(why.find("TUTTI_TIMEOUT"), std::string::npos) << why;
      ncclResult_t async = ncclSuccess;
      EXPECT_EQ(ncclCommGetAsyncError(comm, &async), ncclSuccess);
      EXPECT_EQ(async, ncclRemoteError);
    }
  });
}

// NCCL's "single process, single thread, multiple devices" example: one thread makes every rank
// (ncclCommInitAll, or ncclCommInitRank calls in a group), runs a grouped collective on device
// buffers (the emulated device), and destroys the communicators one after another. Closing a
// device executor waits for every rank, so the clique closes together at the last destroy instead
// of the first destroy waiting for ranks not destroyed yet.
TEST(NcclApi, OneThreadDestroysItsDeviceCommunicatorsOneAfterAnother) {
  tutti::test_support::ScopedEnv env({{"TUTTI_DEVICE", "emulated"}});
  const int n = 3;
  for (bool grouped_init : {false, true}) {
    SCOPED_TRACE(grouped_init ? "ncclCommInitRank in a group" : "ncclCommInitAll");
    std::vector<ncclComm_t> comms(n);
    if (grouped_init) {
      ncclUniqueId id;
      ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
      ASSERT_EQ(ncclGroupStart(), ncclSuccess);
      for (int r = 0; r < n; ++r) ASSERT_EQ(ncclCommInitRank(&comms[r], n, id, r), ncclSuccess);
      ASSERT_EQ(ncclGroupEnd(), ncclSuccess) << ncclGetLastError(nullptr);
    } else {
      ASSERT_EQ(ncclCommInitAll(comms.data(), n, nullptr), ncclSuccess) << ncclGetLastError(nullptr);
    }
    std::vector<std::vector<float>> bufs(n, std::vector<float>(1000));
    for (int r = 0; r < n; ++r) std::fill(bufs[r].begin(), bufs[r].end(), static_cast<float>(r + 1));
    ASSERT_EQ(ncclGroupStart(), ncclSuccess);
    for (int r = 0; r < n; ++r)
      ASSERT_EQ(ncclAllReduce(bufs[r].data(), bufs[r].data(), 1000, ncclFloat, ncclSum, comms[r], nullptr), ncclSuccess);
    ASSERT_EQ(ncclGroupEnd(), ncclSuccess) << ncclGetLastError(nullptr);
    for (int r = 0; r < n; ++r) EXPECT_EQ(bufs[r][999], 6.0f);
    for (int r = 0; r < n; ++r) EXPECT_EQ(ncclCommDestroy(comms[r]), ncclSuccess) << ncclGetLastError(nullptr);
  }
}
