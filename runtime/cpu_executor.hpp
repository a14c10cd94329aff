#pragma once
// The CPU plan interpreter. Each rank runs every block of its part of a Plan as a state machine: an
// instruction starts when its dependencies are retired, posts its transfers tile by tile (so a chunk
// moving through several ranks is pipelined), and is issued when its last tile is received and its
// last outgoing tile posted. No block waiting for a peer stops another block from running.
//
// Eager sends. The verifier proves a plan deadlock-free assuming a send completes once posted. So a
// block moves on as soon as its sends are posted; a step *retires* (and satisfies the dependencies
// of other blocks) once its outgoing tiles are done, i.e. the buffer they come from may be
// overwritten. A later step of the same block that writes a region some pending send still reads
// waits for it. When a rank has nothing else to do, pending sends are copied into memory the
// connection owns (Connection::own), which retires them at once: no cycle of full FIFOs can form,
// whatever the message sizes and FIFO depths.
//
// Workers. Blocks are spread over TUTTI_WORKERS threads by channel (a channel's connections belong
// to one thread, so connections stay single-threaded); the calling thread is worker 0. Retirement
// counters are atomics (release on store, acquire on the dependency check), and a worker that
// retires a step rings the rank's doorbell so a sleeping worker waiting for it wakes up.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/communicator.hpp"
#include "runtime/executor.hpp"
#include "runtime/worker_pool.hpp"

namespace tutti {

namespace executor_detail {
class BlockMachine;
}

// The point-to-point transfers of a group on host buffers, over channel 0 of the communicator:
// transfers to one peer are matched in order on the peer, as NCCL's; a transfer to this rank itself
// is a copy (its sends and receives paired in order, equal sizes). Returns when all are done.
// Throws InvalidUsage for unpaired or mismatched self transfers and the communicator's errors.
void run_host_p2p(Communicator& comm, const std::vector<P2pTransfer>& ops);

// The CPU executor's settings, read when a communicator is made.
struct CpuExecutorOptions {
  // TUTTI_TILE_SIZE: transfers move in tiles this large (a multiple of 64). Unset: the calibration's
  // the communicator took (Communicator::calibration), else kDefaultTileBytes.
  std::optional<int64_t> tile_bytes;
  static constexpr int64_t kDefaultTileBytes = 1 << 20;
  int staging_slots = 4;             // TUTTI_PIPELINE_DEPTH: tiles a forwarding reduction keeps in flight
  int workers = 0;                   // TUTTI_WORKERS: 0 picks cores / ranks on this host
  bool stream_epilogues = true;      // TUTTI_STREAM_EPILOGUES: reductions' epilogues run as data arrives
  bool huge_pages = true;            // TUTTI_HUGE_PAGES: large buffers are moved onto huge pages
  // TUTTI_STREAM_THRESHOLD: outputs this large are written around the caches (0: never). Unset: the
  // host's last-level cache divided by the ranks on it (default_stream_threshold).
  std::optional<uint64_t> stream_threshold;
  std::string trace;                 // TUTTI_TRACE: a Chrome trace of every instruction (runtime/trace.hpp)
  // Throws InvalidArgument naming a bad value.
  static CpuExecutorOptions from_env();
};

// A reducing receive whose epilogue streams (KernelDef::stream): the receive stores a chunk
// (recv_reduce_copy) and `compute`, which follows it in its block or depends on it, runs a kernel
// with a stream form that rewrites that chunk in place as its first input and output. The executor
// runs the kernel on each range of the chunk as the receive combines it; the compute step only
// finishes it (the rest of the range, the statistics).
struct StreamedEpilogueStep {
  plan::Dep receive, compute;
};
// The receives of `rank`'s part of the plan whose epilogue can stream: those where every other
// step that touches the chunk runs before the receive or after the compute, as the plan orders
// them, so none sees the chunk half processed.
std::vector<StreamedEpilogueStep> streamed_epilogues(const PreparedPlan& plan, int rank);

// The output size from which a rank's received and copied data go around the caches: where the
// outputs of every rank on the host together fill the last-level cache (sysfs), since below that
// the next call finds them in the cache (2 ranks here, 32 MiB L3: an 8 MiB all-gather ran 1.5x
// faster kept in the cache, a 16 MiB one 1.3x faster streamed). 8 MiB where the cache size is unknown.
uint64_t default_stream_threshold(int local_ranks);

class CpuExecutor final : public Executor {
 public:
  // Plan channel c runs on communicator channel c + 1: channel 0 carries point-to-point traffic
  // (ncclSend/ncclRecv), which must never interleave with a plan's messages on one connection.
  static constexpr int kPlanChannelBase = 1;

  CpuExecutor(Communicator& comm, const CpuExecutorOptions& options);
  ~CpuExecutor() override;
  void run(const PreparedPlan& plan, const ExecArgs& args) override;
  bool device() const override { return false; }
  void* temp(int slot, size_t bytes, void* stream) override;
  void copy(void* dst, const void* src, size_t bytes, void* stream) override;
  void scale(DataType type, void* dst, const void* src, const void* scalar, size_t count, void* stream) override;
  void divide(DataType type, void* dst, const void* src, uint64_t divisor, size_t count, void* stream) override;

  int64_t tile_bytes() const { return tile_bytes_; }
  // For the calibration's sweeps only (collectives/calibrate.cpp): later runs use tiles of `bytes`
  // (rounded down to a multiple of 64, at least 64). Every rank must use the same tile size: a
  // transfer's tiles are messages its receiver matches one by one.
  void set_tile_bytes(int64_t bytes);
  // Worker threads a run uses at most.
  int workers() const { return options_.workers; }

 private:
  Communicator& comm_;
  CpuExecutorOptions options_;  // workers resolved
  int64_t tile_bytes_ = CpuExecutorOptions::kDefaultTileBytes;  // options_.tile_bytes resolved
  std::vector<unsigned char> scratch_;
  std::vector<std::vector<unsigned char>> staging_;  // per block, grown on demand
  std::vector<unsigned char> temp_[2];
  WorkerPool pool_;
  struct Layout;
  // Drives the call's blocks to the end on the layout's workers (the calling thread is worker 0).
  void run_workers(executor_detail::BlockMachine& machine, Layout& layout, Doorbell* bell, std::atomic<bool>& failed);
  // Per prepared plan run here (by PreparedPlan::id): a program that alternates collectives, or a
  // tuner that alternates candidates, does not rebuild state machines and engines on each switch.
  std::map<uint64_t, std::unique_ptr<Layout>> layouts_;
};

}  // namespace tutti
