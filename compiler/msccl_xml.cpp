#include "compiler/msccl_xml.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <pugixml.hpp>
#include <set>
#include <sstream>

#include "core/error.hpp"

namespace tutti::plan {
namespace {

// Line numbers for messages, by binary search over the newlines (counting from the start for each
// message made a file of many unknown elements quadratic: seconds for a few hundred kilobytes).
struct Source {
  explicit Source(const std::string& t) : text(t) {
    for (size_t i = 0; i < t.size(); ++i)
      if (t[i] == '\n') newlines.push_back(static_cast<ptrdiff_t>(i));
  }
  const std::string& text;
  std::vector<ptrdiff_t> newlines;
  int line(ptrdiff_t offset) const {
    return 1 + static_cast<int>(std::lower_bound(newlines.begin(), newlines.end(), offset) - newlines.begin());
  }
  int line(const pugi::xml_node& n) const { return line(n.offset_debug()); }
};

// Warnings, at most Limits::kWarnings of them, then one line counting the rest.
struct Warnings {
  std::vector<std::string>* out;
  size_t dropped = 0;
  explicit operator bool() const { return out != nullptr; }
  Warnings* operator->() { return this; }
  void push_back(std::string w) {
    if (!out) return;
    if (out->size() < Limits::kWarnings) out->push_back(std::move(w));
    else ++dropped;
  }
  ~Warnings() {
    if (out && dropped) out->push_back(fmt::format("... and {} more warnings", dropped));
  }
};

int64_t int_attr(const Source& src, const pugi::xml_node& n, const char* name, bool required, int64_t fallback = 0);

// An attribute that must fit an int (ids, peers, channels): a larger value is an error, not a wrap.
int int32_attr(const Source& src, const pugi::xml_node& n, const char* name, bool required, int fallback = 0) {
  const int64_t v = int_attr(src, n, name, required, fallback);
  TUTTI_CHECK(v >= INT32_MIN && v <= INT32_MAX, InvalidArgument, "MSCCL XML line {}: <{}> attribute {}={} is out of range",
              src.line(n), n.name(), name, v);
  return static_cast<int>(v);
}

int64_t int_attr(const Source& src, const pugi::xml_node& n, const char* name, bool required, int64_t fallback) {
  pugi::xml_attribute a = n.attribute(name);
  if (!a) {
    TUTTI_CHECK(!required, InvalidArgument, "MSCCL XML line {}: <{}> lacks attribute {}", src.line(n), n.name(), name);
    return fallback;
  }
  std::string v = a.value();
  try {
    size_t used = 0;
    long long x = std::stoll(v, &used, 10);
    if (used == v.size()) return x;
  } catch (const std::exception&) {
  }
  throw InvalidArgument(fmt::format("MSCCL XML line {}: <{}> attribute {}='{}' is not an integer", src.line(n), n.name(), name, v));
}

uint64_t size_attr(const Source& src, const pugi::xml_node& n, const char* name, uint64_t fallback) {
  pugi::xml_attribute a = n.attribute(name);
  if (!a) return fallback;
  std::string v = a.value();
  try {
    size_t used = 0;
    if (!v.empty() && v[0] != '-') {
      unsigned long long x = std::stoull(v, &used, 10);
      if (used == v.size()) return x;
    }
  } catch (const std::exception&) {
  }
  throw InvalidArgument(fmt::format("MSCCL XML line {}: <{}> attribute {}='{}' is not a byte count", src.line(n), n.name(), name, v));
}

BufferKind buffer_attr(const Source& src, const pugi::xml_node& n, const char* name) {
  std::string v = n.attribute(name).value();
  if (v == "i") return BufferKind::kInput;
  if (v == "o") return BufferKind::kOutput;
  if (v == "s") return BufferKind::kScratch;
  throw InvalidArgument(fmt::format("MSCCL XML line {}: <step> {}='{}' is not i, o or s", src.line(n), name, v));
}

void report_unknown(const Source& src, const pugi::xml_node& n, const std::set<std::string>& known, Warnings& warnings) {
  if (!warnings) return;
  for (auto a : n.attributes())
    if (!known.count(a.name()))
      warnings->push_back(fmt::format("line {}: unknown attribute {}=\"{}\" on <{}> ignored", src.line(n), a.name(),
                                      a.value(), n.name()));
}

char buffer_letter(BufferKind b) { return b == BufferKind::kInput ? 'i' : b == BufferKind::kOutput ? 'o' : 's'; }

// The collectives whose nchunksperloop counts the chunks of every rank's piece: a plan's
// chunk_factor is that divided by the number of ranks.
bool divides_chunks(Collective c) {
  return c == Collective::kAllGather || c == Collective::kReduceScatter || c == Collective::kAllToAll ||
         c == Collective::kGather || c == Collective::kScatter;
}

// Whether n is an element named `name`; another element is warned about, and the caller skips it.
bool element_named(const Source& src, const pugi::xml_node& n, const char* name, Warnings& warnings) {
  if (n.type() != pugi::node_element) return false;
  if (std::string(n.name()) == name) return true;
  if (warnings) warnings->push_back(fmt::format("line {}: unknown element <{}> ignored", src.line(n), n.name()));
  return false;
}

Plan import_unchecked(const std::string& text, std::vector<std::string>* warning_list);

}  // namespace

Plan import_msccl_xml(const std::string& text, std::vector<std::string>* warnings) {
  // Nothing escapes as anything but InvalidArgument.
  try {
    return import_unchecked(text, warnings);
  } catch (const Error&) {
    throw;
  } catch (const std::length_error& e) {
    throw InvalidArgument(fmt::format("MSCCL XML: a size is out of range ({})", e.what()));
  } catch (const std::bad_alloc&) {
    throw InvalidArgument("MSCCL XML: the plan does not fit in memory");
  }
}

namespace {

// <algo nchunksperloop>, as the plan's chunk_factor (p's collective and nranks already read).
int chunk_factor_attr(const Source& src, const pugi::xml_node& algo, const Plan& p, const std::string& coll) {
  int64_t per_loop = int_attr(src, algo, "nchunksperloop", true);
  TUTTI_CHECK(per_loop >= 1 && per_loop <= int64_t{Limits::kChunkFactor} * p.nranks, InvalidArgument,
              "MSCCL XML line {}: nchunksperloop={} (allowed 1..{} for ngpus={})", src.line(algo), per_loop,
              int64_t{Limits::kChunkFactor} * p.nranks, p.nranks);
  bool divided = divides_chunks(p.collective);
  TUTTI_CHECK(!divided || per_loop % p.nranks == 0, InvalidArgument,
              "MSCCL XML line {}: nchunksperloop={} is not a multiple of ngpus={} for {}", src.line(algo), per_loop,
              p.nranks, coll);
  return static_cast<int>(divided ? per_loop / p.nranks : per_loop);
}

// <algo inplace outofplace>, as the plan's inplace.
bool inplace_attr(const Source& src, const pugi::xml_node& algo) {
  bool inplace = int_attr(src, algo, "inplace", false, 0) != 0;
  if (algo.attribute("outofplace")) {
    bool oop = int_attr(src, algo, "outofplace", false) != 0;
    TUTTI_CHECK(inplace || oop, InvalidArgument,
                "MSCCL XML line {}: inplace=0 and outofplace=0: the algorithm serves no call", src.line(algo));
    // Both (as RCCL writes them): the schedule is correct whether or not the buffers alias, i.e. an
    // out-of-place plan; the dispatcher serves in-place calls with it too.
    if (oop) inplace = false;
  }
  return inplace;
}

Protocol protocol_attr(const Source& src, const pugi::xml_node& algo, Warnings& warnings) {
  std::string proto = algo.attribute("proto").value();
  if (!proto.empty() && proto != "LL" && proto != "LL128" && proto != "Simple" && warnings)
    warnings->push_back(fmt::format("line {}: unknown proto '{}', using Simple", src.line(algo), proto));
  return proto == "LL" ? Protocol::kLL : proto == "LL128" ? Protocol::kLL128 : Protocol::kSimple;
}

// The attributes of <algo>: all of the plan but its ranks.
void read_algo(const Source& src, const pugi::xml_node& algo, Plan& p, Warnings& warnings) {
  report_unknown(src, algo,
                 {"name", "proto", "nchannels", "nchunksperloop", "ngpus", "coll", "inplace", "outofplace", "minBytes",
                  "maxBytes", "redop", "nthreads"},
                 warnings);
  p.name = algo.attribute("name").value();
  std::string coll = algo.attribute("coll").value();
  auto c = parse_collective(coll);
  TUTTI_CHECK(c.has_value() && *c != Collective::kCustom, InvalidArgument,
              "MSCCL XML line {}: unknown collective coll='{}'", src.line(algo), coll);
  p.collective = *c;
  const int64_t ngpus = int_attr(src, algo, "ngpus", true);
  TUTTI_CHECK(ngpus >= 1 && ngpus <= Limits::kRanks, InvalidArgument, "MSCCL XML line {}: ngpus={} (allowed 1..{})",
              src.line(algo), ngpus, Limits::kRanks);
  p.nranks = static_cast<int>(ngpus);
  p.chunk_factor = chunk_factor_attr(src, algo, p, coll);
  p.inplace = inplace_attr(src, algo);
  p.protocol = protocol_attr(src, algo, warnings);
  p.min_bytes = size_attr(src, algo, "minBytes", 0);
  p.max_bytes = size_attr(src, algo, "maxBytes", UINT64_MAX);
  if (p.max_bytes == 0) p.max_bytes = UINT64_MAX;  // RCCL: maxBytes="0" means no upper bound
}

// The opcode and operands of a <step> of type `type`, each attribute read only where the type has it.
void read_operands(const Source& src, const pugi::xml_node& st, const std::string& type, int64_t cnt, Instruction& in) {
  auto sref = [&] { return Ref{buffer_attr(src, st, "srcbuf"), int_attr(src, st, "srcoff", true), cnt}; };
  auto dref = [&] { return Ref{buffer_attr(src, st, "dstbuf"), int_attr(src, st, "dstoff", true), cnt}; };
  if (type == "nop") {
    in.op = Opcode::kNop;
  } else if (type == "s") {
    in.op = Opcode::kSend;
    in.srcs = {sref()};
    in.remote = dref();
  } else if (type == "r" || type == "rcs") {
    in.op = type == "r" ? Opcode::kRecv : Opcode::kRecvCopySend;
    in.dst = dref();
    in.remote = sref();
  } else if (type == "rrs") {
    in.op = Opcode::kRecvReduceSend;
    in.srcs = {sref()};
  } else if (type == "rrc" || type == "rrcs") {
    in.op = type == "rrc" ? Opcode::kRecvReduceCopy : Opcode::kRecvReduceCopySend;
    in.srcs = {sref()};
    in.dst = dref();
  } else if (type == "cpy") {
    in.op = Opcode::kCopy;
    in.srcs = {sref()};
    in.dst = dref();
  } else if (type == "re") {
    in.op = Opcode::kReduce;
    in.srcs = {dref(), sref()};
    in.dst = dref();
  } else {
    throw InvalidArgument(fmt::format("MSCCL XML line {}: unknown step type '{}'", src.line(st), type));
  }
}

// The next <step> of block b (threadblock of <gpu id=gpu> with peers send and recv).
Instruction read_step(const Source& src, const pugi::xml_node& st, int gpu, const Block& b, int send, int recv,
                      Warnings& warnings) {
  report_unknown(src, st, {"s", "type", "srcbuf", "srcoff", "dstbuf", "dstoff", "cnt", "depid", "deps", "hasdep"},
                 warnings);
  int64_t s = int_attr(src, st, "s", true);
  TUTTI_CHECK(s == static_cast<int64_t>(b.steps.size()), InvalidArgument,
              "MSCCL XML line {}: step s={} in tb {} of gpu {}, expected s={}", src.line(st), s, b.id, gpu, b.steps.size());
  std::string type = st.attribute("type").value();
  int64_t cnt = int_attr(src, st, "cnt", true);
  Instruction in;
  read_operands(src, st, type, cnt, in);
  if (sends(in.op)) {
    TUTTI_CHECK(send >= 0, InvalidArgument, "MSCCL XML line {}: step '{}' sends but tb {} has send=-1", src.line(st),
                type, b.id);
    in.send_peer = send;
  }
  if (receives(in.op)) {
    TUTTI_CHECK(recv >= 0, InvalidArgument, "MSCCL XML line {}: step '{}' receives but tb {} has recv=-1",
                src.line(st), type, b.id);
    in.recv_peer = recv;
  }
  int64_t depid = int_attr(src, st, "depid", false, -1), deps = int_attr(src, st, "deps", false, -1);
  if (depid >= 0) in.deps.push_back({depid, deps});
  return in;
}

// A <tb> of <gpu id=gpu>, with its steps.
Block read_tb(const Source& src, const pugi::xml_node& tb, int gpu, int nranks, Warnings& warnings) {
  report_unknown(src, tb, {"id", "send", "recv", "chan"}, warnings);
  Block b;
  b.id = int_attr(src, tb, "id", true);
  b.channel = int32_attr(src, tb, "chan", true);
  TUTTI_CHECK(b.channel >= 0 && b.channel < Limits::kChannels, InvalidArgument,
              "MSCCL XML line {}: <tb chan={}> (allowed 0..{})", src.line(tb), b.channel, Limits::kChannels - 1);
  int send = int32_attr(src, tb, "send", true);
  int recv = int32_attr(src, tb, "recv", true);
  TUTTI_CHECK(send >= -1 && send < nranks && recv >= -1 && recv < nranks, InvalidArgument,
              "MSCCL XML line {}: <tb send={} recv={}> outside -1..{}", src.line(tb), send, recv, nranks - 1);
  for (auto st : tb.children())
    if (element_named(src, st, "step", warnings)) b.steps.push_back(read_step(src, st, gpu, b, send, recv, warnings));
  return b;
}

// A <gpu> into its rank of p; seen marks the ids read so far.
void read_gpu(const Source& src, const pugi::xml_node& gpu, Plan& p, std::vector<bool>& seen, Warnings& warnings) {
  report_unknown(src, gpu, {"id", "i_chunks", "o_chunks", "s_chunks"}, warnings);
  int id = int32_attr(src, gpu, "id", true);
  TUTTI_CHECK(id >= 0 && id < p.nranks, InvalidArgument, "MSCCL XML line {}: <gpu id={}> outside 0..{}", src.line(gpu), id,
              p.nranks - 1);
  TUTTI_CHECK(!seen[id], InvalidArgument, "MSCCL XML line {}: <gpu id={}> appears twice", src.line(gpu), id);
  seen[id] = true;
  RankPlan& rp = p.ranks[id];
  rp.input_chunks = int_attr(src, gpu, "i_chunks", true);
  rp.output_chunks = int_attr(src, gpu, "o_chunks", true);
  rp.scratch_chunks = int_attr(src, gpu, "s_chunks", true);
  for (auto tb : gpu.children())
    if (element_named(src, tb, "tb", warnings)) rp.blocks.push_back(read_tb(src, tb, id, p.nranks, warnings));
}

Plan import_unchecked(const std::string& text, std::vector<std::string>* warning_list) {
  TUTTI_CHECK(text.size() <= Limits::kFileBytes, InvalidArgument, "MSCCL XML: {} bytes (at most {})", text.size(),
              Limits::kFileBytes);
  Source src{text};
  Warnings warnings{warning_list};
  pugi::xml_document doc;
  pugi::xml_parse_result res = doc.load_string(text.c_str());
  if (!res)
    throw InvalidArgument(fmt::format("MSCCL XML line {}: malformed XML: {}", src.line(res.offset), res.description()));
  pugi::xml_node algo = doc.child("algo");
  TUTTI_CHECK(algo, InvalidArgument, "MSCCL XML: no <algo> element at the top");
  for (auto n : doc.children()) element_named(src, n, "algo", warnings);  // warns about the others
  Plan p;
  read_algo(src, algo, p, warnings);
  p.ranks.resize(p.nranks);
  std::vector<bool> seen(p.nranks, false);
  for (auto gpu : algo.children())
    if (element_named(src, gpu, "gpu", warnings)) read_gpu(src, gpu, p, seen, warnings);
  for (int r = 0; r < p.nranks; ++r)
    TUTTI_CHECK(seen[r], InvalidArgument, "MSCCL XML: no <gpu id={}> although ngpus={}", r, p.nranks);
  check_limits(p);
  renumber_blocks(p);  // tb ids need not be 0..n-1; executors index blocks by id
  return p;
}

// MSCCL's spelling of a collective in <algo coll=...>.
std::string msccl_name(Collective c) {
  std::string s = to_string(c);
  std::erase(s, '_');
  return s;  // allreduce, allgather, reducescatter, alltoall, broadcast, reduce, gather, scatter
}

// A rank's step numbers in XML, which inserts nop chains (before a step of several dependencies) and
// re chains (for a reduce of several sources): new step numbers; hasdep per (block, new step).
struct XmlSteps {
  std::map<int64_t, std::vector<int64_t>> renumber;  // block id -> old step -> new step (its last emitted step)
  std::set<std::pair<int64_t, int64_t>> has_dep;

