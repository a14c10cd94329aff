#include "plan/plan.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string_view>
#include <tuple>

#include "core/error.hpp"

namespace tutti::plan {

using nlohmann::json;



const char* to_string(Opcode op) { return op_info(op).name; }

std::optional<Opcode> parse_opcode(const std::string& text) {
  for (int i = 0; i < kNumOpcodes; ++i)
    if (text == op_info(static_cast<Opcode>(i)).name) return static_cast<Opcode>(i);
  return std::nullopt;
}

bool sends(Opcode op) { return shape_of(op).send; }
bool receives(Opcode op) { return shape_of(op).recv; }
bool stores(Opcode op) { return shape_of(op).store; }

std::string Ref::describe() const {
  if (count == 1) return fmt::format("{}[{}]", to_string(buffer), index);
  return fmt::format("{}[{}..{})", to_string(buffer), index, index + count);
}

int64_t Instruction::count() const {
  if (dst) return dst->count;
  if (!srcs.empty()) return srcs[0].count;
  return 0;
}

std::vector<Ref> Instruction::writes() const {
  std::vector<Ref> out;
  if (dst) out.push_back(*dst);
  out.insert(out.end(), more_dsts.begin(), more_dsts.end());
  return out;
}

CollectiveSpec Plan::spec() const {
  CollectiveSpec s = CollectiveSpec::of(collective, nranks, chunk_factor, inplace, root);
  if (collective == Collective::kCustom)  // no pre/postcondition travels with a plan: buffer sizes only
    for (auto& r : ranks) {
      s.custom_input_chunks = std::max(s.custom_input_chunks, static_cast<int>(r.input_chunks));
      s.custom_output_chunks = std::max(s.custom_output_chunks, static_cast<int>(r.output_chunks));
    }
  for (const StateBuffer& b : states) s.states.push_back(StateBufferSpec{b.name, static_cast<int>(b.chunks), b.unit, {}});
  return s;
}

int64_t Plan::unit(BufferKind b) const {
  if (!is_state(b)) return 0;
  const size_t k = static_cast<size_t>(state_index(b));
  return k < states.size() ? states[k].unit : 0;
}

int64_t Plan::size(int rank, BufferKind b) const {
  const RankPlan& r = ranks.at(static_cast<size_t>(rank));
  switch (b) {
    case BufferKind::kInput: return r.input_chunks;
    case BufferKind::kOutput: return r.output_chunks;
    case BufferKind::kScratch: return r.scratch_chunks;
    default: {
      const size_t k = static_cast<size_t>(state_index(b));
      return k < states.size() ? states[k].chunks : 0;
    }
  }
}

int Plan::channels() const {
  int c = 0;
  for (auto& r : ranks)
    for (auto& b : r.blocks) c = std::max(c, b.channel + 1);
  return c;
}

int64_t Plan::steps() const {
  int64_t n = 0;
  for (auto& r : ranks)
    for (auto& b : r.blocks) n += static_cast<int64_t>(b.steps.size());
  return n;
}

int64_t Plan::blocks() const {
  int64_t n = 0;
  for (auto& r : ranks) n += static_cast<int64_t>(r.blocks.size());
  return n;
}

namespace {

json ref_json(const Ref& r) { return json::array({to_string(r.buffer), r.index, r.count}); }

Ref parse_ref(const json& j, const std::string& where) {
  TUTTI_CHECK(j.is_array() && j.size() == 3 && j[0].is_string() && j[1].is_number_integer() && j[2].is_number_integer(),
              InvalidArgument, "plan JSON: {}: a chunk reference is [\"input|output|scratch\", index, count]", where);
  Ref r;
  std::string b = j[0];
  auto kind = parse_buffer(b);
  TUTTI_CHECK(kind.has_value(), InvalidArgument, "plan JSON: {}: unknown buffer '{}' (input, output, scratch, stateK)",
              where, b);
  r.buffer = *kind;
  auto fits = [](const json& v) {
    return !v.is_number_unsigned() || v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX);
  };
  TUTTI_CHECK(fits(j[1]) && fits(j[2]), InvalidArgument, "plan JSON: {}: chunk reference {} is out of range", where,
              j.dump());
  r.index = j[1].get<int64_t>();
  r.count = j[2].get<int64_t>();
  return r;
}

void check_keys(const json& j, std::initializer_list<const char*> known, const std::string& where) {
  TUTTI_CHECK(j.is_object(), InvalidArgument, "plan JSON: {} must be an object", where);
  for (auto& [k, v] : j.items()) {
    bool ok = false;
    for (const char* n : known) ok |= k == n;
    TUTTI_CHECK(ok, InvalidArgument, "plan JSON: {}: unknown field '{}'", where, k);
  }
}

// An integer field must be an integer in T's range: nlohmann converts a float or a wider integer
// with a plain cast (1e300 into an int is undefined behaviour, 2^32 wraps).
template <class T>
T integer(const json& v, const std::string& where, const char* key) {
  bool ok = v.is_number_integer();
  if (ok && v.is_number_unsigned()) ok = v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max());
  else if (ok) {
    const int64_t x = v.get<int64_t>();
    ok = (std::is_signed_v<T> || x >= 0) &&
         (sizeof(T) >= sizeof(int64_t) ||
          (x >= static_cast<int64_t>(std::numeric_limits<T>::min()) && x <= static_cast<int64_t>(std::numeric_limits<T>::max())));
  }
  TUTTI_CHECK(ok, InvalidArgument, "plan JSON: {}: '{}' is {}, not an integer in {}..{}", where, key, v.dump(),
              std::numeric_limits<T>::min(), std::numeric_limits<T>::max());
  return v.is_number_unsigned() ? static_cast<T>(v.get<uint64_t>()) : static_cast<T>(v.get<int64_t>());
}

