#pragma once
// Calls native(T{}) for the native element types and mini(F{}) for the low-precision formats of
// core/element.hpp, so a kernel family is written once as two generic lambdas (CPU reductions,
// the CUDA backend's small kernels).

#include <cstdint>

#include "core/datatype.hpp"
#include "core/element.hpp"

namespace tutti {

template <class Native, class Mini>
void by_type(DataType type, Native native, Mini mini) {
  switch (type) {
    case DataType::kInt8: return native(int8_t{});
    case DataType::kUint8: return native(uint8_t{});
    case DataType::kInt32: return native(int32_t{});
    case DataType::kUint32: return native(uint32_t{});
    case DataType::kInt64: return native(int64_t{});
    case DataType::kUint64: return native(uint64_t{});
    case DataType::kFloat32: return native(float{});
    case DataType::kFloat64: return native(double{});
    case DataType::kFloat16: return mini(element::HalfT{});
    case DataType::kBfloat16: return mini(element::Bf16T{});
    case DataType::kFp8E4M3: return mini(element::E4M3T{});
    case DataType::kFp8E5M2: return mini(element::E5M2T{});
  }
}

}  // namespace tutti
