#pragma once
// Device buffers between ranks that share no GPU memory (ranks on other hosts, or
// TUTTI_DEVICE_STAGING=1): each call waits for the caller's stream, copies its device buffers to
// host memory, runs the CPU executor (or the host point-to-point path) over the host transports
// (shm, tcp), and copies the results back. Correct first: the call returns when it is done rather
// than once enqueued, and it cannot be captured in a CUDA graph (refused with a message). A proxy
// thread that lets the call return at once is the next step (DESIGN.md §4).
//
// Which buffers a call touches comes from the plan: the input and output chunks of the collective
// (the spec's chunk counts in the call's geometry). The output is copied in as well as out, so
// regions a plan leaves alone (a non-root's gather output) come back unchanged.

#include <cstdint>
#include <vector>

#include "runtime/communicator.hpp"
#include "runtime/device/backend.hpp"
#include "runtime/device/device_executor.hpp"
#include "runtime/executor.hpp"

namespace tutti::device {

class HostStagingExecutor final : public Executor {
 public:
  // `device`: the communicator's device executor, connected and needing host staging (its backend
  // copies and synchronises; its temporaries and element steps serve the dispatcher's adaptations);
  // `host`: the CPU executor of the same communicator, which runs the plans.
  HostStagingExecutor(Communicator& comm, DeviceExecutor& device, CpuExecutor& host);
  void run(const PreparedPlan& plan, const ExecArgs& args) override;
  bool device() const override { return true; }
  void* temp(int slot, size_t bytes, void* stream) override;
  void copy(void* dst, const void* src, size_t bytes, void* stream) override;
  void scale(DataType type, void* dst, const void* src, const void* scalar, size_t count, void* stream) override;
  void divide(DataType type, void* dst, const void* src, uint64_t divisor, size_t count, void* stream) override;
  // A group's sends and receives on device buffers, through host memory over channel 0, as
  // DeviceExecutor::run_p2p would run them (one peer's transfers in order, matched in order).
  void run_p2p(const std::vector<P2pTransfer>& ops, void* stream);

 private:
  void refuse_capture(void* stream, const char* what) const;

  Communicator& comm_;
  DeviceExecutor& device_;
  CpuExecutor& host_;
  std::vector<unsigned char> in_, out_;  // host copies of the call's buffers, grown on demand
  std::vector<std::vector<unsigned char>> p2p_;  // host copies of a group's transfers
};

}  // namespace tutti::device
