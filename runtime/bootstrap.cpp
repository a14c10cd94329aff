#include "runtime/bootstrap.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <list>

#include "core/log.hpp"
#include "runtime/auth.hpp"
#include "runtime/rendezvous.hpp"
#include "runtime/wire.hpp"

namespace tutti {
namespace {

constexpr std::string_view kMeshPurpose = "tutti mesh hello";
constexpr std::string_view kTcpPurpose = "tutti tcp hello";

// Connects as `rank` to a listener: answers its challenge with a hello of `type` whose MAC proves
// the secret over the challenge and `fields`.
void send_hello(int fd, uint64_t secret, wire::FrameType type, const std::vector<unsigned char>& fields,
                Deadline deadline, const std::string& what) {
  const auth::Nonce challenge = auth::recv_challenge(fd, deadline, what);
  const auth::Mac proof = auth::mac(secret, type == wire::FrameType::kMeshHello ? kMeshPurpose : kTcpPurpose, challenge,
                                    fields.data(), fields.size());
  std::vector<unsigned char> hello(proof.size() + fields.size());
  std::memcpy(hello.data(), proof.data(), proof.size());
  if (!fields.empty()) std::memcpy(hello.data() + proof.size(), fields.data(), fields.size());
  wire::FrameHeader h;
  h.type = static_cast<uint32_t>(type);
  h.length = hello.size();
  send_exact(fd, &h, sizeof(h), deadline, what);
  send_exact(fd, hello.data(), hello.size(), deadline, what);
}

// A connection accepted and not closed since (closed ones stay listed until the end of the round).
constexpr auto is_open = [](const auto& p) { return bool(p.fd); };

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

uint64_t mix(uint64_t h, const std::string& s) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::string ns_id(const char* path) {
  struct stat st {};
  if (stat(path, &st) != 0) return "";
  return std::to_string(st.st_ino);
}

}  // namespace

uint64_t local_host_hash() {
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  uint64_t h = 1469598103934665603ull;
  h = mix(h, host);
  h = mix(h, boot);
  h = mix(h, ns_id("/proc/self/ns/mnt"));
  h = mix(h, ns_id("/proc/self/ns/ipc"));
  return h;
}

std::vector<unsigned char> PeerInfo::encode() const {
  wire::Writer w;
  w.put<int32_t>(rank).put<uint64_t>(host_hash).put_string(hostname).put<int32_t>(pid);
  w.put_bytes(&listen.storage, listen.length).put_string(control_shm).put<uint64_t>(probe_addr);
  return std::move(w.bytes());
}

PeerInfo PeerInfo::decode(const std::vector<unsigned char>& bytes) {
  wire::Reader r(bytes, "peer info");
  PeerInfo p;
  p.rank = r.get<int32_t>();
  p.host_hash = r.get<uint64_t>();
  p.hostname = r.get_string();
  p.pid = r.get<int32_t>();
  auto addr = r.get_bytes();
  TUTTI_CHECK(addr.size() <= sizeof(p.listen.storage), RemoteError, "peer info: address too long");
  if (!addr.empty()) std::memcpy(&p.listen.storage, addr.data(), addr.size());
  p.listen.length = static_cast<socklen_t>(addr.size());
  p.control_shm = r.get_string();
  p.probe_addr = r.get<uint64_t>();
  return p;
}

Bootstrap::Bootstrap(std::shared_ptr<CommState> state, uint64_t secret, double timeout_s,
                     const std::string& socket_ifname)
    : state_(std::move(state)),
      secret_(secret),
      timeout_s_(timeout_s),
      listener_(listen_on(choose_interface_address(socket_ifname))),
      wake_(TUTTI_SYSCALL(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC), "eventfd()")) {
  for (int i = 0; i < state_->nranks(); ++i) mesh_.push_back(std::make_unique<Peer>());
  thread_ = std::thread([this] { serve(); });
}

Bootstrap::~Bootstrap() {
  stop_ = true;
  wake_service();
  if (thread_.joinable()) thread_.join();
}

SocketAddress Bootstrap::listen_address() const { return local_address(listener_.get()); }

