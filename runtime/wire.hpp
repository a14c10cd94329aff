#pragma once
// Byte encoding of control messages (bootstrap, rendezvous). Every read is bounds-checked and a
// short or malformed buffer throws RemoteError naming the message, never reads past the end.
// Frames on a socket are: FrameHeader (magic, type, tag, length) followed by length bytes.

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "core/error.hpp"

namespace tutti::wire {

inline constexpr uint32_t kMagic = 0x54545431;          // "TTT1"
inline constexpr uint64_t kMaxControlBytes = 64u << 20;  // control messages are small; larger is corrupt
// Before a connection has proven the secret, the most a listener reads from it: a rendezvous hello
// (a rank's PeerInfo is well under 1 KiB) or a bootstrap hello (under 64 bytes).
inline constexpr uint64_t kMaxHelloBytes = 4096;
// Unauthenticated connections a listener keeps at once; the oldest goes when another arrives.
inline constexpr size_t kMaxPendingConnections = 64;

enum class FrameType : uint32_t {
  kHello = 1,         // rank -> rendezvous root: who I am
  kTable = 2,         // root -> rank: everyone's info
  kRootError = 3,     // root -> rank: rendezvous failed (payload: kind, message)
  kMeshHello = 4,     // rank -> rank: bootstrap connection
  kData = 5,          // rank -> rank: tagged bootstrap payload
  kGoodbye = 6,       // rank -> rank: orderly shutdown, EOF that follows is not a failure
  kAbortNotice = 7,   // rank -> rank: this rank failed or aborted (payload: message)
  kTcpHello = 8,      // rank -> rank: a TCP transport socket (channel, index)
  kPing = 9,          // rank -> rank: liveness check (tag: a nonce); the service thread answers
  kPong = 10,         // rank -> rank: the answer (tag: the nonce)
  kChallenge = 11,    // listener -> whoever connected: a nonce the hello must prove the secret over
};

struct FrameHeader {
  uint32_t magic = kMagic;
  uint32_t type = 0;
  uint64_t tag = 0;
  uint64_t length = 0;
};
static_assert(sizeof(FrameHeader) == 24);

class Writer {
 public:
  template <class T>
  Writer& put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const unsigned char*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
    return *this;
  }
  Writer& put_string(const std::string& s) {
    put<uint64_t>(s.size());
    bytes_.insert(bytes_.end(), s.begin(), s.end());
    return *this;
  }
  Writer& put_bytes(const void* data, size_t n) {
    put<uint64_t>(n);
    const auto* p = static_cast<const unsigned char*>(data);
    bytes_.insert(bytes_.end(), p, p + n);
    return *this;
  }
  std::vector<unsigned char>& bytes() { return bytes_; }

 private:
  std::vector<unsigned char> bytes_;
};

class Reader {
 public:
  Reader(const void* data, size_t n, std::string what) : p_(static_cast<const unsigned char*>(data)), n_(n), what_(std::move(what)) {}
  explicit Reader(const std::vector<unsigned char>& v, std::string what) : Reader(v.data(), v.size(), std::move(what)) {}
  template <class T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_ + off_, sizeof(T));
    off_ += sizeof(T);
    return v;
  }
  std::string get_string() {
    uint64_t n = get<uint64_t>();
    need(n);
    std::string s(reinterpret_cast<const char*>(p_ + off_), n);
    off_ += n;
    return s;
  }
  std::vector<unsigned char> get_bytes() {
    uint64_t n = get<uint64_t>();
    need(n);
    std::vector<unsigned char> v(p_ + off_, p_ + off_ + n);
    off_ += n;
    return v;
  }
  bool done() const { return off_ == n_; }

 private:
  void need(uint64_t k) const {
    if (k > n_ - off_)
      throw RemoteError(fmt::format("malformed {}: needs {} more bytes at offset {} of {}", what_, k, off_, n_));
  }
  const unsigned char* p_;
  size_t n_;
  size_t off_ = 0;
  std::string what_;
};

}  // namespace tutti::wire
