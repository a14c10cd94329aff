// The device plan interpreter on the emulated device (the CUDA kernel's source compiled for the
// host, a CPU thread per thread block, the same FIFO and flag protocol): every built-in at 1, 2, 3,
// 4 and 8 ranks, in and out of place, Simple and LL; every data type and operator; the shared MSCCL
// plans; FIFOs of one and two slots; failures that name where they stopped. Results are compared bit
// for bit with the CPU reductions over nccl-tests-style data (exact in every type, any order).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <thread>

#include "collectives/algorithms/registry.hpp"
#include "compiler/compile.hpp"
#include "compiler/plan_file.hpp"
#include "core/reduce.hpp"
#include "runtime/cpu_executor.hpp"
#include "runtime/device/device_executor.hpp"
#include "runtime/device/host_staging.hpp"
#include "plan/semantics.hpp"
#include "support/env.hpp"
#include "support/ranks.hpp"
#include "support/sanitizers.hpp"

using namespace tutti;
using namespace tutti::device;

namespace {

// In place, these collectives' input is the rank's slice of the output (gathers) or their output
// the rank's slice of the input (scatters).
bool gathers(Collective c) { return c == Collective::kAllGather || c == Collective::kGather; }
bool scatters(Collective c) { return c == Collective::kReduceScatter || c == Collective::kScatter; }

using Prepared = std::shared_ptr<const PreparedPlan>;

// Small values whose sums, products, minima and maxima over up to 8 ranks are exact in every type,
// including fp8 (integers up to 16 in e4m3, powers of two up to 256).
double value(DataType type, RedOp op, int rank, int64_t i) {
  const bool is_unsigned = type == DataType::kUint8 || type == DataType::kUint32 || type == DataType::kUint64;
  int64_t h = (rank * 7 + i * 3 + i / 5) % 3;
  switch (op) {
    case RedOp::kProd: return h == 0 ? 1 : h == 1 ? (is_unsigned ? 1 : -1) : 2;
    case RedOp::kMin:
    case RedOp::kMax: return static_cast<double>((rank * 5 + i * 7) % 7) - (is_unsigned ? 0 : 3);
    default: return is_unsigned ? static_cast<double>(h) : static_cast<double>(h - 1);
  }
}

struct Options {
  DataType type = DataType::kFloat32;
  RedOp op = RedOp::kSum;
  int32_t protocol = kProtoSimple;
  int64_t slot_bytes = 4096;  // small slots: most calls take several rounds
  int64_t ll_slot_bytes = 2048;
  int64_t fifo_depth = 8;
  int instances = 1;
  double timeout_s = 120;  // a deadlock fails the test instead of hanging it
  bool registered = false;  // register every rank's buffers (peers may read them in place)
};

DeviceOptions device_options(const Options& o) {
  DeviceOptions d;
  d.slot_bytes = o.slot_bytes;
  d.ll_slot_bytes = o.ll_slot_bytes;
  d.fifo_depth = o.fifo_depth;
  d.instances = o.instances;
  d.protocol = o.protocol;
  d.timeout_s = o.timeout_s;
  return d;
}

// Runs each plan of `seq` in turn on one emulated-device executor per rank (later plans meet the
// FIFO counters and epochs earlier ones left) and checks every output element bit for bit. Adds
// the messages peers read in place to *direct.
void run_and_check(const std::vector<Prepared>& seq, const std::vector<int64_t>& counts, const Options& o,
                   uint64_t* direct = nullptr) {
  ASSERT_FALSE(seq.empty());
  const int n = seq[0]->plan.nranks;
  auto comms = Communicator::create_local(n);
  std::vector<std::unique_ptr<DeviceExecutor>> executors;
  for (int r = 0; r < n; ++r)
    executors.push_back(std::make_unique<DeviceExecutor>(*comms[r], make_emulated_backend(), device_options(o)));
  const int64_t es = static_cast<int64_t>(size_of(o.type));
  for (int64_t count : counts)
    for (const Prepared& prepared : seq) {
      const plan::Plan& pl = prepared->plan;
      SCOPED_TRACE(fmt::format("{} ranks={} {} {} {} count={}", pl.name, n, pl.inplace ? "in-place" : "out-of-place",
                               name(o.type), name(o.op), o.protocol == kProtoLL ? "LL" : "Simple", count));
      CollectiveSpec spec = pl.spec();
      const int64_t C = pl.chunk_factor;
      const int64_t in_elems = spec.input_chunks() / C * count, out_elems = spec.output_chunks() / C * count;
      auto elem = [&](std::vector<unsigned char>& v, int64_t i) { return v.data() + i * es; };
      std::vector<std::vector<unsigned char>> in(n), out(n);
      for (int r = 0; r < n; ++r) {
        in[r].resize(static_cast<size_t>(in_elems * es));
        for (int64_t i = 0; i < in_elems; ++i) store_value(o.type, elem(in[r], i), value(o.type, o.op, r, i));
        out[r].assign(static_cast<size_t>(out_elems * es), 0xa5);
        if (pl.inplace && gathers(pl.collective)) {
          if (count > 0) std::memcpy(out[r].data() + r * count * es, in[r].data(), static_cast<size_t>(count * es));
        }
        else if (pl.inplace && !scatters(pl.collective))
          out[r] = in[r];
      }
      test_support::on_ranks(comms, [&](int r, Communicator&) {
        if (o.registered) {
          if (!in[r].empty()) executors[r]->register_memory(in[r].data(), in[r].size());
          if (!out[r].empty()) executors[r]->register_memory(out[r].data(), out[r].size());
        }
        ExecArgs a;
        a.count = count;
        a.reduction.type = o.type;
        a.reduction.op = o.op;
        if (pl.inplace && scatters(pl.collective)) {
          a.input = in[r].data();
          a.output = in[r].data() + r * count * es;
        } else {
          a.input = pl.inplace ? out[r].data() : in[r].data();
          a.output = out[r].data();
        }
        executors[r]->run(*prepared, a);
        if (o.registered) {
          if (!in[r].empty()) executors[r]->deregister_memory(in[r].data(), in[r].size());
          if (!out[r].empty()) executors[r]->deregister_memory(out[r].data(), out[r].size());
        }
        if (pl.inplace && scatters(pl.collective) && count > 0)
          std::memcpy(out[r].data(), in[r].data() + r * count * es, static_cast<size_t>(count * es));
      });
      // Reference: each output element folds its contributions with the CPU kernels.
      exec::Geometry g{count, C, es};
      std::vector<unsigned char> want(static_cast<size_t>(es)), part(static_cast<size_t>(es));
      for (int r = 0; r < n; ++r)
        for (int64_t j = 0; j < spec.output_chunks(); ++j) {
          auto post = spec.postcondition(r, static_cast<int>(j));
          if (!post) continue;
          for (int64_t e = g.chunk_begin(j); e < g.chunk_end(j); ++e) {
            const int64_t within = e - g.chunk_begin(j);
            bool first = true;
            for (auto& c : post->parts) {
              store_value(o.type, part.data(), value(o.type, o.op, c.rank, g.chunk_begin(c.index) + within));
              if (first) want = part;
              else combine(o.op, o.type, want.data(), want.data(), part.data(), 1);
              first = false;
            }
            ASSERT_EQ(std::memcmp(elem(out[r], e), want.data(), static_cast<size_t>(es)), 0)
                << "rank " << r << " output element " << e << " (chunk " << j << ")";
          }
        }
    }
  if (direct)
    for (auto& e : executors) *direct += e->direct_messages();
  test_support::on_ranks(comms, [&](int r, Communicator&) { executors[r]->close(); });
}

Prepared builtin(const std::string& name, int n, algorithms::Params prm = {}) {
  return PreparedPlan::make(plan::compile(algorithms::build(name, n, prm)).plan);
}

class EveryBuiltin : public testing::TestWithParam<int32_t> {};

TEST_P(EveryBuiltin, ProducesTheReferenceResultAtEveryRankCount) {
  Options o;
  o.protocol = GetParam();
  for (const auto& b : algorithms::builtins())
    for (int n : {1, 2, 3, 4, 8})
      for (int inplace : {0, 1}) {
        algorithms::Params prm;
        bool has_inplace = false;
        for (auto& p : b.params) has_inplace |= p.name == "inplace";
        if (has_inplace) prm["inplace"] = inplace;
        else if (inplace) continue;
        if (b.name.find("hier") != std::string::npos) prm["local"] = n % 2 == 0 ? 2 : 1;
        if (b.name.find("broadcast") != std::string::npos || b.name == "tree_reduce") prm["root"] = n - 1;
        try {
          algorithms::resolve(b, n, prm);
        } catch (const InvalidArgument&) {
          continue;  // not offered at this rank count
        }
        // Under ThreadSanitizer (a third of its job's time went here) the large count, many slots a
        // transfer, runs at 2 and 4 ranks only.
        std::vector<int64_t> counts = {0, 1, 7, 1000};
        if (!test_support::kThreadSanitizer || n == 2 || n == 4) counts.push_back(30001);
        ASSERT_NO_FATAL_FAILURE(run_and_check({builtin(b.name, n, prm)}, counts, o));
      }
}

INSTANTIATE_TEST_SUITE_P(Protocols, EveryBuiltin, testing::Values(kProtoSimple, kProtoLL),
                         [](const auto& info) { return info.param == kProtoLL ? std::string("LL") : std::string("Simple"); });

struct TypeCase {
  DataType type;
  int32_t protocol;
};
class EveryTypeAndOp : public testing::TestWithParam<TypeCase> {};

TEST_P(EveryTypeAndOp, AllReduceReduceScatterAllGatherAreBitExact) {
  std::vector<Prepared> plans = {builtin("ring_allreduce", 3, {{"channels", 2}}),
                                 builtin("ring_allreduce", 4, {{"inplace", 1}}), builtin("rhd_allreduce", 4),
                                 builtin("ring_reducescatter", 4), builtin("ring_allgather", 3, {{"inplace", 1}})};
  for (RedOp op : {RedOp::kSum, RedOp::kProd, RedOp::kMin, RedOp::kMax}) {
    Options o;
    o.type = GetParam().type;
    o.protocol = GetParam().protocol;
    o.op = op;
    for (const Prepared& p : plans) ASSERT_NO_FATAL_FAILURE(run_and_check({p}, {1, 33, 2049}, o));
  }
}

std::vector<TypeCase> type_cases() {
  std::vector<TypeCase> out;
  for (int t = 0; t < kNumDataTypes; ++t)
    for (int32_t proto : {kProtoSimple, kProtoLL}) out.push_back({static_cast<DataType>(t), proto});
  return out;
}
INSTANTIATE_TEST_SUITE_P(Types, EveryTypeAndOp, testing::ValuesIn(type_cases()), [](const auto& info) {
  return std::string(name(info.param.type)) + (info.param.protocol == kProtoLL ? "_LL" : "_Simple");
});

TEST(DeviceExecutor, SharedMscclPlansRunAtTheirRankCounts) {
  int seen = 0;
  for (const auto& entry : std::filesystem::directory_iterator(TUTTI_TESTDATA "/msccl")) {
    SCOPED_TRACE(entry.path().string());
    plan::Plan loaded = plan::load_file(entry.path().string());
    plan::certify(loaded);
    Prepared p = PreparedPlan::make(std::move(loaded));
    for (int32_t proto : {kProtoSimple, kProtoLL}) {
      // Under ThreadSanitizer (half of its job's time went here) each plan runs one protocol, the
      // plans taking turns, so both protocols still run at many rank counts.
      if (test_support::kThreadSanitizer && (proto == kProtoLL) != (seen % 2 == 1)) continue;
      Options o;
      o.protocol = proto;
      o.slot_bytes = 64 << 10;
      o.ll_slot_bytes = 64 << 10;
      const int64_t C = p->plan.chunk_factor;
      ASSERT_NO_FATAL_FAILURE(run_and_check({p}, {C, 257 * C}, o));
    }
    ++seen;
  }
  EXPECT_GE(seen, 6);
}

// ncclCommRegister's direct reads: with registered buffers, a send the compiler marked stable lets
// the peer read the data from the sender's buffer; results stay exact for every built-in and the
// shared MSCCL plans, in and out of place (where later writes forbid it, the data goes through the
// FIFO), and FIFOs of the verified depth still finish.
TEST(DeviceExecutor, RegisteredBuffersAreReadInPlaceWhereThePlanAllows) {
  Options o;
  o.registered = true;
  uint64_t direct = 0;
  for (const auto& b : algorithms::builtins())
    for (int n : {2, 3, 4})
      for (int inplace : {0, 1}) {
        algorithms::Params prm;
        bool has_inplace = false;
        for (auto& p : b.params) has_inplace |= p.name == "inplace";
        if (has_inplace) prm["inplace"] = inplace;
        else if (inplace) continue;
        if (b.name.find("hier") != std::string::npos) prm["local"] = n % 2 == 0 ? 2 : 1;
        try {
          algorithms::resolve(b, n, prm);
        } catch (const InvalidArgument&) {
          continue;
        }
        ASSERT_NO_FATAL_FAILURE(run_and_check({builtin(b.name, n, prm)}, {1, 1000, 30001}, o, &direct));
      }
  EXPECT_GT(direct, 0u);
  for (const auto& entry : std::filesystem::directory_iterator(TUTTI_TESTDATA "/msccl")) {
    SCOPED_TRACE(entry.path().string());
    plan::Plan loaded = plan::load_file(entry.path().string());
    plan::certify(loaded);
    Prepared p = PreparedPlan::make(std::move(loaded));
    o.slot_bytes = 64 << 10;
    ASSERT_NO_FATAL_FAILURE(run_and_check({p}, {p->plan.chunk_factor * 257}, o));
  }
  // Every message of an out-of-place all-gather's first hop, and none without registration or in LL.
  Options one;
  one.registered = true;
  one.fifo_depth = 2;  // the verified depth: direct messages still hold their slots until read
  one.slot_bytes = 256;
  uint64_t ring = 0, plain = 0, ll = 0;
  ASSERT_NO_FATAL_FAILURE(run_and_check({builtin("ring_allgather", 4)}, {4099}, one, &ring));
  EXPECT_GT(ring, 0u);
  one.registered = false;
  ASSERT_NO_FATAL_FAILURE(run_and_check({builtin("ring_allgather", 4)}, {4099}, one, &plain));
  EXPECT_EQ(plain, 0u);
  one.registered = true;
  one.protocol = kProtoLL;
  ASSERT_NO_FATAL_FAILURE(run_and_check({builtin("ring_allgather", 4)}, {4099}, one, &ll));
  EXPECT_EQ(ll, 0u);
}

// An out-of-place plan given one buffer as input and output (an in-place rooted call) may write a
// chunk it sent through the other name: the compiler's stable-source proof assumed two buffers, so
// such a call moves its data through the FIFOs even when registered.
TEST(DeviceExecutor, OverlappingBuffersOfAnOutOfPlacePlanAreNotReadInPlace) {
  const int n = 3;
  Prepared bc = builtin("chain_broadcast", n, {{"inplace", 0}, {"root", 0}});
  ASSERT_FALSE(bc->plan.inplace);
  auto comms = Communicator::create_local(n);
  std::vector<std::unique_ptr<DeviceExecutor>> ex;
  for (int r = 0; r < n; ++r)
    ex.push_back(std::make_unique<DeviceExecutor>(*comms[r], make_emulated_backend(), device_options(Options{})));
  const int64_t count = 5000;
  std::vector<std::vector<float>> buf(n, std::vector<float>(count));
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < count; ++i) buf[r][i] = r == 0 ? static_cast<float>(i % 1000) : -1.0f;
  test_support::on_ranks(comms, [&](int r, Communicator&) {
    ex[r]->register_memory(buf[r].data(), buf[r].size() * sizeof(float));
    ExecArgs a;
    a.input = buf[r].data();
    a.output = buf[r].data();
    a.count = count;
    ex[r]->run(*bc, a);
  });
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < count; ++i) ASSERT_EQ(buf[r][i], static_cast<float>(i % 1000)) << "rank " << r;
    EXPECT_EQ(ex[r]->direct_messages(), 0u) << "rank " << r;
  }
  // The same buffers, now two of them: the root's sends are read in place.
  std::vector<std::vector<float>> out(n, std::vector<float>(count, -1.0f));
  test_support::on_ranks(comms, [&](int r, Communicator&) {
    ex[r]->register_memory(out[r].data(), out[r].size() * sizeof(float));
    ExecArgs a;
    a.input = buf[r].data();
    a.output = out[r].data();
    a.count = count;
    ex[r]->run(*bc, a);
  });
  EXPECT_GT(ex[0]->direct_messages(), 0u);
  for (int r = 0; r < n; ++r) EXPECT_EQ(out[r], buf[0]) << "rank " << r;
  test_support::on_ranks(comms, [&](int r, Communicator&) { ex[r]->close(); });
}

