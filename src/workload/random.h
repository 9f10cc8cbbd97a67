// Counter-seeded random streams for the workload generators: splitmix64 seeding, xoshiro256** bits, Box-Muller
// normals. Every (tensor, head) of a generator owns one stream derived from (seed, tag, index), so the output does not
// depend on the number of threads or on the order in which heads are generated.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace sparse_prefill::workload::detail {

inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The seed of stream (tag, index) of a generator run with `seed`.
inline uint64_t stream_seed(uint64_t seed, uint64_t tag, uint64_t index) {
  uint64_t s = seed;
  uint64_t a = splitmix64(s) ^ (tag * 0xD6E8FEB86659FD93ull);
  a = splitmix64(a) ^ (index * 0xA0761D6478BD642Full);
  return splitmix64(a);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (uint64_t& w : s_) w = splitmix64(seed);
  }
  uint64_t next() {  // xoshiro256**
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }
  // Uniform integer in [0, n), n > 0.
  int64_t below(int64_t n) { return int64_t((unsigned __int128)next() * (unsigned __int128)uint64_t(n) >> 64); }
  // Standard normal (Box-Muller, both outputs used).
  float normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    float a, b;
    normal_pair(a, b);
    spare_ = b;
    has_spare_ = true;
    return a;
  }
  // n standard normals into out (float32). Box-Muller in batches: the random bits are drawn first, then a branch-free
  // loop (polynomial log and sin/cos, which the compiler vectorises) turns them into normals: ~1 ns per normal.
  void normals(float* out, int64_t n) {
    int64_t i = 0;
    if (has_spare_ && n > 0) {
      out[i++] = spare_;
      has_spare_ = false;
    }
    constexpr int kBatch = 256;  // pairs
    uint64_t bits[kBatch];
    while (n - i >= 2) {
      const int pairs = int(std::min<int64_t>(kBatch, (n - i) / 2));
      for (int b = 0; b < pairs; ++b) bits[b] = next();
      float* o = out + i;
      for (int b = 0; b < pairs; ++b) pair_from_bits(bits[b], o[2 * b], o[2 * b + 1]);
      i += 2 * int64_t(pairs);
    }
    if (i < n) out[i] = normal();
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  void normal_pair(float& a, float& b) { pair_from_bits(next(), a, b); }

  // Box-Muller from 64 random bits: u1 in (0, 1] (24 bits), an angle in [0, pi/2) (24 bits) and two sign bits that
  // place it in one of the four quadrants. Errors of the polynomials are below 1e-6 relative.
  static inline void pair_from_bits(uint64_t bits, float& a, float& b) {
    // (Signed int -> float conversions: native in SIMD, unlike unsigned ones.)
    const float u1 = float(int32_t(bits >> 40) + 1) * 0x1.0p-24f;
    const float t = float(int32_t((bits >> 16) & 0xFFFFFFu)) * (0x1.0p-24f * 1.57079632679489662f);
    const float sa = 1.0f - 2.0f * float(int32_t(bits & 1u)), sb = 1.0f - 2.0f * float(int32_t((bits >> 1) & 1u));
    const float r = sqrt_nonneg(-2.0f * log_unit(u1));
    const float t2 = t * t;
    // sin and cos on [0, pi/2] (Taylor to degree 11 / 12).
    const float s = t * (1.0f + t2 * (-1.0f / 6 + t2 * (1.0f / 120 + t2 * (-1.0f / 5040 + t2 * (1.0f / 362880 +
                                                                                        t2 * (-1.0f / 39916800))))));
    const float c = 1.0f + t2 * (-0.5f + t2 * (1.0f / 24 + t2 * (-1.0f / 720 + t2 * (1.0f / 40320 +
                                                                       t2 * (-1.0f / 3628800 + t2 / 479001600.0f)))));
    a = sa * r * c;
    b = sb * r * s;
  }
  // sqrt of y >= 0 without libm (std::sqrt sets errno, which keeps the batch loop from vectorising): bit-trick
  // reciprocal square root, three Newton steps (relative error ~1e-7), times y.
  static inline float sqrt_nonneg(float y) {
    uint32_t i;
    std::memcpy(&i, &y, 4);
    i = 0x5F375A86u - (i >> 1);
    float x;
    std::memcpy(&x, &i, 4);
    const float h = 0.5f * y;
    x = x * (1.5f - h * x * x);
    x = x * (1.5f - h * x * x);
    x = x * (1.5f - h * x * x);
    return y * x;
  }
  // Natural log of x in (0, 1]: x = 2^e * m, m in [1, 2); log m = 2 atanh((m - 1) / (m + 1)) (series to z^11).
  static inline float log_unit(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const int e = int(u >> 23) - 127;
    u = (u & 0x007FFFFFu) | 0x3F800000u;
    float m;
    std::memcpy(&m, &u, 4);
    const float z = (m - 1.0f) / (m + 1.0f), z2 = z * z;
    const float atanh =
        z * (1.0f + z2 * (1.0f / 3 + z2 * (1.0f / 5 + z2 * (1.0f / 7 + z2 * (1.0f / 9 + z2 * (1.0f / 11))))));
    return float(e) * 0.693147180559945309f + 2.0f * atanh;
  }
  uint64_t s_[4];
  float spare_ = 0;
  bool has_spare_ = false;
};

}  // namespace sparse_prefill::workload::detail
