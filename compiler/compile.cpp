#include "compiler/compile.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>

#include "core/error.hpp"

namespace tutti::plan {
namespace {


struct LInstr {
  Instruction ins;
  int channel = 0;
  int block_hint = -1;
  int priority = 0;
  bool dead = false;
  std::vector<Content> value;  // what it receives (recv-type) or sends (send): for cross-index fusion
  std::vector<int> deps;       // indices into the rank's list
};

Instruction make(Opcode op, std::vector<Ref> srcs, std::optional<Ref> dst) {
  Instruction in;
  in.op = op;
  in.srcs = std::move(srcs);
  in.dst = std::move(dst);
  return in;
}

struct UnionFind {
  std::vector<int> parent;
  int add() {
    parent.push_back(static_cast<int>(parent.size()));
    return parent.back();
  }
  int find(int x) { return parent[x] == x ? x : parent[x] = find(parent[x]); }
  void unite(int a, int b) { parent[find(a)] = find(b); }
};

class Lowering {
 public:
  explicit Lowering(const dsl::Program& p) : prog_(p), spec_(p.spec()), lists_(p.nranks()) {
    // Scratch buffers are laid out one after another on each rank.
    auto names = p.scratch_names();
    offsets_.resize(p.nranks());
    scratch_total_.assign(p.nranks(), 0);
    for (int r = 0; r < p.nranks(); ++r)
      for (auto& n : names) {
        offsets_[r][n] = scratch_total_[r];
        scratch_total_[r] += p.scratch_chunks(r, n);
      }
  }

  Plan run(bool fuse) {
    replay();
    // Dataflow order first, so fusion pairs a receive with the send that follows it in the schedule
    // the plan will run (not in the order the program happened to be written).
    for (int r = 0; r < prog_.nranks(); ++r) compute_deps(r);
    auto first = dataflow_order();
    for (int r = 0; r < prog_.nranks(); ++r) {
      std::vector<LInstr> sorted;
      for (int i : first[r]) sorted.push_back(std::move(lists_[r][i]));
      lists_[r] = std::move(sorted);
    }
    if (fuse)
      for (int r = 0; r < prog_.nranks(); ++r) {
        forward_copies(r);
        fuse_rank(r);
      }
    Plan plan;
    plan.name = prog_.name();
    plan.collective = spec_.kind;
    plan.nranks = spec_.nranks;
    plan.chunk_factor = spec_.chunk_factor;
    plan.inplace = spec_.inplace;
    plan.root = spec_.root;
    for (const StateBufferSpec& b : spec_.states) plan.states.push_back(StateBuffer{b.name, b.chunks, b.unit});
    for (int r = 0; r < prog_.nranks(); ++r) compute_deps(r);
    auto order = dataflow_order();
    for (int r = 0; r < prog_.nranks(); ++r) plan.ranks.push_back(build_rank(r, order[r]));
    return plan;
  }

 private:
  using Cell = std::pair<int, int64_t>;  // canonical (buffer, index)

  Ref ref(const dsl::ChunkLoc& l) const {
    Ref r{l.buffer.kind, l.index, l.count};
    if (l.buffer.kind == BufferKind::kScratch) r.index += offsets_[l.rank].at(l.buffer.name);
    return r;
  }

  // Canonical (buffer, index) keys of a ref on a rank.
  std::vector<Cell> cells(int rank, const Ref& r) const {
    std::vector<Cell> v;
    for (int64_t k = 0; k < r.count; ++k) {
      Location l = spec_.canonical(rank, r.buffer, static_cast<int>(r.index + k));
      v.push_back({static_cast<int>(l.buffer), l.index});
    }
    return v;
  }