TEST(DeviceExecutor, FifosOfTheVerifiedDepthStillFinish) {
  for (int64_t depth : {2, 3}) {
    Options o;
    o.fifo_depth = depth;
    o.slot_bytes = 256;  // 16 float32 per message: thousands of rounds
    o.ll_slot_bytes = 256;
    for (int32_t proto : {kProtoSimple, kProtoLL}) {
      o.protocol = proto;
      ASSERT_NO_FATAL_FAILURE(run_and_check({builtin("ring_allreduce", 4, {{"channels", 2}})}, {20011}, o));
      ASSERT_NO_FATAL_FAILURE(run_and_check({builtin("ring_allgather", 3)}, {5003}, o));
    }
  }
  // Plans that the verifier proves deadlock-free with one-slot FIFOs run with exactly one slot.
  for (auto [name, n] : {std::pair{"allpairs_allreduce", 4}, std::pair{"tree_allreduce", 5}}) {
    Prepared p = builtin(name, n);
    if (p->plan.fifo_depth != 1) continue;
    Options o;
    o.fifo_depth = 1;
    o.slot_bytes = o.ll_slot_bytes = 256;
    for (int32_t proto : {kProtoSimple, kProtoLL}) {
      o.protocol = proto;
      ASSERT_NO_FATAL_FAILURE(run_and_check({p}, {4099}, o));
    }
  }
}

