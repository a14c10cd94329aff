#pragma once
// Calls that run in order on one thread of their own, so the caller does not wait for them: the
// NCCL layer's non-blocking communicators and the C++ API's asynchronous handles use it.
//
// The thread is started with the queue and polls for new work for `spin_us` after each call (the
// next call of a loop is usually microseconds away), then sleeps on a condition variable.
// Ordering: jobs run one at a time in post order; a job's effects are visible to a thread that saw
// done(ticket) or returned from wait(ticket) (both synchronise on the queue's mutex).

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

namespace tutti {

class CallQueue {
 public:
  using Job = std::function<void()>;  // reports failure by throwing
  explicit CallQueue(int spin_us);
  ~CallQueue();  // runs what was posted, then stops
  CallQueue(const CallQueue&) = delete;
  CallQueue& operator=(const CallQueue&) = delete;

  // Queues a job; returns its ticket (1, 2, ... in post order).
  uint64_t post(Job job);
  bool done(uint64_t ticket);
  // Waits for the job; rethrows what it threw.
  void wait(uint64_t ticket);
  void drain();  // waits for every posted job (does not throw)
  bool idle();
  // What job `ticket` threw (null if it succeeded or has not run), and the first failure of all.
  std::exception_ptr error(uint64_t ticket);
  std::exception_ptr first_error();

 private:
  void loop();
  const int spin_us_;
  std::mutex mu_;
  std::condition_variable wake_, finished_cv_;
  std::deque<Job> jobs_;
  uint64_t posted_ = 0, finished_ = 0;  // under mu_
  std::atomic<uint64_t> posted_hint_{0};  // posted_, for the worker to poll without the lock
  std::map<uint64_t, std::exception_ptr> errors_;  // failed jobs only
  std::exception_ptr first_error_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace tutti
