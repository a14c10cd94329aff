#include "tests/support/exchange.hpp"

#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

namespace tutti::test_support {

size_t message_bytes(const ExchangeSpec& spec, int src, int dst, int index) {
  if (index == 0) return 0;
  if (index == 1 && src == 0 && dst == 1) return spec.big_bytes;
  std::mt19937_64 rng(spec.seed * 1000003u + static_cast<uint64_t>(src) * 7919u + static_cast<uint64_t>(dst) * 104729u +
                      static_cast<uint64_t>(index));
  double lo = std::log(static_cast<double>(std::max<size_t>(1, spec.min_bytes)));
  double hi = std::log(static_cast<double>(std::max(spec.max_bytes, spec.min_bytes)));
  double x = std::uniform_real_distribution<double>(lo, hi)(rng);
  return std::max<size_t>(1, static_cast<size_t>(std::exp(x)));
}

unsigned char message_byte(int src, int dst, int index, size_t offset) {
  uint64_t v = (offset * 0x9E3779B97F4A7C15ull) ^ (static_cast<uint64_t>(src) << 40) ^ (static_cast<uint64_t>(dst) << 32) ^
               static_cast<uint64_t>(index) * 0x100000001B3ull;
  return static_cast<unsigned char>(v >> 29);
}

size_t random_exchange(Communicator& comm, const ExchangeSpec& spec) {
  const int me = comm.rank(), n = comm.size();
  struct Posted {
    int peer;
    Ticket ticket;
    bool send;
  };
  std::vector<std::vector<unsigned char>> send_bufs, recv_bufs;
  std::vector<std::tuple<int, int, size_t>> recv_meta;  // (src, index, recv_bufs slot)
  std::vector<Posted> posted;
  send_bufs.reserve(static_cast<size_t>(n * spec.messages));
  recv_bufs.reserve(static_cast<size_t>(n * spec.messages));
  for (int k = 0; k < spec.messages; ++k) {
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      size_t out = message_bytes(spec, me, p, k);
      auto& sb = send_bufs.emplace_back(out);
      for (size_t i = 0; i < out; ++i) sb[i] = message_byte(me, p, k, i);
      posted.push_back({p, comm.connection(p, spec.channel).send(sb.data(), out), true});
      size_t in = message_bytes(spec, p, me, k);
      auto& rb = recv_bufs.emplace_back(in);
      recv_meta.emplace_back(p, k, recv_bufs.size() - 1);
      posted.push_back({p, comm.connection(p, spec.channel).recv(rb.data(), in), false});
    }
  }
  comm.engine().wait(
      [&] {
        for (auto& op : posted) {
          Connection& c = comm.connection(op.peer, spec.channel);
          if (op.send ? !c.send_done(op.ticket) : !c.recv_done(op.ticket)) return false;
        }
        return true;
      },
      [] { return std::string("in the random exchange"); });
  size_t total = 0;
  for (auto& [src, k, slot] : recv_meta) {
    auto& rb = recv_bufs[slot];
    total += rb.size();
    for (size_t i = 0; i < rb.size(); ++i)
      if (rb[i] != message_byte(src, me, k, i))
        throw std::runtime_error(fmt::format("rank {}: message {} from rank {} ({} bytes) is wrong at byte {}", me, k,
                                             src, rb.size(), i));
  }
  return total;
}

}  // namespace tutti::test_support
