#include "runtime/rendezvous.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <list>
#include <map>
#include <mutex>

#include "core/error.hpp"
#include "core/log.hpp"
#include "runtime/auth.hpp"
#include "runtime/wire.hpp"

namespace tutti {
namespace {

using Clock = std::chrono::steady_clock;
constexpr double kHandshakeSeconds = 10;  // a connection that sends no complete hello by then is dropped

struct Client {
  Fd fd;
  std::string addr;
  auth::Nonce challenge{};    // sent at accept; the hello's MAC covers it
  auth::Nonce rank_nonce{};   // the rank's, from its hello; the answer's MAC covers it
  Clock::time_point since = Clock::now();
  std::vector<unsigned char> buf;
  bool hello = false;
  int rank = -1, nranks = 0;
  uint64_t generation = 0;
  double timeout = 0;
  std::vector<unsigned char> info;
};

struct Group {
  int nranks = 0;
  double timeout = 0;
  Clock::time_point first = Clock::now();
  std::map<int, Client*> members;
  // A mistake the root saw (a rank twice, another size): told to every member at once, and to every
  // rank of the group that arrives until the group's timeout, instead of each waiting it out.
  std::string failed;
};

void send_frame(int fd, wire::FrameType type, const std::vector<unsigned char>& payload, const std::string& what) {
  wire::FrameHeader h;
  h.type = static_cast<uint32_t>(type);
  h.length = payload.size();
  Deadline d = Deadline::after(kHandshakeSeconds);
  send_exact(fd, &h, sizeof(h), d, what);
  if (!payload.empty()) send_exact(fd, payload.data(), payload.size(), d, what);
}

// An answer to an authenticated rank: a MAC over the rank's nonce and the body, then the body.
std::vector<unsigned char> signed_answer(uint64_t secret, std::string_view purpose, const auth::Nonce& rank_nonce,
                                         const std::vector<unsigned char>& body) {
  auth::Mac m = auth::mac(secret, purpose, rank_nonce, body.data(), body.size());
  std::vector<unsigned char> out(m.size() + body.size());
  std::memcpy(out.data(), m.data(), m.size());
  if (!body.empty()) std::memcpy(out.data() + m.size(), body.data(), body.size());
  return out;
}

constexpr std::string_view kHelloPurpose = "tutti rendezvous hello";
constexpr std::string_view kTablePurpose = "tutti rendezvous table";
constexpr std::string_view kErrorPurpose = "tutti rendezvous error";

void send_error(Client& c, uint64_t secret, ErrorKind kind, const std::string& msg) {
  wire::Writer w;
  w.put<uint32_t>(static_cast<uint32_t>(kind)).put_string(msg);
  try {
    send_frame(c.fd.get(), wire::FrameType::kRootError, signed_answer(secret, kErrorPurpose, c.rank_nonce, w.bytes()),
               c.addr);
  } catch (const Error&) {
  }
  c.fd.reset();
}

std::string list_missing(const Group& g) {
  std::string s;
  int shown = 0;
  for (int r = 0; r < g.nranks; ++r) {
    if (g.members.count(r)) continue;
    if (shown++ == 32) {
      s += ", ...";
      break;
    }
    s += (s.empty() ? "" : ", ") + std::to_string(r);
  }
  return s;
}

// A connection that has proven nothing yet: the first to go when connections run short.
bool unauthenticated(const Client& c) { return c.fd && !c.hello; }

void drop(Client& c, const std::string& why) {
  TUTTI_WARN("rendezvous root: refused connection from {}: {}", c.addr, why);
  c.fd.reset();
}

// What is wrong with a joiner for the group of its generation (another size, a rank that is there
// already), or nothing.
std::string group_mistake(Group& g, const Client& c) {
  if (g.nranks != c.nranks)
    return fmt::format("rank {} (from {}) was started with {} ranks but rank {} with {}", c.rank, c.addr, c.nranks,
                       g.members.begin()->first, g.nranks);
  if (g.members.count(c.rank))
    return fmt::format("rank {} joined twice (from {} and from {}): every rank must be started once, with a "
                       "rank of its own",
                       c.rank, g.members[c.rank]->addr, c.addr);
  return {};
}

// The root thread's state between polls: the connections, and the group each generation is forming.
struct RootLoop {
  using GroupIt = std::map<uint64_t, Group>::iterator;