std::string Bootstrap::describe(int peer) const {
  if (peer >= 0 && peer < static_cast<int>(peers_.size()))
    return fmt::format("rank {} ({} pid {})", peer, peers_[peer].hostname, peers_[peer].pid);
  return fmt::format("rank {}", peer);
}

void Bootstrap::wake_service() {
  uint64_t one = 1;
  [[maybe_unused]] ssize_t k = ::write(wake_.get(), &one, sizeof(one));
}

void Bootstrap::establish(const UniqueId& id, uint64_t generation, PeerInfo self, double init_timeout_s) {
  const int rank = state_->rank(), n = state_->nranks();
  self.listen = listen_address();
  auto table = rendezvous(id, rank, n, generation, self.encode(), init_timeout_s, state_->abort_flag());
  for (auto& bytes : table) peers_.push_back(PeerInfo::decode(bytes));
  for (int r = 0; r < n; ++r)
    TUTTI_CHECK(peers_[r].rank == r, RemoteError, "rank {}: rendezvous table entry {} claims rank {}", rank, r,
                peers_[r].rank);
  // Mesh: connect to higher ranks; lower ranks connect to us (handled by the service thread).
  Deadline deadline = Deadline::after(init_timeout_s);
  for (int peer = rank + 1; peer < n; ++peer) {
    Fd fd = connect_with_retry(peers_[peer].listen, deadline, state_->abort_flag(), describe(peer));
    wire::Writer w;
    w.put<int32_t>(rank);
    send_hello(fd.get(), secret_, wire::FrameType::kMeshHello, w.bytes(), deadline, describe(peer));
    set_nonblocking(fd.get());
    std::lock_guard lock(state_->mutex());
    mesh_[peer]->fd = std::move(fd);
    registered_.push_back(peer);
  }
  wake_service();
  std::unique_lock lock(state_->mutex());
  while (true) {
    std::string missing;
    for (int peer = 0; peer < rank; ++peer)
      if (!mesh_[peer]->fd) missing += (missing.empty() ? "" : ", ") + std::to_string(peer);
    if (missing.empty()) break;
    lock.unlock();
    state_->check("connecting the bootstrap mesh");
    lock.lock();
    if (deadline.expired())
      throw Timeout(fmt::format("rank {}: ranks {} did not connect within {} s", rank, missing, init_timeout_s));
    state_->cv().wait_for(lock, std::chrono::milliseconds(50));
  }
}

void Bootstrap::send_frame(int peer, uint32_t type, uint64_t tag, const std::vector<unsigned char>& payload,
                           Deadline d) {
  Peer& p = *mesh_.at(peer);
  wire::FrameHeader h;
  h.type = type;
  h.tag = tag;
  h.length = payload.size();
  std::lock_guard lock(p.send_mutex);
  TUTTI_CHECK(p.fd, RemoteError, "rank {}: no bootstrap connection to {}", rank(), describe(peer));
  send_exact(p.fd.get(), &h, sizeof(h), d, describe(peer));
  if (!payload.empty()) send_exact(p.fd.get(), payload.data(), payload.size(), d, describe(peer));
}

void Bootstrap::send(int peer, uint64_t tag, const std::vector<unsigned char>& data, bool despite_failure) {
  TUTTI_CHECK(peer >= 0 && peer < nranks() && peer != rank(), InvalidArgument, "rank {}: bootstrap send to bad peer {}",
              rank(), peer);
  if (!despite_failure || state_->aborted()) state_->check(fmt::format("sending a bootstrap message to rank {}", peer));
  send_frame(peer, static_cast<uint32_t>(wire::FrameType::kData), tag, data, Deadline::after(timeout_s_));
}

