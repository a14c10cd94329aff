#pragma once
// Runs a function on a thread per rank of communicators made by Communicator::create_local, and
// rethrows the first failure after every thread has finished (so a failing rank cannot leave the
// others blocked on it without the test seeing why).

#include <exception>
#include <memory>
#include <thread>
#include <vector>

#include "runtime/communicator.hpp"

namespace tutti::test_support {

template <class F>
void on_ranks(std::vector<std::unique_ptr<Communicator>>& comms, F fn) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(comms.size());
  for (size_t r = 0; r < comms.size(); ++r)
    threads.emplace_back([&, r] {
      try {
        fn(static_cast<int>(r), *comms[r]);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace tutti::test_support
