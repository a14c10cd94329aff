// The one-shot mailbox (runtime/mailbox.hpp) and the collectives over it (collectives/oneshot.hpp):
// results against a host reference, outbox reuse over many calls, abort, timeout, when it exists,
// and when the dispatcher picks it.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <thread>

#include "collectives/dispatcher.hpp"
#include "collectives/oneshot.hpp"
#include "core/element.hpp"
#include "runtime/communicator.hpp"
#include "support/env.hpp"
#include "tests/support/ranks.hpp"

using namespace tutti;
using test_support::on_ranks;

namespace {

// Runs fn(rank, comm) on a thread per rank; rethrows the first failure.

// Input element i of rank r: small integers, so any summation order is exact in float.
float value(int r, int64_t i, int seed) { return static_cast<float>((r * 7 + i * 3 + seed) % 13 - 6); }

// Reference output of rank `me` for an all-pairs collective of `count` floats (sum), or empty if
// the rank's output is not defined (a reduce's non-root).
std::vector<float> expected(Collective c, int n, int me, int64_t count, int root, int seed) {
  std::vector<float> out;
  auto in = [&](int r, int64_t i) { return value(r, i, seed); };
  switch (c) {
    case Collective::kAllReduce:
    case Collective::kReduce:
      if (c == Collective::kReduce && me != root) return {};
      for (int64_t i = 0; i < count; ++i) {
        float s = 0;
        for (int r = 0; r < n; ++r) s += in(r, i);
        out.push_back(s);
      }
      break;
    case Collective::kReduceScatter:
      for (int64_t i = 0; i < count; ++i) {
        float s = 0;
        for (int r = 0; r < n; ++r) s += in(r, me * count + i);
        out.push_back(s);
      }
      break;
    case Collective::kBroadcast:
      for (int64_t i = 0; i < count; ++i) out.push_back(in(root, i));
      break;
    case Collective::kAllGather:
      for (int r = 0; r < n; ++r)
        for (int64_t i = 0; i < count; ++i) out.push_back(in(r, i));
      break;
    case Collective::kAllToAll:
      for (int r = 0; r < n; ++r)
        for (int64_t i = 0; i < count; ++i) out.push_back(in(r, me * count + i));
      break;
    default: break;
  }
  return out;
}

int64_t in_elems(Collective c, int64_t count, int n) {
  return c == Collective::kReduceScatter || c == Collective::kAllToAll ? count * n : count;
}
int64_t out_elems(Collective c, int64_t count, int n) {
  return c == Collective::kAllGather || c == Collective::kAllToAll ? count * n : count;
}

const Collective kAll[] = {Collective::kAllReduce, Collective::kAllGather, Collective::kReduceScatter,
                           Collective::kBroadcast, Collective::kReduce,    Collective::kAllToAll};

// One call on every rank, checked against the reference; in place where NCCL defines it.
void call_and_check(int rank, Communicator& comm, Collective c, int64_t count, int root, int seed, bool inplace) {
  const int n = comm.size();
  std::vector<float> in(static_cast<size_t>(std::max<int64_t>(in_elems(c, count, n), 1)));
  for (int64_t i = 0; i < in_elems(c, count, n); ++i) in[static_cast<size_t>(i)] = value(rank, i, seed);
  std::vector<float> out(static_cast<size_t>(std::max<int64_t>(out_elems(c, count, n), 1)), -99.f);
  const void* src = in.data();
  void* dst = out.data();
  if (inplace) {
    // NCCL's in-place layouts: all-gather's input is the rank's piece of the output, a
    // reduce-scatter's output the rank's piece of the input; the others use one buffer.
    if (c == Collective::kAllGather) {
      std::memcpy(out.data() + rank * count, in.data(), static_cast<size_t>(count) * 4);
      src = out.data() + rank * count;
    } else if (c == Collective::kReduceScatter) {
      out = in;
      dst = out.data() + rank * count;
      src = out.data();
    } else {
      out = in;
      out.resize(std::max(out.size(), static_cast<size_t>(out_elems(c, count, n))));
      src = dst = out.data();
    }
  }
  Reduction red;
  red.op = RedOp::kSum;
  red.type = DataType::kFloat32;
  run_oneshot(*comm.mailbox(), c, src, dst, count, red, root);
  auto want = expected(c, n, rank, count, root, seed);
  const float* got = static_cast<const float*>(dst);
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_EQ(got[i], want[i]) << to_string(c) << " rank " << rank << " count " << count << " element " << i
                               << (inplace ? " in place" : "");
}

}  // namespace

