#include "runtime/device/device_plan.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "tutti/kernel.hpp"

namespace tutti::device {

DevicePlan flatten(const PreparedPlan& pp, int rank) {
  const plan::Plan& p = pp.plan;
  TUTTI_CHECK(p.states.empty(), InvalidArgument,
              "plan '{}' has state buffers ('{}', ...): the device interpreter runs input, output and scratch only "
              "(run it on host buffers)",
              p.name, p.states.empty() ? "" : p.states[0].name);
  TUTTI_CHECK(rank >= 0 && rank < p.nranks, InvalidArgument, "plan '{}': rank {} out of range ({} ranks)", p.name, rank,
              p.nranks);
  DevicePlan out;
  for (const plan::RankPlan& rp : p.ranks) {
    out.max_blocks = std::max(out.max_blocks, static_cast<int>(rp.blocks.size()));
    for (const plan::Block& b : rp.blocks)
      for (const plan::Instruction& in : b.steps) out.max_message_chunks = std::max(out.max_message_chunks, in.count());
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
    Location l = pp.spec.canonical(rank, r.buffer, static_cast<int>(r.index));
    return DevRef{l.index, static_cast<uint8_t>(l.buffer)};
  };
  for (const plan::Block& b : rp.blocks) {
    TUTTI_CHECK(out.steps.size() + b.steps.size() < (1u << 31), InvalidArgument, "plan '{}' has too many steps", p.name);
    out.blocks.push_back(DevBlock{static_cast<int32_t>(out.steps.size()), static_cast<int32_t>(b.steps.size())});
    for (const plan::Instruction& in : b.steps) {
      DevStep s;
      s.op = static_cast<uint8_t>(in.op);
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
        // The interpreter knows the built-ins; user kernels run on the CPU executor for now.
        TUTTI_CHECK(in.kernel == kernels::kIdentity || in.kernel == kernels::kScale, InvalidArgument,
                    "plan '{}': rank {} runs kernel '{}', which has no device implementation (the device "
                    "interpreter runs identity and scale)",
                    p.name, rank, kernel_def(in.kernel).name);
        TUTTI_CHECK(in.scalars.empty() || in.scalars[0].slot < 0, InvalidArgument,
                    "plan '{}': rank {} scales by a per-call scalar, which the device interpreter does not take yet",
                    p.name, rank);
        s.kernel = in.kernel;
        s.kernel_arg = in.scalars.empty() ? 1.0 : in.scalars[0].value;
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
