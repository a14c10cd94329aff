// Compute kernels by name (tutti/kernel.hpp): the registry, a user kernel through the DSL, the
// compiler's proof, the plan's JSON and the CPU executor; the device interpreter's refusal of
// kernels it has no implementation of.
#include <gtest/gtest.h>

#include <cmath>
#include <thread>

#include "compiler/compile.hpp"
#include "core/error.hpp"
#include "runtime/device/device_plan.hpp"
#include "runtime/executor.hpp"
#include "tutti/dsl.hpp"
#include "tutti/kernel.hpp"

using namespace tutti;
using dsl::Buffer;
using dsl::Program;

namespace {

// output = input * input + offset, for float32 (the test's only type).
void square_plus(const KernelArgs& a) {
  if (a.type != DataType::kFloat32) throw InvalidArgument("test.square_plus: float32 only");
  const auto* in = static_cast<const float*>(a.input);
  auto* out = static_cast<float*>(a.output);
  for (int64_t i = 0; i < a.count; ++i) out[i] = in[i] * in[i] + static_cast<float>(a.scalars[0]);
}

KernelId square_plus_id() {
  static const KernelId id = register_kernel(KernelDef{"test.square_plus", {"offset"}, square_plus, 2.0});
  return id;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Kernels, TheRegistryHoldsTheBuiltInsAndRefusesBadDefinitions) {
  EXPECT_EQ(find_kernel("identity"), kernels::kIdentity);
  EXPECT_EQ(find_kernel("scale"), kernels::kScale);
  EXPECT_EQ(kernel_def(kernels::kScale).scalars, std::vector<std::string>{"factor"});
  const KernelId id = square_plus_id();
  EXPECT_GE(id, 2);
  EXPECT_EQ(find_kernel("test.square_plus"), id);
  EXPECT_EQ(kernel_def(id).copy_cost, 2.0);
  EXPECT_FALSE(find_kernel("no.such.kernel").has_value());
  EXPECT_NE(error_of([] { register_kernel(KernelDef{"test.square_plus", {}, square_plus}); }).find("registered already"),
            std::string::npos);
  EXPECT_NE(error_of([] { register_kernel(KernelDef{"bad name", {}, square_plus}); }).find("is not a kernel name"),
            std::string::npos);
  EXPECT_NE(error_of([] { register_kernel(KernelDef{"test.no_cpu", {}, nullptr}); }).find("no CPU implementation"),
            std::string::npos);
  EXPECT_NE(error_of([] { kernel_def(100000); }).find("no compute kernel has id 100000"), std::string::npos);
}

// Two ranks: each one's output is the other's input, squared plus 0.5 (a custom collective whose
// postcondition names the kernel).
Program swap_and_square() {
  CollectiveSpec s;
  s.kind = Collective::kCustom;
  s.nranks = 2;
  s.custom_input_chunks = 1;
  s.custom_output_chunks = 1;
  const KernelId k = square_plus_id();
  s.custom_post = [k](int rank, int) {
    return std::optional<Content>(Content::apply(k, {Content::of(1 - rank, 0)}, {0.5}));
  };
  Program p("swap_and_square", s);
  for (int r = 0; r < 2; ++r) p.chunk(r, Buffer::input(), 0).copy(1 - r, Buffer::output(), 0).apply(k, {0.5});
  return p;
}

TEST(Kernels, AUserKernelRunsInAVerifiedPlanOnTheCpu) {
  Program p = swap_and_square();
  plan::Compiled c = plan::compile(p);  // verified against the postcondition, kernel included
  auto prepared = PreparedPlan::make(c.plan);
  const int64_t count = 1001;
  auto comms = Communicator::create_local(2);
  std::vector<std::vector<float>> in(2, std::vector<float>(count)), out(2, std::vector<float>(count, 0));
  for (int r = 0; r < 2; ++r)
    for (int64_t i = 0; i < count; ++i) in[r][i] = static_cast<float>((r + 1) * (i % 17)) * 0.25f;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      CpuExecutor ex(*comms[r], CpuExecutorOptions{});
      ExecArgs a;
      a.input = in[r].data();
      a.output = out[r].data();
      a.count = count;
      a.reduction.type = DataType::kFloat32;
      ex.run(*prepared, a);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r)
    for (int64_t i = 0; i < count; ++i)
      ASSERT_EQ(out[r][i], in[1 - r][i] * in[1 - r][i] + 0.5f) << "rank " << r << " element " << i;

