// AllToAll: pairwise exchange, and the two-step hierarchical exchange for `local` ranks per node.
#include "collectives/algorithms/registry.hpp"

namespace tutti::algorithms {
namespace {

using dsl::Buffer;
using dsl::Program;

// Step k: send the block for rank r+k, receive the block from rank r-k. Every pair talks once.
Program pairwise_alltoall(int n, const Params& prm) {
  const int C = prm.at("chunks");
  Program p("pairwise_alltoall", spec_of(Collective::kAllToAll, n, C, false));
  for (int r = 0; r < n; ++r) p.chunk(r, Buffer::input(), r * C, C).copy(r, Buffer::output(), r * C);
  for (int k = 1; k < n; ++k)
    for (int r = 0; r < n; ++r) {
      int to = (r + k) % n;
      p.chunk(r, Buffer::input(), to * C, C).copy(to, Buffer::output(), r * C);
    }
  return p;
}

// Rank (a, i) = a*L + i. Step 1, inside node a: (a, i) hands every block meant for (b, j) to (a, j),
// which stages it in scratch at (b*L + i)*C. Step 2, across nodes: (a, j) sends the L blocks meant
// for (b, j) as one message, landing at output (a*L)*C .. (a*L + L)*C of (b, j). L times fewer
// inter-node messages than pairwise, each L times larger.
Program hier_alltoall(int n, const Params& prm) {
  const int C = prm.at("chunks"), L = prm.at("local"), N = n / L;
  Program p("hier_alltoall", spec_of(Collective::kAllToAll, n, C, false));
  auto rank = [&](int node, int j) { return node * L + j; };
  const Buffer staged = Buffer::scratch("staged");
  for (int a = 0; a < N; ++a)
    for (int i = 0; i < L; ++i)
      for (int j = 0; j < L; ++j)
        for (int b = 0; b < N; ++b)
          p.chunk(rank(a, i), Buffer::input(), rank(b, j) * C, C).copy(rank(a, j), staged, (b * L + i) * C);
  dsl::Annotations across;
  across.channel = 1;
  for (int a = 0; a < N; ++a)
    for (int j = 0; j < L; ++j)
      for (int b = 0; b < N; ++b)
        p.chunk(rank(a, j), staged, b * L * C, L * C).copy(rank(b, j), Buffer::output(), a * L * C, across);
  return p;
}

}  // namespace

void register_alltoall(std::vector<Builtin>& out) {
  const Param chunks{"chunks", 1, "chunks per destination"};
  out.push_back({"pairwise_alltoall", Collective::kAllToAll, "n - 1 pairwise exchange steps", {chunks},
                 [](int, const Params& p) { return p.at("chunks") >= 1 ? "" : std::string("chunks must be >= 1"); },
                 pairwise_alltoall});
  out.push_back({"hier_alltoall", Collective::kAllToAll, "two steps: gather by destination within the node, then across",
                 {chunks, {"local", 1, "ranks per node (must divide the rank count)"}},
                 [](int n, const Params& p) {
                   if (p.at("chunks") < 1) return std::string("chunks must be >= 1");
                   return needs_divisor(n, p.at("local"), "local");
                 },
                 hier_alltoall});
}

}  // namespace tutti::algorithms
