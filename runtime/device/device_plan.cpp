#include "runtime/device/device_plan.hpp"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "core/error.hpp"
#include "tutti/kernel.hpp"

namespace tutti::device {

namespace {

// What the device form of a kernel reads and writes, operand by operand: 'd' a data range of the
// call's unit with input 0's chunk count, 's' one element of a statistic (a state buffer of unit 1),
// 'h' as many 16-bit values as 'd' has floats (a state buffer whose unit is half a chunk, which
// the call's count must match: DevicePlan::half_unit, checked per call), 'r' a row (a state buffer
// chunk of its own unit, e.g. a bias, whose length the call's chunks must be a multiple of:
// DevicePlan::row_units, checked per call), 'a' any chunks whose length the kernel's constant
// scalars fix (DevicePlan::lengths, checked per call), 'u' one chunk of a state buffer of a unit of
// its own, whatever its length (a token or slot table, whose lengths the kernel reads).
// The CPU forms check their operands' lengths when called; the device forms cannot throw, so a plan
// that would hand one a wrong operand is refused here, by the kernel's and the operand's names.
struct Operands {
  const char* inputs;
  const char* outputs;
};
Operands operands_of(DeviceKernel k) {
  switch (k) {
    case DeviceKernel::kUnscaleSumsq: return {"d", "ds"};
    case DeviceKernel::kUnscaleSumsqAcc: return {"ds", "ds"};
    case DeviceKernel::kAdamw: return {"dddds", "ddd"};
    case DeviceKernel::kAdamwMasked: return {"ddddd", "ddd"};
    case DeviceKernel::kAdamwCast: return {"dddds", "dddh"};
    case DeviceKernel::kBiasDropoutResidual: return {"drd", "d"};
    case DeviceKernel::kBiasDropoutResidualLn: return {"drdrr", "dd"};
    case DeviceKernel::kGemm: return {"aa", "a"};
    case DeviceKernel::kMoeGather: return {"uu", "a"};
    case DeviceKernel::kMoeCombineFirst: return {"auu", "u"};
    case DeviceKernel::kMoeCombine: return {"auuu", "u"};
    default: return {"d", "d"};  // identity, scale
  }
}

void check_operands(const plan::Plan& p, int rank, const plan::Instruction& in, const KernelDef& def, DevicePlan& out) {
  int64_t& half_unit = out.half_unit;
  Operands want = operands_of(def.device);
  // Element-wise kernels: every operand a data range like input 0's.
  const std::string element_ins(static_cast<size_t>(def.inputs), 'd'), element_outs(static_cast<size_t>(def.outputs), 'd');
  if (def.device == DeviceKernel::kElementwise) want = {element_ins.c_str(), element_outs.c_str()};
  const std::vector<plan::Ref> outs = in.writes();
  const int64_t chunks = in.srcs.empty() ? 0 : in.srcs[0].count;
  // The lengths of 'a' operands, from the kernel's constant scalars (a GEMM: rows x k, k x n, rows x n).
  std::vector<int64_t> fixed;
  if (def.device == DeviceKernel::kGemm) {
    for (const ScalarArg& a : in.scalars)
      TUTTI_CHECK(a.slot < 0, InvalidArgument,
                  "plan '{}': rank {} runs kernel '{}' with a per-call shape; its device form takes the shape as "
                  "constants of the plan",
                  p.name, rank, def.name);
    TUTTI_CHECK(in.scalars.size() == 3, InvalidArgument, "plan '{}': rank {} runs kernel '{}' with {} scalars, not 3",
                p.name, rank, def.name, in.scalars.size());
    const auto rows = static_cast<int64_t>(in.scalars[0].value), k = static_cast<int64_t>(in.scalars[1].value),
               n = static_cast<int64_t>(in.scalars[2].value);
    fixed = {rows * k, k * n, rows * n};
  }
  const bool moe = def.device == DeviceKernel::kMoeGather || def.device == DeviceKernel::kMoeCombineFirst ||
                   def.device == DeviceKernel::kMoeCombine;
  if (moe) {
    // The tables: a token table of whole rows of `hidden`; index and gate tables of one length, the
    // slots, which fix the block's length (slots x hidden).
    TUTTI_CHECK(in.scalars.size() == 1 && in.scalars[0].slot < 0 && in.scalars[0].value >= 1, InvalidArgument,
                "plan '{}': rank {} runs kernel '{}' without a constant row length; its device form takes one",
                p.name, rank, def.name);
    const auto hidden = static_cast<int64_t>(in.scalars[0].value);
    const bool gather = def.device == DeviceKernel::kMoeGather;
    auto unit_of = [&](const plan::Ref& r) { return p.unit(r.buffer); };
    const size_t want_srcs = gather ? 2 : def.device == DeviceKernel::kMoeCombine ? 4 : 3;
    TUTTI_CHECK(in.srcs.size() == want_srcs && outs.size() == 1, InvalidArgument,
                "plan '{}': rank {} runs kernel '{}' with {} inputs and {} outputs; its device form takes {} and 1",
                p.name, rank, def.name, in.srcs.size(), outs.size(), want_srcs);
    const int64_t tokens_unit = gather ? unit_of(in.srcs[0]) : unit_of(outs[0]);
    const int64_t slots = gather ? unit_of(in.srcs[1]) : unit_of(in.srcs[1]);
    TUTTI_CHECK(tokens_unit > 0 && tokens_unit % hidden == 0 && slots > 0 &&
                    (gather || (unit_of(in.srcs[2]) == slots &&
                                (want_srcs == 3 || unit_of(in.srcs[3]) == tokens_unit))),
                InvalidArgument,
                "plan '{}': rank {} runs kernel '{}' on tables its device form cannot read: tokens of {} elements in "
                "rows of {}, {} slots",
                p.name, rank, def.name, tokens_unit, hidden, slots);
    fixed = gather ? std::vector<int64_t>{0, 0, slots * hidden} : std::vector<int64_t>{slots * hidden, 0, 0, 0, 0};
  }
  int operand = 0;
  auto check = [&](const std::vector<plan::Ref>& refs, const char* kinds, const char* what) {
    TUTTI_CHECK(refs.size() == std::strlen(kinds), InvalidArgument,
                "plan '{}': rank {} runs kernel '{}' with {} {}s; its device form takes {}", p.name, rank, def.name,
                refs.size(), what, std::strlen(kinds));
    for (size_t i = 0; i < refs.size(); ++i, ++operand) {
      const int64_t unit = p.unit(refs[i].buffer);
      if (kinds[i] == 'a') {
        out.lengths.push_back({def.name, operand, unit, refs[i].count, fixed.at(static_cast<size_t>(operand))});
        continue;
      }
      const bool ok = kinds[i] == 'u'   ? unit > 0 && refs[i].count == 1
                      : kinds[i] == 'd' ? unit == 0 && refs[i].count == chunks
                      : kinds[i] == 'h' ? unit > 0 && refs[i].count == chunks
                      : kinds[i] == 'r' ? unit > 0 && refs[i].count == 1
                                        : unit == 1 && refs[i].count == 1;
      if (kinds[i] == 'r' && ok && std::find(out.row_units.begin(), out.row_units.end(), unit) == out.row_units.end())
        out.row_units.push_back(unit);
      if (kinds[i] == 'h' && ok) {
        TUTTI_CHECK(half_unit == 0 || half_unit == unit, InvalidArgument,
                    "plan '{}': rank {} runs kernel '{}' with 16-bit outputs of units {} and {}", p.name, rank, def.name,
                    half_unit, unit);
        half_unit = unit;
      }
      TUTTI_CHECK(ok, InvalidArgument,
                  "plan '{}': rank {} runs kernel '{}' with {} {} in a buffer of unit {} ({} chunk(s)); its device form "
                  "takes {} there",
                  p.name, rank, def.name, what, i, unit, refs[i].count,
                  kinds[i] == 'd'   ? fmt::format("{} chunk(s) of the call's size", chunks)
                  : kinds[i] == 'h' ? fmt::format("{} chunk(s) of 16-bit values (a unit of half a chunk)", chunks)
                  : kinds[i] == 'r' ? std::string("one chunk of a row (a state buffer of a unit of its own)")
                  : kinds[i] == 'u' ? std::string("one chunk of a table (a state buffer of a unit of its own)")
                                    : std::string("one element of a statistic (unit 1)"));
    }
  };
  check(in.srcs, want.inputs, "input");
  check(outs, want.outputs, "output");
}

}  // namespace

DevicePlan flatten(const PreparedPlan& pp, int rank) {
  const plan::Plan& p = pp.plan;
  TUTTI_CHECK(static_cast<int>(p.states.size()) <= kMaxStates, InvalidArgument,
              "plan '{}' has {} state buffers; a device launch carries at most {}", p.name, p.states.size(), kMaxStates);
  TUTTI_CHECK(rank >= 0 && rank < p.nranks, InvalidArgument, "plan '{}': rank {} out of range ({} ranks)", p.name, rank,
              p.nranks);
  DevicePlan out;
  out.one_pass = !p.states.empty();
  out.nstates = static_cast<int>(p.states.size());
  for (const plan::RankPlan& rp : p.ranks) {
    out.max_blocks = std::max(out.max_blocks, static_cast<int>(rp.blocks.size()));
    for (const plan::Block& b : rp.blocks)
      for (const plan::Instruction& in : b.steps) {
        const plan::Ref* moved = plan::sends(in.op) && !in.srcs.empty() ? &in.srcs[0] : in.dst ? &*in.dst : nullptr;
        const int64_t unit = moved ? p.unit(moved->buffer) : 0;
        if (unit > 0 && (plan::sends(in.op) || plan::receives(in.op))) {
          out.max_unit_message_chunks = std::max(out.max_unit_message_chunks, in.count());
          out.max_unit = std::max(out.max_unit, unit);
        } else {
          out.max_message_chunks = std::max(out.max_message_chunks, in.count());
        }
      }
  }
  out.channels = std::max(1, p.channels());
  const plan::RankPlan& rp = p.ranks[rank];
  out.scratch_chunks = rp.scratch_chunks;
  auto conn = [](std::vector<ConnectionKey>& table, ConnectionKey key) {
    auto it = std::find(table.begin(), table.end(), key);
    if (it != table.end()) return static_cast<int32_t>(it - table.begin());
    table.push_back(key);
    return static_cast<int32_t>(table.size() - 1);
  };
  auto ref = [&](const plan::Ref& r) {
    if (is_state(r.buffer)) return DevRef{r.index, static_cast<uint8_t>(kBufState + state_index(r.buffer))};
    Location l = pp.spec.canonical(rank, r.buffer, static_cast<int>(r.index));
    return DevRef{l.index, static_cast<uint8_t>(l.buffer)};
  };
  for (const plan::Block& b : rp.blocks) {
    TUTTI_CHECK(out.steps.size() + b.steps.size() < (1u << 31), InvalidArgument, "plan '{}' has too many steps", p.name);
    out.blocks.push_back(DevBlock{static_cast<int32_t>(out.steps.size()), static_cast<int32_t>(b.steps.size())});
    for (const plan::Instruction& in : b.steps) {
      DevStep s;
      s.op = in.op;
      s.count = in.count();
      s.first_src = static_cast<int32_t>(out.srcs.size());
      s.nsrcs = static_cast<uint16_t>(in.srcs.size());
      for (const plan::Ref& r : in.srcs) out.srcs.push_back(ref(r));
      if (in.dst) s.dst = ref(*in.dst);
      if (plan::sends(in.op)) s.send_conn = conn(out.sends, {in.send_peer, b.channel});
      if (plan::receives(in.op)) s.recv_conn = conn(out.recvs, {in.recv_peer, b.channel});
      s.first_dep = static_cast<int32_t>(out.deps.size());
      s.ndeps = static_cast<int32_t>(in.deps.size());
      for (const plan::Dep& d : in.deps) {
        TUTTI_CHECK(d.block >= 0 && d.block < static_cast<int64_t>(rp.blocks.size()), InvalidArgument,
                    "plan '{}': rank {} depends on block {}, which it does not have", p.name, rank, d.block);
        out.deps.push_back(DevDep{static_cast<int32_t>(d.block), static_cast<int32_t>(d.step)});
      }
      s.stable_src = in.stable_source ? 1 : 0;
      if (in.op == plan::Opcode::kCompute) {
        const KernelDef& def = kernel_def(in.kernel);
        TUTTI_CHECK(def.device != DeviceKernel::kNone, InvalidArgument,
                    "plan '{}': rank {} runs kernel '{}', which has no device form (tutti/kernel.hpp, DeviceKernel): "
                    "run the plan on host buffers",
                    p.name, rank, def.name);
        check_operands(p, rank, in, def, out);
        s.offset_index = in.srcs[0].index;
        s.offset_unit = p.unit(in.srcs[0].buffer);
        s.kernel = static_cast<int32_t>(def.device);
        if (s.kernel >= static_cast<int32_t>(DeviceKernel::kUnscaleSumsq)) out.float_kernels = true;
        s.kernel_arg = in.scalars.empty() || in.scalars[0].slot >= 0 ? 1.0 : in.scalars[0].value;
        s.first_scalar = static_cast<int32_t>(out.scalars.size());
        s.nscalars = static_cast<int32_t>(in.scalars.size());
        for (const ScalarArg& a : in.scalars) {
          TUTTI_CHECK(a.slot < kMaxScalars, InvalidArgument,
                      "plan '{}': kernel '{}' takes per-call scalar {}; a device launch carries {}", p.name, def.name,
                      a.slot, kMaxScalars);
          out.scalars.push_back(DevScalar{a.value, a.slot});
          out.scalar_slots = std::max(out.scalar_slots, a.slot + 1);
        }
        if (def.device == DeviceKernel::kElementwise) {
          const std::vector<element::ElementCode> code = compile_elements(def);
          s.first_code = static_cast<int32_t>(out.code.size());
          s.ncode = static_cast<int32_t>(code.size());
          out.code.insert(out.code.end(), code.begin(), code.end());
        }
        s.nouts = static_cast<uint16_t>(in.more_dsts.size());
        for (const plan::Ref& r : in.more_dsts) out.srcs.push_back(ref(r));
      }
      out.steps.push_back(s);
    }
  }
  // Mark what other blocks wait for.
  for (const DevDep& d : out.deps) {
    TUTTI_CHECK(d.step >= 0 && d.step < out.blocks[d.block].nsteps, InvalidArgument,
                "plan '{}': rank {} depends on step {} of a block with {} steps", p.name, rank, d.step,
                out.blocks[d.block].nsteps);
    out.steps[out.blocks[d.block].first_step + d.step].signal = 1;
  }
  return out;
}

}  // namespace tutti::device