std::vector<unsigned char> Bootstrap::recv(int peer, uint64_t tag, bool despite_failure) {
  TUTTI_CHECK(peer >= 0 && peer < nranks() && peer != rank(), InvalidArgument, "rank {}: bootstrap recv from bad peer {}",
              rank(), peer);
  Deadline deadline = Deadline::after(timeout_s_);
  DivergenceProbe probe(*state_);
  std::unique_lock lock(state_->mutex());
  const uint64_t seq = tag >> 16;
  while (true) {
    auto it = inbox_.find({peer, tag});
    if (it != inbox_.end() && !it->second.empty()) {
      auto msg = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) inbox_.erase(it);
      return msg;
    }
    // The peer's message of the same collective step, for another purpose: it runs another call.
    for (auto other = inbox_.lower_bound({peer, seq << 16}); other != inbox_.end() && other->first.first == peer &&
                                                              other->first.second >> 16 == seq;
         ++other)
      if (other->first.second != tag && !other->second.empty()) {
        const std::string message = fmt::format(
            "rank {}: {} runs a {} where this rank runs a {} (bootstrap step {}): every rank must make the same calls "
            "(collectives, split, shrink) in the same order",
            rank(), describe(peer), to_string(static_cast<BootstrapOp>(other->first.second >> 8 & 0xff)),
            to_string(static_cast<BootstrapOp>(tag >> 8 & 0xff)), seq);
        // The bootstrap's steps are out of step for good: the communicator fails, and its peers hear it.
        lock.unlock();
        state_->fail(ErrorKind::kInvalidUsage, message);
        throw InvalidUsage(message);
      }
    if (mesh_[peer]->departed || mesh_[peer]->eof)
      throw RemoteError(fmt::format("rank {}: {} left the communicator while this rank waited for its message",
                                    rank(), describe(peer)));
    lock.unlock();
    if (!despite_failure || state_->aborted())
      state_->check(fmt::format("waiting for a bootstrap message from rank {}", peer));
    if (!despite_failure) probe.tick(false);
    lock.lock();
    if (deadline.expired())
      throw Timeout(fmt::format("rank {}: timed out after {} s waiting for a bootstrap message from {}", rank(),
                                timeout_s_, describe(peer)));
    state_->cv().wait_for(lock, std::chrono::milliseconds(100));
  }
}

const char* to_string(BootstrapOp op) {
  switch (op) {
    case BootstrapOp::kGeneric: return "bootstrap allgather";
    case BootstrapOp::kBarrier: return "barrier";
    case BootstrapOp::kChannelSetup: return "channel setup (a collective's first use of a channel)";
    case BootstrapOp::kSplit: return "split";
    case BootstrapOp::kShrink: return "shrink";
    case BootstrapOp::kDeviceSetup: return "device channel setup";
    case BootstrapOp::kCallCheck: return "TUTTI_CHECK comparison of a call";
  }
  return "bootstrap step";
}

std::vector<std::vector<unsigned char>> Bootstrap::allgather(const std::vector<unsigned char>& mine, BootstrapOp op) {
  uint64_t tag = next_tag(op);
  for (int peer = 0; peer < nranks(); ++peer)
    if (peer != rank()) send(peer, tag, mine);
  std::vector<std::vector<unsigned char>> all(nranks());
  all[rank()] = mine;
  for (int peer = 0; peer < nranks(); ++peer)
    if (peer != rank()) all[peer] = recv(peer, tag);
  return all;
}

void Bootstrap::barrier() { allgather({}, BootstrapOp::kBarrier); }

Fd Bootstrap::connect_tcp(int peer, uint32_t channel, uint32_t index) {
  Deadline deadline = Deadline::after(timeout_s_);
  Fd fd = connect_with_retry(peers_.at(peer).listen, deadline, state_->abort_flag(), describe(peer));
  wire::Writer w;
  w.put<int32_t>(rank()).put<uint32_t>(channel).put<uint32_t>(index);
  send_hello(fd.get(), secret_, wire::FrameType::kTcpHello, w.bytes(), deadline, describe(peer));
  return fd;
}

