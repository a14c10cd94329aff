#pragma once
// Whether a large shared-memory message between two processes goes through the FIFO or by single
// copy (process_vm_readv), chosen per message from the rates measured on the connection.
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
// What is measured (nanoseconds per MiB, moving averages): the sender's copy into full FIFO slots,
// the receiver's copy out of them (plain copies, not reductions), and the receiver's single-copy
// reads. The receiver publishes its two in the FIFO's control block; the sender decides. Per byte,
// the FIFO costs each core both copies (a core of an exchange sends and receives), single copy one.
// Single copy is first tried three times, a few messages apart, once the FIFO is measured; then the
// current loser is tried now and then so that a move of the cores is noticed: single copy every
// `kProbeCma` eligible messages while the FIFO wins, the FIFO every `kProbeFifo` while single copy
// wins. Messages below one FIFO slot always use the FIFO; messages of at least the fixed threshold
// (TUTTI_SHM_CMA_THRESHOLD, the calibration's) always use single copy; with adaptation off
// (TUTTI_SHM_CMA_ADAPTIVE=0, or the threshold set by the user) only the threshold decides.

#include <algorithm>
#include <cstdint>

namespace tutti {

// A moving average of a cost per MiB; 0 means nothing measured yet. It averages the median of the
// last three samples, so one copy that the scheduler interrupted (a sample 100 times too slow) does
// not swing the choice, while a lasting change passes after two.
class RateAverage {
 public:
  void add(uint64_t bytes, double ns) {
    if (bytes == 0) return;
    const double x = ns * static_cast<double>(1u << 20) / static_cast<double>(bytes);
    last_[seen_++ % 3] = x;
    const double a = last_[0], b = last_[1], c = last_[2];
    const double mid = seen_ < 3 ? x : std::max(std::min(a, b), std::min(std::max(a, b), c));
    value_ = value_ == 0 ? mid : value_ + (mid - value_) / 4;
  }
  double ns_per_mib() const { return value_; }

 private:
  double value_ = 0;
  double last_[3] = {0, 0, 0};
  uint64_t seen_ = 0;
};

class SingleCopyChoice {
 public:
  static constexpr uint64_t kProbeCma = 256;  // while the FIFO wins: one message in this many by single copy
  static constexpr uint64_t kProbeFifo = 64;  // while single copy wins: one in this many through the FIFO
  static constexpr uint64_t kFirstProbe = 8;  // single copy's first tries: every this many messages, three times
  static constexpr int kFirstProbes = 3;

  // min_bytes: the smallest message the choice applies to (a FIFO slot); threshold: from this size
  // on always single copy; adaptive: whether the measured rates decide below the threshold.
  SingleCopyChoice(uint64_t min_bytes, uint64_t threshold, bool adaptive)
      : min_bytes_(min_bytes), threshold_(threshold), adaptive_(adaptive) {}

  void set_threshold(uint64_t bytes) { threshold_ = bytes; }
  void set_adaptive(bool on) { adaptive_ = on; }
  bool adaptive() const { return adaptive_; }

  // The decision for one message of `bytes`, given the receiver's published costs (0: unknown).
  bool single_copy(uint64_t bytes, double recv_ns_per_mib, double cma_ns_per_mib) {
    if (bytes >= threshold_) return true;
    if (!adaptive_ || bytes < min_bytes_) return false;
    ++eligible_;
    const double send = sent_.ns_per_mib();
    if (send == 0 || recv_ns_per_mib == 0) return false;  // the FIFO not measured yet: measure it first
    // Then single copy three times, a few messages apart, so its average starts from a median: a
    // first read into pages never touched pays their faults and looks several times slower.
    if (first_probes_ < kFirstProbes && eligible_ >= kFirstProbe * static_cast<uint64_t>(first_probes_ + 1)) {
      ++first_probes_;
      return true;
    }
    if (cma_ns_per_mib == 0) return eligible_ % kProbeCma == 0;  // the receiver does not measure it
    // Single copy must win by 10 %: near-ties stay with the FIFO, whose sends complete eagerly.
    const bool prefer = cma_ns_per_mib < 0.9 * (send + recv_ns_per_mib);
    return prefer ? eligible_ % kProbeFifo != 0 : eligible_ % kProbeCma == 0;
  }
  // The sender's copy of `bytes` into a FIFO slot took `ns`.
  void sent(uint64_t bytes, double ns) { sent_.add(bytes, ns); }
  double send_ns_per_mib() const { return sent_.ns_per_mib(); }

 private:
  uint64_t min_bytes_, threshold_;
  bool adaptive_;
  uint64_t eligible_ = 0;  // messages the measured choice applied to
  int first_probes_ = 0;
  RateAverage sent_;
};

}  // namespace tutti
