// Rooted collectives: pipelined chain Broadcast, binomial-tree Broadcast, binomial-tree Reduce,
// direct Gather and Scatter.
#include "collectives/algorithms/registry.hpp"

namespace tutti::algorithms {
namespace {

using dsl::Buffer;
using dsl::Program;

// The root's data flows root -> root+1 -> ... in `chunks` pieces, so every link is busy at once.
Program chain_broadcast(int n, const Params& prm) {
  const int k = prm.at("chunks"), root = prm.at("root");
  Program p("chain_broadcast", spec_of(Collective::kBroadcast, n, k, prm.at("inplace"), root));
  const Buffer w = work_buffer(p);
  if (!p.spec().inplace) p.chunk(root, Buffer::input(), 0, k).copy(root, Buffer::output(), 0);
  for (int i = 0; i < k; ++i) {
    auto c = p.chunk(root, w, i);
    for (int step = 1; step < n; ++step) c = c.copy((root + step) % n, w, i);
  }
  return p;
}

// Binomial tree: in round j, ranks (relative to the root) below 2^j send to rank + 2^j.
Program tree_broadcast(int n, const Params& prm) {
  const int root = prm.at("root"), C = prm.at("chunks");
  Program p("tree_broadcast", spec_of(Collective::kBroadcast, n, C, prm.at("inplace"), root));
  const Buffer w = work_buffer(p);
  if (!p.spec().inplace) p.chunk(root, Buffer::input(), 0, C).copy(root, Buffer::output(), 0);
  for (int d = 1; d < n; d *= 2)
    for (int rel = 0; rel < d && rel + d < n; ++rel)
      p.chunk((root + rel) % n, w, 0, C).copy((root + rel + d) % n, w, 0);
  return p;
}

// Binomial tree towards the root: in round j, relative ranks that are odd multiples of 2^j send
// their partial sum to rank - 2^j. Non-roots accumulate in their output, which Reduce leaves unspecified.
Program tree_reduce(int n, const Params& prm) {
  const int root = prm.at("root"), C = prm.at("chunks");
  Program p("tree_reduce", spec_of(Collective::kReduce, n, C, prm.at("inplace"), root));
  copy_input_to_output(p);
  const Buffer w = work_buffer(p);
  for (int d = 1; d < n; d *= 2)
    for (int rel = d; rel < n; rel += 2 * d)
      p.chunk((root + rel - d) % n, w, 0, C).reduce(p.chunk((root + rel) % n, w, 0, C));
  return p;
}

// Every rank sends its part straight to the root (NCCL's gather is the same n - 1 sends and
// receives: the root's link carries every byte once whatever the schedule).
Program direct_gather(int n, const Params& prm) {
  const int root = prm.at("root"), C = prm.at("chunks");
  Program p("direct_gather", spec_of(Collective::kGather, n, C, prm.at("inplace"), root));
  for (int r = 0; r < n; ++r)
    if (r != root || !p.spec().inplace) p.chunk(r, Buffer::input(), 0, C).copy(root, Buffer::output(), r * C);
  return p;
}

// The root sends each rank its part.
Program direct_scatter(int n, const Params& prm) {
  const int root = prm.at("root"), C = prm.at("chunks");
  Program p("direct_scatter", spec_of(Collective::kScatter, n, C, prm.at("inplace"), root));
  for (int r = 0; r < n; ++r)
    if (r != root || !p.spec().inplace) p.chunk(root, Buffer::input(), r * C, C).copy(r, Buffer::output(), 0);
  return p;
}

std::string root_ok(int n, const Params& p) {
  if (p.at("root") < 0 || p.at("root") >= n) return "root must be a rank";
  if (p.at("chunks") < 1) return "chunks must be >= 1";
  return {};
}

}  // namespace

void register_rooted(std::vector<Builtin>& out) {
  const Param inplace{"inplace", 0, "1: one buffer serves as input and output"};
  const Param root{"root", 0, "the root rank"};
  out.push_back({"chain_broadcast", Collective::kBroadcast, "pipelined chain from the root",
                 {root, {"chunks", 4, "pipeline pieces"}, inplace}, root_ok, chain_broadcast});
  out.push_back({"tree_broadcast", Collective::kBroadcast, "binomial tree from the root",
                 {root, {"chunks", 1, "chunks per buffer"}, inplace}, root_ok, tree_broadcast});
  out.push_back({"tree_reduce", Collective::kReduce, "binomial tree towards the root",
                 {root, {"chunks", 1, "chunks per buffer"}, inplace}, root_ok, tree_reduce});
  out.push_back({"direct_gather", Collective::kGather, "every rank sends its part to the root",
                 {root, {"chunks", 1, "chunks per part"}, inplace}, root_ok, direct_gather});
  out.push_back({"direct_scatter", Collective::kScatter, "the root sends every rank its part",
                 {root, {"chunks", 1, "chunks per part"}, inplace}, root_ok, direct_scatter});
}

}  // namespace tutti::algorithms
