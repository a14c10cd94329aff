#include "runtime/cpu_executor.hpp"

#include "tutti/kernel.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <exception>
#include <fstream>
#include <mutex>
#include <set>
#include <span>
#include <thread>

#include "core/copy.hpp"
#include "core/element.hpp"
#include "core/env.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "runtime/huge_pages.hpp"
#include "plan/semantics.hpp"
#include "runtime/trace.hpp"

namespace tutti {

namespace executor_detail {

// A send whose buffer the transport may still read.
struct PendingSend {
  Connection* conn;
  Ticket ticket;
  const unsigned char* begin;
  const unsigned char* end;
  size_t step;
};

// A compute step's operands and scalars, as its kernel gets them.
struct KernelCall {
  const KernelDef* kernel = nullptr;
  std::vector<const void*> ins;
  std::vector<void*> outs;
  std::vector<int64_t> counts;  // inputs, then outputs
  std::vector<double> values;
  KernelArgs args{};
};

// A reduction's epilogue run on the ranges of its receive as they are combined (KernelDef::stream,
// streamed_epilogues): the receive's tiles land in order at base, so the ranges follow each other.
// Ranges are passed on in whole multiples of 64 elements; the rest, with the statistics, waits for
// the compute step (finish).
class StreamedEpilogue final : public ReceiveEpilogue {
 public:
  plan::Dep compute{};  // the step that finishes it
  KernelCall call;
  bool open = false;    // the receive of this call streams it (its operands passed open_epilogue's check)

  void begin(unsigned char* base, int64_t esize) {
    base_ = base;
    esize_ = esize;
    written_ = done_ = 0;
    state_.assign(call.kernel->stream_state, 0);
    call.kernel->stream(call.args, state_.data(), 0, 0, false);
  }
  void written(unsigned char* data, size_t bytes) override {
    if (data != base_ + written_ * esize_)
      throw InternalError(fmt::format("kernel '{}' streamed over a receive: a range arrived at element {}, expected {}",
                                      call.kernel->name, (data - base_) / esize_, written_));
    written_ += static_cast<int64_t>(bytes) / esize_;
    const int64_t to = written_ / 64 * 64;
    if (to > done_) {
      call.kernel->stream(call.args, state_.data(), done_, to, false);
      done_ = to;
    }
  }
  void finish() { call.kernel->stream(call.args, state_.data(), done_, call.args.count, true); }

 private:
  unsigned char* base_ = nullptr;
  int64_t esize_ = 1, written_ = 0, done_ = 0;
  std::vector<unsigned char> state_;
};

struct Run {
  const plan::Block* block = nullptr;
  // Per step: the streamed epilogue a receive opens or a compute step finishes (streamed_epilogues).
  std::vector<StreamedEpilogue*> epilogues;
  StreamedEpilogue* epilogue_at_pc() const { return epilogues.empty() ? nullptr : epilogues[pc]; }
  int worker = 0;
  size_t pc = 0;                  // steps [0, pc) are issued
  std::atomic<size_t> retired{0};  // steps [0, retired) are issued and their sends are done or owned
  std::atomic<size_t> wanted{0};   // a step of some block waits for steps [0, wanted) to retire
  // A region this block's next move waits for pending sends of the block to release.
  const unsigned char* need_begin = nullptr;
  const unsigned char* need_end = nullptr;
  bool started = false;
  // The current instruction.
  plan::OpShape shape{};
  bool stream = false;  // a plain receive or copy into a large user buffer: written around the caches
  int64_t bytes = 0, tiles = 0;
  unsigned char* dst = nullptr;
  const unsigned char* local = nullptr;  // srcs[0] of reducing receives, or what a send sends
  Connection* rconn = nullptr;
  Connection* sconn = nullptr;
  int64_t recv_posted = 0, processed = 0;
  std::deque<Ticket> recv_tickets;
  unsigned char* slots = nullptr;
  int64_t slot_bytes = 0;
  double started_us = 0;  // TUTTI_TRACE
  std::deque<PendingSend> pending;

  bool finished() const { return pc == block->steps.size(); }
  void reset() {
    pc = 0;
    retired.store(0, std::memory_order_relaxed);
    wanted.store(0, std::memory_order_relaxed);
    started = false;
    need_begin = need_end = nullptr;
    recv_tickets.clear();
    pending.clear();
  }
  // Whether a pending send still reads [b, e).
  bool busy(const unsigned char* b, const unsigned char* e) const {
    for (auto& s : pending)
      if (s.begin < e && b < s.end) return true;
    return false;
  }
};




// One call of a plan on this rank: the state machines of its blocks and what they share. A worker
// drives its blocks with step() until they are done, copies sends something waits for into
// connection-owned memory with relieve() when nothing else moves, and stall() says what its
// blocks wait for when a timeout or abort ends the call.
class BlockMachine {
 public:
  struct Call {
    Communicator& comm;
    const PreparedPlan& pp;
    const ExecArgs& args;
    unsigned char* scratch;
    bool stream_output;  // large outputs are written around the caches
    bool stream_epilogues;  // TUTTI_STREAM_EPILOGUES
    Run* runs;
    size_t nruns;
    int nworkers;
    const std::vector<std::vector<Connection*>>& conns;  // per worker
    std::vector<std::vector<unsigned char>>& staging;    // per block
    int64_t tile;
    int staging_slots;
    Doorbell* bell;
    std::atomic<bool>& failed;  // another worker of this rank threw
  };
  explicit BlockMachine(const Call& c)
      : comm(c.comm),
        pp(c.pp),
        p(c.pp.plan),
        rank(c.comm.rank()),
        op(c.args.reduction.op),
        type(c.args.reduction.type),
        esize(static_cast<int64_t>(size_of(type))),
        g{c.args.count, p.chunk_factor, esize},
        args(c.args),
        scratch(c.scratch),
        stream_output(c.stream_output),
        stream_epilogues(c.stream_epilogues),
        runs(c.runs),
        nruns(c.nruns),
        nworkers(c.nworkers),
        conns(c.conns),
        staging(c.staging),
        tile(c.tile),
        staging_slots(c.staging_slots),
        bell(c.bell),
        failed(c.failed),
        tracing(trace::enabled()),
        faults(c.comm.faults()) {}

