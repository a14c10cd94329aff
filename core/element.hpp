#pragma once
// What one element operation does to bits. Host/device neutral (no exceptions, no std library
// beyond <cstdint>), so the CPU kernels, the scalar test reference and the CUDA kernels share it and
// the CPU test suite checks the arithmetic the GPU runs.
//
// Low-precision floats (half, bfloat16, fp8) compute in float and round once to nearest-even. For
// +, -, *, that is exactly the correctly rounded result: float's 24 bits are at least 2p+2 for
// every p here (11, 8, 4, 3), so double rounding cannot differ.
// fp8 e4m3 is the OCP "e4m3fn" format (no infinities; S.1111.111 is NaN; largest finite 448); a value
// that rounds beyond 448 becomes NaN (as ml_dtypes and CUDA's non-saturating conversion do).
// fp8 e5m2 and half overflow to infinity.

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TUTTI_HD __host__ __device__ __forceinline__
#define TUTTI_UNROLL _Pragma("unroll")
#else
#define TUTTI_HD inline
#define TUTTI_UNROLL
#endif

namespace tutti::element {

TUTTI_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
TUTTI_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Minifloat with E exponent bits and M mantissa bits. kIeee: all-ones exponent encodes inf/NaN;
// otherwise (e4m3fn) only the all-ones pattern is NaN and there is no infinity.
template <int E, int M, bool kIeee>
struct MiniFloat {
  static constexpr int kBias = (1 << (E - 1)) - 1;
  static constexpr int kEmin = 1 - kBias;
  static constexpr uint32_t kSign = 1u << (E + M);
  static constexpr uint32_t kExpMask = ((1u << E) - 1) << M;
  static constexpr uint32_t kNan = kIeee ? (kExpMask | (1u << (M - 1))) : (kExpMask | ((1u << M) - 1));
  static constexpr uint32_t kInf = kIeee ? kExpMask : kNan;
  static constexpr uint32_t kMaxFinite = kIeee ? kExpMask - 1 : kNan - 1;

  TUTTI_HD static float decode(uint32_t b) {
    uint32_t sign = (b & kSign) ? 0x80000000u : 0u;
    uint32_t exp = (b & kExpMask) >> M;
    uint32_t man = b & ((1u << M) - 1);
    if (kIeee && exp == (1u << E) - 1) return bits_float(sign | 0x7f800000u | (man ? 0x400000u : 0u));
    if (!kIeee && (b & ~kSign) == (kNan & ~kSign)) return bits_float(sign | 0x7fc00000u);
    if (exp == 0) {
      // Subnormal: man * 2^(emin - M), exact in float for every format here.
      float v = static_cast<float>(man) * bits_float(static_cast<uint32_t>(127 + kEmin - M) << 23);
      return bits_float(float_bits(v) | sign);
    }
    return bits_float(sign | ((exp - kBias + 127) << 23) | (man << (23 - M)));
  }

  TUTTI_HD static uint32_t encode(float f) {
    uint32_t x = float_bits(f);
    uint32_t sign = (x & 0x80000000u) ? kSign : 0u;
    uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | kNan;
    if (a == 0x7f800000u) return sign | kInf;
    if (a == 0) return sign;
    int exp = (a >> 23) == 0 ? -126 : static_cast<int>(a >> 23) - 127;
    uint32_t man = (a & 0x7fffffu) | ((a >> 23) ? 0x800000u : 0u);
    int e_target = exp > kEmin ? exp : kEmin;
    int shift = 23 - M + (e_target - exp);
    uint32_t q;
    if (shift >= 32) {
      q = 0;
    } else {
      q = man >> shift;
      uint32_t rem = man & ((1u << shift) - 1);
      uint32_t half = 1u << (shift - 1);
      if (rem > half || (rem == half && (q & 1u))) ++q;
    }
    // q counts units of 2^(e_target - M) with the implicit bit at M; adding the biased exponent
    // lets a carry out of the mantissa step into the exponent, and subnormals fall out at e=emin.
    uint32_t bits = (static_cast<uint32_t>(e_target - kEmin) << M) + q;
    if (bits > kMaxFinite) return sign | kInf;
    return sign | bits;
  }
};

using Half = MiniFloat<5, 10, true>;
using BFloat16 = MiniFloat<8, 7, true>;
using Fp8E4M3 = MiniFloat<4, 3, false>;
using Fp8E5M2 = MiniFloat<5, 2, true>;

TUTTI_HD float half_to_float(uint16_t h) { return Half::decode(h); }
TUTTI_HD uint16_t float_to_half(float f) { return static_cast<uint16_t>(Half::encode(f)); }
TUTTI_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }
TUTTI_HD uint16_t float_to_bf16(float f) { return static_cast<uint16_t>(BFloat16::encode(f)); }
TUTTI_HD float e4m3_to_float(uint8_t b) { return Fp8E4M3::decode(b); }
TUTTI_HD uint8_t float_to_e4m3(float f) { return static_cast<uint8_t>(Fp8E4M3::encode(f)); }
TUTTI_HD float e5m2_to_float(uint8_t b) { return Fp8E5M2::decode(b); }
TUTTI_HD uint8_t float_to_e5m2(float f) { return static_cast<uint8_t>(Fp8E5M2::encode(f)); }

