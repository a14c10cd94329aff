#include "compiler/verify.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <map>
#include <set>

#include "core/error.hpp"

namespace tutti::plan {
namespace {


[[noreturn]] void fail(const char* property, const std::string& message) {
  throw InvalidArgument(fmt::format("verification failed: {}: {}", property, message));
}

struct Node {
  int rank;
  int block;  // index in ranks[rank].blocks
  int step;
};

struct ConnKey {
  int src, dst, channel;
  auto operator<=>(const ConnKey&) const = default;
};

struct Connection {
  int send_block = -1, recv_block = -1;
  std::vector<int> sends, recvs;  // node ids in order
};

class Checker {
 public:
  Checker(const Plan& p, const CollectiveSpec* spec) : p_(p), spec_(spec ? *spec : p.spec()) {}

  VerifyReport run(const VerifyOptions& opt) {
    index();
    structure();
    connections();
    VerifyReport rep;
    rep.steps = p_.steps();
    rep.blocks = p_.blocks();
    rep.channels = p_.channels();
    for (auto& r : p_.ranks) rep.max_chunks = std::max({rep.max_chunks, r.input_chunks, r.output_chunks, r.scratch_chunks});
    int64_t most = 1;
    for (auto& [k, c] : conns_) most = std::max<int64_t>(most, static_cast<int64_t>(c.sends.size()));
    rep.max_messages_per_connection = most;
    if (opt.fifo_depth > 0) {
      if (!simulate(opt.fifo_depth)) report_deadlock(opt.fifo_depth);
      rep.fifo_depth_needed = opt.fifo_depth;
    } else {
      if (!simulate(most)) report_deadlock(most);
      int64_t lo = 1, hi = most;  // hi works
      while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (simulate(mid)) hi = mid;
        else lo = mid + 1;
      }
      rep.fifo_depth_needed = hi;
      if (!simulate(hi)) report_deadlock(hi);  // leaves the final state of a completed run
    }
    postcondition();
    if (opt.check_hazards) rep.stable_sends = hazards();
    return rep;
  }

 private:
  std::string at(int node) const {
    const Node& n = nodes_[node];
    const Instruction& in = instr(node);
    std::string peers;
    if (in.recv_peer >= 0) peers += fmt::format(" from rank {}", in.recv_peer);
    if (in.send_peer >= 0) peers += fmt::format(" to rank {}", in.send_peer);
    return fmt::format("rank {} block {} step {} ({}{})", n.rank, p_.ranks[n.rank].blocks[n.block].id, n.step,
                       to_string(in.op), peers);
  }
  const Instruction& instr(int node) const {
    const Node& n = nodes_[node];
    return p_.ranks[n.rank].blocks[n.block].steps[n.step];
  }
  int channel(int node) const { return p_.ranks[nodes_[node].rank].blocks[nodes_[node].block].channel; }

  void index() {
    TUTTI_CHECK(static_cast<int>(p_.ranks.size()) == p_.nranks, InvalidArgument,
                "verification failed: structure: the plan lists {} ranks but says nranks={}", p_.ranks.size(), p_.nranks);
    const Collective c = p_.collective;
    const bool rooted = c == Collective::kBroadcast || c == Collective::kReduce || c == Collective::kGather ||
                        c == Collective::kScatter;
    if (rooted && (p_.root < 0 || p_.root >= p_.nranks))
      fail("structure", fmt::format("the {}'s root {} is not a rank (0..{})", to_string(c), p_.root, p_.nranks - 1));
    block_base_.resize(p_.nranks);
    node_base_.resize(p_.nranks);
    block_index_.resize(p_.nranks);
    for (int r = 0; r < p_.nranks; ++r) {
      block_base_[r] = total_blocks_;
      auto& blocks = p_.ranks[r].blocks;
      node_base_[r].resize(blocks.size());
      for (size_t b = 0; b < blocks.size(); ++b) {
        if (!block_index_[r].emplace(blocks[b].id, static_cast<int>(b)).second)
          fail("structure", fmt::format("rank {} has two blocks with id {}", r, blocks[b].id));
        node_base_[r][b] = static_cast<int>(nodes_.size());
        for (size_t s = 0; s < blocks[b].steps.size(); ++s)
          nodes_.push_back({r, static_cast<int>(b), static_cast<int>(s)});
        ++total_blocks_;
      }
    }
  }

