// Online softmax over the S accumulator of one warpgroup (FA2/FA3 style, exp2 with the scale folded into one FFMA,
// one final normalisation). A row is spread over the 4 threads of a quad: max is quad-reduced every block, the sum
// only once at the end.
#pragma once

#include <cute/tensor.hpp>
#include <cmath>

namespace sparse_prefill::cuda {

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// Views a wgmma accumulator ((2, 2, V), MMA_M, MMA_N) as (rows, cols) = ((2, MMA_M), (2, V, MMA_N)).
template <class AccLayout>
__host__ __device__ constexpr auto acc_rowcol(AccLayout acc) {
  using namespace cute;
  auto v = get<0>(acc);
  return make_layout(make_layout(get<1>(v), get<1>(acc)), make_layout(get<0>(v), get<2>(v), get<2>(acc)));
}

// Reinterprets a 16-bit-converted S accumulator ((2, 2, V), MMA_M, MMA_N) as the A operand of an RS wgmma with
// k = 16: ((2, 2, 2), MMA_M, V / 2 * MMA_N). The register order already matches; only the view changes.
template <class AccLayout>
__host__ __device__ constexpr auto acc_to_a_layout(AccLayout acc) {
  using namespace cute;
  auto v = get<0>(acc);
  auto vv = logical_divide(get<2>(v), cute::Layout<cute::_2>{});
  return make_layout(make_layout(get<0>(v), get<1>(v), get<0>(vv)), get<1>(acc),
                     coalesce(make_layout(get<1>(vv), get<2>(acc))));
}

// kMaxOffset (FP8, FA3's Max_offset): P = exp2(s * scale_log2 - max * scale_log2 + kMaxOffset), in [0, 2^kMaxOffset]
// for more of e4m3's range; row sums carry the same factor, so O / sum is unchanged and the LSE subtracts it.
template <int kRows, int kMaxOffset = 0>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];   // per-thread partial sums
  float scale_log2;       // softmax_scale * log2(e)

  __device__ __forceinline__ explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) { row_max[r] = -INFINITY; row_sum[r] = 0.f; }
  }

  // S (rows x cols view, fp32) -> P = exp2(S*scale_log2 - max*scale_log2) in place. o_scale[r] receives the factor
  // that O (accumulated up to the previous block) must be multiplied by.
  template <bool kFirst, class TensorRC>
  __device__ __forceinline__ void step(TensorRC& s, float (&o_scale)[kRows]) {
    using namespace cute;
    static_assert(decltype(size<0>(s))::value == kRows);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      // 4 independent partial maxima / sums: shorter dependency chains than one serial FMNMX / FADD chain of 32.
      constexpr int kCols = decltype(size<1>(s))::value;
      static_assert(kCols % 4 == 0);
      float mp[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
      for (int c = 0; c < kCols; ++c) mp[c % 4] = fmaxf(mp[c % 4], s(r, c));
      float m = fmaxf(fmaxf(mp[0], mp[1]), fmaxf(mp[2], mp[3]));
      if (!kFirst) m = fmaxf(m, row_max[r]);
      m = quad_max(m);
      // A row with nothing visible so far keeps max = -inf; use 0 as the reference so exp2 gives 0, never NaN.
      const float m_ref = (m == -INFINITY) ? 0.f : m;
      const float mb = m_ref * scale_log2;
      o_scale[r] = kFirst ? 1.f : fast_exp2(row_max[r] * scale_log2 - mb);
      row_max[r] = m;
      float mbp = mb;  // the reference of P
      if constexpr (kMaxOffset != 0) mbp = mb - float(kMaxOffset);
      float sp[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const float p = fast_exp2(fmaf(s(r, c), scale_log2, -mbp));
        s(r, c) = p;
        sp[c % 4] += p;
      }
      const float sum = (sp[0] + sp[1]) + (sp[2] + sp[3]);
      row_sum[r] = kFirst ? sum : fmaf(row_sum[r], o_scale[r], sum);
    }
  }

  // inv_sum[r] multiplies O; lse[r] is the natural-log LSE (-inf for a row that saw no key, whose O becomes 0).
  __device__ __forceinline__ void finalize(float softmax_scale, float (&inv_sum)[kRows], float (&lse)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const bool empty = !(sum > 0.f) || row_max[r] == -INFINITY;
      inv_sum[r] = empty ? 0.f : 1.f / sum;
      lse[r] = empty ? -INFINITY : row_max[r] * softmax_scale + logf(sum);
      if constexpr (kMaxOffset != 0) lse[r] -= float(kMaxOffset * M_LN2);  // -inf stays -inf
    }
  }
};

}  // namespace sparse_prefill::cuda
