#pragma once
// The mailbox: one-shot exchange of small messages between the ranks of a communicator that all
// share memory (one host, shm transport). Each rank owns an outbox in its control segment, which
// every peer maps; a call writes the rank's data into its outbox and publishes the call's sequence
// number, then reads the outboxes of the peers it needs once they have published the same number.
// No FIFO, no ticket, no plan interpreter: a small all-reduce costs one copy in, one cache-line
// handoff per peer and one reduction, which is what makes 8 B calls sub-microsecond.
//
// Layout of an outbox: an acknowledgement line, then two rings of records. A record is a
// 64-byte-aligned sequence word, the writer's `done` (below), then data bytes, so a message of up
// to 32 bytes shares the sequence word's cache line and costs the reader one miss. The first
// kStampBytes of the data are the call's stamp: what every rank must agree on (the one-shot layer
// packs collective, type, op, root and count there).
// - The lockstep ring: kRecords records of `capacity` data bytes; call s takes record s mod
//   kRecords. Calls in which every rank waits for every other (an all-reduce) never run ahead.
// - The deep ring: kDeepRecords records of kDeepRecordBytes; call s takes record s mod
//   kDeepRecords. Calls that let ranks run ahead (`deep`: a broadcast's root, a reduce's senders,
//   with data that fits) use it on a crowded host.
// Every rank makes the same choice for a call (deep() depends on what the stamps agree on), so a
// reader looks for its peer's record of call t in the ring of its own call t. Where the calls
// differ, the peer's record is in the other ring: a reader that does not find the record where it
// expects it looks there too, and the stamps then name both calls.
//
// Why two rings. How far a rank may run ahead of the ranks that read it is the number of records
// of its ring. A broadcast's root on a crowded host (more ranks than cores) that may run 16 calls
// ahead switches to its receivers every 16 calls; 256 made 4-rank broadcasts of 8 B-512 B on 2
// cores 2-3x faster. But a ring of 256 records costs lockstep calls: a record's lines, rewritten
// only every 256 calls, have left the writer's caches, and a 2-rank all-reduce of 64-128 B took
// 0.1-0.2 us more (20-call runs); records of the largest one-shot size 256 deep would also take
// 64 MiB of shared memory per rank. So lockstep calls keep 16 records close to the cores.
//
// Who waits for whom. A call names the peers it reads: every peer (an all-reduce), one (a
// broadcast's receivers read the root), or none (a broadcast's root, a reduce's senders). A rank
// waits only for the records it reads, so a broadcast's root and a reduce's senders run ahead of
// the others by up to kDeepRecords calls (kRecords where the data does not fit a deep record), as
// an MPI root that sends eagerly does. On a crowded host
// this is what lets a root's calls go on while its receivers wait for a core.
//
// Reuse. Every rank still writes a record at every call (the stamp at least), and checks every
// peer's stamp of every call: in the call for the peers it reads, later for the others (every
// kCheckBatch calls, and whenever it waits), while their records are still there. A rank's `done`
// is the last call through which it has checked and read every peer's records. A rank writes
// record s of a ring of R records only once every rank's `done` (its own included) has reached
// s - R, so no record is overwritten while someone may still read it (the record's last user was a
// call at or before s - R). `done` travels in
// every record its rank writes, so the peers that read the record learn it for free; a rank about
// to sleep also stores it on its acknowledgement line, so no rank ever waits for an acknowledgement
// that a sleeping peer holds back.
//
// Mismatched calls. A stamp that differs from this rank's stamp of the same call fails: in the call
// (InvalidArgument naming both calls) where this rank reads that peer, otherwise at the end of the
// first later call that checks it (at the latest the next call that reads that peer). Either way
// every rank that made one of the two calls reports it, once, and the communicator goes on working
// for matching calls.
//
// Memory ordering. The writer stores its data, then the sequence word with release, then rings the
// doorbells of the peers that read it in this call (doorbell.hpp: a fence and a load unless the
// peer sleeps). A reader that loads the sequence word with acquire and sees the call's number sees
// the data and the writer's `done`. `done` is written (in a record, or on the acknowledgement line
// with release) after the reads it acknowledges, and read with acquire before the record it frees
// is overwritten.
//
// Waiting spins briefly, then sleeps on this rank's doorbell through the progress engine, which
// honours abort, peer failure and TUTTI_TIMEOUT.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/comm_state.hpp"
#include "runtime/doorbell.hpp"
#include "runtime/progress.hpp"

namespace tutti {

class Mailbox {
 public:
  // Records per ring: how many calls a rank may run ahead of a peer that has not read them.
  static constexpr int kRecords = 16;
  static constexpr int kDeepRecords = 256;
  // Bytes of a deep record (whole cache lines), and the data it holds after its stamp.
  static constexpr size_t kDeepRecordBytes = 1024;
  static constexpr size_t kDeepDataBytes = kDeepRecordBytes - 2 * sizeof(uint64_t) - 16;
  // Whether a call whose writers publish `bytes` of data (after the stamp) takes the deep ring:
  // `run_ahead` calls (the one-shot layer's broadcast and reduce) whose data fits, on a crowded host
  // (more ranks than cores, the same answer on every rank). With a core per rank, 16 calls of run
  // ahead are plenty, and the deep ring's cold records cost a 2-rank broadcast of 64 B-1 KiB 0.1-0.2
  // us per call (20-call runs).
  bool deep(uint64_t bytes, bool run_ahead) const { return run_ahead && oversubscribed_ && bytes <= kDeepDataBytes; }
  // How many calls of that kind a rank may run ahead.
  static constexpr uint64_t depth(bool deep) { return deep ? kDeepRecords : kRecords; }
  // Stamps of peers this rank does not read are checked every kCheckBatch calls (or when it waits).
  static constexpr int kCheckBatch = 4;
  static constexpr size_t kStampBytes = 16;
  // Text for a stamp, for error messages (the one-shot layer's call header).
  using Describe = std::string (*)(const unsigned char* stamp);

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