  int64_t buffer_size(int rank, BufferKind b) const { return p_.size(rank, b); }

  std::string unit_text(BufferKind b) const {
    return p_.unit(b) ? fmt::format("{} element(s)", p_.unit(b)) : std::string("the call's chunk");
  }

  void check_ref(int node, const Ref& ref, int64_t count, const char* role) {
    int rank = nodes_[node].rank;
    if (ref.index < 0 || ref.count < 1 || ref.index + ref.count > buffer_size(rank, ref.buffer))
      fail("structure", fmt::format("{}: {} {} is out of range ({} has {} chunks on rank {})", at(node), role,
                                    ref.describe(), to_string(ref.buffer), buffer_size(rank, ref.buffer), rank));
    if (ref.count != count)
      fail("structure", fmt::format("{}: {} {} has {} chunks, the instruction moves {}", at(node), role, ref.describe(),
                                    ref.count, count));
  }

  void structure() {
    check_states();
    for (int node = 0; node < static_cast<int>(nodes_.size()); ++node) check_step(node);
  }

  // The plan's state buffers are its collective's.
  void check_states() {
    if (!p_.states.empty() && p_.collective != Collective::kCustom)
      fail("structure", fmt::format("the {} plan names state buffers: only custom collectives have them",
                                    to_string(p_.collective)));
    if (p_.states.size() != spec_.states.size())
      fail("structure", fmt::format("the plan has {} state buffer(s), its collective {}", p_.states.size(),
                                    spec_.states.size()));
    for (size_t k = 0; k < p_.states.size(); ++k)
      if (p_.states[k].chunks != spec_.states[k].chunks || p_.states[k].unit != spec_.states[k].unit)
        fail("structure", fmt::format("state buffer '{}' has {} chunk(s) of unit {} in the plan, {} of unit {} in the "
                                      "collective",
                                      p_.states[k].name, p_.states[k].chunks, p_.states[k].unit, spec_.states[k].chunks,
                                      spec_.states[k].unit));
  }

  void check_step(int node) {
    const Instruction& in = instr(node);
    const Opcode op = in.op;
    check_operands(node);
    int64_t count = in.count();
    if (op != Opcode::kNop && count < 1) fail("structure", fmt::format("{}: moves no chunks", at(node)));
    for (auto& s : in.srcs) check_ref(node, s, count, "source");
    check_units(node);
    for (const Ref& w : in.writes()) {
      check_ref(node, w, count, "destination");
      // NCCL's sendbuff is const: out-of-place collectives must leave the input as it was.
      if (w.buffer == BufferKind::kInput && !p_.inplace && p_.collective != Collective::kCustom)
        fail("structure", fmt::format("{}: writes {} although the input of an out-of-place {} is read-only", at(node),
                                      w.describe(), to_string(p_.collective)));
    }
    check_peer(node, in.send_peer, sends(op), "send");
    check_peer(node, in.recv_peer, receives(op), "receive");
    for (const Dep& d : in.deps) check_dep(node, d);
  }

