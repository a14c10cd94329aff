#include "runtime/unique_id.hpp"

#include <sys/random.h>

#include <cstring>

#include "core/env.hpp"
#include "core/error.hpp"

namespace tutti {
namespace {

// Layout inside the 128 bytes: magic, version, secret, address length, sockaddr.
struct Layout {
  uint32_t magic;
  uint32_t version;
  uint64_t secret;
  uint32_t addr_len;
  uint32_t reserved;
  unsigned char addr[sizeof(sockaddr_in6)];
};
static_assert(sizeof(Layout) <= UniqueId::kBytes);
constexpr uint32_t kIdMagic = 0x54555454;  // "TTUT"
constexpr uint32_t kIdVersion = 2;  // 2: the last 8 bytes check the others
// The check: FNV-1a over every byte before it. Each step is a bijection of the state, so any change
// of one byte gives another check: a damaged id is refused at once, instead of a rank knocking at a
// wrong address or with a wrong secret until TUTTI_INIT_TIMEOUT.
constexpr size_t kCheckOffset = UniqueId::kBytes - sizeof(uint64_t);
static_assert(sizeof(Layout) <= kCheckOffset);

uint64_t check_of(const UniqueId& id) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < kCheckOffset; ++i) h = (h ^ id.bytes[i]) * 1099511628211ull;
  return h;
}
uint64_t stored_check(const UniqueId& id) {
  uint64_t c;
  std::memcpy(&c, id.bytes.data() + kCheckOffset, sizeof c);
  return c;
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

Layout layout_of(const UniqueId& id) {
  Layout l;
  std::memcpy(&l, id.bytes.data(), sizeof(l));
  return l;
}

}  // namespace

uint64_t UniqueId::random_secret() {
  uint64_t s = 0;
  while (getrandom(&s, sizeof(s), 0) != sizeof(s)) {
  }
  return s;
}

UniqueId UniqueId::make(const SocketAddress& root, uint64_t secret) {
  Layout l{};
  l.magic = kIdMagic;
  l.version = kIdVersion;
  l.secret = secret;
  TUTTI_CHECK(root.length <= sizeof(l.addr), InvalidArgument, "root address too long");
  l.addr_len = root.length;
  std::memcpy(l.addr, &root.storage, root.length);
  UniqueId id;
  std::memcpy(id.bytes.data(), &l, sizeof(l));
  const uint64_t check = check_of(id);
  std::memcpy(id.bytes.data() + kCheckOffset, &check, sizeof check);
  return id;
}

bool UniqueId::valid() const {
  Layout l = layout_of(*this);
  return l.magic == kIdMagic && l.version == kIdVersion && l.addr_len > 0 && l.addr_len <= sizeof(l.addr) &&
         stored_check(*this) == check_of(*this);
}

SocketAddress UniqueId::root() const {
  TUTTI_CHECK(valid(), InvalidArgument, "unique id is not valid (wrong magic or version: not made by tutti?)");
  Layout l = layout_of(*this);
  SocketAddress a;
  std::memcpy(&a.storage, l.addr, l.addr_len);
  a.length = l.addr_len;
  return a;
}

uint64_t UniqueId::secret() const { return layout_of(*this).secret; }

std::string UniqueId::hex() const {
  static const char* kDigits = "0123456789abcdef";
  std::string s;
  for (unsigned char b : bytes) s += kDigits[b >> 4], s += kDigits[b & 15];
  return s;
}

UniqueId UniqueId::parse(const std::string& text, const std::string& secret) {
  if (text.size() == 2 * kBytes && text.find(':') == std::string::npos) {
    UniqueId id;
    for (size_t i = 0; i < kBytes; ++i) {
      auto nib = [&](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        throw InvalidArgument(fmt::format("comm id: '{}' is not a hex digit", c));
      };
      id.bytes[i] = static_cast<unsigned char>(nib(text[2 * i]) << 4 | nib(text[2 * i + 1]));
    }
    TUTTI_CHECK(id.valid(), InvalidArgument, "comm id (hex form) is not a tutti unique id");
    return id;
  }
  SocketAddress root = SocketAddress::parse(text);
  // A host:port carries no secret, and one derived from the address is no secret at all (anyone
  // who can reach the port can compute it and join as a rank), so it must come from outside.
  TUTTI_CHECK(!secret.empty(), InvalidArgument,
              "comm id '{}' is a bare host:port, which carries no secret: set the same TUTTI_COMM_SECRET on every "
              "rank (e.g. export TUTTI_COMM_SECRET=$(od -An -tx8 -N16 /dev/urandom | tr -d ' ')), or start the "
              "ranks with tutti-run, whose ids carry a random secret (docs/SECURITY.md)",
              text);
  return make(root, fnv1a("tutti-secret:" + secret));
}

}  // namespace tutti
