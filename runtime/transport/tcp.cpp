#include "runtime/transport/tcp.hpp"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "core/error.hpp"

namespace tutti {
namespace {

constexpr uint32_t kHeaderMagic = 0x54544350;  // "TTCP"

const TransportInfo kTcpInfo{"tcp", WaitSource::kFd, MemoryRegistration::kNone,
                             "nothing: sockets are connected through the bootstrap's listener"};

// TUTTI_TCP_NSOCKS sockets per peer and channel.
class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(const CommOptions& o) : options_(o) {}
  const TransportInfo& info() const override { return kTcpInfo; }
  bool can_connect(const PeerInfo&, const PeerInfo&) const override { return true; }
  void publish(const ChannelSetup&, const std::vector<int>&, wire::Writer&) override {}
  void connect(const ChannelSetup& s, const std::vector<int>& peers, std::vector<wire::Reader>&,
               std::vector<std::unique_ptr<Connection>>& conns) override {
    // Connect to higher ranks first (completes without the peer's help), then accept from lower.
    const uint32_t channel = static_cast<uint32_t>(s.channel);
    const uint32_t nsocks = static_cast<uint32_t>(options_.tcp_sockets);
    std::vector<std::vector<Fd>> sockets(s.nranks);
    for (int p : peers)
      if (p > s.rank)
        for (uint32_t k = 0; k < nsocks; ++k) sockets[p].push_back(s.bootstrap.connect_tcp(p, channel, k));
    for (int p : peers)
      if (p < s.rank)
        for (uint32_t k = 0; k < nsocks; ++k) sockets[p].push_back(s.bootstrap.accept_tcp(p, channel, k));
    for (int p : peers)
      conns[p] = std::make_unique<TcpConnection>(s.rank, p, s.channel, std::move(sockets[p]),
                                                 options_.tcp_stripe_threshold);
  }

 private:
  CommOptions options_;
};

}  // namespace

std::unique_ptr<Transport> make_tcp_transport(const CommOptions& options) {
  return std::make_unique<TcpTransport>(options);
}

const TransportInfo& TcpConnection::transport() const { return kTcpInfo; }

TcpConnection::TcpConnection(int rank, int peer, int channel, std::vector<Fd> sockets, uint64_t stripe_threshold)
    : Connection(rank, peer, channel),
      sockets_(std::move(sockets)),
      stripe_threshold_(stripe_threshold),
      send_segments_(sockets_.size()),
      recv_segments_(sockets_.size()) {
  for (auto& s : sockets_) {
    set_nonblocking(s.get());
    set_nodelay(s.get());
  }
}

void TcpConnection::plan(Message& m, unsigned char* data, bool send) {
  auto& segs = send ? send_segments_ : recv_segments_;
  size_t n = sockets_.size();
  size_t parts = m.bytes >= stripe_threshold_ ? n : 1;
  m.segments_left = 1;  // the header
  segs[0].push_back({reinterpret_cast<unsigned char*>(&m.header), sizeof(Header), 0, m.ticket, true});
  // Parts rounded to 4 KiB so each socket moves whole pages.
  size_t per = parts == 1 ? m.bytes : (m.bytes / parts + 4095) / 4096 * 4096;
  size_t off = 0;
  for (size_t i = 0; i < parts && off < m.bytes; ++i) {
    size_t len = std::min(per, m.bytes - off);
    segs[i].push_back({data + off, len, 0, m.ticket, false});
    ++m.segments_left;
    off += len;
  }
}

uint32_t TcpConnection::check_of(const Header& h) {
  return static_cast<uint32_t>(header_hash({h.magic, h.bytes, h.stamp}) >> 32);
}

void TcpConnection::finish_segment(bool send, const Segment& s) {
  auto& msgs = send ? send_messages_ : recv_messages_;
  Message& m = msgs[s.ticket - msgs.front().ticket];
  if (s.header && !send) {
    const Header& h = m.header;
    if (h.magic != kHeaderMagic || h.check != check_of(h)) corrupt_header("TCP message header");
    if (h.stamp != m.stamp) stamp_mismatch(h.stamp, m.stamp);
    if (h.bytes != m.bytes)
      throw RemoteError(fmt::format("{}: message size mismatch: the peer sent {} bytes, the receive was posted for {}",
                                    where(), h.bytes, m.bytes));
  }
  --m.segments_left;
}

