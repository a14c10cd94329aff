#pragma once
// The device plan executor: runs the same verified plans as the CPU executor, on device buffers,
// as one launch of the interpreter (runtime/device/interpreter.hpp) per call on the caller's
// stream. The call returns once the launch is enqueued (at once on CUDA; the emulated device runs
// it before returning).
//
// Connections: for each channel a plan uses, every rank allocates an inbox in its device memory,
// one FIFO per sending peer (runtime/device/abi.hpp), and the ranks exchange the inboxes through the
// bootstrap: ranks of one process use each other's pointers (peer access between GPUs), ranks of
// other processes on the host map them with the backend's sharing handles (CUDA IPC). Several
// ranks may share one GPU.
//
// Thread safety: one thread drives an executor at a time (as its communicator). Launches of one
// executor must be ordered (one stream, or streams the caller orders): they share FIFOs and flags.

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "runtime/communicator.hpp"
#include "runtime/device/backend.hpp"
#include "runtime/device/device_plan.hpp"
#include "runtime/executor.hpp"

namespace tutti::device {

struct DeviceOptions {
  int64_t slot_bytes = 512 << 10;
  int64_t ll_slot_bytes = 32 << 10;
  int64_t fifo_depth = 8;
  int threads = 512;
  int instances = 0;  // 0: about one thread block per multiprocessor over the ranks of this host
  int min_instances = 1, max_instances = 64;  // bounds of the automatic count (NCCL_MIN/MAX_NCHANNELS)
  std::optional<int32_t> protocol;  // kProtoSimple / kProtoLL for every plan; unset: the plan's own
  double timeout_s = 1800;
  bool host_staging = false;  // carry device buffers through host memory even where GPU memory could be shared
  // TUTTI_DEVICE_SLOT_SIZE, TUTTI_DEVICE_LL_SLOT_SIZE, TUTTI_DEVICE_FIFO_DEPTH, TUTTI_DEVICE_THREADS,
  // TUTTI_DEVICE_INSTANCES, TUTTI_DEVICE_STAGING, TUTTI_PROTO/NCCL_PROTO, TUTTI_TIMEOUT, and NCCL's
  // NCCL_BUFFSIZE, NCCL_NTHREADS, NCCL_MIN_NCHANNELS and NCCL_MAX_NCHANNELS where they mean something here. Throws InvalidArgument naming a bad value.
  static DeviceOptions from_env();
};

class DeviceExecutor final : public Executor {
 public:
  DeviceExecutor(Communicator& comm, std::unique_ptr<Backend> backend, const DeviceOptions& options);
  // Frees the device memory only after close(): until every rank has closed, a peer may still
  // read and write this rank's FIFOs (a peer that is still in a collective this rank left, after an
  // error). Without close() the memory stays allocated (and a warning says so).
  ~DeviceExecutor() override;
  DeviceExecutor(const DeviceExecutor&) = delete;
  DeviceExecutor& operator=(const DeviceExecutor&) = delete;