TEST(OneShot, EveryCollectiveMatchesTheReferenceInAndOutOfPlace) {
  for (int n : {2, 3, 5}) {
    auto comms = Communicator::create_local(n);
    ASSERT_NE(comms[0]->mailbox(), nullptr);
    on_ranks(comms, [&](int rank, Communicator& comm) {
      int seed = 0;
      for (Collective c : kAll)
        for (int64_t count : {0, 1, 13, 14, 1000})
          for (bool inplace : {false, true}) {
            ++seed;
            call_and_check(rank, comm, c, count, seed % n, seed, inplace);
          }
    });
  }
}

TEST(OneShot, OutboxesAreReusedSafelyOverManyCallsOfMixedSizes) {
  // Ranks drift apart by varying amounts of local work between calls (rooted calls let some run
  // ahead by up to Mailbox::depth() calls); the outboxes' records must never be overwritten while
  // a peer still reads them (mailbox.hpp's argument). Counts up to 700 floats mix rooted calls in
  // the deep ring (up to 248 floats) with calls in the lockstep ring.
  auto comms = Communicator::create_local(4);
  on_ranks(comms, [&](int rank, Communicator& comm) {
    std::mt19937 rng(1234);  // same sequence of calls on every rank
    std::mt19937 local(static_cast<unsigned>(rank));
    volatile uint64_t sink = 0;
    for (int k = 0; k < 3000; ++k) {
      Collective c = kAll[rng() % 6];
      int64_t count = static_cast<int64_t>(rng() % 700);
      int root = static_cast<int>(rng() % 4);
      for (uint32_t spin = local() % 20000; spin > 0; --spin) sink = sink + spin;
      call_and_check(rank, comm, c, count, root, k, false);
    }
  });
}

// A broadcast's root waits for no receiver and a reduce's senders wait for no root: each makes up
// to Mailbox::depth() calls before the ranks that read them make any (on a crowded host kDeepRecords
// calls whose data fits a deep record, else kRecords), then waits for room. Were they in lock step, the first
// call would wait for ranks that start only after it returns, and the timeout would fail the test.
TEST(OneShot, RootedCallsRunAheadOfTheRanksThatRead) {
  constexpr int64_t kDeepFloats = static_cast<int64_t>(Mailbox::kDeepDataBytes / 4);
  for (Collective c : {Collective::kBroadcast, Collective::kReduce})
    for (int64_t base : {int64_t{1}, kDeepFloats + 1}) {
      CommOptions opts = CommOptions::from_env();
      opts.timeout_s = 60;
      auto comms = Communicator::create_local(3, opts);
      constexpr int kRoot = 1;
      const Mailbox& mb = *comms[0]->mailbox();
      const int ahead_calls = static_cast<int>(Mailbox::depth(mb.deep(static_cast<uint64_t>(base) * 4, true)));
      // The deep ring only where ranks outnumber cores (3 thread ranks: CI's 2 cores).
      const bool crowded = std::thread::hardware_concurrency() < 3;
      EXPECT_EQ(ahead_calls, base == 1 && crowded ? Mailbox::kDeepRecords : Mailbox::kRecords);
      const int leaders = c == Collective::kBroadcast ? 1 : 2;  // the ranks that read nobody
      std::atomic<int> ahead{0};
      on_ranks(comms, [&](int rank, Communicator& comm) {
        const bool leads = c == Collective::kBroadcast ? rank == kRoot : rank != kRoot;
        if (!leads)
          while (ahead.load() < leaders) std::this_thread::yield();  // a flag, not a timing guess
        for (int k = 0; k < 3 * ahead_calls; ++k) {
          if (leads && k == ahead_calls) ahead.fetch_add(1);
          call_and_check(rank, comm, c, base + k % 9, kRoot, k, false);
        }
      });
    }
}

