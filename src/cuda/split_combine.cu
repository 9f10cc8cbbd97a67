// Split-KV combine: out = sum_s exp(lse_s - lse) * O_s with lse = log sum_s exp(lse_s), one warp per (query row,
// head); the partials are the sparse kernel's float32 normalised outputs and their LSEs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "cuda/fwd_args.h"

namespace sparse_prefill::cuda {
namespace {

template <typename T>
__device__ T to_out(float x);
template <> __device__ __nv_bfloat16 to_out<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __half to_out<__half>(float x) { return __float2half(x); }

template <typename T, int D>
__global__ void __launch_bounds__(128) split_combine_kernel(const float* o_part, const float* lse_part, int splits,
                                                            int total_q, int num_heads, T* out, int64_t o_rs,
                                                            int64_t o_hs, float* lse, int64_t l_hs, int64_t l_rs) {
  const int64_t item = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;  // (row, head)
  if (item >= int64_t(total_q) * num_heads) return;
  const int lane = threadIdx.x % 32;
  const int row = int(item / num_heads), head = int(item % num_heads);
  const float l = lane < splits ? lse_part[(int64_t(lane) * num_heads + head) * total_q + row] : -INFINITY;
  float m = l;
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float w = m == -INFINITY ? 0.f : expf(l - m);
  float sum = w;
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  w = sum > 0.f ? w / sum : 0.f;
  constexpr int kPer = D / 32;
  float acc[kPer];
  for (int e = 0; e < kPer; ++e) acc[e] = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float ws = __shfl_sync(0xffffffffu, w, s);
    if (ws == 0.f) continue;  // also skips the partials of empty splits
    const float* src = o_part + ((int64_t(s) * total_q + row) * num_heads + head) * D + lane * kPer;
    for (int e = 0; e < kPer; ++e) acc[e] += ws * src[e];
  }
  T* dst = out + int64_t(row) * o_rs + int64_t(head) * o_hs + lane * kPer;
  for (int e = 0; e < kPer; ++e) dst[e] = to_out<T>(acc[e]);
  if (lse != nullptr && lane == 0)
    lse[int64_t(head) * l_hs + int64_t(row) * l_rs] = (m == -INFINITY || !(sum > 0.f)) ? -INFINITY : m + logf(sum);
}

}  // namespace

void run_split_combine(const FwdArgs& a, const SparseFwdArgs& s, bool bf16) {
  if (s.num_splits > 32) throw std::runtime_error("sparse_prefill cuda: at most 32 KV splits");
  const int64_t items = int64_t(a.total_q) * a.num_q_heads;
  if (items == 0) return;
  const unsigned grid = unsigned((items + 3) / 4);
  cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  if (bf16) {
    split_combine_kernel<__nv_bfloat16, 128><<<grid, 128, 0, stream>>>(
        s.o_partial, s.lse_partial, s.num_splits, a.total_q, a.num_q_heads, static_cast<__nv_bfloat16*>(a.out),
        a.o_row_stride, a.o_head_stride, a.lse, a.lse_head_stride, a.lse_row_stride);
  } else {
    split_combine_kernel<__half, 128><<<grid, 128, 0, stream>>>(
        s.o_partial, s.lse_partial, s.num_splits, a.total_q, a.num_q_heads, static_cast<__half*>(a.out),
        a.o_row_stride, a.o_head_stride, a.lse, a.lse_head_stride, a.lse_row_stride);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("sparse_prefill cuda: combine launch: ") + cudaGetErrorString(e));
}

}  // namespace sparse_prefill::cuda