// Storage type + float view of a low-precision format.
struct HalfT { using Bits = uint16_t; TUTTI_HD static float load(Bits b) { return half_to_float(b); } TUTTI_HD static Bits store(float f) { return float_to_half(f); } };
struct Bf16T { using Bits = uint16_t; TUTTI_HD static float load(Bits b) { return bf16_to_float(b); } TUTTI_HD static Bits store(float f) { return float_to_bf16(f); } };
struct E4M3T { using Bits = uint8_t; TUTTI_HD static float load(Bits b) { return e4m3_to_float(b); } TUTTI_HD static Bits store(float f) { return float_to_e4m3(f); } };
struct E5M2T { using Bits = uint8_t; TUTTI_HD static float load(Bits b) { return e5m2_to_float(b); } TUTTI_HD static Bits store(float f) { return float_to_e5m2(f); } };

// Binary operators on native values. Integers wrap (computed unsigned, no UB); min/max follow the
// x86 minps/maxps rule (a < b ? a : b), which the vector kernels implement too.
template <class T>
struct Wrap { using U = T; };
template <> struct Wrap<int8_t> { using U = uint8_t; };
template <> struct Wrap<int32_t> { using U = uint32_t; };
template <> struct Wrap<int64_t> { using U = uint64_t; };

template <class T> TUTTI_HD T op_sum(T a, T b) {
  using U = typename Wrap<T>::U;
  return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
}
template <class T> TUTTI_HD T op_prod(T a, T b) {
  using U = typename Wrap<T>::U;
  if constexpr (sizeof(T) == 1) return static_cast<T>(static_cast<uint32_t>(static_cast<U>(a)) * static_cast<uint32_t>(static_cast<U>(b)));
  else return static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
}
template <class T> TUTTI_HD T op_min(T a, T b) { return a < b ? a : b; }
template <class T> TUTTI_HD T op_max(T a, T b) { return a > b ? a : b; }
template <> TUTTI_HD float op_sum<float>(float a, float b) { return a + b; }
template <> TUTTI_HD double op_sum<double>(double a, double b) { return a + b; }
template <> TUTTI_HD float op_prod<float>(float a, float b) { return a * b; }
template <> TUTTI_HD double op_prod<double>(double a, double b) { return a * b; }

// Integer average divides with truncation toward zero, as NCCL's SumPostDiv does.
template <class T> TUTTI_HD T op_div(T a, uint64_t n) {
  if constexpr (static_cast<T>(-1) < static_cast<T>(0) || sizeof(T) < 4) return static_cast<T>(static_cast<int64_t>(a) / static_cast<int64_t>(n));
  else return static_cast<T>(a / static_cast<T>(n));
}
template <> TUTTI_HD float op_div<float>(float a, uint64_t n) { return a / static_cast<float>(n); }
template <> TUTTI_HD double op_div<double>(double a, uint64_t n) { return a / static_cast<double>(n); }

}  // namespace tutti::element