  // Data bytes every rank's record holds (the smallest of them), stamp included: what one call may
  // publish.
  uint64_t capacity() const { return capacity_; }
  int size() const { return static_cast<int>(boxes_.size()); }
  int rank() const { return rank_; }

  // Whose records a call reads, and who reads this rank's: kEvery, kNobody or one rank.
  static constexpr int kEvery = -1, kNobody = -2;
  struct Call {
    const char* what = "";  // the collective, for messages
    int reads = kEvery;
    int read_by = kEvery;
    Describe describe = nullptr;
  };

  // Whether open(deep) can return without waiting (every rank has acknowledged the record it
  // reuses).
  bool has_room(bool deep);
  // Where this rank's data for the next call goes, in the ring deep() chose for it, once its record
  // may be overwritten (waits for room): up to capacity() - kStampBytes bytes (kDeepDataBytes in the
  // deep ring); then publish().
  unsigned char* open(const char* what, bool deep);
  // Writes the call's stamp (kStampBytes), makes the record this call's and tells the peers that
  // read it (`reads`, `read_by`: Call's).
  void publish(const unsigned char* stamp, const char* what, int reads, int read_by, Describe describe);
  // Whether every peer this call reads has published it (without waiting, after a short spin).
  bool arrived();
  // Blocks until they have, and checks their stamps: InvalidArgument naming both calls where one
  // differs, RemoteError where this rank's own record was damaged, and the communicator's error
  // (Aborted, RemoteError, Timeout) naming the call.
  void wait();
  // After wait(): rank r's data of this call, after its stamp (our own record for r == rank).
  const unsigned char* data(int r) const;
  // Ends the call once its data is read (the records it read may be reused from now on); every
  // kCheckBatch calls checks what peers published since; throws InvalidArgument for a mismatch
  // found in an earlier call's stamps.
  void complete();
  uint64_t calls() const { return seq_; }
  // Fault injection (runtime/fault.hpp). drop: from now on publish() announces nothing, so peers
  // wait in vain. corrupt: the next publish() flips bit 3 of stamp byte 8 (the count of a one-shot
  // call's header, which every peer compares with its own).
  void inject_drop() { drop_ = true; }
  void inject_corrupt() { corrupt_ = true; }

 private:
  struct Box {
    std::atomic<uint64_t>* done;
    unsigned char* records;  // lockstep record k at records + k * stride
    size_t stride;
    unsigned char* deep;     // deep record k at deep + k * kDeepRecordBytes
    Doorbell* bell;
  };
  // Rank r's record for `call` in the lockstep or the deep ring (it may hold an older call).
  unsigned char* record(int r, uint64_t call, bool deep) const;
  // Rank r's published record of `call`: in the ring our call of that number took (`expect`),
  // else in the other (a mismatched call), else null (not published yet).
  const unsigned char* find(int r, uint64_t call, bool expect) const;
  const unsigned char* find(int r, uint64_t call) const;  // for a call we have made
  void learn_done(const unsigned char* record, int r);    // from rank r's published record
  // Learns rank r's `done` from the records it published beyond our last call; whether there are any.
  bool learn_ahead(int r);
  bool seen();                // arrived() without the spin
  // has_room() for a call of a ring of `depth` records, with `margin` more calls acknowledged by
  // every peer.
  bool room(uint64_t depth, uint64_t margin);
  void refresh();  // done_ and peers_done_ from checked_ and peer_done_
  // Checks peer r's stamps up to `last`, stopping at the first record it has not published.
  void check_published(int r, uint64_t last);
  void check_all_published();
  // Compares peer r's stamp of call t with ours: the error's text, or empty where they agree.
  std::string compare(int r, uint64_t t) const;
  void acknowledge();  // publishes `done` on the acknowledgement line, before a sleep
  bool deep_of(uint64_t call) const { return deep_of_[call % kDeepRecords]; }
  void complete_call();  // complete() without throwing what an earlier call's check found
  [[noreturn]] void fail_departed(int peer, const std::string& waiting_for);

  int rank_;
  uint64_t capacity_ = 0;
  std::vector<Box> boxes_;
  ProgressEngine& engine_;
  CommState& state_;
  bool oversubscribed_;
  uint64_t seq_ = 0;           // calls published so far
  Call call_;                  // the call in progress (between publish and complete)
  bool in_call_ = false;
  bool damaged_ = false;       // our record of this call differs from what the caller wrote
  int next_ = 0;               // the lowest peer not yet seen publishing call seq_
  std::vector<uint64_t> checked_;    // per peer: the last call whose stamp this rank has checked
  std::vector<uint64_t> peer_done_;  // per peer: its `done` as last read
  std::vector<uint64_t> ahead_;      // per peer: the newest call of its records learn_ahead() has read
  uint64_t acked_ = 0;               // our `done` as last published
  uint64_t done_ = 0;                // our `done`: the lowest of checked_
  uint64_t peers_done_ = 0;          // the lowest of peer_done_
  std::array<std::array<unsigned char, kStampBytes>, kDeepRecords> stamps_{};  // ours, by call mod kDeepRecords
  std::array<bool, kDeepRecords> deep_of_{};  // the ring each of our calls took, by call mod kDeepRecords
  bool opened_deep_ = false;                  // the ring of the call open() prepared
  size_t deep_lines_ = 0;                     // cache lines our last deep record took
  std::string deferred_;       // a mismatch found outside its call, thrown by complete()
  bool drop_ = false, corrupt_ = false;
};

}  // namespace tutti
