// AllReduce algorithms: ring (with channels), recursive halving-doubling, all-pairs (one shot),
// double binary tree, and two-level hierarchical.
#include <fmt/format.h>

#include "collectives/algorithms/registry.hpp"

namespace tutti::algorithms {
namespace {

using dsl::Buffer;
using dsl::Program;

// Ring: chunk k of channel ch is reduced along the ring starting at rank k, ending at rank k-1,
// then copied around the ring. Each channel carries its own n chunks on its own connections.
Program ring_allreduce(int n, const Params& prm) {
  const int channels = prm.at("channels");
  Program p("ring_allreduce", spec_of(Collective::kAllReduce, n, n * channels, prm.at("inplace")));
  copy_input_to_output(p);
  const Buffer w = work_buffer(p);
  for (int ch = 0; ch < channels; ++ch) {
    dsl::Annotations a;
    a.channel = ch;
    for (int k = 0; k < n; ++k) {
      int index = ch * n + k;
      auto c = p.chunk(k, w, index);
      for (int step = 1; step < n; ++step) c = p.chunk((k + step) % n, w, index).reduce(c, a);
      for (int step = 0; step < n - 1; ++step) c = c.copy((k + step) % n, w, index, a);
    }
  }
  return p;
}

// Recursive halving (reduce-scatter) then recursive doubling (all-gather) among the largest power of
// two p2 <= n; the other n - p2 ranks first fold their data into a partner and get the result back.
Program rhd_allreduce(int n, const Params& prm) {
  int p2 = 1;
  while (p2 * 2 <= n) p2 *= 2;
  Program p("rhd_allreduce", spec_of(Collective::kAllReduce, n, p2, prm.at("inplace")));
  copy_input_to_output(p);
  const Buffer w = work_buffer(p);
  for (int r = p2; r < n; ++r) p.chunk(r - p2, w, 0, p2).reduce(p.chunk(r, w, 0, p2));
  std::vector<int> lo(p2, 0), hi(p2, p2);
  for (int d = p2 / 2; d >= 1; d /= 2) {
    for (int r = 0; r < p2; ++r) {
      int partner = r ^ d;
      if (r > partner) continue;
      int mid = (lo[r] + hi[r]) / 2;
      // r keeps [lo, mid) and reduces the partner's copy of it; the partner keeps [mid, hi).
      p.chunk(r, w, lo[r], mid - lo[r]).reduce(p.chunk(partner, w, lo[r], mid - lo[r]));
      p.chunk(partner, w, mid, hi[r] - mid).reduce(p.chunk(r, w, mid, hi[r] - mid));
      hi[r] = mid;
      lo[partner] = mid;
    }
  }
  for (int d = 1; d < p2; d *= 2) {
    for (int r = 0; r < p2; ++r) {
      int partner = r ^ d;
      if (r > partner) continue;
      p.chunk(r, w, lo[r], hi[r] - lo[r]).copy(partner, w, lo[r]);
      p.chunk(partner, w, lo[partner], hi[partner] - lo[partner]).copy(r, w, lo[partner]);
      int nlo = std::min(lo[r], lo[partner]), nhi = std::max(hi[r], hi[partner]);
      lo[r] = lo[partner] = nlo;
      hi[r] = hi[partner] = nhi;
    }
  }
  for (int r = p2; r < n; ++r) p.chunk(r - p2, w, 0, p2).copy(r, w, 0);
  return p;
}

// One shot: every rank sends its whole buffer to every other rank's scratch and reduces all n
// contributions itself. Fewest steps; n - 1 times the data on the wire.
Program allpairs_allreduce(int n, const Params& prm) {
  const int C = prm.at("chunks");
  Program p("allpairs_allreduce", spec_of(Collective::kAllReduce, n, C, prm.at("inplace")));
  const Buffer w = work_buffer(p);
  if (n == 2 && !prm.at("inplace")) {
    // Two ranks, out of place: a + b and b + a are the same bits, so each rank reduces the peer's
    // input straight out of the transport into its output (operand: its own input, once the
    // compiler forwards the copy): one message each way, no scratch, two instructions per rank.
    copy_input_to_output(p);
    for (int r = 0; r < 2; ++r) p.chunk(r, w, 0, C).reduce(p.chunk(1 - r, Buffer::input(), 0, C));
    return p;
  }
  for (int r = 0; r < n; ++r)
    for (int q = 0; q < n; ++q)
      if (q != r) p.chunk(q, Buffer::input(), 0, C).copy(r, Buffer::scratch("gathered"), (q < r ? q : q - 1) * C);
  copy_input_to_output(p);
  for (int r = 0; r < n; ++r)
    for (int q = 0; q + 1 < n; ++q) p.chunk(r, w, 0, C).reduce(p.chunk(r, Buffer::scratch("gathered"), q * C, C));
  return p;
}

// Double binary tree: two binary trees in heap order, the second over ranks shifted by one so most
// ranks are leaves in one tree and inner nodes in the other; each tree reduces then broadcasts half
// of the chunks, pipelined over `chunks` pieces.
Program tree_allreduce(int n, const Params& prm) {
  const int k = prm.at("chunks");
  Program p("tree_allreduce", spec_of(Collective::kAllReduce, n, 2 * k, prm.at("inplace")));
  copy_input_to_output(p);
  const Buffer w = work_buffer(p);
  for (int piece = 0; piece < k; ++piece)
    for (int tree = 0; tree < 2; ++tree) {
      int index = piece * 2 + tree;
      auto rank_of = [&](int node) { return (node + tree) % n; };
      dsl::Annotations a;
      a.channel = tree;
      for (int node = n - 1; node >= 1; --node)
        p.chunk(rank_of((node - 1) / 2), w, index).reduce(p.chunk(rank_of(node), w, index), a);
      for (int node = 1; node < n; ++node) p.chunk(rank_of((node - 1) / 2), w, index).copy(rank_of(node), w, index, a);
    }
  return p;
}

// Two levels: `local` ranks per node. Within a node, local rank j gathers and reduces chunk j;
// across nodes, ranks with the same local index reduce chunk j around a ring and copy it back;
// within the node again, each rank sends its chunk to the others.
Program hier_allreduce(int n, const Params& prm) {
  const int L = prm.at("local");
  const int N = n / L;
  Program p("hier_allreduce", spec_of(Collective::kAllReduce, n, L, prm.at("inplace")));
  copy_input_to_output(p);
  const Buffer w = work_buffer(p);
  auto rank = [&](int node, int j) { return node * L + j; };
  for (int node = 0; node < N; ++node)
    for (int j = 0; j < L; ++j)
      for (int i = 0; i < L; ++i)
        if (i != j) p.chunk(rank(node, j), w, j).reduce(p.chunk(rank(node, i), w, j));
  for (int j = 0; j < L; ++j) {
    dsl::Annotations a;
    a.channel = 1;  // the inter-node ring has its own connections
    auto c = p.chunk(rank(0, j), w, j);
    for (int node = 1; node < N; ++node) c = p.chunk(rank(node, j), w, j).reduce(c, a);
    for (int node = 0; node < N - 1; ++node) c = c.copy(rank(node, j), w, j, a);
  }
  for (int node = 0; node < N; ++node)
    for (int j = 0; j < L; ++j)
      for (int i = 0; i < L; ++i)
        if (i != j) p.chunk(rank(node, j), w, j).copy(rank(node, i), w, j);
  return p;
}

}  // namespace

void register_allreduce(std::vector<Builtin>& out) {
  const Param inplace{"inplace", 1, "1: result overwrites the input; 0: separate output buffer"};
  out.push_back({"ring_allreduce", Collective::kAllReduce, "ring reduce-scatter + ring all-gather, one ring per channel",
                 {{"channels", 1, "parallel rings"}, inplace},
                 [](int, const Params& p) { return p.at("channels") >= 1 ? "" : std::string("channels must be >= 1"); },
                 ring_allreduce});
  out.push_back({"rhd_allreduce", Collective::kAllReduce,
                 "recursive halving + recursive doubling (Rabenseifner); non-powers of two fold into partners",
                 {inplace}, nullptr, rhd_allreduce});
  out.push_back({"allpairs_allreduce", Collective::kAllReduce, "one shot: gather everything everywhere, reduce locally",
                 {{"chunks", 1, "chunks per buffer"}, inplace},
                 [](int, const Params& p) { return p.at("chunks") >= 1 ? "" : std::string("chunks must be >= 1"); },
                 allpairs_allreduce});
  out.push_back({"tree_allreduce", Collective::kAllReduce, "double binary tree, pipelined",
                 {{"chunks", 1, "pipeline pieces per tree"}, inplace},
                 [](int, const Params& p) { return p.at("chunks") >= 1 ? "" : std::string("chunks must be >= 1"); },
                 tree_allreduce});
  out.push_back({"hier_allreduce", Collective::kAllReduce,
                 "two levels: reduce within nodes, ring across nodes, gather within nodes",
                 {{"local", 1, "ranks per node (must divide the rank count)"}, inplace},
                 [](int n, const Params& p) { return needs_divisor(n, p.at("local"), "local"); }, hier_allreduce});
}

}  // namespace tutti::algorithms
