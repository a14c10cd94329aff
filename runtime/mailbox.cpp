#include "runtime/mailbox.hpp"

#include <sched.h>

#include <algorithm>
#include <new>

#include "core/error.hpp"

namespace tutti {
namespace {

constexpr size_t kLine = 64;
constexpr size_t kWord = sizeof(uint64_t);
static_assert(sizeof(Doorbell) == kLine, "the outbox starts on the line after the doorbell");

size_t record_bytes(uint64_t capacity) { return (kWord + capacity + kLine - 1) / kLine * kLine; }

}  // namespace

size_t Mailbox::segment_bytes(uint64_t capacity) { return sizeof(Doorbell) + 2 * record_bytes(capacity); }

uint64_t Mailbox::capacity_of(size_t bytes) {
  if (bytes < sizeof(Doorbell) + 2 * kLine) return 0;
  return (bytes - sizeof(Doorbell)) / 2 - kWord;
}

void Mailbox::init(void* segment, uint64_t capacity) {
  auto* base = static_cast<unsigned char*>(segment) + sizeof(Doorbell);
  for (int p = 0; p < 2; ++p) new (base + p * record_bytes(capacity)) std::atomic<uint64_t>(0);
}

Mailbox::Mailbox(int rank, std::vector<Segment> segments, ProgressEngine& engine, CommState& state, bool oversubscribed)
    : rank_(rank), engine_(engine), state_(state), oversubscribed_(oversubscribed) {
  capacity_ = UINT64_MAX;
  for (const Segment& s : segments) capacity_ = std::min(capacity_, capacity_of(s.bytes));
  for (const Segment& s : segments) {
    // Each segment's own layout: its capacity decides where parity 1 starts.
    const size_t record = record_bytes(capacity_of(s.bytes));
    auto* base = static_cast<unsigned char*>(s.base);
    Box b;
    b.bell = reinterpret_cast<Doorbell*>(base);
    for (int p = 0; p < 2; ++p) {
      unsigned char* rec = base + sizeof(Doorbell) + p * record;
      b.word[p] = reinterpret_cast<std::atomic<uint64_t>*>(rec);
      b.data[p] = rec + kWord;
    }
    boxes_.push_back(b);
  }
}

unsigned char* Mailbox::outbox() { return boxes_[rank_].data[(seq_ + 1) & 1]; }

const unsigned char* Mailbox::data(int r) const { return boxes_[r].data[seq_ & 1]; }

void Mailbox::publish(const char* what) {
  if (state_.interrupted()) state_.check_data(fmt::format("{} (one-shot mailbox)", what));
  const uint64_t s = ++seq_;
  if (corrupt_ && capacity_ > 8) boxes_[rank_].data[s & 1][8] ^= 1u << 3, corrupt_ = false;
  if (!drop_) boxes_[rank_].word[s & 1]->store(s, std::memory_order_release);
  for (int r = 0; r < size(); ++r)
    if (r != rank_) ring(*boxes_[r].bell);
  next_ = rank_ == 0 ? 1 : 0;
}

bool Mailbox::seen() {
  // Peers still to be seen, lowest first; each is looked at until it arrives.
  const int parity = static_cast<int>(seq_ & 1), n = size();
  while (next_ < n) {
    if (boxes_[next_].word[parity]->load(std::memory_order_acquire) != seq_) return false;
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

void Mailbox::wait(const char* what) {
  if (arrived()) return;
  engine_.wait(
      [&] {
        if (seen()) return true;
        // A peer that destroyed its communicator will never publish: fail now, not at the timeout.
        // A failure it told us of first (an abort says so, then goodbye) is the better message.
        if (state_.interrupted()) state_.check_data(fmt::format("{} (one-shot mailbox)", what));
        // (Seen again after the departure: it published before its goodbye, so a publish that
        // raced with the first look is seen now.)
        if (state_.departed(next_) && !seen()) {
          std::string message = fmt::format("rank {}: {} (one-shot mailbox call {}): rank {} left the communicator "
                                            "(destroyed it) without making this call",
                                            rank_, what, seq_, next_);
          state_.fail(ErrorKind::kRemote, message);
          throw RemoteError(message);
        }
        return false;
      },
      [&] {
    return fmt::format("rank {}: {} (one-shot mailbox call {}): waiting for rank {} to publish", rank_, what, seq_,
                       next_);
  });
}

void Mailbox::exchange(const char* what) {
  publish(what);
  wait(what);
}

}  // namespace tutti
