#pragma once
// The mailbox: one-shot exchange of small messages between the ranks of a communicator that all
// share memory (one host, shm transport). Each rank owns an outbox in its control segment, which
// every peer maps; a call writes the rank's data into its outbox and publishes the call's sequence
// number, then reads every peer's outbox once that peer has published the same number. No FIFO, no
// ticket, no plan interpreter: a small all-reduce costs one copy in, one cache-line handoff per
// peer and one reduction, which is what makes 8 B calls sub-microsecond.
//
// Layout of an outbox: two parities (calls alternate between them), each a 64-byte-aligned record
// of an 8-byte sequence word followed by `capacity` data bytes, so a message of up to 56 bytes
// shares the sequence word's cache line and costs the reader one miss.
//
// Memory ordering. The writer stores its data, then the sequence word with release, then rings
// every peer's doorbell (doorbell.hpp: a fence and a load unless the peer sleeps). A reader that
// loads the sequence word with acquire and sees the call's number sees the data.
//
// Reuse without acknowledgements. Every rank publishes at every call, even where it has nothing to
// send (a broadcast's non-roots publish zero bytes), and every rank waits for every peer's word at
// every call. A rank writes parity p at call s + 2 only after it has seen every peer's word of
// call s + 1, which each peer published only after it finished reading call s: so nobody can still
// be reading what is overwritten. All ranks must therefore take the mailbox for the same calls in
// the same order, which holds because the choice depends only on arguments NCCL requires to agree.
//
// Waiting spins briefly on the peers' words, then sleeps on this rank's doorbell through the
// progress engine, which honours abort, peer failure and TUTTI_TIMEOUT.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "runtime/comm_state.hpp"
#include "runtime/doorbell.hpp"
#include "runtime/progress.hpp"

namespace tutti {

class Mailbox {
 public:
  // Bytes of a control segment that holds a doorbell and an outbox of `capacity` data bytes.
  static size_t segment_bytes(uint64_t capacity);
  // The data capacity of a control segment of `bytes`.
  static uint64_t capacity_of(size_t segment_bytes);
  // Places a fresh outbox after the doorbell in a zero-filled control segment.
  static void init(void* segment, uint64_t capacity);

  // segments[r]: rank r's control segment (ours included), mapped here, with its size.
  struct Segment {
    void* base = nullptr;
    size_t bytes = 0;
  };
  Mailbox(int rank, std::vector<Segment> segments, ProgressEngine& engine, CommState& state, bool oversubscribed);

  // Data bytes every rank's outbox holds (the smallest of them): what one call may publish.
  uint64_t capacity() const { return capacity_; }
  int size() const { return static_cast<int>(boxes_.size()); }
  int rank() const { return rank_; }

  // This rank's outbox for the next call: write up to capacity() bytes, then publish().
  unsigned char* outbox();
  // Publishes the outbox and waits until every peer has published this call. Throws the
  // communicator's error (Aborted, RemoteError, Timeout) naming `what`.
  void exchange(const char* what);
  // The same in two halves, so a caller that must not block can publish, look, and leave the wait
  // to someone else: publish() makes the outbox this call's; arrived() says (without waiting, after
  // a short spin) whether every peer has published it; wait() blocks like exchange().
  void publish(const char* what);
  bool arrived();
  void wait(const char* what);
  // After exchange(): rank r's data of this call (our own outbox for r == rank).
  const unsigned char* data(int r) const;
  uint64_t calls() const { return seq_; }
  // Fault injection (runtime/fault.hpp). drop: from now on publish() announces nothing, so peers
  // wait in vain. corrupt: the next publish() flips bit 3 of outbox byte 8 (the count of a one-shot
  // call's header, which every peer compares with its own).
  void inject_drop() { drop_ = true; }
  void inject_corrupt() { corrupt_ = true; }

 private:
  bool seen();  // arrived() without the spin
  struct Box {
    std::atomic<uint64_t>* word[2];
    unsigned char* data[2];
    Doorbell* bell;
  };
  int rank_;
  uint64_t capacity_ = 0;
  std::vector<Box> boxes_;
  ProgressEngine& engine_;
  CommState& state_;
  bool oversubscribed_;
  uint64_t seq_ = 0;  // calls published so far
  int next_ = 0;      // the lowest peer not yet seen publishing call seq_
  bool drop_ = false, corrupt_ = false;
};

}  // namespace tutti