  // Replays the program, emitting instructions and remembering the data each message carries.
  void replay() {
    std::vector<std::map<std::pair<int, int64_t>, Content>> state(prog_.nranks());
    for (int r = 0; r < prog_.nranks(); ++r)
      for (int i = 0; i < spec_.input_chunks(); ++i) {
        auto c = cells(r, Ref{BufferKind::kInput, i, 1})[0];
        state[r][c] = spec_.precondition(r, i);
      }
    for (int r = 0; r < prog_.nranks(); ++r)
      for (size_t k = 0; k < spec_.states.size(); ++k)
        for (int i = 0; i < spec_.states[k].chunks; ++i)
          state[r][{static_cast<int>(state_buffer(static_cast<int>(k))), i}] = Content::of_state(r, static_cast<int>(k), i);
    auto read = [&](int rank, const Ref& r) {
      std::vector<Content> v;
      for (auto& c : cells(rank, r)) v.push_back(state[rank][c]);
      return v;
    };
    auto write = [&](int rank, const Ref& r, const std::vector<Content>& v) {
      auto cs = cells(rank, r);
      for (size_t k = 0; k < cs.size(); ++k) state[rank][cs[k]] = v[k];
    };
    for (const dsl::Op& op : prog_.ops()) {
      Ref src = ref(op.src), dst = ref(op.dst);
      int a = op.src.rank, b = op.dst.rank;
      int ch = std::max(op.annotations.channel, 0);
      auto emit = [&](int rank, Instruction in, std::vector<Content> value) {
        LInstr li;
        li.ins = std::move(in);
        li.channel = ch;
        li.block_hint = op.annotations.block;
        li.priority = op.annotations.priority;
        li.value = std::move(value);
        lists_[rank].push_back(std::move(li));
      };
      auto data = read(a, src);
      if (op.kind == dsl::OpKind::kCompute) {
        std::vector<Ref> ins, outs;
        for (const dsl::ChunkLoc& l : op.inputs) ins.push_back(ref(l));
        for (const dsl::ChunkLoc& l : op.outputs) outs.push_back(ref(l));
        Instruction in = make(Opcode::kCompute, ins, outs[0]);
        in.more_dsts.assign(outs.begin() + 1, outs.end());
        in.kernel = op.kernel;
        in.scalars = op.scalars;
        std::vector<std::vector<Content>> args;
        for (const Ref& r : ins) args.push_back(read(a, r));
        std::vector<std::vector<Content>> results(outs.size());
        for (size_t j = 0; j < outs.size(); ++j)
          for (size_t k = 0; k < args[0].size(); ++k) {
            std::vector<Content> at_k;
            for (auto& v : args) at_k.push_back(v[k]);
            results[j].push_back(Content::apply(in.kernel, at_k, in.scalars, static_cast<int>(j)));
          }
        emit(a, in, results[0]);
        for (size_t j = 0; j < outs.size(); ++j) write(a, outs[j], results[j]);
      } else if (a == b) {
        if (op.kind == dsl::OpKind::kCopy) {
          emit(a, make(Opcode::kCopy, {src}, dst), data);
          write(a, dst, data);
        } else {
          auto mine = read(b, dst);
          for (size_t k = 0; k < mine.size(); ++k) mine[k].merge(data[k]);
          emit(a, make(Opcode::kReduce, {dst, src}, dst), mine);
          write(a, dst, mine);
        }
      } else {
        Instruction s = make(Opcode::kSend, {src}, std::nullopt);
        s.send_peer = b;
        s.remote = dst;
        emit(a, s, data);
        Instruction rcv;
        rcv.recv_peer = a;
        rcv.remote = src;
        rcv.dst = dst;
        if (op.kind == dsl::OpKind::kCopy) {
          rcv.op = Opcode::kRecv;
          emit(b, rcv, data);
          write(b, dst, data);
        } else {
          rcv.op = Opcode::kRecvReduceCopy;
          rcv.srcs = {dst};
          auto mine = read(b, dst);
          for (size_t k = 0; k < mine.size(); ++k) mine[k].merge(data[k]);
          emit(b, rcv, data);
          write(b, dst, mine);
        }
      }
    }
  }

  bool checked_at_end(int rank, std::pair<int, int64_t> cell) const {
    // State buffers are the user's and outlive the call: what a program leaves there is its result.
    if (is_state(static_cast<BufferKind>(cell.first))) return true;
    if (cell.first != static_cast<int>(BufferKind::kOutput)) {
      // An input cell is checked only when it doubles as output (in-place).
      if (cell.first == static_cast<int>(BufferKind::kScratch)) return false;
      for (int i = 0; i < spec_.output_chunks(); ++i) {
        Location l = spec_.canonical(rank, BufferKind::kOutput, i);
        if (static_cast<int>(l.buffer) == cell.first && l.index == cell.second) return spec_.postcondition(rank, i).has_value();
      }
      return false;
    }
    return spec_.postcondition(rank, static_cast<int>(cell.second)).has_value();
  }

  // The source chunk a cell equals through a live copy (forward_copies, phase 1).
  struct Alias {
    Ref source;        // one chunk
    Cell source_cell;  // its cell
    int copy;          // the instruction that made the cell equal to it
  };

  // A send or reducing receive that could read the copies' sources instead of their destinations.
  struct Use {
    int instr;
    Ref source;
    std::set<int> copies;
    bool reducing;
  };

