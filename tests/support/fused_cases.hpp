#pragma once
// The fused operations' plans with inputs for every rank, for tests that run them on two executors
// (the emulated device and the CPU in test_device_fused; a GPU and the CPU in test_cuda_fused) and
// compare what they leave. Data is exact wherever sums are taken (small integers, gates and
// dropout scales that are powers of two apart), so every order of adding gives the same floats;
// LayerNorm's square root and division are the only roundings a GPU may do differently.
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "compiler/compile.hpp"
#include "runtime/executor.hpp"
#include "tutti/fused.hpp"
#include "tutti/kernel.hpp"

namespace tutti::test_support {

using Arrays = std::vector<std::vector<float>>;

// A value no result keeps: outputs start as it, so an element a plan forgot shows.
inline constexpr float kUnwritten = -999.0f;

struct FusedCase {
  std::string name;
  std::vector<std::shared_ptr<const PreparedPlan>> plans;  // run in turn
  std::vector<Arrays> buffers;                              // each rank's arrays before the run
  // Rank r's call of plan k, given the addresses of its arrays (host or device memory).
  std::function<ExecArgs(int r, const std::vector<float*>& arrays, size_t k)> args;
  std::vector<size_t> results;  // the arrays to compare afterwards
  bool same_on_every_rank = false;  // the results are replicated (an all-gathered output)
  bool rounded = false;             // a GPU may round them differently (contractions, LayerNorm)
};

// A custom collective of `nranks` ranks with `inputs` and `outputs` chunks each (one chunk per rank
// piece); the caller adds postconditions and state buffers.
inline CollectiveSpec custom_spec(int nranks, int inputs, int outputs) {
  CollectiveSpec spec;
  spec.kind = Collective::kCustom;
  spec.nranks = nranks;
  spec.chunk_factor = 1;
  spec.custom_input_chunks = inputs;
  spec.custom_output_chunks = outputs;
  return spec;
}

inline std::shared_ptr<const PreparedPlan> prepare(const dsl::Program& p) {
  return PreparedPlan::make(plan::compile(p).plan);
}

// Small integers in [-mod/2, mod/2], varying with i (13 is prime to every mod used) and with the rank.
inline float small_int(size_t i, int r, int mod) {
  const size_t v = i * 13 + static_cast<size_t>(r) * 5 + i / 17;
  return static_cast<float>(static_cast<int>(v % static_cast<size_t>(mod)) - mod / 2);
}

// The row-parallel epilogue: partial sums of rows x hidden, bias, residual (+ gamma, beta).
inline FusedCase epilogue_case(int n, const fused::EpilogueOptions& o, int64_t hidden = 40, int64_t rows_per_block = 3) {
  fused::register_kernels();
  const int pieces = 2;
  const int64_t rows = static_cast<int64_t>(n) * pieces * rows_per_block;
  const int64_t total = rows * hidden, mine = o.sequence_parallel ? total / n : total;
  enum { kPartial, kOut, kBias, kResidual, kLn, kGamma, kBeta };
  FusedCase c;
  c.name = "epilogue";
  c.plans = {prepare(fused::bias_dropout_residual_program(n, pieces, hidden, o))};
  for (int r = 0; r < n; ++r) {
    Arrays b(7);
    b[kPartial].resize(static_cast<size_t>(total));
    for (size_t i = 0; i < b[kPartial].size(); ++i) b[kPartial][i] = small_int(i, r, 7);
    b[kOut].assign(static_cast<size_t>(mine), kUnwritten);
    for (int k : {kBias, kGamma, kBeta}) b[static_cast<size_t>(k)].resize(static_cast<size_t>(hidden));
    for (size_t i = 0; i < static_cast<size_t>(hidden); ++i) {
      b[kBias][i] = 0.03125f * static_cast<float>(i % 11) - 0.125f;
      b[kGamma][i] = 1.0f + 0.0625f * static_cast<float>(i % 5);
      b[kBeta][i] = 0.25f * static_cast<float>(i % 3);
    }
    b[kResidual].resize(static_cast<size_t>(mine));
    const size_t first = o.sequence_parallel ? static_cast<size_t>(r * mine) : 0;  // replicated rows otherwise
    for (size_t i = 0; i < b[kResidual].size(); ++i) b[kResidual][i] = 0.5f * static_cast<float>((i + first) % 13);
    b[kLn].assign(o.layer_norm ? static_cast<size_t>(mine) : 0, kUnwritten);
    c.buffers.push_back(std::move(b));
  }
  c.args = [=](int, const std::vector<float*>& b, size_t) {
    ExecArgs a;
    a.input = b[kPartial];
    a.output = b[kOut];
    a.count = total;
    a.reduction.type = DataType::kFloat32;
    a.scalars = {o.dropout, static_cast<double>(o.seed >> 32), static_cast<double>(o.seed & 0xFFFFFFFFu), o.ln_eps};
    a.states = {b[kBias], b[kResidual], b[kLn]};
    if (o.layer_norm) a.states.push_back(b[kGamma]), a.states.push_back(b[kBeta]);
    return a;
  };
  c.results = {kOut, kLn};
  c.same_on_every_rank = !o.sequence_parallel;
  c.rounded = o.layer_norm || o.dropout > 0;  // a GPU contracts residual + x * scale into one rounding
  return c;
}

// GEMM -> reduce-scatter (row-parallel linear under sequence parallelism).
inline FusedCase gemm_reduce_scatter_case(int n) {
  fused::register_kernels();
  const int pieces = 2;
  const int64_t rows = static_cast<int64_t>(n) * pieces * 3, k = 12, cols = 10;
  enum { kX, kW, kOut };
  FusedCase c;
  c.name = "gemm_reduce_scatter";
  c.plans = {prepare(fused::gemm_reduce_scatter_program(n, pieces, rows, k, cols))};
  for (int r = 0; r < n; ++r) {
    Arrays b(3);
    b[kX].resize(static_cast<size_t>(rows * k));
    for (size_t i = 0; i < b[kX].size(); ++i) b[kX][i] = small_int(i, r, 5);
    b[kW].resize(static_cast<size_t>(k * cols));
    for (size_t i = 0; i < b[kW].size(); ++i) b[kW][i] = small_int(i, r + 1, 7);
    b[kOut].assign(static_cast<size_t>(rows / n * cols), kUnwritten);
    c.buffers.push_back(std::move(b));
  }
  c.args = [=](int, const std::vector<float*>& b, size_t) {
    ExecArgs a;
    a.output = b[kOut];
    a.count = rows / n * cols;
    a.reduction.type = DataType::kFloat32;
    a.states = {b[kX], b[kW]};
    return a;
  };
  c.results = {kOut};
  return c;
}

// All-gather -> GEMM (column-parallel linear under sequence parallelism).
inline FusedCase all_gather_gemm_case(int n) {
  fused::register_kernels();
  const int pieces = 2;
  const int64_t rows = static_cast<int64_t>(n) * pieces * 3, k = 12, cols = 10;
  enum { kX, kGathered, kW, kY };
  FusedCase c;
  c.name = "all_gather_gemm";
  c.plans = {prepare(fused::all_gather_gemm_program(n, pieces, rows, k, cols))};
  for (int r = 0; r < n; ++r) {
    Arrays b(4);
    b[kX].resize(static_cast<size_t>(rows / n * k));
    for (size_t i = 0; i < b[kX].size(); ++i) b[kX][i] = small_int(i, r, 5);
    b[kGathered].assign(static_cast<size_t>(rows * k), kUnwritten);
    b[kW].resize(static_cast<size_t>(k * cols));
    for (size_t i = 0; i < b[kW].size(); ++i) b[kW][i] = small_int(i, r + 1, 7);
    b[kY].assign(static_cast<size_t>(rows * cols), kUnwritten);
    c.buffers.push_back(std::move(b));
  }
  c.args = [=](int, const std::vector<float*>& b, size_t) {
    ExecArgs a;
    a.input = b[kX];
    a.output = b[kGathered];
    a.count = rows / n * k;
    a.reduction.type = DataType::kFloat32;
    a.states = {b[kW], b[kY]};
    return a;
  };
  c.results = {kGathered, kY};
  return c;
}

// MoE dispatch, then combine: tokens sent to several experts, empty slots (-1), gates of quarters.
inline FusedCase moe_case(int n, int64_t tokens = 10, int64_t hidden = 8, int64_t capacity = 6) {
  fused::register_kernels();
  enum { kX, kIndex, kExpertIn, kExpertOut, kY, kGate };
  FusedCase c;
  c.name = "moe";
  c.plans = {prepare(fused::moe_dispatch_program(n, tokens, hidden, capacity)),
             prepare(fused::moe_combine_program(n, tokens, hidden, capacity))};
  const int64_t slots = n * capacity, block = slots * hidden;
  for (int r = 0; r < n; ++r) {
    Arrays b(6);
    b[kX].resize(static_cast<size_t>(tokens * hidden));
    for (size_t i = 0; i < b[kX].size(); ++i) b[kX][i] = small_int(i, r, 11);
    std::vector<int32_t> index(static_cast<size_t>(slots));
    b[kGate].resize(index.size());
    for (size_t s = 0; s < index.size(); ++s) {
      index[s] = s % 4 == 3 ? -1 : static_cast<int32_t>((s * 5 + static_cast<size_t>(r)) % static_cast<size_t>(tokens));
      b[kGate][s] = 0.25f * static_cast<float>(1 + (s + static_cast<size_t>(r)) % 3);
    }
    b[kIndex].resize(index.size());
    std::memcpy(b[kIndex].data(), index.data(), index.size() * sizeof(int32_t));  // int32 in a float call's bytes
    b[kExpertIn].assign(static_cast<size_t>(block), kUnwritten);
    b[kExpertOut].resize(static_cast<size_t>(block));
    for (size_t i = 0; i < b[kExpertOut].size(); ++i) b[kExpertOut][i] = small_int(i, r + 2, 9);
    b[kY].assign(static_cast<size_t>(tokens * hidden), kUnwritten);
    c.buffers.push_back(std::move(b));
  }
  c.args = [=](int, const std::vector<float*>& b, size_t k) {
    ExecArgs a;
    a.count = block;
    a.reduction.type = DataType::kFloat32;
    if (k == 0) {
      a.output = b[kExpertIn];
      a.states = {b[kX], b[kIndex]};
    } else {
      a.input = b[kExpertOut];
      a.states = {b[kY], b[kGate], b[kIndex]};
    }
    return a;
  };
  c.results = {kExpertIn, kY};
  return c;
}

// A user kernel given as an element-wise program (tutti/kernel.hpp) after a reduction, 2 ranks:
// two inputs (the sum, in place in the output, and a residual state buffer), two outputs (the
// output and an aux state buffer), a per-call scalar (bias) and a constant one (0.25), every kind
// of operation. A GPU's tanh, exp and sqrt may round differently.
inline KernelId user_gelu_mix_kernel() {
  static const KernelId id = [] {
    namespace ew = tutti::elementwise;
    ew::Builder b;
    const ew::Value x = b.input(0), res = b.input(1), bias = b.scalar(0), alpha = b.scalar(1);
    const ew::Value y = x + bias;
    const ew::Value gelu = y * 0.5 * (1.0 + tanh(0.7978845608 * (y + 0.044715 * y * y * y)));
    b.output(gelu + alpha * res);
    b.output(select(x, sqrt(abs(x)), exp(min(x, b.constant(0.5)))) + fma(x, res, b.constant(1.0)) + max(x, res) -
             x / (1.0 + abs(res)));
    KernelDef def;
    def.name = "test.user_gelu_mix";
    def.scalars = {"bias", "alpha"};
    def.inputs = 2;
    def.outputs = 2;
    def.element = std::move(b).build();
    return register_kernel(std::move(def));
  }();
  return id;
}

inline constexpr float kUserKernelBias = 0.125f;

inline FusedCase user_kernel_case(int64_t count = 1000) {
  enum { kIn, kOut, kResidual, kAux };
  const KernelId k = user_gelu_mix_kernel();
  const std::vector<ScalarArg> scalars = {ScalarArg::per_call(0), ScalarArg(0.25)};
  auto result = [=](int q, int output) {
    Content sum = Content::of(0, 0);
    sum.merge(Content::of(1, 0));
    return std::optional<Content>(Content::apply(k, {sum, Content::of_state(q, 0, 0)}, scalars, output));
  };
  CollectiveSpec spec = custom_spec(2, 1, 1);
  spec.custom_post = [=](int q, int) { return result(q, 0); };
  spec.states = {StateBufferSpec{"residual", 1, 0, {}},
                 StateBufferSpec{"aux", 1, 0, [=](int q, int) { return result(q, 1); }}};
  dsl::Program prog("user_kernel_after_a_reduction", spec);
  const dsl::Buffer in = dsl::Buffer::input(), out = dsl::Buffer::output();
  for (int q = 0; q < 2; ++q) prog.chunk(q, in, 0).copy(q, out, 0).reduce(prog.chunk(1 - q, in, 0));
  for (int q = 0; q < 2; ++q)  // in place on the sum
    prog.apply(k, {prog.chunk(q, out, 0), prog.chunk(q, dsl::Buffer::state("residual"), 0)},
               {prog.chunk(q, out, 0), prog.chunk(q, dsl::Buffer::state("aux"), 0)}, scalars);
  FusedCase c;
  c.name = "user element-wise kernel";
  c.plans = {prepare(prog)};
  for (int r = 0; r < 2; ++r) {
    // x of both signs (and zeros); the residual never -1, so 1 + |r| > 0.
    Arrays a(4);
    a[kIn].resize(static_cast<size_t>(count));
    a[kResidual].resize(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) {
      a[kIn][static_cast<size_t>(i)] = static_cast<float>((i * 37 + r * 11) % 41 - 20) / 8.0f;
      a[kResidual][static_cast<size_t>(i)] = static_cast<float>((i * 13 + r) % 23 - 11) / 16.0f;
    }
    a[kOut].assign(static_cast<size_t>(count), kUnwritten);
    a[kAux].assign(static_cast<size_t>(count), kUnwritten);
    c.buffers.push_back(std::move(a));
  }
  c.args = [=](int, const std::vector<float*>& b, size_t) {
    ExecArgs e;
    e.input = b[kIn];
    e.output = b[kOut];
    e.count = count;
    e.reduction.type = DataType::kFloat32;
    e.scalars = {kUserKernelBias};
    e.states = {b[kResidual], b[kAux]};
    return e;
  };
  c.results = {kOut, kAux};
  c.rounded = true;
  return c;
}

inline std::vector<float*> addresses(Arrays& arrays) {
  std::vector<float*> p;
  for (auto& a : arrays) p.push_back(a.data());
  return p;
}

}  // namespace tutti::test_support
