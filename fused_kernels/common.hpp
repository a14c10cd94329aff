#pragma once
// What the fused operations share: registering their kernels once, checking a kernel's element
// type, and cutting a rank's part into pipeline pieces.

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "core/datatype.hpp"
#include "core/error.hpp"
#include "tutti/kernel.hpp"

namespace tutti::fused {

// The kernel's id, registering it on first use. `mixed_units`: see KernelDef::mixed_units.
inline KernelId register_once(KernelDef def, bool mixed_units = false, DeviceKernel device = DeviceKernel::kNone) {
  if (auto id = find_kernel(def.name)) return *id;
  def.mixed_units = mixed_units;
  def.device = device;
  return register_kernel(std::move(def));
}

inline void require_float(const KernelArgs& a, const char* kernel) {
  if (a.type != DataType::kFloat32)
    throw InvalidArgument(fmt::format("kernel '{}' runs on float32, not {}", kernel, name(a.type)));
}

// Pieces for `units` (rows, elements) of `unit_bytes` each: about `piece_bytes` a piece, at most
// `most`, and a divisor of `units` (every piece the same size).
inline int pieces_for(int64_t units, int64_t unit_bytes, int64_t piece_bytes, int64_t most) {
  int64_t want = std::clamp<int64_t>(units * unit_bytes / piece_bytes, 1, std::max<int64_t>(most, 1));
  while (units % want != 0) --want;
  return static_cast<int>(want);
}

}  // namespace tutti::fused