  // The number of sources and destinations the opcode (or a compute step's kernel) takes.
  void check_operands(int node) {
    const Instruction& in = instr(node);
    const Opcode op = in.op;
    size_t want_srcs = (op == Opcode::kSend || op == Opcode::kCopy || op == Opcode::kRecvReduceSend ||
                        op == Opcode::kRecvReduceCopy || op == Opcode::kRecvReduceCopySend)
                           ? 1
                           : 0;
    if (op == Opcode::kCompute) {  // the kernel's operands
      want_srcs = check_kernel_operands(node);
    } else if (!in.more_dsts.empty()) {
      fail("structure", fmt::format("{}: only compute steps have more than one destination", at(node)));
    }
    bool want_dst = stores(op);
    if (op == Opcode::kReduce) {
      if (in.srcs.empty()) fail("structure", fmt::format("{}: reduce needs at least one source", at(node)));
    } else if (in.srcs.size() != want_srcs) {
      fail("structure", fmt::format("{}: {} takes {} source(s), has {}", at(node), to_string(op), want_srcs, in.srcs.size()));
    }
    if (want_dst != in.dst.has_value())
      fail("structure", fmt::format("{}: {} {} a destination", at(node), to_string(op), want_dst ? "needs" : "takes no"));
  }

  // Checks a compute step's outputs and scalars against its kernel; returns the sources it takes.
  size_t check_kernel_operands(int node) {
    const Instruction& in = instr(node);
    const KernelDef& k = kernel_def(in.kernel);
    if (in.more_dsts.size() + 1 != static_cast<size_t>(k.outputs))
      fail("structure", fmt::format("{}: kernel '{}' has {} output(s), the step writes {}", at(node), k.name, k.outputs,
                                    in.more_dsts.size() + (in.dst ? 1 : 0)));
    if (in.scalars.size() != k.scalars.size())
      fail("structure", fmt::format("{}: kernel '{}' takes {} scalar(s), the step gives {}", at(node), k.name,
                                    k.scalars.size(), in.scalars.size()));
    return static_cast<size_t>(k.inputs);
  }

  // Data moves between chunks of one size; only a kernel that declares mixed units turns data
  // into a statistic (it checks its operands' lengths itself).
  void check_units(int node) {
    const Instruction& in = instr(node);
    if (in.op == Opcode::kCompute && kernel_def(in.kernel).mixed_units) return;
    std::vector<Ref> refs = in.srcs;
    for (const Ref& w : in.writes()) refs.push_back(w);
    for (const Ref& x : refs)
      if (p_.unit(x.buffer) != p_.unit(refs[0].buffer))
        fail("structure", fmt::format("{}: {} chunks hold {}, {} chunks {}", at(node), x.describe(), unit_text(x.buffer),
                                      refs[0].describe(), unit_text(refs[0].buffer)));
  }

  void check_peer(int node, int peer, bool wanted, const char* what) {
    const Opcode op = instr(node).op;
    const int rank = nodes_[node].rank;
    if (!wanted && peer >= 0) fail("structure", fmt::format("{}: {} has a {} peer", at(node), to_string(op), what));
    if (wanted && (peer < 0 || peer >= p_.nranks || peer == rank))
      fail("structure", fmt::format("{}: {} peer {} is not another rank of {}", at(node), what, peer, p_.nranks));
  }

  void check_dep(int node, const Dep& d) {
    const int rank = nodes_[node].rank;
    auto it = block_index_[rank].find(d.block);
    if (it == block_index_[rank].end())
      fail("structure", fmt::format("{}: depends on block {}, which rank {} does not have", at(node), d.block, rank));
    const Block& db = p_.ranks[rank].blocks[it->second];
    if (d.step < 0 || d.step >= static_cast<int64_t>(db.steps.size()))
      fail("structure", fmt::format("{}: depends on step {} of block {}, which has {} steps", at(node), d.step, d.block,
                                    db.steps.size()));
    if (it->second == nodes_[node].block && d.step >= nodes_[node].step)
      fail("structure", fmt::format("{}: depends on step {} of its own block, which comes later", at(node), d.step));
  }

  int dep_node(int node, const Dep& d) const {
    int rank = nodes_[node].rank;
    return node_base_[rank][block_index_[rank].at(d.block)] + static_cast<int>(d.step);
  }