  // One pass over the worker's blocks: starts what is ready, advances transfers, retires steps.
  // Returns whether anything moved; `done` when every block of the worker is retired.
  bool step(int worker, bool& done);
  bool relieve(int worker);
  std::string stall(int worker) const;

 private:
  static constexpr int kPlanChannelBase = CpuExecutor::kPlanChannelBase;
  // Starts the current instruction of block b. Local instructions complete here (true); transfers
  // post what they can and complete in advance().
  bool start(size_t b);
  // Advances the current transfer of block b; true when it is issued (every tile received and
  // every outgoing tile posted).
  bool advance(size_t b, bool& moved);
  // Drops finished sends and publishes how far block b is retired; true if that moved.
  bool retire(Run& r);
  void traced(const Run& r) const {
    const plan::Instruction& in = r.block->steps[r.pc];
    trace::record(rank, r.block->id, plan::to_string(in.op), r.started_us, trace::now_us(), r.bytes,
                  in.send_peer >= 0 ? in.send_peer : in.recv_peer, p.name);
  }
  unsigned char* pointer(const plan::Ref& ref) const {
    if (is_state(ref.buffer)) {
      auto* base = static_cast<unsigned char*>(args.states[static_cast<size_t>(state_index(ref.buffer))]);
      const int64_t unit = p.unit(ref.buffer);
      return base + (unit ? ref.index * unit * esize : g.offset(ref.index));
    }
    Location l = pp.spec.canonical(rank, ref.buffer, static_cast<int>(ref.index));
    unsigned char* base = l.buffer == BufferKind::kInput    ? static_cast<unsigned char*>(const_cast<void*>(args.input))
                          : l.buffer == BufferKind::kOutput ? static_cast<unsigned char*>(args.output)
                                                            : scratch;
    return base + g.offset(l.index);
  }
  // Fills `call` for compute step `in` of block `r`: its operands' addresses and lengths, its scalars.
  void kernel_call(const Run& r, const plan::Instruction& in, KernelCall& call) const;
  // Opens `e` for the receive `r` is starting, if the compute step's operands are as
  // streamed_epilogues assumed: the chunk in place, and nothing else overlapping it.
  void open_epilogue(const Run& r, StreamedEpilogue& e);
  static ReceiveEpilogue* epilogue_of(const Run& r) {
    StreamedEpilogue* e = r.epilogue_at_pc();
    return e && e->open ? e : nullptr;
  }
  // Large outputs are written with non-temporal stores where nothing reads them back during the
  // call: plain receives and local copies into the user's buffers (never scratch, never the landing
  // place of a tile that is forwarded from there).
  int64_t bytes_of(const plan::Ref& ref) const {
    const int64_t unit = p.unit(ref.buffer);
    return unit ? ref.count * unit * esize : g.bytes(ref.index, ref.count);
  }
  bool streams(const plan::Ref& ref) const {
    const BufferKind b = pp.spec.canonical(rank, ref.buffer, static_cast<int>(ref.index)).buffer;
    return stream_output && b != BufferKind::kScratch && p.unit(b) == 0;
  }

