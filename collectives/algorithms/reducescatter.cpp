// ReduceScatter: ring. The input is never written (NCCL's sendbuff is const); partial sums travel
// through scratch and the last hop reduces into the output.
#include "collectives/algorithms/registry.hpp"

namespace tutti::algorithms {
namespace {

using dsl::Buffer;
using dsl::Program;

Program ring_reducescatter(int n, const Params& prm) {
  const int channels = prm.at("channels");
  const int C = channels;
  Program p("ring_reducescatter", spec_of(Collective::kReduceScatter, n, C, prm.at("inplace")));
  for (int ch = 0; ch < channels; ++ch) {
    dsl::Annotations a;
    a.channel = ch;
    for (int d = 0; d < n; ++d) {
      int index = d * C + ch;  // destined for rank d
      // Start one past d, go around, end at d.
      auto c = p.chunk((d + 1) % n, Buffer::input(), index);
      for (int step = 2; step <= n; ++step) {
        int q = (d + step) % n;
        auto mine = q == d ? p.chunk(q, Buffer::input(), index).copy(q, Buffer::output(), ch, a)
                           : p.chunk(q, Buffer::input(), index).copy(q, Buffer::scratch("partial"), index, a);
        c = mine.reduce(c, a);
      }
      if (n == 1) c.copy(d, Buffer::output(), ch, a);
    }
  }
  return p;
}

}  // namespace

void register_reducescatter(std::vector<Builtin>& out) {
  out.push_back({"ring_reducescatter", Collective::kReduceScatter, "ring, one per channel",
                 {{"channels", 1, "parallel rings"}, {"inplace", 0, "1: the output is the rank's slice of the input"}},
                 [](int, const Params& p) { return p.at("channels") >= 1 ? "" : std::string("channels must be >= 1"); },
                 ring_reducescatter});
}

}  // namespace tutti::algorithms