  RootLoop(int listener, uint64_t secret, bool persistent, std::atomic<bool>& stop)
      : listener(listener), secret(secret), persistent(persistent), stop(stop) {}

  void accept_connections();
  void receive(Client& c);
  void disconnected(Client& c);
  bool read_hello(Client& c);
  void join(Client& c);
  void fail(Group& g, Client& c, const std::string& mistake);
  void answer(GroupIt it);
  GroupIt retire(GroupIt it);
  void expire();

  int listener;
  uint64_t secret;
  bool persistent;
  std::atomic<bool>& stop;
  std::list<Client> clients;
  std::map<uint64_t, Group> groups;
  Clock::time_point listen_paused_until{};
};

void RootLoop::accept_connections() {
  while (true) {
    int fd = ::accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        // Make room by dropping the oldest connection that has proven nothing; if there is
        // none, wait before trying again.
        auto oldest = std::find_if(clients.begin(), clients.end(), unauthenticated);
        if (oldest != clients.end()) drop(*oldest, "descriptor limit reached; dropping the oldest unauthenticated connection");
        else listen_paused_until = Clock::now() + std::chrono::milliseconds(100);
      }
      break;
    }
    Client c;
    c.fd = Fd(fd);
    c.addr = peer_address(fd).to_string();
    c.challenge = auth::random_nonce();
    if (!auth::send_challenge(fd, c.challenge)) continue;  // Fd closes it
    // A bounded number of connections may be proving themselves at once: the oldest goes.
    size_t pending = std::count_if(clients.begin(), clients.end(), unauthenticated);
    if (pending >= wire::kMaxPendingConnections) {
      auto oldest = std::find_if(clients.begin(), clients.end(), unauthenticated);
      drop(*oldest, fmt::format("more than {} connections without a hello; dropping the oldest",
                                wire::kMaxPendingConnections));
    }
    clients.push_back(std::move(c));
  }
}

// A readable connection: more of its hello, or its end.
void RootLoop::receive(Client& c) {
  unsigned char tmp[4096];
  ssize_t k = ::recv(c.fd.get(), tmp, sizeof(tmp), MSG_DONTWAIT);
  if (k <= 0) {
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) return;
    disconnected(c);
    return;
  }
  if (c.hello) return;  // nothing more is expected; ignore
  c.buf.insert(c.buf.end(), tmp, tmp + k);
  if (!read_hello(c)) return;
  c.hello = true;
  join(c);
}

void RootLoop::disconnected(Client& c) {
  if (!c.hello) {
    drop(c, fmt::format("connection closed after {} bytes (truncated hello)", c.buf.size()));
  } else {
    // A rank that arrived and then went away: it no longer counts as present.
    TUTTI_WARN("rendezvous root: rank {} (of generation {}) disconnected before all ranks arrived", c.rank,
               c.generation);
    auto g = groups.find(c.generation);
    if (g != groups.end()) g->second.members.erase(c.rank);
    c.fd.reset();
  }
}

// Checks and decodes the hello in c.buf once it is complete. False while it is incomplete, or when
// it was refused (and the connection dropped).
bool RootLoop::read_hello(Client& c) {
  if (c.buf.size() < sizeof(wire::FrameHeader)) return false;
  wire::FrameHeader h;
  std::memcpy(&h, c.buf.data(), sizeof(h));
  if (h.magic != wire::kMagic || h.type != static_cast<uint32_t>(wire::FrameType::kHello)) {
    drop(c, "not a tutti rendezvous hello (bad magic or type)");
    return false;
  }
  if (h.length > wire::kMaxHelloBytes || h.length < sizeof(auth::Mac) + sizeof(auth::Nonce)) {
    drop(c, fmt::format("hello claims {} bytes, outside {}..{}", h.length, sizeof(auth::Mac) + sizeof(auth::Nonce),
                        wire::kMaxHelloBytes));
    return false;
  }
  if (c.buf.size() > sizeof(h) + h.length) {
    drop(c, "sent more than its hello before the answer");
    return false;
  }
  if (c.buf.size() < sizeof(h) + h.length) return false;
  try {
    // mac | rank nonce | body, the MAC over nonce and body keyed with the secret.
    const unsigned char* p = c.buf.data() + sizeof(h);
    auth::Mac got;
    std::memcpy(got.data(), p, got.size());
    std::memcpy(c.rank_nonce.data(), p + got.size(), c.rank_nonce.size());
    const unsigned char* signed_part = p + got.size();
    const size_t signed_bytes = h.length - got.size();
    if (!auth::equal(got, auth::mac(secret, kHelloPurpose, c.challenge, signed_part, signed_bytes))) {
      drop(c, "wrong secret (the hello's proof does not match)");
      return false;
    }
    wire::Reader r(signed_part + c.rank_nonce.size(), signed_bytes - c.rank_nonce.size(), "rendezvous hello");
    c.generation = r.get<uint64_t>();
    c.rank = r.get<int32_t>();
    c.nranks = r.get<int32_t>();
    c.timeout = r.get<double>();
    c.info = r.get_bytes();
  } catch (const Error& e) {
    drop(c, e.what());
    return false;
  }
  return true;
}