  Communicator& comm;
  const PreparedPlan& pp;
  const plan::Plan& p;
  const int rank;
  const RedOp op;
  const DataType type;
  const int64_t esize;
  const exec::Geometry g;
  const ExecArgs& args;
  unsigned char* const scratch;
  const bool stream_output;
  const bool stream_epilogues;
  Run* const runs;
  const size_t nruns;
  const int nworkers;
  const std::vector<std::vector<Connection*>>& conns;
  std::vector<std::vector<unsigned char>>& staging;
  const int64_t tile;
  const int staging_slots;
  Doorbell* const bell;
  std::atomic<bool>& failed;
  const bool tracing;
  FaultInjector* const faults;              // TUTTI_FAULT, or null
  std::atomic<int64_t> started_steps{0};     // instructions this rank started in the call (for faults)
};

bool BlockMachine::start(size_t b) {
  Run& r = runs[b];
  const plan::Instruction& in = r.block->steps[r.pc];
  r.shape = plan::shape_of(in.op);
  r.recv_posted = r.processed = 0;
  r.recv_tickets.clear();
  int64_t n = in.count();
  const plan::Ref& any = in.dst ? *in.dst : in.srcs.empty() ? plan::Ref{} : in.srcs[0];
  r.bytes = n > 0 ? bytes_of(any) : 0;
  r.dst = in.dst ? pointer(*in.dst) : nullptr;
  switch (in.op) {
    case plan::Opcode::kNop: return true;
    case plan::Opcode::kCopy: {
      const unsigned char* src = pointer(in.srcs[0]);
      const size_t len = static_cast<size_t>(r.bytes);
      if (len == 0 || src == r.dst) return true;
      if (src + len > r.dst && r.dst + len > src) {  // overlapping: one memmove
        std::memmove(r.dst, src, len);
        return true;
      }
      // A large copy moves a tile per turn (advance), between the other blocks' transfers, so a
      // peer waiting for this rank's sends is served while it runs.
      r.stream = streams(*in.dst);
      r.local = src;
      r.tiles = exec::tile_count(r.bytes, tile);
      r.processed = 0;
      if (r.tiles > 1) return false;
      copy_bytes(r.dst, src, len, r.stream);
      return true;
    }
    case plan::Opcode::kReduce: {
      std::vector<const void*> srcs;
      for (auto& s : in.srcs) srcs.push_back(pointer(s));
      combine_n(op, type, r.dst, srcs, static_cast<size_t>(r.bytes / esize));
      return true;
    }
    case plan::Opcode::kCompute: {
      if (StreamedEpilogue* e = r.epilogue_at_pc(); e && e->open) {
        e->open = false;  // its receive ran the kernel on the chunk as it arrived
        e->finish();
        return true;
      }
      KernelCall call;
      kernel_call(r, in, call);
      call.kernel->cpu(call.args);
      return true;
    }
    default: break;
  }
  r.tiles = exec::tile_count(r.bytes, tile);
  r.stream = in.op == plan::Opcode::kRecv && in.dst && streams(*in.dst);
  if (r.shape.recv) r.rconn = &comm.connection(in.recv_peer, r.block->channel + kPlanChannelBase);
  if (r.shape.send) r.sconn = &comm.connection(in.send_peer, r.block->channel + kPlanChannelBase);
  r.local = in.srcs.empty() ? nullptr : pointer(in.srcs[0]);
  if (StreamedEpilogue* e = r.epilogue_at_pc(); stream_epilogues && e) open_epilogue(r, *e);
  if (in.op == plan::Opcode::kRecvReduceSend) {
    // Full-tile slots, allocated once: earlier forwards may still read them, so the buffer must
    // never move while the block runs.
    r.slot_bytes = tile;
    r.slots = staging[b].data();
  }
  if (in.op == plan::Opcode::kSend) {
    for (int64_t t = 0; t < r.tiles; ++t) {
      const unsigned char* from = r.local + exec::tile_begin(t, tile);
      int64_t len = exec::tile_bytes(t, r.bytes, tile);
      r.pending.push_back({r.sconn, r.sconn->send(from, static_cast<size_t>(len)), from, from + len, r.pc});
    }
    return true;
  }
  return false;
}

void BlockMachine::kernel_call(const Run& r, const plan::Instruction& in, KernelCall& call) const {
  const KernelDef& k = kernel_def(in.kernel);
  call.kernel = &k;
  for (const plan::Ref& s : in.srcs) call.ins.push_back(pointer(s));
  for (const plan::Ref& w : in.writes()) call.outs.push_back(pointer(w));
  for (const plan::Ref& s : in.srcs) call.counts.push_back(bytes_of(s) / esize);
  for (const plan::Ref& w : in.writes()) call.counts.push_back(bytes_of(w) / esize);
  for (const ScalarArg& a : in.scalars) {
    TUTTI_CHECK(a.slot < static_cast<int>(args.scalars.size()), InvalidArgument,
                "rank {}: plan '{}' block {} runs kernel '{}' with per-call scalar {}, but the call passes {} "
                "scalar(s)",
                rank, p.name, r.block->id, k.name, a.slot, args.scalars.size());
    call.values.push_back(a.slot >= 0 ? args.scalars[static_cast<size_t>(a.slot)] : a.value);
  }
  const plan::Ref& first = in.srcs[0];
  const int64_t unit = p.unit(first.buffer);
  const int64_t offset = unit ? first.index * unit : g.chunk_begin(first.index);
  call.args = KernelArgs{call.ins.data(), call.outs.data(), call.counts[0], type, call.values.data(),
                         call.counts.data(), call.counts.data() + in.srcs.size(), offset, &k};
}

void BlockMachine::open_epilogue(const Run& r, StreamedEpilogue& e) {
  e.open = false;
  KernelCall& call = e.call;
  call = KernelCall{};
  const Run& c = runs[static_cast<size_t>(e.compute.block)];
  kernel_call(c, c.block->steps[static_cast<size_t>(e.compute.step)], call);
  const unsigned char* begin = r.dst;
  const unsigned char* end = r.dst + r.bytes;
  if (call.ins[0] != begin || call.outs[0] != begin || call.counts[0] * esize != r.bytes) return;
  const size_t nins = call.ins.size();
  for (size_t i = 0; i < nins + call.outs.size(); ++i) {
    if (i == 0 || i == nins) continue;
    const auto* at = static_cast<const unsigned char*>(i < nins ? call.ins[i] : call.outs[i - nins]);
    if (at < end && begin < at + call.counts[i] * esize) return;  // an operand inside the chunk: a pass of its own
  }
  e.begin(r.dst, esize);
  e.open = true;
}

bool BlockMachine::advance(size_t b, bool& moved) {
  Run& r = runs[b];
  const plan::Instruction& in = r.block->steps[r.pc];
  if (in.op == plan::Opcode::kCopy) {  // a tiled local copy: one tile per turn
    int64_t t = r.processed++;
    int64_t at = exec::tile_begin(t, tile);
    copy_bytes(r.dst + at, r.local + at, static_cast<size_t>(exec::tile_bytes(t, r.bytes, tile)), r.stream);
    moved = true;
    return r.processed == r.tiles;
  }
  // Reducing receives combine straight out of the transport (recv_reduce): into dst when they
  // store, into a staging slot (free again once its forward is done or owned) when they only forward.
  const bool staged = in.op == plan::Opcode::kRecvReduceSend;
  auto landing = [&](int64_t t) {
    return staged ? r.slots + (t % staging_slots) * r.slot_bytes : r.dst + exec::tile_begin(t, tile);
  };
  while (r.recv_posted < r.tiles) {
    int64_t t = r.recv_posted;
    size_t len = static_cast<size_t>(exec::tile_bytes(t, r.bytes, tile));
    unsigned char* to = landing(t);
    if (staged && t - r.processed >= staging_slots) break;
    if (staged && r.busy(to, to + r.slot_bytes)) {
      r.need_begin = to;
      r.need_end = to + r.slot_bytes;
      break;
    }
    r.recv_tickets.push_back(r.shape.reduce_local
                                 ? r.rconn->recv_reduce(to, r.local + exec::tile_begin(t, tile), len, op, type,
                                                        epilogue_of(r))
                                 : r.rconn->recv(to, len, r.stream));
    ++r.recv_posted;
    moved = true;
  }
  while (!r.recv_tickets.empty() && r.rconn->recv_done(r.recv_tickets.front())) {
    r.recv_tickets.pop_front();
    int64_t t = r.processed;
    int64_t len = exec::tile_bytes(t, r.bytes, tile);
    const unsigned char* out = landing(t);
    if (r.shape.send) r.pending.push_back({r.sconn, r.sconn->send(out, static_cast<size_t>(len)), out, out + len, r.pc});
    ++r.processed;
    moved = true;
  }
  return r.processed == r.tiles;
}

bool BlockMachine::retire(Run& r) {
  while (!r.pending.empty() && r.pending.front().conn->send_done(r.pending.front().ticket)) r.pending.pop_front();
  std::erase_if(r.pending, [](const PendingSend& s) { return s.conn->send_done(s.ticket); });
  size_t upto = r.pc;
  if (!r.pending.empty()) upto = std::min(upto, r.pending.front().step);
  if (upto == r.retired.load(std::memory_order_relaxed)) return false;
  r.retired.store(upto, std::memory_order_release);
  if (nworkers > 1 && bell) ring(*bell);
  return true;
}

bool BlockMachine::step(int worker, bool& done) {
  if (failed.load(std::memory_order_relaxed)) throw InternalError("another worker of this rank failed");
  bool moved = false;
  done = true;
  for (size_t b = 0; b < nruns; ++b) {
    Run& r = runs[b];
    if (r.worker != worker) continue;
    r.need_begin = r.need_end = nullptr;
    while (!r.finished()) {
      const plan::Instruction& in = r.block->steps[r.pc];
      if (!r.started) {
        bool ready = true;
        for (auto& d : in.deps) {
          Run& o = runs[static_cast<size_t>(d.block)];
          if (o.retired.load(std::memory_order_acquire) <= static_cast<size_t>(d.step)) {
            ready = false;
            size_t want = static_cast<size_t>(d.step) + 1, had = o.wanted.load(std::memory_order_relaxed);
            while (had < want && !o.wanted.compare_exchange_weak(had, want, std::memory_order_relaxed)) {
            }
          }
        }
        // Write-after-read within the block: an earlier send may still read what this step writes.
        if (ready)
          for (const plan::Ref& w : in.writes()) {
            unsigned char* d = pointer(w);
            const int64_t bytes = w.count > 0 ? bytes_of(w) : 0;
            if (r.busy(d, d + bytes)) {
              ready = false;
              r.need_begin = d;
              r.need_end = d + bytes;
              break;
            }
          }
        if (!ready) break;
        if (faults) faults->at_step(comm, started_steps.fetch_add(1, std::memory_order_relaxed) + 1);
        moved = true;
        r.started = true;
        if (tracing) r.started_us = trace::now_us();
        if (start(b)) {
          if (tracing) traced(r);
          r.started = false;
          ++r.pc;
          // A kernel is the one long local step: after each, the other blocks (a send its result
          // feeds, a peer's message) and the connections get their turn before the next.
          if (in.op == plan::Opcode::kCompute) break;
          continue;
        }
      }
      if (!advance(b, moved)) break;
      if (tracing) traced(r);
      r.started = false;
      ++r.pc;
      moved = true;
    }
    moved |= retire(r);
    if (r.retired.load(std::memory_order_relaxed) != r.block->steps.size()) done = false;
  }
  // Sends made eager by own() must still reach the peer before the call returns: nothing else
  // drives this rank's connections between calls.
  if (done)
    for (Connection* c : conns[worker])
      if (c->sends_pending()) done = false;
  return moved;
}

bool BlockMachine::relieve(int worker) {
  bool freed = false;
  for (Run& r : std::span(runs, nruns)) {
    if (r.worker != worker || r.pending.empty()) continue;
    size_t wanted = r.wanted.load(std::memory_order_relaxed);
    size_t before = r.pending.size();
    std::erase_if(r.pending, [&](const PendingSend& s) {
      bool needed = s.step < wanted || (s.begin < r.need_end && r.need_begin < s.end);
      return needed && s.conn->own(s.ticket);
    });
    freed |= r.pending.size() != before;
  }
  return freed;
}

std::string BlockMachine::stall(int worker) const {
  // Every unfinished block of this worker and what it waits for: the message a timeout or abort reports.
  std::string where;
  int shown = 0;
  for (Run& r : std::span(runs, nruns)) {
    if (r.worker != worker || r.retired.load(std::memory_order_relaxed) == r.block->steps.size()) continue;
    if (shown++ == 8) {
      where += "; ...";
      break;
    }
    std::string state;
    if (r.finished()) {
      state = fmt::format("{} send(s) not taken by the peer yet", r.pending.size());
    } else {
      const plan::Instruction& in = r.block->steps[r.pc];
      bool deps_met = true;
      for (auto& d : in.deps)
        if (runs[static_cast<size_t>(d.block)].retired.load(std::memory_order_acquire) <= static_cast<size_t>(d.step))
          deps_met = false;
      state = !r.started ? (deps_met ? fmt::format("waiting for {} earlier send(s) of the block to release what it "
                                                   "overwrites",
                                                   r.pending.size())
                                     : std::string("waiting for its dependencies"))
                         : fmt::format("{} of {} tile(s) received, {} send(s) pending", r.processed, r.tiles,
                                       r.pending.size());
      std::string peers;
      if (in.recv_peer >= 0) peers += fmt::format(" from rank {}", in.recv_peer);
      if (in.send_peer >= 0) peers += fmt::format(" to rank {}", in.send_peer);
      const std::string size = r.started ? fmt::format(" of {} bytes", r.bytes) : std::string();
      state = fmt::format("step {} ({}{}{}): {}", r.pc, plan::to_string(in.op), size, peers, state);
    }
    where += fmt::format("{}block {} (channel {}) {}", where.empty() ? "" : "; ", r.block->id, r.block->channel,
                         state);
  }
  return fmt::format("running plan '{}' for {} [{}]", p.name, to_string(p.collective), where);
}

}  // namespace executor_detail

using executor_detail::BlockMachine;
using executor_detail::PendingSend;
using executor_detail::Run;
using executor_detail::StreamedEpilogue;

// What run() derives from a plan once and reuses while the same plan repeats: the blocks' state
// machines, the worker of each block, each worker's connections and engine.
struct CpuExecutor::Layout {
  uint64_t plan_id = 0;
  std::unique_ptr<Run[]> runs;
  size_t nruns = 0;
  int nworkers = 1;
  std::vector<std::vector<Connection*>> conns;
  std::vector<std::unique_ptr<ProgressEngine>> engines;
  std::vector<std::unique_ptr<StreamedEpilogue>> epilogues;  // Run::epilogues point here
};

CpuExecutorOptions CpuExecutorOptions::from_env() {
  CpuExecutorOptions o;
  if (env::is_set("TUTTI_TILE_SIZE")) o.tile_bytes = static_cast<int64_t>(env::get_size("TUTTI_TILE_SIZE"));
  o.staging_slots = static_cast<int>(env::get_int("TUTTI_PIPELINE_DEPTH"));
  o.workers = static_cast<int>(env::get_int("TUTTI_WORKERS"));
  o.stream_epilogues = env::get_bool("TUTTI_STREAM_EPILOGUES");
  o.huge_pages = env::get_bool("TUTTI_HUGE_PAGES");
  if (env::is_set("TUTTI_STREAM_THRESHOLD")) o.stream_threshold = env::get_size("TUTTI_STREAM_THRESHOLD");
  o.trace = env::get_string("TUTTI_TRACE");
  return o;
}

std::vector<StreamedEpilogueStep> streamed_epilogues(const PreparedPlan& pp, int rank) {
  const plan::RankPlan& rp = pp.plan.ranks[static_cast<size_t>(rank)];
  // The rank's steps as one graph: a step comes after its block's previous step and after its deps.
  std::vector<size_t> first(rp.blocks.size() + 1, 0);
  for (size_t b = 0; b < rp.blocks.size(); ++b) first[b + 1] = first[b] + rp.blocks[b].steps.size();
  const size_t n = first.back();
  auto id = [&](const plan::Dep& d) { return first[static_cast<size_t>(d.block)] + static_cast<size_t>(d.step); };
  std::vector<std::vector<size_t>> after(n), before(n);
  std::vector<plan::Dep> where(n);
  for (size_t b = 0; b < rp.blocks.size(); ++b)
    for (size_t t = 0; t < rp.blocks[b].steps.size(); ++t) {
      const size_t i = first[b] + t;
      where[i] = {static_cast<int64_t>(b), static_cast<int64_t>(t)};
      if (t > 0) before[i].push_back(i - 1), after[i - 1].push_back(i);
      for (const plan::Dep& d : rp.blocks[b].steps[t].deps) before[i].push_back(id(d)), after[id(d)].push_back(i);
    }
  auto step = [&](size_t i) -> const plan::Instruction& {
    return rp.blocks[static_cast<size_t>(where[i].block)].steps[static_cast<size_t>(where[i].step)];
  };
  // Where a reference lives: in-place collectives alias output and input (CollectiveSpec::canonical).
  auto overlaps = [&](const plan::Ref& a, const plan::Ref& b) {
    const Location la = pp.spec.canonical(rank, a.buffer, static_cast<int>(a.index));
    const Location lb = pp.spec.canonical(rank, b.buffer, static_cast<int>(b.index));
    return la.buffer == lb.buffer && la.index < lb.index + b.count && lb.index < la.index + a.count;
  };
  auto reach = [&](size_t from, const std::vector<std::vector<size_t>>& edges) {
    std::vector<char> seen(n, 0);
    std::vector<size_t> todo = {from};
    seen[from] = 1;
    while (!todo.empty()) {
      const size_t i = todo.back();
      todo.pop_back();
      for (size_t j : edges[i])
        if (!seen[j]) seen[j] = 1, todo.push_back(j);
    }
    return seen;
  };
  std::vector<StreamedEpilogueStep> out;
  for (size_t r = 0; r < n; ++r) {
    const plan::Instruction& recv = step(r);
    if (recv.op != plan::Opcode::kRecvReduceCopy || !recv.dst) continue;
    const plan::Ref& chunk = *recv.dst;
    // The compute that finishes it: a direct successor rewriting the chunk in place with a stream form.
    std::optional<size_t> c;
    for (size_t j : after[r]) {
      const plan::Instruction& in = step(j);
      if (in.op == plan::Opcode::kCompute && in.dst && !in.srcs.empty() && in.srcs[0] == chunk && *in.dst == chunk &&
          kernel_def(in.kernel).stream)
        c = j;
    }
    if (!c) continue;
    // Every other step touching the chunk must run before the receive or after the compute.
    const std::vector<char> later = reach(*c, after), earlier = reach(r, before);
    bool alone = true;
    for (size_t x = 0; x < n && alone; ++x) {
      if (x == r || x == *c || later[x] || earlier[x]) continue;
      const plan::Instruction& in = step(x);
      for (const plan::Ref& s : in.srcs) alone = alone && !overlaps(s, chunk);
      for (const plan::Ref& w : in.writes()) alone = alone && !overlaps(w, chunk);
    }
    if (alone) out.push_back({where[r], where[*c]});
  }
  return out;
}

uint64_t default_stream_threshold(int local_ranks) {
  static const uint64_t llc = [] {
    uint64_t best = 0;
    for (int i = 0; i < 8; ++i) {  // the largest cache of cpu0 (level 3 on x86 servers)
      const std::string dir = fmt::format("/sys/devices/system/cpu/cpu0/cache/index{}/", i);
      std::ifstream size_file(dir + "size");
      std::string text;
      if (!(size_file >> text)) break;
      try {
        best = std::max(best, env::parse_size(text));
      } catch (const Error&) {
      }
    }
    return best;
  }();
  return llc ? std::max<uint64_t>(llc / static_cast<uint64_t>(std::max(1, local_ranks)), 1 << 20) : 8u << 20;
}

CpuExecutor::CpuExecutor(Communicator& comm, const CpuExecutorOptions& options)
    : comm_(comm), options_(options), pool_(comm.rank()) {
  const std::optional<int64_t> calibrated =
      comm.calibration() ? comm.calibration()->tile_bytes : std::optional<int64_t>();
  int64_t tile = options_.tile_bytes.value_or(calibrated.value_or(CpuExecutorOptions::kDefaultTileBytes));
  TUTTI_CHECK(tile >= 64, InvalidArgument, "TUTTI_TILE_SIZE must be at least 64 bytes, not {}", tile);
  tile_bytes_ = tile / 64 * 64;  // a multiple of every element size
  if (!options_.tile_bytes && calibrated)
    TUTTI_INFO(log::kTuning, "rank {}: tiles of {} bytes (calibrated for {} ranks over shm)", comm.rank(), tile_bytes_,
               comm.size());
  TUTTI_CHECK(options_.staging_slots >= 1, InvalidArgument, "TUTTI_PIPELINE_DEPTH must be at least 1, not {}",
              options_.staging_slots);
  TUTTI_CHECK(options_.workers >= 0, InvalidArgument,
              "TUTTI_WORKERS must be 0 (automatic) or a thread count, not {}", options_.workers);
  if (options_.workers == 0)
    options_.workers =
        std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / std::max(1, comm.local_ranks()));
  if (!options_.stream_threshold) options_.stream_threshold = default_stream_threshold(comm.local_ranks());
  if (!options_.trace.empty()) {
    bool elsewhere = comm.local_ranks() < comm.size();  // a rank in another process (or on another host)
    for (int p = 0; p < comm.size() && !elsewhere; ++p)
      elsewhere = p != comm.rank() && comm.bootstrap().peer(p).pid != getpid();
    trace::start(options_.trace, elsewhere);
  }
}

