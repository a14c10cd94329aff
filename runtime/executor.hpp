#pragma once
// What runs plans, and what they are given: the Executor interface that the CPU executor
// (runtime/cpu_executor.hpp), the device executor (runtime/device/device_executor.hpp) and host
// staging (runtime/device/host_staging.hpp) implement and the dispatcher drives; a prepared plan; a
// call's arguments; the checks every executor makes of a call; the stamp its messages carry.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/reduce.hpp"
#include "plan/plan.hpp"
#include "runtime/call_stamp.hpp"
#include "runtime/communicator.hpp"

namespace tutti {

// A certified plan (plan::certify) prepared for execution: computed once, reused by every call.
// Everything an executor needs is stated by the Plan itself (dense block ids, fifo_depth,
// any_count); make() only checks that it was.
// Shared: work enqueued for later (a host-staging proxy) keeps the plan it runs alive.
struct PreparedPlan : std::enable_shared_from_this<PreparedPlan> {
  uint64_t id = 0;  // unique per prepared plan in this process (executors cache per id)
  plan::Plan plan;
  CollectiveSpec spec;
  // Throws InvalidArgument naming the plan if it was not certified or its block ids are not dense.
  static std::shared_ptr<const PreparedPlan> make(plan::Plan plan);
};

struct ExecArgs;
// What every executor checks of a call before running a plan: the plan's rank count, a count the
// plan can split, a buffer for each of its state buffers. Throws InvalidArgument naming the plan.
void check_call(const PreparedPlan& plan, int nranks, const ExecArgs& args);

struct ExecArgs {
  const void* input = nullptr;  // sendbuff
  void* output = nullptr;       // recvbuff
  int64_t count = 0;            // elements per rank piece (NCCL's count)
  Reduction reduction;          // op and type (type also for pure data movement)
  void* stream = nullptr;       // device executors: the cudaStream_t the call is ordered on
  // Device executors: run this call with this protocol (kSimple or kLL) rather than the plan's.
  Protocol protocol = Protocol::kAuto;
  // The values of the plan's per-call kernel scalars (ScalarArg::per_call slots), this call's.
  std::vector<double> scalars;
  // The plan's state buffers (plan::Plan::states), in order: the user's memory, read and written
  // in place; each holds the plan's chunks of it (the call's chunk, or the buffer's unit).
  std::vector<void*> states;
  // The call's stamp (call_stamp below) when the caller has it already (the dispatcher computes it
  // for the divergence probe); 0: the executor computes it.
  CallStamp stamp = 0;
};

// What every message of a plan's call carries (runtime/call_stamp.hpp), on every executor: the
// plan's collective and root, the call's type, op and count (args.stamp where the caller set it).
CallStamp call_stamp(const plan::Plan& plan, const ExecArgs& args);

// One ncclSend (send) or ncclRecv of a group.
struct P2pTransfer {
  bool send = true;
  int peer = -1;
  void* buffer = nullptr;
  size_t bytes = 0;
};

// What runs plans: the CPU executor (host buffers, runtime/cpu_executor.hpp) and the device executor (device buffers,
// runtime/device/device_executor.hpp) implement it, and the dispatcher drives either the same way.
class Executor {
 public:
  virtual ~Executor() = default;
  // Runs the plan for this rank: the CPU executor returns when this rank's part is done, a device
  // executor once it is enqueued on args.stream. Collective: every rank runs the same plan with the
  // same count. Throws InvalidArgument for a call the plan cannot take (check_call) and the
  // communicator's error if a peer fails or a wait times out.
  virtual void run(const PreparedPlan& plan, const ExecArgs& args) = 0;
  // Whether the buffers of the calls it runs are device memory.
  virtual bool device() const = 0;
  // What the dispatcher does around a plan (an input copy, a discarded output, premulsum's scaling,
  // avg's division), in the executor's memory and in the order of its runs on `stream`.
  // temp: slot 0 holds an input copy, slot 1 a discarded output; valid until the next temp(slot).
  virtual void* temp(int slot, size_t bytes, void* stream) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes, void* stream) = 0;
  virtual void scale(DataType type, void* dst, const void* src, const void* scalar, size_t count, void* stream) = 0;
  virtual void divide(DataType type, void* dst, const void* src, uint64_t divisor, size_t count, void* stream) = 0;
};

}  // namespace tutti
