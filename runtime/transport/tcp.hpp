#pragma once
// TCP transport: several non-blocking sockets per peer and channel (TCP_NODELAY). A message starts
// with a 16-byte header on socket 0 (magic, size); a message of at least `stripe_threshold` bytes is
// split into one contiguous part per socket, smaller ones travel whole on socket 0. Each socket
// carries its parts in message order, so the receiver, which knows the size it posted, knows what
// every socket holds next; the header then confirms the size.

#include <memory>
#include <vector>

#include "runtime/comm_options.hpp"
#include "runtime/socket.hpp"
#include "runtime/transport/connection.hpp"

namespace tutti {

// The TCP transport for the registry (runtime/transport/transport.hpp): any two ranks.
std::unique_ptr<Transport> make_tcp_transport(const CommOptions& options);

class TcpConnection : public Connection {
 public:
  TcpConnection(int rank, int peer, int channel, std::vector<Fd> sockets, uint64_t stripe_threshold);
  const TransportInfo& transport() const override;
  bool progress() override;
  void poll_fds(std::vector<pollfd>& fds) const override;
  void sever() override;

 protected:
  void rebase(Op& op, const unsigned char* old) override;

 private:
  // Every message starts with one. `check` covers the other words (runtime/call_stamp.hpp).
  struct Header {
    uint32_t magic;
    uint32_t check;
    uint64_t bytes;
    CallStamp stamp;
  };
  static uint32_t check_of(const Header& h);
  struct Segment {
    unsigned char* data;
    size_t bytes;
    size_t done;
    Ticket ticket;
    bool header;
  };
  struct Message {
    Ticket ticket;
    int segments_left;
    Header header;  // the send's header, or the received one
    size_t bytes;
    CallStamp stamp;                  // a receive's: the stamp its message must carry
    std::vector<unsigned char> temp;  // a reducing receive lands here, then is reduced into place
  };
  // Splits a message into per-socket segments.
  void plan(Message& m, unsigned char* data, bool send);
  void finish_segment(bool send, const Segment& s);

  std::vector<Fd> sockets_;
  uint64_t stripe_threshold_;
  std::vector<std::deque<Segment>> send_segments_, recv_segments_;
  std::deque<Message> send_messages_, recv_messages_;
  size_t send_planned_ = 0, recv_planned_ = 0;  // ops of sendq_/recvq_ already split into segments
};

}  // namespace tutti