TEST(DeviceExecutor, AlternatingPlansAndRepeatedCallsShareFifosAndEpochs) {
  Options o;
  std::vector<Prepared> seq = {builtin("ring_allreduce", 4, {{"channels", 2}}), builtin("rhd_allreduce", 4),
                               builtin("ring_allreduce", 4, {{"channels", 2}}), builtin("allpairs_allreduce", 4),
                               builtin("ring_allreduce", 4, {{"channels", 2}})};
  for (int32_t proto : {kProtoSimple, kProtoLL}) {
    o.protocol = proto;
    ASSERT_NO_FATAL_FAILURE(run_and_check(seq, {7, 3001, 1}, o));
  }
}

// Instances: copies of the plan with their own FIFOs take rounds in turn.
TEST(DeviceExecutor, InstancesShareTheRounds) {
  Options o;
  o.instances = 3;
  for (int32_t proto : {kProtoSimple, kProtoLL}) {
    o.protocol = proto;
    ASSERT_NO_FATAL_FAILURE(run_and_check({builtin("ring_allreduce", 4, {{"channels", 2}}), builtin("tree_allreduce", 4),
                                           builtin("rhd_allreduce", 4, {{"inplace", 1}})},
                                          {1, 1000, 100003}, o));
  }
}

TEST(DeviceExecutor, RefusesPlansThatNeedDeeperFifosThanConfigured) {
  Prepared p = builtin("ring_allreduce", 4);
  int64_t need = p->plan.fifo_depth;
  ASSERT_GE(need, 2);  // a ring's first send and its receive overlap
  auto comms = Communicator::create_local(4);
  DeviceOptions d;
  d.fifo_depth = need - 1;
  DeviceExecutor ex(*comms[0], make_emulated_backend(), d);
  std::vector<float> buf(64);
  ExecArgs a;
  a.input = a.output = buf.data();
  a.count = 16;
  try {
    ex.run(*p, a);
    FAIL() << "ran a plan that needs deeper FIFOs";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("TUTTI_DEVICE_FIFO_DEPTH"), std::string::npos) << e.what();
  }
}

