#pragma once
// Element types and reduction operators. The numeric values equal NCCL's ncclDataType_t and
// ncclRedOp_t so the C API converts by cast after a range check.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace tutti {

enum class DataType : int {
  kInt8 = 0,
  kUint8 = 1,
  kInt32 = 2,
  kUint32 = 3,
  kInt64 = 4,
  kUint64 = 5,
  kFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
  kBfloat16 = 9,
  kFp8E4M3 = 10,
  kFp8E5M2 = 11,
};
inline constexpr int kNumDataTypes = 12;

enum class RedOp : int {
  kSum = 0,
  kProd = 1,
  kMax = 2,
  kMin = 3,
  kAvg = 4,        // sum, then divided by the number of contributions
  kPreMulSum = 5,  // each contribution multiplied by a scalar, then summed
};
inline constexpr int kNumRedOps = 6;

size_t size_of(DataType type);
std::string_view name(DataType type);  // nccl-tests spelling: int8, uint8, ..., half, float, double, bfloat16, f8e4m3, f8e5m2
std::string_view name(RedOp op);       // sum, prod, max, min, avg, premulsum
std::optional<DataType> parse_datatype(std::string_view text);  // also accepts int, float32, fp16, bf16...
std::optional<RedOp> parse_redop(std::string_view text);
bool is_floating(DataType type);
bool is_valid(DataType type);
bool is_valid(RedOp op);

}  // namespace tutti
