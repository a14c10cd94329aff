// The NCCL C API over tutti (libnccl.so.2). Every function converts tutti's typed errors into
// ncclResult_t, records the message for ncclGetLastError and logs it at WARN; nothing throws across
// the C boundary.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <system_error>
#include <thread>
#include <vector>

#include "collectives/dispatcher.hpp"
#include "compiler/plan_file.hpp"
#include "runtime/shared_buffers.hpp"
#include "collectives/include/nccl.h"
#include "collectives/include/tutti_nccl.h"
#include "plan/plan.hpp"
#include "compiler/verify.hpp"
#include "core/address_space.hpp"
#include "core/env.hpp"
#include "core/log.hpp"
#include "runtime/rendezvous.hpp"
#include "runtime/shm_segment.hpp"
#include "runtime/device/backend.hpp"
#include "runtime/device/device_executor.hpp"
#include "runtime/device/host_staging.hpp"
#include "runtime/call_queue.hpp"
#ifdef TUTTI_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#define NCCL_API(ret, func, ...)                                                                    \
  extern "C" __attribute__((visibility("default"))) __attribute__((alias(#func))) ret p##func(__VA_ARGS__); \
  extern "C" __attribute__((visibility("default"))) __attribute__((weak)) ret func(__VA_ARGS__)

using namespace tutti;

// Communicators one thread made together (ncclCommInitAll, or ncclCommInitRank calls in one group).
// Programs destroy them one after another from that thread (NCCL's "single process, single thread,
// multiple devices" example), but closing a device executor waits for every rank of its
// communicator: the first destroy would wait for ranks the thread has not destroyed yet. So the
// clique's communicators are kept, destroyed in name, until the last of them is destroyed, which
// closes every device executor of the clique side by side (or, if one was aborted, none: their
// memory stays allocated, as after any abort).
struct Clique {
  struct Parts {
    std::unique_ptr<device::DeviceExecutor> device;
    std::unique_ptr<Dispatcher> dispatcher;
    std::unique_ptr<Communicator> comm;
  };
  std::mutex mu;
  int live = 0;
  bool aborted = false;
  std::vector<Parts> held;
};

// What ncclCommRegister's handle stands for.
struct Registration {
  void* buff;
  size_t size;
  bool device;  // registered with the communicator's device executor (plans read it in place)
};

struct ncclComm {
  static constexpr uint64_t kMagic = 0x74757474436f6d6dull;
  uint64_t magic = kMagic;
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Dispatcher> dispatcher;
  bool blocking = true;
  int cuda_dev = -1;  // the current device at init, as NCCL's
  bool emulated = false;  // TUTTI_DEVICE=emulated: every buffer runs on the emulated device
  device::DeviceOptions device_options;  // read at creation, as every setting of a communicator
  // Made on the first call with device buffers; `device_mu` guards making it against readers on
  // other threads (a framework's watchdog polling ncclCommGetAsyncError, ncclCommAbort).
  std::unique_ptr<device::DeviceExecutor> device;
  std::unique_ptr<device::HostStagingExecutor> staging;  // device buffers through host memory (host_staging())
  std::mutex device_mu;
  std::atomic<int> async{ncclSuccess};
  // Non-blocking communicators run their calls in order on a queue's thread, started with them (a
  // call costs a hand-off, not a thread: starting one per call made an 8-byte all-reduce take
  // milliseconds). Their async state is ncclInProgress while it holds calls, then the first failure.
  std::unique_ptr<CallQueue> worker;
  std::mutex mu;
  std::condition_variable cv;
  // Calls in progress: destroy/abort wait for them to leave. Atomic, and the leaving call takes
  // `mu` to notify only when `closing` is set (seq_cst on both sides: either the leaver sees
  // closing, or the closer sees active == 0), so a call costs no lock of its own.
  std::atomic<int> active{0};
  std::atomic<bool> closing{false};
  std::atomic<bool> revoked{false};  // ncclCommRevoke: only destroy, split and shrink from now on
  std::atomic<bool> finalized{false};  // ncclCommFinalize was called (a second call is an error, as NCCL's)
  // ncclCommInitRank*: `comm` is set once `ready`; until then abort stops the rendezvous through
  // `init_state`, the runtime state the communicator will use.
  std::atomic<bool> ready{true};
  std::shared_ptr<CommState> init_state;
  struct UserOp {
    DataType type;
    bool immediate;
    unsigned char value[8];
    const void* pointer;
    bool live;
  };
  std::vector<UserOp> redops;
  // Handles ncclCommRegister (and ncclCommWindowRegister) gave out and not yet deregistered: a handle
  // is looked up here before it is used or freed, so a made-up or twice-freed one is an error.
  std::mutex registrations_mu;
  std::map<void*, std::unique_ptr<Registration>> registrations;
  std::shared_ptr<Clique> clique;  // made together with others by one thread; null otherwise
};

namespace {

thread_local std::string t_last_error;
std::mutex g_comms_mutex;
std::set<ncclComm*> g_comms;

ncclResult_t to_result(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument: return ncclInvalidArgument;
    case ErrorKind::kInvalidUsage: return ncclInvalidUsage;
    case ErrorKind::kSystem: return ncclSystemError;
    case ErrorKind::kRemote: return ncclRemoteError;
    case ErrorKind::kTimeout: return ncclRemoteError;
    case ErrorKind::kAborted: return ncclInvalidUsage;
    case ErrorKind::kInternal: return ncclInternalError;
  }
  return ncclInternalError;
}

thread_local int t_group_depth = 0;
thread_local ncclResult_t t_group_error = ncclSuccess;

// Runs an API call: every tutti error becomes NCCL's result code and ncclGetLastError's text. A
// call that fails inside a group also fails the group (ncclGroupEnd returns the first failure and
// runs nothing), as NCCL does, so the peers are not left waiting for a call that was dropped.
template <class F>
ncclResult_t guard(const char* fn, F&& f) {
  ncclResult_t rc = ncclSuccess;
  try {
    return f();
  } catch (const Error& e) {
    // Messages that already name the function are not prefixed twice.
    const std::string_view what = e.what();
    const bool named = what.starts_with(fn) && what.substr(std::strlen(fn)).starts_with(": ");
    t_last_error = named ? std::string(what) : fmt::format("{}: {}", fn, what);
    rc = to_result(e.kind());
  } catch (const std::bad_alloc&) {
    t_last_error = fmt::format("{}: out of memory", fn);
    rc = ncclSystemError;
  } catch (const std::exception& e) {
    t_last_error = fmt::format("{}: internal error: {}", fn, e.what());
    rc = ncclInternalError;
  }
  TUTTI_WARN("{}", t_last_error);
  if (t_group_depth > 0 && t_group_error == ncclSuccess) t_group_error = rc;
  return rc;
}

void register_comm(ncclComm* c) {
  std::lock_guard lock(g_comms_mutex);
  g_comms.insert(c);
}
bool unregister_comm(ncclComm* c) {
  std::lock_guard lock(g_comms_mutex);
  return g_comms.erase(c) > 0;
}

// Checks the handle and keeps the communicator alive for the duration of a call.
// What a failed job of a communicator's queue threw, as NCCL reports it.
ncclResult_t result_of(std::exception_ptr e, std::string* text) {
  try {
    std::rethrow_exception(e);
  } catch (const Error& err) {
    *text = err.what();
    return to_result(err.kind());
  } catch (const std::exception& err) {
    *text = err.what();
    return ncclInternalError;
  } catch (...) {
    *text = "an unknown exception";
    return ncclInternalError;
  }
}

// Keeps a communicator alive while a call uses it: destroy and abort wait until no call is inside.
// `need_comm`: the call needs the runtime communicator (made by init, which may still be running or
// may have failed); calls that only read the handle's state (ncclCommGetAsyncError) do not.
class Use {
 public:
  Use(ncclComm* c, const char* fn, bool need_comm = true) : c_(c) {
    {
      std::lock_guard lock(g_comms_mutex);
      TUTTI_CHECK(c && g_comms.count(c) && c->magic == ncclComm::kMagic, InvalidArgument,
                  "{}: the communicator is NULL, freed or aborted", fn);
      c->active.fetch_add(1, std::memory_order_seq_cst);
    }
    if (!need_comm) return;
    try {
      // A non-blocking init still running: what is asked of the communicator needs it.
      if (!c->comm && c->worker) c->worker->drain();
      if (!c->comm && c->worker)
        if (auto e = c->worker->first_error()) {
          std::string text;
          c->async = result_of(e, &text);
        }
      TUTTI_CHECK(c->comm != nullptr, InvalidUsage, "{}: the communicator failed to initialize: {}", fn,
                  ncclGetErrorString(static_cast<ncclResult_t>(c->async.load())));
      log::set_thread_rank(c->comm->rank());
    } catch (...) {
      leave();  // a constructor that throws runs no destructor
      throw;
    }
  }
  ~Use() { leave(); }
  Use(const Use&) = delete;
  Use& operator=(const Use&) = delete;
  ncclComm* operator->() const { return c_; }
  ncclComm* get() const { return c_; }

 private:
  // Once `active` may reach 0, release() may delete the communicator: nothing here touches it after
  // the decrement unless `mu` is held, which release() needs before it can go on.
  void leave() {
    if (c_->closing.load(std::memory_order_seq_cst)) {
      std::lock_guard lock(c_->mu);
      c_->active.fetch_sub(1, std::memory_order_seq_cst);
      c_->cv.notify_all();
    } else {
      c_->active.fetch_sub(1, std::memory_order_seq_cst);  // release() re-checks on a timer
    }
  }
  ncclComm* c_;
};

DataType to_type(ncclDataType_t t, const char* fn) {
  TUTTI_CHECK(static_cast<int>(t) >= 0 && static_cast<int>(t) < ncclNumTypes, InvalidArgument,
              "{}: invalid datatype {} (valid: 0..{})", fn, static_cast<int>(t), ncclNumTypes - 1);
  return static_cast<DataType>(t);
}

Reduction to_reduction(ncclComm* c, ncclRedOp_t op, DataType type, const char* fn) {
  Reduction r;
  r.type = type;
  int o = static_cast<int>(op);
  if (o >= 0 && o < ncclNumOps) {
    r.op = static_cast<RedOp>(o);
    return r;
  }
  size_t user = static_cast<size_t>(o - ncclNumOps);
  TUTTI_CHECK(o >= ncclNumOps && user < c->redops.size() && c->redops[user].live, InvalidArgument,
              "{}: invalid reduction operator {} (not a built-in and not created on this communicator)", fn, o);
  const auto& u = c->redops[user];
  TUTTI_CHECK(u.type == type, InvalidArgument, "{}: operator {} was created for {}, the call uses {}", fn, o,
              name(u.type), name(type));
  r.op = RedOp::kPreMulSum;
  std::memcpy(r.scalar, u.immediate ? u.value : u.pointer, size_of(type));
  return r;
}

bool have_gpu() {
#ifdef TUTTI_HAVE_CUDA
  static const bool yes = device::cuda_device_count() > 0;
  return yes;
#else
  return false;
#endif
}

bool is_device_memory(const void* p) {
#ifdef TUTTI_HAVE_CUDA
  return p && have_gpu() && device::memory_kind(p) == device::MemoryKind::kDevice;
#else
  (void)p;
  return false;
#endif
}

void check_buffer(const void* p, size_t count, const char* what, const char* fn) {
  TUTTI_CHECK(p || count == 0, InvalidArgument, "{}: {} is NULL with count {}", fn, what, count);
}

// Whether a call's buffers are device memory (then every one must be), for the device executor.
bool on_device(ncclComm* c, std::span<const void* const> buffers, const char* fn) {
  if (c->emulated) return true;
  int device = 0, host = 0;
  for (const void* p : buffers)
    if (p) ++(is_device_memory(p) ? device : host);
  TUTTI_CHECK(device == 0 || host == 0, InvalidArgument,
              "{}: some buffers are device memory and some host memory; a call takes one kind", fn);
  return device > 0;
}
bool on_device(ncclComm* c, std::initializer_list<const void*> buffers, const char* fn) {
  return on_device(c, std::span<const void* const>(buffers.begin(), buffers.size()), fn);
}

device::DeviceExecutor& device_executor(ncclComm* c) {
  std::lock_guard lock(c->device_mu);
  if (!c->device) {
    std::unique_ptr<device::Backend> backend;
    if (c->emulated) {
      backend = device::make_emulated_backend();
    } else {
#ifdef TUTTI_HAVE_CUDA
      TUTTI_CHECK(c->cuda_dev >= 0, InvalidUsage,
                  "rank {}: device buffers, but no CUDA device was current when the communicator was created",
                  c->comm->rank());
      backend = device::make_cuda_backend(c->cuda_dev);
#else
      throw InvalidUsage("device buffers need a CUDA build of tutti");
#endif
    }
    c->device = std::make_unique<device::DeviceExecutor>(*c->comm, std::move(backend), c->device_options);
  }
  return *c->device;
}

// The executor for device buffers when some ranks share no GPU memory (decided collectively when
// the device executor connects); null when the device executor runs them.
device::HostStagingExecutor* host_staging(ncclComm* c) {
  device::DeviceExecutor& dev = device_executor(c);
  dev.connect();  // already connected when the communicator was made: no collective step here
  if (!dev.needs_host_staging()) return nullptr;
  std::lock_guard lock(c->device_mu);
  if (!c->staging)
    c->staging = std::make_unique<device::HostStagingExecutor>(*c->comm, dev, c->dispatcher->resources()->executor);
  return c->staging.get();
}

// Communicators that can see device buffers connect their device channel 0 when they are made
// (collectively), so point-to-point calls between two ranks never need the others.
void connect_device(ncclComm* c) {
  if (c->emulated || (c->cuda_dev >= 0 && have_gpu())) device_executor(c).connect();
}

int current_cuda_device() {
#ifdef TUTTI_HAVE_CUDA
  return have_gpu() ? device::cuda_current_device() : -1;
#else
  return -1;
#endif
}

bool emulated_device() {
  std::string mode = env::get_string("TUTTI_DEVICE");
  TUTTI_CHECK(mode == "auto" || mode == "emulated", InvalidArgument, "TUTTI_DEVICE must be auto or emulated, not '{}'",
              mode);
  return mode == "emulated";
}

// --- groups -------------------------------------------------------------------------------------

struct PendingOp {
  enum Kind { kCollective, kSend, kRecv, kPlan } kind;
  ncclComm* comm;
  CollectiveCall call;
  void* buffer = nullptr;
  size_t bytes = 0;
  int peer = -1;
  bool device = false;
  void* stream = nullptr;
  // kPlan (tuttiRunPlan): the plan and the call's arguments (stream included).
  std::shared_ptr<const PreparedPlan> plan = nullptr;
  ExecArgs args = {};
};

thread_local std::vector<PendingOp> t_ops;
// ncclCommInitRank calls made inside a group: NCCL's documented way for one thread to create
// several ranks. They connect together at the outermost ncclGroupEnd, one thread each (each waits
// for the others in the rendezvous), before the group's operations run.
struct PendingInit {
  ncclComm* comm;
  std::function<void()> init;
};
thread_local std::vector<PendingInit> t_inits;
// Host-buffer calls drive the CPU executor, which host staging's proxy also drives: they wait for
// the proxy's earlier calls first (staging is made by the thread that runs calls).
void drain_staging(ncclComm* c) {
  if (c->staging) c->staging->drain();
}

void run_collective(ncclComm* c, const CollectiveCall& call) {
  if (!call.device) drain_staging(c), c->dispatcher->run(call);
  else if (device::HostStagingExecutor* staged = host_staging(c)) c->dispatcher->run(call, *staged);
  else c->dispatcher->run(call, device_executor(c));
}

// tuttiRunPlan's call: the plan straight on the executor for its kind of memory (no dispatcher
// choice; the plan was checked against the call when it was submitted).
void run_plan_op(ncclComm* c, const PendingOp& op) {
  if (!op.device) {
    drain_staging(c);
    c->dispatcher->resources()->executor.run(*op.plan, op.args);
  } else if (device::HostStagingExecutor* staged = host_staging(c)) {
    // The proxy copies the call's input and output through host memory, not state buffers.
    TUTTI_CHECK(op.plan->plan.states.empty(), InvalidArgument,
                "rank {}: plan '{}' has state buffers, which device calls carry only between ranks that "
                "share GPU memory; this communicator's device buffers go through host memory (other hosts, or "
                "TUTTI_DEVICE_STAGING)",
                c->comm->rank(), op.plan->plan.name);
    staged->run(*op.plan, op.args);
  } else {
    device_executor(c).run(*op.plan, op.args);
  }
}

void run_ops(ncclComm* c, const std::vector<PendingOp>& ops) {
  log::set_thread_rank(c->comm->rank());
  for (size_t i = 0; i < ops.size();) {
    if (ops[i].kind == PendingOp::kCollective || ops[i].kind == PendingOp::kPlan) {
      if (ops[i].kind == PendingOp::kPlan) run_plan_op(c, ops[i]);
      else run_collective(c, ops[i].call);
      ++i;
      continue;
    }
    // Consecutive point-to-point calls of one kind of memory (and one stream) run together.
    std::vector<PendingOp> p2p;
    const bool dev = ops[i].device;
    void* stream = ops[i].stream;
    while (i < ops.size() && (ops[i].kind == PendingOp::kSend || ops[i].kind == PendingOp::kRecv) && ops[i].device == dev &&
           (!dev || ops[i].stream == stream))
      p2p.push_back(ops[i++]);
    std::vector<P2pTransfer> transfers;
    for (const PendingOp& op : p2p) transfers.push_back({op.kind == PendingOp::kSend, op.peer, op.buffer, op.bytes});
    if (!dev) drain_staging(c), run_host_p2p(*c->comm, transfers);
    else if (device::HostStagingExecutor* staged = host_staging(c)) staged->run_p2p(transfers, stream);
    else device_executor(c).run_p2p(transfers, stream);
  }
}

// Runs fn(0..n-1) side by side, one thread each (ranks driven by one thread need each other; one
// runs inline), and returns each one's result; the first failure's text becomes this thread's
// ncclGetLastError.
std::vector<ncclResult_t> side_by_side(size_t n, const char* fn, const std::function<void(size_t)>& body) {
  std::vector<ncclResult_t> results(n, ncclSuccess);
  std::vector<std::string> errors(n);
  auto one = [&](size_t k) {
    results[k] = guard(fn, [&] {
      body(k);
      return ncclSuccess;
    });
    if (results[k] != ncclSuccess) errors[k] = t_last_error;
  };
  if (n == 1) {
    one(0);
  } else {
    std::vector<std::thread> threads;
    try {
      for (size_t k = 0; k < n; ++k) threads.emplace_back(one, k);
    } catch (const std::system_error& e) {  // the process is out of threads: those not started fail
      for (size_t k = threads.size(); k < n; ++k) {
        errors[k] = fmt::format("{}: starting thread {} of {}: {}", fn, k, n, e.what());
        results[k] = ncclSystemError;
      }
    }
    for (auto& t : threads) t.join();
  }
  for (size_t k = 0; k < n; ++k)
    if (results[k] != ncclSuccess) {
      t_last_error = errors[k];
      break;
    }
  return results;
}

ncclResult_t execute(std::vector<PendingOp> ops) {
  // Per communicator, in submission order; several communicators (one thread driving several ranks)
  // run side by side, one thread each, as their ranks need each other.
  std::vector<ncclComm*> order;
  std::map<ncclComm*, std::vector<PendingOp>> by_comm;
  for (auto& op : ops) {
    if (!by_comm.count(op.comm)) order.push_back(op.comm);
    by_comm[op.comm].push_back(op);
  }
  std::vector<std::unique_ptr<Use>> uses;
  for (ncclComm* c : order) uses.push_back(std::make_unique<Use>(c, "ncclGroupEnd"));
  // Non-blocking communicators' calls go to their workers. The others run here, side by side
  // with those (they may need each other), and are done when the group returns, as a blocking
  // communicator's calls must be.
  bool async = false;
  std::vector<ncclComm*> here;
  for (ncclComm* c : order) {
    if (c->worker) {
      c->worker->post([c, mine = by_comm[c]] { run_ops(c, mine); });
      async = true;
    } else {
      here.push_back(c);
    }
  }
  if (!async && here.size() == 1) {  // one communicator: its errors reach the caller's guard as they are
    run_ops(here[0], by_comm[here[0]]);
    return ncclSuccess;
  }
  auto results = side_by_side(here.size(), "ncclGroupEnd", [&](size_t k) { run_ops(here[k], by_comm[here[k]]); });
  for (ncclResult_t rc : results)
    if (rc != ncclSuccess) return rc;
  return async ? ncclInProgress : ncclSuccess;
}

// Runs the inits of a group side by side. A communicator whose init fails keeps the error as its
// async error (ncclCommGetAsyncError) and the group returns the first one, as NCCL does.
ncclResult_t run_inits(std::vector<PendingInit>& inits) {
  if (inits.size() > 1) {
    auto clique = std::make_shared<Clique>();
    clique->live = static_cast<int>(inits.size());
    for (PendingInit& i : inits) i.comm->clique = clique;
  }
  auto results = side_by_side(inits.size(), "ncclCommInitRank (in a group)", [&](size_t k) { inits[k].init(); });
  for (size_t k = 0; k < inits.size(); ++k) inits[k].comm->async = results[k];
  for (ncclResult_t rc : results)
    if (rc != ncclSuccess) return rc;
  return ncclSuccess;
}

// `use` holds op.comm for the call (every API entry takes one first; one per call is enough).
ncclResult_t submit(const Use& use, PendingOp&& op) {
  TUTTI_CHECK(!op.comm->revoked.load(), InvalidUsage,
              "the communicator was revoked (ncclCommRevoke): only ncclCommDestroy, ncclCommSplit and ncclCommShrink "
              "are allowed on it");
  if (t_group_depth > 0) {
    t_ops.push_back(std::move(op));
    return ncclSuccess;
  }
  if (op.kind == PendingOp::kCollective) {
    // A lone blocking collective: straight to the dispatcher, without the group machinery's
    // containers (a small all-reduce is a microsecond; allocations would be a good part of it).
    if (use->blocking && !use->worker) {
      run_collective(op.comm, op.call);
      return ncclSuccess;
    }
    // A lone non-blocking host collective with nothing queued before it: started here, so a call
    // whose peers are already there (a loop of small calls) completes without a hand-off; only
    // the waiting, if any, goes to the worker.
    if (!use->blocking && use->worker && !op.call.device && use->worker->idle()) {
      drain_staging(use.get());  // the staging proxy drives the same CPU executor
      std::function<void()> rest = use->dispatcher->start(op.call);
      if (!rest) return ncclSuccess;
      use->worker->post(std::move(rest));
      return ncclInProgress;
    }
  }
  return execute({std::move(op)});
}

ncclResult_t collective(const Use& use, const char* fn, const CollectiveCall& call, cudaStream_t stream) {
  check_call_sizes(call, use->comm->size(), use->comm->rank(), fn);
  CollectiveCall c = call;
  c.device = on_device(use.get(), {call.input, call.output}, fn);
  c.stream = stream;
  // A lone blocking collective (what submit() would do, without building a pending operation).
  if (t_group_depth == 0 && use->blocking && !use->worker && !use->revoked.load()) {
    run_collective(use.get(), c);
    return ncclSuccess;
  }
  return submit(use, PendingOp{PendingOp::kCollective, use.get(), c});
}

size_t read_config_int(const ncclConfig_t* cfg, size_t offset, int* out) {
  if (cfg->size >= offset + sizeof(int)) std::memcpy(out, reinterpret_cast<const char*>(cfg) + offset, sizeof(int));
  return 0;
}

void apply_config(ncclComm* c, const ncclConfig_t* cfg, const char* fn) {
  if (!cfg) return;
  TUTTI_CHECK(cfg->magic == 0xcafebeef, InvalidArgument,
              "{}: config was not initialized with NCCL_CONFIG_INITIALIZER (magic {:#x})", fn, cfg->magic);
  TUTTI_CHECK(cfg->size >= offsetof(ncclConfig_t, blocking) + sizeof(int), InvalidArgument, "{}: config size {} too small",
              fn, cfg->size);
  int blocking = NCCL_CONFIG_UNDEF_INT;
  read_config_int(cfg, offsetof(ncclConfig_t, blocking), &blocking);
  c->blocking = blocking == NCCL_CONFIG_UNDEF_INT ? true : blocking != 0;
}

}  // namespace

// --- versions, ids, errors -----------------------------------------------------------------------

NCCL_API(ncclResult_t, ncclGetVersion, int* version) {
  return guard("ncclGetVersion", [&] {
    TUTTI_CHECK(version, InvalidArgument, "ncclGetVersion: version is NULL");
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
  });
}

NCCL_API(ncclResult_t, ncclGetUniqueId, ncclUniqueId* out) {
  return guard("ncclGetUniqueId", [&] {
    TUTTI_CHECK(out, InvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
    UniqueId id;
    const CommOptions options = CommOptions::from_env();
    if (auto text = env::raw("TUTTI_COMM_ID")) id = UniqueId::parse(*text, options.comm_secret);  // rank 0 serves it at init
    else id = create_unique_id(options.socket_ifname);
    static_assert(sizeof(out->internal) == UniqueId::kBytes);
    std::memcpy(out->internal, id.bytes.data(), UniqueId::kBytes);
    return ncclSuccess;
  });
}

NCCL_API(const char*, ncclGetErrorString, ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the tutti developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

NCCL_API(const char*, ncclGetLastError, ncclComm_t comm) {
  (void)comm;  // like NCCL: the calling thread's last error
  return t_last_error.c_str();
}

// --- communicators ----------------------------------------------------------------------------

NCCL_API(ncclResult_t, ncclCommInitRankConfig, ncclComm_t* newcomm, int nranks, ncclUniqueId commId, int rank,
         ncclConfig_t* config) {
  return guard("ncclCommInitRankConfig", [&]() -> ncclResult_t {
    TUTTI_CHECK(newcomm, InvalidArgument, "ncclCommInitRank: newcomm is NULL");
    *newcomm = nullptr;
    TUTTI_CHECK(nranks >= 1, InvalidArgument, "ncclCommInitRank: nranks {} must be at least 1", nranks);
    TUTTI_CHECK(rank >= 0 && rank < nranks, InvalidArgument, "ncclCommInitRank: rank {} is out of range for {} ranks",
                rank, nranks);
    check_world_size(nranks, CommOptions::from_env());
    UniqueId id;
    std::memcpy(id.bytes.data(), commId.internal, UniqueId::kBytes);
    TUTTI_CHECK(id.valid(), InvalidArgument,
                "ncclCommInitRank: rank {}: the unique id was not made by ncclGetUniqueId or was damaged on its way "
                "(its check does not match): every rank must get rank 0's 128 bytes unchanged",
                rank);
    if (rank == 0)
      if (auto text = env::raw("TUTTI_COMM_ID"))
        if (text->find(':') != std::string::npos &&
            UniqueId::parse(*text, CommOptions::from_env().comm_secret).bytes == id.bytes)
          ensure_persistent_root(id);
    auto c = std::make_unique<ncclComm>();
    apply_config(c.get(), config, "ncclCommInitRankConfig");
    c->cuda_dev = current_cuda_device();
    c->emulated = emulated_device();
    c->device_options = device::DeviceOptions::from_env();
    ncclComm* raw = c.release();
    register_comm(raw);
    *newcomm = raw;
    raw->ready = false;
    raw->init_state = std::make_shared<CommState>(rank, nranks);
    auto init = [raw, id, nranks, rank] {
      raw->comm = Communicator::create(id, nranks, rank, CommOptions::from_env(), 0, raw->init_state);
      raw->dispatcher = std::make_unique<Dispatcher>(*raw->comm);
      connect_device(raw);
      raw->ready.store(true, std::memory_order_release);
    };
    // A non-blocking communicator's calls run on its worker, started with it.
    if (!raw->blocking)
      raw->worker = std::make_unique<CallQueue>(CommOptions::from_env().spin.value_or(CommOptions::kDefaultSpin));
    if (t_group_depth > 0) {
      raw->async = ncclInProgress;
      t_inits.push_back({raw, init});
      return ncclSuccess;
    }
    if (!raw->blocking) {
      raw->worker->post(init);
      return ncclInProgress;
    }
    try {
      init();
    } catch (...) {
      unregister_comm(raw);
      delete raw;
      *newcomm = nullptr;
      throw;
    }
    return ncclSuccess;
  });
}

NCCL_API(ncclResult_t, ncclCommInitRank, ncclComm_t* newcomm, int nranks, ncclUniqueId commId, int rank) {
  return pncclCommInitRankConfig(newcomm, nranks, commId, rank, nullptr);
}

NCCL_API(ncclResult_t, ncclCommInitAll, ncclComm_t* comms, int ndev, const int* devlist) {
  return guard("ncclCommInitAll", [&] {
    TUTTI_CHECK(comms, InvalidArgument, "ncclCommInitAll: comms is NULL");
    TUTTI_CHECK(ndev >= 1, InvalidArgument, "ncclCommInitAll: ndev {} must be at least 1", ndev);
    check_local_ranks(ndev, CommOptions::from_env());
    // With a GPU, as NCCL: every device named must exist (ranks that share one are fine). Without
    // one (or on the emulated device), the ranks are host ranks and devlist is only reported back.
#ifdef TUTTI_HAVE_CUDA
    if (have_gpu() && !emulated_device()) {
      const int devices = device::cuda_device_count();
      for (int r = 0; r < ndev; ++r) {
        const int d = devlist ? devlist[r] : r;
        TUTTI_CHECK(d >= 0 && d < devices, InvalidArgument,
                    "ncclCommInitAll: rank {}'s device {} does not exist ({} CUDA devices{})", r, d, devices,
                    devlist ? "" : "; devlist is NULL, so rank r uses device r");
      }
    }
#endif
    auto all = Communicator::create_local(ndev);
    auto clique = std::make_shared<Clique>();
    clique->live = ndev;
    for (int r = 0; r < ndev; ++r) {
      auto* c = new ncclComm();
      c->clique = clique;
      c->cuda_dev = devlist ? devlist[r] : r;  // as NCCL: the devices listed, else 0..ndev-1
      c->emulated = emulated_device();
      c->device_options = device::DeviceOptions::from_env();
      c->comm = std::move(all[r]);
      c->dispatcher = std::make_unique<Dispatcher>(*c->comm);
      register_comm(c);
      comms[r] = c;
    }
    // Connecting device channels is collective: one thread per rank.
    for (ncclResult_t rc : side_by_side(static_cast<size_t>(ndev), "ncclCommInitAll",
                                        [&](size_t r) { connect_device(comms[r]); }))
      if (rc != ncclSuccess) return rc;
    return ncclSuccess;
  });
}

NCCL_API(ncclResult_t, ncclCommSplit, ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  return guard("ncclCommSplit", [&] {
    TUTTI_CHECK(newcomm, InvalidArgument, "ncclCommSplit: newcomm is NULL");
    TUTTI_CHECK(color >= 0 || color == NCCL_SPLIT_NOCOLOR, InvalidArgument,
                "ncclCommSplit: color {} must be non-negative or NCCL_SPLIT_NOCOLOR", color);
    Use use(comm, "ncclCommSplit");
    *newcomm = nullptr;
    // Collective through the bootstrap: this rank's queued calls (non-blocking) first, or their
    // channel setup could draw bootstrap tags in another order than the peers'.
    if (use->worker) use->worker->drain();
    auto child = use->comm->split(color, key);
    if (!child) return ncclSuccess;
    auto* c = new ncclComm();
    apply_config(c, config, "ncclCommSplit");
    c->blocking = true;
    c->cuda_dev = use->cuda_dev;
    c->emulated = use->emulated;
    c->device_options = use->device_options;
    c->comm = std::move(child);
    c->dispatcher = std::make_unique<Dispatcher>(*c->comm);
    connect_device(c);
    register_comm(c);
    *newcomm = c;
    return ncclSuccess;
  });
}

NCCL_API(ncclResult_t, ncclCommFinalize, ncclComm_t comm) {
  if (!comm) return ncclSuccess;  // as NCCL
  return guard("ncclCommFinalize", [&] {
    Use use(comm, "ncclCommFinalize");
    TUTTI_CHECK(!use->finalized.exchange(true), InvalidArgument,
                "ncclCommFinalize: rank {}: the communicator was finalized already", use->comm->rank());
    if (use->worker) {
      use->worker->drain();  // pending non-blocking work
      if (auto e = use->worker->first_error()) {
        std::string text;
        ncclResult_t r = result_of(e, &text);
        t_last_error = fmt::format("ncclCommFinalize: {}", text);
        return r;
      }
    }
    return static_cast<ncclResult_t>(use->async.load() == ncclInProgress ? ncclSuccess : use->async.load());
  });
}

namespace {
ncclResult_t release(ncclComm_t comm, bool abort, const char* fn) {
  if (!comm) return ncclSuccess;  // as NCCL: destroying or aborting NULL does nothing
  return guard(fn, [&] {
    {
      std::lock_guard lock(g_comms_mutex);
      TUTTI_CHECK(comm && g_comms.count(comm), InvalidArgument, "{}: the communicator is NULL, freed or aborted", fn);
      g_comms.erase(comm);
    }
    // An init still in the rendezvous gives up on its state's abort flag; a made communicator also
    // tells its peers.
    if (abort && comm->ready.load(std::memory_order_acquire) && comm->comm) comm->comm->abort();
    else if (abort && comm->init_state) comm->init_state->abort();
    if (abort) {
      std::lock_guard lock(comm->device_mu);
      if (comm->device) comm->device->abort();
    }
    comm->closing.store(true, std::memory_order_seq_cst);
    {
      // A call that left just before `closing` was set did not notify: look again now and then.
      std::unique_lock lock(comm->mu);
      while (comm->active.load(std::memory_order_seq_cst) != 0) comm->cv.wait_for(lock, std::chrono::milliseconds(10));
    }
    comm->worker.reset();  // runs what is queued (failing fast after an abort), then stops
    comm->staging.reset();  // its proxy runs what the streams hand it (nothing after an abort), then stops
    comm->magic = 0;
    std::vector<Clique::Parts> parts;
    bool close = !abort;
    if (std::shared_ptr<Clique> clique = comm->clique) {
      std::lock_guard lock(clique->mu);
      clique->aborted = clique->aborted || abort;
      clique->held.push_back({std::move(comm->device), std::move(comm->dispatcher), std::move(comm->comm)});
      if (--clique->live > 0) {
        delete comm;  // the runtime parts wait in the clique for the last destroy
        return ncclSuccess;
      }
      parts.swap(clique->held);
      close = !clique->aborted;
    } else {
      parts.push_back({std::move(comm->device), std::move(comm->dispatcher), std::move(comm->comm)});
    }
    delete comm;
    // With every rank: then no peer uses this rank's FIFOs any more. A clique's ranks close side
    // by side (each one's close waits for the others).
    if (close) {
      std::vector<size_t> open;
      for (size_t k = 0; k < parts.size(); ++k)
        if (parts[k].device) open.push_back(k);
      const auto results = side_by_side(open.size(), fn, [&](size_t k) { parts[open[k]].device->close(); });
      for (ncclResult_t rc : results)
        if (rc != ncclSuccess) TUTTI_WARN("{}: closing the device executor: {}", fn, t_last_error);
    }
    for (Clique::Parts& p : parts) {
      p.device.reset();
      p.dispatcher.reset();
      p.comm.reset();  // flushes (destroy) or just frees (abort)
    }
    return ncclSuccess;
  });
}
}  // namespace

NCCL_API(ncclResult_t, ncclCommDestroy, ncclComm_t comm) { return release(comm, false, "ncclCommDestroy"); }
NCCL_API(ncclResult_t, ncclCommAbort, ncclComm_t comm) { return release(comm, true, "ncclCommAbort"); }

NCCL_API(ncclResult_t, ncclCommGetAsyncError, ncclComm_t comm, ncclResult_t* asyncError) {
  return guard("ncclCommGetAsyncError", [&] {
    TUTTI_CHECK(asyncError, InvalidArgument, "ncclCommGetAsyncError: asyncError is NULL");
    Use use(comm, "ncclCommGetAsyncError", false);  // alive while read, even by a watchdog thread
    const int others = 1;  // this call's own Use
    ncclResult_t r = static_cast<ncclResult_t>(comm->async.load());
    if (comm->revoked.load()) {
      // In progress until every call that was running has left (they give up promptly).
      const bool busy = comm->active.load() > others || (comm->worker && !comm->worker->idle());
      *asyncError = busy ? ncclInProgress : ncclSuccess;
      return ncclSuccess;
    }
    if (r == ncclSuccess && comm->worker) {
      if (!comm->worker->idle()) {
        r = ncclInProgress;
        std::this_thread::yield();  // a caller polling in a loop: let the worker have the core
      } else if (auto e = comm->worker->first_error()) {
        std::string text;
        r = result_of(e, &text);
        t_last_error = fmt::format("ncclCommGetAsyncError: {}", text);
      }
    }
    if (r == ncclSuccess && comm->comm && comm->comm->state().failed()) r = ncclRemoteError;
    std::lock_guard lock(comm->device_mu);
    if (r == ncclSuccess && comm->device) {
      try {
        comm->device->check();
        if (comm->staging) comm->staging->check();
      } catch (const Error& e) {
        t_last_error = fmt::format("ncclCommGetAsyncError: {}", e.what());
        r = e.kind() == ErrorKind::kAborted ? ncclInvalidUsage : ncclRemoteError;
      }
    }
    *asyncError = r;
    return ncclSuccess;
  });
}

NCCL_API(ncclResult_t, ncclCommCount, const ncclComm_t comm, int* count) {
  return guard("ncclCommCount", [&] {
    TUTTI_CHECK(count, InvalidArgument, "ncclCommCount: count is NULL");
    Use use(comm, "ncclCommCount");
    *count = use->comm->size();
    return ncclSuccess;
  });
}

NCCL_API(ncclResult_t, ncclCommCuDevice, const ncclComm_t comm, int* device) {
  return guard("ncclCommCuDevice", [&] {
    TUTTI_CHECK(device, InvalidArgument, "ncclCommCuDevice: device is NULL");
    Use use(comm, "ncclCommCuDevice");
    *device = use->cuda_dev;
    return ncclSuccess;
  });
}

NCCL_API(ncclResult_t, ncclCommUserRank, const ncclComm_t comm, int* rank) {
  return guard("ncclCommUserRank", [&] {
    TUTTI_CHECK(rank, InvalidArgument, "ncclCommUserRank: rank is NULL");
    Use use(comm, "ncclCommUserRank");
    *rank = use->comm->rank();
    return ncclSuccess;
  });
}

// --- memory -----------------------------------------------------------------------------------

namespace {
std::mutex g_mem_mutex;
}  // namespace

namespace {
std::set<void*> g_device_mem;  // guarded by g_mem_mutex
}

NCCL_API(ncclResult_t, ncclMemAlloc, void** ptr, size_t size) {
  return guard("ncclMemAlloc", [&] {
    TUTTI_CHECK(ptr, InvalidArgument, "ncclMemAlloc: ptr is NULL");
#ifdef TUTTI_HAVE_CUDA
    // With a CUDA device, device memory, as NCCL's (which ncclCommRegister and the device FIFOs use).
    if (current_cuda_device() >= 0) {
      cudaError_t rc = cudaMalloc(ptr, std::max<size_t>(size, 1));
      if (rc != cudaSuccess) {
        cudaGetLastError();
        throw Error(ErrorKind::kSystem, fmt::format("ncclMemAlloc: cudaMalloc of {} bytes: {}", size,
                                                    cudaGetErrorString(rc)));
      }
      std::lock_guard lock(g_mem_mutex);
      g_device_mem.insert(*ptr);
      return ncclSuccess;
    }
#endif
    // A shared segment: peers on this host can map it by name.
    *ptr = allocate_shared_buffer(size);
    return ncclSuccess;
  });
}

NCCL_API(ncclResult_t, ncclMemFree, void* ptr) {
  if (!ptr) return ncclSuccess;  // as NCCL (and free())
  return guard("ncclMemFree", [&] {
    std::lock_guard lock(g_mem_mutex);
#ifdef TUTTI_HAVE_CUDA
    if (g_device_mem.erase(ptr)) {
      cudaFree(ptr);
      return ncclSuccess;
    }
#endif
    TUTTI_CHECK(free_shared_buffer(ptr), InvalidArgument, "ncclMemFree: {} was not allocated by ncclMemAlloc", ptr);
    return ncclSuccess;
  });
}

NCCL_API(ncclResult_t, ncclCommRegister, const ncclComm_t comm, void* buff, size_t size, void** handle) {
  return guard("ncclCommRegister", [&] {
    Use use(comm, "ncclCommRegister");
    TUTTI_CHECK(handle, InvalidArgument, "ncclCommRegister: handle is NULL");
    check_buffer(buff, size, "buff", "ncclCommRegister");
    TUTTI_CHECK(!buff || addressable(buff, size), InvalidArgument,
                "ncclCommRegister: rank {}: buff {} of {} bytes ends past this process's memory", use->comm->rank(), buff,
                size);
    auto reg = std::make_unique<Registration>(Registration{buff, size, false});
    // Device memory: same-process peers may read it in place. Host memory: the CPU transports
    // already read a peer's buffer in place where they can (shared buffers), registration or not.
    if (buff && size > 0 && on_device(use.get(), {buff}, "ncclCommRegister")) {
      device_executor(use.get()).register_memory(buff, size);
      reg->device = true;
    }
    std::lock_guard lock(use->registrations_mu);
    void* key = reg.get();
    use->registrations.emplace(key, std::move(reg));
    *handle = key;
    return ncclSuccess;
  });
}

NCCL_API(ncclResult_t, ncclCommDeregister, const ncclComm_t comm, void* handle) {
  return guard("ncclCommDeregister", [&] {
    Use use(comm, "ncclCommDeregister");
    if (!handle) return ncclSuccess;  // as NCCL
    std::unique_ptr<Registration> reg;
    {
      std::lock_guard lock(use->registrations_mu);
      auto it = use->registrations.find(handle);
      TUTTI_CHECK(it != use->registrations.end(), InvalidUsage,
                  "ncclCommDeregister: rank {}: handle {} was not returned by ncclCommRegister on this communicator, or "
                  "was deregistered already",
                  use->comm->rank(), handle);
      reg = std::move(it->second);
      use->registrations.erase(it);
    }
    if (reg->device) device_executor(use.get()).deregister_memory(reg->buff, reg->size);
    return ncclSuccess;
  });
}

// --- reduction operators ---------------------------------------------------------------------

NCCL_API(ncclResult_t, ncclRedOpCreatePreMulSum, ncclRedOp_t* op, void* scalar, ncclDataType_t datatype,
         ncclScalarResidence_t residence, ncclComm_t comm) {
  return guard("ncclRedOpCreatePreMulSum", [&] {
    Use use(comm, "ncclRedOpCreatePreMulSum");
    TUTTI_CHECK(op && scalar, InvalidArgument, "ncclRedOpCreatePreMulSum: op or scalar is NULL");
    DataType type = to_type(datatype, "ncclRedOpCreatePreMulSum");
    TUTTI_CHECK(residence == ncclScalarHostImmediate || residence == ncclScalarDevice, InvalidArgument,
                "ncclRedOpCreatePreMulSum: invalid residence {}", static_cast<int>(residence));
    ncclComm::UserOp u{type, residence == ncclScalarHostImmediate, {}, scalar, true};
    if (u.immediate) std::memcpy(u.value, scalar, size_of(type));
    use->redops.push_back(u);
    *op = static_cast<ncclRedOp_t>(ncclNumOps + static_cast<int>(use->redops.size()) - 1);
    return ncclSuccess;
  });
}

NCCL_API(ncclResult_t, ncclRedOpDestroy, ncclRedOp_t op, ncclComm_t comm) {
  return guard("ncclRedOpDestroy", [&] {
    Use use(comm, "ncclRedOpDestroy");
    size_t user = static_cast<size_t>(static_cast<int>(op) - ncclNumOps);
    TUTTI_CHECK(static_cast<int>(op) >= ncclNumOps && user < use->redops.size() && use->redops[user].live, InvalidArgument,
                "ncclRedOpDestroy: operator {} was not created on this communicator (or is destroyed)", static_cast<int>(op));
    use->redops[user].live = false;
    return ncclSuccess;
  });
}

// --- collectives ---------------------------------------------------------------------------------

NCCL_API(ncclResult_t, ncclAllReduce, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
         ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return guard("ncclAllReduce", [&] {
    Use use(comm, "ncclAllReduce");
    CollectiveCall call{Collective::kAllReduce, sendbuff, recvbuff, static_cast<int64_t>(count), {}, 0};
    call.reduction = to_reduction(comm, op, to_type(datatype, "ncclAllReduce"), "ncclAllReduce");
    check_buffer(sendbuff, count, "sendbuff", "ncclAllReduce");
    check_buffer(recvbuff, count, "recvbuff", "ncclAllReduce");
    return collective(use, "ncclAllReduce", call, stream);
  });
}

NCCL_API(ncclResult_t, ncclBroadcast, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
         int root, ncclComm_t comm, cudaStream_t stream) {
  return guard("ncclBroadcast", [&] {
    Use use(comm, "ncclBroadcast");
    TUTTI_CHECK(root >= 0 && root < use->comm->size(), InvalidArgument, "ncclBroadcast: root {} is out of range (0..{})",
                root, use->comm->size() - 1);
    CollectiveCall call{Collective::kBroadcast, sendbuff, recvbuff, static_cast<int64_t>(count), {}, root};
    call.reduction.type = to_type(datatype, "ncclBroadcast");
    if (use->comm->rank() == root) check_buffer(sendbuff, count, "sendbuff", "ncclBroadcast");
    check_buffer(recvbuff, count, "recvbuff", "ncclBroadcast");
    return collective(use, "ncclBroadcast", call, stream);
  });
}

NCCL_API(ncclResult_t, ncclBcast, void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
         cudaStream_t stream) {
  return pncclBroadcast(buff, buff, count, datatype, root, comm, stream);
}

NCCL_API(ncclResult_t, ncclReduce, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
         ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  return guard("ncclReduce", [&] {
    Use use(comm, "ncclReduce");
    TUTTI_CHECK(root >= 0 && root < use->comm->size(), InvalidArgument, "ncclReduce: root {} is out of range (0..{})", root,
                use->comm->size() - 1);
    CollectiveCall call{Collective::kReduce, sendbuff, recvbuff, static_cast<int64_t>(count), {}, root};
    call.reduction = to_reduction(comm, op, to_type(datatype, "ncclReduce"), "ncclReduce");
    check_buffer(sendbuff, count, "sendbuff", "ncclReduce");
    if (use->comm->rank() == root) check_buffer(recvbuff, count, "recvbuff", "ncclReduce");
    return collective(use, "ncclReduce", call, stream);
  });
}

NCCL_API(ncclResult_t, ncclAllGather, const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
         ncclComm_t comm, cudaStream_t stream) {
  return guard("ncclAllGather", [&] {
    Use use(comm, "ncclAllGather");
    CollectiveCall call{Collective::kAllGather, sendbuff, recvbuff, static_cast<int64_t>(sendcount), {}, 0};
    call.reduction.type = to_type(datatype, "ncclAllGather");
    check_buffer(sendbuff, sendcount, "sendbuff", "ncclAllGather");
    check_buffer(recvbuff, sendcount, "recvbuff", "ncclAllGather");
    return collective(use, "ncclAllGather", call, stream);
  });
}

NCCL_API(ncclResult_t, ncclReduceScatter, const void* sendbuff, void* recvbuff, size_t recvcount,
         ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return guard("ncclReduceScatter", [&] {
    Use use(comm, "ncclReduceScatter");
    CollectiveCall call{Collective::kReduceScatter, sendbuff, recvbuff, static_cast<int64_t>(recvcount), {}, 0};
    call.reduction = to_reduction(comm, op, to_type(datatype, "ncclReduceScatter"), "ncclReduceScatter");
    check_buffer(sendbuff, recvcount, "sendbuff", "ncclReduceScatter");
    check_buffer(recvbuff, recvcount, "recvbuff", "ncclReduceScatter");
    return collective(use, "ncclReduceScatter", call, stream);
  });
}

NCCL_API(ncclResult_t, ncclAllToAll, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
         ncclComm_t comm, cudaStream_t stream) {
  return guard("ncclAllToAll", [&] {
    Use use(comm, "ncclAllToAll");
    CollectiveCall call{Collective::kAllToAll, sendbuff, recvbuff, static_cast<int64_t>(count), {}, 0};
    call.reduction.type = to_type(datatype, "ncclAllToAll");
    check_buffer(sendbuff, count, "sendbuff", "ncclAllToAll");
    check_buffer(recvbuff, count, "recvbuff", "ncclAllToAll");
    TUTTI_CHECK(sendbuff != recvbuff || count == 0, InvalidArgument, "ncclAllToAll: in-place all-to-all is not supported");
    return collective(use, "ncclAllToAll", call, stream);
  });
}

NCCL_API(ncclResult_t, ncclSend, const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
         cudaStream_t stream) {
  return guard("ncclSend", [&] {
    Use use(comm, "ncclSend");
    DataType type = to_type(datatype, "ncclSend");
    TUTTI_CHECK(peer >= 0 && peer < use->comm->size(), InvalidArgument, "ncclSend: peer {} is out of range (0..{})", peer,
                use->comm->size() - 1);
    check_buffer(sendbuff, count, "sendbuff", "ncclSend");
    const size_t bytes = checked_transfer_bytes(sendbuff, count, type, use->comm->rank(), "ncclSend");
    PendingOp op{PendingOp::kSend, comm, {}, const_cast<void*>(sendbuff), bytes, peer};
    op.device = on_device(comm, {sendbuff}, "ncclSend");
    op.stream = stream;
    return submit(use, std::move(op));
  });
}

NCCL_API(ncclResult_t, ncclRecv, void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
         cudaStream_t stream) {
  return guard("ncclRecv", [&] {
    Use use(comm, "ncclRecv");
    DataType type = to_type(datatype, "ncclRecv");
    TUTTI_CHECK(peer >= 0 && peer < use->comm->size(), InvalidArgument, "ncclRecv: peer {} is out of range (0..{})", peer,
                use->comm->size() - 1);
    check_buffer(recvbuff, count, "recvbuff", "ncclRecv");
    const size_t bytes = checked_transfer_bytes(recvbuff, count, type, use->comm->rank(), "ncclRecv");
    PendingOp op{PendingOp::kRecv, comm, {}, recvbuff, bytes, peer};
    op.device = on_device(comm, {recvbuff}, "ncclRecv");
    op.stream = stream;
    return submit(use, std::move(op));
  });
}

NCCL_API(ncclResult_t, ncclGroupStart) {
  if (t_group_depth == 0) t_group_error = ncclSuccess;
  ++t_group_depth;
  return ncclSuccess;
}

NCCL_API(ncclResult_t, ncclGroupEnd) {
  return guard("ncclGroupEnd", [&] {
    TUTTI_CHECK(t_group_depth > 0, InvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--t_group_depth > 0) return ncclSuccess;
    std::vector<PendingOp> ops;
    ops.swap(t_ops);
    std::vector<PendingInit> inits;
    inits.swap(t_inits);
    if (!inits.empty()) {
      ncclResult_t rc = run_inits(inits);
      if (rc != ncclSuccess) return rc;
    }
    if (t_group_error != ncclSuccess) return t_group_error;
    return execute(std::move(ops));
  });
}

// --- plans (tutti_nccl.h) -------------------------------------------------------------------------

struct tuttiPlan {
  std::shared_ptr<const PreparedPlan> prepared;
};

namespace {

ncclResult_t make_plan(const char* fn, tuttiPlan_t* out, const std::function<plan::Plan()>& read,
                       const std::string& what) {
  return guard(fn, [&] {
    TUTTI_CHECK(out, InvalidArgument, "plan is NULL");
    *out = nullptr;
    plan::Plan p;
    try {
      p = read();
      plan::certify(p);
    } catch (const Error& e) {
      throw InvalidArgument(fmt::format("{}: {}", what, e.what()));
    }
    auto h = std::make_unique<tuttiPlan>();
    h->prepared = PreparedPlan::make(std::move(p));
    *out = h.release();
    return ncclSuccess;
  });
}

}  // namespace

NCCL_API(ncclResult_t, tuttiPlanLoad, const char* path, tuttiPlan_t* plan) {
  if (!path) return guard("tuttiPlanLoad", []() -> ncclResult_t { throw InvalidArgument("path is NULL"); });
  return make_plan("tuttiPlanLoad", plan, [&] { return plan::load_file(path); }, fmt::format("plan file {}", path));
}

NCCL_API(ncclResult_t, tuttiPlanParse, const char* json, tuttiPlan_t* plan) {
  if (!json) return guard("tuttiPlanParse", []() -> ncclResult_t { throw InvalidArgument("json is NULL"); });
  return make_plan("tuttiPlanParse", plan, [&] { return plan::parse_json(json); }, "plan text");
}

NCCL_API(ncclResult_t, tuttiPlanName, tuttiPlan_t plan, const char** name) {
  return guard("tuttiPlanName", [&] {
    TUTTI_CHECK(plan && name, InvalidArgument, "{} is NULL", plan ? "name" : "plan");
    *name = plan->prepared->plan.name.c_str();
    return ncclSuccess;
  });
}

NCCL_API(ncclResult_t, tuttiPlanFree, tuttiPlan_t plan) {
  delete plan;  // enqueued calls hold the prepared plan themselves
  return ncclSuccess;
}

NCCL_API(ncclResult_t, tuttiRunPlan, tuttiPlan_t plan, const void* sendbuff, void* recvbuff, size_t count,
         ncclDataType_t datatype, ncclRedOp_t op, void* const* states, int nstates, const double* scalars,
         int nscalars, ncclComm_t comm, cudaStream_t stream) {
  return guard("tuttiRunPlan", [&] {
    Use use(comm, "tuttiRunPlan");
    const int rank = use->comm->rank();
    TUTTI_CHECK(plan, InvalidArgument, "rank {}: plan is NULL", rank);
    const std::string& name = plan->prepared->plan.name;
    TUTTI_CHECK(nstates >= 0 && (states || nstates == 0), InvalidArgument,
                "rank {}: plan '{}': {} state buffers at {}", rank, name, nstates, static_cast<const void*>(states));
    TUTTI_CHECK(nscalars >= 0 && (scalars || nscalars == 0), InvalidArgument,
                "rank {}: plan '{}': {} scalars at {}", rank, name, nscalars, static_cast<const void*>(scalars));
    PendingOp pending{PendingOp::kPlan, use.get(), {}};
    ExecArgs& args = pending.args;
    args.input = sendbuff;
    args.output = recvbuff;
    args.count = static_cast<int64_t>(count);
    args.reduction = to_reduction(use.get(), op, to_type(datatype, "tuttiRunPlan"), "tuttiRunPlan");
    TUTTI_CHECK(args.reduction.op != RedOp::kPreMulSum, InvalidArgument,
                "rank {}: plan '{}': a plan's reductions take built-in operators, not ncclRedOpCreatePreMulSum's",
                rank, name);
    args.states.assign(states, states + nstates);
    args.scalars.assign(scalars, scalars + nscalars);
    args.stream = stream;
    const plan::RankPlan& mine = plan->prepared->plan.ranks.at(static_cast<size_t>(rank));
    TUTTI_CHECK(count == 0 || ((sendbuff || mine.input_chunks == 0) && (recvbuff || mine.output_chunks == 0)),
                InvalidArgument, "rank {}: plan '{}': the plan reads sendbuff and writes recvbuff; {} is NULL",
                rank, name, sendbuff ? "recvbuff" : "sendbuff");
    try {
      check_call(*plan->prepared, use->comm->size(), args);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("rank {}: {}", rank, e.what()));
    }
    std::vector<const void*> buffers{sendbuff, recvbuff};
    buffers.insert(buffers.end(), args.states.begin(), args.states.end());
    pending.device = on_device(use.get(), buffers, "tuttiRunPlan");
    pending.plan = plan->prepared;
    return submit(use, std::move(pending));
  });
}

// --- NCCL 2.28 names that programs built against that NCCL link to -------------------------------
// (PyTorch's libtorch_cuda.so needs every one of them to load.)

NCCL_API(ncclResult_t, ncclAlltoAll, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
         ncclComm_t comm, cudaStream_t stream) {
  return pncclAllToAll(sendbuff, recvbuff, count, datatype, comm, stream);
}

namespace {
// Gather (to_root) or scatter from the root, as one group of sends and receives.
// Gather and scatter are collectives of the dispatcher like the others (built-in plans
// direct_gather and direct_scatter, or loaded ones): only the root's receive (gather) or send
// (scatter) buffer holds every part, and a non-root's may be NULL.
ncclResult_t rooted_exchange(const char* fn, bool to_root, const void* sendbuff, void* recvbuff, size_t count,
                             ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream) {
  return guard(fn, [&]() -> ncclResult_t {
    Use use(comm, fn);
    const int n = use->comm->size(), me = use->comm->rank();
    TUTTI_CHECK(root >= 0 && root < n, InvalidArgument, "{}: root {} is out of range (0..{})", fn, root, n - 1);
    CollectiveCall call{to_root ? Collective::kGather : Collective::kScatter, sendbuff, recvbuff,
                        static_cast<int64_t>(count), {}, root};
    call.reduction.type = to_type(datatype, fn);
    if (me != root && to_root) call.output = nullptr;  // only the root's buffer holds every part
    if (me != root && !to_root) call.input = nullptr;
    check_buffer(call.input, to_root || me == root ? count : 0, "sendbuff", fn);
    check_buffer(call.output, !to_root || me == root ? count : 0, "recvbuff", fn);
    return collective(use, fn, call, stream);
  });
}

ncclResult_t unsupported(const char* fn, const char* why) {
  t_last_error = fmt::format("{}: {}", fn, why);
  TUTTI_WARN("{}", t_last_error);
  return ncclInvalidUsage;
}
constexpr const char* kNoDeviceApi = "tutti does not offer NCCL's device API (ncclDevComm, teams, barriers)";

struct Team {  // NCCL's ncclTeam_t
  int nRanks, rank, stride;
};
Team world_team(ncclComm_t comm) {
  if (!comm || !comm->comm) return {0, 0, 1};
  return {comm->comm->size(), comm->comm->rank(), 1};
}
// Load/store accessible ranks: tutti shares memory among all ranks of a host; a team is a
// contiguous range only when every rank of the communicator is on this host.
Team lsa_team(ncclComm_t comm) {
  Team w = world_team(comm);
  if (comm && comm->comm && comm->comm->local_ranks() == w.nRanks) return w;
  return {1, 0, 1};
}
}  // namespace

NCCL_API(ncclResult_t, ncclGather, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
         int root, ncclComm_t comm, cudaStream_t stream) {
  return rooted_exchange("ncclGather", true, sendbuff, recvbuff, count, datatype, root, comm, stream);
}

NCCL_API(ncclResult_t, ncclScatter, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
         int root, ncclComm_t comm, cudaStream_t stream) {
  return rooted_exchange("ncclScatter", false, sendbuff, recvbuff, count, datatype, root, comm, stream);
}

// Windows register like ncclCommRegister: plans read registered memory where they can.
NCCL_API(ncclResult_t, ncclCommWindowRegister, ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win, int) {
  return pncclCommRegister(comm, buff, size, reinterpret_cast<void**>(win));
}
NCCL_API(ncclResult_t, ncclCommWindowDeregister, ncclComm_t comm, ncclWindow_t win) { return pncclCommDeregister(comm, win); }

NCCL_API(ncclResult_t, ncclCommInitRankScalable, ncclComm_t* newcomm, int nranks, int myrank, int nId,
         ncclUniqueId* commIds, ncclConfig_t* config) {
  // Several ids spread NCCL's bootstrap over several roots; tutti's rendezvous takes one.
  if (nId < 1 || !commIds) {
    t_last_error = fmt::format("ncclCommInitRankScalable: {} unique ids", nId);
    return ncclInvalidArgument;
  }
  return pncclCommInitRankConfig(newcomm, nranks, commIds[0], myrank, config);
}

NCCL_API(ncclResult_t, ncclCommShrink, ncclComm_t comm, int* excludeRanksList, int excludeRanksCount,
         ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags) {
  if (newcomm) *newcomm = nullptr;
  return guard("ncclCommShrink", [&] {
    TUTTI_CHECK((shrinkFlags & ~NCCL_SHRINK_ABORT) == 0, InvalidArgument,
                "ncclCommShrink: unknown shrinkFlags {:#x} (NCCL_SHRINK_DEFAULT or NCCL_SHRINK_ABORT)", shrinkFlags);
    const bool after_failure = (shrinkFlags & NCCL_SHRINK_ABORT) != 0;
    TUTTI_CHECK(newcomm, InvalidArgument, "ncclCommShrink: newcomm is NULL");
    TUTTI_CHECK(excludeRanksCount >= 0 && (excludeRanksCount == 0 || excludeRanksList), InvalidArgument,
                "ncclCommShrink: {} excluded ranks but the list is NULL", excludeRanksCount);
    Use use(comm, "ncclCommShrink");
    std::vector<int> exclude(excludeRanksList, excludeRanksList + excludeRanksCount);
    const int n = use->comm->size(), me = use->comm->rank();
    for (int r : exclude) {
      TUTTI_CHECK(r >= 0 && r < n, InvalidArgument, "ncclCommShrink: rank {}: excluded rank {} is out of range (0..{})",
                  me, r, n - 1);
      TUTTI_CHECK(r != me, InvalidArgument,
                  "ncclCommShrink: rank {} is in its own exclusion list; only the ranks that remain call it", me);
    }
    auto* c = new ncclComm();
    try {
      apply_config(c, config, "ncclCommShrink");
      c->blocking = true;
      c->cuda_dev = use->cuda_dev;
      c->emulated = use->emulated;
      c->device_options = use->device_options;
      if (after_failure) {  // the parent's calls in progress stop first, device launches too
        use->revoked = true;
        use->comm->revoke();
        std::lock_guard lock(use->device_mu);
        if (use->device) use->device->abort();
      }
      if (use->worker) use->worker->drain();  // its queued calls first (they give up if revoked)
      c->comm = use->comm->shrink(exclude, after_failure);
      c->dispatcher = std::make_unique<Dispatcher>(*c->comm);
      connect_device(c);
    } catch (...) {
      delete c;
      throw;
    }
    register_comm(c);
    *newcomm = c;
    return ncclSuccess;
  });
}
NCCL_API(ncclResult_t, ncclCommRevoke, ncclComm_t comm, int revokeFlags) {
  if (!comm) return ncclSuccess;  // as NCCL
  return guard("ncclCommRevoke", [&] {
    TUTTI_CHECK(revokeFlags == NCCL_REVOKE_DEFAULT, InvalidArgument,
                "ncclCommRevoke: revokeFlags {} must be NCCL_REVOKE_DEFAULT (0)", revokeFlags);
    Use use(comm, "ncclCommRevoke", false);
    TUTTI_CHECK(!comm->revoked.exchange(true), InvalidArgument, "ncclCommRevoke: the communicator was revoked already");
    // Calls in progress on any thread give up (Aborted, "revoked"); the bootstrap stays, so the
    // ranks can still split, shrink and destroy. Device launches stop on their abort flag.
    if (comm->comm) comm->comm->revoke();
    std::lock_guard lock(comm->device_mu);
    if (comm->device) comm->device->abort();
    return ncclSuccess;
  });
}
NCCL_API(ncclResult_t, ncclGroupSimulateEnd, ncclSimInfo_t* simInfo) {
  return guard("ncclGroupSimulateEnd", [&] {
    TUTTI_CHECK(t_group_depth > 0, InvalidUsage, "ncclGroupSimulateEnd without ncclGroupStart");
    TUTTI_CHECK(!simInfo || simInfo->magic == 0x74685283, InvalidArgument,
                "ncclGroupSimulateEnd: simInfo was not initialized with NCCL_SIM_INFO_INITIALIZER");
    if (--t_group_depth > 0) return ncclSuccess;
    // The group ends without running: its calls are predicted, not made. A group's communicators
    // run side by side, so its time is the slowest communicator's calls, one after another.
    std::vector<PendingOp> ops;
    ops.swap(t_ops);
    t_inits.clear();
    std::map<ncclComm*, double> per_comm;
    for (const PendingOp& op : ops) {
      Use use(op.comm, "ncclGroupSimulateEnd");
      if (use->worker) use->worker->drain();  // the dispatcher is not shared with a running call
      if (op.kind == PendingOp::kCollective) {
        per_comm[op.comm] += use->dispatcher->predict_us(op.call);
      } else if (op.kind == PendingOp::kPlan) {
        per_comm[op.comm] += use->dispatcher->predict_us(
            op.plan->plan, static_cast<uint64_t>(op.args.count) * size_of(op.args.reduction.type));
      } else {
        // A send or receive: one message over the model's link (its latency and bandwidth).
        if (op.peer != use->comm->rank()) per_comm[op.comm] += use->dispatcher->predict_transfer_us(op.peer, op.bytes);
      }
    }
    double slowest = 0;
    for (auto& [c, us] : per_comm) slowest = std::max(slowest, us);
    if (simInfo) simInfo->estimatedTime = static_cast<float>(slowest);
    return ncclSuccess;
  });
}
NCCL_API(void, ncclResetDebugInit) {}
NCCL_API(void, ncclResetDebugInitInternal) {}

NCCL_API(ncclResult_t, ncclDevCommCreate, ncclComm_t, const void*, void*) {
  return unsupported("ncclDevCommCreate", kNoDeviceApi);
}
NCCL_API(ncclResult_t, ncclDevCommDestroy, ncclComm_t, const void*) {
  return unsupported("ncclDevCommDestroy", kNoDeviceApi);
}
NCCL_API(ncclResult_t, ncclGinBarrierCreateRequirement, ncclComm_t, Team, int, void*, void*) {
  return unsupported("ncclGinBarrierCreateRequirement", kNoDeviceApi);
}
NCCL_API(ncclResult_t, ncclLsaBarrierCreateRequirement, Team, int, void*, void*) {
  return unsupported("ncclLsaBarrierCreateRequirement", kNoDeviceApi);
}
NCCL_API(ncclResult_t, ncclLLA2ACreateRequirement, int, int, void*, void*) {
  return unsupported("ncclLLA2ACreateRequirement", kNoDeviceApi);
}
NCCL_API(int, ncclLLA2ACalcSlots, int, int) {
  unsupported("ncclLLA2ACalcSlots", kNoDeviceApi);
  return 0;
}
NCCL_API(Team, ncclTeamWorld, ncclComm_t comm) { return world_team(comm); }
NCCL_API(Team, ncclTeamLsa, ncclComm_t comm) { return lsa_team(comm); }
NCCL_API(Team, ncclTeamRail, ncclComm_t comm) {
  Team w = world_team(comm), l = lsa_team(comm);
  return {w.nRanks / std::max(1, l.nRanks), w.rank / std::max(1, l.nRanks), l.nRanks};
}
NCCL_API(int, ncclTeamRankToWorld, ncclComm_t comm, Team team, int rank) {
  return world_team(comm).rank + (rank - team.rank) * team.stride;
}
NCCL_API(int, ncclTeamRankToLsa, ncclComm_t comm, Team team, int rank) {
  Team w = world_team(comm), l = lsa_team(comm);
  int world = w.rank + (rank - team.rank) * team.stride;
  return world - (w.rank - l.rank);
}