// Two ranks' emulated-device executors (Simple, `timeout_s`) that connected and ran `plan` once
// together on 1024 floats each, ready for one of them to run alone.
struct TwoRanksRanOnce {
  std::vector<std::unique_ptr<DeviceExecutor>> ex;
  std::vector<std::vector<float>> buf = std::vector<std::vector<float>>(2, std::vector<float>(1024, 1.0f));
  TwoRanksRanOnce(std::vector<std::unique_ptr<Communicator>>& comms, const PreparedPlan& plan, double timeout_s) {
    DeviceOptions d;
    d.timeout_s = timeout_s;
    d.protocol = kProtoSimple;
    for (int r = 0; r < 2; ++r) ex.push_back(std::make_unique<DeviceExecutor>(*comms[r], make_emulated_backend(), d));
    test_support::on_ranks(comms, [&](int r, Communicator&) { ex[r]->run(plan, args(r)); });
  }
  ExecArgs args(int r) {
    ExecArgs a;
    a.input = a.output = buf[r].data();
    a.count = 1024;
    return a;
  }
};

// A rank whose peer never launches gives up after TUTTI_TIMEOUT with a message naming the block,
// the step and the peer it waited for; an aborted executor stops at once.
TEST(DeviceExecutor, WaitsTimeOutAndAbortNamingWhereTheyStopped) {
  Prepared p = builtin("ring_allreduce", 2);
  for (bool abort : {false, true}) {
    SCOPED_TRACE(abort ? "abort" : "timeout");
    auto comms = Communicator::create_local(2);
    // 0: no timeout, only the abort can end the wait. 2 s: long enough that the joint first run
    // never times out on a loaded machine, short enough for a test.
    TwoRanksRanOnce two(comms, *p, abort ? 0 : 2);
    auto& ex = two.ex;
    auto args = [&](int r) { return two.args(r); };
    std::thread aborter;
    if (abort)
      aborter = std::thread([&] { ex[0]->abort(); });  // before or during the run: either way it stops
    try {
      ex[0]->run(*p, args(0));
      ADD_FAILURE() << "a rank without its peer finished";
    } catch (const Error& e) {
      std::string m = e.what();
      EXPECT_EQ(e.kind(), abort ? ErrorKind::kAborted : ErrorKind::kTimeout) << m;
      EXPECT_NE(m.find("waiting for rank 1"), std::string::npos) << m;
      EXPECT_NE(m.find("ring_allreduce"), std::string::npos) << m;
    }
    if (aborter.joinable()) aborter.join();
    // The failure stays recorded: the next call reports it instead of running on broken FIFOs.
    EXPECT_THROW(ex[0]->run(*p, args(0)), Error);
    // The timeout failed the communicator (its peer is told): closing keeps the memory, as after an
    // abort, instead of waiting in a barrier no failed communicator can hold, whether the peer has
    // heard of the failure before it closes or while it waits there.
    if (!abort) {
      EXPECT_TRUE(comms[0]->state().failed());
      test_support::on_ranks(comms, [&](int r, Communicator&) { EXPECT_NO_THROW(ex[r]->close()); });
    }
  }
}

