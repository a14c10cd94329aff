// Ordered delivery of random-sized messages (0 B .. 64 MiB) between ranks running as threads, over
// both transports and over the shared-memory FIFO alone. The same traffic runs between processes
// through tutti-test-rank under tutti-run (see CMakeLists.txt).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <fstream>
#include <thread>

#include "core/error.hpp"
#include "runtime/shm_segment.hpp"
#include "runtime/transport/shm.hpp"
#include "tests/support/env.hpp"
#include "tests/support/exchange.hpp"

using namespace tutti;

namespace {

struct Case {
  int ranks;
  TransportKind transport;
  bool fifo_only;  // single copy off and tiny slots: every byte goes through the slots
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return fmt::format("{}_{}ranks{}", c.transport == TransportKind::kShm ? "shm" : "tcp", c.ranks,
                     c.fifo_only ? "_fifo" : "");
}

class ThreadExchange : public ::testing::TestWithParam<Case> {};

TEST_P(ThreadExchange, DeliversEveryMessageInOrder) {
  const Case& c = GetParam();
  CommOptions opts = CommOptions::from_env();
  opts.transport = c.transport;
  opts.timeout_s = 300;
  opts.shm_single_copy_threshold = 256 << 10;  // exercise single copy for the large messages
  if (c.fifo_only) {
    opts.shm_single_copy = false;
    opts.shm_slots = 2;
    opts.shm_slot_size = 4096;
  }
  auto comms = Communicator::create_local(c.ranks, opts);
  for (int r = 0; r < c.ranks; ++r)
    for (int p = 0; p < c.ranks; ++p)
      if (p != r) {
        EXPECT_STREQ(comms[r]->transport_to(p), c.transport == TransportKind::kShm ? "shm" : "tcp");
      }
  test_support::ExchangeSpec spec;
  spec.seed = static_cast<uint64_t>(c.ranks * 10 + static_cast<int>(c.transport));
  spec.max_bytes = c.ranks >= 8 ? (1 << 20) : (4 << 20);
  spec.messages = c.ranks >= 8 ? 6 : 10;
  std::vector<std::exception_ptr> errors(c.ranks);
  std::vector<size_t> got(c.ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < c.ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        got[r] = test_support::random_exchange(*comms[r], spec);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < c.ranks; ++r) {
    if (errors[r]) {
      try {
        std::rethrow_exception(errors[r]);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << ": " << e.what();
      }
    }
  }
  EXPECT_GE(got[1], spec.big_bytes);  // rank 1 received the 64 MiB message
}

INSTANTIATE_TEST_SUITE_P(Matrix, ThreadExchange,
                         ::testing::Values(Case{2, TransportKind::kShm, false}, Case{3, TransportKind::kShm, false},
                                           Case{4, TransportKind::kShm, false}, Case{8, TransportKind::kShm, false},
                                           Case{2, TransportKind::kTcp, false}, Case{3, TransportKind::kTcp, false},
                                           Case{4, TransportKind::kTcp, false}, Case{8, TransportKind::kTcp, false},
                                           Case{3, TransportKind::kShm, true}),
                         case_name);

TEST(Transport, SizeMismatchIsAnErrorNamingBothSizes) {
  for (TransportKind t : {TransportKind::kShm, TransportKind::kTcp}) {
    CommOptions opts = CommOptions::from_env();
    opts.transport = t;
    opts.timeout_s = 60;
    auto comms = Communicator::create_local(2, opts);
    std::vector<char> out(100), in(64);
    std::string message;
    std::thread sender([&] {
      try {
        comms[0]->send(1, out.data(), out.size());
      } catch (const Error&) {
        // The receiver fails the communicator; the sender may or may not notice.
      }
    });
    try {
      comms[1]->recv(0, in.data(), in.size());
    } catch (const RemoteError& e) {
      message = e.what();
    }
    comms[1]->abort();
    sender.join();
    EXPECT_NE(message.find("peer sent 100 bytes"), std::string::npos) << message;
    EXPECT_NE(message.find("posted for 64"), std::string::npos) << message;
  }
}

TEST(Transport, BadArgumentsAreRejected) {
  auto comms = Communicator::create_local(2);
  EXPECT_THROW(comms[0]->send(5, nullptr, 0), InvalidArgument);
  EXPECT_THROW(comms[0]->send(0, nullptr, 0), InvalidArgument);  // self
  EXPECT_THROW(comms[0]->send(1, nullptr, 8), InvalidArgument);
  EXPECT_THROW(comms[0]->connection(1, 3), InvalidArgument);
}

// kB of shared memory this process maps with huge pages (PMD entries).
long shmem_huge_kb() {
  std::ifstream rollup("/proc/self/smaps_rollup");
  std::string line;
  while (std::getline(rollup, line))
    if (line.rfind("ShmemPmdMapped:", 0) == 0) return std::stol(line.substr(15));
  return -1;
}

// A FIFO that whole slots stream through goes onto huge pages (runtime/huge_pages.hpp), in both
// ranks' views; one that carries only small messages, or any with TUTTI_HUGE_PAGES=0, does not.
TEST(Transport, FifosOfLargeMessagesAreOnHugePages) {
  {
    ShmSegment probe = ShmSegment::create("hugeprobe", 2 << 20);
    if (madvise(probe.data(), 2 << 20, 25 /* MADV_COLLAPSE */) != 0)
      GTEST_SKIP() << "this kernel gives shared memory no huge pages: " << std::strerror(errno);
  }
  for (bool huge : {false, true}) {
    CommOptions opts = CommOptions::from_env();
    opts.transport = TransportKind::kShm;
    opts.timeout_s = 60;
    opts.huge_pages = huge;
    opts.shm_single_copy = false;
    opts.shm_zero_copy_threshold = UINT64_MAX;  // every byte through the slots
    auto comms = Communicator::create_local(2, opts);
    const long before = shmem_huge_kb();  // after setup: a crowded host's outboxes are not the FIFOs
    auto exchange = [&](size_t bytes) {
      std::vector<unsigned char> out(bytes, 7), in(bytes);
      std::thread sender([&] { comms[0]->send(1, out.data(), out.size()); });
      comms[1]->recv(0, in.data(), in.size());
      sender.join();
      EXPECT_EQ(in, out);
    };
    exchange(4096);
    EXPECT_EQ(shmem_huge_kb(), before) << "a FIFO of small messages only";
    exchange(1 << 20);
    if (huge) {
      EXPECT_GE(shmem_huge_kb(), before + 2048) << "the FIFO of a 1 MiB message";
    } else {
      EXPECT_EQ(shmem_huge_kb(), before) << "TUTTI_HUGE_PAGES=0";
    }
  }
}

// Every outbox of the one-shot mailbox goes onto huge pages when the communicator is made, on a
// crowded host (more ranks than cores) and elsewhere; with TUTTI_HUGE_PAGES=0 they stay on small
// pages.
TEST(Transport, OutboxesAreOnHugePages) {
  {
    ShmSegment probe = ShmSegment::create("hugeprobe", 2 << 20);
    if (madvise(probe.data(), 2 << 20, 25 /* MADV_COLLAPSE */) != 0)
      GTEST_SKIP() << "this kernel gives shared memory no huge pages: " << std::strerror(errno);
  }
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  for (int ranks : {2, cores + 1}) {
    for (bool huge : {false, true}) {
      const long before = shmem_huge_kb();
      CommOptions opts = CommOptions::from_env();
      opts.transport = TransportKind::kShm;
      opts.huge_pages = huge;
      auto comms = Communicator::create_local(ranks, opts);
      EXPECT_EQ(comms[0]->crowded_host(), ranks > cores);
      const long outboxes_kb = static_cast<long>(ranks) * 2 * 2048;  // an outbox holds two whole huge pages
      if (huge) {
        EXPECT_GE(shmem_huge_kb(), before + outboxes_kb) << ranks << " ranks on " << cores << " cores";
      } else {
        EXPECT_EQ(shmem_huge_kb(), before) << ranks << " ranks on " << cores << " cores, TUTTI_HUGE_PAGES=0";
      }
    }
  }
}

TEST(Transport, MoreChannelsAreIndependentStreams) {
  auto comms = Communicator::create_local(2);
  std::thread t([&] { comms[1]->ensure_channels(3); });
  comms[0]->ensure_channels(3);
  t.join();
  int a = 1, b = 2, ra = 0, rb = 0;
  // Send on channel 2 first, then channel 1; receive in the other order: channels do not block each other.
  std::thread sender([&] {
    auto s2 = comms[0]->connection(1, 2).send(&b, sizeof(b));
    auto s1 = comms[0]->connection(1, 1).send(&a, sizeof(a));
    comms[0]->wait_send(1, s1, 1);
    comms[0]->wait_send(1, s2, 2);
  });
  comms[1]->recv(0, &ra, sizeof(ra), 1);
  comms[1]->recv(0, &rb, sizeof(rb), 2);
  sender.join();
  EXPECT_EQ(ra, 1);
  EXPECT_EQ(rb, 2);
}

}  // namespace

