#include "runtime/transport/transport.hpp"

#include "runtime/comm_options.hpp"
#include "runtime/transport/shm.hpp"
#include "runtime/transport/tcp.hpp"

namespace tutti {

const char* to_string(WaitSource w) {
  switch (w) {
    case WaitSource::kDoorbell: return "doorbell";
    case WaitSource::kFd: return "fd";
    case WaitSource::kDeviceFlag: return "device flag";
  }
  return "?";
}

const char* to_string(MemoryRegistration r) {
  switch (r) {
    case MemoryRegistration::kNone: return "none";
    case MemoryRegistration::kSharedSegment: return "shared segment";
    case MemoryRegistration::kDevicePointer: return "device pointer";
    case MemoryRegistration::kCudaIpc: return "CUDA IPC handle";
    case MemoryRegistration::kHostStaging: return "host staging";
  }
  return "?";
}

std::vector<std::unique_ptr<Transport>> make_host_transports(const CommOptions& options) {
  std::vector<std::unique_ptr<Transport>> out;
  if (options.transport != TransportKind::kTcp) out.push_back(make_shm_transport(options));
  if (options.transport != TransportKind::kShm) out.push_back(make_tcp_transport(options));
  return out;
}

const std::vector<TransportInfo>& device_transports() {
  static const std::vector<TransportInfo> table = {
      {"cuda-p2p", WaitSource::kDeviceFlag, MemoryRegistration::kDevicePointer,
       "device pointers of each rank's inboxes (ranks of one process)"},
      {"cuda-ipc", WaitSource::kDeviceFlag, MemoryRegistration::kCudaIpc,
       "CUDA IPC handles of each rank's inboxes (processes of one host)"},
      {"host-staged", WaitSource::kDoorbell, MemoryRegistration::kHostStaging,
       "nothing of its own: device buffers are copied to host memory and carried by the host transports"},
  };
  return table;
}

}  // namespace tutti