  struct Forwarding {
    std::vector<Use> uses;
    std::map<int, size_t> use_of;  // instruction -> index in uses
    std::vector<bool> redirect;    // per use

    bool redirected(int instr) const {
      auto it = use_of.find(instr);
      return it != use_of.end() && redirect[it->second];
    }

    // A reducing receive is redirected only when every copy it reads through is dead (a kept copy
    // must stay its destination's writer). Returns whether any use was demoted.
    bool demote_reducing(const std::set<int>& needed) {
      bool changed = false;
      for (size_t k = 0; k < uses.size(); ++k) {
        if (!uses[k].reducing || !redirect[k]) continue;
        for (int c : uses[k].copies)
          if (needed.count(c)) {
            redirect[k] = false;
            changed = true;
            break;
          }
      }
      return changed;
    }
  };

  // Copy propagation: after local copies X -> Y, a send of Y may send X and a reducing receive into
  // Y may take X as its operand (X is unchanged meanwhile), so neither waits for the copies. A copy
  // nothing else reads before its cells are overwritten, and whose final value does not matter, is
  // dead. Out-of-place plans start with such copies, one per chunk (input -> output); this removes a
  // full pass over the data from them. A use may span several chunks (halving-doubling sends half
  // the buffer at once): it is redirected when every cell it reads still equals a source cell and
  // those sources are consecutive chunks of one buffer.
  void forward_copies(int r) {
    auto& L = lists_[r];
    Forwarding fw = forwardable_uses(r);
    // Phase 2: a copy is needed when a cell it wrote is read, other than by a redirected use, before
    // it is overwritten, or matters at the end. A reducing receive is redirected only when every copy
    // it reads through is dead, so demoting one can make more copies needed: repeat until nothing
    // changes.
    fw.redirect.assign(fw.uses.size(), true);
    std::set<int> needed;
    for (bool changed = true; changed;) {
      needed = needed_copies(r, fw);
      changed = fw.demote_reducing(needed);
    }
    for (size_t k = 0; k < fw.uses.size(); ++k)
      if (fw.redirect[k]) L[fw.uses[k].instr].ins.srcs[0] = fw.uses[k].source;
    for (int i = 0; i < static_cast<int>(L.size()); ++i)
      if (forwardable_copy(r, L[i]) && !needed.count(i)) L[i].dead = true;
  }

  // A live local copy whose source and destination do not overlap: the kind forward_copies removes.
  bool forwardable_copy(int r, const LInstr& li) const {
    return !li.dead && li.ins.op == Opcode::kCopy && !overlaps(r, li.ins.srcs[0], *li.ins.dst);
  }

  // Phase 1 of forward_copies: which uses could read the sources instead.
  Forwarding forwardable_uses(int r) const {
    const auto& L = lists_[r];
    // alias[cell]: the source chunk a cell equals through a live copy, until either is written.
    std::map<Cell, Alias> alias;
    Forwarding fw;
    for (int j = 0; j < static_cast<int>(L.size()); ++j) {
      const LInstr& u = L[j];
      if (u.dead) continue;
      const bool send = u.ins.op == Opcode::kSend;
      const bool reducing = u.ins.op == Opcode::kRecvReduceCopy && u.ins.dst && u.ins.srcs[0] == *u.ins.dst;
      if (send || reducing) {
        std::set<int> copies;
        if (auto src = aliased_source(r, u, alias, copies)) {
          fw.use_of[j] = fw.uses.size();
          fw.uses.push_back({j, *src, copies, reducing});
        }
      }
      track_aliases(r, j, alias);
    }
    return fw;
  }

  // The consecutive source chunks that every cell u reads equals through copies on u's channel, if
  // there are such; `copies` collects those copies.
  std::optional<Ref> aliased_source(int r, const LInstr& u, const std::map<Cell, Alias>& alias,
                                    std::set<int>& copies) const {
    auto cs = cells(r, u.ins.srcs[0]);
    std::optional<Ref> src;
    for (size_t k = 0; k < cs.size(); ++k) {
      auto it = alias.find(cs[k]);
      if (it == alias.end() || lists_[r][it->second.copy].channel != u.channel) return std::nullopt;
      const Ref& x = it->second.source;
      if (k == 0) src = Ref{x.buffer, x.index, static_cast<int64_t>(cs.size())};
      else if (x.buffer != src->buffer || x.index != src->index + static_cast<int64_t>(k)) return std::nullopt;
      copies.insert(it->second.copy);
    }
    return src;
  }