// Ranks whose calls differ (count, type, op) fail at their first message, on every rank that
// receives one, naming both calls: in Simple (the stamp in the descriptor) and in LL (the stamp in
// the slot's header line). Counts of ratio two with small slots are the case that returned wrong
// data before: both calls send full slots, so sizes alone cannot tell them apart.
TEST(DeviceExecutor, CallsThatDifferFailOnEveryRankThatReceivesNamingBothCalls) {
  Prepared p = builtin("ring_allreduce", 2);
  struct Case {
    const char* what;
    int64_t count1;
    DataType type1;
    RedOp op1;
    const char* names;  // what rank 0's message names of rank 1's call
  };
  const Case cases[] = {
      {"count", 2048, DataType::kFloat32, RedOp::kSum, "all_reduce of 2048 float (sum)"},
      {"type", 4096, DataType::kInt32, RedOp::kSum, "all_reduce of 4096 int32 (sum)"},
      {"op", 4096, DataType::kFloat32, RedOp::kMax, "(max)"},
  };
  for (int32_t protocol : {kProtoSimple, kProtoLL})
    for (const Case& c : cases) {
      SCOPED_TRACE(fmt::format("{} {}", protocol == kProtoLL ? "LL" : "Simple", c.what));
      auto comms = Communicator::create_local(2);
      DeviceOptions d;
      d.slot_bytes = 4096;
      d.ll_slot_bytes = 2048;
      d.protocol = protocol;
      d.timeout_s = 120;  // a missed mismatch fails the test by its kind, not by hanging it
      std::vector<std::unique_ptr<DeviceExecutor>> ex;
      for (int r = 0; r < 2; ++r) ex.push_back(std::make_unique<DeviceExecutor>(*comms[r], make_emulated_backend(), d));
      std::vector<std::vector<float>> buf(2, std::vector<float>(4096, 1.0f));
      std::vector<std::string> errors(2);
      test_support::on_ranks(comms, [&](int r, Communicator&) {
        ExecArgs a;
        a.input = a.output = buf[r].data();
        a.count = r == 0 ? 4096 : c.count1;
        a.reduction.type = r == 0 ? DataType::kFloat32 : c.type1;
        a.reduction.op = r == 0 ? RedOp::kSum : c.op1;
        try {
          ex[r]->run(*p, a);
        } catch (const Error& e) {
          errors[r] = fmt::format("{}: {}", static_cast<int>(e.kind()), e.what());
          EXPECT_EQ(e.kind(), ErrorKind::kInvalidUsage) << e.what();
        }
      });
      for (int r = 0; r < 2; ++r) {
        EXPECT_NE(errors[r].find("sent a message of"), std::string::npos) << "rank " << r << ": " << errors[r];
        EXPECT_NE(errors[r].find(fmt::format("rank {} sent", 1 - r)), std::string::npos) << errors[r];
      }
      EXPECT_NE(errors[0].find(c.names), std::string::npos) << errors[0];
      EXPECT_NE(errors[1].find("this rank runs all_reduce of"), std::string::npos) << errors[1];
    }
}