template <class T>
T field(const json& j, const char* key, const std::string& where) {
  TUTTI_CHECK(j.contains(key), InvalidArgument, "plan JSON: {}: missing field '{}'", where, key);
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    return integer<T>(j.at(key), where, key);
  } else {
    try {
      return j.at(key).get<T>();
    } catch (const json::exception&) {
      throw InvalidArgument(fmt::format("plan JSON: {}: field '{}' has the wrong type", where, key));
    }
  }
}

Plan parse_json_unchecked(const std::string& text);

}  // namespace

std::string to_json(const Plan& p) {
  json j;
  j["format"] = "tutti-plan";
  j["version"] = Plan::kVersion;
  j["name"] = p.name;
  j["collective"] = to_string(p.collective);
  j["nranks"] = p.nranks;
  j["chunk_factor"] = p.chunk_factor;
  j["inplace"] = p.inplace;
  j["root"] = p.root;
  j["protocol"] = to_string(p.protocol);
  j["min_bytes"] = p.min_bytes;
  j["max_bytes"] = p.max_bytes;
  j["topology"] = p.topology;
  j["fifo_depth"] = p.fifo_depth;
  j["any_count"] = p.any_count;
  if (!p.states.empty()) {
    json states = json::array();
    for (const StateBuffer& b : p.states) states.push_back({{"name", b.name}, {"chunks", b.chunks}, {"unit", b.unit}});
    j["states"] = states;
  }
  json ranks = json::array();
  for (auto& r : p.ranks) {
    json jr;
    jr["input_chunks"] = r.input_chunks;
    jr["output_chunks"] = r.output_chunks;
    jr["scratch_chunks"] = r.scratch_chunks;
    json blocks = json::array();
    for (auto& b : r.blocks) {
      json jb;
      jb["id"] = b.id;
      jb["channel"] = b.channel;
      json steps = json::array();
      for (auto& s : b.steps) {
        json js;
        js["op"] = to_string(s.op);
        if (!s.srcs.empty()) {
          json srcs = json::array();
          for (auto& r2 : s.srcs) srcs.push_back(ref_json(r2));
          js["srcs"] = srcs;
        }
        if (s.dst) js["dst"] = ref_json(*s.dst);
        if (s.send_peer >= 0) js["send_peer"] = s.send_peer;
        if (s.recv_peer >= 0) js["recv_peer"] = s.recv_peer;
        if (s.remote) js["remote"] = ref_json(*s.remote);
        if (s.stable_source) js["stable_source"] = true;
        if (!s.deps.empty()) {
          json deps = json::array();
          for (auto& d : s.deps) deps.push_back(json::array({d.block, d.step}));
          js["deps"] = deps;
        }
        if (s.op == Opcode::kCompute) {
          js["kernel"] = kernel_def(s.kernel).name;  // by name: ids depend on registration order
          if (!s.scalars.empty()) {
            json sc = json::array();
            for (const ScalarArg& a : s.scalars) sc.push_back(a.slot >= 0 ? json{{"slot", a.slot}} : json(a.value));
            js["scalars"] = sc;
          }
          if (!s.more_dsts.empty()) {
            json more = json::array();
            for (auto& r2 : s.more_dsts) more.push_back(ref_json(r2));
            js["more_dsts"] = more;
          }
        }
        steps.push_back(js);
      }
      jb["steps"] = steps;
      blocks.push_back(jb);
    }
    jr["blocks"] = blocks;
    ranks.push_back(jr);
  }
  j["ranks"] = ranks;
  return j.dump(1);
}

