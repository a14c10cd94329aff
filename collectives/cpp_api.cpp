// tutti's C++ API (include/tutti/tutti.hpp) over the runtime: a communicator, the dispatcher that
// picks a plan per call, and a CallQueue whose thread runs the calls in order so they return at once.
#include <atomic>
#include <cstring>
#include <mutex>

#include "collectives/dispatcher.hpp"
#include "compiler/compile.hpp"
#include "compiler/plan_file.hpp"
#include "core/datatype.hpp"
#include "core/error.hpp"
#include "runtime/call_queue.hpp"
#include "runtime/communicator.hpp"
#include "runtime/cpu_executor.hpp"
#include "runtime/rendezvous.hpp"
#include "runtime/shared_buffers.hpp"
#include "runtime/unique_id.hpp"
#include "tutti/plan.hpp"
#include "tutti/tutti.hpp"

namespace tutti {
namespace api_detail {

struct CommState {
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Dispatcher> dispatcher;
  // Shared with the Work handles, which may outlive the Comm.
  std::shared_ptr<CallQueue> queue;
  std::mutex mu;
  std::string last_plan;  // under mu
  // A group in progress: its transfers and the Work they share.
  bool in_group = false;
  std::vector<P2pTransfer> group;
  std::shared_ptr<WorkState> group_work;