Fd Bootstrap::accept_tcp(int peer, uint32_t channel, uint32_t index) {
  Deadline deadline = Deadline::after(timeout_s_);
  std::unique_lock lock(state_->mutex());
  while (true) {
    auto it = tcp_inbox_.find({peer, channel, index});
    if (it != tcp_inbox_.end()) {
      Fd fd = std::move(it->second);
      tcp_inbox_.erase(it);
      return fd;
    }
    lock.unlock();
    state_->check(fmt::format("waiting for TCP connection {} of channel {} from rank {}", index, channel, peer));
    lock.lock();
    if (deadline.expired())
      throw Timeout(fmt::format("rank {}: {} did not open TCP connection {} of channel {} within {} s", rank(),
                                describe(peer), index, channel, timeout_s_));
    state_->cv().wait_for(lock, std::chrono::milliseconds(50));
  }
}

bool Bootstrap::peer_departed(int peer) const {
  std::lock_guard lock(state_->mutex());
  return mesh_.at(peer)->departed;
}

Bootstrap::PingRound Bootstrap::ping_all(double wait_s) {
  PingRound round;
  round.nonce = ping_seq_.fetch_add(1) + 1;
  for (int peer = 0; peer < nranks(); ++peer) {
    if (peer == rank()) continue;
    {
      std::lock_guard lock(state_->mutex());
      if (!mesh_[peer]->fd || mesh_[peer]->eof || mesh_[peer]->departed) {
        round.gone.push_back(peer);
        continue;
      }
    }
    try {
      send_frame(peer, static_cast<uint32_t>(wire::FrameType::kPing), round.nonce, {}, Deadline::after(0.2));
      round.asked.push_back(peer);
    } catch (const Error&) {
      round.silent.push_back(peer);
    }
  }
  Deadline deadline = Deadline::after(wait_s);
  std::unique_lock lock(state_->mutex());
  auto unanswered = [&] {
    std::vector<int> out;
    for (int peer : round.asked)
      if (mesh_[peer]->pong < round.nonce) out.push_back(peer);
    return out;
  };
  while (!unanswered().empty() && !deadline.expired()) state_->cv().wait_for(lock, std::chrono::milliseconds(10));
  for (int peer : unanswered()) round.silent.push_back(peer);
  std::sort(round.silent.begin(), round.silent.end());
  return round;
}

std::vector<int> Bootstrap::silent_peers(double wait_s, std::vector<int>* gone) {
  PingRound round = ping_all(wait_s);
  if (gone) gone->insert(gone->end(), round.gone.begin(), round.gone.end());
  return round.silent;
}

std::vector<std::optional<CommState::Activity>> Bootstrap::activities(double wait_s) {
  const PingRound round = ping_all(wait_s);
  std::vector<std::optional<CommState::Activity>> out(static_cast<size_t>(nranks()));
  std::lock_guard lock(state_->mutex());
  for (int peer : round.asked)
    if (mesh_[peer]->pong >= round.nonce) out[static_cast<size_t>(peer)] = mesh_[peer]->activity;
  return out;
}

std::string Bootstrap::liveness(double wait_s) {
  std::vector<int> gone;
  std::vector<int> silent = silent_peers(wait_s, &gone);
  auto names = [&](const std::vector<int>& peers) {
    std::string out;
    for (int peer : peers) out += fmt::format("{}{}", out.empty() ? "" : ", ", describe(peer));
    return out;
  };
  std::string out;
  if (!gone.empty()) out = fmt::format("{} left or closed its connection; ", names(gone));
  if (silent.empty())
    return out + fmt::format("every {}peer answered a liveness check within {} s{}", gone.empty() ? "" : "other ",
                             wait_s, gone.empty() ? " (none is stopped or dead)" : "");
  return out + fmt::format("no answer to a liveness check within {} s from {}: stopped (SIGSTOP), hung outside tutti, "
                           "or unreachable",
                           wait_s, names(silent));
}

void Bootstrap::sever(int peer) {
  std::lock_guard lock(state_->mutex());
  if (mesh_.at(peer)->fd) ::shutdown(mesh_[peer]->fd.get(), SHUT_RDWR);
}

void Bootstrap::notify_failure(const std::string& message) {
  wire::Writer w;
  w.put_string(message);
  for (int peer = 0; peer < nranks(); ++peer) {
    if (peer == rank() || !mesh_[peer]->fd) continue;
    try {
      send_frame(peer, static_cast<uint32_t>(wire::FrameType::kAbortNotice), 0, w.bytes(), Deadline::after(0.2));
    } catch (const Error&) {
    }
  }
}