void CpuExecutor::set_tile_bytes(int64_t bytes) {
  TUTTI_CHECK(bytes >= 64, InvalidArgument, "rank {}: tile size {} must be at least 64 bytes", comm_.rank(), bytes);
  tile_bytes_ = bytes / 64 * 64;
}

CpuExecutor::~CpuExecutor() = default;

void* CpuExecutor::temp(int slot, size_t bytes, void*) {
  auto& v = temp_[slot == 0 ? 0 : 1];
  if (v.size() < bytes) v.resize(bytes);
  return v.data();
}

void CpuExecutor::copy(void* dst, const void* src, size_t bytes, void*) {
  if (bytes && dst != src) std::memmove(dst, src, bytes);
}

void CpuExecutor::scale(DataType t, void* dst, const void* src, const void* scalar, size_t n, void*) {
  tutti::scale(t, dst, src, scalar, n);
}

void CpuExecutor::divide(DataType t, void* dst, const void* src, uint64_t d, size_t n, void*) {
  tutti::divide(t, dst, src, d, n);
}

void run_host_p2p(Communicator& comm, const std::vector<P2pTransfer>& ops) {
  struct Posted {
    Connection* c;
    Ticket t;
    bool send;
  };
  std::vector<Posted> posted;
  std::vector<const P2pTransfer*> self_sends, self_recvs;
  // Large buffers go onto huge pages, as a plan's (CpuExecutor::run): a single-copy read of a large
  // message runs 2-3x faster from them.
  static const bool huge_pages = env::get_bool("TUTTI_HUGE_PAGES");
  for (const P2pTransfer& op : ops) {
    if (huge_pages) back_with_huge_pages(op.buffer, op.bytes);
    if (op.peer == comm.rank()) {
      (op.send ? self_sends : self_recvs).push_back(&op);
      continue;
    }
    Connection& c = comm.connection(op.peer, 0);
    posted.push_back(op.send ? Posted{&c, c.send(op.buffer, op.bytes), true}
                             : Posted{&c, c.recv(op.buffer, op.bytes), false});
  }
  TUTTI_CHECK(self_sends.size() == self_recvs.size(), InvalidUsage,
              "rank {}: {} send(s) to itself but {} receive(s) from itself in one group", comm.rank(), self_sends.size(),
              self_recvs.size());
  for (size_t i = 0; i < self_sends.size(); ++i) {
    TUTTI_CHECK(self_sends[i]->bytes == self_recvs[i]->bytes, InvalidUsage,
                "rank {}: send to itself of {} bytes meets a receive of {} bytes", comm.rank(), self_sends[i]->bytes,
                self_recvs[i]->bytes);
    if (self_sends[i]->bytes) std::memmove(self_recvs[i]->buffer, self_sends[i]->buffer, self_sends[i]->bytes);
  }
  try {
    comm.engine().wait(
        [&] {
          for (auto& p : posted)
            if (p.send ? !p.c->send_done(p.t) : !p.c->recv_done(p.t)) return false;
          return true;
        },
        [&] { return fmt::format("waiting for {} point-to-point operation(s) of a group", posted.size()); });
  } catch (...) {
    // The caller may free the buffers once this returns: no peer may read them any more.
    for (auto& p : posted)
      if (p.send) p.c->withdraw();
    throw;
  }
}

