#include "runtime/comm_state.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>

#include "core/log.hpp"

namespace tutti {

CommState::CommState(int rank, int nranks)
    : rank_(rank),
      nranks_(nranks),
      departed_(std::make_unique<std::atomic<bool>[]>(static_cast<size_t>(std::max(nranks, 1)))),
      event_fd_(TUTTI_SYSCALL(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC), "eventfd()")) {}

void CommState::set_departed(int peer) {
  departed_[static_cast<size_t>(peer)].store(true, std::memory_order_release);
  wake_all();
}

void CommState::fail(ErrorKind kind, const std::string& message, bool tell_peers) {
  {
    std::lock_guard lock(mutex_);
    if (failed_.load()) return;
    kind_ = kind;
    message_ = message;
    failed_.store(true, std::memory_order_release);
    for (auto [word, value] : stop_words_) std::atomic_ref<int32_t>(*word).store(value, std::memory_order_release);
  }
  TUTTI_WARN("rank {}: {}", rank_, message);
  wake_all();
  if (!tell_peers || aborted()) return;  // an abort tells the peers itself
  std::lock_guard lock(tell_mutex_);
  if (tell_peers_) tell_peers_(message);
}

void CommState::add_stop_word(int32_t* word, int32_t failed_value) {
  std::lock_guard lock(mutex_);
  stop_words_.emplace_back(word, failed_value);
  if (failed_.load()) std::atomic_ref<int32_t>(*word).store(failed_value, std::memory_order_release);
}

void CommState::remove_stop_word(int32_t* word) {
  std::lock_guard lock(mutex_);
  std::erase_if(stop_words_, [&](const auto& w) { return w.first == word; });
}

void CommState::set_hooks(std::function<void(const std::string&)> tell_peers, std::function<std::string()> diagnose) {
  std::scoped_lock lock(tell_mutex_, diagnose_mutex_);
  tell_peers_ = std::move(tell_peers);
  diagnose_ = std::move(diagnose);
}

CommState::Activity CommState::activity() const {
  const uint64_t seq = call_seq_.load(std::memory_order_acquire);
  const uint64_t stamp = call_stamp_.load(std::memory_order_acquire);
  // Moved on while read: report no call, which no peer takes for a divergence.
  if (call_seq_.load(std::memory_order_acquire) != seq) return {seq, 0};
  return {seq, stamp};
}

void CommState::set_probe(std::function<std::string()> probe, double first_after_s) {
  std::lock_guard lock(probe_mutex_);
  probe_ = std::move(probe);
  probe_after_s_ = probe_ ? first_after_s : 0;
}

void CommState::check_diverged() {
  std::string message;
  {
    std::lock_guard lock(probe_mutex_);
    if (probe_) message = probe_();
  }
  if (message.empty()) return;
  fail(ErrorKind::kInvalidUsage, message);
  throw InvalidUsage(message);
}

std::string CommState::diagnose() {
  std::lock_guard lock(diagnose_mutex_);
  return diagnose_ ? diagnose_() : std::string();
}

void CommState::abort() {
  aborted_.store(true);
  wake_all();
}

void CommState::revoke() {
  revoked_.store(true);
  wake_all();
}

void CommState::check_data(const std::string& doing) const {
  check(doing);
  if (revoked_.load(std::memory_order_relaxed))
    throw Aborted(fmt::format("rank {}: communicator revoked while {}", rank_, doing));
}

void CommState::check(const std::string& doing) const {
  if (aborted_.load(std::memory_order_relaxed))
    throw Aborted(fmt::format("rank {}: communicator aborted while {}", rank_, doing));
  if (failed_.load(std::memory_order_acquire)) {
    std::string msg;
    ErrorKind kind;
    {
      std::lock_guard lock(mutex_);
      msg = message_;
      kind = kind_;
    }
    rethrow_with_context(Error(kind, msg), fmt::format("rank {}: {}", rank_, doing));
  }
}

std::string CommState::error_message() const {
  std::lock_guard lock(mutex_);
  return message_;
}

void CommState::wake_all() {
  if (doorbell_) ring(*doorbell_);
  uint64_t one = 1;
  [[maybe_unused]] ssize_t k = ::write(event_fd_.get(), &one, sizeof(one));
  std::lock_guard lock(mutex_);
  cv_.notify_all();
}

void CommState::drain_event_fd() {
  uint64_t v;
  [[maybe_unused]] ssize_t k = ::read(event_fd_.get(), &v, sizeof(v));
}

}  // namespace tutti