  // Updates alias past instruction j: what it writes no longer equals anything, and a copy makes its
  // destination cells equal to its source chunks.
  void track_aliases(int r, int j, std::map<Cell, Alias>& alias) const {
    const LInstr& u = lists_[r][j];
    if (!u.ins.dst) return;
    std::set<Cell> w;
    for (const Ref& out : u.ins.writes())
      for (auto& cell : cells(r, out)) w.insert(cell);
    for (auto it = alias.begin(); it != alias.end();)
      it = w.count(it->first) || w.count(it->second.source_cell) ? alias.erase(it) : std::next(it);
    if (!forwardable_copy(r, u)) return;
    auto written = cells(r, *u.ins.dst);
    auto from = cells(r, u.ins.srcs[0]);
    for (int64_t k = 0; k < u.ins.dst->count; ++k) {
      Ref x{u.ins.srcs[0].buffer, u.ins.srcs[0].index + k, 1};
      alias[written[static_cast<size_t>(k)]] = {x, from[static_cast<size_t>(k)], j};
    }
  }

  // The forwardable copies still needed with the uses fw currently redirects.
  std::set<int> needed_copies(int r, const Forwarding& fw) const {
    const auto& L = lists_[r];
    std::set<int> needed;
    for (int i = 0; i < static_cast<int>(L.size()); ++i)
      if (forwardable_copy(r, L[i]) && copy_needed(r, i, fw)) needed.insert(i);
    return needed;
  }

  // Whether a cell copy i wrote is read, other than by a redirected use, before it is overwritten,
  // or matters at the end.
  bool copy_needed(int r, int i, const Forwarding& fw) const {
    const auto& L = lists_[r];
    std::set<Cell> live;
    for (auto& cell : cells(r, *L[i].ins.dst)) live.insert(cell);
    for (int j = i + 1; j < static_cast<int>(L.size()) && !live.empty(); ++j) {
      const LInstr& u = L[j];
      if (u.dead) continue;
      if (!fw.redirected(j) && any_cell(r, u.ins.srcs, [&](const Cell& c) { return live.count(c) > 0; })) return true;
      for (const Ref& out : u.ins.writes())
        for (auto& cell : cells(r, out)) live.erase(cell);
    }
    for (auto& cell : live)
      if (checked_at_end(r, cell)) return true;
    return false;
  }

  // Whether some cell of refs satisfies pred.
  template <class Pred>
  bool any_cell(int r, const std::vector<Ref>& refs, Pred pred) const {
    for (const Ref& x : refs)
      for (auto& c : cells(r, x))
        if (pred(c)) return true;
    return false;
  }

  bool overlaps(int r, const Ref& a, const Ref& b) const {
    auto ca = cells(r, a), cb = cells(r, b);
    for (auto& x : ca)
      for (auto& y : cb)
        if (x == y) return true;
    return false;
  }

  void fuse_rank(int r) {
    fuse_sends(r);
    drop_unused_stores(r);
  }

  // Folds each send into the receive that last stored the data it carries: recv + send become
  // recv_copy_send, recv_reduce_copy + send recv_reduce_copy_send.
  void fuse_sends(int r) {
    auto& L = lists_[r];
    std::map<Cell, int> last_write;
    for (int j = 0; j < static_cast<int>(L.size()); ++j) {
      LInstr& s = L[j];
      if (s.ins.op == Opcode::kSend) {
        const int target = fusion_target(r, j, last_write);
        if (target >= 0) {
          LInstr& rv = L[target];
          // A no-op for a receive into the send's own source; across indices the send now reads
          // the received location.
          s.ins.srcs[0] = *rv.ins.dst;
          rv.ins.op = rv.ins.op == Opcode::kRecv ? Opcode::kRecvCopySend : Opcode::kRecvReduceCopySend;
          rv.ins.send_peer = s.ins.send_peer;
          s.dead = true;
        }
      }
      if (!s.dead)
        for (const Ref& w : s.ins.writes())
          for (auto& c : cells(r, w)) last_write[c] = j;
    }
  }

