// Mixture-of-experts dispatch and combine (tutti/fused.hpp): the gather of each destination's
// tokens fused with its send, and the gate weighting and scatter fused with each block's receipt.
#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "core/datatype.hpp"
#include "core/error.hpp"
#include "fused_kernels/common.hpp"
#include "tutti/fused.hpp"
#include "tutti/kernel.hpp"

namespace tutti::fused {
namespace {

// Scalars of both kernels: {hidden} (a constant of the plan).
// inputs {x: tokens x hidden, index: slots (int32)}, outputs {block: slots x hidden}: block row s =
// x row index[s], zeros for an empty slot.
void gather_rows(const KernelArgs& a) {
  require_float(a, "moe.gather");
  const auto hidden = static_cast<int64_t>(a.scalars[0]);
  const auto* x = static_cast<const float*>(a.inputs[0]);
  const auto* index = static_cast<const int32_t*>(a.inputs[1]);
  auto* block = static_cast<float*>(a.outputs[0]);
  if (hidden < 1 || !a.input_counts || a.input_counts[0] % hidden != 0 ||
      (a.output_counts && a.output_counts[0] != a.input_counts[1] * hidden))
    throw InvalidArgument(fmt::format("kernel 'moe.gather': rows of {} do not fit the operands", hidden));
  const int64_t tokens = a.input_counts[0] / hidden, slots = a.input_counts[1];
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t t = index[s];
    if (t < -1 || t >= tokens)
      throw InvalidArgument(fmt::format("kernel 'moe.gather': slot {} names token {} of {}", s, t, tokens));
    if (t < 0) std::memset(block + s * hidden, 0, static_cast<size_t>(hidden) * sizeof(float));
    else std::memcpy(block + s * hidden, x + t * hidden, static_cast<size_t>(hidden) * sizeof(float));
  }
}

// inputs {block: slots x hidden, gate: slots, index: slots (int32)[, y]}, outputs {y: tokens x
// hidden}: y row index[s] += gate[s] * block row s; without the input y, y starts at zero.
void scatter_rows(const KernelArgs& a, bool first) {
  const char* what = first ? "moe.combine_first" : "moe.combine";
  require_float(a, what);
  const auto hidden = static_cast<int64_t>(a.scalars[0]);
  const auto* block = static_cast<const float*>(a.inputs[0]);
  const auto* gate = static_cast<const float*>(a.inputs[1]);
  const auto* index = static_cast<const int32_t*>(a.inputs[2]);
  auto* y = static_cast<float*>(a.outputs[0]);
  if (hidden < 1 || !a.input_counts || !a.output_counts || a.output_counts[0] % hidden != 0 ||
      a.input_counts[0] != a.input_counts[1] * hidden || a.input_counts[2] != a.input_counts[1] ||
      (!first && a.input_counts[3] != a.output_counts[0]))
    throw InvalidArgument(fmt::format("kernel '{}': rows of {} do not fit the operands", what, hidden));
  const int64_t tokens = a.output_counts[0] / hidden, slots = a.input_counts[1];
  if (first) std::memset(y, 0, static_cast<size_t>(tokens * hidden) * sizeof(float));
  else if (a.inputs[3] != y) std::memcpy(y, a.inputs[3], static_cast<size_t>(tokens * hidden) * sizeof(float));
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t t = index[s];
    if (t < -1 || t >= tokens) throw InvalidArgument(fmt::format("kernel '{}': slot {} names token {} of {}", what, s, t, tokens));
    if (t < 0) continue;
    const float g = gate[s];
    for (int64_t c = 0; c < hidden; ++c) y[t * hidden + c] += g * block[s * hidden + c];
  }
}
void combine_first(const KernelArgs& a) { scatter_rows(a, true); }
void combine_more(const KernelArgs& a) { scatter_rows(a, false); }

struct KernelIds {
  KernelId gather, first, more;
};

const KernelIds& ids() {
  static const KernelIds k = [] {
    // Mixed units: token tables, slot tables and blocks are state buffers of their own units.
    return KernelIds{
        register_once({"moe.gather", {"hidden"}, gather_rows, 1.0, 2, 1}, true, DeviceKernel::kMoeGather),
        register_once({"moe.combine_first", {"hidden"}, combine_first, 2.0, 3, 1}, true, DeviceKernel::kMoeCombineFirst),
        register_once({"moe.combine", {"hidden"}, combine_more, 2.0, 4, 1}, true, DeviceKernel::kMoeCombine)};
  }();
  return k;
}

// Rank r combines the blocks in this order: its own, then r + 1, r + 2, ... (the unfused form too).
int combine_source(int r, int step, int n) { return (r + step) % n; }

}  // namespace

