#pragma once
// Device buffers between ranks that share no GPU memory (ranks on other hosts, or
// TUTTI_DEVICE_STAGING=1): a proxy thread per rank runs the CPU executor (or the host
// point-to-point path) over the host transports (shm, tcp) on host copies of the call's buffers.
//
// A call returns once enqueued. On the caller's stream it enqueues: copies of the device buffers
// into pinned host memory; a host callback that hands the job to the proxy; a wait until the proxy
// has finished it (Backend::wait_flag on a host-mapped counter); the copies back; a host callback
// that recycles the host memory. The proxy runs jobs in the order they were enqueued, which is the
// communicator's call order on every rank, whatever streams they came on. A failure is recorded,
// the counter still advances (the stream never hangs on a failed job) and the next call, or
// check(), throws it. Capture in a CUDA graph is refused: the proxy takes a job per enqueue, not
// per replay.
//
// Which buffers a call touches comes from the plan: the input and output chunks of the collective
// (the spec's chunk counts in the call's geometry). The output is copied in as well as out, so
// regions a plan leaves alone (a non-root's gather output) come back unchanged.
//
// Thread safety: one thread enqueues at a time (as its communicator); the proxy is the only other
// thread that drives the communicator's CPU executor, so the communicator's calls on host buffers
// wait for it first (drain()).

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/communicator.hpp"
#include "runtime/device/backend.hpp"
#include "runtime/device/device_executor.hpp"
#include "runtime/cpu_executor.hpp"

namespace tutti::device {

class HostStagingExecutor final : public Executor {
 public:
  // `device`: the communicator's device executor, connected and needing host staging (its backend
  // copies, waits and calls back; its temporaries and element steps serve the dispatcher's
  // adaptations); `host`: the CPU executor of the same communicator, which runs the plans.
  HostStagingExecutor(Communicator& comm, DeviceExecutor& device, CpuExecutor& host);
  // Lets the proxy finish what was enqueued (unless the communicator was aborted), then stops it.
  ~HostStagingExecutor() override;
  HostStagingExecutor(const HostStagingExecutor&) = delete;
  HostStagingExecutor& operator=(const HostStagingExecutor&) = delete;

  void run(const PreparedPlan& plan, const ExecArgs& args) override;
  bool device() const override { return true; }
  void* temp(int slot, size_t bytes, void* stream) override;
  void copy(void* dst, const void* src, size_t bytes, void* stream) override;
  void scale(DataType type, void* dst, const void* src, const void* scalar, size_t count, void* stream) override;
  void divide(DataType type, void* dst, const void* src, uint64_t divisor, size_t count, void* stream) override;
  // A group's sends and receives on device buffers, through host memory over channel 0, as
  // DeviceExecutor::run_p2p would run them (one peer's transfers in order, matched in order).
  void run_p2p(const std::vector<P2pTransfer>& ops, void* stream);
  // Waits until the proxy has run every job enqueued so far (their streams must get there).
  void drain();
  // Throws the first failure of a job the proxy ran.
  void check();

 private:
  struct Job;
  struct Shared;
  struct HostBuffer {
    unsigned char* data = nullptr;
    size_t bytes = 0;
  };
  void refuse_capture(void* stream, const char* what) const;
  HostBuffer take(size_t bytes);  // pinned host memory of at least `bytes`, from the pool
  void enqueue(std::unique_ptr<Job> job, void* stream);
  void proxy_loop();
  static void on_ready(void* job);
  static void on_recycle(void* job);

  Communicator& comm_;
  DeviceExecutor& device_;
  CpuExecutor& host_;
  uint64_t* done_host_ = nullptr;  // jobs the proxy finished (host-mapped; the stream waits on it)
  uint64_t* done_dev_ = nullptr;
  uint64_t enqueued_ = 0;          // jobs enqueued (the caller's thread)
  // What the stream's callbacks touch lives apart from this object, held by every job: after an
  // abort the streams may call back after the executor is gone.
  std::shared_ptr<Shared> shared_;
  std::vector<unsigned char*> pinned_;  // every pinned buffer, freed at the end
  std::thread proxy_;
};

}  // namespace tutti::device