  void connections() {
    for (int node = 0; node < static_cast<int>(nodes_.size()); ++node) {
      const Instruction& in = instr(node);
      const int rank = nodes_[node].rank, block = nodes_[node].block;
      if (sends(in.op)) {
        Connection& c = conns_[{rank, in.send_peer, channel(node)}];
        if (c.send_block >= 0 && c.send_block != block)
          fail("matching", fmt::format("rank {} sends to rank {} on channel {} from blocks {} and {}: the order of their "
                                       "messages is undefined",
                                       rank, in.send_peer, channel(node), p_.ranks[rank].blocks[c.send_block].id,
                                       p_.ranks[rank].blocks[block].id));
        c.send_block = block;
        c.sends.push_back(node);
      }
      if (receives(in.op)) {
        Connection& c = conns_[{in.recv_peer, rank, channel(node)}];
        if (c.recv_block >= 0 && c.recv_block != block)
          fail("matching", fmt::format("rank {} receives from rank {} on channel {} in blocks {} and {}: the order is "
                                       "undefined",
                                       rank, in.recv_peer, channel(node), p_.ranks[rank].blocks[c.recv_block].id,
                                       p_.ranks[rank].blocks[block].id));
        c.recv_block = block;
        c.recvs.push_back(node);
      }
    }
    for (auto& [k, c] : conns_) {
      if (c.sends.size() != c.recvs.size())
        fail("matching", fmt::format("rank {} sends {} message(s) to rank {} on channel {}, rank {} receives {}", k.src,
                                     c.sends.size(), k.dst, k.channel, k.dst, c.recvs.size()));
      for (size_t i = 0; i < c.sends.size(); ++i) {
        int64_t a = instr(c.sends[i]).count(), b = instr(c.recvs[i]).count();
        if (a != b)
          fail("matching", fmt::format("message {} from rank {} to rank {} on channel {}: {} sends {} chunk(s), {} "
                                       "receives {}",
                                       i, k.src, k.dst, k.channel, at(c.sends[i]), a, at(c.recvs[i]), b));
        const BufferKind from = payload(instr(c.sends[i])), to = payload(instr(c.recvs[i]));
        if (p_.unit(from) != p_.unit(to))
          fail("matching", fmt::format("message {} from rank {} to rank {} on channel {}: {} sends chunks of {} ({}), {} "
                                       "receives chunks of {} ({})",
                                       i, k.src, k.dst, k.channel, at(c.sends[i]), unit_text(from), to_string(from),
                                       at(c.recvs[i]), unit_text(to), to_string(to)));
        matched_send_[c.recvs[i]] = c.sends[i];
      }
    }
  }

  // The buffer whose chunks a message carries (every operand of a transfer has the same unit).
  static BufferKind payload(const Instruction& in) { return in.dst ? in.dst->buffer : in.srcs.at(0).buffer; }

  // --- simulation ---------------------------------------------------------------------------
  struct State {
    std::vector<std::vector<Content>> in, out, scratch;
    std::vector<std::vector<std::vector<Content>>> states;  // [rank][state buffer][chunk]
  };
  Content& cell(int rank, BufferKind b, int64_t index) {
    Location l = spec_.canonical(rank, b, static_cast<int>(index));
    auto& v = is_state(l.buffer)                   ? st_.states[rank].at(static_cast<size_t>(state_index(l.buffer)))
              : l.buffer == BufferKind::kInput  ? st_.in[rank]
              : l.buffer == BufferKind::kOutput ? st_.out[rank]
                                                : st_.scratch[rank];
    if (l.index < 0 || l.index >= static_cast<int>(v.size()))
      fail("structure", fmt::format("rank {}: {}[{}] aliases {}[{}], outside that buffer", rank, to_string(b), index,
                                    to_string(l.buffer), l.index));
    return v[l.index];
  }

  std::vector<Content> read(int node, const Ref& ref) {
    std::vector<Content> v;
    for (int64_t k = 0; k < ref.count; ++k) {
      const Content& c = cell(nodes_[node].rank, ref.buffer, ref.index + k);
      if (c.empty())
        fail("data", fmt::format("{}: reads {}[{}], which holds nothing at that point", at(node),
                                 to_string(ref.buffer), ref.index + k));
      v.push_back(c);
    }
    return v;
  }

