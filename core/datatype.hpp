#pragma once
// Element types and reduction operators. The numeric values equal NCCL's ncclDataType_t and
// ncclRedOp_t so the C API converts by cast after a range check.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "tutti/types.hpp"

namespace tutti {

// DataType and RedOp themselves are public: include/tutti/types.hpp.

size_t size_of(DataType type);
std::string_view name(DataType type);  // nccl-tests spelling: int8, uint8, ..., half, float, double, bfloat16, f8e4m3, f8e5m2
std::string_view name(RedOp op);       // sum, prod, max, min, avg, premulsum
std::optional<DataType> parse_datatype(std::string_view text);  // also accepts int, float32, fp16, bf16...
std::optional<RedOp> parse_redop(std::string_view text);
bool is_floating(DataType type);
bool is_valid(DataType type);
bool is_valid(RedOp op);

}  // namespace tutti
