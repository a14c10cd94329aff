// The public C++ API (include/tutti/tutti.hpp), used the way a program outside the tree uses it:
// only public headers here.
#include <gtest/gtest.h>
#include <sys/statvfs.h>

#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "support/env.hpp"
#include "tutti/tutti.hpp"

namespace {

// One thread per rank, as the API asks of a Comm.
template <class F>
void on_ranks(std::vector<tutti::Comm>& comms, F fn) {
  std::vector<std::thread> threads;
  for (size_t r = 0; r < comms.size(); ++r) threads.emplace_back([&, r] { fn(static_cast<int>(r), comms[r]); });
  for (auto& t : threads) t.join();
}

TEST(CppApi, AsynchronousCollectivesOnSpansGiveTheReferenceResults) {
  const int n = 3;
  const size_t count = 1001;
  auto comms = tutti::Comm::create_local(n);
  on_ranks(comms, [&](int r, tutti::Comm& c) {
    ASSERT_EQ(c.rank(), r);
    ASSERT_EQ(c.size(), n);
    std::vector<float> in(count), sum(count), gathered(count * n), scattered(count / 1);
    std::vector<double> big(count * n), part(count);
    for (size_t i = 0; i < count; ++i) in[i] = static_cast<float>((r + 1) * (i % 11));
    for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<double>(r * 1000 + i % 17);
    // Two calls in flight at once, waited for in the other order.
    tutti::Work a = c.all_reduce<float>(in, sum);
    tutti::Work b = c.all_gather<float>(in, gathered);
    tutti::Work d = c.reduce_scatter<double>(big, part, tutti::RedOp::kMax);
    d.wait();
    b.wait();
    a.wait();
    EXPECT_TRUE(a.test());
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(sum[i], static_cast<float>(6 * (i % 11))) << "rank " << r << " " << i;
    for (int q = 0; q < n; ++q)
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(gathered[q * count + i], static_cast<float>((q + 1) * (i % 11)));
    for (size_t i = 0; i < count; ++i)
      ASSERT_EQ(part[i], static_cast<double>((n - 1) * 1000 + (r * count + i) % 17)) << "rank " << r << " " << i;
    EXPECT_FALSE(c.last_plan().empty());
  });
}

TEST(CppApi, GroupedSendsAndReceivesAndAllToAll) {
  const int n = 4;
  auto comms = tutti::Comm::create_local(n);
  on_ranks(comms, [&](int r, tutti::Comm& c) {
    // A ring exchange in one group: each rank sends right and receives from the left.
    std::vector<int32_t> out(100, r), in(100, -1);
    c.group_start();
    tutti::Work s = c.send(out.data(), out.size(), tutti::DataType::kInt32, (r + 1) % n);
    tutti::Work rv = c.recv(in.data(), in.size(), tutti::DataType::kInt32, (r + n - 1) % n);
    EXPECT_THROW(s.wait(), tutti::InvalidUsage);  // the group has not ended
    tutti::Work g = c.group_end();
    g.wait();
    rv.wait();  // the group's Works are done together
    for (int32_t v : in) ASSERT_EQ(v, (r + n - 1) % n);
    std::vector<int64_t> to(n * 5), from(n * 5);
    for (int q = 0; q < n; ++q)
      for (int i = 0; i < 5; ++i) to[q * 5 + i] = r * 100 + q;
    c.all_to_all<int64_t>(to, from).wait();
    for (int q = 0; q < n; ++q)
      for (int i = 0; i < 5; ++i) ASSERT_EQ(from[q * 5 + i], q * 100 + r);
  });
}

TEST(CppApi, BadArgumentsAreRefusedAtTheCallNamingWhatIsWrong) {
  auto comms = tutti::Comm::create_local(1);
  tutti::Comm& c = comms[0];
  std::vector<float> a(10), b(9);
  try {
    c.all_reduce<float>(a, b);
    FAIL() << "accepted spans of different sizes";
  } catch (const tutti::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("all_reduce"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("10"), std::string::npos) << e.what();
  }
  EXPECT_THROW(c.send(a.data(), 10, tutti::DataType::kFloat32, 3), tutti::InvalidArgument);
  EXPECT_THROW(c.broadcast(a.data(), a.data(), 10, tutti::DataType::kFloat32, 5), tutti::InvalidArgument);
  EXPECT_THROW(c.group_end(), tutti::InvalidUsage);
  EXPECT_THROW(tutti::load_plan("/nonexistent/plan.json"), tutti::InvalidArgument);
  EXPECT_THROW(tutti::CommId::parse("not an id"), tutti::InvalidArgument);
  EXPECT_STRNE(tutti::version(), "");
}

// Shared memory the host cannot back is refused when it is asked for, naming the size: tmpfs grants
// any size to a sparse segment and would raise SIGBUS at the first write past what /dev/shm holds.
TEST(CppApi, SharedMemoryLargerThanDevShmIsRefusedAtAllocation) {
  struct statvfs fs {};
  ASSERT_EQ(statvfs("/dev/shm", &fs), 0);
  const size_t too_big = static_cast<size_t>(fs.f_blocks) * fs.f_frsize + (size_t{1} << 30);
  try {
    void* p = tutti::alloc_shared(too_big);
    tutti::free_shared(p);
    FAIL() << "alloc_shared handed out " << too_big << " bytes, more than /dev/shm holds";
  } catch (const tutti::SystemError& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(too_big)), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("/dev/shm"), std::string::npos) << e.what();
  }
  void* small = tutti::alloc_shared(4096);  // and a size that fits still works
  static_cast<char*>(small)[4095] = 1;
  tutti::free_shared(small);
}

TEST(CppApi, LoadedPlansAreVerifiedAndUsed) {
  // A shared MSCCL plan for 4 ranks, loaded through the API and forced by name.
  tutti::load_plan(TUTTI_TESTDATA "/msccl/ncv4-ag_hier_4_LL.xml");
  tutti::test_support::ScopedEnv env({{"TUTTI_ALGO", "allgather_hierarchical"}});
  const int n = 4;
  auto comms = tutti::Comm::create_local(n);
  on_ranks(comms, [&](int r, tutti::Comm& c) {
    std::vector<float> in(64, static_cast<float>(r)), out(64 * n);
    c.all_gather<float>(in, out).wait();
    for (int q = 0; q < n; ++q) ASSERT_EQ(out[q * 64], static_cast<float>(q));
    EXPECT_EQ(c.last_plan(), "allgather_hierarchical");
  });
}

}  // namespace
