// The NCCL API used wrongly, as an adversary or a hurried user would: counts that differ between
// ranks, sizes that overflow, handles that were never made or are freed twice, absurd rank counts,
// damaged unique ids, NULLs where NCCL documents what happens. Each case must end in an error that
// names what is wrong (or NVIDIA's documented return code) on every rank: never a crash, a hang, or
// success with wrong data. The mismatch cases run with ranks as threads (shared memory and TCP) and
// as processes under tutti-run (the test runs itself).
#include <gtest/gtest.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "collectives/include/nccl.h"
#include "support/env.hpp"
#include "support/nccl_ranks.hpp"

namespace {

using tutti::test_support::on_nccl_ranks;
using tutti::test_support::ScopedEnv;

// --- counts that differ between ranks ----------------------------------------------------------

// Counts whose ratio is a power of two, above the executor's 1 MiB tile: every message of both
// calls has the tile's size, so only the count in the call stamp can tell them apart. Before it
// travelled, one rank of each pair returned success with wrong data.
struct Mismatch {
  const char* name;
  // Runs rank r's call on `in`/`out` (each of kMaxElems floats).
  std::function<ncclResult_t(int r, ncclComm_t, float* in, float* out)> call;
};

constexpr size_t kM = 1 << 20;
constexpr size_t kMaxElems = 8 * kM;  // the largest buffer any case below reads or writes

const std::vector<Mismatch>& mismatches() {
  static const std::vector<Mismatch> cases = {
      {"all_reduce 1M/512K",
       [](int r, ncclComm_t c, float* in, float* out) {
         return ncclAllReduce(in, out, r == 0 ? kM : kM / 2, ncclFloat, ncclSum, c, nullptr);
       }},
      {"all_reduce 512K/1M",
       [](int r, ncclComm_t c, float* in, float* out) {
         return ncclAllReduce(in, out, r == 0 ? kM / 2 : kM, ncclFloat, ncclSum, c, nullptr);
       }},
      {"all_reduce 2M/1M",
       [](int r, ncclComm_t c, float* in, float* out) {
         return ncclAllReduce(in, out, r == 0 ? 2 * kM : kM, ncclFloat, ncclSum, c, nullptr);
       }},
      {"all_reduce 4M/2M",
       [](int r, ncclComm_t c, float* in, float* out) {
         return ncclAllReduce(in, out, r == 0 ? 4 * kM : 2 * kM, ncclFloat, ncclSum, c, nullptr);
       }},
      {"reduce_scatter 512K/256K",
       [](int r, ncclComm_t c, float* in, float* out) {
         return ncclReduceScatter(in, out, r == 0 ? kM / 2 : kM / 4, ncclFloat, ncclSum, c, nullptr);
       }},
      {"alltoall 512K/256K",
       [](int r, ncclComm_t c, float* in, float* out) {
         return ncclAllToAll(in, out, r == 0 ? kM / 2 : kM / 4, ncclFloat, c, nullptr);
       }},
      {"all_gather 1M/512K",
       [](int r, ncclComm_t c, float* in, float* out) {
         return ncclAllGather(in, out, r == 0 ? kM : kM / 2, ncclFloat, c, nullptr);
       }},
      {"broadcast 2M/1M",
       [](int r, ncclComm_t c, float* in, float* out) {
         return ncclBroadcast(in, out, r == 0 ? 2 * kM : kM, ncclFloat, 0, c, nullptr);
       }},
  };
  return cases;
}

// Whether rank r's call failed with an error that names the mismatch; the message, for the report.
struct Outcome {
  ncclResult_t rc = ncclSuccess;
  std::string error;
};

Outcome run_mismatch(const Mismatch& k, int r, ncclComm_t comm) {
  std::vector<float> in(kMaxElems, static_cast<float>(r + 1)), out(kMaxElems, -1.0f);
  Outcome o;
  o.rc = k.call(r, comm, in.data(), out.data());
  if (o.rc == ncclSuccess) {
    // A blocking call that returned success must have finished; so must its peer's.
    o.error = "success";
  } else {
    o.error = ncclGetLastError(comm);
  }
  return o;
}

void expect_every_rank_failed(const std::vector<Outcome>& outcomes, const std::string& what) {
  bool named = false;
  for (size_t r = 0; r < outcomes.size(); ++r) {
    EXPECT_NE(outcomes[r].rc, ncclSuccess) << what << ": rank " << r << " reported success";
    named |= outcomes[r].error.find("every rank must make the same call") != std::string::npos;
  }
  EXPECT_TRUE(named) << what << ": no rank named the mismatch: " << outcomes[0].error << " | " << outcomes[1].error;
}

class CountMismatch : public ::testing::TestWithParam<const char*> {};

// "emulated": every buffer is a device buffer on the emulated device, whose FIFOs carry the stamp in
// each message's descriptor or LL header (runtime/device/abi.hpp).
TEST_P(CountMismatch, FailsOnEveryRankAsThreads) {
  const bool device = std::string(GetParam()) == "emulated";
  ScopedEnv env({{"TUTTI_TRANSPORT", device ? "shm" : GetParam()},
                 {"TUTTI_DEVICE", device ? "emulated" : nullptr},
                 {"TUTTI_TIMEOUT", "60"}});
  for (const Mismatch& k : mismatches()) {
    std::vector<Outcome> outcomes(2);
    on_nccl_ranks(2, [&](int r, ncclComm_t comm) { outcomes[r] = run_mismatch(k, r, comm); });
    expect_every_rank_failed(outcomes, std::string(GetParam()) + " " + k.name);
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, CountMismatch, ::testing::Values("shm", "tcp", "emulated"));

// One rank per process: the test runs itself under tutti-run, each process checks its own rank.
TEST(CountMismatchProcesses, FailsOnEveryRank) {
  const char* rank = std::getenv("TUTTI_RANK");
  if (!rank) {
    for (const char* transport : {"shm", "tcp"}) {
      const std::string cmd = std::string("TUTTI_TIMEOUT=60 TUTTI_TRANSPORT=") + transport + " " + TUTTI_RUN_PATH +
                              " -n 2 " + TUTTI_SELF_PATH + " --gtest_filter=CountMismatchProcesses.FailsOnEveryRank 2>&1";
      FILE* p = popen(cmd.c_str(), "r");
      ASSERT_NE(p, nullptr);
      std::string output;
      char buf[4096];
      while (size_t got = fread(buf, 1, sizeof buf, p)) output.append(buf, got);
      EXPECT_EQ(pclose(p), 0) << transport << ": " << output;
      EXPECT_NE(output.find("[  PASSED  ] 1 test"), std::string::npos) << output;
    }
    return;
  }
  const int r = std::atoi(rank), n = std::atoi(std::getenv("TUTTI_SIZE"));
  ASSERT_EQ(n, 2);
  for (const Mismatch& k : mismatches()) {
    ncclUniqueId id;
    ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
    ncclComm_t comm;
    ASSERT_EQ(ncclCommInitRank(&comm, n, id, r), ncclSuccess) << ncclGetLastError(nullptr);
    const Outcome o = run_mismatch(k, r, comm);
    // Only this rank's outcome is seen here: it must not be success, and if it names the cause it
    // must name the mismatch (the other rank may only have heard that this one failed).
    EXPECT_NE(o.rc, ncclSuccess) << k.name << ": rank " << r << " reported success";
    EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
  }
}

// --- sizes that overflow -------------------------------------------------------------------------

// Counts whose bytes wrap past 2^64 (or 2^63) or that no buffer of this process can hold: refused on
// the calling rank before anything moves, naming the argument. Before: all_reduce and
// reduce_scatter crashed in the one-shot reduction, send/recv overwrote the stack, the rest moved
// nothing and returned success.
TEST(Sizes, OverflowingCountsAreRefusedOnEveryCall) {
  const size_t huge = size_t{1} << 62, sixty = size_t{1} << 60;
  struct Case {
    const char* name;
    std::function<ncclResult_t(ncclComm_t, float*)> call;
    const char* names;  // the argument or reason the message must name
  };
  const std::vector<Case> cases = {
      {"all_reduce 2^62", [&](ncclComm_t c, float* x) { return ncclAllReduce(x, x, huge, ncclFloat, ncclSum, c, nullptr); }, "count"},
      {"reduce_scatter 2^62",
       [&](ncclComm_t c, float* x) { return ncclReduceScatter(x, x, huge, ncclFloat, ncclSum, c, nullptr); }, "count"},
      {"all_gather 2^62", [&](ncclComm_t c, float* x) { return ncclAllGather(x, x, huge, ncclFloat, c, nullptr); }, "count"},
      {"all_gather 2^60", [&](ncclComm_t c, float* x) { return ncclAllGather(x, x, sixty, ncclFloat, c, nullptr); },
       "past this process's memory"},
      {"alltoall 2^61 x 2 ranks", [&](ncclComm_t c, float* x) { return ncclAllToAll(x, x + 1, huge / 2, ncclFloat, c, nullptr); },
       "times 2 ranks"},
      {"broadcast 2^62", [&](ncclComm_t c, float* x) { return ncclBroadcast(x, x, huge, ncclFloat, 0, c, nullptr); }, "count"},
      {"reduce 2^62", [&](ncclComm_t c, float* x) { return ncclReduce(x, x, huge, ncclFloat, ncclSum, 0, c, nullptr); }, "count"},
      {"alltoall 2^62", [&](ncclComm_t c, float* x) { return ncclAllToAll(x, x + 1, huge, ncclFloat, c, nullptr); }, "count"},
      {"gather 2^62", [&](ncclComm_t c, float* x) { return ncclGather(x, x, huge, ncclFloat, 0, c, nullptr); }, "count"},
      {"scatter 2^62", [&](ncclComm_t c, float* x) { return ncclScatter(x, x, huge, ncclFloat, 0, c, nullptr); }, "count"},
      {"send SIZE_MAX", [&](ncclComm_t c, float* x) { return ncclSend(x, SIZE_MAX, ncclFloat, 0, c, nullptr); }, "count"},
      {"recv SIZE_MAX", [&](ncclComm_t c, float* x) { return ncclRecv(x, SIZE_MAX, ncclFloat, 0, c, nullptr); }, "count"},
      {"send 2^62", [&](ncclComm_t c, float* x) { return ncclSend(x, huge, ncclFloat, 0, c, nullptr); }, "count"},
      // Bytes that fit 64 bits but no mapping of this process: 2^44 floats (64 TiB) from the stack.
      {"all_reduce past memory",
       [&](ncclComm_t c, float* x) { return ncclAllReduce(x, x, size_t{1} << 44, ncclFloat, ncclSum, c, nullptr); },
       "past this process's memory"},
  };
  on_nccl_ranks(2, [&](int r, ncclComm_t comm) {
    for (const Case& k : cases) {
      float x[4] = {1, 2, 3, 4};
      EXPECT_EQ(k.call(comm, x), ncclInvalidArgument) << k.name << " on rank " << r;
      const std::string error = ncclGetLastError(comm);
      EXPECT_NE(error.find(k.names), std::string::npos) << k.name << ": " << error;
      EXPECT_NE(error.find("rank " + std::to_string(r)), std::string::npos) << k.name << ": " << error;
      EXPECT_EQ(x[3], 4.0f) << k.name;
    }
    // The communicator still works.
    std::vector<float> y(16, static_cast<float>(r + 1));
    ASSERT_EQ(ncclAllReduce(y.data(), y.data(), y.size(), ncclFloat, ncclSum, comm, nullptr), ncclSuccess)
        << ncclGetLastError(comm);
    EXPECT_EQ(y[15], 3.0f);
  });
}

// An error names the function once ("ncclAllReduce: ncclAllReduce: ..." before).
TEST(Messages, NameTheFunctionOnce) {
  on_nccl_ranks(1, [&](int, ncclComm_t comm) {
    float x = 0;
    EXPECT_EQ(ncclBroadcast(&x, &x, 1, ncclFloat, 5, comm, nullptr), ncclInvalidArgument);
    const std::string error = ncclGetLastError(comm);
    EXPECT_EQ(error.find("ncclBroadcast"), 0u) << error;
    EXPECT_EQ(error.find("ncclBroadcast", 1), std::string::npos) << error;
  });
}


// --- handles --------------------------------------------------------------------------------------

// Registration handles are looked up, never freed blindly: a made-up handle or a second deregister
// is ncclInvalidUsage, as NCCL answers (before: free() of a stack address aborted the process).
TEST(Handles, RegistrationsAreLookedUpBeforeTheyAreFreed) {
  on_nccl_ranks(2, [&](int r, ncclComm_t comm) {
    std::vector<float> x(1024);
    void* handle = nullptr;
    ASSERT_EQ(ncclCommRegister(comm, x.data(), x.size() * sizeof(float), &handle), ncclSuccess);
    int not_a_handle = 0;
    EXPECT_EQ(ncclCommDeregister(comm, &not_a_handle), ncclInvalidUsage) << "rank " << r;
    EXPECT_NE(std::string(ncclGetLastError(comm)).find("not returned by ncclCommRegister"), std::string::npos)
        << ncclGetLastError(comm);
    EXPECT_EQ(ncclCommDeregister(comm, handle), ncclSuccess);
    EXPECT_EQ(ncclCommDeregister(comm, handle), ncclInvalidUsage) << "a second deregister";
    EXPECT_EQ(ncclCommDeregister(comm, nullptr), ncclSuccess) << "NULL, as NCCL";
    ncclWindow_t win = nullptr;
    ASSERT_EQ(ncclCommWindowRegister(comm, x.data(), x.size() * sizeof(float), &win, 0), ncclSuccess);
    EXPECT_EQ(ncclCommWindowDeregister(comm, win), ncclSuccess);
    EXPECT_EQ(ncclCommWindowDeregister(comm, win), ncclInvalidUsage);
    // A handle still registered when the communicator is destroyed is freed with it.
    void* leftover = nullptr;
    ASSERT_EQ(ncclCommRegister(comm, x.data(), 64, &leftover), ncclSuccess);  // freed with the communicator
  });
}

// NCCL's answers for NULL and repeated calls.
TEST(Handles, NullAndRepeatedCallsAnswerAsNccl) {
  EXPECT_EQ(ncclCommDestroy(nullptr), ncclSuccess);
  EXPECT_EQ(ncclCommAbort(nullptr), ncclSuccess);
  EXPECT_EQ(ncclCommFinalize(nullptr), ncclSuccess);
  EXPECT_EQ(ncclCommRevoke(nullptr, NCCL_REVOKE_DEFAULT), ncclSuccess);
  EXPECT_EQ(ncclMemFree(nullptr), ncclSuccess);
  on_nccl_ranks(2, [&](int r, ncclComm_t comm) {
    EXPECT_EQ(ncclCommFinalize(comm), ncclSuccess);
    EXPECT_EQ(ncclCommFinalize(comm), ncclInvalidArgument) << "rank " << r << ": a second finalize";
    EXPECT_NE(std::string(ncclGetLastError(comm)).find("finalized already"), std::string::npos);
  });
  on_nccl_ranks(2, [&](int r, ncclComm_t comm) {
    EXPECT_EQ(ncclCommRevoke(comm, NCCL_REVOKE_DEFAULT), ncclSuccess);
    EXPECT_EQ(ncclCommRevoke(comm, NCCL_REVOKE_DEFAULT), ncclInvalidArgument) << "rank " << r << ": a second revoke";
  });
}

// --- init ---------------------------------------------------------------------------------------

// Sizes no job has are refused before anything is allocated for them (before: nranks = INT_MAX grew
// to 19.5 GB, ncclCommInitAll(100000) started thousands of threads and never returned).
TEST(Init, AbsurdSizesAreRefusedAtOnce) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  ncclComm_t comm = nullptr;
  EXPECT_EQ(ncclCommInitRank(&comm, INT_MAX, id, 0), ncclInvalidArgument);
  EXPECT_NE(std::string(ncclGetLastError(nullptr)).find("TUTTI_MAX_RANKS"), std::string::npos) << ncclGetLastError(nullptr);
  EXPECT_EQ(comm, nullptr);
  for (int ndev : {100000, INT_MAX}) {
    std::vector<ncclComm_t> comms(4);
    EXPECT_EQ(ncclCommInitAll(comms.data(), ndev, nullptr), ncclInvalidArgument) << ndev;
    EXPECT_NE(std::string(ncclGetLastError(nullptr)).find("TUTTI_MAX_"), std::string::npos)
        << ncclGetLastError(nullptr);
  }
  {
    ScopedEnv env({{"TUTTI_MAX_RANKS", "8"}});
    EXPECT_EQ(ncclCommInitRank(&comm, 9, id, 0), ncclInvalidArgument) << "the cap is configurable";
  }
}

// A lone rank of a large world gives up at TUTTI_INIT_TIMEOUT, naming (some of) the missing ranks.
TEST(Init, ALoneRankOfALargeWorldGivesUpAtTheInitTimeout) {
  ScopedEnv env({{"TUTTI_INIT_TIMEOUT", "1"}});
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  ncclComm_t comm = nullptr;
  EXPECT_NE(ncclCommInitRank(&comm, 1 << 16, id, 0), ncclSuccess);
  const std::string error = ncclGetLastError(nullptr);
  EXPECT_NE(error.find("never arrived"), std::string::npos) << error;
  EXPECT_LT(error.size(), 1000u) << "the missing ranks are not all listed";
}

// Every single-byte change of a unique id is refused at once (before: 105 of 128 waited out the
// init timeout and one succeeded).
TEST(Init, EveryDamagedByteOfAUniqueIdIsRefused) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  for (size_t i = 0; i < sizeof(id.internal); ++i) {
    ncclUniqueId bad = id;
    bad.internal[i] = static_cast<char>(bad.internal[i] ^ 0x20);
    ncclComm_t comm = nullptr;
    ASSERT_EQ(ncclCommInitRank(&comm, 2, bad, 1), ncclInvalidArgument) << "byte " << i;
    EXPECT_NE(std::string(ncclGetLastError(nullptr)).find("damaged"), std::string::npos) << ncclGetLastError(nullptr);
  }
}