  explicit XmlSteps(const RankPlan& rp) {
    for (auto& b : rp.blocks) {
      int64_t n = 0;
      auto& v = renumber[b.id];
      for (auto& in : b.steps) {
        n += in.deps.size() > 1 ? static_cast<int64_t>(in.deps.size()) - 1 : 0;
        n += in.op == Opcode::kReduce ? static_cast<int64_t>(in.srcs.size()) - 2 : 0;
        v.push_back(n++);
      }
    }
    for (auto& b : rp.blocks)
      for (auto& in : b.steps)
        for (auto& d : in.deps) has_dep.insert({d.block, of(d)});
  }
  int64_t of(const Dep& d) const { return renumber.at(d.block).at(d.step); }
};

// The send and receive peer of block b of rank r (-1: none): an MSCCL threadblock has one of each.
std::pair<int, int> tb_peers(int r, const Block& b) {
  int send = -1, recv = -1;
  for (auto& in : b.steps) {
    TUTTI_CHECK(in.op != Opcode::kCompute, InvalidArgument, "rank {} block {}: compute steps have no MSCCL XML form", r, b.id);
    if (in.send_peer >= 0) {
      TUTTI_CHECK(send < 0 || send == in.send_peer, InvalidArgument,
                  "rank {} block {} sends to ranks {} and {}; an MSCCL threadblock has one send peer", r, b.id, send,
                  in.send_peer);
      send = in.send_peer;
    }
    if (in.recv_peer >= 0) {
      TUTTI_CHECK(recv < 0 || recv == in.recv_peer, InvalidArgument,
                  "rank {} block {} receives from ranks {} and {}; an MSCCL threadblock has one receive peer", r, b.id,
                  recv, in.recv_peer);
      recv = in.recv_peer;
    }
  }
  return {send, recv};
}

// Writes the <step> elements of one <tb>, numbering them from 0.
struct StepWriter {
  std::ostringstream& o;
  const XmlSteps& steps;
  int64_t block;
  int64_t s = 0;