dsl::Program moe_dispatch_program(int n, int64_t tokens, int64_t hidden, int64_t capacity) {
  TUTTI_CHECK(n >= 1 && tokens >= 1 && hidden >= 1 && capacity >= 1, InvalidArgument,
              "moe_dispatch_program: {} ranks, {} tokens of {}, capacity {}", n, tokens, hidden, capacity);
  const KernelIds& k = ids();
  const std::vector<ScalarArg> h = {ScalarArg(static_cast<double>(hidden))};
  CollectiveSpec s;
  s.kind = Collective::kCustom;
  s.nranks = n;
  s.chunk_factor = n;  // the output: n blocks of capacity x hidden
  s.custom_input_chunks = 0;
  s.custom_output_chunks = n;
  s.custom_post = [=](int q, int r) {
    return std::optional<Content>(Content::apply(k.gather, {Content::of_state(r, 0, 0), Content::of_state(r, 1, q)}, h));
  };
  s.states = {StateBufferSpec{"x", 1, tokens * hidden, {}}, StateBufferSpec{"index", n, capacity, {}}};
  dsl::Program p(fmt::format("moe_dispatch_n{}", n), s);
  const dsl::Buffer x = dsl::Buffer::state("x"), index = dsl::Buffer::state("index"), out = dsl::Buffer::output(),
                    staged = dsl::Buffer::scratch("grouped");
  for (int r = 0; r < n; ++r)
    for (int step = 1; step <= n; ++step) {  // the peers' blocks first, each sent as it is gathered; its own last
      const int q = (r + step) % n;
      if (q == r) {
        p.apply(k.gather, {p.chunk(r, x, 0), p.chunk(r, index, q)}, {p.chunk(r, out, r)}, h);
      } else {
        p.apply(k.gather, {p.chunk(r, x, 0), p.chunk(r, index, q)}, {p.chunk(r, staged, q)}, h);
        p.chunk(r, staged, q).copy(q, out, r);
      }
    }
  return p;
}

dsl::Program moe_combine_program(int n, int64_t tokens, int64_t hidden, int64_t capacity) {
  TUTTI_CHECK(n >= 1 && tokens >= 1 && hidden >= 1 && capacity >= 1, InvalidArgument,
              "moe_combine_program: {} ranks, {} tokens of {}, capacity {}", n, tokens, hidden, capacity);
  const KernelIds& k = ids();
  const std::vector<ScalarArg> h = {ScalarArg(static_cast<double>(hidden))};
  CollectiveSpec s;
  s.kind = Collective::kCustom;
  s.nranks = n;
  s.chunk_factor = n;  // the input: n blocks of capacity x hidden (block r: outputs for rank r's tokens)
  s.custom_input_chunks = n;
  s.custom_output_chunks = 0;
  s.states = {StateBufferSpec{"y", 1, tokens * hidden,
                              [=](int r, int) {
                                Content y;
                                for (int step = 0; step < n; ++step) {
                                  const int q = combine_source(r, step, n);
                                  std::vector<Content> args = {Content::of(q, r), Content::of_state(r, 1, q),
                                                               Content::of_state(r, 2, q)};
                                  if (step > 0) args.push_back(y);
                                  y = Content::apply(step == 0 ? k.first : k.more, args, h);
                                }
                                return std::optional<Content>(y);
                              }},
              StateBufferSpec{"gate", n, capacity, {}}, StateBufferSpec{"index", n, capacity, {}}};
  dsl::Program p(fmt::format("moe_combine_n{}", n), s);
  const dsl::Buffer in = dsl::Buffer::input(), y = dsl::Buffer::state("y"), gate = dsl::Buffer::state("gate"),
                    index = dsl::Buffer::state("index"), landed = dsl::Buffer::scratch("returned");
  for (int q = 0; q < n; ++q)  // every expert block back to the rank its tokens came from
    for (int r = 0; r < n; ++r)
      if (r != q) p.chunk(q, in, r).copy(r, landed, q);
  for (int r = 0; r < n; ++r)
    for (int step = 0; step < n; ++step) {
      const int q = combine_source(r, step, n);
      auto block = q == r ? p.chunk(r, in, r) : p.chunk(r, landed, q);
      std::vector<dsl::ChunkRef> args = {block, p.chunk(r, gate, q), p.chunk(r, index, q)};
      if (step > 0) args.push_back(p.chunk(r, y, 0));
      p.apply(step == 0 ? k.first : k.more, args, {p.chunk(r, y, 0)}, h);
    }
  return p;
}

