#include "runtime/executor.hpp"

#include <atomic>

#include "core/error.hpp"

namespace tutti {

std::shared_ptr<const PreparedPlan> PreparedPlan::make(plan::Plan p) {
  TUTTI_CHECK(p.fifo_depth >= 1, InvalidArgument,
              "plan '{}' was not verified (it states no FIFO depth): certify it (plan::certify) before running it",
              p.name);
  for (int r = 0; r < p.nranks; ++r)
    for (size_t b = 0; b < p.ranks[r].blocks.size(); ++b)
      TUTTI_CHECK(p.ranks[r].blocks[b].id == static_cast<int64_t>(b), InvalidArgument,
                  "plan '{}': rank {} block at position {} has id {}; block ids must be dense (plan::renumber_blocks)",
                  p.name, r, b, p.ranks[r].blocks[b].id);
  auto out = std::make_shared<PreparedPlan>();
  static std::atomic<uint64_t> next_id{1};
  out->id = next_id.fetch_add(1, std::memory_order_relaxed);
  out->spec = p.spec();
  out->plan = std::move(p);
  return out;
}

CallStamp call_stamp(const plan::Plan& p, const ExecArgs& args) {
  if (args.stamp != 0) return args.stamp;
  return make_stamp(p.collective, args.reduction.type, args.reduction.op, p.root, static_cast<uint64_t>(args.count));
}

void check_call(const PreparedPlan& pp, int nranks, const ExecArgs& args) {
  const plan::Plan& p = pp.plan;
  const int64_t count = args.count;
  TUTTI_CHECK(args.states.size() == p.states.size(), InvalidArgument,
              "plan '{}' names {} state buffer(s), the call passes {}", p.name, p.states.size(), args.states.size());
  for (size_t k = 0; k < p.states.size(); ++k)
    TUTTI_CHECK(args.states[k] != nullptr || p.states[k].chunks == 0, InvalidArgument,
                "plan '{}': state buffer {} ('{}') is null", p.name, k, p.states[k].name);
  TUTTI_CHECK(p.nranks == nranks, InvalidArgument, "plan '{}' is for {} ranks, the communicator has {}", p.name,
              p.nranks, nranks);
  TUTTI_CHECK(count >= 0, InvalidArgument, "negative count {}", count);
  TUTTI_CHECK(pp.plan.any_count || count % p.chunk_factor == 0, InvalidArgument,
              "plan '{}' moves chunks between different positions and needs the count ({}) to be a multiple of {}",
              p.name, count, p.chunk_factor);
}

}  // namespace tutti