void TcpConnection::sever() {
  for (auto& s : sockets_) ::shutdown(s.get(), SHUT_RDWR);
}

bool TcpConnection::progress() {
  bool moved = false;
  // Split newly posted operations into segments.
  for (; send_planned_ < sendq_.size(); ++send_planned_) {
    Op& op = sendq_[send_planned_];
    send_messages_.push_back({op.ticket, 0, {kHeaderMagic, 0, op.bytes, op.stamp}, op.bytes, op.stamp, {}});
    Message& m = send_messages_.back();
    m.header.check = check_of(m.header);
    if (corrupt_.load(std::memory_order_relaxed)) {  // TUTTI_FAULT=corrupt
      m.header.bytes ^= 1ull << 3;
      corrupt_.store(false, std::memory_order_relaxed);
    }
    if (drop_.load(std::memory_order_relaxed)) continue;  // TUTTI_FAULT=drop: no segments, so it completes unsent
    plan(m, op.data, true);
  }
  for (; recv_planned_ < recvq_.size(); ++recv_planned_) {
    Op& op = recvq_[recv_planned_];
    recv_messages_.push_back({op.ticket, 0, {0, 0, 0, 0}, op.bytes, op.stamp, {}});
    Message& m = recv_messages_.back();
    if (op.reduce) m.temp.resize(op.bytes);
    plan(m, op.reduce ? m.temp.data() : op.data, false);
  }
  for (size_t i = 0; i < sockets_.size(); ++i) {
    int fd = sockets_[i].get();
    auto& sq = send_segments_[i];
    while (!sq.empty()) {
      Segment& s = sq.front();
      ssize_t k = s.bytes == s.done ? 0 : ::send(fd, s.data + s.done, s.bytes - s.done, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        throw RemoteError(fmt::format("{}: TCP connection lost while sending: {}", where(), std::strerror(errno)));
      }
      s.done += static_cast<size_t>(k);
      moved |= k > 0;
      if (s.done < s.bytes) break;
      finish_segment(true, s);
      sq.pop_front();
      moved = true;
    }
    auto& rq = recv_segments_[i];
    while (!rq.empty()) {
      Segment& s = rq.front();
      ssize_t k = s.bytes == s.done ? 0 : ::recv(fd, s.data + s.done, s.bytes - s.done, MSG_DONTWAIT);
      if (k < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        throw RemoteError(fmt::format("{}: TCP connection lost while receiving: {}", where(), std::strerror(errno)));
      }
      if (k == 0 && s.bytes > s.done)
        throw RemoteError(fmt::format("{}: the peer closed the TCP connection with {} bytes of a message missing",
                                      where(), s.bytes - s.done));
      s.done += static_cast<size_t>(k);
      moved |= k > 0;
      if (s.done < s.bytes) break;
      finish_segment(false, s);
      rq.pop_front();
      moved = true;
    }
  }
  while (!send_messages_.empty() && send_messages_.front().segments_left == 0) {
    send_messages_.pop_front();
    sendq_.pop_front();
    --send_planned_;
    ++sends_completed_;
  }
  while (!recv_messages_.empty() && recv_messages_.front().segments_left == 0) {
    if (recvq_.front().reduce) deliver(recvq_.front(), 0, recv_messages_.front().temp.data(), recvq_.front().bytes);
    recv_messages_.pop_front();
    recvq_.pop_front();
    --recv_planned_;
    ++recvs_completed_;
  }
  return moved;
}

void TcpConnection::rebase(Op& op, const unsigned char* old) {
  // Planned segments point into the message: move them to the copy (bytes already sent don't matter).
  for (auto& q : send_segments_)
    for (Segment& s : q)
      if (s.ticket == op.ticket && !s.header) s.data = op.data + (s.data - old);
}

void TcpConnection::poll_fds(std::vector<pollfd>& fds) const {
  for (size_t i = 0; i < sockets_.size(); ++i) {
    short ev = 0;
    if (!recv_segments_[i].empty() || recv_planned_ < recvq_.size()) ev |= POLLIN;
    if (!send_segments_[i].empty() || send_planned_ < sendq_.size()) ev |= POLLOUT;
    if (ev) fds.push_back({sockets_[i].get(), ev, 0});
  }
}

}  // namespace tutti
