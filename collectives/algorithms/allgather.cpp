// AllGather algorithms: ring (with channels), recursive doubling, Bruck.
#include "collectives/algorithms/registry.hpp"

namespace tutti::algorithms {
namespace {

using dsl::Buffer;
using dsl::Program;

// Out-of-place: each rank first copies its input into its own slot of the output.
void own_slot(Program& p) {
  if (p.spec().inplace) return;
  const int C = p.spec().chunk_factor;
  for (int r = 0; r < p.nranks(); ++r) p.chunk(r, Buffer::input(), 0, C).copy(r, Buffer::output(), r * C);
}

Program ring_allgather(int n, const Params& prm) {
  const int channels = prm.at("channels");
  Program p("ring_allgather", spec_of(Collective::kAllGather, n, channels, prm.at("inplace")));
  own_slot(p);
  for (int ch = 0; ch < channels; ++ch) {
    dsl::Annotations a;
    a.channel = ch;
    for (int r = 0; r < n; ++r) {
      // The first hop reads the input, not the own slot, so it does not wait for the own copy.
      auto c = p.chunk(r, Buffer::input(), ch);
      for (int step = 1; step < n; ++step) c = c.copy((r + step) % n, Buffer::output(), r * channels + ch, a);
    }
  }
  return p;
}

// Recursive doubling among the largest power of two p2 <= n: at distance d each rank swaps all it
// has with rank ^ d. Ranks beyond p2 hand their piece to rank - p2 first and get everything back.
Program rd_allgather(int n, const Params& prm) {
  Program p("rd_allgather", spec_of(Collective::kAllGather, n, 1, prm.at("inplace")));
  own_slot(p);
  int p2 = 1;
  while (p2 * 2 <= n) p2 *= 2;
  const Buffer o = Buffer::output();
  for (int r = p2; r < n; ++r) p.chunk(r, o, r).copy(r - p2, o, r);
  // What rank r holds: ranks [base, base + size) and their folded partners.
  auto extra = [&](int q) { return q + p2 < n; };
  for (int d = 1; d < p2; d *= 2) {
    for (int r = 0; r < p2; ++r) {
      int partner = r ^ d;
      int base = r & ~(d - 1) & ~0, start = base - (base % d);
      (void)start;
      int from = r - (r % d);  // r's group before this step: [from, from + d)
      p.chunk(r, o, from, d).copy(partner, o, from);
      // Folded pieces of the group: ranks from+p2 .. min(from+d, n-p2)+p2, contiguous in the output.
      int ehi = std::min(from + d, n - p2);
      if (from < ehi && extra(from)) p.chunk(r, o, from + p2, ehi - from).copy(partner, o, from + p2);
      (void)base;
    }
  }
  for (int r = p2; r < n; ++r) p.chunk(r - p2, o, 0, n).copy(r, o, 0);
  return p;
}

// Bruck: at step k rank r sends what it has (pieces r .. r+m-1, m = min(2^k, n - 2^k), modulo n) to
// rank r - 2^k. Pieces land at their final output index, so no rotation is needed at the end.
Program bruck_allgather(int n, const Params& prm) {
  Program p("bruck_allgather", spec_of(Collective::kAllGather, n, 1, prm.at("inplace")));
  own_slot(p);
  const Buffer o = Buffer::output();
  for (int dist = 1; dist < n; dist *= 2) {
    int m = std::min(dist, n - dist);
    for (int r = 0; r < n; ++r) {
      int to = (r - dist + n) % n;
      int first = r, len = std::min(m, n - r);  // pieces r .. r+len-1, then the wrapped part 0..
      p.chunk(r, o, first, len).copy(to, o, first);
      if (len < m) p.chunk(r, o, 0, m - len).copy(to, o, 0);
    }
  }
  return p;
}

}  // namespace

void register_allgather(std::vector<Builtin>& out) {
  const Param inplace{"inplace", 0, "1: the input is the rank's slice of the output"};
  out.push_back({"ring_allgather", Collective::kAllGather, "ring, one per channel", {{"channels", 1, "parallel rings"}, inplace},
                 [](int, const Params& p) { return p.at("channels") >= 1 ? "" : std::string("channels must be >= 1"); },
                 ring_allgather});
  out.push_back({"rd_allgather", Collective::kAllGather, "recursive doubling; non-powers of two fold into partners",
                 {inplace}, nullptr, rd_allgather});
  out.push_back({"bruck_allgather", Collective::kAllGather, "Bruck: ceil(log2 n) steps for any n", {inplace}, nullptr,
                 bruck_allgather});
}

}  // namespace tutti::algorithms