void CpuExecutor::run(const PreparedPlan& pp, const ExecArgs& args) {
  const plan::Plan& p = pp.plan;
  const int rank = comm_.rank();
  const int64_t esize = static_cast<int64_t>(size_of(args.reduction.type));
  const exec::Geometry g{args.count, p.chunk_factor, esize};
  const plan::RankPlan& rp = p.ranks[rank];
  check_call(pp, comm_.size(), args);  // the same on every rank (the APIs check calls before they get here)
  // Scratch this rank cannot get fails it alone: the communicator fails, so the peers hear it at
  // once instead of waiting for this rank's messages until TUTTI_TIMEOUT.
  const size_t scratch_bytes =
      rp.scratch_chunks > 0 ? static_cast<size_t>(g.chunk_end(rp.scratch_chunks - 1) * esize) : 0;
  try {
    if (scratch_.size() < scratch_bytes) scratch_.resize(scratch_bytes);
  } catch (const std::exception&) {  // bad_alloc, length_error
    const std::string what = fmt::format("rank {}: plan '{}' needs {} bytes of scratch on this rank: out of memory",
                                         rank, p.name, scratch_bytes);
    comm_.state().fail(ErrorKind::kSystem, what);
    throw SystemError(what, ENOMEM);
  }
  comm_.ensure_channels(std::max(p.channels(), 1) + kPlanChannelBase);

  // The user's buffers the call writes: the output and the state buffers of the call's chunk size.
  int64_t output_bytes = g.bytes(0, pp.spec.output_chunks());
  for (const plan::StateBuffer& sb : p.states)
    if (sb.unit == 0 && sb.chunks > 0) output_bytes += g.bytes(0, sb.chunks);
  // Large buffers go onto huge pages (runtime/huge_pages.hpp).
  if (options_.huge_pages) {
    back_with_huge_pages(args.output, static_cast<size_t>(g.bytes(0, pp.spec.output_chunks())));
    if (args.input && args.input != args.output) back_with_huge_pages(args.input, static_cast<size_t>(g.bytes(0, pp.spec.input_chunks())));
  }
  const bool stream_output =
      *options_.stream_threshold > 0 && static_cast<uint64_t>(output_bytes) >= *options_.stream_threshold;

  std::unique_ptr<Layout>& slot = layouts_[pp.id];
  if (!slot) {
    auto l = std::make_unique<Layout>();
    l->plan_id = pp.id;
    l->nruns = rp.blocks.size();
    l->runs = std::make_unique<Run[]>(l->nruns);
    // Channels in use -> workers, round robin.
    std::map<int, int> worker_of_channel;
    for (auto& b : rp.blocks)
      if (!b.steps.empty()) worker_of_channel.emplace(b.channel, 0);
    l->nworkers = std::max(1, std::min<int>(options_.workers, static_cast<int>(worker_of_channel.size())));
    int k = 0;
    for (auto& [channel, w] : worker_of_channel) w = k++ % l->nworkers;
    for (size_t b = 0; b < rp.blocks.size(); ++b) l->runs[b].block = &rp.blocks[b];
    for (const StreamedEpilogueStep& s : streamed_epilogues(pp, rank)) {
      auto e = std::make_unique<StreamedEpilogue>();
      e->compute = s.compute;
      for (const plan::Dep& at : {s.receive, s.compute}) {
        Run& run = l->runs[static_cast<size_t>(at.block)];
        run.epilogues.resize(run.block->steps.size(), nullptr);
        run.epilogues[static_cast<size_t>(at.step)] = e.get();
      }
      l->epilogues.push_back(std::move(e));
    }
    for (size_t b = 0; b < rp.blocks.size(); ++b) {
      if (!rp.blocks[b].steps.empty()) l->runs[b].worker = worker_of_channel.at(rp.blocks[b].channel);
    }
    // Connections of each worker's channels, and an engine per worker when there are several.
    l->conns.resize(l->nworkers);
    for (auto& [channel, w] : worker_of_channel)
      for (int peer = 0; peer < comm_.size(); ++peer)
        if (peer != rank) l->conns[w].push_back(&comm_.connection(peer, channel + kPlanChannelBase));
    if (l->nworkers > 1)
      for (int w = 0; w < l->nworkers; ++w) {
        l->engines.push_back(comm_.engine().sibling(true));
        for (Connection* c : l->conns[w]) l->engines[w]->add(c);
      }
    slot = std::move(l);
  } else {
    for (size_t b = 0; b < slot->nruns; ++b) slot->runs[b].reset();
  }
  Layout* const layout = slot.get();
  // Every message of this call carries what the call is, and every receive checks it: ranks that
  // make different calls fail on the first message (runtime/call_stamp.hpp).
  const CallStamp stamp = call_stamp(p, args);
  for (const auto& worker_conns : layout->conns)
    for (Connection* conn : worker_conns) conn->set_stamp(stamp);
  Run* runs = layout->runs.get();
  const size_t nruns = layout->nruns;
  const int nworkers = layout->nworkers;
  const auto& conns = layout->conns;
  // Staging slots of blocks that forward reduced data (recv_reduce_send), allocated before anything
  // runs: sends read them asynchronously, so they must not move during the run.
  if (staging_.size() < nruns) staging_.resize(nruns);
  for (size_t b = 0; b < rp.blocks.size(); ++b)
    for (auto& in : rp.blocks[b].steps)
      if (in.op == plan::Opcode::kRecvReduceSend && staging_[b].size() < static_cast<size_t>(tile_bytes_ * options_.staging_slots))
        staging_[b].resize(static_cast<size_t>(tile_bytes_ * options_.staging_slots));
  Doorbell* bell = comm_.state().doorbell();
  std::atomic<bool> failed{false};
  BlockMachine machine({comm_, pp, args, scratch_.data(), stream_output, options_.stream_epilogues, runs, nruns,
                        nworkers, conns, staging_,
                        tile_bytes_, options_.staging_slots, bell, failed});
  // A call that fails midway leaves messages posted that no later call matches: the communicator
  // fails (its peers are told), and the call does not return while a peer may still read this
  // rank's buffers by reference, since the caller may free them at once (Connection::withdraw).
  auto leave_failed = [&](ErrorKind kind, const char* what) {
    comm_.state().fail(kind, fmt::format("rank {}: {} failed: {}", rank, p.name, what));
    for (const auto& worker_conns : conns)
      for (Connection* c : worker_conns) c->withdraw();
  };
  try {
    run_workers(machine, *layout, bell, failed);
  } catch (const Error& e) {
    leave_failed(e.kind(), e.what());
    throw;
  } catch (const std::exception& e) {
    leave_failed(ErrorKind::kInternal, e.what());
    throw;
  }
}

void CpuExecutor::run_workers(executor_detail::BlockMachine& machine, Layout& layout, Doorbell* bell,
                              std::atomic<bool>& failed) {
  const int nworkers = layout.nworkers;
  // The worker loop: each worker drives its blocks on its progress engine, which sleeps while
  // nothing moves and reports a stall with the machine's description.
  auto work = [&](int worker, ProgressEngine& engine) {
    engine.run([&](bool& done) { return machine.step(worker, done); }, [&] { return machine.stall(worker); },
               [&] { return machine.relieve(worker); });
  };
  if (nworkers == 1) {
    work(0, comm_.engine());
    return;
  }
  std::mutex first_mutex;
  std::exception_ptr first;
  pool_.run(nworkers, [&](int w) {
    try {
      work(w, *layout.engines[w]);
    } catch (...) {
      std::lock_guard lock(first_mutex);
      if (!first) first = std::current_exception();
      failed.store(true);
      if (bell) ring(*bell);
    }
  });
  if (first) std::rethrow_exception(first);
}

}  // namespace tutti
