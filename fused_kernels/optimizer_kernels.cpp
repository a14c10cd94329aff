#include "fused_kernels/optimizer_kernels.hpp"

// Highway's per-target compilation: this file is re-included once per instruction set, and the
// best one the CPU has is chosen at run time (as core/reduce.cpp). Built with -ffp-contract=off:
// every element gets the same multiplies and adds on every target and in the scalar tail, so a
// parameter's update does not depend on where a chunk boundary falls (fused == unfused bit for bit).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "fused_kernels/optimizer_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>

HWY_BEFORE_NAMESPACE();
namespace tutti::fused::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The sum of squares is taken over groups of kGroup elements counted from the chunk's start: each
// group's squares are summed in float vectors (a lane adds at most kGroup / Lanes(float) of them),
// and the group's sum is added to the double accumulators. Summing the squares in double element by
// element cost twice the instructions, and the pass runs on a chunk still in cache, where
// instructions, not memory, are its time. A chunk cut into pieces of whole groups gives the same
// sum, bit for bit, wherever the cuts fall.
constexpr int64_t kGroup = kSquareGroup;
static_assert(kGroup % (HWY_MAX_BYTES / sizeof(float)) == 0, "a group is whole float vectors on every target");

// Adds the squares of one group x[0, kGroup) to acc0 and acc1 (after out = x * scale when Scale).
template <bool Scale, class DD, class DF>
HWY_INLINE void SquareGroup(DD dd, DF df, float* out, const float* in, hn::Vec<DF> vs, hn::Vec<DD>& acc0,
                            hn::Vec<DD>& acc1) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  // Four independent sums: one chain of multiply-adds would wait out its latency on every vector.
  auto sq0 = hn::Zero(df), sq1 = hn::Zero(df), sq2 = hn::Zero(df), sq3 = hn::Zero(df);
  auto square = [&](int64_t j, hn::Vec<DF>& sq) {
    auto x = hn::LoadU(df, in + j);
    if constexpr (Scale) {
      x = hn::Mul(x, vs);
      hn::StoreU(x, df, out + j);
    }
    sq = hn::MulAdd(x, x, sq);
  };
  if (4 * N <= kGroup) {
    for (int64_t j = 0; j < kGroup; j += 4 * N) {
      square(j, sq0);
      square(j + N, sq1);
      square(j + 2 * N, sq2);
      square(j + 3 * N, sq3);
    }
  } else {  // vectors wider than a quarter of a group (long SVE or RVV): one sum
    for (int64_t j = 0; j < kGroup; j += N) square(j, sq0);
  }
  const auto sum = hn::Add(hn::Add(sq0, sq1), hn::Add(sq2, sq3));
#if HWY_TARGET == HWY_SCALAR  // one lane: nothing to split
  (void)acc1;
  acc0 = hn::Add(acc0, hn::PromoteTo(dd, sum));
#else
  const hn::Half<DF> dh;
  acc0 = hn::Add(acc0, hn::PromoteTo(dd, hn::LowerHalf(dh, sum)));
  acc1 = hn::Add(acc1, hn::PromoteTo(dd, hn::UpperHalf(dh, sum)));
#endif
}

// UnscaleSquare over a chunk given in consecutive pieces: `acc` (2 * Lanes(double) doubles, zero
// before the first piece) carries the double accumulators from piece to piece, and every piece but
// the last holds whole groups. Returns the sum on the last piece (the elements after the last whole
// group added one by one after the lanes, as for a whole chunk).
double UnscaleSquarePiece(float* out, const float* in, int64_t n, float scale, double* acc, bool last) {
  const hn::ScalableTag<float> df;
  const hn::Repartition<double, decltype(df)> dd;
  const int64_t N = static_cast<int64_t>(hn::Lanes(dd));
  const auto vs = hn::Set(df, scale);
  auto acc0 = hn::LoadU(dd, acc), acc1 = hn::LoadU(dd, acc + N);
  int64_t i = 0;
  for (; i + kGroup <= n; i += kGroup) SquareGroup<true>(dd, df, out + i, in + i, vs, acc0, acc1);
  if (!last) {
    hn::StoreU(acc0, dd, acc);
    hn::StoreU(acc1, dd, acc + N);
    return 0;
  }
  double sum = hn::GetLane(hn::SumOfLanes(dd, hn::Add(acc0, acc1)));
  for (; i < n; ++i) {
    const float x = in[i] * scale;
    out[i] = x;
    sum += static_cast<double>(x) * static_cast<double>(x);
  }
  return sum;
}

// The bytes UnscaleSquarePiece's `acc` holds on this target.
size_t UnscaleSquareStateBytes() { return 2 * hn::Lanes(hn::ScalableTag<double>()) * sizeof(double); }

double UnscaleSquare(float* out, const float* in, int64_t n, float scale) {
  double acc[2 * HWY_MAX_BYTES / sizeof(double)];
  std::fill_n(acc, 2 * hn::Lanes(hn::ScalableTag<double>()), 0.0);
  return UnscaleSquarePiece(out, in, n, scale, acc, true);
}