TEST(OneShot, PreMulSumAvgAndEveryTypeMatchThePlans) {
  // The dispatcher with the mailbox and with plans only must agree bit for bit.
  std::vector<unsigned char> first;
  test_support::ScopedEnv env;
  for (const char* threshold : {"32K", "0"}) {
    env.set("TUTTI_ONESHOT_THRESHOLD", threshold);
    auto comms = Communicator::create_local(3);
    std::vector<std::vector<unsigned char>> results(3);
    on_ranks(comms, [&](int rank, Communicator& comm) {
      Dispatcher d(comm);
      for (DataType t : {DataType::kInt8, DataType::kUint32, DataType::kFloat16, DataType::kBfloat16,
                         DataType::kFloat64, DataType::kFp8E4M3})
        for (RedOp op : {RedOp::kSum, RedOp::kProd, RedOp::kMin, RedOp::kMax, RedOp::kAvg, RedOp::kPreMulSum}) {
          const size_t es = size_of(t);
          const int64_t count = 37;
          std::vector<unsigned char> in(count * es), out(count * es);
          for (int64_t i = 0; i < count; ++i) store_value(t, in.data() + i * es, (rank + i) % 3);
          CollectiveCall call;
          call.collective = Collective::kAllReduce;
          call.input = in.data();
          call.output = out.data();
          call.count = count;
          call.reduction.op = op;
          call.reduction.type = t;
          store_value(t, call.reduction.scalar, 2);
          d.run(call);
          EXPECT_EQ(d.last_plan() == "oneshot", std::string(threshold) != "0");
          results[rank].insert(results[rank].end(), out.begin(), out.end());
        }
    });
    if (std::string(threshold) == "32K") first = results[0];
    else EXPECT_EQ(first, results[0]) << "one-shot and plan results differ";
    EXPECT_EQ(results[0], results[1]);
    EXPECT_EQ(results[0], results[2]);
  }
}

// Ranks 0 and 1 broadcast, rank 2 all-reduces the same count. On a crowded host (more ranks than
// cores, as on CI's 2 cores) the broadcast takes the deep ring and the all-reduce the lockstep one,
// so rank 2 finds its peers' records of the call only in the other ring; it must still fail naming
// both calls, not wait for records that never come.
TEST(OneShot, ACallMismatchedAcrossRingsNamesBothCalls) {
  CommOptions opts = CommOptions::from_env();
  opts.timeout_s = 60;
  auto comms = Communicator::create_local(3, opts);
  std::string error;
  on_ranks(comms, [&](int rank, Communicator& comm) {
    std::vector<float> x(4, 1.0f);
    Reduction red;
    if (rank < 2) {
      run_oneshot(*comm.mailbox(), Collective::kBroadcast, x.data(), x.data(), 4, red, 0);
      return;
    }
    try {
      run_oneshot(*comm.mailbox(), Collective::kAllReduce, x.data(), x.data(), 4, red, 0);
    } catch (const InvalidArgument& e) {
      error = e.what();
    }
  });
  EXPECT_NE(error.find("every rank must make the same call"), std::string::npos) << error;
  EXPECT_NE(error.find("broadcast of 4 float to root 0"), std::string::npos) << error;
  EXPECT_NE(error.find("all_reduce of 4 float"), std::string::npos) << error;
}

