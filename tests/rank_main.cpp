// tutti-test-rank: one rank of a multi-process test, started by tutti-run or by a test harness.
//
//   tutti-test-rank exchange [max_bytes]  random traffic with every peer (support/exchange.hpp)
//   tutti-test-rank kill VICTIM           VICTIM kills itself after setup; survivors must get a
//                                         RemoteError naming it (exit 3), not hang
//   tutti-test-rank split                 split into even/odd ranks and exchange in each half
//
// Exit status: 0 success, 1 failure, 3 "expected remote error seen".
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/error.hpp"
#include "tests/support/exchange.hpp"

using namespace tutti;

int main(int argc, char** argv) {
  std::string scenario = argc > 1 ? argv[1] : "exchange";
  try {
    auto comm = Communicator::create_from_env();
    if (scenario == "exchange") {
      test_support::ExchangeSpec spec;
      spec.max_bytes = argc > 2 ? std::strtoull(argv[2], nullptr, 0) : (comm->size() >= 8 ? 1 << 20 : 4 << 20);
      spec.messages = comm->size() >= 8 ? 6 : 10;
      size_t got = test_support::random_exchange(*comm, spec);
      std::printf("rank %d: received %zu bytes from %d peers over %s, all verified\n", comm->rank(), got,
                  comm->size() - 1, comm->size() > 1 ? comm->transport_to((comm->rank() + 1) % comm->size()) : "-");
      return 0;
    }
    if (scenario == "kill") {
      int victim = argc > 2 ? std::atoi(argv[2]) : 1;
      int x = 0;
      try {
        // The victim may die while others are still in the barrier: that must be reported too.
        comm->barrier();
        if (comm->rank() == victim) raise(SIGKILL);
        comm->recv(victim, &x, sizeof(x));
      } catch (const RemoteError& e) {
        std::printf("rank %d: remote error as expected: %s\n", comm->rank(), e.what());
        return 3;
      }
      std::printf("rank %d: received from a dead rank?\n", comm->rank());
      return 1;
    }
    if (scenario == "split") {
      auto half = comm->split(comm->rank() % 2, -comm->rank());
      test_support::ExchangeSpec spec;
      spec.max_bytes = 1 << 16;
      spec.big_bytes = 1 << 16;
      spec.messages = 4;
      test_support::random_exchange(*half, spec);
      std::printf("rank %d: split rank %d of %d ok\n", comm->rank(), half->rank(), half->size());
      return 0;
    }
    std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tutti-test-rank: %s\n", e.what());
    return 1;
  }
}
