#include "core/reduce.hpp"

#include "core/by_type.hpp"

// Highway's per-target compilation: this file is re-included once per instruction set.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "core/reduce.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "core/element.hpp"
#include "core/unaligned.hpp"

HWY_BEFORE_NAMESPACE();
namespace tutti::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Which (type, op) pairs Highway 1.0 vectorises on every x86/Arm target; the rest run the scalar
// loop from core/element.hpp (8- and 64-bit integer multiply, 64-bit integer min/max).
template <class T> constexpr bool kVecMul = std::is_floating_point_v<T> || sizeof(T) == 4;
template <class T> constexpr bool kVecMinMax = std::is_floating_point_v<T> || sizeof(T) <= 4;

template <class T, int kOp>
HWY_INLINE T scalar_op(T a, T b) {
  if constexpr (kOp == static_cast<int>(RedOp::kProd)) return element::op_prod(a, b);
  else if constexpr (kOp == static_cast<int>(RedOp::kMin)) return element::op_min(a, b);
  else if constexpr (kOp == static_cast<int>(RedOp::kMax)) return element::op_max(a, b);
  else return element::op_sum(a, b);
}

template <int kOp, class D, class V>
HWY_INLINE V vec_op(D, V a, V b) {
  if constexpr (kOp == static_cast<int>(RedOp::kProd)) return hn::Mul(a, b);
  else if constexpr (kOp == static_cast<int>(RedOp::kMin)) return hn::Min(a, b);
  else if constexpr (kOp == static_cast<int>(RedOp::kMax)) return hn::Max(a, b);
  else return hn::Add(a, b);
}

template <class T, int kOp>
void fold_typed(void* dst_v, const void* const* srcs_v, size_t nsrcs, size_t count) {
  T* dst = static_cast<T*>(dst_v);
  constexpr bool kVector = (kOp == static_cast<int>(RedOp::kProd))  ? kVecMul<T>
                           : (kOp == static_cast<int>(RedOp::kMin) || kOp == static_cast<int>(RedOp::kMax)) ? kVecMinMax<T>
                                                                                                           : true;
  size_t i = 0;
  if constexpr (kVector) {
    const hn::ScalableTag<T> d;
    const size_t lanes = hn::Lanes(d);
    // Unrolled by two: hides load latency for the common two-source case at little code cost.
    for (; i + 2 * lanes <= count; i += 2 * lanes) {
      auto acc0 = hn::LoadU(d, static_cast<const T*>(srcs_v[0]) + i);
      auto acc1 = hn::LoadU(d, static_cast<const T*>(srcs_v[0]) + i + lanes);
      for (size_t s = 1; s < nsrcs; ++s) {
        const T* src = static_cast<const T*>(srcs_v[s]);
        acc0 = vec_op<kOp>(d, acc0, hn::LoadU(d, src + i));
        acc1 = vec_op<kOp>(d, acc1, hn::LoadU(d, src + i + lanes));
      }
      hn::StoreU(acc0, d, dst + i);
      hn::StoreU(acc1, d, dst + i + lanes);
    }
    for (; i + lanes <= count; i += lanes) {
      auto acc = hn::LoadU(d, static_cast<const T*>(srcs_v[0]) + i);
      for (size_t s = 1; s < nsrcs; ++s) acc = vec_op<kOp>(d, acc, hn::LoadU(d, static_cast<const T*>(srcs_v[s]) + i));
      hn::StoreU(acc, d, dst + i);
    }
  }
  for (; i < count; ++i) {
    T acc = unaligned::load<T>(srcs_v[0], i);
    for (size_t s = 1; s < nsrcs; ++s) acc = scalar_op<T, kOp>(acc, unaligned::load<T>(srcs_v[s], i));
    unaligned::store<T>(dst, i, acc);
  }
}

// Low-precision floats: widen a block to float, fold with a rounding after each step, narrow.
template <class F, int kOp>
void fold_mini(void* dst_v, const void* const* srcs_v, size_t nsrcs, size_t count) {
  using Bits = typename F::Bits;
  for (size_t i = 0; i < count; ++i) {
    float acc = F::load(unaligned::load<Bits>(srcs_v[0], i));
    for (size_t s = 1; s < nsrcs; ++s) {
      float x = F::load(unaligned::load<Bits>(srcs_v[s], i));
      acc = F::load(F::store(scalar_op<float, kOp>(acc, x)));
    }
    unaligned::store<Bits>(dst_v, i, F::store(acc));
  }
}