void Bootstrap::shutdown() {
  for (int peer = 0; peer < nranks(); ++peer) {
    if (peer == rank() || !mesh_[peer]->fd) continue;
    try {
      send_frame(peer, static_cast<uint32_t>(wire::FrameType::kGoodbye), 0, {}, Deadline::after(1));
    } catch (const Error&) {
    }
  }
  stop_ = true;
  wake_service();
  if (thread_.joinable()) thread_.join();
  for (auto& p : mesh_) p->fd.reset();
}

void Bootstrap::handle_frame(int peer, uint32_t type, uint64_t tag, std::vector<unsigned char> payload) {
  switch (static_cast<wire::FrameType>(type)) {
    case wire::FrameType::kData: {
      std::lock_guard lock(state_->mutex());
      inbox_[{peer, tag}].push_back(std::move(payload));
      state_->cv().notify_all();
      return;
    }
    case wire::FrameType::kGoodbye: {
      {
        std::lock_guard lock(state_->mutex());
        mesh_[peer]->departed = true;
        state_->cv().notify_all();
      }
      state_->set_departed(peer);  // wakes data-plane waiters: the mailbox fails at once
      return;
    }
    case wire::FrameType::kAbortNotice: {
      std::string msg = "(unreadable)";
      try {
        msg = wire::Reader(payload, "abort notice").get_string();
      } catch (const Error&) {
      }
      state_->fail(ErrorKind::kRemote, fmt::format("{} failed: {}", describe(peer), msg), /*tell_peers=*/false);
      return;
    }
    case wire::FrameType::kPing:
      try {
        // The answer says which collective call this rank is in (activities()).
        const CommState::Activity a = state_->activity();
        wire::Writer w;
        w.put<uint64_t>(a.seq).put<uint64_t>(a.stamp);
        send_frame(peer, static_cast<uint32_t>(wire::FrameType::kPong), tag, w.bytes(), Deadline::after(0.2));
      } catch (const Error&) {
      }
      return;
    case wire::FrameType::kPong: {
      CommState::Activity a;
      try {
        wire::Reader r(payload, "liveness answer");
        a.seq = r.get<uint64_t>();
        a.stamp = r.get<uint64_t>();
      } catch (const Error&) {
        a = {};  // unreadable: no conclusion from it
      }
      std::lock_guard lock(state_->mutex());
      if (tag >= mesh_[peer]->pong) mesh_[peer]->activity = a;
      mesh_[peer]->pong = std::max(mesh_[peer]->pong, tag);
      state_->cv().notify_all();
      return;
    }
    default:
      state_->fail(ErrorKind::kRemote, fmt::format("malformed bootstrap frame (type {}) from {}", type, describe(peer)));
  }
}

void Bootstrap::handle_pending(Pending& p) {
  wire::FrameHeader h;
  std::memcpy(&h, p.buf.data(), sizeof(h));
  auth::Mac got{};
  TUTTI_CHECK(h.length >= got.size(), RemoteError, "hello of {} bytes is too short", h.length);
  std::memcpy(got.data(), p.buf.data() + sizeof(h), got.size());
  const unsigned char* fields = p.buf.data() + sizeof(h) + got.size();
  const size_t field_bytes = h.length - got.size();
  const bool mesh = h.type == static_cast<uint32_t>(wire::FrameType::kMeshHello);
  if (!auth::equal(got, auth::mac(secret_, mesh ? kMeshPurpose : kTcpPurpose, p.challenge, fields, field_bytes))) {
    TUTTI_WARN("rank {}: refused connection from {}: wrong secret (the hello's proof does not match)", rank(), p.addr);
    p.fd.reset();
    return;
  }
  wire::Reader r(fields, field_bytes, "bootstrap hello");
  int from = r.get<int32_t>();
  if (from < 0 || from >= nranks() || from == rank()) {
    TUTTI_WARN("rank {}: refused connection from {}: bad rank {}", rank(), p.addr, from);
    p.fd.reset();
    return;
  }
  std::lock_guard lock(state_->mutex());
  if (h.type == static_cast<uint32_t>(wire::FrameType::kMeshHello)) {
    if (from > rank() || mesh_[from]->fd) {
      TUTTI_WARN("rank {}: refused duplicate or misdirected mesh connection from rank {}", rank(), from);
      p.fd.reset();
      return;
    }
    mesh_[from]->fd = std::move(p.fd);
    registered_.push_back(from);
  } else {
    uint32_t channel = r.get<uint32_t>(), index = r.get<uint32_t>();
    set_nonblocking(p.fd.get(), false);
    tcp_inbox_[{from, channel, index}] = std::move(p.fd);
  }
  state_->cv().notify_all();
}

