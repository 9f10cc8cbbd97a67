// float8_e4m3fn decoding (every code against its definition), encoding (nearest even, saturating: what exact_max's
// reference rounds with) and the FP8 argument checks of the C++ API.
#include <cmath>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "core/dtype_convert.h"
#include "sparse_prefill/attention.h"

namespace {

using sparse_prefill::ArgumentError;
using sparse_prefill::DType;
using sparse_prefill::make_view;

TEST(Fp8, DecodesEveryCodeByItsDefinition) {
  for (int c = 0; c < 256; ++c) {
    const int sign = c >> 7, exp = (c >> 3) & 15, mant = c & 7;
    const float got = sparse_prefill::fp8e4m3_to_float(uint8_t(c));
    if (exp == 15 && mant == 7) {
      EXPECT_TRUE(std::isnan(got)) << c;
      continue;
    }
    const double mag = exp == 0 ? std::ldexp(mant / 8.0, -6) : std::ldexp(1.0 + mant / 8.0, exp - 7);
    EXPECT_EQ(double(got), sign ? -mag : mag) << c;
    EXPECT_EQ(std::signbit(got), bool(sign)) << c;
  }
  EXPECT_EQ(sparse_prefill::fp8e4m3_to_float(0x7e), 448.f);           // largest finite
  EXPECT_EQ(sparse_prefill::fp8e4m3_to_float(0x01), std::ldexp(1.f, -9));  // smallest subnormal
  EXPECT_EQ(sparse_prefill::fp8e4m3_to_float(0x38), 1.f);
}

TEST(Fp8, EncodesToNearestEvenAndSaturates) {
  using sparse_prefill::float_to_fp8e4m3;
  using sparse_prefill::fp8e4m3_to_float;
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN
    EXPECT_EQ(int(float_to_fp8e4m3(fp8e4m3_to_float(uint8_t(c)))), c) << c;  // every value is its own code
  }
  // between neighbouring codes c and c + 1 (same sign): below the midpoint c, above it c + 1, at it the even one
  for (int c = 0; c < 0x7e; ++c) {
    const double lo = fp8e4m3_to_float(uint8_t(c)), hi = fp8e4m3_to_float(uint8_t(c + 1)), mid = (lo + hi) / 2;
    EXPECT_EQ(int(float_to_fp8e4m3(float(mid))), c % 2 == 0 ? c : c + 1) << c;
    EXPECT_EQ(int(float_to_fp8e4m3(std::nextafter(float(mid), 0.f))), c) << c;
    EXPECT_EQ(int(float_to_fp8e4m3(std::nextafter(float(mid), 1e30f))), c + 1) << c;
    EXPECT_EQ(int(float_to_fp8e4m3(-float(mid))), (c % 2 == 0 ? c : c + 1) | 0x80) << c;
  }
  EXPECT_EQ(int(float_to_fp8e4m3(464.f)), 0x7e);  // past 448: saturated (cvt.rn.satfinite), never NaN
  EXPECT_EQ(int(float_to_fp8e4m3(1e30f)), 0x7e);
  EXPECT_EQ(int(float_to_fp8e4m3(-INFINITY)), 0xfe);
  EXPECT_EQ(int(float_to_fp8e4m3(std::ldexp(1.f, -11))), 0);  // a quarter of the smallest subnormal: zero
  EXPECT_EQ(int(float_to_fp8e4m3(-0.f)), 0x80);
  EXPECT_TRUE(std::isnan(fp8e4m3_to_float(float_to_fp8e4m3(NAN))));
}

// One FP8 sequence of 4 tokens, Hq 2, Hkv 1, D 64; descale arrays [1, 1].
struct Fp8Call {
  std::vector<uint8_t> q = std::vector<uint8_t>(4 * 2 * 64, 0x38), k = std::vector<uint8_t>(4 * 64, 0x38),
                       v = std::vector<uint8_t>(4 * 64, 0x38);
  std::vector<int32_t> cu = {0, 4};
  std::vector<float> scale = {0.5f};
  std::vector<uint16_t> out = std::vector<uint16_t>(4 * 2 * 64, 0);
  sparse_prefill::AttentionInputs in;
  sparse_prefill::AttentionOutputs outs;
  Fp8Call() {
    in.q = make_view(q.data(), DType::kFloat8E4M3, {4, 2, 64});
    in.k = make_view(k.data(), DType::kFloat8E4M3, {4, 1, 64});
    in.v = make_view(v.data(), DType::kFloat8E4M3, {4, 1, 64});
    in.cu_seqlens_q = make_view(cu.data(), DType::kInt32, {2});
    in.cu_seqlens_k = make_view(cu.data(), DType::kInt32, {2});
    in.max_seqlen_q = in.max_seqlen_k = 4;
    outs.out = make_view(out.data(), DType::kBFloat16, {4, 2, 64});
  }
};

std::string error_of(const Fp8Call& c) {
  try {
    sparse_prefill::attention(c.in, c.outs);
  } catch (const ArgumentError& e) {
    return e.what();
  }
  return "";
}

TEST(Fp8, AttentionOfOnesIsTheValueDescale) {
  Fp8Call c;
  c.in.v_descale = make_view(c.scale.data(), DType::kFloat32, {1, 1});
  sparse_prefill::attention(c.in, c.outs);
  for (uint16_t o : c.out) EXPECT_EQ(sparse_prefill::bf16_to_float(o), 0.5f);  // every value is 1 * 0.5
}

TEST(Fp8, ArgumentErrorsNameTheArgument) {
  Fp8Call c;
  c.in.k_descale = make_view(c.scale.data(), DType::kFloat32, {1, 2});
  EXPECT_EQ(error_of(c).rfind("k_descale: expected shape [1, 1]", 0), 0u) << error_of(c);
  Fp8Call d;
  d.outs.out.dtype = DType::kFloat16;
  EXPECT_EQ(error_of(d).rfind("out: dtype float16 must be bfloat16 for float8_e4m3fn inputs", 0), 0u);
  Fp8Call e;
  e.in.k.dtype = DType::kBFloat16;
  EXPECT_EQ(error_of(e).rfind("k: dtype bfloat16 does not match q's float8_e4m3fn", 0), 0u);
  Fp8Call f;  // descales for non-FP8 inputs
  f.in.q.dtype = f.in.k.dtype = f.in.v.dtype = DType::kBFloat16;
  f.in.q_descale = make_view(f.scale.data(), DType::kFloat32, {1, 1});
  EXPECT_EQ(error_of(f).rfind("q_descale: applies to float8_e4m3fn inputs only", 0), 0u) << error_of(f);
}

}  // namespace
