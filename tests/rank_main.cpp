// tutti-test-rank: one rank of a multi-process test, started by tutti-run or by a test harness.
//
//   tutti-test-rank exchange [max_bytes [min_bytes messages]]  random traffic with every peer
//                                         (support/exchange.hpp)
//   tutti-test-rank kill VICTIM           VICTIM kills itself after setup; survivors must get a
//                                         RemoteError naming it (exit 3), not hang
//   tutti-test-rank split                 split into even/odd ranks and exchange in each half
//   tutti-test-rank world HOSTS           merges the ranks' topologies through the bootstrap and
//                                         checks HOSTS hosts, every rank placed on its own host's device
//   tutti-test-rank fd-limit-root N       no communicator: limits itself to N descriptors, runs a
//                                         rendezvous root for one group, prints its id, and exits
//                                         (printing its CPU time) once the group has met
//
// Exit status: 0 success, 1 failure, 3 "expected remote error seen".
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "collectives/tuner.hpp"
#include "core/error.hpp"
#include "runtime/rendezvous.hpp"
#include "tests/support/exchange.hpp"

using namespace tutti;

int main(int argc, char** argv) {
  std::string scenario = argc > 1 ? argv[1] : "exchange";
  if (scenario == "fd-limit-root") {
    const rlim_t n = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 48;
    rlimit limit{n, n};
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) return 1;
    RendezvousRoot root(SocketAddress::parse("127.0.0.1:0"), UniqueId::random_secret(), false);
    std::printf("%s\n", root.unique_id().hex().c_str());
    std::fflush(stdout);
    while (!root.finished()) usleep(10000);
    rusage use{};
    getrusage(RUSAGE_SELF, &use);
    std::printf("cpu %.3f s\n", use.ru_utime.tv_sec + use.ru_stime.tv_sec + (use.ru_utime.tv_usec + use.ru_stime.tv_usec) * 1e-6);
    return 0;
  }
  try {
    auto comm = Communicator::create_from_env();
    if (scenario == "exchange") {
      test_support::ExchangeSpec spec;
      spec.max_bytes = argc > 2 ? std::strtoull(argv[2], nullptr, 0) : (comm->size() >= 8 ? 1 << 20 : 4 << 20);
      spec.messages = comm->size() >= 8 ? 6 : 10;
      if (argc > 4) {
        spec.min_bytes = std::strtoull(argv[3], nullptr, 0);
        spec.messages = std::atoi(argv[4]);
      }
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
    if (scenario == "world") {
      const int want = argc > 2 ? std::atoi(argv[2]) : 1;
      topo::Topology w = tuning::live_topology(*comm);
      int bad = 0;
      for (int r = 0; r < comm->size(); ++r) {
        // Ranks of one host (same host hash) share a host device; ranks of different hosts do not.
        const bool same = comm->peer_info(r).host_hash == comm->peer_info(comm->rank()).host_hash;
        const int mine = w.devices[w.rank_device[comm->rank()]].host, theirs = w.devices[w.rank_device[r]].host;
        if (same != (mine == theirs)) ++bad;
      }
      std::printf("rank %d: world topology of %d hosts (want %d), %d ranks, %d misplaced; path to rank 0: %.2f GB/s\n",
                  comm->rank(), w.count(topo::DeviceType::kHost), want, w.nranks(), bad,
                  comm->rank() == 0 ? 0.0 : w.path(comm->rank(), 0).gbps);
      return w.count(topo::DeviceType::kHost) == want && w.nranks() == comm->size() && bad == 0 ? 0 : 1;
    }
    std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tutti-test-rank: %s\n", e.what());
    return 1;
  }
}
