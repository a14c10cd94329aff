// Compute kernels by name (tutti/kernel.hpp): the registry, a user kernel through the DSL, the
// compiler's proof, the plan's JSON and the CPU executor; the device interpreter's refusal of
// kernels it has no implementation of.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <thread>

#include "collectives/algorithms/registry.hpp"
#include "compiler/compile.hpp"
#include "compiler/msccl_xml.hpp"
#include "core/error.hpp"
#include "runtime/device/device_plan.hpp"
#include "runtime/cpu_executor.hpp"
#include "tutti/dsl.hpp"
#include "tutti/kernel.hpp"
#include "support/errors.hpp"

using namespace tutti;
using test_support::error_of;
using dsl::Buffer;
using dsl::Program;

namespace {

// output = input * input + offset, for float32 (the test's only type).
void square_plus(const KernelArgs& a) {
  if (a.type != DataType::kFloat32) throw InvalidArgument("test.square_plus: float32 only");
  const auto* in = static_cast<const float*>(a.inputs[0]);
  auto* out = static_cast<float*>(a.outputs[0]);
  for (int64_t i = 0; i < a.count; ++i) out[i] = in[i] * in[i] + static_cast<float>(a.scalars[0]);
}

KernelId square_plus_id() {
  static const KernelId id = register_kernel(KernelDef{"test.square_plus", {"offset"}, square_plus, 2.0});
  return id;
}

// Runs `prepared` on two ranks as threads (one executor each), float32 buffers of `count` elements
// per piece; returns rank 0's error text ("" when it ran).
std::string run_two_ranks(std::vector<std::unique_ptr<CpuExecutor>>& ex, const PreparedPlan& prepared,
                          std::vector<std::vector<float>>& in, std::vector<std::vector<float>>& out, int64_t count,
                          std::vector<double> scalars = {}) {
  std::vector<std::thread> threads;
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      ExecArgs a;
      a.input = in[r].data();
      a.output = out[r].data();
      a.count = count;
      a.reduction.type = DataType::kFloat32;
      a.scalars = scalars;
      try {
        ex[r]->run(prepared, a);
      } catch (const Error& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors[0];
}

std::vector<std::unique_ptr<CpuExecutor>> two_executors(std::vector<std::unique_ptr<Communicator>>& comms) {
  std::vector<std::unique_ptr<CpuExecutor>> ex;
  for (auto& c : comms) ex.push_back(std::make_unique<CpuExecutor>(*c, CpuExecutorOptions{}));
  return ex;
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

// Element-wise programs (user kernels' device form): checked against the kernel's operands and
// scalars when registered, naming the kernel and the instruction; the program serves as the CPU
// form when no other is given.
TEST(Kernels, ElementwiseProgramsAreCheckedWhenRegistered) {
  auto def_with = [](const char* name, ElementProgram p, int inputs = 1, int outputs = 1) {
    KernelDef d;
    d.name = name;
    d.scalars = {"s"};
    d.inputs = inputs;
    d.outputs = outputs;
    d.element = std::move(p);
    return d;
  };
  namespace ew = tutti::elementwise;
  {
    ew::Builder b;
    b.output(b.input(0) * b.scalar(0) + 1.0);
    const KernelId id = register_kernel(def_with("test.ew_affine", std::move(b).build()));
    EXPECT_EQ(kernel_def(id).device, DeviceKernel::kElementwise);
    ASSERT_NE(kernel_def(id).cpu, nullptr);
    // Its CPU form, through the definition (as the executors call it).
    float x[3] = {1, 2, 3}, y[3] = {};
    const void* ins[1] = {x};
    void* outs[1] = {y};
    const double scalar = 3;
    KernelArgs a{ins, outs, 3, DataType::kFloat32, &scalar};
    a.kernel = &kernel_def(id);
    kernel_def(id).cpu(a);
    EXPECT_EQ(y[0], 4.0f);
    EXPECT_EQ(y[2], 10.0f);
    a.type = DataType::kFloat64;
    EXPECT_NE(error_of([&] { kernel_def(id).cpu(a); }).find("takes float32 calls"), std::string::npos);
  }
  const std::vector<std::pair<ElementProgram, std::string>> bad = {
      {{{{ElementOp::kInput, 1}}, {0}}, "instruction 0 reads input 1 of 1"},
      {{{{ElementOp::kScalar, 2}}, {0}}, "instruction 0 reads scalar 2 of 1"},
      {{{{ElementOp::kInput, 0}, {ElementOp::kAdd, 0, 2}}, {1}}, "instruction 1 uses value 2"},
      {{{{ElementOp::kInput, 0}}, {0, 0}}, "2 output value(s) for 1 output(s)"},
      {{{{ElementOp::kInput, 0}}, {3}}, "output 0 is value 3 of 1"},
      {{{{static_cast<ElementOp>(99), 0}}, {0}}, "instruction 0 has opcode 99"},
      {{std::vector<ElementInstr>(64, {ElementOp::kConst}), {0}}, "64 instructions and 1 outputs; at most 64"},
  };
  for (const auto& entry : bad) {
    const ElementProgram& program = entry.first;
    const std::string& why = entry.second;
    const std::string e = error_of([&] { register_kernel(def_with("test.ew_bad", program)); });
    EXPECT_NE(e.find("test.ew_bad"), std::string::npos) << e;
    EXPECT_NE(e.find(why), std::string::npos) << "wanted '" << why << "' in: " << e;
  }
  EXPECT_FALSE(find_kernel("test.ew_bad").has_value());
  KernelDef both = def_with("test.ew_both", {{{ElementOp::kInput, 0}}, {0}});
  both.device = DeviceKernel::kAdamw;
  EXPECT_NE(error_of([&] { register_kernel(both); }).find("one of them"), std::string::npos);
  KernelDef none = def_with("test.ew_none", {});
  none.cpu = square_plus;
  none.device = DeviceKernel::kElementwise;
  EXPECT_NE(error_of([&] { register_kernel(none); }).find("without a program"), std::string::npos);
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
  for (int r = 0; r < 2; ++r) p.chunk(r, Buffer::input(), 0).copy(1 - r, Buffer::output(), 0).then(k, {0.5});
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
  auto ex = two_executors(comms);
  ASSERT_EQ(run_two_ranks(ex, *prepared, in, out, count), "");
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
  // MSCCL's XML has no compute step: the export says so instead of dropping it.
  plan::Plan ag = plan::compile(algorithms::build("ring_allgather", 2)).plan;
  plan::Instruction step;
  step.op = plan::Opcode::kCompute;
  step.srcs = {plan::Ref{BufferKind::kOutput, 0, 1}};
  step.dst = plan::Ref{BufferKind::kOutput, 0, 1};
  step.kernel = square_plus_id();
  step.scalars = {1.0};
  ag.ranks[0].blocks[0].steps.push_back(step);
  const std::string xml_error = error_of([&] { plan::export_msccl_xml(ag); });
  EXPECT_NE(xml_error.find("compute steps have no MSCCL XML form"), std::string::npos) << xml_error;
  // The DSL checks the scalars too.
  Program p("t", swap_and_square().spec());
  EXPECT_NE(error_of([&] { p.chunk(0, Buffer::input(), 0).then(square_plus_id(), {}); })
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
      .then(kernels::kScale, {0.5});
  EXPECT_NO_THROW(after.check_postcondition());
  EXPECT_NO_THROW(plan::compile(after));

  Program before("scale before the sum", s);
  before.chunk(0, Buffer::input(), 0)
      .copy(0, Buffer::output(), 0)
      .then(kernels::kScale, {0.5})
      .reduce(before.chunk(1, Buffer::input(), 0));
  const std::string e = error_of([&] { before.check_postcondition(); });
  EXPECT_NE(e.find("holds {r1:i0, scale[0.5]({r0:i0})}, should hold {scale[0.5]({r0:i0, r1:i0})}"), std::string::npos)
      << e;
  // Another scalar is another value.
  Program half("scale by 2", s);
  half.chunk(0, Buffer::input(), 0)
      .copy(0, Buffer::output(), 0)
      .reduce(half.chunk(1, Buffer::input(), 0))
      .then(kernels::kScale, {2.0});
  EXPECT_NE(error_of([&] { half.check_postcondition(); }).find("postcondition"), std::string::npos);
  // Terms are equal whatever order built them.
  Content ab = Content::of(1, 0), x = Content::apply(kernels::kScale, {Content::of(0, 0)}, {0.5});
  ab.merge(x);
  Content ba = x;
  ba.merge(Content::of(1, 0));
  EXPECT_EQ(ab, ba);
}

// A kernel of several operands: m' = 0.9 m + g; p' = p - lr m' (inputs g, m, p; outputs m', p').
void momentum(const KernelArgs& a) {
  const auto* g = static_cast<const float*>(a.inputs[0]);
  const auto* m = static_cast<const float*>(a.inputs[1]);
  const auto* p = static_cast<const float*>(a.inputs[2]);
  auto* m2 = static_cast<float*>(a.outputs[0]);
  auto* p2 = static_cast<float*>(a.outputs[1]);
  const float lr = static_cast<float>(a.scalars[0]);
  for (int64_t i = 0; i < a.count; ++i) {  // element by element: outputs may alias inputs
    const float mi = 0.9f * m[i] + g[i];
    p2[i] = p[i] - lr * mi;
    m2[i] = mi;
  }
}

KernelId momentum_id() {
  static const KernelId id = register_kernel(KernelDef{"test.momentum", {"lr"}, momentum, 3.0, 3, 2});
  return id;
}

// A fused optimizer step on 2 ranks: each reduces its shard of the gradients (input chunk r of
// both ranks) into output[0], then runs the optimizer there, in place, with its moment (input 2)
// and parameters (input 3): output[0] = p', output[1] = m'.
CollectiveSpec optimizer_step_spec(bool check) {
  CollectiveSpec s;
  s.kind = Collective::kCustom;
  s.nranks = 2;
  s.custom_input_chunks = 4;
  s.custom_output_chunks = 2;
  const KernelId k = momentum_id();
  s.custom_post = [k, check](int rank, int index) -> std::optional<Content> {
    if (!check) return std::nullopt;
    Content g = Content::of(0, rank);
    g.merge(Content::of(1, rank));
    return Content::apply(k, {g, Content::of(rank, 2), Content::of(rank, 3)}, {0.1}, index == 0 ? 1 : 0);
  };
  return s;
}

TEST(Kernels, AKernelOfSeveralOperandsIsProvenAndRunInPlace) {
  const KernelId k = momentum_id();
  Program p("optimizer step", optimizer_step_spec(true));
  for (int r = 0; r < 2; ++r) {
    auto g = p.chunk(r, Buffer::input(), r).copy(r, Buffer::output(), 0).reduce(p.chunk(1 - r, Buffer::input(), r));
    p.apply(k, {g, p.chunk(r, Buffer::input(), 2), p.chunk(r, Buffer::input(), 3)}, {p.chunk(r, Buffer::output(), 1), g},
            {0.1});
  }
  plan::Compiled c = plan::compile(p);
  EXPECT_EQ(plan::parse_json(plan::to_json(c.plan)), c.plan);  // more_dsts travel in JSON
  {  // Mutations of the fused plan: operands swapped, the reduction dropped. The verifier, given the
     // collective (a custom one's postcondition does not travel with its plan), refuses both.
    const CollectiveSpec spec = optimizer_step_spec(true);
    plan::VerifyOptions o;
    o.spec = &spec;
    EXPECT_EQ(error_of([&] { plan::verify(c.plan, o); }), "");
    plan::Plan swapped = c.plan, dropped = c.plan;
    for (auto& b : swapped.ranks[1].blocks)
      for (auto& in : b.steps)
        if (in.op == plan::Opcode::kCompute) std::swap(in.srcs[1], in.srcs[2]);
    EXPECT_NE(error_of([&] { plan::verify(swapped, o); }).find("postcondition"), std::string::npos);
    for (auto& b : dropped.ranks[0].blocks)
      for (auto& in : b.steps)
        if (in.op == plan::Opcode::kRecvReduceCopy) in.op = plan::Opcode::kRecv, in.srcs.clear();
    EXPECT_NE(error_of([&] { plan::verify(dropped, o); }).find("postcondition"), std::string::npos);
  }
  {  // The verifier holds a step to its kernel's operands.
    plan::Plan cut = c.plan;
    for (auto& b : cut.ranks[0].blocks)
      for (auto& in : b.steps)
        if (in.op == plan::Opcode::kCompute) in.more_dsts.clear();
    EXPECT_NE(error_of([&] { plan::verify(cut); }).find("kernel 'test.momentum' has 2 output(s), the step writes 1"),
              std::string::npos);
  }
  auto prepared = PreparedPlan::make(c.plan);
  const int64_t count = 777;
  auto comms = Communicator::create_local(2);
  std::vector<std::vector<float>> in(2, std::vector<float>(4 * count)), out(2, std::vector<float>(2 * count, 0));
  for (int r = 0; r < 2; ++r)
    for (int64_t i = 0; i < 4 * count; ++i) in[r][i] = static_cast<float>((r + 2) * (i % 13)) * 0.5f;
  auto ex = two_executors(comms);
  ASSERT_EQ(run_two_ranks(ex, *prepared, in, out, count), "");
  for (int r = 0; r < 2; ++r)
    for (int64_t i = 0; i < count; ++i) {
      const float g = in[r][r * count + i] + in[1 - r][r * count + i];
      const float m = 0.9f * in[r][2 * count + i] + g;
      ASSERT_EQ(out[r][count + i], m) << "rank " << r << " m' element " << i;
      ASSERT_EQ(out[r][i], in[r][3 * count + i] - 0.1f * m) << "rank " << r << " p' element " << i;
    }

  // The optimizer on a partial sum (before the peer's gradient arrives) is another value.
  Program early("too early", optimizer_step_spec(true));
  for (int r = 0; r < 2; ++r) {
    auto g = early.chunk(r, Buffer::input(), r).copy(r, Buffer::output(), 0);
    early.apply(k, {g, early.chunk(r, Buffer::input(), 2), early.chunk(r, Buffer::input(), 3)},
                {early.chunk(r, Buffer::output(), 1), g}, {0.1});
    g.reduce(early.chunk(1 - r, Buffer::input(), r));
  }
  EXPECT_NE(error_of([&] { early.check_postcondition(); }).find("postcondition"), std::string::npos);
  // Operands that do not fit the kernel.
  Program bad("bad", optimizer_step_spec(false));
  EXPECT_NE(error_of([&] { bad.apply(k, {bad.chunk(0, Buffer::input(), 0)}, {bad.chunk(0, Buffer::output(), 0)}, {0.1}); })
                .find("takes 3 input(s) and 2 output(s), 1 and 1 given"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              bad.apply(k, {bad.chunk(0, Buffer::input(), 0), bad.chunk(1, Buffer::input(), 2), bad.chunk(0, Buffer::input(), 3)},
                        {bad.chunk(0, Buffer::output(), 1), bad.chunk(0, Buffer::output(), 0)}, {0.1});
            }).find("operands on rank 0"),
            std::string::npos);
}

// A scalar a call passes (ScalarArg::per_call): one cached plan, a new learning rate each call.
TEST(Kernels, PerCallScalarsChangeWithoutANewPlan) {
  const KernelId k = momentum_id();
  CollectiveSpec s = optimizer_step_spec(false);
  Program p("optimizer step, lr per call", s);
  for (int r = 0; r < 2; ++r) {
    auto g = p.chunk(r, Buffer::input(), r).copy(r, Buffer::output(), 0).reduce(p.chunk(1 - r, Buffer::input(), r));
    p.apply(k, {g, p.chunk(r, Buffer::input(), 2), p.chunk(r, Buffer::input(), 3)}, {p.chunk(r, Buffer::output(), 1), g},
            {ScalarArg::per_call(0)});
  }
  plan::Compiled c = plan::compile(p);
  const std::string text = plan::to_json(c.plan);
  EXPECT_NE(text.find("\"slot\": 0"), std::string::npos) << text;
  EXPECT_EQ(plan::parse_json(text), c.plan);
  auto prepared = PreparedPlan::make(c.plan);
  const int64_t count = 100;
  auto comms = Communicator::create_local(2);
  std::vector<std::vector<float>> in(2, std::vector<float>(4 * count, 1.0f)), out(2, std::vector<float>(2 * count));
  auto ex = two_executors(comms);
  auto run = [&](std::vector<double> scalars) { return run_two_ranks(ex, *prepared, in, out, count, scalars); };
  // g = 2, m = 1, p = 1: m' = 2.9, p' = 1 - lr * 2.9.
  for (double lr : {0.5, 0.25}) {
    EXPECT_EQ(run({lr}), "");
    EXPECT_EQ(out[0][0], 1.0f - static_cast<float>(lr) * 2.9f) << "lr " << lr;
  }
  EXPECT_NE(run({}).find("per-call scalar 0, but the call passes 0 scalar(s)"), std::string::npos);
}

TEST(Kernels, TheDeviceInterpreterRefusesKernelsItCannotRun) {
  auto prepared = PreparedPlan::make(plan::compile(swap_and_square()).plan);
  EXPECT_NE(error_of([&] { device::flatten(*prepared, 0); }).find("runs kernel 'test.square_plus', which has no device"),
            std::string::npos);
}

}  // namespace

// A reduction's epilogue streamed over its receive (KernelDef::stream): output = input * factor,
// counting the ranges it is given before the compute step itself runs.
std::atomic<int64_t> streamed_ranges{0};

void scale_by(const KernelArgs& a) {
  const auto* in = static_cast<const float*>(a.inputs[0]);
  auto* out = static_cast<float*>(a.outputs[0]);
  for (int64_t i = 0; i < a.count; ++i) out[i] = in[i] * static_cast<float>(a.scalars[0]);
}

void scale_by_stream(const KernelArgs& a, void* state, int64_t from, int64_t to, bool last) {
  if (from == 0 && a.type != DataType::kFloat32) throw InvalidArgument("test.stream_scale: float32 only");
  auto* seen = static_cast<int64_t*>(state);  // the carry: where the previous range ended
  if (*seen != from) throw InternalError("test.stream_scale: ranges out of order");
  if (!last && to % 64 != 0) throw InternalError("test.stream_scale: a range that is not whole groups of 64");
  const auto* in = static_cast<const float*>(a.inputs[0]);
  auto* out = static_cast<float*>(a.outputs[0]);
  for (int64_t i = from; i < to; ++i) out[i] = in[i] * static_cast<float>(a.scalars[0]);
  *seen = to;
  if (!last && to > from) streamed_ranges.fetch_add(1);
}

KernelId stream_scale_id() {
  static const KernelId id = [] {
    KernelDef d{"test.stream_scale", {"factor"}, scale_by, 1.0};
    d.stream = scale_by_stream;
    d.stream_state = sizeof(int64_t);
    return register_kernel(d);
  }();
  return id;
}

// Rank 0's output: (input of rank 0 + input of rank 1) * 0.5. With `peek`, rank 1's output gets
// the sum before the kernel runs: a step between the receive and the kernel that reads the chunk.
Program sum_then_scale(bool peek) {
  CollectiveSpec s;
  s.kind = Collective::kCustom;
  s.nranks = 2;
  s.custom_input_chunks = 1;
  s.custom_output_chunks = 1;
  const KernelId k = stream_scale_id();
  Content sum = Content::of(0, 0);
  sum.merge(Content::of(1, 0));
  s.custom_post = [k, sum, peek](int rank, int) {
    if (rank == 0) return std::optional<Content>(Content::apply(k, {sum}, {0.5}));
    return peek ? std::optional<Content>(sum) : std::nullopt;
  };
  Program p(peek ? "sum_peek_scale" : "sum_then_scale", s);
  auto g = p.chunk(0, Buffer::input(), 0).copy(0, Buffer::output(), 0).reduce(p.chunk(1, Buffer::input(), 0));
  if (peek) g.copy(1, Buffer::output(), 0);
  g.then(k, {0.5});
  return p;
}

TEST(Kernels, AReductionsEpilogueStreamsOverItsReceiveUnlessAStepReadsTheChunkBetween) {
  EXPECT_NE(error_of([] {
              KernelDef d{"test.state_without_stream", {}, scale_by};
              d.stream_state = 8;
              register_kernel(d);
            }).find("without a stream form"),
            std::string::npos);
  const int64_t count = 100003;  // several FIFO slots, and a tail that is not a multiple of 64
  for (bool peek : {false, true})
    for (bool streaming : {true, false}) {
      SCOPED_TRACE(testing::Message() << (peek ? "a step reads the sum" : "nothing reads the sum")
                                      << (streaming ? ", streaming on" : ", streaming off"));
      auto prepared = PreparedPlan::make(plan::compile(sum_then_scale(peek)).plan);
      const std::vector<StreamedEpilogueStep> streams = streamed_epilogues(*prepared, 0);
      EXPECT_EQ(streams.size(), peek ? 0u : 1u);
      EXPECT_TRUE(streamed_epilogues(*prepared, 1).empty());
      auto comms = Communicator::create_local(2);
      std::vector<std::unique_ptr<CpuExecutor>> ex;
      CpuExecutorOptions o;
      o.stream_epilogues = streaming;
      for (auto& c : comms) ex.push_back(std::make_unique<CpuExecutor>(*c, o));
      std::vector<std::vector<float>> in(2, std::vector<float>(count)), out(2, std::vector<float>(count, -1));
      for (int r = 0; r < 2; ++r)
        for (int64_t i = 0; i < count; ++i) in[r][i] = static_cast<float>((r + 1) * (i % 19) - 9);
      const int64_t before = streamed_ranges.load();
      ASSERT_EQ(run_two_ranks(ex, *prepared, in, out, count), "");
      EXPECT_EQ(streamed_ranges.load() > before, streaming && !peek);
      for (int64_t i = 0; i < count; ++i) {
        const float sum = in[0][i] + in[1][i];
        ASSERT_EQ(out[0][i], sum * 0.5f) << "element " << i;
        if (peek) {
          ASSERT_EQ(out[1][i], sum) << "rank 1 read the sum before the kernel, element " << i;
        }
      }
    }
}
// The plan above with one more step on rank 0 that reads the chunk (a copy into scratch), in a block
// of its own, ordered by `deps`.
plan::Plan with_reader(std::vector<plan::Dep> deps, bool receive_waits_for_it = false) {
  plan::Plan p = plan::compile(sum_then_scale(false)).plan;
  plan::Instruction read;
  read.op = plan::Opcode::kCopy;
  read.srcs = {plan::Ref{BufferKind::kOutput, 0, 1}};
  read.dst = plan::Ref{BufferKind::kScratch, 0, 1};
  read.deps = std::move(deps);
  plan::RankPlan& r0 = p.ranks[0];
  r0.scratch_chunks = 1;
  const int64_t id = static_cast<int64_t>(r0.blocks.size());
  r0.blocks.push_back(plan::Block{id, 0, {read}});
  if (receive_waits_for_it) r0.blocks[0].steps[0].deps.push_back(plan::Dep{id, 0});
  return p;
}

TEST(Kernels, AnEpilogueStreamsOnlyWhereNoOtherStepCanSeeTheChunkHalfProcessed) {
  // Rank 0: block 0 receives and reduces into output 0, block 1 runs the kernel on it.
  const plan::Plan p = plan::compile(sum_then_scale(false)).plan;
  ASSERT_EQ(p.ranks[0].blocks.size(), 2u);
  const std::vector<StreamedEpilogueStep> plain = streamed_epilogues(*PreparedPlan::make(p), 0);
  ASSERT_EQ(plain.size(), 1u);
  EXPECT_EQ(plain[0].receive, (plan::Dep{0, 0}));
  EXPECT_EQ(plain[0].compute, (plan::Dep{1, 0}));
  // After the receive, unordered with the kernel: it could read the chunk half scaled.
  EXPECT_TRUE(streamed_epilogues(*PreparedPlan::make(with_reader({{0, 0}})), 0).empty());
  // After the kernel, or before the receive: it reads the chunk whole.
  EXPECT_EQ(streamed_epilogues(*PreparedPlan::make(with_reader({{1, 0}})), 0).size(), 1u);
  EXPECT_EQ(streamed_epilogues(*PreparedPlan::make(with_reader({}, true)), 0).size(), 1u);
  // Unordered with both: not streamed either.
  EXPECT_TRUE(streamed_epilogues(*PreparedPlan::make(with_reader({})), 0).empty());
}