void Bootstrap::serve() {
  std::list<Pending> pending;
  double listen_paused_until = 0;
  while (!stop_) {
    std::vector<pollfd> fds{{listener_.get(), static_cast<short>(now_s() < listen_paused_until ? 0 : POLLIN), 0},
                            {wake_.get(), POLLIN, 0}};
    std::vector<int> peers;
    {
      std::lock_guard lock(state_->mutex());
      for (int peer : registered_)
        if (mesh_[peer]->fd && !mesh_[peer]->eof) {
          fds.push_back({mesh_[peer]->fd.get(), POLLIN, 0});
          peers.push_back(peer);
        }
    }
    std::vector<Pending*> order;
    for (auto& p : pending) {
      fds.push_back({p.fd.get(), POLLIN, 0});
      order.push_back(&p);
    }
    int rc = ::poll(fds.data(), fds.size(), 500);
    if (rc < 0 && errno != EINTR) break;
    if (fds[1].revents & POLLIN) {
      uint64_t v;
      [[maybe_unused]] ssize_t k = ::read(wake_.get(), &v, sizeof(v));
    }
    if (fds[0].revents & POLLIN) accept_pending(pending, listen_paused_until);
    for (size_t i = 0; i < peers.size(); ++i)
      if (fds[i + 2].revents & (POLLIN | POLLHUP | POLLERR)) read_mesh(peers[i]);
    for (size_t i = 0; i < order.size(); ++i) {
      Pending& p = *order[i];
      if (!p.fd) continue;  // closed above in this round
      if (!(fds[peers.size() + 2 + i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      read_hello(p);
    }
    expire_pending(pending);
    pending.remove_if([](const Pending& p) { return !p.fd; });
  }
}

void Bootstrap::accept_pending(std::list<Pending>& pending, double& listen_paused_until) {
  while (true) {
    int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      // At the descriptor limit the listener stays readable: make room by dropping the oldest
      // connection that has proven nothing, or stop polling it for a while rather than spin.
      // (Entries are only closed here, never erased: serve()'s `order` points at them; its remove_if
      // erases the closed ones.)
      if (errno == EMFILE || errno == ENFILE) {
        auto oldest = std::find_if(pending.begin(), pending.end(), is_open);
        if (oldest != pending.end()) {
          TUTTI_WARN("rank {}: descriptor limit reached; dropped the oldest unauthenticated connection (from {})",
                     rank(), oldest->addr);
          oldest->fd.reset();
        } else {
          listen_paused_until = now_s() + 0.1;
        }
      }
      break;
    }
    set_nodelay(fd);
    Pending p{Fd(fd), peer_address(fd).to_string(), {}, now_s(), auth::random_nonce()};
    if (!auth::send_challenge(fd, p.challenge)) continue;
    if (std::count_if(pending.begin(), pending.end(), is_open) >=
        static_cast<std::ptrdiff_t>(wire::kMaxPendingConnections)) {
      auto oldest = std::find_if(pending.begin(), pending.end(), is_open);
      TUTTI_WARN("rank {}: more than {} connections without a hello; dropped the oldest (from {})", rank(),
                 wire::kMaxPendingConnections, oldest->addr);
      oldest->fd.reset();
    }
    pending.push_back(std::move(p));
  }
}

// A readable mesh socket: everything it has, each complete frame handled in order, then its end.
void Bootstrap::read_mesh(int peer) {
  Peer& p = *mesh_[peer];
  unsigned char tmp[65536];
  ssize_t k;
  while ((k = ::recv(p.fd.get(), tmp, sizeof(tmp), MSG_DONTWAIT)) > 0) p.buf.insert(p.buf.end(), tmp, tmp + k);
  bool closed = k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
  // Parse every complete frame first: a goodbye may be followed at once by EOF.
  size_t off = 0;
  while (p.buf.size() - off >= sizeof(wire::FrameHeader)) {
    wire::FrameHeader h;
    std::memcpy(&h, p.buf.data() + off, sizeof(h));
    if (h.magic != wire::kMagic || h.length > wire::kMaxControlBytes) {
      state_->fail(ErrorKind::kRemote, fmt::format("malformed bootstrap message from {}", describe(peer)));
      closed = true;
      off = p.buf.size();
      break;
    }
    if (p.buf.size() - off < sizeof(h) + h.length) break;
    std::vector<unsigned char> payload(p.buf.begin() + off + sizeof(h), p.buf.begin() + off + sizeof(h) + h.length);
    off += sizeof(h) + h.length;
    handle_frame(peer, h.type, h.tag, std::move(payload));
  }
  p.buf.erase(p.buf.begin(), p.buf.begin() + off);
  if (closed) mesh_closed(peer);
}

// The end of a mesh connection: a failure unless the peer said goodbye first.
void Bootstrap::mesh_closed(int peer) {
  Peer& p = *mesh_[peer];
  bool departed;
  {
    std::lock_guard lock(state_->mutex());
    p.eof = true;
    departed = p.departed;
    state_->cv().notify_all();
  }
  if (!departed)
    state_->fail(ErrorKind::kRemote,
                 fmt::format("{} closed its connection without leaving the communicator: the process died or "
                             "failed",
                             describe(peer)));
}

// A readable connection that has not sent its whole hello yet; handle_pending takes a complete one.
void Bootstrap::read_hello(Pending& p) {
  // Read no further than the hello: what follows belongs to the mesh or the transport.
  size_t want = sizeof(wire::FrameHeader) - std::min(p.buf.size(), sizeof(wire::FrameHeader));
  if (want == 0) {
    wire::FrameHeader h;
    std::memcpy(&h, p.buf.data(), sizeof(h));
    want = sizeof(h) + h.length - p.buf.size();
  }
  unsigned char tmp[512];
  ssize_t k = ::recv(p.fd.get(), tmp, std::min(want, sizeof(tmp)), MSG_DONTWAIT);
  if (k <= 0) {
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) return;
    TUTTI_WARN("rank {}: refused connection from {}: closed after {} bytes (truncated hello)", rank(), p.addr,
               p.buf.size());
    p.fd.reset();
    return;
  }
  p.buf.insert(p.buf.end(), tmp, tmp + k);
  if (p.buf.size() < sizeof(wire::FrameHeader)) return;
  wire::FrameHeader h;
  std::memcpy(&h, p.buf.data(), sizeof(h));
  bool known = h.type == static_cast<uint32_t>(wire::FrameType::kMeshHello) ||
               h.type == static_cast<uint32_t>(wire::FrameType::kTcpHello);
  if (h.magic != wire::kMagic || !known || h.length > 64 || h.length < sizeof(auth::Mac) + sizeof(int32_t)) {
    TUTTI_WARN("rank {}: refused connection from {}: not a tutti hello", rank(), p.addr);
    p.fd.reset();
    return;
  }
  if (p.buf.size() < sizeof(h) + h.length) return;
  try {
    handle_pending(p);
  } catch (const Error& e) {
    TUTTI_WARN("rank {}: refused connection from {}: {}", rank(), p.addr, e.what());
    p.fd.reset();
  }
}

void Bootstrap::expire_pending(std::list<Pending>& pending) {
  double now = now_s();
  for (auto& p : pending)
    if (p.fd && now - p.since > 10) {
      TUTTI_WARN("rank {}: dropped connection from {}: no complete hello within 10 s", rank(), p.addr);
      p.fd.reset();
    }
}

}  // namespace tutti
