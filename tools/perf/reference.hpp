#pragma once
// nccl-tests' kind of data, shared by tutti-perf and tutti-storm (tests/storm.cpp): small
// integers, exact in every type under every reduction order, so results are compared bit for bit.
// Ops are numbered as tutti-perf's -o: 0 sum, 1 prod, 2 max, 3 min, 4 avg, 5 premulsum (by 2).

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/datatype.hpp"

namespace tutti::reference {

// Element i of rank r's input. Products use only +-1 so they stay small; fp8 uses -1..1 so sums
// of up to 16 ranks stay exact; unsigned types get non-negative values, so min and max agree with
// their unsigned order.
inline double value(DataType t, int op, int rank, size_t i) {
  uint64_t h = (i * 2654435761u + static_cast<uint64_t>(rank) * 40503u + 7) >> 7;
  if (op == 1) return (h & 1) ? 1.0 : -1.0;
  if (t == DataType::kFp8E4M3 || t == DataType::kFp8E5M2) return static_cast<double>(h % 3) - 1.0;
  if (t == DataType::kUint8 || t == DataType::kUint32 || t == DataType::kUint64) return static_cast<double>(h % 11);
  return static_cast<double>(h % 11) - 5.0;
}

// Element i reduced over ranks 0..n-1 with `op` (premulsum's scaling included; avg's division is
// the caller's, in the type, as the library divides).
inline double reduced(DataType t, int op, int n, size_t i) {
  const double scale = op == 5 ? 2 : 1;
  double v = value(t, op, 0, i) * scale;
  for (int q = 1; q < n; ++q) {
    const double x = value(t, op, q, i) * scale;
    if (op == 1) v *= x;
    else if (op == 2) v = std::max(v, x);
    else if (op == 3) v = std::min(v, x);
    else v += x;
  }
  return v;
}

}  // namespace tutti::reference