void check_limits(const Plan& p) {
  using L = Limits;
  auto over = [&](const std::string& what, int64_t value, int64_t limit) {
    if (value < 0 || value > limit)
      throw InvalidArgument(fmt::format("plan '{}': {} is {} (allowed 0..{})", p.name, what, value, limit));
  };
  over("nranks", p.nranks, L::kRanks);
  TUTTI_CHECK(p.nranks >= 1, InvalidArgument, "plan '{}': nranks is {} (at least 1)", p.name, p.nranks);
  over("chunk_factor", p.chunk_factor, L::kChunkFactor);
  TUTTI_CHECK(p.chunk_factor >= 1, InvalidArgument, "plan '{}': chunk_factor is {} (at least 1)", p.name, p.chunk_factor);
  over("number of rank entries", static_cast<int64_t>(p.ranks.size()), L::kRanks);
  int64_t slots = 0, steps = 0;
  for (size_t r = 0; r < p.ranks.size(); ++r) {
    const RankPlan& rp = p.ranks[r];
    over(fmt::format("rank {} input_chunks", r), rp.input_chunks, L::kChunksPerBuffer);
    over(fmt::format("rank {} output_chunks", r), rp.output_chunks, L::kChunksPerBuffer);
    over(fmt::format("rank {} scratch_chunks", r), rp.scratch_chunks, L::kChunksPerBuffer);
    // Scratch is allocated per call in proportion to the call's buffers: bounded here by that ratio,
    // so a verified plan cannot ask a rank for terabytes (and fail on that rank alone).
    over(fmt::format("rank {} scratch_chunks (per chunk of its largest buffer, {} chunks)", r,
                     std::max<int64_t>({rp.input_chunks, rp.output_chunks, 1})),
         rp.scratch_chunks,
         L::scratch_ratio(p.nranks) * std::max<int64_t>({rp.input_chunks, rp.output_chunks, 1}));
    slots += rp.input_chunks + rp.output_chunks + rp.scratch_chunks;
    over(fmt::format("rank {} blocks", r), static_cast<int64_t>(rp.blocks.size()), L::kBlocksPerRank);
    for (const Block& b : rp.blocks) {
      over(fmt::format("rank {} block {} channel", r, b.id), b.channel, L::kChannels - 1);
      steps += static_cast<int64_t>(b.steps.size());
      over("steps", steps, L::kSteps);
      for (size_t s = 0; s < b.steps.size(); ++s) {
        const Instruction& in = b.steps[s];
        over(fmt::format("rank {} block {} step {} operands", r, b.id, s),
             static_cast<int64_t>(in.srcs.size() + in.more_dsts.size() + in.deps.size()), L::kOperandsPerStep);
      }
    }
  }
  for (const StateBuffer& sb : p.states) slots += sb.chunks * p.nranks;
  over("chunks over all ranks and buffers", slots, L::kChunkSlots);
  over("chunks over all ranks and buffers x nranks", slots * p.nranks, L::kChunkSlotsTimesRanks);
}