  // Enqueues the plan for this rank on args.stream. Collective: every rank runs the same plan with
  // the same count. Throws InvalidArgument for a count the plan cannot split or a plan that needs
  // deeper FIFOs than configured, and the failure of an earlier launch (check()). The protocol is
  // the options' (TUTTI_PROTO) if set, else args.protocol unless kAuto, else the plan's.
  void run(const PreparedPlan& plan, const ExecArgs& args) override;
  bool device() const override { return true; }
  // Scratch memory of the device for the caller's adaptations (in-place / out-of-place), grown on
  // demand in `stream`'s order; valid until the next call of temp().
  void* temp(int slot, size_t bytes, void* stream) override;
  void copy(void* dst, const void* src, size_t bytes, void* stream) override;
  void scale(DataType type, void* dst, const void* src, const void* scalar, size_t count, void* stream) override;
  void divide(DataType type, void* dst, const void* src, uint64_t divisor, size_t count, void* stream) override;
  // Enqueues the point-to-point transfers of a group on `stream`: transfers with different peers or
  // directions run concurrently, those of one peer and direction in order (matched in order on the
  // peer, as NCCL's). A transfer to this rank itself is a copy (sends and receives paired in order).
  void run_p2p(const std::vector<P2pTransfer>& ops, void* stream);
  // Throws the error an earlier launch recorded (abort, timeout: rank, block, step, peer, round).
  void check();
  // Makes every wait of running and future launches give up (communicator abort).
  void abort();
  // Collective: connects device channel 0 (point-to-point), so later point-to-point calls between
  // any two ranks need no other rank. NCCL layers call it when a communicator is made. It also
  // decides, the same way on every rank, whether this executor can run at all: when some pair of
  // ranks shares no GPU memory (other hosts, or TUTTI_DEVICE_STAGING), no FIFO is opened and
  // needs_host_staging() says so; the caller then runs device calls with a HostStagingExecutor
  // (runtime/device/host_staging.hpp), and run() here refuses them.
  void connect() { ensure_channels(1); }
  bool needs_host_staging() const { return staged_; }
  // The device transport that carries each peer's FIFOs ("cuda-p2p", "cuda-ipc", "host-staged";
  // runtime/transport/transport.hpp), known once connected; "self" for this rank.
  const char* transport_to(int peer) const;
  // Collective: waits for this rank's launches, then for every rank to get here, after which no
  // peer touches this rank's FIFOs and the destructor frees them. Not after abort(), nor once the
  // communicator has failed: then the memory stays allocated.
  void close();
  // Memory registered with the communicator (ncclCommRegister): a plan's send from a call buffer
  // that lies wholly inside it, to a rank of this process on the same GPU, lets the peer read the
  // data in place instead of through the FIFO (abi.hpp, "Direct reads"); the sender's launch then
  // ends only once the peer has read it, so a send from a registered buffer completes with its
  // receive (as NCCL's large sends do: pair them in a group). After a failed call (abort,
  // timeout) peers may still read the buffers until their own calls fail: keep them until then.
  // deregister_memory takes what register_memory was given.
  void register_memory(const void* p, size_t bytes);
  void deregister_memory(const void* p, size_t bytes);
  // Messages peers have read in place from this rank's memory (waits for this rank's launches).
  uint64_t direct_messages();
  Backend& backend() { return *backend_; }
  // The device view of the flag abort() sets (waits of other device work honour it too).
  const volatile int32_t* abort_flag() const { return abort_dev_; }
  const DeviceOptions& options() const { return options_; }

 private:
  struct Channel;
  struct Uploaded;
  struct P2pPlan;
  void ensure_channels(int n);
  Uploaded& upload(const PreparedPlan& plan, void* stream);
  // Throws InvalidArgument for a call this device cannot run (device_executor.cpp); not collective.
  void check_device_call(const DevicePlan& d, const PreparedPlan& pp, const ExecArgs& args, int32_t protocol) const;
  FifoView view(const Channel& ch, int peer, bool send) const;
  bool registered(const void* p, size_t bytes) const;

  Communicator& comm_;
  std::unique_ptr<Backend> backend_;
  DeviceOptions options_;
  int64_t fifo_stride_ = 0;
  std::vector<std::unique_ptr<Channel>> channels_;
  std::map<uint64_t, std::unique_ptr<Uploaded>> plans_;  // by PreparedPlan::id
  std::map<std::pair<int, bool>, std::unique_ptr<P2pPlan>> p2p_;  // by (peer, send)
  RankState* p2p_state_ = nullptr;  // point-to-point launches run beside each other: their own epochs
  RankState* state_ = nullptr;  // device memory
  CallStamp last_stamp_ = 0;  // the last launch's call, for a mismatch's message
  Status* status_host_ = nullptr;
  Status* status_dev_ = nullptr;
  int32_t* abort_host_ = nullptr;
  int32_t* abort_dev_ = nullptr;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  void* temps_[2] = {nullptr, nullptr};
  size_t temp_bytes_[2] = {0, 0};
  std::string last_plan_;
  bool aborted_ = false;
  bool closed_ = false;
  int ranks_on_device_ = 1;  // the most ranks of this communicator on one GPU, known once connected
  bool staged_ = false;      // some pair of ranks shares no GPU memory (the same on every rank)
  std::vector<const TransportInfo*> peer_transport_;  // by rank, once connected
  std::vector<int> peer_device_;                      // by rank, once connected
  // register_memory's; guarded by registered_mu_ (a non-blocking communicator's calls run on a
  // thread of their own while its user registers).
  std::vector<std::pair<const unsigned char*, size_t>> registered_;
  mutable std::mutex registered_mu_;
};

}  // namespace tutti::device