  // The receive send j can be fused into, or -1.
  int fusion_target(int r, int j, const std::map<Cell, int>& last_write) const {
    const auto& L = lists_[r];
    const LInstr& s = L[j];
    auto cs = cells(r, s.ins.srcs[0]);
    auto w = last_write.find(cs[0]);
    if (w != last_write.end() && fusable(r, w->second, j, cs.size(), last_write) && L[w->second].ins.dst == s.ins.srcs[0])
      return w->second;
    // Across indices: a received location that still holds exactly the data this send carries.
    for (int i = j - 1; i >= 0; --i)
      if (receives(L[i].ins.op) && L[i].ins.dst && fusable(r, i, j, cs.size(), last_write)) {
        // Only a plain recv stores exactly what arrived, which is what `value` records.
        if (L[i].ins.op == Opcode::kRecv && L[i].value == s.value) return i;
      }
    return -1;
  }

  // Whether receive i, storing n cells, can take over send j.
  bool fusable(int r, int i, int j, size_t n, const std::map<Cell, int>& last_write) const {
    const auto& L = lists_[r];
    const LInstr& rv = L[i];
    const LInstr& s = L[j];
    if (rv.dead || rv.channel != s.channel || rv.block_hint != s.block_hint) return false;
    if (rv.ins.op != Opcode::kRecv && rv.ins.op != Opcode::kRecvReduceCopy) return false;
    auto rc = cells(r, *rv.ins.dst);
    if (rc.size() != n) return false;
    for (auto& c : rc)
      if (last_write.at(c) != i) return false;  // overwritten since
    // Moving the send back to i must not reorder it with other sends on its connection.
    for (int k = i + 1; k < j; ++k)
      if (!L[k].dead && sends(L[k].ins.op) && L[k].ins.send_peer == s.ins.send_peer && L[k].channel == s.channel)
        return false;
    return true;
  }

  // recv_reduce_copy_send whose stored value is never read before being overwritten.
  void drop_unused_stores(int r) {
    auto& L = lists_[r];
    for (int i = 0; i < static_cast<int>(L.size()); ++i) {
      LInstr& rv = L[i];
      if (rv.dead || rv.ins.op != Opcode::kRecvReduceCopySend || stored_value_used(r, i)) continue;
      rv.ins.op = Opcode::kRecvReduceSend;
      rv.ins.dst.reset();
    }
  }

  // Whether a later step reads a cell instruction i stores before one overwrites it, or the cell
  // matters at the end.
  bool stored_value_used(int r, int i) const {
    const auto& L = lists_[r];
    for (auto& c : cells(r, *L[i].ins.dst)) {
      auto is_c = [&](const Cell& x) { return x == c; };
      bool decided = false;
      for (int k = i + 1; k < static_cast<int>(L.size()) && !decided; ++k) {
        if (L[k].dead) continue;
        if (any_cell(r, L[k].ins.srcs, is_c)) return true;
        decided = any_cell(r, L[k].ins.writes(), is_c);
      }
      if (!decided && checked_at_end(r, c)) return true;
    }
    return false;
  }

  // Dependencies from data flow in program order (RAW, WAR, WAW on canonical cells).
  void compute_deps(int r) {
    auto& L = lists_[r];
    std::vector<int> live;
    for (int i = 0; i < static_cast<int>(L.size()); ++i)
      if (!L[i].dead) live.push_back(i);
    std::map<std::pair<int, int64_t>, int> last_write;
    std::map<std::pair<int, int64_t>, std::vector<int>> readers;
    for (int i : live) {
      LInstr& li = L[i];
      std::vector<int> deps;
      for (auto& s : li.ins.srcs)
        for (auto& c : cells(r, s))
          if (last_write.count(c)) deps.push_back(last_write[c]);
      for (const Ref& w : li.ins.writes())
        for (auto& c : cells(r, w)) {
          if (last_write.count(c)) deps.push_back(last_write[c]);
          for (int rd : readers[c]) deps.push_back(rd);
        }
      std::sort(deps.begin(), deps.end());
      deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
      std::erase(deps, i);
      li.deps = deps;
      for (auto& s : li.ins.srcs)
        for (auto& c : cells(r, s)) readers[c].push_back(i);
      for (const Ref& w : li.ins.writes())
        for (auto& c : cells(r, w)) {
          last_write[c] = i;
          readers[c].clear();
        }
    }
  }