namespace {
// Single copy is chosen per peer by a probe at setup; when the kernel refuses the read the FIFO is
// used instead. The probe must say no, not crash, for every kind of refusal.
TEST(Transport, SingleCopyProbeDetectsForbiddenReads) {
  static uint64_t word = 0x1234567890abcdefull;
  EXPECT_TRUE(probe_single_copy(getpid(), reinterpret_cast<uint64_t>(&word), word));
  EXPECT_FALSE(probe_single_copy(getpid(), reinterpret_cast<uint64_t>(&word), word + 1));  // wrong content
  EXPECT_FALSE(probe_single_copy(getpid(), 16, word));                                      // unmapped address
  EXPECT_FALSE(probe_single_copy(0x3fffffff, reinterpret_cast<uint64_t>(&word), word));     // no such process
}
}  // namespace

namespace tutti {
namespace {

// Shared segments: owner-only, named with random bits (another user can neither guess nor
// pre-create one), and a segment that is not this user's with mode 600 is refused on open.
TEST(SharedSegments, AreOwnerOnlyUnguessableAndForeignOnesAreRefused) {
  ShmSegment a = ShmSegment::create("test", 4096), b = ShmSegment::create("test", 4096);
  struct stat st {};
  ASSERT_EQ(::stat(("/dev/shm" + a.name()).c_str(), &st), 0) << a.name();
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, geteuid());
  // /tutti-PID-RANDOM-COUNTER-what: 16 hex digits of randomness, different for every segment.
  auto nonce = [](const std::string& name) { return name.substr(name.find('-', 7) + 1, 16); };
  EXPECT_EQ(nonce(a.name()).find_first_not_of("0123456789abcdef"), std::string::npos) << a.name();
  EXPECT_NE(nonce(a.name()), nonce(b.name()));