// Two processes (here threads) that both take rank 1: the rendezvous root sees it and every rank of
// the job hears it at once, naming the rank, instead of waiting for the missing rank 0.
TEST(Init, ADuplicateRankFailsEveryRankAtOnce) {
  ScopedEnv env({{"TUTTI_INIT_TIMEOUT", "600"}});
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  std::vector<ncclResult_t> rc(3, ncclSuccess);
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int k = 0; k < 3; ++k)
    threads.emplace_back([&, k] {
      ncclComm_t comm = nullptr;
      rc[k] = ncclCommInitRank(&comm, 3, id, k == 0 ? 0 : 1);  // ranks 0, 1, 1: rank 2 never comes
      errors[k] = ncclGetLastError(nullptr);
      if (rc[k] == ncclSuccess) ncclCommDestroy(comm);
    });
  for (auto& t : threads) t.join();
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(rc[k], ncclInvalidArgument) << "thread " << k << ": " << errors[k];
    EXPECT_NE(errors[k].find("rank 1 joined twice"), std::string::npos) << errors[k];
  }
}


// --- mistakes one rank can see --------------------------------------------------------------------

struct Diverging {
  const char* name;
  std::function<ncclResult_t(ncclComm_t)> other;  // what rank 1 does while rank 0 splits
};

