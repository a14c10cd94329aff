#include "runtime/auth.hpp"

#include <openssl/crypto.h>
#include <openssl/hmac.h>
#include <sys/random.h>
#include <sys/socket.h>

#include <cstring>

#include "core/error.hpp"
#include "runtime/wire.hpp"

namespace tutti::auth {

Nonce random_nonce() {
  Nonce n;
  size_t got = 0;
  while (got < n.size()) {
    ssize_t k = getrandom(n.data() + got, n.size() - got, 0);
    if (k < 0) {
      if (errno == EINTR) continue;
      throw_system_error("getrandom() for an authentication challenge");
    }
    got += static_cast<size_t>(k);
  }
  return n;
}

Mac mac(uint64_t secret, std::string_view purpose, const Nonce& nonce, const unsigned char* data, size_t bytes) {
  std::vector<unsigned char> message;
  message.reserve(purpose.size() + 1 + nonce.size() + bytes);
  message.insert(message.end(), purpose.begin(), purpose.end());
  message.push_back(0);  // purposes never run into the nonce
  message.insert(message.end(), nonce.begin(), nonce.end());
  if (bytes) message.insert(message.end(), data, data + bytes);
  unsigned char key[sizeof(secret)];
  std::memcpy(key, &secret, sizeof(secret));
  Mac out{};
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), key, sizeof(key), message.data(), message.size(), out.data(), &len) || len != out.size())
    throw InternalError("HMAC-SHA256 failed");
  return out;
}

bool equal(const Mac& a, const Mac& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

bool send_challenge(int fd, const Nonce& nonce) {
  wire::FrameHeader h;
  h.type = static_cast<uint32_t>(wire::FrameType::kChallenge);
  h.length = nonce.size();
  unsigned char frame[sizeof(h) + sizeof(Nonce)];
  std::memcpy(frame, &h, sizeof(h));
  std::memcpy(frame + sizeof(h), nonce.data(), nonce.size());
  return ::send(fd, frame, sizeof(frame), MSG_DONTWAIT | MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof(frame));
}

Nonce recv_challenge(int fd, Deadline deadline, const std::string& what) {
  wire::FrameHeader h;
  recv_exact(fd, &h, sizeof(h), deadline, what);
  TUTTI_CHECK(h.magic == wire::kMagic && h.type == static_cast<uint32_t>(wire::FrameType::kChallenge) &&
                  h.length == sizeof(Nonce),
              RemoteError, "{} did not open with an authentication challenge (not a tutti listener of this version?)",
              what);
  Nonce n;
  recv_exact(fd, n.data(), n.size(), deadline, what);
  return n;
}

}  // namespace tutti::auth