// An authenticated rank joins the group of its generation; the last one completes it.
void RootLoop::join(Client& c) {
  if (c.nranks <= 0 || c.rank < 0 || c.rank >= c.nranks) {
    send_error(c, secret, ErrorKind::kInvalidArgument, fmt::format("rank {} is out of range for {} ranks", c.rank, c.nranks));
    return;
  }
  auto [it, fresh] = groups.try_emplace(c.generation);
  Group& g = it->second;
  if (!g.failed.empty()) {
    send_error(c, secret, ErrorKind::kInvalidArgument, g.failed);
    return;
  }
  if (fresh || g.members.empty()) {
    g.nranks = c.nranks;
    g.timeout = c.timeout;
    g.first = Clock::now();
  }
  std::string mistake = group_mistake(g, c);
  if (!mistake.empty()) {
    fail(g, c, mistake);
    return;
  }
  g.timeout = std::min(g.timeout, c.timeout);
  g.members[c.rank] = &c;
  TUTTI_INFO(log::kBootstrap, "rendezvous root: rank {}/{} arrived from {}", c.rank, c.nranks, c.addr);
  if (static_cast<int>(g.members.size()) == g.nranks) answer(it);
}

void RootLoop::fail(Group& g, Client& c, const std::string& mistake) {
  TUTTI_WARN("rendezvous root: {}", mistake);
  g.failed = mistake;
  send_error(c, secret, ErrorKind::kInvalidArgument, mistake);
  for (auto& [rank, m] : g.members) send_error(*m, secret, ErrorKind::kInvalidArgument, mistake);
  g.members.clear();
}

// Every rank of a complete group gets the table of all ranks' info.
void RootLoop::answer(GroupIt it) {
  Group& g = it->second;
  wire::Writer w;
  w.put<int32_t>(g.nranks);
  for (auto& [rank, m] : g.members) w.put_bytes(m->info.data(), m->info.size());
  for (auto& [rank, m] : g.members) {
    try {
      send_frame(m->fd.get(), wire::FrameType::kTable, signed_answer(secret, kTablePurpose, m->rank_nonce, w.bytes()),
                 m->addr);
    } catch (const Error& e) {
      TUTTI_WARN("rendezvous root: could not answer rank {}: {}", rank, e.what());
    }
    m->fd.reset();
  }
  retire(it);
}

// A group is done with (answered, failed or timed out): a one-shot root stops after it.
RootLoop::GroupIt RootLoop::retire(GroupIt it) {
  GroupIt next = groups.erase(it);
  if (!persistent) stop = true;
  return next;
}