template <int kOp>
void fold_op(int type, void* dst, const void* const* srcs, size_t nsrcs, size_t count) {
  switch (static_cast<DataType>(type)) {
    case DataType::kInt8: return fold_typed<int8_t, kOp>(dst, srcs, nsrcs, count);
    case DataType::kUint8: return fold_typed<uint8_t, kOp>(dst, srcs, nsrcs, count);
    case DataType::kInt32: return fold_typed<int32_t, kOp>(dst, srcs, nsrcs, count);
    case DataType::kUint32: return fold_typed<uint32_t, kOp>(dst, srcs, nsrcs, count);
    case DataType::kInt64: return fold_typed<int64_t, kOp>(dst, srcs, nsrcs, count);
    case DataType::kUint64: return fold_typed<uint64_t, kOp>(dst, srcs, nsrcs, count);
    case DataType::kFloat32: return fold_typed<float, kOp>(dst, srcs, nsrcs, count);
    case DataType::kFloat64: return fold_typed<double, kOp>(dst, srcs, nsrcs, count);
    case DataType::kFloat16: return fold_mini<element::HalfT, kOp>(dst, srcs, nsrcs, count);
    case DataType::kBfloat16: return fold_mini<element::Bf16T, kOp>(dst, srcs, nsrcs, count);
    case DataType::kFp8E4M3: return fold_mini<element::E4M3T, kOp>(dst, srcs, nsrcs, count);
    case DataType::kFp8E5M2: return fold_mini<element::E5M2T, kOp>(dst, srcs, nsrcs, count);
  }
}

