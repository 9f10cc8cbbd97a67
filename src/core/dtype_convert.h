// Scalar conversions between float and the 16-bit storage types (round to nearest even), and float8_e4m3fn's
// (decoding; encoding as the GPU's cvt.rn.satfinite); host only.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "sparse_prefill/tensor.h"

namespace sparse_prefill {

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) return uint16_t((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) { mant <<= 1; --exp; }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_half(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint32_t sign = (bits >> 16) & 0x8000u;
  int32_t exp = int32_t((bits >> 23) & 0xffu);
  uint32_t mant = bits & 0x7fffffu;
  if (exp == 0xff) return uint16_t(sign | 0x7c00u | (mant ? 0x200u : 0u));
  int32_t e = exp - 127 + 15;
  if (e >= 0x1f) return uint16_t(sign | 0x7c00u);  // overflow -> inf
  if (e <= 0) {                                     // subnormal or zero
    if (e < -10) return uint16_t(sign);
    mant |= 0x800000u;
    uint32_t shift = uint32_t(14 - e);
    uint32_t half_mant = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_mant & 1u))) ++half_mant;
    return uint16_t(sign | half_mant);
  }
  uint32_t h = sign | (uint32_t(e) << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent: still correct
  return uint16_t(h);
}

// float8_e4m3fn (OCP FP8 E4M3, "fn": no infinities): sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is
// NaN, the largest finite value 448, the smallest subnormal 2^-9. Exact in float.
inline float fp8e4m3_to_float(uint8_t x) {
  const uint32_t sign = uint32_t(x & 0x80u) << 24;
  const uint32_t exp = (x >> 3) & 0xfu, mant = x & 0x7u;
  if (exp == 0xfu && mant == 0x7u) {
    const uint32_t nan = sign | 0x7fc00000u;
    float f;
    std::memcpy(&f, &nan, 4);
    return f;
  }
  float f;
  if (exp == 0) {
    f = float(mant) * (1.0f / 512.0f);  // subnormal: mant / 8 * 2^-6
  } else {
    const uint32_t bits = ((exp + 127 - 7) << 23) | (mant << 20);
    std::memcpy(&f, &bits, 4);
  }
  return sign ? -f : f;
}

// float -> float8_e4m3fn, round to nearest even, saturating as the GPU's cvt.rn.satfinite.e4m3x2.f32 does:
// magnitudes past 448 (and infinities) become +-448, NaN stays NaN (S.1111.111).
inline uint8_t float_to_fp8e4m3(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80u : 0u;
  const float a = std::fabs(f);
  if (std::isnan(a)) return uint8_t(sign | 0x7fu);
  if (a >= 448.f) return uint8_t(sign | 0x7eu);
  if (a < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (an exact scaling); 8 steps round up to 2^-6 = 0x08
    return uint8_t(sign | uint8_t(std::nearbyint(a * 512.f)));  // nearbyint: the default mode, ties to even
  }
  int e;
  const float m = std::frexp(a, &e);                    // a = m * 2^e, m in [0.5, 1)
  const int q = int(std::nearbyint((m * 2.f - 1.f) * 8.f));  // 3 mantissa bits of 1.xxx, exact scaling
  const int code = ((e - 1 + 7) << 3) + q;              // q == 8 carries into the exponent: still the right code
  return uint8_t(sign | uint8_t(code > 0x7e ? 0x7e : code));
}

// Reads element `i` (in elements from `base`) of a float-like tensor as float.
inline float load_as_float(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kFloat16: return half_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat8E4M3: return fp8e4m3_to_float(static_cast<const uint8_t*>(base)[i]);
    default: return 0.f;
  }
}

inline void store_from_float(void* base, DType dtype, int64_t i, float x) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(base)[i] = x; break;
    case DType::kFloat16: static_cast<uint16_t*>(base)[i] = float_to_half(x); break;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[i] = float_to_bf16(x); break;
    default: break;
  }
}

}  // namespace sparse_prefill
