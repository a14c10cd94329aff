// The DSL: dataflow references, split/group, and the errors a program can make.
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "tutti/dsl.hpp"

using namespace tutti;
using namespace tutti::dsl;

namespace {

CollectiveSpec allreduce(int n, int chunks) {
  CollectiveSpec s;
  s.kind = Collective::kAllReduce;
  s.nranks = n;
  s.chunk_factor = chunks;
  return s;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Dsl, OperationsReturnTheNewReference) {
  Program p("t", allreduce(3, 1));
  auto c = p.chunk(0, Buffer::input(), 0);
  auto d = c.copy(1, Buffer::scratch("tmp"), 2);
  EXPECT_EQ(d.rank(), 1);
  EXPECT_EQ(d.index(), 2);
  EXPECT_EQ(d.buffer(), Buffer::scratch("tmp"));
  auto e = p.chunk(1, Buffer::input(), 0).reduce(d);
  EXPECT_EQ(e.rank(), 1);
  EXPECT_EQ(p.content(1, Buffer::input(), 0).describe(), "{r0:i0, r1:i0}");
  EXPECT_EQ(p.scratch_chunks(1, "tmp"), 3);
  EXPECT_EQ(p.ops().size(), 2u);
}

TEST(Dsl, SplitAndGroupWorkOnRanges) {
  Program p("t", allreduce(2, 4));
  auto all = p.chunk(0, Buffer::input(), 0, 4);
  auto halves = all.split(2);
  ASSERT_EQ(halves.size(), 2u);
  EXPECT_EQ(halves[1].index(), 2);
  EXPECT_EQ(halves[1].count(), 2);
  auto whole = p.group({all[0], all[1], all[2]});
  EXPECT_EQ(whole.count(), 3);
  EXPECT_NE(error_of([&] { all.split(3); }).find("cannot be split into 3"), std::string::npos);
  EXPECT_NE(error_of([&] { p.group({all[0], all[2]}); }).find("does not follow"), std::string::npos);
}

TEST(Dsl, ReadingAnEmptyChunkNamesOpRankAndChunk) {
  Program p("t", allreduce(2, 2));
  std::string e = error_of([&] { p.chunk(0, Buffer::scratch("s"), 1).copy(1, Buffer::output(), 0); });
  EXPECT_NE(e.find("op #0 (copy rank 0 scratch 's'[1]"), std::string::npos) << e;
  EXPECT_NE(e.find("which is empty"), std::string::npos) << e;
}

TEST(Dsl, IndexOutOfRange) {
  Program p("t", allreduce(2, 2));
  std::string e = error_of([&] { p.chunk(1, Buffer::input(), 1, 2); });
  EXPECT_NE(e.find("rank 1 input[1..3) is out of range: the input has 2 chunks"), std::string::npos) << e;
  e = error_of([&] { p.chunk(0, Buffer::input(), 0).copy(1, Buffer::output(), 5); });
  EXPECT_NE(e.find("output[5..6) is out of range"), std::string::npos) << e;
}

TEST(Dsl, ReduceOfDifferentCounts) {
  Program p("t", allreduce(2, 2));
  std::string e = error_of([&] { p.chunk(0, Buffer::input(), 0, 2).reduce(p.chunk(1, Buffer::input(), 0, 1)); });
  EXPECT_NE(e.find("reduce of chunks with different counts (destination 2, source 1)"), std::string::npos) << e;
}

TEST(Dsl, CopyToARankThatDoesNotExist) {
  Program p("t", allreduce(4, 1));
  std::string e = error_of([&] { p.chunk(0, Buffer::input(), 0).copy(4, Buffer::output(), 0); });
  EXPECT_NE(e.find("destination rank 4 does not exist (4 ranks)"), std::string::npos) << e;
  e = error_of([&] { p.chunk(-1, Buffer::input(), 0); });
  EXPECT_NE(e.find("rank -1, which does not exist"), std::string::npos) << e;
}

TEST(Dsl, PostconditionNamesTheWrongChunk) {
  Program p("t", allreduce(2, 1));
  p.chunk(0, Buffer::input(), 0).copy(0, Buffer::output(), 0);
  std::string e = error_of([&] { p.check_postcondition(); });
  EXPECT_NE(e.find("postcondition fails at rank 0 output[0]: holds {r0:i0}, should hold {r0:i0, r1:i0}"), std::string::npos)
      << e;
}

TEST(Dsl, ComputeKernelsAreTracked) {
  CollectiveSpec s;
  s.kind = Collective::kCustom;
  s.nranks = 1;
  s.custom_input_chunks = 1;
  s.custom_output_chunks = 1;
  s.custom_post = [](int, int) {
    return std::optional<Content>(Content::apply(kernels::kScale, {Content::of(0, 0)}, {0.5}));
  };
  Program p("scaled copy", s);
  p.chunk(0, Buffer::input(), 0).copy(0, Buffer::output(), 0).then(kernels::kScale, {0.5});
  EXPECT_NO_THROW(p.check_postcondition());
}

TEST(Dsl, InPlaceAliasesFollowTheCollective) {
  CollectiveSpec s;
  s.kind = Collective::kAllGather;
  s.nranks = 4;
  s.inplace = true;
  Program p("t", s);
  // Rank 2's input is output[2] of rank 2.
  EXPECT_EQ(p.content(2, Buffer::output(), 2).describe(), "{r2:i0}");
  EXPECT_TRUE(p.content(2, Buffer::output(), 1).empty());
}

}  // namespace
