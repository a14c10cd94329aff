#pragma once
// Rendezvous: every rank connects to the root named by the unique id, presents the secret and its
// peer info, and receives everyone's info once all nranks have arrived.
//
// The root is a thread of whichever process made the unique id: tutti-run (for the ranks it
// launches), rank 0 (for a host:port NCCL_COMM_ID), or the caller of create_unique_id() (like
// ncclGetUniqueId). A persistent root serves successive communicators distinguished by a
// generation number (the k-th communicator a process creates from its environment).
//
// Failure handling: a connection with the wrong secret or a malformed message is refused and
// logged, and the rendezvous goes on for the others; if not all ranks arrive within the timeout,
// the ranks that did get an error naming the missing ones.

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "runtime/socket.hpp"
#include "runtime/unique_id.hpp"

namespace tutti {

class RendezvousRoot {
 public:
  // Listens on addr (port 0: any free port). persistent=false: exits after one rendezvous.
  RendezvousRoot(const SocketAddress& addr, uint64_t secret, bool persistent);
  ~RendezvousRoot();
  RendezvousRoot(const RendezvousRoot&) = delete;
  RendezvousRoot& operator=(const RendezvousRoot&) = delete;

  const UniqueId& unique_id() const { return id_; }
  bool finished() const { return finished_.load(); }

 private:
  void run();
  Fd listener_;
  Fd wake_;
  UniqueId id_;
  uint64_t secret_;
  bool persistent_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> finished_{false};
  std::thread thread_;
};

// Makes a unique id whose root runs in this process until its rendezvous is done (or times out),
// listening where `socket_ifname` says (CommOptions::socket_ifname).
UniqueId create_unique_id(const std::string& socket_ifname);

// For a host:port comm id: rank 0 starts a persistent root bound there (once per process).
void ensure_persistent_root(const UniqueId& id);

// The rank side. Returns every rank's info, indexed by rank. Throws Timeout naming missing ranks,
// InvalidArgument for inconsistent ranks/sizes, Aborted if *abort becomes true.
std::vector<std::vector<unsigned char>> rendezvous(const UniqueId& id, int rank, int nranks, uint64_t generation,
                                                   const std::vector<unsigned char>& info, double timeout_s,
                                                   const std::atomic<bool>* abort);

}  // namespace tutti