// Deadlines: incomplete hellos and incomplete groups.
void RootLoop::expire() {
  auto now = Clock::now();
  for (auto& c : clients)
    if (c.fd && !c.hello && now - c.since > std::chrono::duration<double>(kHandshakeSeconds))
      drop(c, "no complete hello in time");
  for (auto it = groups.begin(); it != groups.end();) {
    Group& g = it->second;
    if (!g.failed.empty() && now - g.first > std::chrono::duration<double>(g.timeout > 0 ? g.timeout : 60)) {
      it = retire(it);  // late ranks of a failed group have been told; later ones time out
      continue;
    }
    if (!g.members.empty() && g.timeout > 0 && now - g.first > std::chrono::duration<double>(g.timeout)) {
      std::string msg = fmt::format("rendezvous timed out after {} s: ranks {} of {} never arrived", g.timeout,
                                    list_missing(g), g.nranks);
      TUTTI_WARN("rendezvous root: {}", msg);
      for (auto& [rank, m] : g.members) send_error(*m, secret, ErrorKind::kTimeout, msg);
      it = retire(it);
    } else {
      ++it;
    }
  }
}

}  // namespace

RendezvousRoot::RendezvousRoot(const SocketAddress& addr, uint64_t secret, bool persistent)
    : listener_(listen_on(addr)),
      wake_(TUTTI_SYSCALL(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC), "eventfd()")),
      secret_(secret),
      persistent_(persistent) {
  SocketAddress bound = local_address(listener_.get());
  id_ = UniqueId::make(bound, secret);
  TUTTI_INFO(log::kBootstrap, "rendezvous root listening on {}", bound.to_string());
  thread_ = std::thread([this] { run(); });
}

