#pragma once
// TCP sockets: RAII file descriptors, addresses, interface selection (NCCL_SOCKET_IFNAME syntax),
// and deadline-bounded blocking helpers for the small control messages of bootstrap.

#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/clock.hpp"

namespace tutti {

// An IPv4 or IPv6 address with port.
struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;

  static SocketAddress parse(const std::string& host_port);  // "host:port", "[v6]:port"; throws InvalidArgument
  std::string to_string() const;
  uint16_t port() const;
  void set_port(uint16_t port);
  const sockaddr* sa() const { return reinterpret_cast<const sockaddr*>(&storage); }
};

// An owned file descriptor; closes on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// Listening socket bound to addr (port 0 picks one); non-blocking accept.
Fd listen_on(const SocketAddress& addr, int backlog = 1024);
SocketAddress local_address(int fd);
SocketAddress peer_address(int fd);
void set_nonblocking(int fd, bool on = true);
void set_nodelay(int fd);

// Connects with retries and exponential backoff (10 ms .. 1 s) until the deadline, for peers that
// have not started listening yet. Checks *abort between attempts. Throws Timeout naming `what`.
Fd connect_with_retry(const SocketAddress& addr, Deadline deadline, const std::atomic<bool>* abort, const std::string& what);

// Blocking exact transfers on a (possibly non-blocking) socket, bounded by the deadline. A closed
// connection mid-transfer throws RemoteError ("truncated"). `what` names the peer in messages.
void send_exact(int fd, const void* data, size_t n, Deadline deadline, const std::string& what);
void recv_exact(int fd, void* data, size_t n, Deadline deadline, const std::string& what);

// The address this host advertises to peers, chosen by `ifname_spec` (CommOptions::socket_ifname:
// TUTTI_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, NCCL syntax) or, when it is empty, the first interface
// that is up and not loopback/docker, then loopback. Port is 0.
SocketAddress choose_interface_address(const std::string& ifname_spec);
// For tests: match one interface name against an NCCL_SOCKET_IFNAME specification.
bool interface_matches(const std::string& spec, const std::string& ifname);

}  // namespace tutti
