#pragma once
// A Plan flattened for a device interpreter: per rank, plain arrays of fixed-size POD records
// (runtime/device/abi.hpp), sized from the plan, with block ids made dense, in-place aliasing
// resolved to canonical buffers, the connections each rank uses numbered, the steps that other
// blocks wait for marked, and the FIFO depth the plan was verified for.

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/device/abi.hpp"
#include "runtime/executor.hpp"

namespace tutti::device {

struct ConnectionKey {
  int peer = -1;
  int channel = 0;  // plan channel
  bool operator==(const ConnectionKey&) const = default;
};

struct DevicePlan {
  std::vector<DevBlock> blocks;
  std::vector<DevStep> steps;
  std::vector<DevRef> srcs;
  std::vector<DevDep> deps;
  std::vector<DevScalar> scalars;  // kernels' scalars (DevStep::first_scalar)
  std::vector<element::ElementCode> code;  // element-wise kernels' programs (DevStep::first_code)
  std::vector<ConnectionKey> sends, recvs;  // indexed by DevStep::send_conn / recv_conn
  int64_t max_message_chunks = 1;  // most chunks one step moves, over every rank (rounds are sized by it)
  // One pass (abi.hpp): the plan has state buffers. Its largest message in buffers of their own unit:
  // most chunks one step moves there, and the largest unit (elements per chunk).
  bool one_pass = false;
  int nstates = 0;
  bool float_kernels = false;  // a kernel of the fused operations (float32 only) runs
  int32_t scalar_slots = 0;  // the call must pass this many per-call scalars (the highest slot a kernel reads + 1)
  int64_t half_unit = 0;  // a kernel writes 16-bit values into a buffer of this unit: the call's chunks must be twice it
  std::vector<int64_t> row_units;
  // Operands whose length a kernel's constant scalars fix (a GEMM's blocks), checked per call: the
  // operand's chunks hold `want` elements at the call's count.
  struct OperandLength {
    std::string kernel;
    int operand;        // inputs first, then outputs
    int64_t unit;       // its buffer's unit (0: the call's chunks)
    int64_t chunks;
    int64_t want;
  };
  std::vector<OperandLength> lengths;  // kernels work on rows of these lengths: the call's chunks must be multiples of each
  int64_t max_unit_message_chunks = 0, max_unit = 0;
  int64_t scratch_chunks = 0;
  int max_blocks = 1;  // most blocks of any rank (instances are chosen alike on every rank from it)
  int channels = 1;
};

// Throws InvalidArgument for a plan whose structure an interpreter cannot run (a dependency on a
// block that does not exist, more steps than a 32-bit index, more state buffers than a launch
// carries, a kernel without a device form or given operands its device form does not take).
DevicePlan flatten(const PreparedPlan& plan, int rank);

}  // namespace tutti::device