MoeExchange::MoeExchange(Comm& comm, int64_t tokens, int64_t hidden, int64_t capacity)
    : comm_(comm), tokens_(tokens), hidden_(hidden), capacity_(capacity) {
  TUTTI_CHECK(tokens >= 1 && hidden >= 1 && capacity >= 1 && tokens < (int64_t{1} << 31), InvalidArgument,
              "rank {}: MoeExchange: {} tokens of {} with capacity {}", comm.rank(), tokens, hidden, capacity);
  dispatch_ = compile_plan(moe_dispatch_program(comm.size(), tokens, hidden, capacity));
  combine_ = compile_plan(moe_combine_program(comm.size(), tokens, hidden, capacity));
}

namespace {
// Before a call is posted, so that a bad slot is this rank's error, not a failed plan its peers wait on.
void check_index(const Comm& comm, const char* call, const int32_t* index, int64_t slots, int64_t tokens) {
  for (int64_t s = 0; s < slots; ++s)
    TUTTI_CHECK(index[s] >= -1 && index[s] < tokens, InvalidArgument,
                "rank {}: MoeExchange::{}: slot {} (destination {}) names token {} of {}", comm.rank(), call, s,
                s / (slots / comm.size()), index[s], tokens);
}
}  // namespace

Work MoeExchange::dispatch(const float* x, const int32_t* index, float* expert_in) {
  TUTTI_CHECK(x && index && expert_in, InvalidArgument, "rank {}: MoeExchange::dispatch: a null buffer", comm_.rank());
  check_index(comm_, "dispatch", index, comm_.size() * capacity_, tokens_);
  PlanCall call;
  call.output = expert_in;
  call.count = static_cast<size_t>(comm_.size() * capacity_ * hidden_);
  // index travels as a state buffer of 4-byte elements: int32 in a float32 call's bytes.
  call.states = {const_cast<float*>(x), const_cast<int32_t*>(index)};
  return run_plan(comm_, dispatch_, call);
}

Work MoeExchange::combine(const float* expert_out, const float* gate, const int32_t* index, float* y) {
  TUTTI_CHECK(expert_out && gate && index && y, InvalidArgument, "rank {}: MoeExchange::combine: a null buffer",
              comm_.rank());
  check_index(comm_, "combine", index, comm_.size() * capacity_, tokens_);
  PlanCall call;
  call.input = expert_out;
  call.count = static_cast<size_t>(comm_.size() * capacity_ * hidden_);
  call.states = {y, const_cast<float*>(gate), const_cast<int32_t*>(index)};
  return run_plan(comm_, combine_, call);
}

void MoeExchange::dispatch_unfused(const float* x, const int32_t* index, float* expert_in) {
  const int n = comm_.size();
  const int64_t block = capacity_ * hidden_;
  staging_.resize(static_cast<size_t>(n * block));
  const double h = static_cast<double>(hidden_);
  const KernelDef& gather = kernel_def(ids().gather);
  for (int q = 0; q < n; ++q) {  // group the tokens by destination, then one all-to-all
    const void* ins[2] = {x, index + q * capacity_};
    void* outs[1] = {staging_.data() + q * block};
    const int64_t in_counts[2] = {tokens_ * hidden_, capacity_}, out_counts[1] = {block};
    gather.cpu(KernelArgs{ins, outs, tokens_ * hidden_, DataType::kFloat32, &h, in_counts, out_counts});
  }
  comm_.all_to_all(staging_.data(), expert_in, static_cast<size_t>(block), DataType::kFloat32).wait();
}

void MoeExchange::combine_unfused(const float* expert_out, const float* gate, const int32_t* index, float* y) {
  const int n = comm_.size(), r = comm_.rank();
  const int64_t block = capacity_ * hidden_;
  staging_.resize(static_cast<size_t>(n * block));
  comm_.all_to_all(expert_out, staging_.data(), static_cast<size_t>(block), DataType::kFloat32).wait();
  const double h = static_cast<double>(hidden_);
  for (int step = 0; step < n; ++step) {  // then the weighting and scatter, in the fused form's order
    const int q = combine_source(r, step, n);
    const void* ins[4] = {staging_.data() + q * block, gate + q * capacity_, index + q * capacity_, y};
    void* outs[1] = {y};
    const int64_t in_counts[4] = {block, capacity_, capacity_, tokens_ * hidden_}, out_counts[1] = {tokens_ * hidden_};
    kernel_def(step == 0 ? ids().first : ids().more)
        .cpu(KernelArgs{ins, outs, block, DataType::kFloat32, &h, in_counts, out_counts});
  }
}

}  // namespace tutti::fused