// A kernel that waits for a peer stops when the communicator fails (here: the peer reports a
// failure of its own), with the communicator's error, although its wait has no timeout: the
// failure sets the executor's stop word (CommState::add_stop_word), as it wakes host waits.
TEST(DeviceExecutor, AFailedCommunicatorStopsAWaitingKernel) {
  Prepared p = builtin("ring_allreduce", 2);
  auto comms = Communicator::create_local(2);
  TwoRanksRanOnce two(comms, *p, 0);  // wait forever: only the failure can end it
  auto& ex = two.ex;
  auto args = [&](int r) { return two.args(r); };
  std::thread alone([&] {
    try {
      ex[0]->run(*p, args(0));
      ADD_FAILURE() << "a rank without its peer finished";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1 gave up"), std::string::npos) << e.what();
    }
  });
  comms[1]->state().fail(ErrorKind::kRemote, "rank 1 gave up");  // told to rank 0 through the bootstrap
  alone.join();
}

}  // namespace

// Host staging is decided with every rank: one rank asking for it (TUTTI_DEVICE_STAGING on that
// rank only, or a peer on another host) puts every rank on it, because a plan cannot run with some
// ranks on device FIFOs and others on host connections. The staged path then gives the reference
// result, in place too (an in-place reduce-scatter's rank 0 passes one pointer for both buffers).
TEST(DeviceExecutor, HostStagingIsChosenByEveryRankAndGivesTheReferenceResult) {
  const int n = 3;
  auto comms = Communicator::create_local(n);
  std::vector<std::unique_ptr<DeviceExecutor>> dev(n);
  std::vector<std::unique_ptr<CpuExecutor>> cpu(n);
  std::vector<std::unique_ptr<HostStagingExecutor>> staged(n);
  test_support::on_ranks(comms, [&](int r, Communicator& c) {
    DeviceOptions d;
    d.host_staging = r == 1;
    dev[r] = std::make_unique<DeviceExecutor>(c, make_emulated_backend(), d);
    dev[r]->connect();
    cpu[r] = std::make_unique<CpuExecutor>(c, CpuExecutorOptions{});
    staged[r] = std::make_unique<HostStagingExecutor>(c, *dev[r], *cpu[r]);
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(dev[r]->needs_host_staging()) << "rank " << r;
    EXPECT_STREQ(dev[r]->transport_to((r + 1) % n), "host-staged");
  }
  Prepared rs = builtin("ring_reducescatter", n, {{"inplace", 1}});
  const int64_t count = 1001;
  std::vector<std::vector<float>> buf(n, std::vector<float>(static_cast<size_t>(n * count)));
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < buf[r].size(); ++i) buf[r][i] = static_cast<float>((r + 1) * 1000 + i % 97);
  test_support::on_ranks(comms, [&](int r, Communicator&) {
    ExecArgs a;
    a.input = buf[r].data();
    a.output = buf[r].data() + r * count;
    a.count = count;
    staged[r]->run(*rs, a);
    // The device executor itself refuses: its FIFOs were never connected.
    EXPECT_THROW(dev[r]->run(*rs, a), InvalidUsage);
  });
  for (int r = 0; r < n; ++r)
    for (int64_t e = 0; e < count; ++e) {
      float want = 0;
      for (int q = 0; q < n; ++q) want += static_cast<float>((q + 1) * 1000 + (r * count + e) % 97);
      ASSERT_EQ(buf[r][static_cast<size_t>(r * count + e)], want) << "rank " << r << " element " << e;
    }
  test_support::on_ranks(comms, [&](int r, Communicator&) { dev[r]->close(); });
}

