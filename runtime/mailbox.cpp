#include "runtime/mailbox.hpp"

#include <sched.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <utility>

#include "core/error.hpp"

namespace tutti {
namespace {

constexpr size_t kLine = 64;
constexpr size_t kWord = sizeof(uint64_t);
constexpr size_t kRecordHead = 2 * kWord;  // the sequence word, then the writer's `done`
constexpr size_t kHead = 2 * kLine;  // the doorbell, then the acknowledgement line
static_assert(sizeof(Doorbell) == kLine, "the acknowledgement line follows the doorbell");
constexpr uint64_t K = Mailbox::kRecords;
constexpr uint64_t KD = Mailbox::kDeepRecords;
constexpr size_t kDeepBytes = Mailbox::kDeepRecordBytes;
static_assert(kDeepBytes % kLine == 0 && Mailbox::kDeepDataBytes + kRecordHead + Mailbox::kStampBytes == kDeepBytes);
static_assert(K <= KD, "our stamps and ring choices are kept for kDeepRecords calls");
constexpr size_t kDeepRingBytes = KD * kDeepBytes;
constexpr uint64_t kPrefaultBytes = 16 << 10;  // of each record: the default one-shot sizes, and more

size_t record_bytes(uint64_t capacity) { return (kRecordHead + capacity + kLine - 1) / kLine * kLine; }

}  // namespace

// The deep ring first: its records' offsets do not depend on the capacity.
size_t Mailbox::segment_bytes(uint64_t capacity) { return kHead + kDeepRingBytes + K * record_bytes(capacity); }

uint64_t Mailbox::capacity_of(size_t bytes) {
  if (bytes < kHead + kDeepRingBytes + K * kLine) return 0;
  return (bytes - kHead - kDeepRingBytes) / K / kLine * kLine - kRecordHead;
}

void Mailbox::init(void* segment, uint64_t capacity) {
  auto* base = static_cast<unsigned char*>(segment);
  new (base + kLine) std::atomic<uint64_t>(0);
  // The pages calls use, allocated now: otherwise the first calls of each size fault in a page per
  // record (each ring turn on fresh pages: a 20-iteration benchmark of 4 KiB calls paid a fault at
  // nearly every call).
  std::memset(base + kHead, 0, kDeepRingBytes);
  for (uint64_t k = 0; k < KD; ++k) {
    unsigned char* rec = base + kHead + k * kDeepBytes;
    new (rec) std::atomic<uint64_t>(0);
    new (rec + kWord) std::atomic<uint64_t>(0);
  }
  for (uint64_t k = 0; k < K; ++k) {
    unsigned char* rec = base + kHead + kDeepRingBytes + k * record_bytes(capacity);
    new (rec) std::atomic<uint64_t>(0);
    new (rec + kWord) std::atomic<uint64_t>(0);
    std::memset(rec + kRecordHead, 0, std::min<uint64_t>(capacity, kPrefaultBytes));
  }
}

Mailbox::Mailbox(int rank, std::vector<Segment> segments, ProgressEngine& engine, CommState& state, bool oversubscribed)
    : rank_(rank), engine_(engine), state_(state), oversubscribed_(oversubscribed) {
  capacity_ = UINT64_MAX;
  for (const Segment& s : segments) capacity_ = std::min(capacity_, capacity_of(s.bytes));
  for (const Segment& s : segments) {
    // Each segment's own layout: its capacity decides the records' stride.
    auto* base = static_cast<unsigned char*>(s.base);
    boxes_.push_back({reinterpret_cast<std::atomic<uint64_t>*>(base + kLine), base + kHead + kDeepRingBytes,
                      record_bytes(capacity_of(s.bytes)), base + kHead, reinterpret_cast<Doorbell*>(base)});
  }
  // Map the pages small calls use in every outbox now (a first touch costs a fault each).
  for (const Box& b : boxes_) {
    for (size_t off = 0; off < kDeepRingBytes; off += 4096) (void)*static_cast<volatile unsigned char*>(b.deep + off);
    for (uint64_t k = 0; k < K; ++k)
      for (size_t off = 0; off < kRecordHead + std::min<uint64_t>(capacity_, kPrefaultBytes); off += 4096)
        (void)*static_cast<volatile unsigned char*>(b.records + k * b.stride + off);
  }
  checked_.assign(segments.size(), 0);
  peer_done_.assign(segments.size(), 0);
  ahead_.assign(segments.size(), 0);
}

namespace {
std::atomic<uint64_t>& seq_word(const unsigned char* record) {
  return *reinterpret_cast<std::atomic<uint64_t>*>(const_cast<unsigned char*>(record));
}
std::atomic<uint64_t>& done_word(const unsigned char* record) {
  return *reinterpret_cast<std::atomic<uint64_t>*>(const_cast<unsigned char*>(record) + kWord);
}
const unsigned char* stamp_of(const unsigned char* record) { return record + kRecordHead; }
}  // namespace

unsigned char* Mailbox::record(int r, uint64_t call, bool deep) const {
  const Box& b = boxes_[static_cast<size_t>(r)];
  return deep ? b.deep + (call % KD) * kDeepBytes : b.records + (call % K) * b.stride;
}

const unsigned char* Mailbox::find(int r, uint64_t call, bool expect) const {
  // A record of ring R is rewritten for call t + R only once our `done` has reached t, and we look
  // only at calls past our `done`: one that shows `call` stays that call while we read it.
  const unsigned char* rec = record(r, call, expect);
  if (seq_word(rec).load(std::memory_order_acquire) == call) return rec;
  rec = record(r, call, !expect);
  return seq_word(rec).load(std::memory_order_acquire) == call ? rec : nullptr;
}

const unsigned char* Mailbox::find(int r, uint64_t call) const { return find(r, call, deep_of(call)); }

void Mailbox::learn_done(const unsigned char* rec, int r) {
  uint64_t& d = peer_done_[static_cast<size_t>(r)];
  d = std::max(d, done_word(rec).load(std::memory_order_relaxed));
}

bool Mailbox::learn_ahead(int r) {
  uint64_t& t = ahead_[static_cast<size_t>(r)];
  t = std::max(t, seq_);
  // It has published call t only once our `done` (at most seq_) reached t - kDeepRecords.
  while (t < seq_ + KD)
    if (const unsigned char* rec = find(r, t + 1, false)) {
      learn_done(rec, r);
      ++t;
    } else {
      break;
    }
  return t > seq_;
}

const unsigned char* Mailbox::data(int r) const {
  return record(r, seq_, deep_of(seq_)) + kRecordHead + kStampBytes;
}

void Mailbox::refresh() {
  uint64_t d = UINT64_MAX, p = UINT64_MAX;
  for (int r = 0; r < size(); ++r)
    if (r != rank_) {
      d = std::min(d, checked_[static_cast<size_t>(r)]);
      p = std::min(p, peer_done_[static_cast<size_t>(r)]);
    }
  done_ = d == UINT64_MAX ? seq_ : d;
  peers_done_ = p == UINT64_MAX ? seq_ : p;
}

std::string Mailbox::compare(int r, uint64_t t) const {
  const unsigned char* mine = stamps_[t % KD].data();
  const unsigned char* found = find(r, t);
  if (!found) return {};  // checked only once published
  const unsigned char* theirs = stamp_of(found);
  if (std::memcmp(mine, theirs, kStampBytes) == 0) return {};
  auto text = [&](const unsigned char* s) { return call_.describe ? call_.describe(s) : std::string("a call"); };
  std::string where = t == seq_ && in_call_ ? std::string() : fmt::format(" (one-shot call {}, found at call {})", t, seq_);
  return fmt::format("rank {} calls {} but rank {} calls {}{}: every rank must make the same call (collective, count, "
                     "datatype, op, root)",
                     rank_, text(mine), r, text(theirs), where);
}

void Mailbox::check_published(int r, uint64_t last) {
  uint64_t& c = checked_[static_cast<size_t>(r)];
  while (c < last) {
    const uint64_t t = c + 1;
    // Record t is still there: the peer rewrites it only after our `done` reaches t.
    const unsigned char* rec = find(r, t);
    if (!rec) return;
    learn_done(rec, r);
    if (std::string e = compare(r, t); !e.empty() && deferred_.empty()) deferred_ = std::move(e);
    c = t;
  }
}

void Mailbox::check_all_published() {
  // In a call, the records of this call stay unacknowledged until complete(): they may be read.
  const uint64_t last = in_call_ ? seq_ - 1 : seq_;
  for (int r = 0; r < size(); ++r)
    if (r != rank_) check_published(r, last);
  refresh();
}

void Mailbox::acknowledge() {
  const uint64_t d = done_;
  if (d <= acked_) return;
  boxes_[static_cast<size_t>(rank_)].done->store(d, std::memory_order_release);
  acked_ = d;
  for (int r = 0; r < size(); ++r)
    if (r != rank_) ring(*boxes_[static_cast<size_t>(r)].bell);
}

bool Mailbox::has_room(bool deep) { return room(depth(deep), 0); }

bool Mailbox::room(uint64_t depth, uint64_t margin) {
  const uint64_t s = seq_ + 1;
  if (s <= depth) return true;
  const uint64_t need = s - depth;
  if (done_ >= need && peers_done_ >= need + margin) return true;
  // Our own stamp of call `need` is overwritten too: every peer's must have been checked.
  if (done_ < need) {
    check_all_published();
    if (done_ < need) return false;
  }
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) continue;
    uint64_t& d = peer_done_[static_cast<size_t>(r)];
    if (d >= need + margin) continue;
    // Its records carry its `done`; one that sleeps has published the exact value on its line.
    check_published(r, seq_);
    if (d < need + margin) d = std::max(d, boxes_[static_cast<size_t>(r)].done->load(std::memory_order_acquire));
    if (d >= need + margin) continue;
    // A peer ahead of us (a root, or a reduce's other sender, that ran ahead) moves its `done` on
    // only at its next call, which may never come (its last call is made): its newest records carry
    // the latest, and no margin is asked of it.
    if (learn_ahead(r) && d >= need) continue;
    return false;
  }
  refresh();
  return true;
}

