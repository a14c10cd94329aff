// Conversions of the low-precision formats against known bit patterns, and exhaustive round trips.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/datatype.hpp"
#include "core/element.hpp"

using namespace tutti;
using namespace tutti::element;

namespace {
float f(uint32_t bits) { return bits_float(bits); }
float p2(int e) { return std::ldexp(1.0f, e); }
}  // namespace

TEST(DataType, SizesAndNamesFollowNccl) {
  EXPECT_EQ(size_of(DataType::kInt8), 1u);
  EXPECT_EQ(size_of(DataType::kFloat16), 2u);
  EXPECT_EQ(size_of(DataType::kBfloat16), 2u);
  EXPECT_EQ(size_of(DataType::kFloat64), 8u);
  EXPECT_EQ(size_of(DataType::kFp8E5M2), 1u);
  EXPECT_EQ(static_cast<int>(DataType::kBfloat16), 9);  // ncclBfloat16
  EXPECT_EQ(static_cast<int>(RedOp::kAvg), 4);          // ncclAvg
  EXPECT_EQ(parse_datatype("half"), DataType::kFloat16);
  EXPECT_EQ(parse_datatype("bf16"), DataType::kBfloat16);
  EXPECT_FALSE(parse_datatype("float128").has_value());
  EXPECT_EQ(name(DataType::kFp8E4M3), "f8e4m3");
  EXPECT_FALSE(is_valid(static_cast<DataType>(12)));
}

TEST(Half, KnownPatterns) {
  EXPECT_EQ(float_to_half(1.0f), 0x3c00);
  EXPECT_EQ(float_to_half(-2.0f), 0xc000);
  EXPECT_EQ(float_to_half(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_half(65519.0f), 0x7bff);     // below the halfway point to 65536
  EXPECT_EQ(float_to_half(65520.0f), 0x7c00);     // halfway: rounds to even = infinity
  EXPECT_EQ(float_to_half(p2(-24)), 0x0001);      // smallest subnormal
  EXPECT_EQ(float_to_half(p2(-25)), 0x0000);      // tie to even: zero
  EXPECT_EQ(float_to_half(1.5f * p2(-25)), 0x0001);
  EXPECT_EQ(float_to_half(p2(-14)), 0x0400);      // smallest normal
  EXPECT_EQ(float_to_half(0.1f), 0x2e66);
  EXPECT_EQ(float_to_half(1.0f / 3.0f), 0x3555);
  EXPECT_EQ(float_to_half(1.0f + p2(-11)), 0x3c00);        // tie: even
  EXPECT_EQ(float_to_half(1.0f + 3 * p2(-11)), 0x3c02);    // tie: up to even
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(float_to_half(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(float_to_half(std::nanf("")), 0x7e00);
  EXPECT_EQ(float_to_half(-0.0f), 0x8000);
  EXPECT_EQ(half_to_float(0x3c00), 1.0f);
  EXPECT_EQ(half_to_float(0x0001), p2(-24));
  EXPECT_EQ(half_to_float(0x7bff), 65504.0f);
  EXPECT_TRUE(std::isinf(half_to_float(0x7c00)));
  EXPECT_TRUE(std::isnan(half_to_float(0x7e01)));
}

TEST(BFloat16, KnownPatterns) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(f(0x3dcccccd)), 0x3dcd);  // 0.1
  EXPECT_EQ(float_to_bf16(3.14159265f), 0x4049);
  EXPECT_EQ(float_to_bf16(f(0x3f808000)), 0x3f80);  // tie: even (down)
  EXPECT_EQ(float_to_bf16(f(0x3f818000)), 0x3f82);  // tie: even (up)
  EXPECT_EQ(float_to_bf16(f(0x3f808001)), 0x3f81);
  EXPECT_EQ(float_to_bf16(f(0x7f7fffff)), 0x7f80);  // FLT_MAX rounds to infinity
  EXPECT_EQ(float_to_bf16(f(0x00000001)), 0x0000);  // float subnormal below bf16's half ulp
  EXPECT_EQ(float_to_bf16(f(0x00010000)), 0x0001);  // bf16 subnormal
  EXPECT_EQ(float_to_bf16(std::nanf("")), 0x7fc0);
  EXPECT_EQ(bf16_to_float(0x4049), f(0x40490000));
}

TEST(Fp8E4M3, KnownPatterns) {
  EXPECT_EQ(float_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(float_to_e4m3(-0.5f), 0xb0);
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7e);   // largest finite
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7e);   // tie between 448 and 480: even (448)
  EXPECT_EQ(float_to_e4m3(480.0f), 0x7f);   // beyond: NaN (no infinity in e4m3fn)
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::infinity()), 0x7f);
  EXPECT_EQ(float_to_e4m3(p2(-9)), 0x01);   // smallest subnormal
  EXPECT_EQ(float_to_e4m3(p2(-10)), 0x00);  // tie to even: zero
  EXPECT_EQ(float_to_e4m3(p2(-6)), 0x08);   // smallest normal
  EXPECT_EQ(float_to_e4m3(0.3f), 0x2a);     // 0.3 -> 0.3125 (nearer than 0.28125)
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), p2(-9));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xff)));
}