  bool simulate(int64_t depth) {
    st_ = State{};
    st_.in.resize(p_.nranks);
    st_.out.resize(p_.nranks);
    st_.scratch.resize(p_.nranks);
    st_.states.resize(p_.nranks);
    for (int r = 0; r < p_.nranks; ++r) {
      const RankPlan& rp = p_.ranks[r];
      st_.in[r].assign(rp.input_chunks, {});
      st_.out[r].assign(rp.output_chunks, {});
      st_.scratch[r].assign(rp.scratch_chunks, {});
      st_.states[r].resize(p_.states.size());
      for (size_t k = 0; k < p_.states.size(); ++k)
        for (int64_t i = 0; i < p_.states[k].chunks; ++i)
          st_.states[r][k].push_back(Content::of_state(r, static_cast<int>(k), static_cast<int>(i)));
      for (int i = 0; i < spec_.input_chunks(); ++i) {
        Location l = spec_.canonical(r, BufferKind::kInput, i);
        auto& v = l.buffer == BufferKind::kInput ? st_.in[r] : st_.out[r];
        if (l.index < static_cast<int>(v.size())) v[l.index] = spec_.precondition(r, i);
      }
    }
    pc_.assign(total_blocks_, 0);
    std::map<ConnKey, std::deque<std::vector<Content>>> fifo;
    order_.clear();
    bool progress = true;
    while (progress) {
      progress = false;
      for (int r = 0; r < p_.nranks; ++r) {
        for (size_t b = 0; b < p_.ranks[r].blocks.size(); ++b) {
          const Block& blk = p_.ranks[r].blocks[b];
          int& pc = pc_[block_base_[r] + b];
          while (pc < static_cast<int>(blk.steps.size())) {
            int node = node_base_[r][b] + pc;
            const Instruction& in = blk.steps[pc];
            bool ready = true;
            for (const Dep& d : in.deps) {
              int bi = block_index_[r].at(d.block);
              if (pc_[block_base_[r] + bi] <= d.step) ready = false;
            }
            ConnKey rk{in.recv_peer, r, blk.channel}, sk{r, in.send_peer, blk.channel};
            if (ready && receives(in.op) && fifo[rk].empty()) ready = false;
            if (ready && sends(in.op) && static_cast<int64_t>(fifo[sk].size()) >= depth) ready = false;
            if (!ready) break;
            execute(node, in, fifo[rk], fifo[sk]);
            order_.push_back(node);
            ++pc;
            progress = true;
          }
        }
      }
    }
    for (int g = 0; g < total_blocks_; ++g)
      if (pc_[g] < block_size(g)) return false;
    return true;
  }

  int block_size(int global_block) const {
    int r = static_cast<int>(std::upper_bound(block_base_.begin(), block_base_.end(), global_block) - block_base_.begin()) - 1;
    return static_cast<int>(p_.ranks[r].blocks[global_block - block_base_[r]].steps.size());
  }