void Mailbox::fail_departed(int peer, const std::string& waiting_for) {
  std::string message = fmt::format("rank {}: {} (one-shot mailbox call {}): rank {} left the communicator "
                                    "(destroyed it) {}",
                                    rank_, call_.what, seq_, peer, waiting_for);
  state_.fail(ErrorKind::kRemote, message);
  throw RemoteError(message);
}

unsigned char* Mailbox::open(const char* what, bool deep) {
  if (state_.interrupted()) state_.check_data(fmt::format("{} (one-shot mailbox)", what));
  const uint64_t depth = Mailbox::depth(deep);
  if (!room(depth, 0)) {
    // Once out of room, wait for a few records more: a root that went on the moment one record
    // freed up would read its receivers' newest records (a miss each) at every call. A receiver's
    // `done` can reach the last call we published, so the margin (under kRecords) always comes.
    constexpr uint64_t kMargin = kCheckBatch;
    static_assert(kMargin < K);
    bool room = false;
    if (!oversubscribed_)
      for (int i = 0; i < 1024 && !room; ++i) {
        cpu_relax();
        room = this->room(depth, kMargin);
      }
    const uint64_t need = seq_ + 1 - depth;
    // The first rank whose acknowledgement (or whose record, for our own) is missing.
    auto blocker = [&] {
      for (int r = 0; r < size(); ++r)
        if (r != rank_ && (checked_[static_cast<size_t>(r)] < need || peer_done_[static_cast<size_t>(r)] < need + kMargin))
          return r;
      return rank_;
    };
    if (!room)
      engine_.wait(
          [&] {
            // Peers may be waiting for our acknowledgement as we wait for theirs.
            check_all_published();
            acknowledge();
            if (this->room(depth, kMargin)) return true;
            if (state_.interrupted()) state_.check_data(fmt::format("{} (one-shot mailbox)", what));
            if (int b = blocker(); b != rank_ && state_.departed(b) && !this->room(depth, kMargin)) {
              call_.what = what;
              fail_departed(b, fmt::format("before reading call {}", need));
            }
            return false;
          },
          [&] {
            return fmt::format("rank {}: {} (one-shot mailbox call {}): waiting for rank {} to read call {} (the "
                               "outboxes hold {} calls of its kind)",
                               rank_, what, seq_ + 1, blocker(), need, depth);
          });
  }
  opened_deep_ = deep;
  return record(rank_, seq_ + 1, deep) + kRecordHead + kStampBytes;
}