Plan parse_json(const std::string& text) {
  // Nothing the parser or a malformed document throws escapes as anything but InvalidArgument.
  try {
    return parse_json_unchecked(text);
  } catch (const Error&) {
    throw;
  } catch (const json::exception& e) {
    throw InvalidArgument(fmt::format("plan JSON: {}", e.what()));
  } catch (const std::length_error& e) {
    throw InvalidArgument(fmt::format("plan JSON: a size is out of range ({})", e.what()));
  } catch (const std::bad_alloc&) {
    throw InvalidArgument("plan JSON: the plan does not fit in memory");
  }
}

namespace {
// An array where the format has one, an object where it has one: iterating anything else would
// read a number as a block.
const json& array_field(const json& a, const std::string& where, const char* key) {
  TUTTI_CHECK(a.contains(key) && a.at(key).is_array(), InvalidArgument, "plan JSON: {}: '{}' must be an array", where,
              key);
  return a.at(key);
}

void check_object(const json& o, const std::string& where) {
  TUTTI_CHECK(o.is_object(), InvalidArgument, "plan JSON: {} must be an object", where);
}

Protocol protocol_field(const json& j) {
  std::string proto = field<std::string>(j, "protocol", "top level");
  if (proto == "Simple") return Protocol::kSimple;
  if (proto == "LL") return Protocol::kLL;
  if (proto == "LL128") return Protocol::kLL128;
  if (proto == "auto") return Protocol::kAuto;
  throw InvalidArgument(fmt::format("plan JSON: unknown protocol '{}'", proto));
}

// The top level's fields but states and ranks.
void read_header(const json& j, Plan& p) {
  check_keys(j, {"format", "version", "name", "collective", "nranks", "chunk_factor", "inplace", "root", "protocol",
                 "min_bytes", "max_bytes", "topology", "fifo_depth", "any_count", "states", "ranks"},
             "top level");
  TUTTI_CHECK(field<std::string>(j, "format", "top level") == "tutti-plan", InvalidArgument,
              "plan JSON: format is not 'tutti-plan'");
  int version = field<int>(j, "version", "top level");
  TUTTI_CHECK(version == Plan::kVersion, InvalidArgument, "plan JSON: version {} is not supported (this build reads {})",
              version, Plan::kVersion);
  p.name = field<std::string>(j, "name", "top level");
  std::string coll = field<std::string>(j, "collective", "top level");
  auto c = parse_collective(coll);
  TUTTI_CHECK(c.has_value(), InvalidArgument, "plan JSON: unknown collective '{}'", coll);
  p.collective = *c;
  p.nranks = field<int>(j, "nranks", "top level");
  p.chunk_factor = field<int>(j, "chunk_factor", "top level");
  TUTTI_CHECK(p.nranks >= 1 && p.nranks <= Limits::kRanks, InvalidArgument, "plan JSON: nranks is {} (allowed 1..{})",
              p.nranks, Limits::kRanks);
  TUTTI_CHECK(p.chunk_factor >= 1 && p.chunk_factor <= Limits::kChunkFactor, InvalidArgument,
              "plan JSON: chunk_factor is {} (allowed 1..{})", p.chunk_factor, Limits::kChunkFactor);
  p.inplace = field<bool>(j, "inplace", "top level");
  p.root = field<int>(j, "root", "top level");
  p.protocol = protocol_field(j);
  p.min_bytes = field<uint64_t>(j, "min_bytes", "top level");
  p.max_bytes = field<uint64_t>(j, "max_bytes", "top level");
  p.topology = field<std::string>(j, "topology", "top level");
  // Stated by the verifier; files written before these fields existed read as "not verified".
  if (j.contains("fifo_depth")) p.fifo_depth = field<int64_t>(j, "fifo_depth", "top level");
  if (j.contains("any_count")) p.any_count = field<bool>(j, "any_count", "top level");
}

// The top level's optional "states".
void read_states(const json& j, Plan& p) {
  if (!j.contains("states")) return;
  TUTTI_CHECK(j["states"].is_array(), InvalidArgument, "plan JSON: 'states' must be an array");
  for (const json& b : j["states"]) {
    std::string where = fmt::format("states[{}]", p.states.size());
    check_object(b, where);
    check_keys(b, {"name", "chunks", "unit"}, where);
    StateBuffer sb{field<std::string>(b, "name", where), field<int64_t>(b, "chunks", where),
                   field<int64_t>(b, "unit", where)};
    // Bounded so that chunk offsets (chunks x unit x 8 bytes) stay far inside int64.
    constexpr int64_t kMaxChunks = int64_t{1} << 31, kMaxUnit = int64_t{1} << 40;
    TUTTI_CHECK(sb.chunks >= 0 && sb.chunks < kMaxChunks && sb.unit >= 0 && sb.unit < kMaxUnit &&
                    (sb.unit == 0 || sb.chunks <= kMaxUnit / sb.unit),
                InvalidArgument, "plan JSON: {}: '{}' has {} chunks of unit {} (at most 2^31 chunks and 2^40 elements)",
                where, sb.name, sb.chunks, sb.unit);
    p.states.push_back(std::move(sb));
  }
}

// A step's "deps", if it has them.
void read_deps(const json& js, const std::string& sw, Instruction& in) {
  if (!js.contains("deps")) return;
  for (const json& d : array_field(js, sw, "deps")) {
    TUTTI_CHECK(d.is_array() && d.size() == 2 && d[0].is_number_integer() && d[1].is_number_integer(),
                InvalidArgument, "plan JSON: {}: a dependency is [block, step]", sw);
    in.deps.push_back({integer<int64_t>(d[0], sw, "deps"), integer<int64_t>(d[1], sw, "deps")});
  }
}

// A step's "kernel" and "scalars", if it has them.
void read_kernel(const json& js, const std::string& sw, Instruction& in) {
  if (js.contains("kernel")) {
    const std::string name = field<std::string>(js, "kernel", sw);
    const std::optional<KernelId> id = find_kernel(name);
    TUTTI_CHECK(id.has_value(), InvalidArgument,
                "plan JSON: {}: unknown kernel '{}' (register it with tutti::register_kernel before loading the "
                "plan)",
                sw, name);
    in.kernel = *id;
  }
  if (js.contains("scalars"))
    for (const json& a : array_field(js, sw, "scalars")) {
      // A number is a constant; {"slot": k} the call's k-th value.
      if (a.is_number()) in.scalars.emplace_back(a.get<double>());
      else in.scalars.push_back(ScalarArg::per_call(field<int>(a, "slot", sw + " scalar")));
    }
}

// Step `sw` ("rank R block B step S").
Instruction read_step(const json& js, const std::string& sw) {
  check_object(js, sw);
  check_keys(js, {"op", "srcs", "dst", "send_peer", "recv_peer", "remote", "deps", "kernel", "scalars", "more_dsts",
                  "stable_source"},
             sw);
  Instruction in;
  std::string op = field<std::string>(js, "op", sw);
  auto code = parse_opcode(op);
  TUTTI_CHECK(code.has_value(), InvalidArgument, "plan JSON: {}: unknown op '{}'", sw, op);
  in.op = *code;
  if (js.contains("srcs"))
    for (const json& s : array_field(js, sw, "srcs")) in.srcs.push_back(parse_ref(s, sw));
  if (js.contains("dst")) in.dst = parse_ref(js["dst"], sw);
  if (js.contains("send_peer")) in.send_peer = field<int>(js, "send_peer", sw);
  if (js.contains("recv_peer")) in.recv_peer = field<int>(js, "recv_peer", sw);
  if (js.contains("remote")) in.remote = parse_ref(js["remote"], sw);
  if (js.contains("stable_source")) in.stable_source = field<bool>(js, "stable_source", sw);
  read_deps(js, sw, in);
  read_kernel(js, sw, in);
  if (js.contains("more_dsts"))
    for (const json& r2 : array_field(js, sw, "more_dsts")) in.more_dsts.push_back(parse_ref(r2, sw));
  if (in.op == Opcode::kCompute) {
    const KernelDef& def = kernel_def(in.kernel);
    TUTTI_CHECK(in.scalars.size() == def.scalars.size(), InvalidArgument,
                "plan JSON: {}: kernel '{}' takes {} scalar(s), the step gives {}", sw, def.name,
                def.scalars.size(), in.scalars.size());
  }
  return in;
}

// Block `bw` ("rank R block B").
Block read_block(const json& jb, const std::string& bw) {
  check_object(jb, bw);
  check_keys(jb, {"id", "channel", "steps"}, bw);
  Block b;
  b.id = field<int64_t>(jb, "id", bw);
  b.channel = field<int>(jb, "channel", bw);
  for (const json& js : array_field(jb, bw, "steps"))
    b.steps.push_back(read_step(js, fmt::format("{} step {}", bw, b.steps.size())));
  return b;
}

RankPlan read_rank(const json& jr, size_t r) {
  std::string where = fmt::format("rank {}", r);
  check_object(jr, where);
  check_keys(jr, {"input_chunks", "output_chunks", "scratch_chunks", "blocks"}, where);
  RankPlan rp;
  rp.input_chunks = field<int64_t>(jr, "input_chunks", where);
  rp.output_chunks = field<int64_t>(jr, "output_chunks", where);
  rp.scratch_chunks = field<int64_t>(jr, "scratch_chunks", where);
  for (const json& jb : array_field(jr, where, "blocks"))
    rp.blocks.push_back(read_block(jb, fmt::format("rank {} block {}", r, rp.blocks.size())));
  return rp;
}

Plan parse_json_unchecked(const std::string& text) {
  TUTTI_CHECK(text.size() <= Limits::kFileBytes, InvalidArgument, "plan JSON: {} bytes (at most {})", text.size(),
              Limits::kFileBytes);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    throw InvalidArgument(fmt::format("plan JSON: not valid JSON: {}", e.what()));
  }
  TUTTI_CHECK(j.is_object(), InvalidArgument, "plan JSON: the top level is not an object");
  Plan p;
  read_header(j, p);
  read_states(j, p);
  TUTTI_CHECK(j.contains("ranks"), InvalidArgument, "plan JSON: top level: missing field 'ranks'");
  const json& ranks = j.at("ranks");
  TUTTI_CHECK(ranks.is_array() && ranks.size() == static_cast<size_t>(std::max(p.nranks, 0)), InvalidArgument,
              "plan JSON: 'ranks' must list {} ranks", p.nranks);
  for (size_t r = 0; r < ranks.size(); ++r) p.ranks.push_back(read_rank(ranks[r], r));
  check_limits(p);
  renumber_blocks(p);
  return p;
}
}  // namespace

