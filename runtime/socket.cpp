#include "runtime/socket.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "core/env.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace tutti {

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

SocketAddress SocketAddress::parse(const std::string& host_port) {
  std::string host, port;
  if (!host_port.empty() && host_port[0] == '[') {
    size_t close = host_port.find(']');
    TUTTI_CHECK(close != std::string::npos && close + 1 < host_port.size() && host_port[close + 1] == ':',
                InvalidArgument, "address '{}' is not [ipv6]:port", host_port);
    host = host_port.substr(1, close - 1);
    port = host_port.substr(close + 2);
  } else {
    size_t colon = host_port.rfind(':');
    TUTTI_CHECK(colon != std::string::npos && colon > 0, InvalidArgument, "address '{}' is not host:port", host_port);
    host = host_port.substr(0, colon);
    port = host_port.substr(colon + 1);
  }
  char* end = nullptr;
  long p = std::strtol(port.c_str(), &end, 10);
  TUTTI_CHECK(!port.empty() && *end == 0 && p >= 0 && p <= 65535, InvalidArgument, "address '{}': bad port '{}'",
              host_port, port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  TUTTI_CHECK(rc == 0 && res, InvalidArgument, "address '{}': cannot resolve host '{}': {}", host_port, host,
              gai_strerror(rc));
  SocketAddress a;
  std::memcpy(&a.storage, res->ai_addr, res->ai_addrlen);
  a.length = res->ai_addrlen;
  freeaddrinfo(res);
  a.set_port(static_cast<uint16_t>(p));
  return a;
}

std::string SocketAddress::to_string() const {
  char buf[INET6_ADDRSTRLEN] = "?";
  if (storage.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr, buf, sizeof(buf));
    return fmt::format("{}:{}", buf, port());
  }
  if (storage.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr, buf, sizeof(buf));
    return fmt::format("[{}]:{}", buf, port());
  }
  return "<no address>";
}

uint16_t SocketAddress::port() const {
  if (storage.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&storage)->sin_port);
  if (storage.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_port);
  return 0;
}

void SocketAddress::set_port(uint16_t port) {
  if (storage.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&storage)->sin_port = htons(port);
  if (storage.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&storage)->sin6_port = htons(port);
}

void set_nonblocking(int fd, bool on) {
  int flags = TUTTI_SYSCALL(fcntl(fd, F_GETFL), "fcntl(F_GETFL)");
  flags = on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK);
  TUTTI_SYSCALL(fcntl(fd, F_SETFL, flags), "fcntl(F_SETFL)");
}

void set_nodelay(int fd) {
  int one = 1;
  TUTTI_SYSCALL(setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)), "setsockopt(TCP_NODELAY)");
}

Fd listen_on(const SocketAddress& addr, int backlog) {
  Fd fd(TUTTI_SYSCALL(::socket(addr.storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0), "socket()"));
  int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  TUTTI_SYSCALL(::bind(fd.get(), addr.sa(), addr.length), "bind({})", addr.to_string());
  TUTTI_SYSCALL(::listen(fd.get(), backlog), "listen({})", addr.to_string());
  set_nonblocking(fd.get());
  return fd;
}

SocketAddress local_address(int fd) {
  SocketAddress a;
  a.length = sizeof(a.storage);
  TUTTI_SYSCALL(getsockname(fd, reinterpret_cast<sockaddr*>(&a.storage), &a.length), "getsockname()");
  return a;
}

SocketAddress peer_address(int fd) {
  SocketAddress a;
  a.length = sizeof(a.storage);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&a.storage), &a.length) != 0) a.length = 0;
  return a;
}