// The sum of squares of x, accumulated exactly as UnscaleSquare accumulates it (so a separate
// norm pass over unscaled data gives the same double).
double SumSquares(const float* in, int64_t n) {
  const hn::ScalableTag<float> df;
  const hn::Repartition<double, decltype(df)> dd;
  auto acc0 = hn::Zero(dd), acc1 = hn::Zero(dd);
  int64_t i = 0;
  for (; i + kGroup <= n; i += kGroup) SquareGroup<false>(dd, df, nullptr, in + i, hn::Zero(df), acc0, acc1);
  double sum = hn::GetLane(hn::SumOfLanes(dd, hn::Add(acc0, acc1)));
  for (; i < n; ++i) sum += static_cast<double>(in[i]) * static_cast<double>(in[i]);
  return sum;
}

// x *= factor; returns whether every result is finite.
bool ScaleCheck(float* x, int64_t n, float factor) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto f = hn::Set(d, factor), inf = hn::Set(d, HUGE_VALF);
  auto finite = hn::Eq(f, f);  // all true
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    const auto v = hn::Mul(hn::LoadU(d, x + i), f);
    hn::StoreU(v, d, x + i);
    finite = hn::And(finite, hn::Lt(hn::Abs(v), inf));
  }
  bool ok = hn::AllTrue(d, finite);
  for (; i < n; ++i) {
    x[i] *= factor;
    ok = ok && std::isfinite(x[i]);
  }
  return ok;
}

void AdamwUpdate(const AdamwArgs& a, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto clip = hn::Set(d, a.clip), b1 = hn::Set(d, a.beta1), b2 = hn::Set(d, a.beta2),
             one_b1 = hn::Set(d, 1.0f - a.beta1), one_b2 = hn::Set(d, 1.0f - a.beta2), eps = hn::Set(d, a.eps),
             decay = hn::Set(d, a.decay), step_size = hn::Set(d, a.step_size), c2 = hn::Set(d, a.c2_sqrt);
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    const auto g = hn::Mul(hn::LoadU(d, a.g + i), clip);
    const auto m = hn::Add(hn::Mul(hn::LoadU(d, a.m_in + i), b1), hn::Mul(g, one_b1));
    const auto v = hn::Add(hn::Mul(hn::LoadU(d, a.v_in + i), b2), hn::Mul(hn::Mul(g, g), one_b2));
    const auto denom = hn::Add(hn::Div(hn::Sqrt(v), c2), eps);
    const auto dec = a.decay_mask ? hn::Sub(hn::Set(d, 1.0f), hn::Mul(hn::Set(d, a.lr_wd), hn::LoadU(d, a.decay_mask + i)))
                                  : decay;
    const auto p = hn::Sub(hn::Mul(hn::LoadU(d, a.p_in + i), dec), hn::Mul(step_size, hn::Div(m, denom)));
    hn::StoreU(m, d, a.m + i);
    hn::StoreU(v, d, a.v + i);
    hn::StoreU(p, d, a.p + i);
  }
  for (; i < n; ++i) {  // the same operations, one element at a time
    const float g = a.g[i] * a.clip;
    const float m = a.m_in[i] * a.beta1 + g * (1.0f - a.beta1);
    const float v = a.v_in[i] * a.beta2 + (g * g) * (1.0f - a.beta2);
    const float denom = std::sqrt(v) / a.c2_sqrt + a.eps;
    a.m[i] = m;
    a.v[i] = v;
    const float dec = a.decay_mask ? 1.0f - a.lr_wd * a.decay_mask[i] : a.decay;
    a.p[i] = a.p_in[i] * dec - a.step_size * (m / denom);
  }
}

}  // namespace tutti::fused::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <fmt/format.h>

#include <cstring>

#include "core/error.hpp"

namespace tutti::fused {

void to_bf16(uint16_t* out, const float* in, int64_t n) {
  // Round to nearest even on the bits, NaN to the signed quiet NaN: what element::float_to_bf16
  // computes (tested against it), without branches, so the compiler vectorises the loop.
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, in + i, 4);
    const uint32_t rne = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, nan = ((u >> 16) & 0x8000u) | 0x7FC0u;
    out[i] = static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rne);
  }
}

HWY_EXPORT(UnscaleSquare);
HWY_EXPORT(UnscaleSquarePiece);
HWY_EXPORT(UnscaleSquareStateBytes);
HWY_EXPORT(AdamwUpdate);
HWY_EXPORT(SumSquares);
HWY_EXPORT(ScaleCheck);

double sum_squares(const float* x, int64_t n) { return HWY_DYNAMIC_DISPATCH(SumSquares)(x, n); }
bool scale_check(float* x, int64_t n, float factor) { return HWY_DYNAMIC_DISPATCH(ScaleCheck)(x, n, factor); }

double unscale_square(float* out, const float* in, int64_t n, float scale) {
  return HWY_DYNAMIC_DISPATCH(UnscaleSquare)(out, in, n, scale);
}

size_t unscale_square_state_bytes() { return HWY_DYNAMIC_DISPATCH(UnscaleSquareStateBytes)(); }

double unscale_square_piece(float* out, const float* in, int64_t n, float scale, double* acc, bool last) {
  // A piece that is not whole groups would leave elements out of the sum (and unscaled).
  if (!last && n % kSquareGroup != 0)
    throw InternalError(fmt::format("unscale_square_piece: a piece of {} elements, not a multiple of {}", n, kSquareGroup));
  return HWY_DYNAMIC_DISPATCH(UnscaleSquarePiece)(out, in, n, scale, acc, last);
}

void adamw_update(const AdamwArgs& args, int64_t n) { HWY_DYNAMIC_DISPATCH(AdamwUpdate)(args, n); }

}  // namespace tutti::fused
#endif
