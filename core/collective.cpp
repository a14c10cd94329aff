#include "tutti/collective.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string_view>

#include "core/error.hpp"

namespace tutti {

const char* to_string(Collective c) {
  switch (c) {
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kAllGather: return "all_gather";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kReduce: return "reduce";
    case Collective::kAllToAll: return "alltoall";
    case Collective::kGather: return "gather";
    case Collective::kScatter: return "scatter";
    case Collective::kSendRecv: return "sendrecv";
    case Collective::kCustom: return "custom";
  }
  return "?";
}

std::optional<Collective> parse_collective(const std::string& text) {
  auto plain = [](std::string_view name) {
    std::string out;
    for (char c : name)
      if (c != '_' && c != '-') out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return out;
  };
  std::string s;
  for (char c : text)
    if (c != '_' && c != '-') s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (Collective c : {Collective::kAllReduce, Collective::kAllGather, Collective::kReduceScatter, Collective::kBroadcast,
                       Collective::kReduce, Collective::kAllToAll, Collective::kGather, Collective::kScatter,
                       Collective::kSendRecv, Collective::kCustom})
    if (s == plain(to_string(c))) return c;
  return std::nullopt;
}

std::string to_string(BufferKind b) {
  switch (b) {
    case BufferKind::kInput: return "input";
    case BufferKind::kOutput: return "output";
    case BufferKind::kScratch: return "scratch";
    default: return fmt::format("state{}", state_index(b));
  }
}

std::optional<BufferKind> parse_buffer(const std::string& text) {
  if (text == "input") return BufferKind::kInput;
  if (text == "output") return BufferKind::kOutput;
  if (text == "scratch") return BufferKind::kScratch;
  if (text.size() > 5 && text.compare(0, 5, "state") == 0 &&
      text.find_first_not_of("0123456789", 5) == std::string::npos && text.size() < 10)
    return state_buffer(std::stoi(text.substr(5)));
  return std::nullopt;
}

const char* to_string(Protocol p) {
  switch (p) {
    case Protocol::kAuto: return "auto";
    case Protocol::kSimple: return "Simple";
    case Protocol::kLL: return "LL";
    case Protocol::kLL128: return "LL128";
  }
  return "?";
}



Content Content::of(int rank, int index) {
  Content c;
  c.parts.push_back({rank, index});
  return c;
}

Content Content::of_state(int rank, int state, int index) {
  Content c;
  c.parts.push_back({rank, index, state});
  return c;
}

Content Content::apply(KernelId kernel, std::vector<Content> args, std::vector<ScalarArg> scalars, int output) {
  Content c;
  c.applied.push_back(Application{kernel, output, std::move(scalars), std::move(args)});
  return c;
}

bool Content::operator==(const Content& o) const { return parts == o.parts && applied == o.applied; }
bool Content::operator<(const Content& o) const {
  if (parts != o.parts) return parts < o.parts;
  return std::lexicographical_compare(applied.begin(), applied.end(), o.applied.begin(), o.applied.end());
}
bool Application::operator==(const Application& o) const {
  return kernel == o.kernel && output == o.output && scalars == o.scalars && args == o.args;
}
bool Application::operator<(const Application& o) const {
  if (kernel != o.kernel) return kernel < o.kernel;
  if (output != o.output) return output < o.output;
  if (scalars != o.scalars) return scalars < o.scalars;
  return std::lexicographical_compare(args.begin(), args.end(), o.args.begin(), o.args.end());
}

void Content::merge(const Content& other) {
  std::vector<Contribution> merged;
  std::merge(parts.begin(), parts.end(), other.parts.begin(), other.parts.end(), std::back_inserter(merged));
  parts = std::move(merged);
  if (!other.applied.empty()) {
    std::vector<Application> both;
    std::merge(applied.begin(), applied.end(), other.applied.begin(), other.applied.end(), std::back_inserter(both));
    applied = std::move(both);
  }
}

std::string Content::describe() const {
  if (empty()) return "{empty}";
  std::string s = "{";
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i == 8 && parts.size() > 10) {
      s += fmt::format(", ... {} more", parts.size() - 8);
      break;
    }
    if (parts[i].state >= 0)
      s += fmt::format("{}r{}:s{}[{}]", i ? ", " : "", parts[i].rank, parts[i].state, parts[i].index);
    else
      s += fmt::format("{}r{}:i{}", i ? ", " : "", parts[i].rank, parts[i].index);
  }
  for (size_t i = 0; i < applied.size(); ++i) {
    const Application& a = applied[i];
    s += fmt::format("{}{}", parts.empty() && i == 0 ? "" : ", ", kernel_def(a.kernel).name);
    if (a.output) s += fmt::format(".{}", a.output);
    if (!a.scalars.empty()) {
      s += "[";
      for (size_t k = 0; k < a.scalars.size(); ++k)
        s += (k ? ", " : "") + (a.scalars[k].slot >= 0 ? fmt::format("${}", a.scalars[k].slot) : fmt::format("{}", a.scalars[k].value));
      s += "]";
    }
    s += "(";
    for (size_t k = 0; k < a.args.size(); ++k) s += (k ? ", " : "") + a.args[k].describe();
    s += ")";
  }
  return s + "}";
}

