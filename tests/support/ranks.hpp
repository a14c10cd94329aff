#pragma once
// Runs a function on a thread per rank of communicators made by Communicator::create_local, and
// rethrows the first failure after every thread has finished (so a failing rank cannot leave the
// others blocked on it without the test seeing why).

#include <exception>
#include <memory>
#include <thread>
#include <vector>

#include "runtime/communicator.hpp"
#include "tutti/tutti.hpp"

namespace tutti::test_support {

template <class T>
T& rank_comm(T& c) {
  return c;
}
template <class T>
T& rank_comm(std::unique_ptr<T>& c) {
  return *c;
}

// `comms`: Communicator::create_local's (runtime) or Comm::create_local's (the C++ API).
template <class Comms, class F>
void on_ranks(Comms& comms, F fn) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(comms.size());
  for (size_t r = 0; r < comms.size(); ++r)
    threads.emplace_back([&, r] {
      try {
        fn(static_cast<int>(r), rank_comm(comms[r]));
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace tutti::test_support
