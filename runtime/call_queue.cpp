#include "runtime/call_queue.hpp"

#include <chrono>

namespace tutti {

CallQueue::CallQueue(int spin_us) : spin_us_(spin_us) { thread_ = std::thread([this] { loop(); }); }

CallQueue::~CallQueue() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

uint64_t CallQueue::post(Job job) {
  uint64_t ticket;
  {
    std::lock_guard lock(mu_);
    jobs_.push_back(std::move(job));
    ticket = ++posted_;
  }
  posted_hint_.store(ticket, std::memory_order_release);
  wake_.notify_one();
  return ticket;
}

bool CallQueue::done(uint64_t ticket) {
  std::lock_guard lock(mu_);
  return finished_ >= ticket;
}

void CallQueue::wait(uint64_t ticket) {
  std::unique_lock lock(mu_);
  finished_cv_.wait(lock, [&] { return finished_ >= ticket; });
  auto it = errors_.find(ticket);
  if (it != errors_.end()) std::rethrow_exception(it->second);
}

void CallQueue::drain() {
  std::unique_lock lock(mu_);
  finished_cv_.wait(lock, [&] { return finished_ == posted_; });
}

bool CallQueue::idle() {
  std::lock_guard lock(mu_);
  return finished_ == posted_;
}

std::exception_ptr CallQueue::error(uint64_t ticket) {
  std::lock_guard lock(mu_);
  auto it = errors_.find(ticket);
  return it == errors_.end() ? nullptr : it->second;
}

std::exception_ptr CallQueue::first_error() {
  std::lock_guard lock(mu_);
  return first_error_;
}

void CallQueue::loop() {
  uint64_t taken = 0;
  for (;;) {
    // Awake for a while after the last job (the hint is polled without the lock; the job itself
    // is taken under it).
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
    while (posted_hint_.load(std::memory_order_acquire) == taken && std::chrono::steady_clock::now() < until)
      std::this_thread::yield();
    Job job;
    {
      std::unique_lock lock(mu_);
      wake_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, nothing left
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    ++taken;
    std::exception_ptr failure;
    try {
      job();
    } catch (...) {
      failure = std::current_exception();
    }
    {
      std::lock_guard lock(mu_);
      ++finished_;
      if (failure) {
        errors_[finished_] = failure;
        if (!first_error_) first_error_ = failure;
      }
    }
    finished_cv_.notify_all();
  }
}

}  // namespace tutti
