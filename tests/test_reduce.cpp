// The Highway reduction kernels against a plain scalar reference, and the streaming copy against
// memcpy, bit for bit, for every type and operator, on odd sizes and misaligned pointers.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/copy.hpp"
#include "core/element.hpp"
#include "core/error.hpp"
#include "core/reduce.hpp"

using namespace tutti;

namespace {

// Random element bits: integers anywhere; floats finite and moderate so products stay finite.
void random_fill(DataType t, unsigned char* p, size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> real(-8.0, 8.0);
  for (size_t i = 0; i < n; ++i) {
    switch (t) {
      case DataType::kFloat32: { float v = static_cast<float>(real(rng)); std::memcpy(p + 4 * i, &v, 4); break; }
      case DataType::kFloat64: { double v = real(rng); std::memcpy(p + 8 * i, &v, 8); break; }
      case DataType::kFloat16: { uint16_t v = element::float_to_half(static_cast<float>(real(rng))); std::memcpy(p + 2 * i, &v, 2); break; }
      case DataType::kBfloat16: { uint16_t v = element::float_to_bf16(static_cast<float>(real(rng))); std::memcpy(p + 2 * i, &v, 2); break; }
      case DataType::kFp8E4M3: p[i] = element::float_to_e4m3(static_cast<float>(real(rng))); break;
      case DataType::kFp8E5M2: p[i] = element::float_to_e5m2(static_cast<float>(real(rng))); break;
      default: {
        uint64_t v = rng();
        std::memcpy(p + size_of(t) * i, &v, size_of(t));
      }
    }
  }
}

template <class T>
T load(const unsigned char* p, size_t i) {
  T v;
  std::memcpy(&v, p + sizeof(T) * i, sizeof(T));
  return v;
}
template <class T>
void put(unsigned char* p, size_t i, T v) {
  std::memcpy(p + sizeof(T) * i, &v, sizeof(T));
}

template <class T>
T apply(RedOp op, T a, T b) {
  switch (op) {
    case RedOp::kProd: return element::op_prod(a, b);
    case RedOp::kMin: return element::op_min(a, b);
    case RedOp::kMax: return element::op_max(a, b);
    default: return element::op_sum(a, b);
  }
}

// Scalar reference of reduce(): element by element, straight from the definitions.
template <class T>
void reference_native(const Reduction& red, unsigned char* dst, const std::vector<const unsigned char*>& srcs, size_t n) {
  T scalar;
  std::memcpy(&scalar, red.scalar, sizeof(T));
  for (size_t i = 0; i < n; ++i) {
    auto contribution = [&](size_t s) {
      T v = load<T>(srcs[s], i);
      return red.op == RedOp::kPreMulSum ? element::op_prod(v, scalar) : v;
    };
    T acc = contribution(0);
    for (size_t s = 1; s < srcs.size(); ++s) acc = apply(red.op, acc, contribution(s));
    if (red.op == RedOp::kAvg) acc = element::op_div(acc, srcs.size());
    put<T>(dst, i, acc);
  }
}

template <class F>
void reference_mini(const Reduction& red, unsigned char* dst, const std::vector<const unsigned char*>& srcs, size_t n) {
  using Bits = typename F::Bits;
  Bits sb;
  std::memcpy(&sb, red.scalar, sizeof(Bits));
  float scalar = F::load(sb);
  for (size_t i = 0; i < n; ++i) {
    auto contribution = [&](size_t s) {
      float v = F::load(load<Bits>(srcs[s], i));
      return red.op == RedOp::kPreMulSum ? F::load(F::store(v * scalar)) : v;
    };
    float acc = contribution(0);
    for (size_t s = 1; s < srcs.size(); ++s) acc = F::load(F::store(apply<float>(red.op, acc, contribution(s))));
    if (red.op == RedOp::kAvg) acc = F::load(F::store(acc / static_cast<float>(srcs.size())));
    put<Bits>(dst, i, F::store(acc));
  }
}

void reference(const Reduction& red, unsigned char* dst, const std::vector<const unsigned char*>& srcs, size_t n) {
  switch (red.type) {
    case DataType::kInt8: return reference_native<int8_t>(red, dst, srcs, n);
    case DataType::kUint8: return reference_native<uint8_t>(red, dst, srcs, n);
    case DataType::kInt32: return reference_native<int32_t>(red, dst, srcs, n);
    case DataType::kUint32: return reference_native<uint32_t>(red, dst, srcs, n);
    case DataType::kInt64: return reference_native<int64_t>(red, dst, srcs, n);
    case DataType::kUint64: return reference_native<uint64_t>(red, dst, srcs, n);
    case DataType::kFloat32: return reference_native<float>(red, dst, srcs, n);
    case DataType::kFloat64: return reference_native<double>(red, dst, srcs, n);
    case DataType::kFloat16: return reference_mini<element::HalfT>(red, dst, srcs, n);
    case DataType::kBfloat16: return reference_mini<element::Bf16T>(red, dst, srcs, n);
    case DataType::kFp8E4M3: return reference_mini<element::E4M3T>(red, dst, srcs, n);
    case DataType::kFp8E5M2: return reference_mini<element::E5M2T>(red, dst, srcs, n);
  }
}

class ReduceTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(ReduceTest, MatchesScalarReferenceBitForBit) {
  auto type = static_cast<DataType>(std::get<0>(GetParam()));
  auto op = static_cast<RedOp>(std::get<1>(GetParam()));
  const size_t es = size_of(type);
  std::mt19937_64 rng(1234 + 17 * std::get<0>(GetParam()) + std::get<1>(GetParam()));
  for (size_t n : {size_t{0}, size_t{1}, size_t{3}, size_t{7}, size_t{31}, size_t{64}, size_t{65}, size_t{1000}, size_t{4099}}) {
    for (size_t misalign : {size_t{0}, size_t{1}, size_t{3}}) {
      for (size_t nsrcs : {size_t{1}, size_t{2}, size_t{3}, size_t{5}}) {
        std::vector<std::vector<unsigned char>> store(nsrcs, std::vector<unsigned char>(n * es + 16));
        std::vector<const unsigned char*> srcs;
        for (auto& s : store) {
          random_fill(type, s.data() + misalign, n, rng);
          srcs.push_back(s.data() + misalign);
        }
        Reduction red;
        red.op = op;
        red.type = type;
        random_fill(type, red.scalar, 1, rng);
        std::vector<unsigned char> got(n * es + 16, 0xcd), want(n * es + 16, 0xcd);
        std::vector<const void*> vsrcs(srcs.begin(), srcs.end());
        reduce(red, got.data() + misalign, vsrcs, n);
        reference(red, want.data() + misalign, srcs, n);
        ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size()), 0)
            << name(type) << " " << name(op) << " n=" << n << " misalign=" << misalign << " srcs=" << nsrcs;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllTypesAllOps, ReduceTest,
                         ::testing::Combine(::testing::Range(0, kNumDataTypes), ::testing::Range(0, kNumRedOps)),
                         [](const auto& info) {
                           return std::string(name(static_cast<DataType>(std::get<0>(info.param)))) + "_" +
                                  std::string(name(static_cast<RedOp>(std::get<1>(info.param))));
                         });

TEST(Reduce, BinaryCombineInPlaceEqualsNary) {
  std::mt19937_64 rng(7);
  const size_t n = 1001;
  std::vector<float> a(n), b(n), c(n);
  for (size_t i = 0; i < n; ++i) a[i] = static_cast<float>(rng() % 1000), b[i] = static_cast<float>(rng() % 1000), c[i] = static_cast<float>(rng() % 1000);
  std::vector<float> chain = a;
  combine(RedOp::kSum, DataType::kFloat32, chain.data(), chain.data(), b.data(), n);
  combine(RedOp::kSum, DataType::kFloat32, chain.data(), chain.data(), c.data(), n);
  std::vector<float> nary(n);
  const void* srcs[] = {a.data(), b.data(), c.data()};
  combine_n(RedOp::kSum, DataType::kFloat32, nary.data(), srcs, n);
  EXPECT_EQ(std::memcmp(chain.data(), nary.data(), n * 4), 0);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(nary[i], a[i] + b[i] + c[i]);
}

TEST(Reduce, IntegersWrapAndAverageTruncates) {
  int8_t a[] = {127, -128, -7}, b[] = {1, -1, 0}, out[3];
  combine(RedOp::kSum, DataType::kInt8, out, a, b, 3);
  EXPECT_EQ(out[0], -128);
  EXPECT_EQ(out[1], 127);
  int32_t x[] = {-7, 7}, y[] = {0, 0}, avg[2];
  Reduction red;
  red.op = RedOp::kAvg;
  red.type = DataType::kInt32;
  const void* srcs[] = {x, y};
  reduce(red, avg, srcs, 2);
  EXPECT_EQ(avg[0], -3);
  EXPECT_EQ(avg[1], 3);
}

TEST(Reduce, BadArgumentsAreNamed) {
  float a = 1, b = 2, c;
  try {
    combine(static_cast<RedOp>(17), DataType::kFloat32, &c, &a, &b, 1);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("invalid operator 17"), std::string::npos) << e.what();
  }
  EXPECT_THROW(combine(RedOp::kSum, static_cast<DataType>(-1), &c, &a, &b, 1), InvalidArgument);
  EXPECT_NE(std::string(reduce_target_name()), "");
}

// Streaming copies land every byte, and only those, for every size around the vector and
// cache-line edges and every destination/source misalignment.
TEST(Copy, StreamingMatchesMemcpyAtEveryAlignment) {
  std::mt19937_64 rng(7);
  std::vector<unsigned char> src(70000), dst(70000 + 64), want(dst.size());
  for (auto& b : src) b = static_cast<unsigned char>(rng());
  for (size_t bytes : {0u, 1u, 15u, 16u, 63u, 255u, 256u, 257u, 1000u, 4096u, 65536u + 17u}) {
    for (size_t doff = 0; doff < 17; doff += 3) {
      for (size_t soff = 0; soff < 17; soff += 4) {
        std::fill(dst.begin(), dst.end(), 0xA5);
        want = dst;
        std::memcpy(want.data() + doff, src.data() + soff, bytes);
        copy_streaming(dst.data() + doff, src.data() + soff, bytes);
        ASSERT_EQ(dst, want) << bytes << " bytes, dst+" << doff << ", src+" << soff;
        std::fill(dst.begin(), dst.end(), 0xA5);
        copy_bytes(dst.data() + doff, src.data() + soff, bytes, false);
        ASSERT_EQ(dst, want) << "memcpy path, " << bytes << " bytes";
      }
    }
  }
}

}  // namespace
