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

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "compiler/plan.hpp"
#include "core/reduce.hpp"
#include "runtime/communicator.hpp"
#include "runtime/worker_pool.hpp"

namespace tutti {

// A certified plan (plan::certify) prepared for execution: computed once, reused by every call.
// Everything an executor needs is stated by the Plan itself (dense block ids, fifo_depth,
// any_count); make() only checks that it was.
struct PreparedPlan {
  uint64_t id = 0;  // unique per prepared plan in this process (executors cache per id)
  plan::Plan plan;
  CollectiveSpec spec;
  // Throws InvalidArgument naming the plan if it was not certified or its block ids are not dense.
  static std::shared_ptr<const PreparedPlan> make(plan::Plan plan);
};

// What every executor checks of a call before running a plan: the plan's rank count, a count the
// plan can split. Throws InvalidArgument naming the plan.
void check_call(const PreparedPlan& plan, int nranks, int64_t count);

struct ExecArgs {
  const void* input = nullptr;  // sendbuff
  void* output = nullptr;       // recvbuff
  int64_t count = 0;            // elements per rank piece (NCCL's count)
  Reduction reduction;          // op and type (type also for pure data movement)
};

class Executor {
 public:
  // Plan channel c runs on communicator channel c + 1: channel 0 carries point-to-point traffic
  // (ncclSend/ncclRecv), which must never interleave with a plan's messages on one connection.
  static constexpr int kPlanChannelBase = 1;

  explicit Executor(Communicator& comm);
  ~Executor();
  // Runs the plan for this rank. Collective: every rank runs the same plan with the same count.
  // Throws InvalidArgument for a count the plan cannot split, and the communicator's error if a
  // peer fails or the wait times out.
  void run(const PreparedPlan& plan, const ExecArgs& args);
  int64_t tile_bytes() const { return tile_; }
  // Worker threads a run uses at most (TUTTI_WORKERS; 0 picks cores / ranks on this host).
  int workers() const { return workers_; }

 private:
  Communicator& comm_;
  int64_t tile_;
  int staging_slots_;
  int workers_;
  uint64_t stream_threshold_;  // TUTTI_STREAM_THRESHOLD: outputs this large are written around the caches
  std::vector<unsigned char> scratch_;
  std::vector<std::vector<unsigned char>> staging_;  // per block, grown on demand
  WorkerPool pool_;
  struct Layout;
  // Per prepared plan run here (by PreparedPlan::id): a program that alternates collectives, or a
  // tuner that alternates candidates, does not rebuild state machines and engines on each switch.
  std::map<uint64_t, std::unique_ptr<Layout>> layouts_;
};

}  // namespace tutti