RendezvousRoot::~RendezvousRoot() {
  stop_ = true;
  uint64_t one = 1;
  [[maybe_unused]] ssize_t k = ::write(wake_.get(), &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
}

void RendezvousRoot::run() {
  RootLoop loop(listener_.get(), secret_, persistent_, stop_);
  while (!stop_) {
    std::vector<pollfd> fds{{listener_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    std::vector<Client*> order;
    for (auto& c : loop.clients) {
      fds.push_back({c.fd.get(), POLLIN, 0});
      order.push_back(&c);
    }
    // At the descriptor limit the listener stays readable: stop polling it for a while rather
    // than spin (each connection that cannot be accepted is someone else's problem until then).
    if (Clock::now() < loop.listen_paused_until) fds[0].events = 0;
    ::poll(fds.data(), fds.size(), 100);
    if (fds[0].revents & POLLIN) loop.accept_connections();
    for (size_t i = 0; i < order.size(); ++i) {
      Client& c = *order[i];
      if (!c.fd) continue;  // dropped above in this round
      if (!(fds[i + 2].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      loop.receive(c);
    }
    loop.expire();
    loop.clients.remove_if([](const Client& c) { return !c.fd; });
  }
  finished_ = true;
}

namespace {
std::mutex g_roots_mutex;
std::vector<std::unique_ptr<RendezvousRoot>> g_roots;  // one-shot roots; finished ones are reaped

void keep_root(std::unique_ptr<RendezvousRoot> root) {
  std::lock_guard lock(g_roots_mutex);
  std::erase_if(g_roots, [](const auto& r) { return r->finished(); });
  g_roots.push_back(std::move(root));
}
}  // namespace

UniqueId create_unique_id(const std::string& socket_ifname) {
  auto root =
      std::make_unique<RendezvousRoot>(choose_interface_address(socket_ifname), UniqueId::random_secret(), false);
  UniqueId id = root->unique_id();
  keep_root(std::move(root));
  return id;
}

void ensure_persistent_root(const UniqueId& id) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<RendezvousRoot>> roots;
  std::lock_guard lock(mu);
  std::string key = id.root().to_string();
  if (roots.count(key)) return;
  roots[key] = std::make_unique<RendezvousRoot>(id.root(), id.secret(), true);
}

std::vector<std::vector<unsigned char>> rendezvous(const UniqueId& id, int rank, int nranks, uint64_t generation,
                                                   const std::vector<unsigned char>& info, double timeout_s,
                                                   const std::atomic<bool>* abort) {
  SocketAddress root = id.root();
  Deadline connect_deadline = Deadline::after(timeout_s);
  std::string what = fmt::format("rendezvous root {}", root.to_string());
  Fd fd = connect_with_retry(root, connect_deadline, abort, "the rendezvous root (is rank 0 / tutti-run running?)");
  Deadline d = Deadline::after(timeout_s);
  // Prove the secret over the root's challenge; send a nonce of our own for the root to prove it back.
  const auth::Nonce challenge = auth::recv_challenge(fd.get(), d, what);
  const auth::Nonce mine = auth::random_nonce();
  wire::Writer w;
  w.put(mine).put<uint64_t>(generation).put<int32_t>(rank).put<int32_t>(nranks).put<double>(timeout_s);
  w.put_bytes(info.data(), info.size());
  TUTTI_CHECK(w.bytes().size() + sizeof(auth::Mac) <= wire::kMaxHelloBytes, InvalidArgument,
              "rank {}: this rank's rendezvous hello ({} bytes) exceeds the {}-byte limit", rank,
              w.bytes().size() + sizeof(auth::Mac), wire::kMaxHelloBytes);
  const auth::Mac proof = auth::mac(id.secret(), kHelloPurpose, challenge, w.bytes().data(), w.bytes().size());
  std::vector<unsigned char> hello(proof.size() + w.bytes().size());
  std::memcpy(hello.data(), proof.data(), proof.size());
  std::memcpy(hello.data() + proof.size(), w.bytes().data(), w.bytes().size());
  wire::FrameHeader h;
  h.type = static_cast<uint32_t>(wire::FrameType::kHello);
  h.length = hello.size();
  send_exact(fd.get(), &h, sizeof(h), d, what);
  send_exact(fd.get(), hello.data(), hello.size(), d, what);
  // The root answers at its own deadline; allow it a grace period to tell us who is missing.
  Deadline answer = Deadline::after(timeout_s > 0 ? timeout_s + 5 : 0);
  wire::FrameHeader rh;
  try {
    while (true) {
      pollfd p{fd.get(), POLLIN, 0};
      int rc = ::poll(&p, 1, answer.ms_left(100));
      TUTTI_CHECK(!(abort && abort->load()), Aborted, "rank {}: aborted during rendezvous", rank);
      if (rc > 0) break;
      TUTTI_CHECK(!answer.expired(), Timeout, "rank {}: no answer from {} within {} s", rank, what, timeout_s);
    }
    recv_exact(fd.get(), &rh, sizeof(rh), answer, what);
  } catch (const RemoteError& e) {
    throw RemoteError(fmt::format("rank {}: {} refused or dropped the connection ({}); wrong secret?", rank, what, e.what()));
  }
  // A table holds every rank's hello; an error, a message.
  const uint64_t most = sizeof(auth::Mac) + 64 + static_cast<uint64_t>(nranks) * (wire::kMaxHelloBytes + 8);
  TUTTI_CHECK(rh.magic == wire::kMagic && rh.length >= sizeof(auth::Mac) && rh.length <= most, RemoteError,
              "rank {}: malformed answer from {} ({} bytes)", rank, what, rh.length);
  std::vector<unsigned char> payload(rh.length);
  recv_exact(fd.get(), payload.data(), payload.size(), answer, what);
  auth::Mac got;
  std::memcpy(got.data(), payload.data(), got.size());
  const bool is_error = rh.type == static_cast<uint32_t>(wire::FrameType::kRootError);
  TUTTI_CHECK(auth::equal(got, auth::mac(id.secret(), is_error ? kErrorPurpose : kTablePurpose, mine,
                                         payload.data() + got.size(), payload.size() - got.size())),
              RemoteError,
              "rank {}: {} answered without proving the communicator's secret: not the root of this job (an "
              "impostor on its port, or another job's root)",
              rank, what);
  wire::Reader r(payload.data() + got.size(), payload.size() - got.size(), "rendezvous answer");
  if (is_error) {
    auto kind = static_cast<ErrorKind>(r.get<uint32_t>());
    std::string msg = fmt::format("rank {}: {}", rank, r.get_string());
    rethrow_with_context(Error(kind, msg), "communicator creation failed");
  }
  TUTTI_CHECK(rh.type == static_cast<uint32_t>(wire::FrameType::kTable), RemoteError,
              "rank {}: unexpected answer type {} from {}", rank, rh.type, what);
  int n = r.get<int32_t>();
  TUTTI_CHECK(n == nranks, RemoteError, "rank {}: root answered for {} ranks, expected {}", rank, n, nranks);
  std::vector<std::vector<unsigned char>> table;
  for (int i = 0; i < n; ++i) table.push_back(r.get_bytes());
  return table;
}

}  // namespace tutti