TEST(OneRankAlone, SplitThatNotEveryRankJoinsFailsFast) {
  ScopedEnv env({{"TUTTI_TIMEOUT", "1800"}, {"TUTTI_DIVERGENCE_PROBE", "1"}});
  const std::vector<Diverging> cases = {
      {"destroys", [](ncclComm_t c) { return ncclCommDestroy(c); }},
      {"all_reduce",
       [](ncclComm_t c) {
         std::vector<float> x(1 << 16, 1.0f);
         return ncclAllReduce(x.data(), x.data(), x.size(), ncclFloat, ncclSum, c, nullptr);
       }},
      // No message of either call reaches the other rank: the divergence probe asks.
      {"small all_reduce",
       [](ncclComm_t c) {
         float x[4] = {1, 1, 1, 1};
         return ncclAllReduce(x, x, 4, ncclFloat, ncclSum, c, nullptr);
       }},
  };
  for (const Diverging& k : cases) {
    std::vector<ncclResult_t> rc(2, ncclSuccess);
    std::vector<std::string> errors(2);
    ncclUniqueId id;
    ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([&, r] {
        ncclComm_t comm = nullptr;
        ASSERT_EQ(ncclCommInitRank(&comm, 2, id, r), ncclSuccess);
        if (r == 0) {
          ncclComm_t child = nullptr;
          rc[r] = ncclCommSplit(comm, 0, 0, &child, nullptr);
          errors[r] = ncclGetLastError(comm);
          if (child) ncclCommDestroy(child);
          ncclCommDestroy(comm);
        } else {
          rc[r] = k.other(comm);
          errors[r] = ncclGetLastError(comm);
          if (std::string(k.name) != "destroys") ncclCommDestroy(comm);
        }
      });
    for (auto& t : threads) t.join();
    EXPECT_NE(rc[0], ncclSuccess) << k.name << ": the splitting rank";
    EXPECT_NE(errors[0].find("rank 1"), std::string::npos) << k.name << ": " << errors[0];
    if (std::string(k.name) != "destroys") {
      EXPECT_NE(rc[1], ncclSuccess) << k.name << ": " << errors[1];
    }
  }
}