void Mailbox::publish(const unsigned char* stamp, const char* what, int reads, int read_by, Describe describe) {
  if (state_.interrupted()) state_.check_data(fmt::format("{} (one-shot mailbox)", what));
  const uint64_t s = ++seq_;
  call_.what = what;
  call_.reads = reads;
  call_.read_by = read_by;
  call_.describe = describe;
  in_call_ = true;
  deep_of_[s % KD] = opened_deep_;
  unsigned char* head = record(rank_, s, opened_deep_);
  unsigned char* rec = head + kRecordHead;
  // From the caller's copy: reading the record back would wait for the line's ownership (a peer
  // read it kRecords calls ago), as a load cannot take its bytes from two smaller pending stores.
  std::memcpy(stamps_[s % KD].data(), stamp, kStampBytes);
  std::memcpy(rec, stamp, kStampBytes);
  done_word(head).store(done_, std::memory_order_relaxed);  // published by the release below
  damaged_ = false;
  if (corrupt_ && capacity_ > 8) rec[8] ^= 1u << 3, corrupt_ = false, damaged_ = true;
  if (!drop_) seq_word(head).store(s, std::memory_order_release);
  // Only the peers that read this record in this call wait for it.
  if (read_by == kEvery) {
    for (int r = 0; r < size(); ++r)
      if (r != rank_) ring(*boxes_[static_cast<size_t>(r)].bell);
  } else if (read_by >= 0 && read_by != rank_) {
    ring(*boxes_[static_cast<size_t>(read_by)].bell);
  }
  next_ = reads >= 0 ? reads : (rank_ == 0 ? 1 : 0);
}

