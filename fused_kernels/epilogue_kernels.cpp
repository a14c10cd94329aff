#include "fused_kernels/epilogue_kernels.hpp"

// Highway's per-target compilation, as optimizer_kernels.cpp. Built with -ffp-contract=off: the
// scalar tail must not fuse the multiply and the add where the vector body does not.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "fused_kernels/epilogue_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <cmath>

#include "runtime/device/kernels.hpp"  // dropout_kept: the mask every form draws

HWY_BEFORE_NAMESPACE();
namespace tutti::fused::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET != HWY_SCALAR
// The low 64 bits of a * b per lane, from 32 x 32 -> 64 products (Highway 1.0 has no 64-bit Mul).
template <class D64, class V>
HWY_INLINE V MulLow64(D64, V a, V b) {
  const hn::Repartition<uint32_t, D64> d32;
  const V lo_lo = hn::MulEven(hn::BitCast(d32, a), hn::BitCast(d32, b));
  const V hi_lo = hn::MulEven(hn::BitCast(d32, hn::ShiftRight<32>(a)), hn::BitCast(d32, b));
  const V lo_hi = hn::MulEven(hn::BitCast(d32, a), hn::BitCast(d32, hn::ShiftRight<32>(b)));
  return hn::Add(lo_lo, hn::ShiftLeft<32>(hn::Add(hi_lo, lo_hi)));
}

// device::dropout_kept's hash, z >> 40, of the indexes in `index` (lanes of 64 bits).
template <class D64, class V>
HWY_INLINE V DropoutBits(D64 d64, V index, V start, V c1, V c2) {
  V z = hn::Add(index, start);
  z = MulLow64(d64, hn::Xor(z, hn::ShiftRight<30>(z)), c1);
  z = MulLow64(d64, hn::Xor(z, hn::ShiftRight<27>(z)), c2);
  z = hn::Xor(z, hn::ShiftRight<31>(z));
  return hn::ShiftRight<40>(z);
}

#endif

// The device form's operations on element c of row r.
HWY_INLINE float OneElement(const BiasDropoutArgs& a, int64_t r, int64_t c) {
  const int64_t i = r + c;
  const float x = a.y[i] + a.bias[c];
  if (!a.dropout) return a.residual[i] + x;
  return a.residual[i] +
         (device::dropout_kept(a.seed, a.first_index + static_cast<uint64_t>(i), a.threshold) ? x * a.scale : 0.0f);
}

void BiasDropoutAddRows(const BiasDropoutArgs& a) {
#if HWY_TARGET == HWY_SCALAR  // no vectors of 64-bit lanes to hash in
  for (int64_t r = 0; r < a.count; r += a.hidden)
    for (int64_t c = 0; c < a.hidden; ++c) a.out[r + c] = OneElement(a, r, c);
#else
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Repartition<uint32_t, decltype(df)> du32;
  const hn::Repartition<uint64_t, decltype(df)> du64;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df)), half = static_cast<int64_t>(hn::Lanes(du64));
  const auto scale = hn::Set(df, a.scale);
  const auto threshold = hn::Set(di, static_cast<int32_t>(a.threshold));
  // z = seed * K + index + L (wrapping): the index-free part once.
  const auto start = hn::Set(du64, a.seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull);
  const auto c1 = hn::Set(du64, 0xBF58476D1CE4E5B9ull), c2 = hn::Set(du64, 0x94D049BB133111EBull);
  for (int64_t r = 0; r < a.count; r += a.hidden) {
    int64_t c = 0;
    for (; c + N <= a.hidden; c += N) {
      const int64_t i = r + c;
      const auto x = hn::Add(hn::LoadU(df, a.y + i), hn::LoadU(df, a.bias + c));
      const auto res = hn::LoadU(df, a.residual + i);
      if (!a.dropout) {
        hn::StoreU(hn::Add(res, x), df, a.out + i);
        continue;
      }
      const uint64_t first = a.first_index + static_cast<uint64_t>(i);
      const auto lo = DropoutBits(du64, hn::Iota(du64, first), start, c1, c2);
      const auto hi = DropoutBits(du64, hn::Iota(du64, first + static_cast<uint64_t>(half)), start, c1, c2);
      // Each lane's 24 bits sit in the low half of its 64: the even 32-bit halves, in order.
      const auto bits = hn::BitCast(di, hn::ConcatEven(du32, hn::BitCast(du32, hi), hn::BitCast(du32, lo)));
      const auto dropped = hn::RebindMask(df, hn::Lt(bits, threshold));
      hn::StoreU(hn::Add(res, hn::IfThenZeroElse(dropped, hn::Mul(x, scale))), df, a.out + i);
    }
    for (; c < a.hidden; ++c) a.out[r + c] = OneElement(a, r, c);
  }
