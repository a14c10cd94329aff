#pragma once
// The 128-byte unique id of a communicator (NCCL's ncclUniqueId size): where the rendezvous root
// listens and the random 64-bit secret every connection must present.

#include <array>
#include <cstdint>
#include <string>

#include "runtime/socket.hpp"

namespace tutti {

struct UniqueId {
  static constexpr size_t kBytes = 128;
  std::array<unsigned char, kBytes> bytes{};

  // Root address + a fresh random secret.
  static UniqueId make(const SocketAddress& root, uint64_t secret);
  static uint64_t random_secret();
  // From TUTTI_COMM_ID/NCCL_COMM_ID text: 256 hex digits (tutti-run's form, which carry their own
  // secret) or host:port, whose secret is `secret` (CommOptions::comm_secret, TUTTI_COMM_SECRET);
  // a host:port with an empty secret is refused (a secret derived from the address is none).
  static UniqueId parse(const std::string& text, const std::string& secret);

  SocketAddress root() const;
  uint64_t secret() const;
  bool valid() const;  // magic, version and the check over every byte
  std::string hex() const;
};

}  // namespace tutti
