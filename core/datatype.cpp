#include "core/datatype.hpp"

#include <array>
#include <string>

namespace tutti {
namespace {

struct TypeInfo {
  std::string_view name;
  size_t size;
  bool floating;
};

constexpr std::array<TypeInfo, kNumDataTypes> kTypes = {{
    {"int8", 1, false},
    {"uint8", 1, false},
    {"int32", 4, false},
    {"uint32", 4, false},
    {"int64", 8, false},
    {"uint64", 8, false},
    {"half", 2, true},
    {"float", 4, true},
    {"double", 8, true},
    {"bfloat16", 2, true},
    {"f8e4m3", 1, true},
    {"f8e5m2", 1, true},
}};

constexpr std::array<std::string_view, kNumRedOps> kOps = {"sum", "prod", "max", "min", "avg", "premulsum"};

}  // namespace

bool is_valid(DataType type) { return static_cast<int>(type) >= 0 && static_cast<int>(type) < kNumDataTypes; }
bool is_valid(RedOp op) { return static_cast<int>(op) >= 0 && static_cast<int>(op) < kNumRedOps; }
size_t size_of(DataType type) { return is_valid(type) ? kTypes[static_cast<int>(type)].size : 0; }
bool is_floating(DataType type) { return is_valid(type) && kTypes[static_cast<int>(type)].floating; }
std::string_view name(DataType type) { return is_valid(type) ? kTypes[static_cast<int>(type)].name : "invalid"; }
std::string_view name(RedOp op) { return is_valid(op) ? kOps[static_cast<int>(op)] : "invalid"; }

std::optional<DataType> parse_datatype(std::string_view text) {
  for (int i = 0; i < kNumDataTypes; ++i)
    if (kTypes[i].name == text) return static_cast<DataType>(i);
  static const std::pair<std::string_view, DataType> kAliases[] = {
      {"char", DataType::kInt8},         {"uchar", DataType::kUint8},      {"int", DataType::kInt32},
      {"uint", DataType::kUint32},       {"float16", DataType::kFloat16},  {"fp16", DataType::kFloat16},
      {"float32", DataType::kFloat32},   {"fp32", DataType::kFloat32},     {"float64", DataType::kFloat64},
      {"fp64", DataType::kFloat64},      {"bf16", DataType::kBfloat16},    {"fp8_e4m3", DataType::kFp8E4M3},
      {"fp8_e5m2", DataType::kFp8E5M2}, {"e4m3", DataType::kFp8E4M3},     {"e5m2", DataType::kFp8E5M2}};
  for (auto& [alias, type] : kAliases)
    if (alias == text) return type;
  return std::nullopt;
}

std::optional<RedOp> parse_redop(std::string_view text) {
  for (int i = 0; i < kNumRedOps; ++i)
    if (kOps[i] == text) return static_cast<RedOp>(i);
  return std::nullopt;
}

}  // namespace tutti