bool Mailbox::seen() {
  const uint64_t s = seq_;
  const bool deep = deep_of(s);
  if (call_.reads == kNobody || call_.reads == rank_) return true;
  if (call_.reads >= 0) return seq_word(record(call_.reads, s, deep)).load(std::memory_order_acquire) == s;
  // Peers still to be seen, lowest first; each is looked at until it arrives.
  const int n = size();
  while (next_ < n) {
    if (seq_word(record(next_, s, deep)).load(std::memory_order_acquire) != s) return false;
    ++next_;
    if (next_ == rank_) ++next_;
  }
  return true;
}

bool Mailbox::arrived() {
  // A short tight spin catches a peer that is a few hundred nanoseconds behind, without the
  // engine's bookkeeping; an oversubscribed rank does not spin (its peer may need this core).
  if (!oversubscribed_)
    for (int i = 0; i < 1024; ++i) {
      if (seen()) return true;
      cpu_relax();
    }
  return seen();
}

void Mailbox::wait() {
  if (!arrived()) {
    // About to sleep: acknowledge exactly what is checked, so no peer waits for us in turn.
    check_all_published();
    acknowledge();
    engine_.wait(
        [&] {
          if (seen()) return true;
          // A peer whose call took the other ring made another call: its stamp says which.
          if (const int r = call_.reads >= 0 ? call_.reads : next_;
              r != rank_ && seq_word(record(r, seq_, !deep_of(seq_))).load(std::memory_order_acquire) == seq_)
            return true;
          // Woken (or on the engine's timer) while a rank ahead of us may wait for our `done`: our
          // checks of what peers published since we slept move it on.
          check_all_published();
          acknowledge();
          // A peer that destroyed its communicator will never publish: fail now, not at the timeout.
          // A failure it told us of first (an abort says so, then goodbye) is the better message.
          if (state_.interrupted()) state_.check_data(fmt::format("{} (one-shot mailbox)", call_.what));
          // (Seen again after the departure: it published before its goodbye, so a publish that
          // raced with the first look is seen now.)
          if (state_.departed(next_) && !seen()) fail_departed(next_, "without making this call");
          return false;
        },
        [&] {
          return fmt::format("rank {}: {} (one-shot mailbox call {}): waiting for rank {} to publish", rank_, call_.what,
                             seq_, next_);
        });
  }
  // Every rank compares every stamp it reads with its own, so all of them fail, naming both calls.
  const uint64_t s = seq_;
  std::string mismatch, damage;
  bool unpublished = false;
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) {
      if (damaged_ && call_.describe)
        damage = fmt::format("rank {}: its own published call header reads {} instead of {}: the outbox was damaged",
                             rank_, call_.describe(stamp_of(record(rank_, s, deep_of(s)))),
                             call_.describe(stamps_[s % KD].data()));
    } else if (call_.reads == kEvery || call_.reads == r) {
      check_published(r, s - 1);  // calls it did not read: published before this one
      const unsigned char* rec = find(r, s);
      if (!rec) {  // not published yet: only after the wait ended for another peer's mismatch
        unpublished = true;
        continue;
      }
      learn_done(rec, r);
      if (mismatch.empty()) mismatch = compare(r, s);
    }
  }
  if (mismatch.empty() && damage.empty()) {
    if (unpublished) throw InternalError(fmt::format("rank {}: {} (one-shot mailbox call {}): a peer's record is missing "
                                                     "after the wait", rank_, call_.what, s));
    return;
  }
  complete_call();
  if (!damage.empty()) throw RemoteError(damage);
  throw InvalidArgument(mismatch);
}

void Mailbox::complete_call() {
  const uint64_t s = seq_;
  if (call_.reads == kEvery) {
    for (int r = 0; r < size(); ++r)
      if (r != rank_) checked_[static_cast<size_t>(r)] = s;
  } else if (call_.reads >= 0 && call_.reads != rank_) {
    checked_[static_cast<size_t>(call_.reads)] = s;
  }
  in_call_ = false;
  refresh();
  if (done_ + kCheckBatch < s) check_all_published();
}

void Mailbox::complete() {
  complete_call();
  if (!deferred_.empty()) throw InvalidArgument(std::exchange(deferred_, std::string()));
}

}  // namespace tutti