#endif
}

// The sum of f(x[c]) over a row in device::row_sum's order for a team of one: element c into lane
// c % 8, the lanes combined by device::lane_tree. f: promoted values in, doubles out.
template <class F>
HWY_INLINE double LaneSum(const float* x, int64_t hidden, F f) {
  const hn::CappedTag<double, 8> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const int64_t L = static_cast<int64_t>(hn::Lanes(dd)), V = 8 / L;  // V vectors of L lanes: 8 lanes
  HWY_ALIGN double lanes[8];
  for (int64_t v = 0; v < V; ++v) hn::Store(hn::Zero(dd), dd, lanes + v * L);
  int64_t c = 0;
  for (; c + 8 <= hidden; c += 8)
    for (int64_t v = 0; v < V; ++v)
      hn::Store(hn::Add(hn::Load(dd, lanes + v * L), f(dd, hn::PromoteTo(dd, hn::LoadU(df, x + c + v * L)))), dd,
                lanes + v * L);
  for (; c < hidden; ++c) {
    const auto one = hn::CappedTag<double, 1>();
    lanes[c % 8] += hn::GetLane(f(one, hn::Set(one, static_cast<double>(x[c]))));
  }
  return device::lane_tree(lanes);
}

void LayerNormRows(const float* x, const float* gamma, const float* beta, float* ln, int64_t count, int64_t hidden,
                   float eps) {
  const hn::ScalableTag<float> df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  for (int64_t r = 0; r < count; r += hidden) {
    const float* row = x + r;
    const double sum = LaneSum(row, hidden, [](auto, auto v) { return v; });
    const float mean = static_cast<float>(sum / static_cast<double>(hidden));
    // (x - mean) in float, then squared in double: the device form's deviation.
    const double sq = LaneSum(row, hidden, [mean](auto d, auto v) {
      const hn::Rebind<float, decltype(d)> f;
      const auto dev = hn::PromoteTo(d, hn::Sub(hn::DemoteTo(f, v), hn::Set(f, mean)));
      return hn::Mul(dev, dev);
    });
    const float rstd = 1.0f / std::sqrt(static_cast<float>(sq / static_cast<double>(hidden)) + eps);
    const auto vmean = hn::Set(df, mean), vrstd = hn::Set(df, rstd);
    int64_t c = 0;
    for (; c + N <= hidden; c += N) {
      const auto v = hn::Mul(hn::Mul(hn::Sub(hn::LoadU(df, row + c), vmean), vrstd), hn::LoadU(df, gamma + c));
      hn::StoreU(hn::Add(v, hn::LoadU(df, beta + c)), df, ln + r + c);
    }
    for (; c < hidden; ++c) ln[r + c] = (row[c] - mean) * rstd * gamma[c] + beta[c];
  }
}

}  // namespace tutti::fused::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tutti::fused {

HWY_EXPORT(BiasDropoutAddRows);
HWY_EXPORT(LayerNormRows);

void bias_dropout_add_rows(const BiasDropoutArgs& args) { HWY_DYNAMIC_DISPATCH(BiasDropoutAddRows)(args); }

void layer_norm_rows(const float* x, const float* gamma, const float* beta, float* ln, int64_t count, int64_t hidden,
                     float eps) {
  HWY_DYNAMIC_DISPATCH(LayerNormRows)(x, gamma, beta, ln, count, hidden, eps);
}

}  // namespace tutti::fused
#endif
