#pragma once
// Helper threads of one rank's executor. run(n, fn) calls fn(0) on the calling thread and fn(1..n-1)
// on helpers, and returns when all have returned; the first exception is rethrown. Helpers sleep on
// a condition variable between runs, so an idle pool costs no CPU.

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tutti {

class WorkerPool {
 public:
  explicit WorkerPool(int rank) : rank_(rank) {}
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void run(int n, const std::function<void(int worker)>& fn);
  int helpers() const { return static_cast<int>(threads_.size()); }

 private:
  void helper(int index);

  int rank_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int active_ = 0;   // helpers taking part in the current job
  int running_ = 0;  // of those, not finished yet
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace tutti
