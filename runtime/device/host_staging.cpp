#include "runtime/device/host_staging.hpp"

#include "core/datatype.hpp"
#include "core/error.hpp"
#include "runtime/instruction_semantics.hpp"

namespace tutti::device {

HostStagingExecutor::HostStagingExecutor(Communicator& comm, DeviceExecutor& device, CpuExecutor& host)
    : comm_(comm), device_(device), host_(host) {}

void HostStagingExecutor::refuse_capture(void* stream, const char* what) const {
  TUTTI_CHECK(!device_.backend().capturing(stream), InvalidUsage,
              "rank {}: {} on device buffers goes through host memory on this communicator (some ranks share no GPU "
              "memory, or TUTTI_DEVICE_STAGING=1), which waits for the stream and cannot be captured in a CUDA graph",
              comm_.rank(), what);
}

void HostStagingExecutor::run(const PreparedPlan& pp, const ExecArgs& args) {
  refuse_capture(args.stream, "a collective");
  check_call(pp, comm_.size(), args.count);
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
  // Everything enqueued before this call (the dispatcher's premulsum scaling and input copies
  // among it) must have happened before its buffers are read.
  b.synchronize(args.stream);
  // A buffer the call does not use may be null (a broadcast's non-root input): nothing to stage.
  if (out_within_in) {
    in_.resize(in_bytes);
    b.copy(in_.data(), in, in_bytes, args.stream);
  } else {
    out_.resize(out_bytes);
    if (out) b.copy(out_.data(), out, out_bytes, args.stream);
    if (!in_within_out) {
      in_.resize(in_bytes);
      if (in) b.copy(in_.data(), in, in_bytes, args.stream);
    }
  }
  b.synchronize(args.stream);
  ExecArgs host = args;
  host.stream = nullptr;
  if (out_within_in) {
    host.input = in_.data();
    host.output = in_.data() + (out - in);
  } else {
    host.output = out_.data();
    host.input = in_within_out ? out_.data() + (in - out) : in_.data();
  }
  host_.run(pp, host);
  // Back to the device: the buffer the plan writes (the whole staged buffer when they are one).
  if (out_within_in) b.copy(const_cast<unsigned char*>(in), in_.data(), in_bytes, args.stream);
  else if (out) b.copy(out, out_.data(), out_bytes, args.stream);
  b.synchronize(args.stream);
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
  Backend& b = device_.backend();
  b.synchronize(stream);
  p2p_.resize(ops.size());
  std::vector<P2pTransfer> host = ops;
  for (size_t i = 0; i < ops.size(); ++i) {
    p2p_[i].resize(ops[i].bytes);
    host[i].buffer = p2p_[i].data();
    if (ops[i].send && ops[i].bytes) b.copy(p2p_[i].data(), ops[i].buffer, ops[i].bytes, stream);
  }
  b.synchronize(stream);
  run_host_p2p(comm_, host);
  for (size_t i = 0; i < ops.size(); ++i)
    if (!ops[i].send && ops[i].bytes) b.copy(ops[i].buffer, p2p_[i].data(), ops[i].bytes, stream);
  b.synchronize(stream);
}

}  // namespace tutti::device