  const std::string foreign = "/tutti-" + std::to_string(getpid()) + "-foreign-test";
  int fd = shm_open(foreign.c_str(), O_CREAT | O_EXCL | O_RDWR, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(fchmod(fd, 0644), 0);  // past the umask: readable by others
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  auto refused = [&] {
    try {
      ShmSegment::open(foreign, 4096);
    } catch (const RemoteError& e) {
      return std::string(e.what());
    }
    return std::string("opened");
  };
  EXPECT_NE(refused().find("refusing a segment this job did not create"), std::string::npos) << refused();
  if (geteuid() == 0) {  // CI runs as root: a segment of another user, mode 600
    ASSERT_EQ(fchmod(fd, 0600), 0);
    ASSERT_EQ(fchown(fd, 65534, 65534), 0);
    EXPECT_NE(refused().find("owned by uid 65534"), std::string::npos) << refused();
  }
  ::close(fd);
  shm_unlink(foreign.c_str());
}

}  // namespace
}  // namespace tutti

// The FIFO/single-copy choice between processes (runtime/transport/single_copy_choice.hpp), fed
// with costs as the connection measures them (ns per MiB).
namespace {
// Costs measured on one direction only (the other direction carries nothing).
PairCosts one_way(double send, double recv, double cma) { return PairCosts{send, recv, cma, 0, 0, 0}; }
// What the other end of the connection reads: the same figures, its out being our in.
PairCosts mirrored(const PairCosts& c) { return PairCosts{c.send_in, c.recv_in, c.cma_in, c.send_out, c.recv_out, c.cma_out}; }
// Of `messages` decisions, those that took single copy; `first`: the first one's number (from 1).
int count_single(SingleCopyChoice& c, const PairCosts& costs, int messages, int* first = nullptr) {
  int n = 0;
  for (int m = 1; m <= messages; ++m)
    if (c.single_copy(1 << 20, costs)) {
      if (first && n == 0) *first = m;
      ++n;
    }
  return n;
}
constexpr int kBurst = SingleCopyChoice::kBurst;
}  // namespace

