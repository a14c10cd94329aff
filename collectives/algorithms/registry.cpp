#include "collectives/algorithms/registry.hpp"

#include <fmt/format.h>

#include "core/error.hpp"

namespace tutti::algorithms {

const std::vector<Builtin>& builtins() {
  static const std::vector<Builtin> all = [] {
    std::vector<Builtin> v;
    register_allreduce(v);
    register_allgather(v);
    register_reducescatter(v);
    register_rooted(v);
    register_alltoall(v);
    return v;
  }();
  return all;
}

const Builtin& find_builtin(const std::string& name) {
  std::string names;
  for (const Builtin& b : builtins()) {
    if (b.name == name) return b;
    names += (names.empty() ? "" : ", ") + b.name;
  }
  throw InvalidArgument(fmt::format("no built-in algorithm '{}' (there are: {})", name, names));
}

Params resolve(const Builtin& b, int nranks, const Params& given) {
  TUTTI_CHECK(nranks >= 1, InvalidArgument, "{}: {} ranks", b.name, nranks);
  Params p;
  for (const Param& d : b.params) p[d.name] = d.fallback;
  for (auto& [k, v] : given) {
    TUTTI_CHECK(p.count(k), InvalidArgument, "{} has no parameter '{}'", b.name, k);
    p[k] = v;
  }
  std::string why = b.supports ? b.supports(nranks, p) : std::string();
  TUTTI_CHECK(why.empty(), InvalidArgument, "{} does not support {} ranks with these parameters: {}", b.name, nranks, why);
  return p;
}

dsl::Program build(const std::string& name, int nranks, const Params& given) {
  const Builtin& b = find_builtin(name);
  return b.build(nranks, resolve(b, nranks, given));
}

Params parse_params(const std::vector<std::string>& kvs) {
  Params out;
  for (const auto& kv : kvs) {
    auto eq = kv.find('=');
    TUTTI_CHECK(eq != std::string::npos, InvalidArgument, "parameter '{}' is not k=v", kv);
    try {
      size_t used = 0;
      std::string value = kv.substr(eq + 1);
      int v = std::stoi(value, &used);
      if (used == value.size()) {
        out[kv.substr(0, eq)] = v;
        continue;
      }
    } catch (const std::exception&) {
    }
    throw InvalidArgument(fmt::format("parameter '{}': the value is not an integer", kv));
  }
  return out;
}

CollectiveSpec spec_of(Collective c, int nranks, int chunk_factor, bool inplace, int root) {
  return CollectiveSpec::of(c, nranks, chunk_factor, inplace, root);
}

dsl::Buffer work_buffer(const dsl::Program& p) {
  return p.spec().inplace ? dsl::Buffer::input() : dsl::Buffer::output();
}

void copy_input_to_output(dsl::Program& p) {
  if (p.spec().inplace) return;
  // One copy per chunk, so the compiler can forward each into its first use and drop it.
  int n = std::min(p.spec().input_chunks(), p.spec().output_chunks());
  for (int r = 0; r < p.nranks(); ++r)
    for (int i = 0; i < n; ++i) p.chunk(r, dsl::Buffer::input(), i).copy(r, dsl::Buffer::output(), i);
}

std::string needs_divisor(int nranks, int local, const char* param) {
  if (local < 1 || nranks % local != 0) return fmt::format("{}={} must divide the rank count {}", param, local, nranks);
  return {};
}

std::string default_algorithm(Collective c, uint64_t bytes, int n, bool crowded) {
  switch (c) {
    case Collective::kAllReduce:
      // One shot while latency dominates (one message each way per peer), then halving-doubling,
      // then the ring, whose every byte crosses each link once.
      return bytes <= (32u << 10) && n <= 16 ? "allpairs_allreduce"
             : bytes > (512u << 10) || n <= 2 ? "ring_allreduce"
                                              : "rhd_allreduce";
    case Collective::kAllGather: return bytes <= (32u << 10) && n > 2 ? "bruck_allgather" : "ring_allgather";
    case Collective::kReduceScatter: return "ring_reducescatter";
    case Collective::kBroadcast:
      // The chain pipelines chunks through every rank, which pays only while every rank runs: 4
      // processes on 2 cores took 2x longer from 128 KiB to 4 MiB than with the tree (log n
      // steps), whose every receiver also forwards less (docs/PERFORMANCE.md).
      return bytes <= (64u << 10) || crowded ? "tree_broadcast" : "chain_broadcast";
    case Collective::kReduce: return "tree_reduce";
    case Collective::kAllToAll: return "pairwise_alltoall";
    case Collective::kGather: return "direct_gather";
    case Collective::kScatter: return "direct_scatter";
    default: throw InvalidArgument(fmt::format("no built-in algorithm for {}", to_string(c)));
  }
}

}  // namespace tutti::algorithms