int CollectiveSpec::input_chunks() const {
  const int C = chunk_factor, n = nranks;
  switch (kind) {
    case Collective::kReduceScatter:
    case Collective::kAllToAll:
    case Collective::kScatter: return n * C;
    case Collective::kCustom: return custom_input_chunks;
    default: return C;
  }
}

int CollectiveSpec::output_chunks() const {
  const int C = chunk_factor, n = nranks;
  switch (kind) {
    case Collective::kAllGather:
    case Collective::kAllToAll:
    case Collective::kGather: return n * C;
    case Collective::kCustom: return custom_output_chunks;
    default: return C;
  }
}

bool CollectiveSpec::has_root() const { return tutti::has_root(kind); }

CollectiveSpec CollectiveSpec::of(Collective kind, int nranks, int chunk_factor, bool inplace, int root) {
  CollectiveSpec s;
  s.kind = kind;
  s.nranks = nranks;
  s.chunk_factor = chunk_factor;
  s.inplace = inplace;
  s.root = root;
  return s;
}

Location CollectiveSpec::canonical(int rank, BufferKind buffer, int index) const {
  if (!inplace || buffer == BufferKind::kScratch || is_state(buffer)) return {buffer, index};
  const int C = chunk_factor;
  switch (kind) {
    case Collective::kAllGather:
    case Collective::kGather:
      // The input is the rank's own slice of the output.
      if (buffer == BufferKind::kInput) return {BufferKind::kOutput, rank * C + index};
      return {BufferKind::kOutput, index};
    case Collective::kReduceScatter:
    case Collective::kScatter:
      // The output is the rank's own slice of the input.
      if (buffer == BufferKind::kOutput) return {BufferKind::kInput, rank * C + index};
      return {BufferKind::kInput, index};
    default:
      return {BufferKind::kInput, index};  // one buffer serves as both
  }
}

Content CollectiveSpec::precondition(int rank, int input_index) const {
  if (kind == Collective::kCustom) {
    if (custom_pre) {
      auto c = custom_pre(rank, input_index);
      return c ? *c : Content{};
    }
    return Content::of(rank, input_index);
  }
  return Content::of(rank, input_index);
}

std::optional<Content> CollectiveSpec::postcondition(int rank, int index) const {
  const int C = chunk_factor, n = nranks;
  auto sum_over_ranks = [&](int input_index) {
    Content c;
    for (int q = 0; q < n; ++q) c.parts.push_back({q, input_index});
    return c;
  };
  switch (kind) {
    case Collective::kAllReduce: return sum_over_ranks(index);
    case Collective::kAllGather: return Content::of(index / C, index % C);
    case Collective::kReduceScatter: return sum_over_ranks(rank * C + index);
    case Collective::kBroadcast: return Content::of(root, index);
    case Collective::kReduce:
      if (rank != root) return std::nullopt;
      return sum_over_ranks(index);
    case Collective::kAllToAll: return Content::of(index / C, rank * C + index % C);
    case Collective::kGather:
      if (rank != root) return std::nullopt;
      return Content::of(index / C, index % C);
    case Collective::kScatter: return Content::of(root, rank * C + index);
    case Collective::kSendRecv: return Content::of((rank + n - 1) % n, index);
    case Collective::kCustom: return custom_post ? custom_post(rank, index) : std::nullopt;
  }
  return std::nullopt;
}

std::optional<Content> CollectiveSpec::state_postcondition(int rank, int state, int index) const {
  const StateBufferSpec& s = states.at(static_cast<size_t>(state));
  return s.post ? s.post(rank, index) : std::nullopt;
}

int CollectiveSpec::state_named(const std::string& name) const {
  std::string known;
  for (size_t k = 0; k < states.size(); ++k) {
    if (states[k].name == name) return static_cast<int>(k);
    known += (k ? ", '" : "'") + states[k].name + "'";
  }
  throw InvalidArgument(fmt::format("{}: no state buffer is named '{}' (the collective has {})", describe(), name,
                                    states.empty() ? std::string("none") : known));
}

std::string CollectiveSpec::describe() const {
  std::string s = fmt::format("{}, {} ranks, {} chunk(s) per rank piece, {}", to_string(kind), nranks, chunk_factor,
                              inplace ? "in-place" : "out-of-place");
  if (has_root()) s += fmt::format(", root {}", root);
  return s;
}

}  // namespace tutti