  void execute(int node, const Instruction& in, std::deque<std::vector<Content>>& rq,
               std::deque<std::vector<Content>>& sq) {
    const int rank = nodes_[node].rank;
    std::vector<Content> value;
    switch (in.op) {
      case Opcode::kNop: return;
      case Opcode::kSend: sq.push_back(read(node, in.srcs[0])); return;
      case Opcode::kCopy: value = read(node, in.srcs[0]); break;
      case Opcode::kCompute: {
        // Every input is read before any output is written (outputs may be inputs: in place).
        std::vector<std::vector<Content>> args;
        for (const Ref& s : in.srcs) args.push_back(read(node, s));
        const std::vector<Ref> outs = in.writes();
        for (size_t j = 0; j < outs.size(); ++j)
          for (int64_t k = 0; k < outs[j].count; ++k) {
            std::vector<Content> at_k;
            for (auto& a : args) at_k.push_back(a[static_cast<size_t>(k)]);
            cell(rank, outs[j].buffer, outs[j].index + k) = Content::apply(in.kernel, at_k, in.scalars, static_cast<int>(j));
          }
        return;
      }
      case Opcode::kReduce: {
        value = read(node, in.srcs[0]);
        for (size_t s = 1; s < in.srcs.size(); ++s) {
          auto more = read(node, in.srcs[s]);
          for (size_t k = 0; k < value.size(); ++k) value[k].merge(more[k]);
        }
        break;
      }
      default: {
        value = std::move(rq.front());
        rq.pop_front();
        if (in.op == Opcode::kRecvReduceSend || in.op == Opcode::kRecvReduceCopy || in.op == Opcode::kRecvReduceCopySend) {
          auto local = read(node, in.srcs[0]);
          for (size_t k = 0; k < value.size(); ++k) value[k].merge(local[k]);
        }
      }
    }
    if (in.dst)
      for (int64_t k = 0; k < in.dst->count; ++k) cell(rank, in.dst->buffer, in.dst->index + k) = value[k];
    if (sends(in.op)) sq.push_back(std::move(value));
  }

  void report_deadlock(int64_t depth) {
    // What each unfinished block waits for: another block (global index) and why.
    std::vector<int> waits(total_blocks_, -1);
    std::vector<std::string> why(total_blocks_);
    int start = -1;
    for (int r = 0; r < p_.nranks; ++r)
      for (size_t b = 0; b < p_.ranks[r].blocks.size(); ++b) {
        int g = block_base_[r] + static_cast<int>(b);
        const Block& blk = p_.ranks[r].blocks[b];
        if (pc_[g] >= static_cast<int>(blk.steps.size())) continue;
        int node = node_base_[r][b] + pc_[g];
        const Instruction& in = blk.steps[pc_[g]];
        start = g;
        for (const Dep& d : in.deps) {
          int bi = block_index_[r].at(d.block);
          if (pc_[block_base_[r] + bi] <= d.step) {
            waits[g] = block_base_[r] + bi;
            why[g] = fmt::format("{} waits for its dependency on step {} of block {}", at(node), d.step, d.block);
          }
        }
        if (waits[g] < 0 && receives(in.op)) {
          const Connection& c = conns_.at({in.recv_peer, r, blk.channel});
          waits[g] = block_base_[in.recv_peer] + c.send_block;
          why[g] = fmt::format("{} waits for a message that rank {} has not sent", at(node), in.recv_peer);
        }
        if (waits[g] < 0 && sends(in.op)) {
          const Connection& c = conns_.at({r, in.send_peer, blk.channel});
          waits[g] = block_base_[in.send_peer] + c.recv_block;
          why[g] = fmt::format("{} waits for room in the full FIFO to rank {}", at(node), in.send_peer);
        }
      }
    std::vector<int> seen(total_blocks_, -1);
    int g = start, k = 0;
    std::vector<int> path;
    while (g >= 0 && seen[g] < 0) {
      seen[g] = k++;
      path.push_back(g);
      g = waits[g];
    }
    std::string cycle;
    if (g >= 0)
      for (size_t i = static_cast<size_t>(seen[g]); i < path.size(); ++i) cycle += "\n  " + why[path[i]];
    else
      for (int p : path) cycle += "\n  " + why[p];
    fail("deadlock", fmt::format("with FIFOs of {} message(s), the plan stops; cycle of waits:{}", depth, cycle));
  }

