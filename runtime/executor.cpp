#include "runtime/executor.hpp"

#include <algorithm>
#include <cstring>
#include <deque>

#include "core/element.hpp"
#include "core/env.hpp"
#include "core/error.hpp"
#include "runtime/instruction_semantics.hpp"
#include "runtime/trace.hpp"

namespace tutti {

static_assert(static_cast<int>(plan::Opcode::kSend) == 1 && static_cast<int>(plan::Opcode::kRecv) == 2 &&
                  static_cast<int>(plan::Opcode::kCopy) == 3 && static_cast<int>(plan::Opcode::kReduce) == 4 &&
                  static_cast<int>(plan::Opcode::kRecvCopySend) == 5 &&
                  static_cast<int>(plan::Opcode::kRecvReduceSend) == 6 &&
                  static_cast<int>(plan::Opcode::kRecvReduceCopy) == 7 &&
                  static_cast<int>(plan::Opcode::kRecvReduceCopySend) == 8 &&
                  static_cast<int>(plan::Opcode::kCompute) == 9,
              "instruction_semantics.hpp numbers opcodes like plan::Opcode");

std::shared_ptr<const PreparedPlan> PreparedPlan::make(plan::Plan p) {
  auto out = std::make_shared<PreparedPlan>();
  out->spec = p.spec();
  const int64_t C = p.chunk_factor;
  auto sub = [&](const plan::Ref& r) { return ((r.index % C) + C) % C; };
  std::map<std::tuple<int, int, int>, std::vector<int64_t>> sent, received;  // sub-index of each message
  for (int r = 0; r < p.nranks; ++r)
    for (auto& b : p.ranks[r].blocks)
      for (auto& in : b.steps) {
        std::vector<const plan::Ref*> refs;
        for (auto& s : in.srcs) refs.push_back(&s);
        if (in.dst) refs.push_back(&*in.dst);
        for (auto* ref : refs)
          if (sub(*ref) != sub(*refs[0])) out->any_count = false;
        if (plan::sends(in.op)) sent[{r, in.send_peer, b.channel}].push_back(in.dst ? sub(*in.dst) : sub(in.srcs[0]));
        if (plan::receives(in.op))
          received[{in.recv_peer, r, b.channel}].push_back(in.dst ? sub(*in.dst) : sub(in.srcs[0]));
      }
  if (sent != received) out->any_count = false;
  out->block_index.resize(p.nranks);
  for (int r = 0; r < p.nranks; ++r)
    for (size_t b = 0; b < p.ranks[r].blocks.size(); ++b) out->block_index[r][p.ranks[r].blocks[b].id] = b;
  out->plan = std::move(p);
  return out;
}

Executor::Executor(Communicator& comm) : comm_(comm) {
  tile_ = static_cast<int64_t>(env::get_size("TUTTI_TILE_SIZE"));
  staging_slots_ = static_cast<int>(env::get_int("TUTTI_PIPELINE_DEPTH"));
  TUTTI_CHECK(tile_ >= 64, InvalidArgument, "TUTTI_TILE_SIZE must be at least 64 bytes");
  tile_ = tile_ / 64 * 64;  // a multiple of every element size
  TUTTI_CHECK(staging_slots_ >= 1, InvalidArgument, "TUTTI_PIPELINE_DEPTH must be at least 1");
}

namespace {

struct Run {
  const plan::Block* block;
  size_t pc = 0;
  bool started = false;
  // The current instruction.
  exec::OpShape shape{};
  int64_t bytes = 0, tiles = 0, elems_per_tile = 0;
  unsigned char* dst = nullptr;
  const unsigned char* local = nullptr;  // srcs[0] of reducing receives, or what a send sends
  Connection* rconn = nullptr;
  Connection* sconn = nullptr;
  int64_t recv_posted = 0, processed = 0, sends_posted = 0, sends_done = 0;
  std::deque<Ticket> recv_tickets, send_tickets;
  unsigned char* slots = nullptr;
  int64_t slot_bytes = 0;
  double started_us = 0;  // TUTTI_TRACE
};

}  // namespace

void Executor::run(const PreparedPlan& pp, const ExecArgs& args) {
  const plan::Plan& p = pp.plan;
  const int rank = comm_.rank();
  TUTTI_CHECK(p.nranks == comm_.size(), InvalidArgument, "plan '{}' is for {} ranks, the communicator has {}", p.name,
              p.nranks, comm_.size());
  TUTTI_CHECK(args.count >= 0, InvalidArgument, "negative count {}", args.count);
  TUTTI_CHECK(pp.any_count || args.count % p.chunk_factor == 0, InvalidArgument,
              "plan '{}' moves chunks between different positions and needs the count ({}) to be a multiple of {}",
              p.name, args.count, p.chunk_factor);
  const RedOp op = args.reduction.op;
  const DataType type = args.reduction.type;
  const int64_t esize = static_cast<int64_t>(size_of(type));
  exec::Geometry g{args.count, p.chunk_factor, esize};
  const plan::RankPlan& rp = p.ranks[rank];
  size_t scratch_bytes = rp.scratch_chunks > 0 ? static_cast<size_t>(g.chunk_end(rp.scratch_chunks - 1) * esize) : 0;
  if (scratch_.size() < scratch_bytes) scratch_.resize(scratch_bytes);
  comm_.ensure_channels(std::max(p.channels(), 1) + kPlanChannelBase);

  auto pointer = [&](const plan::Ref& ref) -> unsigned char* {
    dsl::Location l = pp.spec.canonical(rank, ref.buffer, static_cast<int>(ref.index));
    unsigned char* base = l.buffer == dsl::BufferKind::kInput    ? static_cast<unsigned char*>(const_cast<void*>(args.input))
                          : l.buffer == dsl::BufferKind::kOutput ? static_cast<unsigned char*>(args.output)
                                                                  : scratch_.data();
    return base + g.offset(l.index);
  };

  std::vector<Run> runs(rp.blocks.size());
  const std::map<int64_t, size_t>& index = pp.block_index[rank];
  for (size_t b = 0; b < rp.blocks.size(); ++b) runs[b].block = &rp.blocks[b];
  if (staging_.size() < runs.size()) staging_.resize(runs.size());
  size_t finished = 0;
  for (auto& r : runs)
    if (r.block->steps.empty()) ++finished;

  auto start = [&](size_t b) {
    Run& r = runs[b];
    const plan::Instruction& in = r.block->steps[r.pc];
    r.shape = exec::shape_of(static_cast<int>(in.op));
    r.recv_posted = r.processed = r.sends_posted = r.sends_done = 0;
    r.recv_tickets.clear();
    r.send_tickets.clear();
    int64_t n = in.count();
    const plan::Ref& any = in.dst ? *in.dst : in.srcs.empty() ? plan::Ref{} : in.srcs[0];
    r.bytes = n > 0 ? g.bytes(any.index, n) : 0;
    r.dst = in.dst ? pointer(*in.dst) : nullptr;
    switch (in.op) {
      case plan::Opcode::kNop: return true;
      case plan::Opcode::kCopy:
        if (r.bytes) std::memmove(r.dst, pointer(in.srcs[0]), static_cast<size_t>(r.bytes));
        return true;
      case plan::Opcode::kReduce: {
        std::vector<const void*> srcs;
        for (auto& s : in.srcs) srcs.push_back(pointer(s));
        combine_n(op, type, r.dst, srcs, static_cast<size_t>(r.bytes / esize));
        return true;
      }
      case plan::Opcode::kCompute: {
        const void* src = pointer(in.srcs[0]);
        if (in.kernel == static_cast<int>(dsl::Kernel::kScale)) {
          unsigned char scalar[8] = {};
          store_value(type, scalar, in.kernel_arg);
          scale(type, r.dst, src, scalar, static_cast<size_t>(r.bytes / esize));
        } else if (r.bytes) {
          std::memmove(r.dst, src, static_cast<size_t>(r.bytes));
        }
        return true;
      }
      default: break;
    }
    r.tiles = exec::tile_count(r.bytes, tile_);
    if (r.shape.recv) r.rconn = &comm_.connection(in.recv_peer, r.block->channel + kPlanChannelBase);
    if (r.shape.send) r.sconn = &comm_.connection(in.send_peer, r.block->channel + kPlanChannelBase);
    r.local = in.srcs.empty() ? nullptr : pointer(in.srcs[0]);
    if (in.op == plan::Opcode::kRecvReduceSend) {
      r.slot_bytes = std::min<int64_t>(tile_, std::max<int64_t>(r.bytes, 1));
      auto& st = staging_[b];
      size_t need = static_cast<size_t>(r.slot_bytes * staging_slots_);
      if (st.size() < need) st.resize(need);
      r.slots = st.data();
    }
    if (in.op == plan::Opcode::kSend) {
      for (int64_t t = 0; t < r.tiles; ++t)
        r.send_tickets.push_back(
            r.sconn->send(r.local + exec::tile_begin(t, tile_), static_cast<size_t>(exec::tile_bytes(t, r.bytes, tile_))));
      r.sends_posted = r.tiles;
    }
    return false;
  };

  // Advances the current instruction of block b; true when it completed.
  auto advance = [&](size_t b, bool& moved) {
    Run& r = runs[b];
    const plan::Instruction& in = r.block->steps[r.pc];
    if (r.shape.recv) {
      // Post receives: straight into dst, or into a staging slot once the slot is free again.
      int64_t released = in.op == plan::Opcode::kRecvReduceSend ? r.sends_done : r.processed;
      // Reducing receives combine straight out of the transport (recv_reduce): into dst when they
      // store, into a staging slot (kept until its send is done) when they only forward.
      bool staged = in.op == plan::Opcode::kRecvReduceSend;
      while (r.recv_posted < r.tiles && (!staged || r.recv_posted < released + staging_slots_)) {
        int64_t t = r.recv_posted;
        int64_t off = exec::tile_begin(t, tile_);
        size_t len = static_cast<size_t>(exec::tile_bytes(t, r.bytes, tile_));
        unsigned char* to = staged ? r.slots + (t % staging_slots_) * r.slot_bytes : r.dst + off;
        r.recv_tickets.push_back(r.shape.reduce_local ? r.rconn->recv_reduce(to, r.local + off, len, op, type)
                                                      : r.rconn->recv(to, len));
        ++r.recv_posted;
        moved = true;
      }
      while (!r.recv_tickets.empty() && r.rconn->recv_done(r.recv_tickets.front())) {
        r.recv_tickets.pop_front();
        int64_t t = r.processed;
        int64_t off = exec::tile_begin(t, tile_);
        size_t len = static_cast<size_t>(exec::tile_bytes(t, r.bytes, tile_));
        const unsigned char* out =
            in.op == plan::Opcode::kRecvReduceSend ? r.slots + (t % staging_slots_) * r.slot_bytes : r.dst + off;
        if (r.shape.send) {
          r.send_tickets.push_back(r.sconn->send(out, len));
          ++r.sends_posted;
        }
        ++r.processed;
        moved = true;
      }
    }
    while (!r.send_tickets.empty() && r.sconn->send_done(r.send_tickets.front())) {
      r.send_tickets.pop_front();
      ++r.sends_done;
      moved = true;
    }
    bool recv_done = !r.shape.recv || r.processed == r.tiles;
    bool send_done = !r.shape.send || r.sends_done == r.tiles;
    return recv_done && send_done;
  };

  const bool tracing = trace::enabled();
  auto traced = [&](const Run& r) {
    const plan::Instruction& in = r.block->steps[r.pc];
    trace::record(rank, r.block->id, plan::to_string(in.op), r.started_us, trace::now_us(), r.bytes,
                  in.send_peer >= 0 ? in.send_peer : in.recv_peer, p.name);
  };
  auto step = [&](bool& done) {
    bool moved = false;
    for (size_t b = 0; b < runs.size(); ++b) {
      Run& r = runs[b];
      while (r.pc < r.block->steps.size()) {
        if (!r.started) {
          bool ready = true;
          for (auto& d : r.block->steps[r.pc].deps) {
            const Run& o = runs[index.at(d.block)];
            if (o.pc <= static_cast<size_t>(d.step)) ready = false;
          }
          if (!ready) break;
          moved = true;
          r.started = true;
          if (tracing) r.started_us = trace::now_us();
          if (start(b)) {
            if (tracing) traced(r);
            r.started = false;
            ++r.pc;
            if (r.pc == r.block->steps.size()) ++finished;
            continue;
          }
        }
        if (!advance(b, moved)) break;
        if (tracing) traced(r);
        r.started = false;
        ++r.pc;
        moved = true;
        if (r.pc == r.block->steps.size()) ++finished;
      }
    }
    done = finished == runs.size();
    return moved;
  };
  comm_.engine().run(step, [&] {
    // Every unfinished block and what it waits for: the message a timeout or abort reports.
    std::string where;
    int shown = 0;
    for (auto& r : runs) {
      if (r.pc >= r.block->steps.size()) continue;
      if (shown++ == 8) {
        where += "; ...";
        break;
      }
      const plan::Instruction& in = r.block->steps[r.pc];
      std::string state = !r.started ? "waiting for its dependencies"
                                     : fmt::format("{} of {} tile(s) received, {} sent", r.processed, r.tiles, r.sends_done);
      std::string peers;
      if (in.recv_peer >= 0) peers += fmt::format(" from rank {}", in.recv_peer);
      if (in.send_peer >= 0) peers += fmt::format(" to rank {}", in.send_peer);
      where += fmt::format("{}block {} step {} ({}{}, channel {}): {}", where.empty() ? "" : "; ", r.block->id, r.pc,
                           plan::to_string(in.op), peers, r.block->channel, state);
    }
    return fmt::format("running plan '{}' for {} [{}]", p.name, dsl::to_string(p.collective), where);
  });
}

}  // namespace tutti