  // The order of each rank's instructions inside its blocks: by dataflow depth (the longest chain of
  // dependencies and messages leading to it, across ranks), then program order. A program written
  // chunk by chunk (for each chunk: every step of the ring) would otherwise run chunk by chunk: the
  // order of messages on a connection follows the program, so a block waits for one chunk to go
  // around the ring before it may take the next. By depth, every rank first does its step-0 work on
  // all chunks, then step 1, ..., which is how a ring pipelines.
  //
  // 1. depth0: longest paths over local dependencies and send -> receive of each message.
  // 2. Each connection carries its messages in the order of depth0 of their sends (program order
  //    among equals); chain edges of weight 1 along that order, on the sending and on the receiving
  //    rank, make sends and receives of one connection strictly ordered the same way.
  // 3. Instructions sort by depth with those chains. If the chains close a cycle, the program's own
  //    message order is used instead, and if that cycles too, program order (the verifier then
  //    reports the deadlock).
  std::vector<std::vector<int>> dataflow_order() const {
    const int n = prog_.nranks();
    std::vector<std::vector<int>> live(n);
    std::vector<std::vector<int>> node_of(n);
    std::vector<std::pair<int, int>> nodes;  // (rank, index)
    for (int r = 0; r < n; ++r) {
      node_of[r].assign(lists_[r].size(), -1);
      for (int i = 0; i < static_cast<int>(lists_[r].size()); ++i)
        if (!lists_[r][i].dead) {
          live[r].push_back(i);
          node_of[r][i] = static_cast<int>(nodes.size());
          nodes.push_back({r, i});
        }
    }
    std::vector<std::tuple<int, int, int>> base;  // (from, to, weight)
    std::map<std::tuple<int, int, int>, std::vector<int>> sends, recvs;  // (from, to, channel) -> nodes in order
    for (int r = 0; r < n; ++r)
      for (int i : live[r]) {
        const LInstr& li = lists_[r][i];
        for (int d : li.deps) base.push_back({node_of[r][d], node_of[r][i], 1});
        if (li.ins.send_peer >= 0) sends[{r, li.ins.send_peer, li.channel}].push_back(node_of[r][i]);
        if (li.ins.recv_peer >= 0) recvs[{li.ins.recv_peer, r, li.channel}].push_back(node_of[r][i]);
      }
    // Messages of each connection: (send node, receive node) in program order.
    std::vector<std::vector<std::pair<int, int>>> messages;
    for (auto& [key, s] : sends) {
      auto it = recvs.find(key);
      if (it == recvs.end()) continue;
      messages.emplace_back();
      for (size_t k = 0; k < s.size() && k < it->second.size(); ++k) {
        messages.back().push_back({s[k], it->second[k]});
        base.push_back({s[k], it->second[k], 1});
      }
    }
    auto longest = [&](const std::vector<std::tuple<int, int, int>>& edges) {
      std::vector<std::vector<std::pair<int, int>>> out(nodes.size());
      std::vector<int> indegree(nodes.size(), 0), depth(nodes.size(), 0), ready;
      for (auto [from, to, w] : edges) {
        out[from].push_back({to, w});
        ++indegree[to];
      }
      for (size_t v = 0; v < nodes.size(); ++v)
        if (indegree[v] == 0) ready.push_back(static_cast<int>(v));
      size_t seen = 0;
      while (!ready.empty()) {
        int v = ready.back();
        ready.pop_back();
        ++seen;
        for (auto [to, w] : out[v]) {
          depth[to] = std::max(depth[to], depth[v] + w);
          if (--indegree[to] == 0) ready.push_back(to);
        }
      }
      if (seen != nodes.size()) depth.clear();
      return depth;
    };
    auto chained = [&](bool by_depth, const std::vector<int>& depth0) {
      auto edges = base;
      for (auto m : messages) {
        if (by_depth)
          std::stable_sort(m.begin(), m.end(), [&](auto& x, auto& y) { return depth0[x.first] < depth0[y.first]; });
        for (size_t k = 1; k < m.size(); ++k) {
          edges.push_back({m[k - 1].first, m[k].first, 1});
          edges.push_back({m[k - 1].second, m[k].second, 1});
        }
      }
      return longest(edges);
    };
    std::vector<int> depth0 = longest(base);
    if (depth0.empty()) return live;
    std::vector<int> depth = chained(true, depth0);
    if (depth.empty()) depth = chained(false, depth0);
    if (depth.empty()) return live;
    for (int r = 0; r < n; ++r)
      std::stable_sort(live[r].begin(), live[r].end(),
                       [&](int a, int b) { return depth[node_of[r][a]] < depth[node_of[r][b]]; });
    return live;
  }