  void operator()(const char* type, const Ref& sr, const Ref& dr, int64_t cnt, const Dep* dep) {
    int64_t depid = dep ? dep->block : -1;
    int64_t deps = dep ? steps.of(*dep) : -1;
    o << fmt::format(
        "      <step s=\"{}\" type=\"{}\" srcbuf=\"{}\" srcoff=\"{}\" dstbuf=\"{}\" dstoff=\"{}\" cnt=\"{}\" depid=\"{}\" "
        "deps=\"{}\" hasdep=\"{}\"/>\n",
        s, type, buffer_letter(sr.buffer), sr.index, buffer_letter(dr.buffer), dr.index, cnt, depid, deps,
        steps.has_dep.count({block, s}) ? 1 : 0);
    ++s;
  }
};

// A reduce of rank r's block b, depending on `last`.
void write_reduce(StepWriter& step, int r, const Block& b, const Instruction& in, const Dep* last) {
  // MSCCL's re is dst = dst (+) src: the first source must be dst; more become a re chain.
  std::vector<Ref> others;
  bool dst_first = in.srcs[0] == *in.dst;
  TUTTI_CHECK(dst_first || in.srcs.size() == 1, InvalidArgument,
              "rank {} block {}: reduce into {} that is not its first operand has no MSCCL XML form", r, b.id,
              in.dst->describe());
  for (size_t k = dst_first ? 1 : 0; k < in.srcs.size(); ++k) others.push_back(in.srcs[k]);
  TUTTI_CHECK(!others.empty(), InvalidArgument, "rank {} block {}: reduce of one operand", r, b.id);
  for (size_t k = 0; k < others.size(); ++k) step("re", others[k], *in.dst, in.count(), k + 1 == others.size() ? last : nullptr);
}

// One instruction of rank r's block b: a nop per dependency but its last, then its own step(s).
void write_instruction(StepWriter& step, int r, const Block& b, const Instruction& in) {
  const Ref none{BufferKind::kInput, -1, 0};
  for (size_t k = 0; k + 1 < in.deps.size(); ++k) step("nop", none, Ref{BufferKind::kOutput, -1, 0}, 0, &in.deps[k]);
  const Dep* last = in.deps.empty() ? nullptr : &in.deps.back();
  int64_t cnt = in.count();
  switch (in.op) {
    case Opcode::kNop: step("nop", none, Ref{BufferKind::kOutput, -1, 0}, 0, last); break;
    case Opcode::kSend: step("s", in.srcs[0], in.remote.value_or(in.srcs[0]), cnt, last); break;
    case Opcode::kRecv: step("r", in.remote.value_or(*in.dst), *in.dst, cnt, last); break;
    case Opcode::kRecvCopySend: step("rcs", in.remote.value_or(*in.dst), *in.dst, cnt, last); break;
    case Opcode::kRecvReduceSend: step("rrs", in.srcs[0], in.srcs[0], cnt, last); break;
    case Opcode::kRecvReduceCopy: step("rrc", in.srcs[0], *in.dst, cnt, last); break;
    case Opcode::kRecvReduceCopySend: step("rrcs", in.srcs[0], *in.dst, cnt, last); break;
    case Opcode::kCopy: step("cpy", in.srcs[0], *in.dst, cnt, last); break;
    case Opcode::kReduce: write_reduce(step, r, b, in, last); break;
    case Opcode::kCompute: break;
  }
}

void write_gpu(std::ostringstream& o, int r, const RankPlan& rp) {
  const XmlSteps steps(rp);
  o << fmt::format("  <gpu id=\"{}\" i_chunks=\"{}\" o_chunks=\"{}\" s_chunks=\"{}\">\n", r, rp.input_chunks,
                   rp.output_chunks, rp.scratch_chunks);
  for (auto& b : rp.blocks) {
    auto [send, recv] = tb_peers(r, b);
    o << fmt::format("    <tb id=\"{}\" send=\"{}\" recv=\"{}\" chan=\"{}\">\n", b.id, send, recv, b.channel);
    StepWriter step{o, steps, b.id};
    for (auto& in : b.steps) write_instruction(step, r, b, in);
    o << "    </tb>\n";
  }
  o << "  </gpu>\n";
}

}  // namespace

std::string export_msccl_xml(const Plan& p) {
  TUTTI_CHECK(p.states.empty(), InvalidArgument, "plan '{}' names state buffers ('{}', ...): MSCCL XML has only input, "
              "output and scratch", p.name, p.states.empty() ? "" : p.states[0].name);
  TUTTI_CHECK(p.collective != Collective::kCustom && p.collective != Collective::kSendRecv, InvalidArgument,
              "MSCCL XML has no collective for '{}'", to_string(p.collective));
  std::ostringstream o;
  const char* proto = p.protocol == Protocol::kLL ? "LL" : p.protocol == Protocol::kLL128 ? "LL128" : "Simple";
  o << fmt::format(
      "<algo name=\"{}\" proto=\"{}\" nchannels=\"{}\" nchunksperloop=\"{}\" ngpus=\"{}\" coll=\"{}\" inplace=\"{}\" "
      "outofplace=\"{}\" minBytes=\"{}\" maxBytes=\"{}\">\n",
      p.name, proto, std::max(p.channels(), 1), divides_chunks(p.collective) ? p.chunk_factor * p.nranks : p.chunk_factor,
      p.nranks, msccl_name(p.collective), p.inplace ? 1 : 0, p.inplace ? 0 : 1, p.min_bytes,
      p.max_bytes == UINT64_MAX ? std::string("18446744073709551615") : std::to_string(p.max_bytes));
  for (int r = 0; r < p.nranks; ++r) write_gpu(o, r, p.ranks[r]);
  o << "</algo>\n";
  return o.str();
}

}  // namespace tutti::plan
