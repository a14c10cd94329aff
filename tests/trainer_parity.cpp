// The trainer's parity check with ranks as processes: run under tutti-run with a layout's flags,
// every rank trains the tiny GPT; the ranks' parameter parts are summed into the whole model; rank 0
// trains the one-rank reference in-process and compares (tests/support/trainer_run.hpp).
//   tutti-run -n 4 trainer-parity --tp 2 --dp 2 [--sp] [--zero N] [--cuda]
//   tutti-run -n 4 trainer-parity --pp 4 --schedule zb-h1 --microbatches 4 [--vp 2] [--layers 4]
//   tutti-run -n 4 trainer-parity --dp 4 --ep 2 --experts 4 --top-k 2 [--capacity 1] --moe-group 2
#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "support/trainer_run.hpp"

using namespace tutti;
using namespace tutti::train;

namespace {
// The reference: the same model on one CPU rank.
test_support::RunOptions one_rank(test_support::RunOptions o) {
  o.cuda = false;
  return o;
}
}  // namespace

int main(int argc, char** argv) {
  Layout layout;
  bool cuda = false;  // every rank's kernels on GPU 0 (the reference stays on the CPU)
  int layers = 2, experts = 0, top_k = 1, moe_group = 0;
  float capacity = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&] {
      if (i + 1 >= argc) {
        fmt::print(stderr, "{} needs a value\n", a);
        std::exit(2);
      }
      return std::atoi(argv[++i]);
    };
    if (a == "--tp") layout.tp = value();
    else if (a == "--dp") layout.dp = value();
    else if (a == "--zero") layout.zero = value();
    else if (a == "--sp") layout.sp = true;
    else if (a == "--pp") layout.pp = value();
    else if (a == "--vp") layout.vp = value();
    else if (a == "--microbatches") layout.microbatches = value();
    else if (a == "--layers") layers = value();
    else if (a == "--ep") layout.ep = value();
    else if (a == "--experts") experts = value();
    else if (a == "--top-k") top_k = value();
    else if (a == "--moe-group") moe_group = value();
    else if (a == "--capacity" && i + 1 < argc) capacity = std::strtof(argv[++i], nullptr);
    else if (a == "--schedule" && i + 1 < argc) layout.schedule = parse_schedule(argv[++i]);
    else if (a == "--cuda") cuda = true;
    else {
      fmt::print(stderr, "unknown argument {}\n", a);
      return 2;
    }
  }
  try {
    Comm world = Comm::from_env();
    test_support::RunOptions options;
    options.cuda = cuda;
    options.layers = layers;
    options.experts = experts;
    options.top_k = top_k;
    options.moe_group = moe_group;
    options.capacity = capacity;
    test_support::RunResult mine = test_support::train_rank(&world, layout, options);
    for (auto& [name, w] : mine.params)
      world.all_reduce(w.data(), w.data(), w.size(), DataType::kFloat32, RedOp::kSum).wait();
    if (world.rank() != 0) return 0;
    const test_support::RunResult one = test_support::train_rank(nullptr, test_support::make_layout(1, 1), one_rank(options));
    const std::string diff = test_support::compare_training(mine, one);
    if (!diff.empty()) {
      fmt::print(stderr, "{} as {} processes differs from one rank: {}\n", layout.describe(), world.size(), diff);
      return 1;
    }
    fmt::print("{} as {} processes trains like one rank: losses {:.6f} -> {:.6f}\n", layout.describe(), world.size(),
               mine.losses.front(), mine.losses.back());
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "trainer-parity: {}\n", e.what());
    return 1;
  }
}