  void postcondition() {
    for (int r = 0; r < p_.nranks; ++r)
      for (int i = 0; i < spec_.output_chunks(); ++i) {
        auto want = spec_.postcondition(r, i);
        if (!want) continue;
        const Content& got = cell(r, BufferKind::kOutput, i);
        if (got != *want)
          fail("postcondition", fmt::format("rank {} output[{}] ends up holding {} but {} needs {}", r, i, got.describe(),
                                            to_string(p_.collective), want->describe()));
      }
    for (int r = 0; r < p_.nranks; ++r)
      for (size_t k = 0; k < spec_.states.size(); ++k)
        for (int i = 0; i < spec_.states[k].chunks; ++i) {
          auto want = spec_.state_postcondition(r, static_cast<int>(k), i);
          if (!want) continue;
          const Content& got = cell(r, state_buffer(static_cast<int>(k)), i);
          if (got != *want)
            fail("postcondition", fmt::format("rank {} state '{}'[{}] ends up holding {} but the collective needs {}", r,
                                              spec_.states[k].name, i, got.describe(), want->describe()));
        }
  }

  // --- hazards ------------------------------------------------------------------------------
  // Vector clocks over all blocks: row(node)[g] counts the steps of global block g that happen
  // before node, node included.
  struct Clocks {
    size_t blocks;
    std::vector<int32_t> vc;
    int32_t* row(int node) { return vc.data() + static_cast<size_t>(node) * blocks; }
    const int32_t* row(int node) const { return vc.data() + static_cast<size_t>(node) * blocks; }
  };

  // Accesses by (rank, location): (node, whether it writes), in execution order.
  using Accesses = std::map<std::tuple<int, int, int>, std::vector<std::pair<int, bool>>>;

  // Fails on the first race; returns the sends whose sources are stable (see VerifyReport).
  std::vector<VerifyReport::At> hazards() {
    const Clocks clocks = vector_clocks();
    const Accesses access = accesses();
    check_races(clocks, access);
    return stable_sends(clocks, access);
  }

  // Filled in the order the simulation executed the nodes (which respects program order,
  // dependencies and messages).
  Clocks vector_clocks() const {
    Clocks c{static_cast<size_t>(total_blocks_), {}};
    c.vc.assign(nodes_.size() * c.blocks, 0);
    auto join = [&](int32_t* dst, const int32_t* src) {
      for (size_t i = 0; i < c.blocks; ++i) dst[i] = std::max(dst[i], src[i]);
    };
    for (int node : order_) {
      const Node& n = nodes_[node];
      int32_t* v = c.row(node);
      if (n.step > 0) join(v, c.row(node - 1));
      for (const Dep& d : instr(node).deps) join(v, c.row(dep_node(node, d)));
      auto m = matched_send_.find(node);
      if (m != matched_send_.end()) join(v, c.row(m->second));
      v[block_base_[n.rank] + n.block] = n.step + 1;
    }
    return c;
  }

  // Whether node a happens before node b.
  bool ordered(const Clocks& c, int a, int b) const {
    const Node& na = nodes_[a];
    return c.row(b)[block_base_[na.rank] + na.block] >= na.step + 1;
  }

  Accesses accesses() const {
    Accesses access;
    for (int node : order_) {
      const Instruction& in = instr(node);
      const int rank = nodes_[node].rank;
      auto touch = [&](const Ref& ref, bool write) {
        for (int64_t k = 0; k < ref.count; ++k) {
          Location l = spec_.canonical(rank, ref.buffer, static_cast<int>(ref.index + k));
          access[{rank, static_cast<int>(l.buffer), l.index}].push_back({node, write});
        }
      };
      for (auto& s : in.srcs) touch(s, false);
      for (const Ref& w : in.writes()) touch(w, true);
    }
    return access;
  }

  // Two accesses to a location from different blocks, at least one a write, must be ordered.
  void check_races(const Clocks& clocks, const Accesses& access) const {
    std::vector<int> position(nodes_.size());
    for (size_t i = 0; i < order_.size(); ++i) position[order_[i]] = static_cast<int>(i);
    for (auto& [loc, list] : access) {
      for (size_t i = 0; i < list.size(); ++i)
        for (size_t j = i + 1; j < list.size(); ++j) {
          auto [a, wa] = list[i];
          auto [b, wb] = list[j];
          if (!wa && !wb) continue;
          if (nodes_[a].block == nodes_[b].block) continue;
          if (position[a] > position[b]) std::swap(a, b), std::swap(wa, wb);
          if (!ordered(clocks, a, b)) report_race(loc, a, wa, b, wb);
        }
    }
  }

