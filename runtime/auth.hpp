#pragma once
// Proof of a communicator's secret without sending it. Whoever accepts a connection (the
// rendezvous root, a rank's bootstrap listener) first sends a fresh random challenge; the hello
// that follows carries HMAC-SHA256(secret, purpose || challenge || the hello's own bytes). A
// listener checks it before it believes, or buffers beyond a small fixed bound, anything the
// connection says; an eavesdropper learns no secret and cannot replay a hello to another
// challenge. The rendezvous root proves the secret back in its answer, over the joining rank's own
// nonce, so a rank does not take a table from an impostor that took the root's port.
// docs/SECURITY.md has the threat model.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "runtime/socket.hpp"

namespace tutti::auth {

using Nonce = std::array<unsigned char, 16>;
using Mac = std::array<unsigned char, 32>;

Nonce random_nonce();  // from getrandom(); throws SystemError if the kernel has none to give
// HMAC-SHA256 keyed with the secret over purpose, nonce and data.
Mac mac(uint64_t secret, std::string_view purpose, const Nonce& nonce, const unsigned char* data, size_t bytes);
bool equal(const Mac& a, const Mac& b);  // constant time

// The challenge frame a listener sends at accept (without blocking: a fresh socket's buffer takes
// it); false if it could not be sent whole.
bool send_challenge(int fd, const Nonce& nonce);
// The connecting side: reads the listener's challenge. Throws RemoteError naming `what` if the
// peer sends anything else, Timeout at the deadline.
Nonce recv_challenge(int fd, Deadline deadline, const std::string& what);

}  // namespace tutti::auth
