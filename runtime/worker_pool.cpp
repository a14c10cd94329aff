#include "runtime/worker_pool.hpp"

#include "core/log.hpp"

namespace tutti {

WorkerPool::~WorkerPool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

void WorkerPool::helper(int index) {
  log::set_thread_rank(rank_);
  uint64_t seen = 0;
  while (true) {
    const std::function<void(int)>* job;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || (generation_ != seen && index < active_); });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    try {
      (*job)(index + 1);
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
    std::lock_guard lock(mutex_);
    if (--running_ == 0) done_.notify_all();
  }
}

void WorkerPool::run(int n, const std::function<void(int)>& fn) {
  if (n <= 1) {
    fn(0);
    return;
  }
  {
    std::lock_guard lock(mutex_);
    while (static_cast<int>(threads_.size()) < n - 1) {
      int index = static_cast<int>(threads_.size());
      threads_.emplace_back([this, index] { helper(index); });
    }
    job_ = &fn;
    active_ = running_ = n - 1;
    error_ = nullptr;
    ++generation_;
  }
  wake_.notify_all();
  std::exception_ptr mine;
  try {
    fn(0);
  } catch (...) {
    mine = std::current_exception();
  }
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return running_ == 0; });
  job_ = nullptr;
  if (mine) std::rethrow_exception(mine);
  if (error_) std::rethrow_exception(error_);
}

}  // namespace tutti
