#pragma once
// What a message on a plan channel belongs to: the collective, datatype, op and root of the call
// that sent it, in 32 bits every transport header carries. The receiver compares it with its own
// call's, so ranks that make different calls (another collective, type, op or root, or the same
// calls in another order) fail at their first message naming both calls, instead of reducing one
// call's data into another's. Counts are caught by the message size, which every transport checks.
// Point-to-point traffic and anything outside a plan carries stamp 0 on both sides.
//
// Also the header checksum: a check over a transport header's words, so a header damaged in flight
// (or by TUTTI_FAULT=corrupt) is an error naming the connection, never a receive of the wrong
// size, at the wrong offset, or from a wrong address.

#include <cstdint>
#include <initializer_list>
#include <string>

#include <fmt/format.h>

#include "core/datatype.hpp"
#include "tutti/collective.hpp"

namespace tutti {

using CallStamp = uint32_t;
inline constexpr uint32_t kStampNoRoot = 0xFFFFF;

// collective: 5 bits, datatype: 4, op: 3 (only for reductions), root: 20 (only for rooted calls;
// a root past 2^20 - 2 is taken modulo). Never 0, so a plan's stamp differs from point-to-point's.
inline CallStamp make_stamp(Collective c, DataType type, RedOp op, bool reduces, int root) {
  const uint32_t r = root >= 0 ? static_cast<uint32_t>(root) % kStampNoRoot : kStampNoRoot;
  return (static_cast<uint32_t>(c) + 1) | static_cast<uint32_t>(type) << 5 |
         (reduces ? static_cast<uint32_t>(op) : 0u) << 9 | r << 12;
}

inline std::string describe_stamp(CallStamp s) {
  if (s == 0) return "point-to-point traffic";
  const auto c = static_cast<Collective>((s & 31u) - 1);
  std::string out = fmt::format("{} of {}", to_string(c), name(static_cast<DataType>((s >> 5) & 15u)));
  if (c == Collective::kAllReduce || c == Collective::kReduce || c == Collective::kReduceScatter)
    out += fmt::format(" ({})", name(static_cast<RedOp>((s >> 9) & 7u)));
  if ((s >> 12) != kStampNoRoot) out += fmt::format(" with root {}", s >> 12);
  return out;
}

// A 64-bit mix of the words of a header (splitmix64's finaliser per word): every bit of every word
// affects every bit of the result, so one flipped bit changes the check.
inline uint64_t header_hash(std::initializer_list<uint64_t> words) {
  uint64_t h = 0x9e3779b97f4a7c15ull;
  for (uint64_t w : words) {
    h ^= w + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    h ^= h >> 31;
  }
  return h;
}

}  // namespace tutti
