#pragma once
// The transport registry. A transport is a way to carry a connection between two ranks; each says
// whether it can connect a pair, what it exchanges when a channel is set up, how its memory is
// registered, and what a rank waiting on it sleeps on. The communicator asks the host transports in
// order of preference (shared memory, then TCP) and the first that can connect a pair carries it;
// the device executor does the same among the device transports (runtime/device). Nothing decides
// by comparing transport names.
//
// Channel setup is collective over the communicator, in three phases for a batch of new channels
// (each phase called per channel, channels in increasing order):
//   publish()  each transport writes what its peers need into this rank's part of one bootstrap
//              allgather (every rank writes a part for every registered transport, in registry
//              order, so readers stay aligned);
//   connect()  each transport reads its part from every peer it serves and makes their connections;
//   finish()   after a bootstrap barrier: every peer has mapped what it needed (names can go).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/bootstrap.hpp"
#include "runtime/shm_segment.hpp"
#include "runtime/wire.hpp"

namespace tutti {

class Connection;
struct CommOptions;

// What a rank waiting for a connection sleeps on.
enum class WaitSource {
  kDoorbell,    // a futex word in shared memory the peer rings (runtime/doorbell.hpp)
  kFd,          // file descriptors to poll() (Connection::poll_fds)
  kDeviceFlag,  // a flag in device memory a kernel polls (runtime/device/fifo.hpp)
};
const char* to_string(WaitSource w);

// How a transport makes memory reachable by the peer.
enum class MemoryRegistration {
  kNone,           // bytes are copied through the kernel (sockets)
  kSharedSegment,  // named POSIX shared memory, mapped by the peer
  kDevicePointer,  // device memory of one process: peers use the pointer (peer access between GPUs)
  kCudaIpc,        // device memory exported with a CUDA IPC handle, opened by the peer's process
  kHostStaging,    // device memory copied to host memory and carried by a host transport
};
const char* to_string(MemoryRegistration r);

struct TransportInfo {
  const char* name;      // "shm", "tcp", "cuda-p2p", "cuda-ipc", "host-staged"
  WaitSource wait;
  MemoryRegistration registration;
  const char* exchanges;  // what setup exchanges through the bootstrap, for logs and docs
};

// What a transport sees of the communicator while it sets up a channel.
struct ChannelSetup {
  int rank = 0, nranks = 0, channel = 0;
  Bootstrap& bootstrap;
  const CommOptions& options;
  // Peers' control segments (their doorbells) by rank, mapped for the ranks on this host.
  const std::vector<ShmSegment>& peer_controls;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const TransportInfo& info() const = 0;
  // Whether this transport can connect `self` to `peer` (same host, same process, ...).
  virtual bool can_connect(const PeerInfo& self, const PeerInfo& peer) const = 0;
  // `peers`: the ranks this transport connects this rank to on the channel (maybe none; publish
  // and connect are still called, so the allgather stays aligned).
  virtual void publish(const ChannelSetup& setup, const std::vector<int>& peers, wire::Writer& out) = 0;
  // published[p]: peer p's part of the allgather, positioned at this transport's section. Must
  // read the whole section of every peer, served or not. conns[p] is filled for every p in peers.
  virtual void connect(const ChannelSetup& setup, const std::vector<int>& peers, std::vector<wire::Reader>& published,
                       std::vector<std::unique_ptr<Connection>>& conns) = 0;
  virtual void finish(const ChannelSetup&) {}
};

// The host transports of a communicator, in order of preference; `options.transport` (TUTTI_TRANSPORT)
// keeps only the one it names.
std::vector<std::unique_ptr<Transport>> make_host_transports(const CommOptions& options);

// The device transports, in order of preference (runtime/device/device_executor.cpp chooses among
// them per peer): the same table drives the choice and what logs and docs say.
const std::vector<TransportInfo>& device_transports();

}  // namespace tutti
