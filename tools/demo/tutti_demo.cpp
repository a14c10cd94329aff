// tutti-demo: ranks bootstrap, connect to every peer, and exchange data, saying what they did.
//
//   tutti-run -n 4 tutti-demo      one rank per process
//   tutti-demo [N]                 N ranks as threads of this process (default 4)
//
// Each rank sends 1 MiB around a ring and a small message to every peer, checks every byte it
// receives, and reports the transport used for each peer and the time the exchanges took.

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "runtime/communicator.hpp"

using tutti::Communicator;

namespace {

std::mutex g_print;

unsigned char pattern(int src, int dst, size_t i) { return static_cast<unsigned char>(src * 37 + dst * 11 + i * 7); }

int run_rank(Communicator& comm) {
  const int me = comm.rank(), n = comm.size();
  std::string peers;
  for (int p = 0; p < n; ++p)
    if (p != me) peers += fmt::format(" {}:{}", p, comm.transport_to(p));
  {
    std::lock_guard lock(g_print);
    std::printf("rank %d/%d: pid %d on %s connected to peers%s\n", me, n, getpid(), comm.peer_info(me).hostname.c_str(),
                peers.empty() ? " (none)" : peers.c_str());
    std::fflush(stdout);
  }
  int errors = 0;
  double ring_ms = 0, a2a_ms = 0;
  if (n > 1) {
    // Ring: 1 MiB to the next rank, from the previous one.
    const size_t bytes = 1 << 20;
    int next = (me + 1) % n, prev = (me + n - 1) % n;
    std::vector<unsigned char> out(bytes), in(bytes);
    for (size_t i = 0; i < bytes; ++i) out[i] = pattern(me, next, i);
    auto t0 = std::chrono::steady_clock::now();
    auto rt = comm.connection(prev).recv(in.data(), bytes);
    auto st = comm.connection(next).send(out.data(), bytes);
    comm.wait_recv(prev, rt);
    comm.wait_send(next, st);
    ring_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    for (size_t i = 0; i < bytes; ++i) errors += in[i] != pattern(prev, me, i);

    // All to all: 4 KiB to every peer at once.
    const size_t small = 4096;
    std::vector<std::vector<unsigned char>> sbuf(n, std::vector<unsigned char>(small)), rbuf = sbuf;
    std::vector<tutti::Ticket> rts(n), sts(n);
    t0 = std::chrono::steady_clock::now();
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      for (size_t i = 0; i < small; ++i) sbuf[p][i] = pattern(me, p, i);
      rts[p] = comm.connection(p).recv(rbuf[p].data(), small);
      sts[p] = comm.connection(p).send(sbuf[p].data(), small);
    }
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      comm.wait_recv(p, rts[p]);
      comm.wait_send(p, sts[p]);
      for (size_t i = 0; i < small; ++i) errors += rbuf[p][i] != pattern(p, me, i);
    }
    a2a_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  comm.barrier();
  {
    std::lock_guard lock(g_print);
    std::printf("rank %d/%d: ring 1 MiB from rank %d in %.3f ms, all-to-all 4 KiB x %d peers in %.3f ms, %s\n", me, n,
                (me + n - 1) % n, ring_ms, n - 1, a2a_ms, errors ? "DATA ERRORS" : "all bytes verified");
    std::fflush(stdout);
  }
  return errors ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (std::getenv("TUTTI_RANK") || std::getenv("OMPI_COMM_WORLD_RANK") || std::getenv("SLURM_PROCID")) {
      auto comm = Communicator::create_from_env();
      return run_rank(*comm);
    }
    int n = argc > 1 ? std::atoi(argv[1]) : 4;
    if (n < 1) {
      std::fprintf(stderr, "usage: tutti-demo [ranks]   (or under tutti-run -n N)\n");
      return 2;
    }
    std::printf("tutti-demo: %d ranks as threads of pid %d\n", n, getpid());
    auto comms = Communicator::create_local(n);
    std::vector<int> rc(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { rc[r] = run_rank(*comms[r]); });
    for (auto& t : threads) t.join();
    for (int r : rc)
      if (r) return r;
    return 0;
  } catch (const tutti::Error& e) {
    std::fprintf(stderr, "tutti-demo: %s\n", e.what());
    return 1;
  }
}