void Fold(int op, int type, void* dst, const void* const* srcs, size_t nsrcs, size_t count) {
  switch (static_cast<RedOp>(op)) {
    case RedOp::kProd: return fold_op<static_cast<int>(RedOp::kProd)>(type, dst, srcs, nsrcs, count);
    case RedOp::kMin: return fold_op<static_cast<int>(RedOp::kMin)>(type, dst, srcs, nsrcs, count);
    case RedOp::kMax: return fold_op<static_cast<int>(RedOp::kMax)>(type, dst, srcs, nsrcs, count);
    default: return fold_op<static_cast<int>(RedOp::kSum)>(type, dst, srcs, nsrcs, count);
  }
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace tutti::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <vector>

#include "core/error.hpp"

namespace tutti {
HWY_EXPORT(Fold);
HWY_EXPORT(TargetName);

namespace {

void check(DataType type, RedOp op) {
  TUTTI_CHECK(is_valid(type), InvalidArgument, "reduction: invalid datatype {}", static_cast<int>(type));
  TUTTI_CHECK(is_valid(op), InvalidArgument, "reduction: invalid operator {}", static_cast<int>(op));
}

template <class T>
void scale_typed(void* dst, const void* src, const void* scalar, size_t count) {
  T s;
  std::memcpy(&s, scalar, sizeof(T));
  for (size_t i = 0; i < count; ++i) unaligned::store<T>(dst, i, element::op_prod(unaligned::load<T>(src, i), s));
}
template <class F>
void scale_mini(void* dst, const void* src, const void* scalar, size_t count) {
  typename F::Bits sb;
  std::memcpy(&sb, scalar, sizeof(sb));
  float s = F::load(sb);
  using Bits = typename F::Bits;
  for (size_t i = 0; i < count; ++i)
    unaligned::store<Bits>(dst, i, F::store(F::load(unaligned::load<Bits>(src, i)) * s));
}
template <class T>
void divide_typed(void* dst, const void* src, uint64_t n, size_t count) {
  for (size_t i = 0; i < count; ++i) unaligned::store<T>(dst, i, element::op_div(unaligned::load<T>(src, i), n));
}
template <class F>
void divide_mini(void* dst, const void* src, uint64_t n, size_t count) {
  using Bits = typename F::Bits;
  for (size_t i = 0; i < count; ++i)
    unaligned::store<Bits>(dst, i, F::store(F::load(unaligned::load<Bits>(src, i)) / static_cast<float>(n)));
}

}  // namespace

void combine(RedOp op, DataType type, void* dst, const void* a, const void* b, size_t count) {
  check(type, op);
  const void* srcs[2] = {a, b};
  HWY_DYNAMIC_DISPATCH(Fold)(static_cast<int>(op), static_cast<int>(type), dst, srcs, 2, count);
}

void combine_n(RedOp op, DataType type, void* dst, std::span<const void* const> srcs, size_t count) {
  check(type, op);
  TUTTI_CHECK(!srcs.empty(), InvalidArgument, "reduction: no sources");
  if (srcs.size() == 1) {
    if (dst != srcs[0]) std::memmove(dst, srcs[0], count * size_of(type));
    return;
  }
  HWY_DYNAMIC_DISPATCH(Fold)(static_cast<int>(op), static_cast<int>(type), dst, srcs.data(), srcs.size(), count);
}

void scale(DataType type, void* dst, const void* src, const void* scalar, size_t count) {
  check(type, RedOp::kSum);
  by_type(
      type, [&](auto t) { scale_typed<decltype(t)>(dst, src, scalar, count); },
      [&](auto f) { scale_mini<decltype(f)>(dst, src, scalar, count); });
}

void divide(DataType type, void* dst, const void* src, uint64_t divisor, size_t count) {
  check(type, RedOp::kSum);
  TUTTI_CHECK(divisor > 0, InvalidArgument, "reduction: avg over zero contributions");
  by_type(
      type, [&](auto t) { divide_typed<decltype(t)>(dst, src, divisor, count); },
      [&](auto f) { divide_mini<decltype(f)>(dst, src, divisor, count); });
}

void reduce(const Reduction& red, void* dst, std::span<const void* const> srcs, size_t count) {
  check(red.type, red.op);
  TUTTI_CHECK(!srcs.empty(), InvalidArgument, "reduction: no sources");
  if (red.op == RedOp::kPreMulSum) {
    // Accumulate apart from dst, which may alias any source.
    size_t bytes = count * size_of(red.type);
    std::vector<unsigned char> acc(bytes), tmp(bytes);
    scale(red.type, acc.data(), srcs[0], red.scalar, count);
    for (size_t s = 1; s < srcs.size(); ++s) {
      scale(red.type, tmp.data(), srcs[s], red.scalar, count);
      combine(RedOp::kSum, red.type, acc.data(), acc.data(), tmp.data(), count);
    }
    if (bytes) std::memcpy(dst, acc.data(), bytes);
    return;
  }
  combine_n(red.op, red.type, dst, srcs, count);
  if (red.op == RedOp::kAvg) divide(red.type, dst, dst, srcs.size(), count);
}

const char* reduce_target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

void store_value(DataType type, void* dst, double v) {
  auto put = [&](auto x) { std::memcpy(dst, &x, sizeof(x)); };
  switch (type) {
    case DataType::kInt8: return put(static_cast<int8_t>(v));
    case DataType::kUint8: return put(static_cast<uint8_t>(static_cast<int64_t>(v)));
    case DataType::kInt32: return put(static_cast<int32_t>(v));
    case DataType::kUint32: return put(static_cast<uint32_t>(static_cast<int64_t>(v)));
    case DataType::kInt64: return put(static_cast<int64_t>(v));
    case DataType::kUint64: return put(static_cast<uint64_t>(static_cast<int64_t>(v)));
    case DataType::kFloat32: return put(static_cast<float>(v));
    case DataType::kFloat64: return put(v);
    case DataType::kFloat16: return put(element::float_to_half(static_cast<float>(v)));
    case DataType::kBfloat16: return put(element::float_to_bf16(static_cast<float>(v)));
    case DataType::kFp8E4M3: return put(element::float_to_e4m3(static_cast<float>(v)));
    case DataType::kFp8E5M2: return put(element::float_to_e5m2(static_cast<float>(v)));
  }
}

}  // namespace tutti
#endif