void renumber_blocks(Plan& p) {
  for (size_t r = 0; r < p.ranks.size(); ++r) {
    auto& blocks = p.ranks[r].blocks;
    std::map<int64_t, int64_t> index;
    for (size_t b = 0; b < blocks.size(); ++b)
      TUTTI_CHECK(index.emplace(blocks[b].id, static_cast<int64_t>(b)).second, InvalidArgument,
                  "plan '{}': rank {} has two blocks with id {}", p.name, r, blocks[b].id);
    for (auto& b : blocks)
      for (size_t s = 0; s < b.steps.size(); ++s)
        for (auto& d : b.steps[s].deps) {
          auto it = index.find(d.block);
          TUTTI_CHECK(it != index.end(), InvalidArgument,
                      "plan '{}': rank {} block {} step {} depends on block {}, which rank {} does not have", p.name, r,
                      b.id, s, d.block, r);
          d.block = it->second;
        }
    for (size_t b = 0; b < blocks.size(); ++b) blocks[b].id = static_cast<int64_t>(b);
  }
}

bool splits_any_count(const Plan& p) {
  // A state buffer's chunk is the same slice of every call only when all chunks are equal.
  if (!p.states.empty()) return false;
  const int64_t C = p.chunk_factor;
  auto sub = [&](const Ref& r) { return ((r.index % C) + C) % C; };
  // Sub-index of each message per connection, in order, from both ends: they must agree too.
  std::map<std::tuple<int, int, int>, std::vector<int64_t>> sent, received;
  for (int r = 0; r < p.nranks; ++r)
    for (auto& b : p.ranks[r].blocks)
      for (auto& in : b.steps) {
        std::vector<const Ref*> refs;
        for (auto& s : in.srcs) refs.push_back(&s);
        if (in.dst) refs.push_back(&*in.dst);
        for (auto* ref : refs)
          if (sub(*ref) != sub(*refs[0])) return false;
        if (refs.empty()) continue;
        if (sends(in.op)) sent[{r, in.send_peer, b.channel}].push_back(sub(*refs.back()));
        if (receives(in.op)) received[{in.recv_peer, r, b.channel}].push_back(sub(*refs.back()));
      }
  return sent == received;
}

