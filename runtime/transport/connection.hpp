#pragma once
// A connection is one ordered, reliable, bidirectional message stream between this rank and one peer
// on one channel. Operations are non-blocking: send()/recv() queue a byte range and return a ticket;
// progress() moves bytes without blocking; send_done()/recv_done() tell whether a ticket completed.
// The progress engine (runtime/progress.hpp) turns this into blocking waits.
//
// Contract:
// - Messages arrive in the order they were sent. Each recv matches the next send of the peer, and its
//   size must equal that send's size: a mismatch is a RemoteError naming both sizes, not a silent
//   truncation.
// - A buffer passed to send/recv must stay valid and untouched until its ticket is done.
// - Tickets of one direction complete in order, so done(t) implies done(t') for t' < t.
// - Not thread-safe: one thread drives a rank's connections at a time.

#include <poll.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "core/copy.hpp"
#include "core/reduce.hpp"
#include "runtime/call_stamp.hpp"
#include "runtime/transport/transport.hpp"

namespace tutti {

using Ticket = uint64_t;

// Work a reducing receive does on its destination right after combining each range of it, while
// the range is in the nearest cache (a reduction's epilogue, KernelDef::stream). Ranges come in
// order, each written once, and together cover the receive; the epilogue may rewrite them in
// place. Called by whichever thread drives the connection, inside progress().
class ReceiveEpilogue {
 public:
  virtual void written(unsigned char* data, size_t bytes) = 0;

 protected:
  ~ReceiveEpilogue() = default;
};

class Connection {
 public:
  Connection(int rank, int peer, int channel) : rank_(rank), peer_(peer), channel_(channel) {}
  virtual ~Connection() = default;
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  int peer() const { return peer_; }
  int channel() const { return channel_; }
  virtual const TransportInfo& transport() const = 0;

  Ticket send(const void* data, size_t bytes) {
    Op o{static_cast<unsigned char*>(const_cast<void*>(data)), bytes, ++sends_posted_};
    o.stamp = stamp_;
    sendq_.push_back(std::move(o));
    return sends_posted_;
  }
  // The call the messages posted from now on belong to (runtime/call_stamp.hpp): sends carry it,
  // receives expect it. 0 (the default) outside plans.
  void set_stamp(CallStamp s) { stamp_ = s; }
  // `stream`: the receiver will not read `data` again soon, so the transport may write it around
  // the caches (core/copy.hpp). The bytes are visible, as always, once the ticket is done.
  Ticket recv(void* data, size_t bytes, bool stream = false) {
    Op o{static_cast<unsigned char*>(data), bytes, ++recvs_posted_};
    o.stream = stream;
    o.stamp = stamp_;
    recvq_.push_back(std::move(o));
    return recvs_posted_;
  }
  // Receives a message and stores dst = message (op) local, element-wise, as it arrives: the
  // message is reduced straight out of the transport's buffer, never copied first. dst may be
  // local. Both must stay valid until the ticket is done. `after`, if given, runs on each range of
  // dst once combined (and must outlive the ticket).
  Ticket recv_reduce(void* dst, const void* local, size_t bytes, RedOp op, DataType type,
                     ReceiveEpilogue* after = nullptr) {
    Op o{static_cast<unsigned char*>(dst), bytes, ++recvs_posted_};
    o.local = static_cast<const unsigned char*>(local);
    o.epilogue = after;
    o.reduce = true;
    o.redop = op;
    o.type = type;
    o.stamp = stamp_;
    recvq_.push_back(std::move(o));
    return recvs_posted_;
  }
  // Eager completion: makes the pending send `t` independent of the caller's buffer by copying the
  // message into memory the connection owns, so the buffer may be reused before the peer takes the
  // message. True if the buffer is free (the send is done or now owned); false if the transport
  // still reads it (a shared-memory single copy already announced to the peer; that one completes
  // when the receiver, idle or not, reads it: see ShmConnection::relieve).
  bool own(Ticket t) {
    if (send_done(t)) return true;
    Op& op = sendq_[t - sendq_.front().ticket];
    if (op.owned) return true;
    if (!can_own(op)) return false;
    std::shared_ptr<unsigned char[]> copy(new unsigned char[op.bytes ? op.bytes : 1]);
    if (op.bytes) std::memcpy(copy.get(), op.data, op.bytes);
    unsigned char* old = op.data;
    op.data = copy.get();
    op.owned = std::move(copy);
    rebase(op, old);
    return true;
  }
  bool send_done(Ticket t) const { return sends_completed_ >= t; }
  bool recv_done(Ticket t) const { return recvs_completed_ >= t; }
  bool idle() const { return sendq_.empty() && recvq_.empty(); }
  bool sends_pending() const { return !sendq_.empty(); }

