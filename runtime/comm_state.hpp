#pragma once
// State every part of one rank's communicator shares: the abort flag, the first error (a peer died,
// a wait timed out), and how to wake every waiter of this rank so it notices either promptly.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "runtime/doorbell.hpp"
#include "runtime/socket.hpp"

namespace tutti {

class CommState {
 public:
  CommState(int rank, int nranks);
  int rank() const { return rank_; }
  int nranks() const { return nranks_; }

  // Records the first failure; later ones are ignored. Wakes every waiter, and tells every peer
  // (the tell_peers hook) unless told not to (a failure a peer told us about): a rank that
  // fails alone (a timeout, a corrupt message, a mismatched call) must not leave its peers waiting.
  void fail(ErrorKind kind, const std::string& message, bool tell_peers = true);
  // Hooks the communicator installs once its bootstrap works, and clears before the bootstrap goes:
  // tell_peers(message) sends the failure to every peer; diagnose() says, for a timeout's message,
  // which peers answer a liveness check (a stopped or hung process does not).
  void set_hooks(std::function<void(const std::string&)> tell_peers, std::function<std::string()> diagnose);
  void clear_hooks() { set_hooks(nullptr, nullptr); }
  std::string diagnose();

  // The collective call this rank is in: its call stamp (runtime/call_stamp.hpp; 0 while in none, or
  // in a call that is not collective) and how many collective calls the rank has begun. Two ranks at
  // the same call number in different calls have diverged (a split on one, an all-reduce on the
  // other; two ranks that each take themselves for a reduce's root) and would wait for each other
  // until TUTTI_TIMEOUT: a wait that has made no progress for a while asks the peers (the probe
  // hook) and fails at once naming both calls. Nested begin/end pairs count once.
  struct Activity {
    uint64_t seq = 0;
    uint64_t stamp = 0;
  };
  void begin_call(uint64_t stamp) {
    if (call_depth_++ > 0) return;
    // Only this thread writes them: plain stores, no locked read-modify-write on every call. A
    // reader that sees the new number sees 0 or the new stamp, never the last call's.
    call_stamp_.store(0, std::memory_order_release);
    call_seq_.store(call_seq_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    call_stamp_.store(stamp, std::memory_order_release);
  }
  void end_call() {
    if (--call_depth_ == 0) call_stamp_.store(0, std::memory_order_release);
  }
  Activity activity() const;
  // The probe: the message naming a peer at this rank's call number in another call, or empty.
  // Installed by the communicator; `first_after_s` of waiting before the first probe (0: never).
  void set_probe(std::function<std::string()> probe, double first_after_s);
  void clear_probe() { set_probe(nullptr, 0); }
  double probe_after_s() const { return probe_after_s_.load(std::memory_order_relaxed); }
  // Runs the probe; on divergence fails the communicator (the peers are told) and throws InvalidUsage.
  void check_diverged();

  void abort();
  bool aborted() const { return aborted_.load(std::memory_order_relaxed); }
  // Revoke (ncclCommRevoke): every data-plane wait (connections, mailbox, executors) gives up with
  // Aborted, while the bootstrap keeps working, so the ranks can still split or shrink the
  // communicator and destroy it. Wakes every waiter.
  void revoke();
  bool revoked() const { return revoked_.load(std::memory_order_relaxed); }
  // A data-plane wait's check: revoked, aborted or failed. Throws like check().
  bool interrupted() const { return aborted() || failed() || revoked(); }
  void check_data(const std::string& doing) const;
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // Throws Aborted or the recorded error, prefixed with what the caller was doing.
  void check(const std::string& doing) const;
  // The recorded error (empty if none).
  std::string error_message() const;
  const std::atomic<bool>* abort_flag() const { return &aborted_; }

  // A peer that left in order (destroyed its communicator: the bootstrap's goodbye). Waits that
  // need that peer fail at once instead of at TUTTI_TIMEOUT.
  void set_departed(int peer);
  bool departed(int peer) const { return departed_[static_cast<size_t>(peer)].load(std::memory_order_acquire); }

  // Words a device polls in its waits (a device executor's host-mapped stop word, abi.hpp): each is
  // set to `failed_value` when the communicator fails, so a kernel waiting for a peer that has
  // failed stops as host waits do, instead of at TUTTI_TIMEOUT. A word added after the failure is
  // set at once; remove a word before freeing it.
  void add_stop_word(int32_t* word, int32_t failed_value);
  void remove_stop_word(int32_t* word);

  // Wakes futex sleepers (doorbell), poll() sleepers (event fd) and condition-variable sleepers.
  void wake_all();
  void set_doorbell(Doorbell* bell) { doorbell_ = bell; }
  Doorbell* doorbell() const { return doorbell_; }
  int event_fd() const { return event_fd_.get(); }
  void drain_event_fd();

  // For bootstrap's inbox waiters.
  std::mutex& mutex() { return mutex_; }
  std::condition_variable& cv() { return cv_; }

 private:
  int rank_, nranks_;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> revoked_{false};
  std::atomic<bool> failed_{false};
  ErrorKind kind_ = ErrorKind::kInternal;
  std::string message_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  Doorbell* doorbell_ = nullptr;
  std::unique_ptr<std::atomic<bool>[]> departed_;
  // Each held while its hook runs, so clear_hooks() waits for it. Two: the service thread may tell
  // the peers of a failure while a worker's diagnosis waits for that thread to hear their answers.
  std::mutex tell_mutex_, diagnose_mutex_;
  std::function<void(const std::string&)> tell_peers_;
  std::function<std::string()> diagnose_;
  std::mutex probe_mutex_;
  std::function<std::string()> probe_;
  std::atomic<double> probe_after_s_{0};
  std::atomic<uint64_t> call_seq_{0}, call_stamp_{0};
  std::vector<std::pair<int32_t*, int32_t>> stop_words_;  // guarded by mutex_
  int call_depth_ = 0;  // only the thread that drives the communicator begins and ends calls
  Fd event_fd_;
};

// A collective call of this rank for the divergence probe: begin_call on construction, end_call on
// destruction, however the call ends.
class CallActivity {
 public:
  CallActivity(CommState& state, uint64_t stamp) : state_(state) { state_.begin_call(stamp); }
  ~CallActivity() { state_.end_call(); }
  CallActivity(const CallActivity&) = delete;
  CallActivity& operator=(const CallActivity&) = delete;

 private:
  CommState& state_;
};

// Asks the peers whether the ranks have diverged once a wait has made no progress for the state's
// probe_after_s, then again at doubling intervals (2, 4, 8 ... s: a job of many ranks that wait
// long does not flood the bootstrap). tick(false) from a wait's idle rounds, tick(true) when
// something moved. Throws what CommState::check_diverged throws.
class DivergenceProbe {
 public:
  explicit DivergenceProbe(CommState& state) : state_(state), first_(state.probe_after_s()), interval_(first_) {}
  void tick(bool moved) {
    if (first_ <= 0) return;
    if (moved) {  // the idle time starts again at the next idle round
      interval_ = first_;
      due_ = {};
      return;
    }
    const auto now = std::chrono::steady_clock::now();
    if (due_ == std::chrono::steady_clock::time_point{}) {
      due_ = now + seconds(interval_);
      return;
    }
    if (now < due_) return;
    state_.check_diverged();
    interval_ *= 2;
    due_ = now + seconds(interval_);
  }

 private:
  static std::chrono::steady_clock::duration seconds(double s) {
    return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
  }
  CommState& state_;
  double first_, interval_;
  std::chrono::steady_clock::time_point due_{};
};

}  // namespace tutti