std::string read_file(const std::string& path) {
  // Non-blocking, so a FIFO (or a device that blocks) opens at once and is then refused by fstat;
  // the limit applies while reading, so a file that grows or never ends (/dev/zero) costs at most it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  TUTTI_CHECK(fd >= 0, InvalidArgument, "cannot open plan file {}: {}", path, std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  TUTTI_CHECK(::fstat(fd, &st) == 0, InvalidArgument, "cannot stat plan file {}: {}", path, std::strerror(errno));
  TUTTI_CHECK(S_ISREG(st.st_mode), InvalidArgument, "plan file {} is not a regular file (a {}): only regular files are read",
              path, S_ISFIFO(st.st_mode) ? "FIFO" : S_ISCHR(st.st_mode) ? "character device" : S_ISDIR(st.st_mode) ? "directory" : S_ISSOCK(st.st_mode) ? "socket" : "special file");
  TUTTI_CHECK(static_cast<uint64_t>(st.st_size) <= Limits::kFileBytes, InvalidArgument,
              "plan file {} has {} bytes (allowed up to {})", path, st.st_size, Limits::kFileBytes);
  std::string text;
  char buf[1 << 16];
  while (true) {
    const ssize_t got = ::read(fd, buf, sizeof buf);
    if (got < 0 && errno == EINTR) continue;
    TUTTI_CHECK(got >= 0, InvalidArgument, "cannot read plan file {}: {}", path, std::strerror(errno));
    if (got == 0) break;
    TUTTI_CHECK(text.size() + static_cast<size_t>(got) <= Limits::kFileBytes, InvalidArgument,
                "plan file {} grew past {} bytes while it was read", path, Limits::kFileBytes);
    text.append(buf, static_cast<size_t>(got));
  }
  return text;
}


}  // namespace tutti::plan
