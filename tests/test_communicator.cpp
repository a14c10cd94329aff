// Communicator lifecycle with ranks as threads: split, abort, timeouts, destroy, and leaks.
#include <dirent.h>
#include <gtest/gtest.h>

#include <atomic>
#include <exception>
#include <thread>

#include "runtime/communicator.hpp"
#include "tests/support/exchange.hpp"

using namespace tutti;

namespace {

// Runs fn(rank) on one thread per rank and rethrows the first exception.
template <class Fn>
void on_all(int n, Fn fn) {
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

int count_fds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (readdir(d)) ++n;
  closedir(d);
  return n;
}

TEST(Communicator, SplitByColorOrdersByKey) {
  const int n = 5;
  auto comms = Communicator::create_local(n);
  std::vector<std::unique_ptr<Communicator>> halves(n);
  on_all(n, [&](int r) {
    int color = r == 4 ? -1 : r % 2;  // rank 4 opts out (NCCL_SPLIT_NOCOLOR)
    halves[r] = comms[r]->split(color, -r);  // reversed order inside each color
  });
  EXPECT_EQ(halves[4], nullptr);
  EXPECT_EQ(halves[0]->size(), 2);
  EXPECT_EQ(halves[0]->rank(), 1);
  EXPECT_EQ(halves[2]->rank(), 0);
  EXPECT_EQ(halves[1]->size(), 2);
  EXPECT_EQ(halves[3]->rank(), 0);
  test_support::ExchangeSpec spec;
  spec.max_bytes = spec.big_bytes = 1 << 16;
  spec.messages = 4;
  on_all(4, [&](int r) { test_support::random_exchange(*halves[r], spec); });
}

TEST(Communicator, SingleRankWorks) {
  auto comms = Communicator::create_local(1);
  EXPECT_EQ(comms[0]->size(), 1);
  comms[0]->barrier();
  auto solo = comms[0]->split(0, 0);
  EXPECT_EQ(solo->size(), 1);
}

TEST(Communicator, AbortUnblocksEveryWaitingRank) {
  for (TransportKind t : {TransportKind::kShm, TransportKind::kTcp}) {
    CommOptions opts = CommOptions::from_env();
    opts.transport = t;
    auto comms = Communicator::create_local(3, opts);
    std::vector<std::string> errors(3);
    std::atomic<int> waiting{0};
    std::vector<std::thread> threads;
    // Ranks 1 and 2 wait for data rank 0 never sends; rank 0 aborts. No sleeps: abort before or
    // during the wait must both end it.
    for (int r = 1; r < 3; ++r)
      threads.emplace_back([&, r] {
        int x;
        ++waiting;
        try {
          comms[r]->recv(0, &x, sizeof(x));
        } catch (const Error& e) {
          errors[r] = std::string(to_string(e.kind())) + ": " + e.what();
        }
      });
    comms[0]->abort();
    for (auto& th : threads) th.join();
    for (int r = 1; r < 3; ++r) EXPECT_NE(errors[r].find("rank 0 aborted"), std::string::npos) << errors[r];
    int x;
    try {
      comms[0]->recv(1, &x, sizeof(x));
      FAIL();
    } catch (const Aborted& e) {
      EXPECT_NE(std::string(e.what()).find("aborted"), std::string::npos);
    }
  }
}

TEST(Communicator, AbortFromAnotherThreadEndsTheWait) {
  auto comms = Communicator::create_local(2);
  std::string error;
  std::thread waiter([&] {
    int x;
    try {
      comms[0]->recv(1, &x, sizeof(x));
    } catch (const Aborted& e) {
      error = e.what();
    }
  });
  comms[0]->abort();
  waiter.join();
  EXPECT_NE(error.find("rank 0: communicator aborted while waiting to receive from rank 1"), std::string::npos) << error;
}

TEST(Communicator, WaitTimesOutNamingPeerAndChannel) {
  CommOptions opts = CommOptions::from_env();
  opts.timeout_s = 0.3;
  auto comms = Communicator::create_local(2, opts);
  int x;
  try {
    comms[1]->recv(0, &x, sizeof(x));
    FAIL();
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("waiting to receive from rank 0 on channel 0"), std::string::npos) << e.what();
  }
}

TEST(Communicator, DestroyFlushesPendingSingleCopySends) {
  CommOptions opts = CommOptions::from_env();
  opts.shm_single_copy_threshold = 1 << 20;
  auto comms = Communicator::create_local(2, opts);
  std::vector<unsigned char> big(8 << 20, 0x5a), in(8 << 20);
  comms[0]->connection(1).send(big.data(), big.size());  // not waited for
  std::thread receiver([&] { comms[1]->recv(0, in.data(), in.size()); });
  comms[0].reset();  // must wait until rank 1 has read the buffer
  receiver.join();
  EXPECT_EQ(in, big);
}

TEST(Communicator, NoFileDescriptorOrSegmentLeaks) {
  // Warm up once: the first communicator starts process-wide state (log, one-shot root reaping).
  Communicator::create_local(2);
  int before = count_fds();
  for (int i = 0; i < 3; ++i) {
    for (TransportKind t : {TransportKind::kShm, TransportKind::kTcp}) {
      CommOptions opts = CommOptions::from_env();
      opts.transport = t;
      auto comms = Communicator::create_local(4, opts);
      test_support::ExchangeSpec spec;
      spec.max_bytes = spec.big_bytes = 1 << 20;
      spec.messages = 3;
      on_all(4, [&](int r) { test_support::random_exchange(*comms[r], spec); });
    }
  }
  EXPECT_EQ(count_fds(), before);
}

TEST(Communicator, InvalidCreationArguments) {
  UniqueId id = UniqueId::make(SocketAddress::parse("127.0.0.1:1"), 1);
  EXPECT_THROW(Communicator::create(id, 0, 0), InvalidArgument);
  EXPECT_THROW(Communicator::create(id, 2, 2), InvalidArgument);
  EXPECT_THROW(Communicator::create(UniqueId{}, 2, 0), InvalidArgument);
  EXPECT_THROW(Communicator::create_local(0), InvalidArgument);
}

}  // namespace
