// tutti-transport-bench: point-to-point latency and bandwidth between two ranks, next to this
// machine's single-core memcpy bandwidth measured in the same run (the yardstick for shm).
//
//   tutti-run -n 2 tutti-transport-bench [--iters N]       (TUTTI_TRANSPORT=shm|tcp picks the transport)
//
// Ping-pong: rank 0 sends 8 B, rank 1 answers; latency is half the round trip.
// Streaming: rank 0 keeps `window` messages in flight to rank 1, which receives them all, then
// acknowledges; bandwidth = bytes / time. Rank 0 prints one table.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "runtime/communicator.hpp"

using Clock = std::chrono::steady_clock;
using tutti::Communicator;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Best of several timed rounds of memcpy over buffers far larger than the caches.
double memcpy_gbps(size_t bytes, int rounds) {
  std::vector<unsigned char> a(bytes, 1), b(bytes, 2);
  double best = 0;
  for (int r = 0; r < rounds; ++r) {
    auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    double s = seconds_since(t0);
    best = std::max(best, bytes / s / 1e9);
    std::swap(a, b);
  }
  return best;
}

double ping_pong_us(Communicator& comm, int iters) {
  char buf[8] = {};
  comm.barrier();
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    if (comm.rank() == 0) {
      comm.send(1, buf, sizeof(buf));
      comm.recv(1, buf, sizeof(buf));
    } else {
      comm.recv(0, buf, sizeof(buf));
      comm.send(0, buf, sizeof(buf));
    }
  }
  return seconds_since(t0) / iters / 2 * 1e6;
}

double stream_gbps(Communicator& comm, size_t bytes, size_t total, int window) {
  const int count = static_cast<int>(std::max<size_t>(total / bytes, 4));
  std::vector<std::vector<unsigned char>> bufs(window, std::vector<unsigned char>(bytes, 7));
  char ack = 0;
  auto& conn = comm.connection(1 - comm.rank());
  double best = 0;
  for (int round = 0; round < 3; ++round) {
    comm.barrier();
    auto t0 = Clock::now();
    std::vector<tutti::Ticket> tickets;
    for (int i = 0; i < count; ++i) {
      auto& b = bufs[i % window];
      if (i >= window) {
        tutti::Ticket t = tickets[i - window];
        if (comm.rank() == 0) comm.wait_send(1, t);
        else comm.wait_recv(0, t);
      }
      tickets.push_back(comm.rank() == 0 ? conn.send(b.data(), bytes) : conn.recv(b.data(), bytes));
    }
    if (comm.rank() == 0) {
      comm.wait_send(1, tickets.back());
      comm.recv(1, &ack, 1);
    } else {
      comm.wait_recv(0, tickets.back());
      comm.send(0, &ack, 1);
    }
    best = std::max(best, static_cast<double>(bytes) * count / seconds_since(t0) / 1e9);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 20000;
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]);
  try {
    auto comm = Communicator::create_from_env();
    if (comm->size() != 2) {
      std::fprintf(stderr, "tutti-transport-bench needs exactly 2 ranks (tutti-run -n 2)\n");
      return 2;
    }
    double copy = comm->rank() == 0 ? memcpy_gbps(64 << 20, 8) : 0;
    double lat = ping_pong_us(*comm, iters);
    struct Row {
      size_t bytes;
      double gbps;
    };
    std::vector<Row> rows;
    for (size_t bytes : {size_t{64} << 10, size_t{1} << 20, size_t{16} << 20})
      rows.push_back({bytes, stream_gbps(*comm, bytes, size_t{512} << 20, 4)});
    if (comm->rank() == 0) {
      const char* transport = comm->transport_to(1);
      std::printf("# tutti-transport-bench: 2 processes, transport %s\n", transport);
      std::printf("%-28s %12s\n", "measurement", "value");
      std::printf("%-28s %9.2f us\n", (std::string(transport) + " ping-pong latency 8 B").c_str(), lat);
      for (auto& r : rows)
        std::printf("%-28s %8.2f GB/s\n", fmt::format("{} stream {} KiB", transport, r.bytes >> 10).c_str(), r.gbps);
      std::printf("%-28s %8.2f GB/s\n", "memcpy single core 64 MiB", copy);
      std::printf("%-28s %9.2f\n", fmt::format("{} 16 MiB / memcpy", transport).c_str(), rows.back().gbps / copy);
    }
    return 0;
  } catch (const tutti::Error& e) {
    std::fprintf(stderr, "tutti-transport-bench: %s\n", e.what());
    return 1;
  }
}