TEST(SingleCopyChoice, FollowsTheMeasuredCostsAndTriesTheLoserInBursts) {
  const uint64_t slot = 256 << 10;
  // Nothing measured yet: the FIFO, which measures itself.
  SingleCopyChoice near(slot, 64 << 20, true);
  EXPECT_EQ(count_single(near, PairCosts{}, 100), 0);
  // The FIFO measured, single copy not: one burst from the kFirstProbe-th message that qualifies on,
  // and while the receiver publishes no figure for it, a burst every kProbeCma.
  SingleCopyChoice fresh(slot, 64 << 20, true);
  int first = 0;
  EXPECT_EQ(count_single(fresh, one_way(45'000, 40'000, 0), 100, &first), kBurst);
  EXPECT_EQ(first, static_cast<int>(SingleCopyChoice::kFirstProbe));
  EXPECT_EQ(count_single(fresh, one_way(45'000, 40'000, 0), static_cast<int>(SingleCopyChoice::kProbeCma)), kBurst);
  // Cores near each other: the FIFO's two copies (85 us per MiB) beat single copy (240): single copy
  // only in a burst every kProbeCma messages.
  SingleCopyChoice nearby(slot, 64 << 20, true);
  const int rounds = 4, messages = rounds * static_cast<int>(SingleCopyChoice::kProbeCma) + kBurst - 1;
  EXPECT_EQ(count_single(nearby, one_way(45'000, 40'000, 240'000), messages), rounds * kBurst);
  // Cores far apart: the sender's copy into slots the receiver's cache holds slows to 140 us per MiB;
  // single copy wins (95 against 205) and the FIFO gets a burst every kProbeFifo messages.
  SingleCopyChoice far(slot, 64 << 20, true);
  const int far_messages = rounds * static_cast<int>(SingleCopyChoice::kProbeFifo) + kBurst - 1;
  EXPECT_EQ(far_messages - count_single(far, one_way(140'000, 65'000, 95'000), far_messages), rounds * kBurst);
  // A near-tie stays with the FIFO (single copy must win by 10 %).
  SingleCopyChoice tie(slot, 64 << 20, true);
  EXPECT_LE(count_single(tie, one_way(140'000, 65'000, 190'000), 200), kBurst);
}

// An exchange with one direction by FIFO and the other by single copy is slower than either, so
// both ends weigh both directions and decide alike, message by message, bursts included: here the
// first direction alone would take single copy (70 against 85) and the second the FIFO (200 against
// 85); together the FIFO wins (170 against 270) on both ends.
TEST(SingleCopyChoice, BothEndsOfAConnectionChooseAlike) {
  const uint64_t slot = 256 << 10;
  const PairCosts a{45'000, 40'000, 70'000, 45'000, 40'000, 200'000};
  EXPECT_TRUE(SingleCopyChoice::prefers_single_copy(one_way(45'000, 40'000, 70'000)));
  EXPECT_FALSE(SingleCopyChoice::prefers_single_copy(a));
  EXPECT_FALSE(SingleCopyChoice::prefers_single_copy(mirrored(a)));
  SingleCopyChoice here(slot, 64 << 20, true), there(slot, 64 << 20, true);
  int single = 0;
  const int rounds = 8, messages = rounds * static_cast<int>(SingleCopyChoice::kProbeCma) + kBurst - 1;
  for (int m = 0; m < messages; ++m) {
    const bool x = here.single_copy(1 << 20, a), y = there.single_copy(1 << 20, mirrored(a));
    ASSERT_EQ(x, y) << "message " << m;
    single += x;
  }
  EXPECT_EQ(single, rounds * kBurst);
  // Where both directions favour single copy, both ends take it.
  const PairCosts b{140'000, 65'000, 95'000, 130'000, 60'000, 100'000};
  SingleCopyChoice p(slot, 64 << 20, true), q(slot, 64 << 20, true);
  for (int m = 0; m < 100; ++m) ASSERT_EQ(p.single_copy(1 << 20, b), q.single_copy(1 << 20, mirrored(b)));
  EXPECT_TRUE(p.single_copy(1 << 20, b));
}

TEST(SingleCopyChoice, ThresholdAndSlotBoundTheMeasuredChoice) {
  const uint64_t slot = 256 << 10;
  SingleCopyChoice c(slot, 8 << 20, true);
  const PairCosts slow_fifo = one_way(100'000, 400'000, 1'000);  // single copy wins wherever the rates decide
  for (int m = 0; m < 100; ++m) {
    EXPECT_FALSE(c.single_copy(slot - 1, slow_fifo)) << "below its smallest message: always the FIFO";
    EXPECT_TRUE(c.single_copy(8 << 20, one_way(1, 1, 1'000'000))) << "at the threshold: always single copy";
  }
  // Adaptation off (TUTTI_SHM_CMA_ADAPTIVE=0 or a threshold the user set): the threshold alone.
  c.set_adaptive(false);
  for (int m = 0; m < 100; ++m) EXPECT_FALSE(c.single_copy(1 << 20, slow_fifo));
  EXPECT_TRUE(c.single_copy(8 << 20, slow_fifo));
  c.set_threshold(512 << 10);
  EXPECT_TRUE(c.single_copy(1 << 20, PairCosts{}));
}

TEST(SingleCopyChoice, MessagesUnderASlotAreChosenForByClassesOfSize) {
  const uint64_t slot = 128 << 10;
  EXPECT_EQ(cost_class(slot, slot), 0);
  EXPECT_EQ(cost_class(64 << 20, slot), 0);
  EXPECT_EQ(cost_class(kSmallestChosen - 1, slot), -1) << "below 16 KiB: always the FIFO";
  EXPECT_EQ(cost_class(0, slot), -1);
  EXPECT_EQ(cost_class(16 << 10, slot), 1);
  EXPECT_EQ(cost_class((32 << 10) - 1, slot), 1);
  EXPECT_EQ(cost_class(32 << 10, slot), 2);
  EXPECT_EQ(cost_class(100 << 10, slot), 3);
  // A large slot: sizes past the last class share it.
  const uint64_t big = 64 << 20;
  EXPECT_EQ(cost_class(4 << 20, big), kCostClasses - 1);
  EXPECT_EQ(cost_class(big - 1, big), kCostClasses - 1);
  // Which class a copy through the FIFO is timed for: a full slot is class 0, a message under a slot
  // its own class, and the last, partial fragment of a large message none (it is not a full slot's
  // rate, and the message was chosen for in class 0).
  EXPECT_EQ(measured_class(slot, 3 * slot, slot), 0);
  EXPECT_EQ(measured_class(slot / 2, slot + slot / 2, slot), -1);
  EXPECT_EQ(measured_class(40 << 10, 40 << 10, slot), 2);
  EXPECT_EQ(measured_class(8 << 10, 8 << 10, slot), -1);
  // Their probing bursts are shorter: with single copy never measured, one burst of kSubSlotBurst.
  SingleCopyChoice sub(kSmallestChosen, 64 << 20, true, SingleCopyChoice::kSubSlotBurst);
  EXPECT_EQ(count_single(sub, one_way(25'000, 35'000, 0), static_cast<int>(SingleCopyChoice::kProbeCma) - 1),
            SingleCopyChoice::kSubSlotBurst);
}

TEST(SingleCopyChoice, TheUsersThresholdTurnsTheMeasuredChoiceOff) {
  for (const char* set : {static_cast<const char*>(nullptr), "4M"}) {
    test_support::ScopedEnv env({{"TUTTI_SHM_CMA_THRESHOLD", set}, {"TUTTI_SHM_CMA_ADAPTIVE", nullptr}});
    CommOptions o = CommOptions::from_env();
    EXPECT_EQ(o.shm_single_copy_adaptive, set == nullptr) << (set ? set : "unset");
  }
  test_support::ScopedEnv off({{"TUTTI_SHM_CMA_ADAPTIVE", "0"}});
  EXPECT_FALSE(CommOptions::from_env().shm_single_copy_adaptive);
}

TEST(SingleCopyChoice, OneInterruptedCopyDoesNotSwingTheAverage) {
  RateAverage r;
  for (int i = 0; i < 8; ++i) r.add(1 << 20, 40'000);
  r.add(1 << 20, 4'000'000);  // preempted in the middle of the copy
  EXPECT_DOUBLE_EQ(r.ns_per_mib(), 40'000);
  for (int i = 0; i < 8; ++i) r.add(1 << 20, 40'000);
  // A lasting change (the cores moved apart) passes from its second sample on.
  r.add(1 << 20, 140'000);
  EXPECT_DOUBLE_EQ(r.ns_per_mib(), 40'000);
  r.add(1 << 20, 140'000);
  EXPECT_GT(r.ns_per_mib(), 60'000);
  for (int i = 0; i < 16; ++i) r.add(1 << 20, 140'000);
  EXPECT_NEAR(r.ns_per_mib(), 140'000, 1'000);
}
