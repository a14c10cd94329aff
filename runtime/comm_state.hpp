#pragma once
// State every part of one rank's communicator shares: the abort flag, the first error (a peer died,
// a wait timed out), and how to wake every waiter of this rank so it notices either promptly.

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

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
  Fd event_fd_;
};

}  // namespace tutti