  explicit CommState(std::unique_ptr<Communicator> c)
      : comm(std::move(c)),
        dispatcher(std::make_unique<Dispatcher>(*comm)),
        queue(std::make_shared<CallQueue>(*comm->options().spin)) {}
  ~CommState() {
    queue->drain();  // every call that was made runs before the communicator goes
  }
};

struct WorkState {
  std::shared_ptr<CallQueue> queue;
  // 0: a group's Work before group_end(); set once by the Comm's thread, read by any thread.
  std::atomic<uint64_t> ticket{0};
};

}  // namespace api_detail

// tutti::CommState is the runtime's; the API's state types keep their namespace.
using ApiState = api_detail::CommState;
using api_detail::WorkState;

// --- CommId --------------------------------------------------------------------------------------

CommId CommId::create() {
  UniqueId id = create_unique_id(CommOptions::from_env().socket_ifname);
  CommId out;
  static_assert(sizeof(out.bytes) == UniqueId::kBytes);
  std::memcpy(out.bytes.data(), id.bytes.data(), UniqueId::kBytes);
  return out;
}

std::string CommId::to_string() const {
  UniqueId id;
  std::memcpy(id.bytes.data(), bytes.data(), UniqueId::kBytes);
  return id.hex();
}

CommId CommId::parse(std::string_view text) {
  UniqueId id = UniqueId::parse(std::string(text), CommOptions::from_env().comm_secret);
  CommId out;
  std::memcpy(out.bytes.data(), id.bytes.data(), UniqueId::kBytes);
  return out;
}

// --- Work ----------------------------------------------------------------------------------------

bool Work::test() {
  if (!state_) return true;
  const uint64_t ticket = state_->ticket.load(std::memory_order_acquire);
  TUTTI_CHECK(ticket != 0, InvalidUsage, "Work::test: the group of this call has not ended (group_end)");
  if (!state_->queue->done(ticket)) return false;
  state_->queue->wait(ticket);  // done: rethrows its failure, if any
  return true;
}

void Work::wait() {
  if (!state_) return;
  const uint64_t ticket = state_->ticket.load(std::memory_order_acquire);
  TUTTI_CHECK(ticket != 0, InvalidUsage, "Work::wait: the group of this call has not ended (group_end)");
  state_->queue->wait(ticket);
}

// --- Comm ----------------------------------------------------------------------------------------

namespace {

// An empty Comm (moved from, or split with color < 0) holds no communicator.
ApiState& state_of(const std::unique_ptr<ApiState>& s, const char* call) {
  TUTTI_CHECK(s != nullptr, InvalidUsage, "Comm::{}: this Comm holds no communicator (moved from, or split's color < 0)",
              call);
  return *s;
}

CommOptions options_of(const CommConfig& config) {
  CommOptions o = CommOptions::from_env();
  if (config.timeout_s >= 0) o.timeout_s = config.timeout_s;
  return o;
}

}  // namespace

Comm::Comm(std::unique_ptr<ApiState> s) : state_(std::move(s)) {}
Comm::Comm(Comm&&) noexcept = default;
Comm& Comm::operator=(Comm&&) noexcept = default;
Comm::~Comm() = default;

Comm Comm::create(const CommId& id, int nranks, int rank, const CommConfig& config) {
  UniqueId uid;
  std::memcpy(uid.bytes.data(), id.bytes.data(), UniqueId::kBytes);
  TUTTI_CHECK(uid.valid(), InvalidArgument, "Comm::create: the id was not made by CommId::create");
  return Comm(std::make_unique<ApiState>(Communicator::create(uid, nranks, rank, options_of(config))));
}

std::vector<Comm> Comm::create_local(int nranks, const CommConfig& config) {
  TUTTI_CHECK(nranks >= 1, InvalidArgument, "Comm::create_local: nranks {} must be at least 1", nranks);
  std::vector<Comm> out;
  for (auto& c : Communicator::create_local(nranks, options_of(config)))
    out.push_back(Comm(std::make_unique<ApiState>(std::move(c))));
  return out;
}

Comm Comm::from_env(const CommConfig& config) {
  return Comm(std::make_unique<ApiState>(Communicator::create_from_env(options_of(config))));
}

int Comm::rank() const {
  TUTTI_CHECK(state_, InvalidUsage, "Comm::rank: this Comm holds no communicator (moved from, or split's color < 0)");
  return state_->comm->rank();
}

int Comm::size() const {
  TUTTI_CHECK(state_, InvalidUsage, "Comm::size: this Comm holds no communicator (moved from, or split's color < 0)");
  return state_->comm->size();
}

void Comm::check_sizes(const char* call, size_t a, size_t b, size_t multiple) const {
  TUTTI_CHECK(a == b, InvalidArgument, "rank {}: {}: the input holds {} elements but the output {} ({} ranks)", rank(),
              call, a, b, size());
  TUTTI_CHECK(multiple > 0 && a % multiple == 0, InvalidArgument,
              "rank {}: {}: {} elements do not split into {} equal pieces", rank(), call, a, multiple);
}

namespace {

Work post_collective(ApiState& s, const char* name, CollectiveCall call, const std::string& where) {
  TUTTI_CHECK(!s.in_group, InvalidUsage, "rank {}: {} inside a group: groups hold sends and receives only ({})",
              s.comm->rank(), name, where);
  TUTTI_CHECK(static_cast<int>(call.reduction.type) >= 0 && static_cast<int>(call.reduction.type) < kNumDataTypes,
              InvalidArgument, "rank {}: {}: invalid data type {}", s.comm->rank(), name,
              static_cast<int>(call.reduction.type));
  TUTTI_CHECK(call.reduction.op != RedOp::kPreMulSum, InvalidArgument,
              "rank {}: {}: premulsum needs a scalar: use the NCCL API (ncclRedOpCreatePreMulSum)", s.comm->rank(), name);
  check_call_sizes(call, s.comm->size(), s.comm->rank(), name);
  auto work = std::make_shared<WorkState>();
  work->queue = s.queue;
  work->ticket = s.queue->post([&s, call] {
    s.dispatcher->run(call);
    std::lock_guard lock(s.mu);
    s.last_plan = s.dispatcher->last_plan();
  });
  return Work::make(std::move(work));
}

CollectiveCall call_of(Collective c, const void* in, void* out, size_t count, DataType type, RedOp op, int root) {
  CollectiveCall call;
  call.collective = c;
  call.input = in;
  call.output = out;
  call.count = static_cast<int64_t>(count);
  call.reduction.op = op;
  call.reduction.type = type;
  call.root = root;
  return call;
}

}  // namespace

Work Comm::all_reduce(const void* in, void* out, size_t count, DataType type, RedOp op) {
  return post_collective(state_of(state_, "all_reduce"), "all_reduce", call_of(Collective::kAllReduce, in, out, count, type, op, 0), "");
}

Work Comm::reduce(const void* in, void* out, size_t count, DataType type, RedOp op, int root) {
  TUTTI_CHECK(root >= 0 && root < size(), InvalidArgument, "rank {}: reduce: root {} is out of range (0..{})", rank(),
              root, size() - 1);
  return post_collective(state_of(state_, "reduce"), "reduce", call_of(Collective::kReduce, in, out, count, type, op, root), "");
}

Work Comm::broadcast(const void* in, void* out, size_t count, DataType type, int root) {
  TUTTI_CHECK(root >= 0 && root < size(), InvalidArgument, "rank {}: broadcast: root {} is out of range (0..{})",
              rank(), root, size() - 1);
  return post_collective(state_of(state_, "broadcast"), "broadcast",
                         call_of(Collective::kBroadcast, in, out, count, type, RedOp::kSum, root), "");
}

Work Comm::all_gather(const void* in, void* out, size_t count, DataType type) {
  return post_collective(state_of(state_, "all_gather"), "all_gather", call_of(Collective::kAllGather, in, out, count, type, RedOp::kSum, 0),
                         "");
}

Work Comm::reduce_scatter(const void* in, void* out, size_t count, DataType type, RedOp op) {
  return post_collective(state_of(state_, "reduce_scatter"), "reduce_scatter",
                         call_of(Collective::kReduceScatter, in, out, count, type, op, 0), "");
}

Work Comm::all_to_all(const void* in, void* out, size_t count, DataType type) {
  return post_collective(state_of(state_, "all_to_all"), "all_to_all", call_of(Collective::kAllToAll, in, out, count, type, RedOp::kSum, 0),
                         "");
}

namespace {

Work post_transfer(ApiState& s, P2pTransfer t, const char* name) {
  TUTTI_CHECK(t.peer >= 0 && t.peer < s.comm->size(), InvalidArgument, "rank {}: {}: peer {} is out of range (0..{})",
              s.comm->rank(), name, t.peer, s.comm->size() - 1);
  if (s.in_group) {
    s.group.push_back(t);
    return Work::make(s.group_work);
  }
  auto work = std::make_shared<WorkState>();
  work->queue = s.queue;
  work->ticket = s.queue->post([&s, t] { run_host_p2p(*s.comm, {t}); });
  return Work::make(std::move(work));
}

}  // namespace

Work Comm::send(const void* in, size_t count, DataType type, int peer) {
  ApiState& s = state_of(state_, "send");
  return post_transfer(s, {true, peer, const_cast<void*>(in), checked_transfer_bytes(in, count, type, s.comm->rank(), "send")},
                       "send");
}

Work Comm::recv(void* out, size_t count, DataType type, int peer) {
  ApiState& s = state_of(state_, "recv");
  return post_transfer(s, {false, peer, out, checked_transfer_bytes(out, count, type, s.comm->rank(), "recv")}, "recv");
}

void Comm::group_start() {
  state_of(state_, "group_start");
  TUTTI_CHECK(!state_->in_group, InvalidUsage, "rank {}: group_start inside a group", rank());
  state_->in_group = true;
  state_->group.clear();
  state_->group_work = std::make_shared<WorkState>();
  state_->group_work->queue = state_->queue;
}

Work Comm::group_end() {
  ApiState& s = state_of(state_, "group_end");
  TUTTI_CHECK(s.in_group, InvalidUsage, "rank {}: group_end without group_start", rank());
  s.in_group = false;
  s.group_work->ticket.store(
      s.queue->post([&s, transfers = std::move(s.group)] { run_host_p2p(*s.comm, transfers); }),
      std::memory_order_release);
  s.group.clear();
  return Work::make(std::move(s.group_work));
}

Comm Comm::split(int color, int key) {
  state_of(state_, "split").queue->drain();  // the split is collective: every earlier call of this rank first
  auto child = state_->comm->split(color, key);
  if (!child) return Comm(nullptr);
  return Comm(std::make_unique<ApiState>(std::move(child)));
}

void Comm::abort() {
  if (state_) state_->comm->abort();
}

std::string Comm::last_plan() const {
  std::lock_guard lock(state_of(state_, "last_plan").mu);
  return state_->last_plan;
}

void load_plan(const std::string& path) { Dispatcher::load_plan(path); }

void* alloc_shared(size_t bytes) { return allocate_shared_buffer(bytes); }

void free_shared(void* p) {
  TUTTI_CHECK(free_shared_buffer(p), InvalidArgument, "free_shared: {} was not allocated by alloc_shared", p);
}

std::string save_plan(const dsl::Program& program, const std::string& path, const PlanOptions& options) {
  plan::CompileOptions o;
  o.min_bytes = options.min_bytes;
  o.max_bytes = options.max_bytes;
  o.instances = options.instances;
  plan::Compiled c = plan::compile(program, o);
  plan::save_file(c.plan, path);
  return c.report.summary(c.plan);
}

const std::string& CompiledPlan::name() const {
  TUTTI_CHECK(prepared_, InvalidUsage, "CompiledPlan: empty (made by compile_plan)");
  return prepared_->plan.name;
}
const std::string& CompiledPlan::summary() const { return summary_; }
std::string CompiledPlan::json() const {
  TUTTI_CHECK(prepared_, InvalidUsage, "CompiledPlan: empty (made by compile_plan)");
  return plan::to_json(prepared_->plan);
}

CompiledPlan compile_plan(const dsl::Program& program) {
  plan::Compiled c = plan::compile(program);
  CompiledPlan out;
  out.summary_ = c.report.summary(c.plan);
  out.prepared_ = PreparedPlan::make(std::move(c.plan));
  return out;
}

Work run_plan(Comm& comm, const CompiledPlan& plan, const PlanCall& call) {
  ApiState& s = state_of(comm.state_, "run_plan");
  TUTTI_CHECK(plan.prepared(), InvalidArgument, "rank {}: run_plan: the plan is empty (made by compile_plan)",
              s.comm->rank());
  TUTTI_CHECK(!s.in_group, InvalidUsage, "rank {}: run_plan '{}' inside a group: groups hold sends and receives only",
              s.comm->rank(), plan.name());
  TUTTI_CHECK(static_cast<int>(call.type) >= 0 && static_cast<int>(call.type) < kNumDataTypes, InvalidArgument,
              "rank {}: run_plan '{}': invalid data type {}", s.comm->rank(), plan.name(), static_cast<int>(call.type));
  TUTTI_CHECK(is_valid(call.op) && call.op != RedOp::kPreMulSum, InvalidArgument,
              "rank {}: run_plan '{}': invalid reduction {}", s.comm->rank(), plan.name(), static_cast<int>(call.op));
  const plan::RankPlan& mine = plan.prepared()->plan.ranks.at(static_cast<size_t>(s.comm->rank()));
  TUTTI_CHECK(call.count == 0 || ((call.input || mine.input_chunks == 0) && (call.output || mine.output_chunks == 0)),
              InvalidArgument, "rank {}: run_plan '{}': the plan reads an input and writes an output; {} is null",
              s.comm->rank(), plan.name(), call.input ? "output" : "input");
  ExecArgs args;
  args.input = call.input;
  args.output = call.output;
  args.count = static_cast<int64_t>(call.count);
  args.reduction.op = call.op;
  args.reduction.type = call.type;
  args.scalars = call.scalars;
  args.states = call.states;
  try {
    check_call(*plan.prepared(), s.comm->size(), args);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("rank {}: run_plan: {}", s.comm->rank(), e.what()));
  }
  auto work = std::make_shared<WorkState>();
  work->queue = s.queue;
  work->ticket = s.queue->post([&s, prepared = plan.prepared(), args] {
    if (FaultInjector* f = s.comm->faults()) f->begin_call(*s.comm);
    s.dispatcher->resources()->executor.run(*prepared, args);
    std::lock_guard lock(s.mu);
    s.last_plan = prepared->plan.name;
  });
  return Work::make(std::move(work));
}

double predict_plan_us(Comm& comm, const CompiledPlan& plan, size_t count, DataType type) {
  ApiState& s = state_of(comm.state_, "predict_plan_us");
  TUTTI_CHECK(plan.prepared(), InvalidArgument, "rank {}: predict_plan_us: the plan is empty (made by compile_plan)",
              s.comm->rank());
  return s.dispatcher->predict_us(plan.prepared()->plan, static_cast<uint64_t>(count) * size_of(type));
}

const char* version() { return TUTTI_VERSION_STRING; }

}  // namespace tutti