// A call the staging proxy cannot finish (here: the communicator was aborted) does not
// hold the stream: the call's wait ends, and the failure is reported by check() and the next call.
TEST(DeviceExecutor, HostStagingReportsAFailedCallWithoutHoldingTheStream) {
  const int n = 2;
  auto comms = Communicator::create_local(n);
  std::vector<std::unique_ptr<DeviceExecutor>> dev(n);
  std::vector<std::unique_ptr<CpuExecutor>> cpu(n);
  std::vector<std::unique_ptr<HostStagingExecutor>> staged(n);
  test_support::on_ranks(comms, [&](int r, Communicator& c) {
    DeviceOptions d;
    d.host_staging = true;
    dev[r] = std::make_unique<DeviceExecutor>(c, make_emulated_backend(), d);
    dev[r]->connect();
    cpu[r] = std::make_unique<CpuExecutor>(c, CpuExecutorOptions{});
    staged[r] = std::make_unique<HostStagingExecutor>(c, *dev[r], *cpu[r]);
  });
  Prepared ar = builtin("ring_allreduce", n);
  std::vector<float> in(64, 1.0f), out(64, 0.0f);
  ExecArgs a;
  a.input = in.data();
  a.output = out.data();
  a.count = 64;
  comms[0]->state().abort();
  staged[0]->run(*ar, a);  // rank 1 never joins: only the abort ends the proxy's call
  EXPECT_THROW(staged[0]->check(), Aborted);
  EXPECT_THROW(staged[0]->run(*ar, a), Aborted);
  staged[0]->drain();
}

