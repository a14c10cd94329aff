#include "runtime/device/host_staging.hpp"

#include <cstring>

#include "core/datatype.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "runtime/device/fifo.hpp"
#include "plan/semantics.hpp"

namespace tutti::device {

// One call's work for the proxy: what it runs on host copies, and the host memory it holds until
// the copies back are done.
struct HostStagingExecutor::Shared {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Job*> queue;                       // enqueued, not yet run
  std::map<Job*, std::unique_ptr<Job>> live;    // enqueued, not yet recycled
  std::multimap<size_t, unsigned char*> free;   // pinned buffers by size
  std::exception_ptr error;
  bool stop = false;
};

struct HostStagingExecutor::Job {
  std::shared_ptr<Shared> shared;
  uint64_t seq = 0;  // the counter's value once it is done
  std::shared_ptr<const PreparedPlan> plan;  // null: point-to-point
  ExecArgs args;                             // host pointers into `buffers`
  std::vector<P2pTransfer> ops;              // host pointers into `buffers`
  std::vector<HostBuffer> buffers;
  bool ready = false;  // its inputs are in host memory; guarded by shared->mu
};

HostStagingExecutor::HostStagingExecutor(Communicator& comm, DeviceExecutor& device, CpuExecutor& host)
    : comm_(comm), device_(device), host_(host), shared_(std::make_shared<Shared>()) {
  void* view = nullptr;
  done_host_ = static_cast<uint64_t*>(device_.backend().alloc_host(sizeof(uint64_t), &view));
  done_dev_ = static_cast<uint64_t*>(view);
  *done_host_ = 0;
  proxy_ = std::thread([this] { proxy_loop(); });
}

HostStagingExecutor::~HostStagingExecutor() {
  Shared& sh = *shared_;
  {
    std::lock_guard lock(sh.mu);
    sh.stop = true;
  }
  sh.cv.notify_all();
  proxy_.join();
  std::unique_lock lock(sh.mu);
  if (!comm_.state().aborted()) {
    // The streams still hold the copies back and the recycling callbacks of the last jobs: they
    // finish on their own (the proxy has run every job), after which nothing refers to this.
    sh.cv.wait(lock, [&] { return sh.live.empty(); });
  } else if (!sh.live.empty()) {
    // An aborted communicator's streams may still call back into these jobs, which keep what they
    // touch (shared_) alive; their pinned memory and the counter stay allocated.
    TUTTI_WARN("rank {}: host staging stopped with {} call(s) unfinished; their host memory stays allocated",
               comm_.rank(), sh.live.size());
    return;
  }
  for (unsigned char* p : pinned_) device_.backend().release_host(p);
  device_.backend().release_host(done_host_);
}

void HostStagingExecutor::refuse_capture(void* stream, const char* what) const {
  TUTTI_CHECK(!device_.backend().capturing(stream), InvalidUsage,
              "rank {}: {} on device buffers goes through host memory on this communicator (some ranks share no GPU "
              "memory, or TUTTI_DEVICE_STAGING=1), whose proxy takes each call once, so it cannot be captured in a "
              "CUDA graph and replayed",
              comm_.rank(), what);
}

void HostStagingExecutor::check() {
  std::lock_guard lock(shared_->mu);
  if (shared_->error) std::rethrow_exception(shared_->error);
}

void HostStagingExecutor::drain() {
  std::unique_lock lock(shared_->mu);
  shared_->cv.wait(lock, [&] { return shared_->queue.empty(); });
}

HostStagingExecutor::HostBuffer HostStagingExecutor::take(size_t bytes) {
  {
    std::lock_guard lock(shared_->mu);
    auto it = shared_->free.lower_bound(bytes);
    if (it != shared_->free.end()) {
      HostBuffer b{it->second, it->first};
      shared_->free.erase(it);
      return b;
    }
  }
  // Pinned, so the copies are asynchronous; rounded up to a power of two so a sweep of sizes
  // allocates a few times, not once per size.
  size_t size = 4096;
  while (size < bytes) size *= 2;
  void* view = nullptr;
  auto* p = static_cast<unsigned char*>(device_.backend().alloc_host(size, &view));
  pinned_.push_back(p);
  return HostBuffer{p, size};
}

// Both run on a CUDA callback thread (or in the caller, emulated); they notify under the lock, so
// a waiter cannot see the state change and destroy the condition variable first.
void HostStagingExecutor::on_ready(void* arg) {
  auto* job = static_cast<Job*>(arg);
  Shared& sh = *job->shared;
  std::lock_guard lock(sh.mu);
  job->ready = true;
  sh.cv.notify_all();
}

void HostStagingExecutor::on_recycle(void* arg) {
  auto* job = static_cast<Job*>(arg);
  const std::shared_ptr<Shared> keep = job->shared;  // erasing the job drops its reference
  std::lock_guard lock(keep->mu);
  for (const HostBuffer& b : job->buffers) keep->free.emplace(b.bytes, b.data);
  keep->live.erase(job);
  keep->cv.notify_all();
}

void HostStagingExecutor::proxy_loop() {
  log::set_thread_rank(comm_.rank());
  Shared& sh = *shared_;
  for (;;) {
    Job* job = nullptr;
    {
      std::unique_lock lock(sh.mu);
      // In call order: the first job enqueued runs first, once its inputs are in host memory.
      sh.cv.wait(lock, [&] {
        const bool runnable = !sh.queue.empty() && sh.queue.front()->ready;
        return runnable || (sh.stop && (sh.queue.empty() || comm_.state().aborted()));
      });
      if (sh.queue.empty() || !sh.queue.front()->ready) return;
      job = sh.queue.front();
    }
    std::exception_ptr failure;
    try {
      if (job->plan) host_.run(*job->plan, job->args);
      else run_host_p2p(comm_, job->ops);
    } catch (...) {
      failure = std::current_exception();
    }
    std::lock_guard lock(sh.mu);
    if (failure && !sh.error) sh.error = failure;
    sh.queue.pop_front();
    mem::store_release(done_host_, job->seq);  // the stream goes on: copies back, then the caller's work
    sh.cv.notify_all();
  }
}

void HostStagingExecutor::enqueue(std::unique_ptr<Job> job, void* stream) {
  Backend& b = device_.backend();
  Job* raw = job.get();
  raw->shared = shared_;
  raw->seq = ++enqueued_;
  {
    std::lock_guard lock(shared_->mu);
    shared_->queue.push_back(raw);
    shared_->live.emplace(raw, std::move(job));
    shared_->cv.notify_all();
  }
  b.host_callback(stream, &HostStagingExecutor::on_ready, raw);
  b.wait_flag(stream, done_dev_, raw->seq, device_.abort_flag());
}

void HostStagingExecutor::run(const PreparedPlan& pp, const ExecArgs& args) {
  refuse_capture(args.stream, "a collective");
  check();
  check_call(pp, comm_.size(), args);
  Backend& b = device_.backend();
  const exec::Geometry g{args.count, pp.plan.chunk_factor, static_cast<int64_t>(size_of(args.reduction.type))};
  auto bytes_of = [&](int chunks) { return chunks > 0 ? static_cast<size_t>(g.bytes(0, chunks)) : size_t{0}; };
  const size_t in_bytes = bytes_of(pp.spec.input_chunks()), out_bytes = bytes_of(pp.spec.output_chunks());
  auto* in = static_cast<const unsigned char*>(args.input);
  auto* out = static_cast<unsigned char*>(args.output);
  // In-place calls pass one buffer and a slice of it (the same pointer, for a reduce-scatter's rank
  // 0): stage the one that holds the other once and alias the slice.
  auto holds = [](const unsigned char* base, size_t n, const unsigned char* p, size_t m) {
    return base && p && n > 0 && p >= base && p + m <= base + n;
  };
  const bool in_within_out = holds(out, out_bytes, in, in_bytes);
  const bool out_within_in = !in_within_out && holds(in, in_bytes, out, out_bytes);

  auto job = std::make_unique<Job>();
  job->plan = pp.weak_from_this().lock();
  if (!job->plan) job->plan = std::make_shared<const PreparedPlan>(pp);  // not made by make(): keep a copy
  ExecArgs& host = job->args;
  host = args;
  host.stream = nullptr;
  // A buffer the call does not use may be null (a broadcast's non-root input): nothing to stage.
  // Everything enqueued before this call (the dispatcher's premulsum scaling and input copies among
  // it) is before these copies on the stream.
  if (out_within_in) {
    HostBuffer hin = take(in_bytes);
    job->buffers.push_back(hin);
    b.copy(hin.data, in, in_bytes, args.stream);
    host.input = hin.data;
    host.output = hin.data + (out - in);
  } else {
    HostBuffer hout = take(out_bytes);
    job->buffers.push_back(hout);
    if (out) b.copy(hout.data, out, out_bytes, args.stream);
    host.output = hout.data;
    if (in_within_out) {
      host.input = hout.data + (in - out);
    } else {
      HostBuffer hin = take(in_bytes);
      job->buffers.push_back(hin);
      if (in) b.copy(hin.data, in, in_bytes, args.stream);
      host.input = hin.data;
    }
  }
  unsigned char* result = job->buffers[0].data;
  Job* raw = job.get();
  enqueue(std::move(job), args.stream);
  // Back to the device: the buffer the plan writes (the whole staged buffer when they are one).
  if (out_within_in) b.copy(const_cast<unsigned char*>(in), result, in_bytes, args.stream);
  else if (out) b.copy(out, result, out_bytes, args.stream);
  b.host_callback(args.stream, &HostStagingExecutor::on_recycle, raw);
}

void* HostStagingExecutor::temp(int slot, size_t bytes, void* stream) { return device_.temp(slot, bytes, stream); }

void HostStagingExecutor::copy(void* dst, const void* src, size_t bytes, void* stream) {
  device_.copy(dst, src, bytes, stream);
}

void HostStagingExecutor::scale(DataType t, void* dst, const void* src, const void* scalar, size_t n, void* stream) {
  device_.scale(t, dst, src, scalar, n, stream);
}

void HostStagingExecutor::divide(DataType t, void* dst, const void* src, uint64_t d, size_t n, void* stream) {
  device_.divide(t, dst, src, d, n, stream);
}

void HostStagingExecutor::run_p2p(const std::vector<P2pTransfer>& ops, void* stream) {
  refuse_capture(stream, "a point-to-point group");
  check();
  Backend& b = device_.backend();
  auto job = std::make_unique<Job>();
  job->ops = ops;
  for (P2pTransfer& op : job->ops) {
    HostBuffer h = take(op.bytes);
    job->buffers.push_back(h);
    if (op.send && op.bytes) b.copy(h.data, op.buffer, op.bytes, stream);
    op.buffer = h.data;
  }
  Job* raw = job.get();
  enqueue(std::move(job), stream);
  for (size_t i = 0; i < ops.size(); ++i)
    if (!ops[i].send && ops[i].bytes) b.copy(ops[i].buffer, raw->buffers[i].data, ops[i].bytes, stream);
  b.host_callback(stream, &HostStagingExecutor::on_recycle, raw);
}

}  // namespace tutti::device
