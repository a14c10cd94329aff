// Lowering, passes, built-ins, verification failures (mutation tests) and random programs
// (property tests against a naive reference interpreter).
#include <gtest/gtest.h>

#include <limits>
#include <map>
#include <random>

#include "collectives/algorithms/registry.hpp"
#include "compiler/compile.hpp"
#include "core/error.hpp"

#include <fmt/format.h>

using namespace tutti;
using namespace tutti::plan;
using dsl::Buffer;

namespace {

std::string verify_error(const Plan& p) {
  try {
    verify(p);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(verified)";
}

int64_t count_ops(const Plan& p, Opcode op) {
  int64_t n = 0;
  for (auto& r : p.ranks)
    for (auto& b : r.blocks)
      for (auto& s : b.steps) n += s.op == op;
  return n;
}

TEST(Builtins, EveryBuiltinVerifiesForOneToSixteenRanks) {
  for (const auto& b : algorithms::builtins()) {
    int verified = 0;
    for (int n = 1; n <= 16; ++n) {
      std::vector<algorithms::Params> variants = {{}};
      for (auto& prm : b.params) {
        if (prm.name == "inplace") variants.push_back({{"inplace", 1 - prm.fallback}});
        if (prm.name == "channels") variants.push_back({{"channels", 2}});
        if (prm.name == "local") variants.push_back({{"local", n % 4 == 0 ? 4 : n % 2 == 0 ? 2 : 1}});
        if (prm.name == "root" && n > 1) variants.push_back({{"root", n - 1}});
      }
      for (auto& v : variants) {
        const auto& params = algorithms::resolve(b, n, v);
        dsl::Program program = b.build(n, params);
        Compiled c = compile(program);
        EXPECT_EQ(c.plan.nranks, n);
        ++verified;
      }
    }
    EXPECT_GE(verified, 16) << b.name;
  }
  EXPECT_EQ(algorithms::builtins().size(), 16u);
}

TEST(Builtins, UnknownNamesAndParametersAreRejected) {
  EXPECT_THROW(algorithms::build("warp_allreduce", 4), InvalidArgument);
  EXPECT_THROW(algorithms::build("ring_allreduce", 4, {{"rings", 2}}), InvalidArgument);
  try {
    algorithms::build("hier_allreduce", 6, {{"local", 4}});
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("local=4 must divide the rank count 6"), std::string::npos) << e.what();
  }
}

TEST(Passes, RingAllReduceFusesLikeMscclRing) {
  Compiled c = compile(algorithms::build("ring_allreduce", 8));
  EXPECT_EQ(c.steps_before_fusion, 224);
  EXPECT_EQ(c.blocks_before_fusion, 16);
  EXPECT_EQ(c.plan.steps(), 120);
  EXPECT_EQ(c.plan.blocks(), 8);
  // Per rank: 1 send, 6 recv_reduce_send, 1 recv_reduce_copy_send, 6 recv_copy_send, 1 recv.
  EXPECT_EQ(count_ops(c.plan, Opcode::kSend), 8);
  EXPECT_EQ(count_ops(c.plan, Opcode::kRecvReduceSend), 48);
  EXPECT_EQ(count_ops(c.plan, Opcode::kRecvReduceCopySend), 8);
  EXPECT_EQ(count_ops(c.plan, Opcode::kRecvCopySend), 48);
  EXPECT_EQ(count_ops(c.plan, Opcode::kRecv), 8);
  CompileOptions raw;
  raw.fuse = false;
  EXPECT_EQ(compile(algorithms::build("ring_allreduce", 8), raw).plan.steps(), 224);
}

// Out-of-place plans begin with one copy per chunk (input -> output). Halving-doubling sends and
// reduces half the buffer at once, a use spanning several of those copies: it must read the input
// instead, so no rank copies its input before the first exchange can start.
TEST(Passes, InputCopiesForwardIntoUsesSpanningSeveralChunks) {
  for (int n : {4, 8}) {
    SCOPED_TRACE(fmt::format("{} ranks", n));
    Plan p = compile(algorithms::build("rhd_allreduce", n, {{"inplace", 0}})).plan;
    EXPECT_EQ(count_ops(p, Opcode::kCopy), 0);
    for (int r = 0; r < n; ++r) {
      int64_t from_input = 0;
      for (auto& b : p.ranks[r].blocks)
        for (auto& s : b.steps)
          for (auto& src : s.srcs) from_input += src.buffer == BufferKind::kInput ? src.count : 0;
      // The first halving step sends one half of the input and reduces the other half into place.
      EXPECT_EQ(from_input, p.chunk_factor) << "rank " << r;
    }
    EXPECT_EQ(verify_error(p), "(verified)");
  }
  // Without fusion the copies stay.
  CompileOptions no_fusion;
  no_fusion.fuse = false;
  Plan unfused = compile(algorithms::build("rhd_allreduce", 4, {{"inplace", 0}}), no_fusion).plan;
  EXPECT_EQ(count_ops(unfused, Opcode::kCopy), 4 * 4);
}

TEST(Passes, FusionAcrossBufferIndicesWhenTheContentsSayItIsLegal) {
  CollectiveSpec s;
  s.kind = Collective::kBroadcast;
  s.nranks = 3;
  dsl::Program p("relay via scratch", s);
  p.chunk(0, Buffer::input(), 0).copy(0, Buffer::output(), 0);
  auto staged = p.chunk(0, Buffer::input(), 0).copy(1, Buffer::scratch("staging"), 0);  // recv into scratch
  staged.copy(1, Buffer::output(), 0);                                                   // local copy
  p.chunk(1, Buffer::output(), 0).copy(2, Buffer::output(), 0);                          // send of the copy
  Compiled c = compile(p);
  bool found = false;
  for (auto& b : c.plan.ranks[1].blocks)
    for (auto& st : b.steps)
      if (st.op == Opcode::kRecvCopySend && st.dst->buffer == BufferKind::kScratch && st.send_peer == 2) found = true;
  EXPECT_TRUE(found) << to_json(c.plan);
  EXPECT_EQ(count_ops(c.plan, Opcode::kSend), 1);  // only rank 0's
}

TEST(Passes, MinimiseDependenciesDropsImpliedOnes) {
  Plan p;
  p.name = "deps";
  p.collective = Collective::kAllReduce;
  p.nranks = 1;
  p.ranks.resize(1);
  RankPlan& r = p.ranks[0];
  r.input_chunks = 1;
  r.output_chunks = 1;
  r.scratch_chunks = 2;
  Instruction a, b, c;
  a.op = b.op = c.op = Opcode::kCopy;
  a.srcs = {Ref{BufferKind::kInput, 0, 1}};
  a.dst = Ref{BufferKind::kScratch, 0, 1};
  b.srcs = {Ref{BufferKind::kScratch, 0, 1}};
  b.dst = Ref{BufferKind::kScratch, 1, 1};
  b.deps = {{0, 0}};
  c.srcs = {Ref{BufferKind::kScratch, 1, 1}};
  c.dst = Ref{BufferKind::kOutput, 0, 1};
  c.deps = {{0, 0}, {1, 0}};  // the first is implied by the second
  r.blocks = {Block{0, 0, {a}}, Block{1, 0, {b}}, Block{2, 0, {c}}};
  EXPECT_EQ(minimise_dependencies(p), 1);
  EXPECT_EQ(p.ranks[0].blocks[2].steps[0].deps, (std::vector<Dep>{{1, 0}}));
}

TEST(Passes, InstancesReplicateAndStillVerify) {
  for (auto policy : {InstancePolicy::kInterleaved, InstancePolicy::kBatched}) {
    CompileOptions o;
    o.instances = 3;
    o.policy = policy;
    Compiled c = compile(algorithms::build("ring_allreduce", 4), o);
    EXPECT_EQ(c.plan.chunk_factor, 12);
    EXPECT_EQ(c.plan.channels(), 3);
    EXPECT_EQ(c.plan.steps(), 3 * compile(algorithms::build("ring_allreduce", 4)).plan.steps());
  }
  CompileOptions o;
  o.instances = 2;
  EXPECT_NO_THROW(compile(algorithms::build("ring_allgather", 5), o));
}

TEST(Passes, ProtocolAndPriorityAnnotationsShapeThePlan) {
  CollectiveSpec s;
  s.kind = Collective::kAllGather;
  s.nranks = 2;
  s.inplace = true;
  dsl::Program p("annotated", s);
  dsl::Annotations low, high;
  low.channel = 0;
  high.channel = 1;
  high.priority = 5;
  high.protocol = low.protocol = Protocol::kLL;
  p.chunk(0, Buffer::output(), 0).copy(1, Buffer::output(), 0, low);
  p.chunk(1, Buffer::output(), 1).copy(0, Buffer::output(), 1, high);
  Compiled c = compile(p);
  EXPECT_EQ(c.plan.protocol, Protocol::kLL);
  EXPECT_EQ(c.plan.ranks[0].blocks[0].channel, 1);  // the priority-5 block comes first
  dsl::Program q("conflict", s);
  dsl::Annotations ll, simple;
  ll.protocol = Protocol::kLL;
  simple.protocol = Protocol::kSimple;
  q.chunk(0, Buffer::output(), 0).copy(1, Buffer::output(), 0, ll);
  q.chunk(1, Buffer::output(), 1).copy(0, Buffer::output(), 1, simple);
  EXPECT_THROW(compile(q), InvalidArgument);
}

// --- mutation tests: a verified plan, changed in one place, must fail with the right message ---

Plan ring4() { return compile(algorithms::build("ring_allreduce", 4)).plan; }

TEST(Mutations, ChangedOffsetBreaksThePostcondition) {
  Plan p = ring4();
  // Rank 1's plain recv (the last step of the all-gather) writes a different chunk.
  for (auto& b : p.ranks[1].blocks)
    for (auto& s : b.steps)
      if (s.op == Opcode::kRecv) s.dst->index = (s.dst->index + 1) % 4;
  std::string e = verify_error(p);
  EXPECT_TRUE(e.find("verification failed: postcondition: rank 1 output[") != std::string::npos ||
              e.find("verification failed: hazard: rank 1") != std::string::npos)
      << e;
}

TEST(Mutations, DroppedStepBreaksMatching) {
  Plan p = ring4();
  int peer = -1;
  for (auto& b : p.ranks[2].blocks)
    for (size_t i = 0; i < b.steps.size() && peer < 0; ++i)
      if (b.steps[i].op == Opcode::kSend) {
        peer = b.steps[i].send_peer;
        b.steps.erase(b.steps.begin() + static_cast<long>(i));
      }
  ASSERT_GE(peer, 0);
  std::string e = verify_error(p);
  EXPECT_NE(e.find(fmt::format("verification failed: matching: rank 2 sends 5 message(s) to rank {} on channel 0, rank {} "
                               "receives 6",
                               peer, peer)),
            std::string::npos)
      << e;
}

TEST(Mutations, SwappedSendsAreCaught) {
  Plan q = compile(algorithms::build("chain_broadcast", 3, {{"chunks", 2}})).plan;
  Block* sender = nullptr;
  for (auto& b : q.ranks[0].blocks)
    if (!b.steps.empty() && b.steps[0].op == Opcode::kSend) sender = &b;
  ASSERT_NE(sender, nullptr);
  ASSERT_EQ(sender->steps.size(), 2u);
  std::swap(sender->steps[0], sender->steps[1]);  // chunk 1 now travels first and lands in chunk 0's place
  std::string e = verify_error(q);
  EXPECT_NE(e.find("verification failed: postcondition: rank 1 output[0] ends up holding {r0:i1}"), std::string::npos) << e;
}

TEST(Mutations, CrossedDependenciesDeadlockWithTheCycleNamed) {
  Plan p = ring4();
  // Make rank 0's only block wait on its own last step from its first step: a dependency cycle.
  auto& blk = p.ranks[0].blocks[0];
  Instruction nop;
  nop.op = Opcode::kNop;
  Block waiter{99, 0, {nop}};
  waiter.steps[0].deps = {{blk.id, static_cast<int64_t>(blk.steps.size() - 1)}};
  blk.steps[0].deps.push_back({99, 0});
  p.ranks[0].blocks.push_back(waiter);
  std::string e = verify_error(p);
  EXPECT_NE(e.find("verification failed: deadlock"), std::string::npos) << e;
  EXPECT_NE(e.find("rank 0 block 0 step 0 (send to rank 1) waits for its dependency on step 0 of block 99"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("rank 0 block 99 step 0 (nop) waits for its dependency"), std::string::npos) << e;
}

TEST(Mutations, RacesAreReportedAsHazards) {
  Plan p = compile(algorithms::build("chain_broadcast", 3, {{"chunks", 1}})).plan;
  // A local copy over the chunk rank 1 forwards, in a block of its own without dependencies.
  Instruction clobber;
  clobber.op = Opcode::kCopy;
  clobber.srcs = {Ref{BufferKind::kOutput, 0, 1}};
  clobber.dst = Ref{BufferKind::kOutput, 0, 1};
  p.ranks[1].blocks.push_back(Block{42, 0, {clobber}});
  std::string e = verify_error(p);
  EXPECT_NE(e.find("verification failed: "), std::string::npos) << e;
  EXPECT_TRUE(e.find("hazard: rank 1 output[0]") != std::string::npos || e.find("data: rank 1 block 42") != std::string::npos)
      << e;
}

// certify marks the sends a peer may read in place: those whose source no later write of their
// rank touches.
TEST(Certify, SendsAreStableUnlessTheirRankWritesTheSourceAfterwards) {
  Plan p = compile(algorithms::build("ring_allgather", 3, {{"inplace", 1}})).plan;
  auto stable_sends = [&] {
    int stable = 0, sends = 0;
    for (auto& r : p.ranks)
      for (auto& b : r.blocks)
        for (auto& in : b.steps)
          if (in.op == Opcode::kSend) ++sends, stable += in.stable_source;
    return std::pair{stable, sends};
  };
  auto [stable, sends] = stable_sends();
  ASSERT_GT(sends, 0);
  EXPECT_EQ(stable, sends);
  // Rank 0 rewrites the chunk of its first send (with the same contents) at the end of the block.
  Block* block = nullptr;
  Instruction* send = nullptr;
  for (auto& b : p.ranks[0].blocks)
    for (auto& in : b.steps)
      if (!send && in.op == Opcode::kSend) block = &b, send = &in;
  ASSERT_NE(send, nullptr);
  Instruction rewrite;
  rewrite.op = Opcode::kCopy;
  rewrite.srcs = {send->srcs[0]};
  rewrite.dst = send->srcs[0];
  const size_t at = static_cast<size_t>(send - block->steps.data());
  block->steps.push_back(rewrite);
  certify(p);
  EXPECT_FALSE(block->steps[at].stable_source);
  EXPECT_EQ(stable_sends(), std::pair(sends - 1, sends));
  // The JSON form carries the marks.
  EXPECT_EQ(parse_json(to_json(p)), p);
}

TEST(Mutations, SmallFifosDeadlockWhereLargerOnesDoNot) {
  // Everyone first sends to everyone, then receives: needs FIFOs as deep as the messages in flight.
  Plan p;
  p.name = "eager";
  p.collective = Collective::kAllGather;
  p.nranks = 2;
  p.chunk_factor = 2;
  for (int r = 0; r < 2; ++r) {
    RankPlan rp;
    rp.input_chunks = 2;
    rp.output_chunks = 4;
    Block b{0, 0, {}};
    for (int k = 0; k < 2; ++k) {
      Instruction c;
      c.op = Opcode::kCopy;
      c.srcs = {Ref{BufferKind::kInput, k, 1}};
      c.dst = Ref{BufferKind::kOutput, r * 2 + k, 1};
      b.steps.push_back(c);
    }
    for (int k = 0; k < 2; ++k) {
      Instruction s;
      s.op = Opcode::kSend;
      s.srcs = {Ref{BufferKind::kInput, k, 1}};
      s.send_peer = 1 - r;
      b.steps.push_back(s);
    }
    for (int k = 0; k < 2; ++k) {
      Instruction v;
      v.op = Opcode::kRecv;
      v.dst = Ref{BufferKind::kOutput, (1 - r) * 2 + k, 1};
      v.recv_peer = 1 - r;
      b.steps.push_back(v);
    }
    rp.blocks.push_back(b);
    p.ranks.push_back(rp);
  }
  VerifyReport rep = verify(p);
  EXPECT_EQ(rep.fifo_depth_needed, 2);
  VerifyOptions one;
  one.fifo_depth = 1;
  try {
    verify(p, one);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("deadlock: with FIFOs of 1 message(s)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("waits for room in the full FIFO to rank"), std::string::npos) << e.what();
  }
}

// --- property tests ---------------------------------------------------------------------------

// The naive reference: apply the operations in order to a map of contents.
struct Reference {
  std::map<std::tuple<int, int, std::string, int>, Content> cells;  // (rank, kind, scratch name, index)
  static std::tuple<int, int, std::string, int> key(const dsl::ChunkLoc& l, int k) {
    return {l.rank, static_cast<int>(l.buffer.kind), l.buffer.name, l.index + k};
  }
};

TEST(Properties, RandomProgramsFailWithAMessageOrMatchTheReference) {
  std::mt19937 rng(2024);
  int verified = 0, rejected = 0;
  for (int trial = 0; trial < 600; ++trial) {
    const int n = 2 + static_cast<int>(rng() % 3), chunks = 4;
    Reference ref;
    for (int r = 0; r < n; ++r)
      for (int i = 0; i < chunks; ++i) ref.cells[{r, 0, "", i}] = Content::of(r, i);
    auto ops = std::make_shared<std::vector<dsl::Op>>();
    CollectiveSpec s;
    s.kind = Collective::kCustom;
    s.nranks = n;
    s.custom_input_chunks = chunks;
    s.custom_output_chunks = chunks;
    // The postcondition is whatever the reference computes for the output.
    auto expected = std::make_shared<std::map<std::pair<int, int>, Content>>();
    s.custom_post = [expected](int rank, int index) -> std::optional<Content> {
      auto it = expected->find({rank, index});
      if (it == expected->end() || it->second.empty()) return std::nullopt;
      return it->second;
    };
    dsl::Program p("random", s);
    std::string error;
    auto pick_buffer = [&] {
      switch (rng() % 5) {
        case 3:
        case 4:
        case 0: return Buffer::input();
        case 1: return Buffer::output();
        default: return Buffer::scratch("s");
      }
    };
    int nops = 1 + static_cast<int>(rng() % 8);
    try {
      for (int k = 0; k < nops; ++k) {
        int count = 1 + static_cast<int>(rng() % 2);
        dsl::ChunkLoc src{static_cast<int>(rng() % n), pick_buffer(), static_cast<int>(rng() % (chunks - 1)), count};
        dsl::ChunkLoc dst{static_cast<int>(rng() % n), pick_buffer(), static_cast<int>(rng() % (chunks - 1)), count};
        if (dst.buffer.kind == BufferKind::kInput) dst.buffer = Buffer::output();
        bool reduce = rng() % 2;
        auto sref = p.chunk(src.rank, src.buffer, src.index, count);
        if (reduce) p.chunk(dst.rank, dst.buffer, dst.index, count).reduce(sref);
        else sref.copy(dst.rank, dst.buffer, dst.index);
        // Reference semantics, applied only if the DSL accepted the op.
        std::vector<Content> in;
        for (int c = 0; c < count; ++c) in.push_back(ref.cells[Reference::key(src, c)]);
        for (int c = 0; c < count; ++c) {
          auto& cell = ref.cells[Reference::key(dst, c)];
          if (reduce) cell.merge(in[c]);
          else cell = in[c];
        }
      }
    } catch (const InvalidArgument& e) {
      error = e.what();
    }
    if (!error.empty()) {
      EXPECT_NE(error.find("program 'random'"), std::string::npos) << error;
      ++rejected;
      continue;
    }
    for (int r = 0; r < n; ++r)
      for (int i = 0; i < chunks; ++i) (*expected)[{r, i}] = ref.cells[{r, 1, "", i}];
    // The plan's symbolic execution must reproduce the reference (verify checks the postcondition).
    // compile() verifies the plan against the reference postcondition; dead copies may vanish.
    Compiled c = compile(p);
    EXPECT_LE(c.plan.steps(), c.steps_before_fusion);
    ++verified;
  }
  EXPECT_GT(verified, 30);
  EXPECT_GT(rejected, 30);
}

}  // namespace

// A rooted plan whose root is not a rank is refused as a structure error (before, a reduce with root
// -1, 5 of 5 ranks or INT_MAX was reported "postcondition holds").
TEST(Mutations, RootsOutsideTheRanksAreRefused) {
  for (const char* name : {"tree_reduce", "tree_broadcast"}) {
    Plan p = compile(algorithms::build(name, 5)).plan;
    for (int root : {-1, 5, std::numeric_limits<int>::max()}) {
      Plan bad = p;
      bad.root = root;
      try {
        verify(bad);
        ADD_FAILURE() << name << " with root " << root << " was verified";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(fmt::format("root {} is not a rank (0..4)", root)), std::string::npos)
            << e.what();
      }
    }
    EXPECT_NO_THROW(verify(p));
  }
}