TEST(OneShot, AbortEndsAWaitForAPeerThatNeverComes) {
  auto comms = Communicator::create_local(2);
  std::string error;
  std::thread waiter([&] {
    float x = 1, y = 0;
    Reduction red;
    try {
      run_oneshot(*comms[0]->mailbox(), Collective::kAllReduce, &x, &y, 1, red, 0);
    } catch (const Aborted& e) {
      error = e.what();
    }
  });
  comms[0]->abort();
  waiter.join();
  EXPECT_NE(error.find("one-shot mailbox"), std::string::npos) << error;
}

TEST(OneShot, TimeoutNamesTheRankThatDidNotPublish) {
  CommOptions opts = CommOptions::from_env();
  opts.timeout_s = 0.3;
  auto comms = Communicator::create_local(3, opts);
  float x = 1, y = 0;
  Reduction red;
  try {
    run_oneshot(*comms[2]->mailbox(), Collective::kAllReduce, &x, &y, 1, red, 0);
    FAIL() << "no timeout";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("all_reduce (one-shot mailbox call 1): waiting for rank 0 to publish"),
              std::string::npos)
        << e.what();
  }
}

TEST(OneShot, ExistsOnlyWhenEveryRankSharesMemory) {
  CommOptions tcp = CommOptions::from_env();
  tcp.transport = TransportKind::kTcp;
  EXPECT_EQ(Communicator::create_local(2, tcp)[0]->mailbox(), nullptr);
  CommOptions off = CommOptions::from_env();
  off.mailbox_bytes = 0;
  EXPECT_EQ(Communicator::create_local(2, off)[1]->mailbox(), nullptr);
  EXPECT_EQ(Communicator::create_local(1)[0]->mailbox(), nullptr);
}

TEST(OneShot, FitsFollowsTheCapacityAndTheCollectivesShape) {
  CommOptions opts = CommOptions::from_env();
  opts.mailbox_bytes = 1024;
  auto comms = Communicator::create_local(4, opts);
  const Mailbox& mb = *comms[0]->mailbox();
  // The outbox is whole cache lines: at least what was asked, less than a line more.
  ASSERT_GE(mb.capacity(), 1024u);
  ASSERT_LT(mb.capacity(), 1024u + 64);
  // Each outbox starts with the call's header (kOneshotHeaderBytes); the data gets the rest.
  const int64_t floats = static_cast<int64_t>((mb.capacity() - kOneshotHeaderBytes) / 4);
  EXPECT_TRUE(oneshot_fits(mb, Collective::kAllReduce, floats, 4));
  EXPECT_FALSE(oneshot_fits(mb, Collective::kAllReduce, floats + 1, 4));
  EXPECT_TRUE(oneshot_fits(mb, Collective::kAllGather, floats, 4));  // publishes its piece
  EXPECT_TRUE(oneshot_fits(mb, Collective::kReduceScatter, floats / 4, 4));  // publishes n pieces
  EXPECT_FALSE(oneshot_fits(mb, Collective::kReduceScatter, floats / 4 + 1, 4));
  EXPECT_FALSE(oneshot_fits(mb, Collective::kAllToAll, floats / 4 + 1, 4));
  EXPECT_FALSE(oneshot_fits(mb, Collective::kSendRecv, 1, 4));
}

TEST(OneShot, DispatcherUsesItForSmallCallsAndPlansForLargeOnes) {
  auto comms = Communicator::create_local(2);
  std::vector<std::string> small(2), large(2);
  on_ranks(comms, [&](int rank, Communicator& comm) {
    Dispatcher d(comm);
    std::vector<float> in(1 << 18, 1.f), out(1 << 18);
    CollectiveCall call;
    call.input = in.data();
    call.output = out.data();
    call.count = 16;
    d.run(call);
    small[rank] = d.last_plan();
    call.count = 1 << 18;
    d.run(call);
    large[rank] = d.last_plan();
    EXPECT_EQ(out[0], 2.f);
  });
  EXPECT_EQ(small[0], "oneshot");
  EXPECT_EQ(small[1], "oneshot");
  EXPECT_NE(large[0], "oneshot");
}