// NCCL's variables where they mean something here: NCCL_NTHREADS is the interpreter's block size,
// NCCL_BUFFSIZE the FIFO of a connection (cut into TUTTI_DEVICE_FIFO_DEPTH slots, as NCCL cuts it
// into steps), NCCL_MIN/MAX_NCHANNELS bound the automatic instance count; tutti's own names win.
TEST(DeviceOptions, NcclVariablesMapOntoTheDeviceSettings) {
  test_support::ScopedEnv env(
      {{"NCCL_NTHREADS", "256"}, {"NCCL_BUFFSIZE", "1M"}, {"NCCL_MIN_NCHANNELS", "2"}, {"NCCL_MAX_NCHANNELS", "4"}});
  DeviceOptions o = DeviceOptions::from_env();
  EXPECT_EQ(o.threads, 256);
  EXPECT_EQ(o.slot_bytes, (1 << 20) / o.fifo_depth);
  EXPECT_EQ(o.min_instances, 2);
  EXPECT_EQ(o.max_instances, 4);
  env.set("TUTTI_DEVICE_SLOT_SIZE", "64K");
  EXPECT_EQ(DeviceOptions::from_env().slot_bytes, 64 << 10);
  env.set("NCCL_MIN_NCHANNELS", "8");
  EXPECT_THROW(DeviceOptions::from_env(), InvalidArgument);  // min above max names both
}

// The interpreter is compiled for blocks of at most kMaxBlockThreads (its __launch_bounds__): a
// larger block is refused when the options are read, naming the limit, instead of failing to
// launch on the GPU.
TEST(DeviceOptions, BlocksLargerThanTheInterpreterIsBuiltForAreRefused) {
  const std::string most = std::to_string(kMaxBlockThreads), more = std::to_string(kMaxBlockThreads + 32);
  test_support::ScopedEnv env({{"TUTTI_DEVICE_THREADS", most.c_str()}});
  EXPECT_EQ(DeviceOptions::from_env().threads, kMaxBlockThreads);
  env.set("TUTTI_DEVICE_THREADS", more.c_str());
  try {
    (void)DeviceOptions::from_env();
    ADD_FAILURE() << "took blocks of " << kMaxBlockThreads + 32 << " threads";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("between 32 and {}", kMaxBlockThreads)), std::string::npos)
        << e.what();
  }
}
