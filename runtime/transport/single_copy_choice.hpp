#pragma once
// Whether a shared-memory message of 16 KiB or more between two processes goes through the FIFO or
// by single copy (process_vm_readv), chosen per message from the rates measured on the connection.
//
// Why measured and not a constant: which one is faster is not a property of the machine but of
// where its cores sit at the moment. On our 2-core VM the hypervisor moves the two vCPUs between
// neighbouring hardware threads (a cache line crosses in 50 ns), cores of one cache (100 ns) and
// distant cores (500 ns), from one minute to the next. Near, the FIFO's two copies run on two cores
// at once and stream about twice as fast as process_vm_readv; far, every slot the sender rewrites
// must first be taken back from the receiver's cache, and the FIFO sends at a quarter of single
// copy's rate (a 16 MiB all-gather took 6.4 ms instead of 1.5). Open MPI, which always uses single
// copy for such sizes, did not notice. A calibration taken in one placement chose the wrong one
// in the other.
//
// What is measured (nanoseconds per MiB, each the median of its last three samples): the sender's
// copy into full FIFO slots, the receiver's copy out of them (plain copies, not reductions), and the
// receiver's single-copy reads. Each side publishes its own in the control block of the FIFO it
// sends or receives on, so both ends of a connection see all six figures. Messages under one slot
// (below) have six figures per class of sizes, measured on whole messages of that class.
//
// Both directions choose alike. In an exchange (every rank of a ring or an all-gather sends and
// receives at once) one direction by FIFO and the other by single copy is slower than either: one
// core makes two copies per byte (its send into the FIFO and its single-copy read) while the other
// makes one, and a 16 MiB all-gather took 2.3-3.6 ms mixed against 1.3-1.7 FIFO both ways and
// 1.8-2.2 single copy both ways. So each sender weighs the same sums: the FIFO's send and receive
// costs of both directions against both single-copy reads, and, with the same figures on both
// sides, both make the same choice. A direction with nothing
// measured yet (traffic one way only) leaves the other to decide alone.
//
// The loser is measured in bursts of kBurst messages (kSubSlotBurst under one slot): single copy
// first once the FIFO is measured, then every kProbeCma eligible messages while the FIFO wins, the
// FIFO every kProbeFifo while single copy wins, so that a move of the cores is noticed. A burst, not one message: single copy's
// first reads after a stretch of FIFO traffic run slower than later ones (200-280 us per MiB, falling
// to about 90 over a few dozen MiB in a run of single copies only; the cause was not pinned down),
// and a lone probe's figure kept a connection on the FIFO where single copy was the faster; the
// median of a burst's last three reads comes closer to the rate single copy would keep. Both sides
// count their own messages, so in an exchange their bursts coincide.
//
// Messages under one slot are chosen for too, from 16 KiB up, in classes of their own: powers of
// two (16-32 KiB, 32-64 KiB, ...), each with its own six figures and its own choice. Far apart, a
// 2-process broadcast of 16-64 KiB through the FIFO took twice Open MPI's single copy (7-17 us
// against 4-7), and near, the FIFO was the faster; but a rate measured on full slots does not hold
// for them, because a single-copy read's system call (about a microsecond) weighs more the smaller
// the message. Below 16 KiB that call costs more than the FIFO's copies: always the FIFO.
// Two limits, as for full slots but weighing more here: a single-copy send completes only when the
// receiver has read it, a wait the measured rates leave out (the FIFO's sends complete eagerly, hence
// the 10 % margin); and an exchange whose two directions' sizes fall in different classes (chunks of
// 32767 and 32768 bytes) sees nothing measured for the other direction, so each end decides alone.
// Messages of at least the fixed threshold (TUTTI_SHM_CMA_THRESHOLD, the calibration's) always use
// single copy; with adaptation off (TUTTI_SHM_CMA_ADAPTIVE=0, or the threshold set by the user)
// only the threshold decides.

#include <algorithm>
#include <bit>
#include <cstdint>

namespace tutti {

// The classes of messages the choice is made for apart (above): class 0 for messages of a FIFO
// slot or more, classes 1.. for powers of two from kSmallestChosen up to the slot (slots larger than
// the last class's range share it), -1 for smaller messages, which always take the FIFO.
inline constexpr uint64_t kSmallestChosen = 16 << 10;
inline constexpr int kCostClasses = 7;
inline int cost_class(uint64_t bytes, uint64_t slot_size) {
  if (bytes >= slot_size) return 0;
  if (bytes < kSmallestChosen) return -1;
  const int above = std::bit_width(bytes / kSmallestChosen);  // 1 for 16-32 KiB, 2 for 32-64 KiB, ...
  return std::min(above, kCostClasses - 1);
}
// The class whose rate a copy through the FIFO measures: full slots (class 0), or a message under
// one slot, which takes a single slot (the class of its size); -1 for the rest (the last fragment
// of a large message, small messages).
inline int measured_class(uint64_t fragment_bytes, uint64_t message_bytes, uint64_t slot_size) {
  if (fragment_bytes == slot_size) return 0;
  return message_bytes < slot_size ? cost_class(message_bytes, slot_size) : -1;
}

// A cost per MiB: the median of the last three samples (0: nothing measured yet), so one copy that
// the scheduler interrupted (a sample 100 times too slow) does not swing the choice, while a lasting
// change passes after two.
class RateAverage {
 public:
  void add(uint64_t bytes, double ns) {
    if (bytes == 0) return;
    const double x = ns * static_cast<double>(1u << 20) / static_cast<double>(bytes);
    last_[seen_++ % 3] = x;
    const double a = last_[0], b = last_[1], c = last_[2];
    value_ = seen_ < 3 ? x : std::max(std::min(a, b), std::min(std::max(a, b), c));
  }
  double ns_per_mib() const { return value_; }