  RankPlan build_rank(int r, const std::vector<int>& live) {
    auto& L = lists_[r];
    // Blocks: union of the keys each instruction uses.
    UnionFind uf;
    std::map<std::tuple<char, int, int>, int> keys;
    auto key = [&](char kind, int a, int b) {
      auto it = keys.find({kind, a, b});
      if (it != keys.end()) return it->second;
      int id = uf.add();
      keys[{kind, a, b}] = id;
      return id;
    };
    std::vector<int> rep(L.size(), -1);
    for (int i : live) {
      LInstr& li = L[i];
      std::vector<int> ks;
      if (li.block_hint >= 0) ks.push_back(key('b', li.block_hint, 0));
      if (li.ins.send_peer >= 0) ks.push_back(key('s', li.ins.send_peer, li.channel));
      if (li.ins.recv_peer >= 0) ks.push_back(key('r', li.ins.recv_peer, li.channel));
      if (ks.empty()) ks.push_back(key('l', li.channel, 0));
      for (size_t k = 1; k < ks.size(); ++k) uf.unite(ks[k], ks[0]);
      rep[i] = ks[0];
    }
    RankPlan rp;
    rp.input_chunks = spec_.input_chunks();
    rp.output_chunks = spec_.output_chunks();
    rp.scratch_chunks = scratch_total_[r];
    std::map<int, int> block_of_root;
    std::map<int, int> block_priority;
    std::vector<std::pair<int, int>> where(L.size(), {-1, -1});
    for (int i : live) {
      int root = uf.find(rep[i]);
      auto [it, fresh] = block_of_root.try_emplace(root, static_cast<int>(rp.blocks.size()));
      if (fresh) {
        Block b;
        b.id = it->second;
        b.channel = L[i].channel;
        rp.blocks.push_back(b);
      }
      Block& b = rp.blocks[it->second];
      TUTTI_CHECK(b.channel == L[i].channel, InvalidArgument,
                  "program '{}': rank {}: block {} would mix channels {} and {} (conflicting annotations)", prog_.name(), r,
                  b.id, b.channel, L[i].channel);
      where[i] = {it->second, static_cast<int>(b.steps.size())};
      Instruction in = L[i].ins;
      for (int d : L[i].deps)
        if (where[d].first != it->second) in.deps.push_back({where[d].first, where[d].second});
      std::sort(in.deps.begin(), in.deps.end());
      in.deps.erase(std::unique(in.deps.begin(), in.deps.end()), in.deps.end());
      b.steps.push_back(std::move(in));
      block_priority[it->second] = std::max(block_priority[it->second], L[i].priority);
    }
    // Higher-priority blocks first: executors visit blocks in this order, so their work starts
    // first when several are ready. Ids (and so dependencies) are unchanged.
    std::vector<size_t> order(rp.blocks.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return block_priority[a] > block_priority[b]; });
    std::vector<Block> sorted;
    for (size_t k : order) sorted.push_back(std::move(rp.blocks[k]));
    rp.blocks = std::move(sorted);
    return rp;
  }

  const dsl::Program& prog_;
  CollectiveSpec spec_;
  std::vector<std::vector<LInstr>> lists_;
  std::vector<std::map<std::string, int64_t>> offsets_;
  std::vector<int64_t> scratch_total_;
};

}  // namespace

Plan lower(const dsl::Program& program, bool fuse) { return Lowering(program).run(fuse); }

int64_t minimise_dependencies(Plan& plan) {
  int64_t removed = 0;
  for (auto& rp : plan.ranks) {
    const size_t B = rp.blocks.size();
    std::map<int64_t, size_t> index;
    for (size_t b = 0; b < B; ++b) index[rp.blocks[b].id] = b;
    // Local vector clocks, computed in a topological order of program order + dependencies.
    std::vector<std::vector<std::vector<int64_t>>> vc(B);
    for (size_t b = 0; b < B; ++b) vc[b].assign(rp.blocks[b].steps.size(), std::vector<int64_t>(B, 0));
    std::vector<size_t> pc(B, 0);
    bool progress = true;
    while (progress) {
      progress = false;
      for (size_t b = 0; b < B; ++b) {
        auto& steps = rp.blocks[b].steps;
        while (pc[b] < steps.size()) {
          Instruction& in = steps[pc[b]];
          bool ready = true;
          for (auto& d : in.deps) {
            auto it = index.find(d.block);
            if (it == index.end() || pc[it->second] <= static_cast<size_t>(d.step)) ready = false;
          }
          if (!ready) break;
          auto clock_of = [&](const Dep& d) -> const std::vector<int64_t>& { return vc[index.at(d.block)][d.step]; };
          std::vector<int64_t> base(B, 0);
          if (pc[b] > 0) base = vc[b][pc[b] - 1];
          std::vector<Dep> kept;
          for (size_t k = 0; k < in.deps.size(); ++k) {
            std::vector<int64_t> cover = base;
            for (size_t m = 0; m < in.deps.size(); ++m) {
              if (m == k) continue;
              bool still = m < k ? std::find(kept.begin(), kept.end(), in.deps[m]) != kept.end() : true;
              if (!still) continue;
              const auto& o = clock_of(in.deps[m]);
              for (size_t x = 0; x < B; ++x) cover[x] = std::max(cover[x], o[x]);
            }
            const Dep& d = in.deps[k];
            if (cover[index.at(d.block)] > d.step) ++removed;
            else kept.push_back(d);
          }
          in.deps = kept;
          std::vector<int64_t> mine = base;
          for (auto& d : in.deps) {
            const auto& o = clock_of(d);
            for (size_t x = 0; x < B; ++x) mine[x] = std::max(mine[x], o[x]);
          }
          mine[b] = static_cast<int64_t>(pc[b]) + 1;
          vc[b][pc[b]] = std::move(mine);
          ++pc[b];
          progress = true;
        }
      }
    }
  }
  return removed;
}

