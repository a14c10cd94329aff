#pragma once
// Bootstrap: after rendezvous, every pair of ranks holds one TCP connection (the mesh). It carries
// small tagged control messages (allgather, barrier, split), hands over the sockets of the TCP
// transport, and doubles as the failure detector: a peer whose process dies closes its sockets,
// and a service thread that reads every mesh socket turns that EOF into a RemoteError that names
// the peer on this rank, waking every waiter. An orderly shutdown sends "goodbye" first, so the EOF
// that follows is not a failure.

#include <array>
#include <atomic>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "runtime/comm_state.hpp"
#include "runtime/socket.hpp"
#include "runtime/unique_id.hpp"

namespace tutti {

// What each rank tells the others about itself.
struct PeerInfo {
  int rank = -1;
  uint64_t host_hash = 0;    // equal on ranks that can share memory (same boot, same mount namespace)
  std::string hostname;
  int32_t pid = 0;
  SocketAddress listen;      // bootstrap + TCP transport listener
  std::string control_shm;   // name of this rank's control segment (doorbell)
  uint64_t probe_addr = 0;   // address of a known word, to test single-copy reads at setup

  std::vector<unsigned char> encode() const;
  static PeerInfo decode(const std::vector<unsigned char>& bytes);
};

// What a bootstrap collective is for. Part of its tag, beside the sequence number every rank draws
// in the same order: ranks that run different ones at the same point (a split on one rank, a
// channel setup for a collective on another) fail naming both, instead of one reading the other's
// message as its own (a split that "succeeded" on a channel setup's bytes).
enum class BootstrapOp : uint8_t { kGeneric = 0, kBarrier, kChannelSetup, kSplit, kShrink, kDeviceSetup, kCallCheck };
const char* to_string(BootstrapOp op);

// This machine's identity for choosing shared memory: boot id, mount and IPC namespaces.
uint64_t local_host_hash();

class Bootstrap {
 public:
  // Opens the listener and starts the service thread; establish() then joins the communicator.
  // `socket_ifname`: where it listens (CommOptions::socket_ifname).
  Bootstrap(std::shared_ptr<CommState> state, uint64_t secret, double timeout_s, const std::string& socket_ifname);
  ~Bootstrap();
  Bootstrap(const Bootstrap&) = delete;
  Bootstrap& operator=(const Bootstrap&) = delete;

  SocketAddress listen_address() const;
  // Rendezvous through the root of id, then connect the mesh. self.listen is filled in here.
  void establish(const UniqueId& id, uint64_t generation, PeerInfo self, double init_timeout_s);

  int rank() const { return state_->rank(); }
  int nranks() const { return state_->nranks(); }
  const PeerInfo& peer(int r) const { return peers_.at(r); }

  // `despite_failure`: go on although the communicator has recorded a failure (another rank died),
  // for the survivors of a shrink after a failure; an abort still stops them.
  void send(int peer, uint64_t tag, const std::vector<unsigned char>& data, bool despite_failure = false);
  std::vector<unsigned char> recv(int peer, uint64_t tag, bool despite_failure = false);
  std::vector<std::vector<unsigned char>> allgather(const std::vector<unsigned char>& mine,
                                                   BootstrapOp op = BootstrapOp::kGeneric);
  void barrier();
  // A fresh tag for a bootstrap-level collective (all ranks call in the same order): the sequence
  // number, then the op; the low 8 bits stay free for messages within one collective.
  uint64_t next_tag(BootstrapOp op = BootstrapOp::kGeneric) { return ++op_seq_ << 16 | uint64_t{uint8_t(op)} << 8; }

  // TCP transport sockets: the lower rank connects, the higher one accepts (via the service thread).
  Fd connect_tcp(int peer, uint32_t channel, uint32_t index);
  Fd accept_tcp(int peer, uint32_t channel, uint32_t index);

  // Tells every peer that this rank failed or aborted, best effort and without blocking.
  void notify_failure(const std::string& message);
  // Orderly end: goodbye to every peer, then close.
  void shutdown();
  bool peer_departed(int peer) const;
  // Pings every connected peer through its service thread and returns those that did not answer
  // within wait_s (a stopped process answers nothing; a busy one answers at once).
  // Peers already known to be gone (EOF or goodbye) are not asked; `gone`, when given, gets them.
  std::vector<int> silent_peers(double wait_s, std::vector<int>* gone = nullptr);
  // Asks every connected peer, the same way, which collective call it is in (CommState::activity);
  // nothing for a peer that is gone or does not answer within wait_s.
  std::vector<std::optional<CommState::Activity>> activities(double wait_s);
  // The same as a sentence for an error message.
  std::string liveness(double wait_s);
  // Cuts the mesh connection to `peer` without a goodbye, as a crash would (TUTTI_FAULT=close).
  void sever(int peer);

 private:
  struct Peer {
    Fd fd;
    std::mutex send_mutex;
    std::vector<unsigned char> buf;
    bool departed = false;
    bool eof = false;
    uint64_t pong = 0;  // the latest liveness check answered
    CommState::Activity activity;  // what the answer to it said
  };
  // Pings every connected peer and waits up to wait_s for the answers: the ping's nonce; peers
  // asked, gone and silent.
  struct PingRound {
    uint64_t nonce = 0;
    std::vector<int> asked, gone, silent;
  };
  PingRound ping_all(double wait_s);
  struct Pending {
    Fd fd;
    std::string addr;
    std::vector<unsigned char> buf;
    double since;
    std::array<unsigned char, 16> challenge;  // sent at accept (runtime/auth.hpp)
  };
  // The service thread: polls the listener, the mesh and the connections still sending a hello.
  void serve();
  void accept_pending(std::list<Pending>& pending, double& listen_paused_until);
  void read_mesh(int peer);
  void mesh_closed(int peer);
  void read_hello(Pending& p);
  void expire_pending(std::list<Pending>& pending);
  void handle_frame(int peer, uint32_t type, uint64_t tag, std::vector<unsigned char> payload);
  void handle_pending(Pending& p);
  void send_frame(int peer, uint32_t type, uint64_t tag, const std::vector<unsigned char>& payload, Deadline d);
  void wake_service();
  std::string describe(int peer) const;

  std::shared_ptr<CommState> state_;
  uint64_t secret_;
  double timeout_s_;
  Fd listener_;
  Fd wake_;
  std::vector<PeerInfo> peers_;
  std::vector<std::unique_ptr<Peer>> mesh_;
  // Guarded by state_->mutex(): inbox, TCP sockets handed over, mesh registration.
  std::map<std::pair<int, uint64_t>, std::deque<std::vector<unsigned char>>> inbox_;
  std::map<std::tuple<int, uint32_t, uint32_t>, Fd> tcp_inbox_;
  std::vector<int> registered_;  // peers whose mesh socket the service thread reads
  std::atomic<bool> stop_{false};
  uint64_t op_seq_ = 0;
  std::atomic<uint64_t> ping_seq_{0};
  std::thread thread_;
};

}  // namespace tutti