 private:
  double value_ = 0;
  double last_[3] = {0, 0, 0};
  uint64_t seen_ = 0;
};

// What both ends of a connection have measured, ns per MiB, 0 where unknown. `out`: this side's
// sends (its copy into the FIFO, the peer's copy out, the peer's single-copy reads); `in`: the
// peer's sends to this side, the same three.
struct PairCosts {
  double send_out = 0, recv_out = 0, cma_out = 0;
  double send_in = 0, recv_in = 0, cma_in = 0;
};

class SingleCopyChoice {
 public:
  static constexpr uint64_t kProbeCma = 256;    // while the FIFO wins: a burst by single copy every this many
  static constexpr uint64_t kProbeFifo = 256;   // while single copy wins: a burst through the FIFO every this many
  static constexpr uint64_t kFirstProbe = 8;    // single copy's first burst, once the FIFO is measured
  static constexpr int kBurst = 6;              // messages of a burst
  // Messages under one slot: a burst of 3 (a median's worth). In a near placement their single
  // copies cost 4-7 times the FIFO's (16 KiB: 230 against 60 us per MiB), and 6 of them made a
  // 25-call 2-process all-gather of 32 KiB 40 % slower; the first read of a burst is the slow one.
  static constexpr int kSubSlotBurst = 3;

  // min_bytes: the smallest message the choice applies to (a FIFO slot for class 0,
  // kSmallestChosen for the classes under a slot); threshold: from this size
  // on always single copy; adaptive: whether the measured rates decide below the threshold.
  // burst: messages of a burst (kBurst, or kSubSlotBurst for a class under one slot).
  SingleCopyChoice(uint64_t min_bytes, uint64_t threshold, bool adaptive, int burst = kBurst)
      : min_bytes_(min_bytes), threshold_(threshold), adaptive_(adaptive), burst_(burst) {}

  void set_threshold(uint64_t bytes) { threshold_ = bytes; }
  void set_adaptive(bool on) { adaptive_ = on; }
  bool adaptive() const { return adaptive_; }

  // The decision for one message of `bytes`.
  bool single_copy(uint64_t bytes, const PairCosts& c) {
    if (bytes >= threshold_) return true;
    if (!adaptive_ || bytes < min_bytes_) return false;
    ++eligible_;
    if (c.send_out == 0 || c.recv_out == 0) return false;  // the FIFO not measured yet: measure it first
    if (burst_left_ > 0) {
      --burst_left_;
      return burst_cma_;
    }
    // Single copy unmeasured: its first burst, then (a receiver that does not measure it) as a loser.
    const bool prefer = c.cma_out > 0 && prefers_single_copy(c);
    const bool probe = c.cma_out == 0 && !tried_ ? eligible_ >= kFirstProbe
                                                  : eligible_ % (prefer ? kProbeFifo : kProbeCma) == 0;
    if (!probe) return prefer;
    tried_ = true;
    burst_cma_ = !prefer;
    burst_left_ = burst_ - 1;
    return burst_cma_;
  }
  // Single copy must win by 10 %: near-ties stay with the FIFO, whose sends complete eagerly.
  static bool prefers_single_copy(const PairCosts& c) {
    const bool both = c.send_in > 0 && c.recv_in > 0 && c.cma_in > 0;
    const double fifo = c.send_out + c.recv_out + (both ? c.send_in + c.recv_in : 0);
    const double single = c.cma_out + (both ? c.cma_in : 0);
    return single < 0.9 * fifo;
  }
  // The sender's copy of `bytes` into a FIFO slot took `ns`.
  void sent(uint64_t bytes, double ns) { sent_.add(bytes, ns); }
  double send_ns_per_mib() const { return sent_.ns_per_mib(); }

 private:
  uint64_t min_bytes_, threshold_;
  bool adaptive_;
  int burst_;
  uint64_t eligible_ = 0;  // messages the measured choice applied to
  int burst_left_ = 0;     // messages left in the current burst
  bool burst_cma_ = false;
  bool tried_ = false;     // single copy's first burst is done
  RateAverage sent_;
};

}  // namespace tutti