TEST(Fp8E5M2, KnownPatterns) {
  EXPECT_EQ(float_to_e5m2(1.0f), 0x3c);
  EXPECT_EQ(float_to_e5m2(57344.0f), 0x7b);  // largest finite
  EXPECT_EQ(float_to_e5m2(61440.0f), 0x7c);  // tie: even = infinity
  EXPECT_EQ(float_to_e5m2(p2(-16)), 0x01);
  EXPECT_EQ(float_to_e5m2(-3.0f), 0xc2);
  EXPECT_EQ(float_to_e5m2(std::nanf("")), 0x7e);
  EXPECT_TRUE(std::isinf(e5m2_to_float(0x7c)));
  EXPECT_EQ(e5m2_to_float(0x7b), 57344.0f);
}

template <class Decode, class Encode>
void expect_round_trip(int codes, Decode decode, Encode encode, const char* what) {
  for (int b = 0; b < codes; ++b) {
    float v = decode(static_cast<uint32_t>(b));
    if (std::isnan(v)) continue;
    ASSERT_EQ(encode(v), static_cast<uint32_t>(b)) << what << " code " << b;
  }
}

TEST(MiniFloats, EveryCodeRoundTrips) {
  expect_round_trip(1 << 16, [](uint32_t b) { return half_to_float(static_cast<uint16_t>(b)); },
                    [](float v) { return static_cast<uint32_t>(float_to_half(v)); }, "half");
  expect_round_trip(1 << 16, [](uint32_t b) { return bf16_to_float(static_cast<uint16_t>(b)); },
                    [](float v) { return static_cast<uint32_t>(float_to_bf16(v)); }, "bf16");
  expect_round_trip(256, [](uint32_t b) { return e4m3_to_float(static_cast<uint8_t>(b)); },
                    [](float v) { return static_cast<uint32_t>(float_to_e4m3(v)); }, "e4m3");
  expect_round_trip(256, [](uint32_t b) { return e5m2_to_float(static_cast<uint8_t>(b)); },
                    [](float v) { return static_cast<uint32_t>(float_to_e5m2(v)); }, "e5m2");
}

TEST(MiniFloats, RoundingMatchesDoubleReference) {
  // Every half value's midpoint with its successor must round to the even neighbour.
  for (uint32_t b = 0; b < 0x7bff; ++b) {
    double lo = half_to_float(static_cast<uint16_t>(b)), hi = half_to_float(static_cast<uint16_t>(b + 1));
    float mid = static_cast<float>((lo + hi) / 2);  // exact in float
    uint32_t expect = (b & 1) ? b + 1 : b;
    ASSERT_EQ(float_to_half(mid), expect) << "midpoint after half code " << b;
  }
}