  // Moves what it can without blocking; true if anything moved. Throws RemoteError on failure.
  virtual bool progress() = 0;
  // Whether progress() has anything to do (cheap; the engine skips connections that say no).
  virtual bool wants_progress() const { return !idle(); }
  // Called when the rank has nothing else to do and is about to sleep: take messages whose senders
  // wait for us although no receive is posted for them (see ShmConnection). True if anything moved.
  virtual bool relieve() { return false; }
  // File descriptors to poll() when sleeping (TCP); shared memory sleeps on the doorbell instead.
  virtual void poll_fds(std::vector<pollfd>&) const {}

  // Fault injection (runtime/fault.hpp). drop: from now on, sends complete without reaching the
  // peer. corrupt: one bit of the next message header flips after its checksum is computed.
  // sever(): the transport's own link is cut as a crash would cut it (TCP: both directions shut).
  // (Another worker of the rank may inject while this connection's owner drives it: atomics.)
  void drop_sends() { drop_.store(true, std::memory_order_relaxed); }
  void corrupt_next_header() { corrupt_.store(true, std::memory_order_relaxed); }
  virtual void sever() {}
  // Called when this rank leaves a failed call (error, timeout, abort): once it returns, no peer
  // reads this rank's memory by reference any more, so the caller may free its buffers. A read in
  // progress finishes first; later ones fail on the reader. Waits only for reads already begun.
  virtual void withdraw() {}
  // Single copy (runtime/transport/shm.hpp): whether this connection can read the peer's memory
  // directly (process ranks with process_vm_readv), and from what message size it does.
  virtual bool can_single_copy() const { return false; }
  virtual void set_single_copy(uint64_t /*threshold*/, bool /*adaptive*/) {}

 protected:
  struct Op {
    Op(unsigned char* d, size_t b, Ticket t) : data(d), bytes(b), ticket(t) {}
    unsigned char* data;
    size_t bytes;
    Ticket ticket;
    size_t offset = 0;     // bytes moved so far (or posted, for shm sends)
    bool started = false;  // first fragment seen/sent
    uint64_t aux = 0;      // transport-specific (single-copy sequence number, segments left)
    // recv_reduce: data = incoming (op) local.
    const unsigned char* local = nullptr;
    bool reduce = false;
    bool stream = false;  // recv: write data with non-temporal stores
    ReceiveEpilogue* epilogue = nullptr;  // recv_reduce: runs on each combined range
    RedOp redop = RedOp::kSum;
    DataType type = DataType::kFloat32;
    std::shared_ptr<unsigned char[]> owned;  // own(): the message's private copy
    CallStamp stamp = 0;                      // the call it belongs to (set_stamp when posted)
  };
  // The error for a message whose stamp is not the receive's: both calls named.
  [[noreturn]] void stamp_mismatch(CallStamp sent, CallStamp expected) const;
  // The error for a header whose checksum does not match its words.
  [[noreturn]] void corrupt_header(const char* what) const;
  // own() hooks: whether the transport still may switch a send to a private copy, and how to repoint
  // its internal references from `old` to op.data.
  virtual bool can_own(const Op&) const { return true; }
  virtual void rebase(Op&, const unsigned char* /*old*/) {}
  // Writes `bytes` of incoming data at `offset` of a posted receive: copied, or reduced with the
  // receive's local operand.
  static void deliver(const Op& op, size_t offset, const void* incoming, size_t bytes) {
    if (!bytes) return;
    if (!op.reduce) {
      copy_bytes(op.data + offset, incoming, bytes, op.stream);
      return;
    }
    const size_t esize = size_of(op.type);
    if (!op.epilogue) {
      combine(op.redop, op.type, op.data + offset, incoming, op.local + offset, bytes / esize);
      return;
    }
    // A range at a time, small enough that the epilogue finds what combine wrote in L1.
    constexpr size_t kRange = 8 << 10;
    const auto* in = static_cast<const unsigned char*>(incoming);
    for (size_t at = 0; at < bytes; at += kRange) {
      const size_t len = std::min(kRange, bytes - at);
      combine(op.redop, op.type, op.data + offset + at, in + at, op.local + offset + at, len / esize);
      op.epilogue->written(op.data + offset + at, len);
    }
  }
  std::string where() const;  // "rank R, connection to rank P on channel C", for messages

  int rank_, peer_, channel_;
  std::deque<Op> sendq_, recvq_;
  Ticket sends_posted_ = 0, recvs_posted_ = 0;
  Ticket sends_completed_ = 0, recvs_completed_ = 0;
  CallStamp stamp_ = 0;
  std::atomic<bool> drop_{false}, corrupt_{false};  // fault injection
};

}  // namespace tutti