Plan replicate(const Plan& plan, int instances, InstancePolicy policy) {
  TUTTI_CHECK(instances >= 1, InvalidArgument, "instances must be at least 1, not {}", instances);
  if (instances == 1) return plan;
  TUTTI_CHECK(plan.states.empty(), InvalidArgument,
              "plan '{}' has state buffers ('{}', ...), which are the user's: it runs as one instance, not {}", plan.name,
              plan.states[0].name, instances);
  Plan out = plan;
  out.chunk_factor = plan.chunk_factor * instances;
  const int channels = std::max(plan.channels(), 1);
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    const RankPlan& src = plan.ranks[r];
    RankPlan& dst = out.ranks[r];
    dst.input_chunks = src.input_chunks * instances;
    dst.output_chunks = src.output_chunks * instances;
    dst.scratch_chunks = src.scratch_chunks * instances;
    dst.blocks.clear();
    int64_t next_id = 0;
    for (int j = 0; j < instances; ++j) {
      std::map<int64_t, int64_t> ids;
      for (auto& b : src.blocks) ids[b.id] = next_id++;
      auto map_ref = [&](Ref x) {
        int64_t size = x.buffer == BufferKind::kInput ? src.input_chunks
                       : x.buffer == BufferKind::kOutput ? src.output_chunks
                                                              : src.scratch_chunks;
        x.index = policy == InstancePolicy::kInterleaved ? x.index * instances + j * x.count : j * size + x.index;
        return x;
      };
      for (auto& b : src.blocks) {
        Block nb;
        nb.id = ids[b.id];
        nb.channel = b.channel * instances + j;
        (void)channels;
        for (auto in : b.steps) {
          for (auto& s : in.srcs) s = map_ref(s);
          if (in.dst) in.dst = map_ref(*in.dst);
          for (Ref& m : in.more_dsts) m = map_ref(m);
          // `remote` names a peer's location; its buffer sizes are the same on every rank here.
          if (in.remote) in.remote = map_ref(*in.remote);
          for (auto& d : in.deps) d.block = ids.at(d.block);
          nb.steps.push_back(std::move(in));
        }
        dst.blocks.push_back(std::move(nb));
      }
    }
  }
  return out;
}

Compiled compile(const dsl::Program& program, const CompileOptions& options) {
  program.check_postcondition();
  Compiled c;
  {
    Plan raw = lower(program, false);
    c.steps_before_fusion = raw.steps();
    c.blocks_before_fusion = raw.blocks();
  }
  c.plan = lower(program, options.fuse);
  minimise_dependencies(c.plan);
  c.plan = replicate(c.plan, options.instances, options.policy);
  // The program's protocol annotations decide the plan's protocol; they must agree.
  c.plan.protocol = options.protocol;
  std::set<Protocol> asked;
  for (const dsl::Op& op : program.ops())
    if (op.annotations.protocol != Protocol::kAuto) asked.insert(op.annotations.protocol);
  TUTTI_CHECK(asked.size() <= 1, InvalidArgument, "program '{}' annotates {} different protocols; a plan has one",
              program.name(), asked.size());
  if (!asked.empty()) c.plan.protocol = *asked.begin();
  c.plan.min_bytes = options.min_bytes;
  c.plan.max_bytes = options.max_bytes;
  VerifyOptions vo = options.verify;
  if (options.instances == 1 && !vo.spec) vo.spec = &program.spec();
  c.report = certify(c.plan, vo);
  return c;
}

}  // namespace tutti::plan