  [[noreturn]] void report_race(const std::tuple<int, int, int>& loc, int a, bool wa, int b, bool wb) const {
    const char* kind = wa && wb ? "write-after-write" : wa ? "read-after-write" : "write-after-read";
    fail("hazard", fmt::format("rank {} {}[{}]: {} {} and {} {} are not ordered by any dependency ({} race)",
                               std::get<0>(loc), to_string(static_cast<BufferKind>(std::get<1>(loc))), std::get<2>(loc),
                               at(a), wa ? "writes" : "reads", at(b), wb ? "writes" : "reads", kind));
  }

  // A send's source is stable when every write to its chunks happens before it. Every write is
  // ordered with it (no races, above), so one that is not before it comes after, possibly before
  // the peer has read the message: then the peer must read a copy.
  std::vector<VerifyReport::At> stable_sends(const Clocks& clocks, const Accesses& access) const {
    std::vector<VerifyReport::At> stable;
    for (int node = 0; node < static_cast<int>(nodes_.size()); ++node) {
      const Instruction& in = instr(node);
      if (in.op != Opcode::kSend || in.srcs.size() != 1) continue;
      if (source_stable(clocks, access, node)) stable.push_back({nodes_[node].rank, nodes_[node].block, nodes_[node].step});
    }
    return stable;
  }

  bool source_stable(const Clocks& clocks, const Accesses& access, int node) const {
    const Instruction& in = instr(node);
    const int rank = nodes_[node].rank;
    for (int64_t k = 0; k < in.srcs[0].count; ++k) {
      Location l = spec_.canonical(rank, in.srcs[0].buffer, static_cast<int>(in.srcs[0].index + k));
      auto it = access.find({rank, static_cast<int>(l.buffer), l.index});
      if (it == access.end()) continue;
      for (auto [other, write] : it->second)
        if (write && !ordered(clocks, other, node)) return false;
    }
    return true;
  }

  const Plan& p_;
  CollectiveSpec spec_;
  std::vector<Node> nodes_;
  std::vector<int> block_base_;
  std::vector<std::vector<int>> node_base_;
  std::vector<std::map<int64_t, int>> block_index_;
  int total_blocks_ = 0;
  std::map<ConnKey, Connection> conns_;
  std::map<int, int> matched_send_;
  State st_;
  std::vector<int> pc_;
  std::vector<int> order_;
};

}  // namespace

VerifyReport verify(const Plan& plan, const VerifyOptions& options) { return Checker(plan, options.spec).run(options); }

std::string VerifyReport::summary(const Plan& plan) const {
  return fmt::format(
      "verified {} '{}': {} ranks, chunk factor {}, {}; {} chunks max per buffer, {} steps in {} blocks on {} channel(s); "
      "deadlock-free with FIFOs of {} message(s) or more; postcondition holds; no hazards",
      to_string(plan.collective), plan.name, plan.nranks, plan.chunk_factor,
      plan.inplace ? "in-place" : "out-of-place", max_chunks, steps, blocks, channels, fifo_depth_needed);
}

VerifyReport certify(Plan& plan, const VerifyOptions& options) {
  VerifyReport report = verify(plan, options);
  plan.fifo_depth = std::max<int64_t>(1, report.fifo_depth_needed);
  plan.any_count = splits_any_count(plan);
  for (RankPlan& r : plan.ranks)
    for (Block& b : r.blocks)
      for (Instruction& in : b.steps) in.stable_source = false;
  for (const VerifyReport::At& at : report.stable_sends)
    plan.ranks[at.rank].blocks[at.block].steps[at.step].stable_source = true;
  return report;
}

}  // namespace tutti::plan
