#pragma once
// What a message on a plan channel belongs to: the collective, datatype, op, root and count of the
// call that sent it, in 64 bits every transport header carries. The receiver compares it with its
// own call's, so ranks that make different calls (another collective, type, op, root or count, or
// the same calls in another order) fail at their first message naming both calls, instead of
// reducing one call's data into another's. The count must be in it: message sizes alone do not
// tell 1M elements from 512K above the executor's tile, where both calls send tiles of one size
// (before the count was carried, one rank of such a pair returned success with wrong data).
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

using CallStamp = uint64_t;
inline constexpr uint32_t kStampNoRoot = 0xFFFFF;
inline constexpr uint32_t kStampHashedCount = 0x80000000u;

// The count's 32 bits: the count itself below 2^31 (so a message can name it), else a 31-bit hash
// of it with the top bit set (counts that differ by a multiple of 2^32, powers of two among them,
// still differ there).
inline uint32_t stamp_count(uint64_t count) {
  if (count < kStampHashedCount) return static_cast<uint32_t>(count);
  uint64_t h = count * 0x9e3779b97f4a7c15ull;
  h ^= h >> 29;
  return kStampHashedCount | static_cast<uint32_t>(h >> 33);
}

// Low word: collective 5 bits, datatype 4, op 3 (only for reductions and custom plans, which may
// reduce), root 20 (only for collectives with a root; a root past 2^20 - 2 is taken modulo). High
// word: stamp_count(count). Never 0, so a plan's stamp differs from point-to-point's.
inline CallStamp make_stamp(Collective c, DataType type, RedOp op, int root, uint64_t count) {
  const bool with_op = reduces(c) || c == Collective::kCustom;
  uint32_t r = kStampNoRoot;
  if (has_root(c) && root >= 0) r = static_cast<uint32_t>(root) < kStampNoRoot ? static_cast<uint32_t>(root) : static_cast<uint32_t>(root) % kStampNoRoot;
  const uint32_t call = (static_cast<uint32_t>(c) + 1) | static_cast<uint32_t>(type) << 5 |
                        (with_op ? static_cast<uint32_t>(op) : 0u) << 9 | r << 12;
  return call | uint64_t{stamp_count(count)} << 32;
}

// The activity stamp of a split (CommState::begin_call): collective bits no collective has.
inline constexpr CallStamp kSplitStamp = 31;

inline std::string describe_stamp(CallStamp s) {
  if (s == 0) return "point-to-point traffic";
  const auto call = static_cast<uint32_t>(s);
  const auto count = static_cast<uint32_t>(s >> 32);
  const auto c = static_cast<Collective>((call & 31u) - 1);
  std::string out = fmt::format("{} of ", to_string(c));
  if (count & kStampHashedCount) out += fmt::format("2^31 or more (hash {:#x}) ", count & ~kStampHashedCount);
  else out += fmt::format("{} ", count);
  out += name(static_cast<DataType>((call >> 5) & 15u));
  if (c == Collective::kAllReduce || c == Collective::kReduce || c == Collective::kReduceScatter)
    out += fmt::format(" ({})", name(static_cast<RedOp>((call >> 9) & 7u)));
  if ((call >> 12) != kStampNoRoot) out += fmt::format(" with root {}", call >> 12);
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