  // Without the kernel the program no longer meets its postcondition.
  Program wrong("swap only", p.spec());
  for (int r = 0; r < 2; ++r) wrong.chunk(r, Buffer::input(), 0).copy(1 - r, Buffer::output(), 0);
  EXPECT_NE(error_of([&] { plan::compile(wrong); }).find("postcondition"), std::string::npos);
}

TEST(Kernels, PlansNameKernelsInJsonAndRefuseUnknownOnes) {
  plan::Compiled c = plan::compile(swap_and_square());
  const std::string text = plan::to_json(c.plan);
  EXPECT_NE(text.find("\"kernel\": \"test.square_plus\""), std::string::npos) << text;
  EXPECT_EQ(plan::parse_json(text), c.plan);
  std::string unknown = text;
  unknown.replace(unknown.find("test.square_plus"), 16, "test.not_there!");
  EXPECT_NE(error_of([&] { plan::parse_json(unknown); }).find("unknown kernel 'test.not_there!'"), std::string::npos);
  std::string no_scalars = text;
  const size_t at = no_scalars.find("\"scalars\"");
  ASSERT_NE(at, std::string::npos);
  no_scalars.replace(at, 9, "\"scalarz\"");
  EXPECT_NE(error_of([&] { plan::parse_json(no_scalars); }).find("scalarz"), std::string::npos);
  // The DSL checks the scalars too.
  Program p("t", swap_and_square().spec());
  EXPECT_NE(error_of([&] { p.chunk(0, Buffer::input(), 0).apply(square_plus_id(), {}); })
                .find("kernel 'test.square_plus' takes 1 scalar(s), 0 given"),
            std::string::npos);
}

// Kernels are terms of the values they produce: scale(a + b) and scale(a) + b are different
// values, and the proof tells them apart (the multiset of applied kernels it kept before could not).
TEST(Kernels, ProvenanceTellsAKernelBeforeAReductionFromOneAfterIt) {
  CollectiveSpec s;
  s.kind = Collective::kCustom;
  s.nranks = 2;
  s.custom_input_chunks = 1;
  s.custom_output_chunks = 1;
  Content sum = Content::of(0, 0);
  sum.merge(Content::of(1, 0));
  const Content want = Content::apply(kernels::kScale, {sum}, {0.5});
  s.custom_post = [want](int rank, int) { return rank == 0 ? std::optional<Content>(want) : std::nullopt; };

  Program after("scale after the sum", s);
  after.chunk(0, Buffer::input(), 0)
      .copy(0, Buffer::output(), 0)
      .reduce(after.chunk(1, Buffer::input(), 0))
      .apply(kernels::kScale, {0.5});
  EXPECT_NO_THROW(after.check_postcondition());
  EXPECT_NO_THROW(plan::compile(after));

  Program before("scale before the sum", s);
  before.chunk(0, Buffer::input(), 0)
      .copy(0, Buffer::output(), 0)
      .apply(kernels::kScale, {0.5})
      .reduce(before.chunk(1, Buffer::input(), 0));
  const std::string e = error_of([&] { before.check_postcondition(); });
  EXPECT_NE(e.find("holds {r1:i0, scale[0.5]({r0:i0})}, should hold {scale[0.5]({r0:i0, r1:i0})}"), std::string::npos)
      << e;
  // Another scalar is another value.
  Program half("scale by 2", s);
  half.chunk(0, Buffer::input(), 0)
      .copy(0, Buffer::output(), 0)
      .reduce(half.chunk(1, Buffer::input(), 0))
      .apply(kernels::kScale, {2.0});
  EXPECT_NE(error_of([&] { half.check_postcondition(); }).find("postcondition"), std::string::npos);
  // Terms are equal whatever order built them.
  Content ab = Content::of(1, 0), x = Content::apply(kernels::kScale, {Content::of(0, 0)}, {0.5});
  ab.merge(x);
  Content ba = x;
  ba.merge(Content::of(1, 0));
  EXPECT_EQ(ab, ba);
}

TEST(Kernels, TheDeviceInterpreterRefusesKernelsItCannotRun) {
  auto prepared = PreparedPlan::make(plan::compile(swap_and_square()).plan);
  EXPECT_NE(error_of([&] { device::flatten(*prepared, 0); }).find("runs kernel 'test.square_plus', which has no device"),
            std::string::npos);
}

}  // namespace