Fd connect_with_retry(const SocketAddress& addr, Deadline deadline, const std::atomic<bool>* abort,
                      const std::string& what) {
  int backoff_ms = 10;
  int last_errno = 0;
  while (true) {
    TUTTI_CHECK(!(abort && abort->load()), Aborted, "aborted while connecting to {} at {}", what, addr.to_string());
    Fd fd(TUTTI_SYSCALL(::socket(addr.storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0), "socket()"));
    if (::connect(fd.get(), addr.sa(), addr.length) == 0) {
      set_nodelay(fd.get());
      return fd;
    }
    last_errno = errno;
    if (last_errno != ECONNREFUSED && last_errno != ETIMEDOUT && last_errno != ENETUNREACH &&
        last_errno != EHOSTUNREACH && last_errno != EAGAIN && last_errno != EINTR)
      throw SystemError(fmt::format("connect to {} at {}", what, addr.to_string()), last_errno);
    if (deadline.expired())
      throw Timeout(fmt::format("could not connect to {} at {}: {} (gave up at the deadline)", what,
                                addr.to_string(), std::strerror(last_errno)));
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(backoff_ms, deadline.ms_left(backoff_ms))));
    backoff_ms = std::min(backoff_ms * 2, 1000);
  }
}

namespace {
void wait_fd(int fd, short events, Deadline deadline, const std::string& what, const char* op) {
  pollfd p{fd, events, 0};
  while (true) {
    int rc = ::poll(&p, 1, deadline.ms_left(1000));
    if (rc > 0) return;
    if (rc < 0 && errno != EINTR) throw_system_error(fmt::format("poll while {} {}", op, what));
    if (deadline.expired()) throw Timeout(fmt::format("timed out {} {}", op, what));
  }
}
}  // namespace

void send_exact(int fd, const void* data, size_t n, Deadline deadline, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      wait_fd(fd, POLLOUT, deadline, what, "sending to");
    } else {
      throw RemoteError(fmt::format("connection to {} lost while sending: {}", what, std::strerror(errno)));
    }
  }
}

void recv_exact(int fd, void* data, size_t n, Deadline deadline, const std::string& what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
    } else if (k == 0) {
      throw RemoteError(fmt::format("{} closed the connection (truncated message, {} bytes missing)", what, n));
    } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      wait_fd(fd, POLLIN, deadline, what, "receiving from");
    } else {
      throw RemoteError(fmt::format("connection to {} lost while receiving: {}", what, std::strerror(errno)));
    }
  }
}

bool interface_matches(const std::string& spec_in, const std::string& ifname) {
  std::string spec = spec_in;
  bool exclude = !spec.empty() && spec[0] == '^';
  if (exclude) spec.erase(0, 1);
  bool exact = !spec.empty() && spec[0] == '=';
  if (exact) spec.erase(0, 1);
  bool hit = false;
  size_t start = 0;
  while (start <= spec.size()) {
    size_t end = spec.find(',', start);
    if (end == std::string::npos) end = spec.size();
    std::string item = spec.substr(start, end - start);
    if (!item.empty() && (exact ? ifname == item : ifname.compare(0, item.size(), item) == 0)) hit = true;
    start = end + 1;
  }
  return exclude ? !hit : hit;
}

SocketAddress choose_interface_address(const std::string& spec) {
  ifaddrs* list = nullptr;
  TUTTI_SYSCALL(getifaddrs(&list), "getifaddrs()");
  SocketAddress best, loopback;
  bool found = false, have_lo = false;
  for (ifaddrs* i = list; i && !found; i = i->ifa_next) {
    if (!i->ifa_addr || !(i->ifa_flags & IFF_UP)) continue;
    int family = i->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    if (family == AF_INET6 && IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr)) continue;
    std::string name = i->ifa_name;
    SocketAddress a;
    a.length = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    std::memcpy(&a.storage, i->ifa_addr, a.length);
    if (!spec.empty()) {
      if (interface_matches(spec, name)) best = a, found = true;
      continue;
    }
    bool is_lo = (i->ifa_flags & IFF_LOOPBACK) != 0;
    if (is_lo) {
      if (!have_lo || family == AF_INET) loopback = a, have_lo = true;
    } else if (name.compare(0, 6, "docker") != 0 && family == AF_INET) {
      best = a, found = true;
    }
  }
  freeifaddrs(list);
  if (!found) {
    TUTTI_CHECK(spec.empty(), InvalidArgument, "TUTTI_SOCKET_IFNAME/NCCL_SOCKET_IFNAME='{}' matches no interface that is up",
                spec);
    if (!have_lo) throw SystemError("no usable network interface", ENODEV);
    best = loopback;
  }
  best.set_port(0);
  return best;
}

}  // namespace tutti