// Two ranks that each take themselves for the root of a reduce only receive: no message crosses, so
// no stamp can tell. Each wait asks the other rank which call it is in and both fail, naming both
// roots, within seconds instead of at TUTTI_TIMEOUT (1800 s here).
TEST(OneRankAlone, TwoRanksThatBothTakeTheRootFailFast) {
  ScopedEnv env({{"TUTTI_TIMEOUT", "1800"}, {"TUTTI_DIVERGENCE_PROBE", "1"}, {"TUTTI_MAILBOX_SIZE", "0"}});
  std::vector<Outcome> outcomes(2);
  on_nccl_ranks(2, [&](int r, ncclComm_t comm) {
    std::vector<float> x(4096, 1.0f), y(4096);
    outcomes[r].rc = ncclReduce(x.data(), y.data(), x.size(), ncclFloat, ncclSum, r, comm, nullptr);
    outcomes[r].error = ncclGetLastError(comm);
  });
  // The rank whose probe answers first fails with ncclInvalidUsage; the other may hear it from that
  // rank first (ncclRemoteError, quoting the same message). Both name both roots.
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(outcomes[r].rc == ncclInvalidUsage || outcomes[r].rc == ncclRemoteError)
        << "rank " << r << ": " << outcomes[r].rc << " " << outcomes[r].error;
    EXPECT_NE(outcomes[r].error.find("with root 0"), std::string::npos) << outcomes[r].error;
    EXPECT_NE(outcomes[r].error.find("with root 1"), std::string::npos) << outcomes[r].error;
  }
  EXPECT_TRUE(outcomes[0].rc == ncclInvalidUsage || outcomes[1].rc == ncclInvalidUsage);
}

}  // namespace
