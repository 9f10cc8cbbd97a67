// The scorer's Q tile (score_select.cu): the packed rows of one (tile, KV head) gathered from q into the
// 128-byte-swizzled 16-bit shared-memory tile sQ by all kThreads threads of the CTA. PackGQA: packed row r of tile t
// is position (128 t + r) / g, query head kvh * g + (128 t + r) % g; rows at or past `rows` (the tile's real rows)
// are zero.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "cuda/index/device_args.cuh"

namespace sparse_prefill::cuda::index_stage {

// 16-bit q with cp.async, kElems elements per copy (8: 16-byte copies when q allows them; 2: 4-byte ones, as
// build_index needs only even q strides), zero-fill past the tile's rows. The caller commits the group (with its
// first pooled-key chunk, so every load is in flight at once: a load-then-store loop serialised 32 global round trips
// per thread, a ~2x slower index stage). A thread's rows lie kRowStep apart, so its source address is stepped, not
// recomputed per copy (runtime divisions and 64-bit products: ~100 instructions per copy before, ~25 now).
template <typename T, int D, int kElems, int kThreads, class TensorQ>
__device__ __forceinline__ void gather_q_cp_async(const QArgs& qa, TensorQ& sQ, int64_t q_start, int64_t t,
                                                  int64_t rows, int group_size, int kvh) {
  constexpr int kPerRow = D / kElems, kBytes = kElems * int(sizeof(T));
  constexpr int kRowStep = kThreads / kPerRow;
  static_assert(kThreads % kPerRow == 0, "a thread's copies share their column");
  const T* q = static_cast<const T*>(qa.q);
  const int r0 = threadIdx.x / kPerRow, col = (threadIdx.x % kPerRow) * kElems;
  const int pr0 = int(t) * kTileRows + r0;  // packed row within the sequence (Lq * g < 2^31)
  int head = pr0 % group_size;
  const T* at = q + (q_start + pr0 / group_size) * qa.stride_row + (kvh * group_size + head) * qa.stride_head + col;
  const int dhead = kRowStep % group_size;  // kRowStep rows on: kRowStep / g positions and dhead heads further
  const int64_t step = (kRowStep / group_size) * qa.stride_row + dhead * qa.stride_head;
  const int64_t wrap = qa.stride_row - group_size * qa.stride_head;  // head g -> head 0 of the next position
  for (int r = r0; r < kTileRows; r += kRowStep) {
    const T* src = r < rows ? at : q;
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(&sQ(r, col)));
    if constexpr (kBytes == 16) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(r < rows ? 16 : 0));
    } else {
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(r < rows ? 4 : 0));
    }
    at += step;
    head += dhead;
    if (head >= group_size) head -= group_size, at += wrap;
  }
}

// FP8 Q into the scorer's bf16 tile: cp.async cannot convert, so each thread loads 16 e4m3 values of a packed row
// (one 16-byte ld.global when qa.vec16, else byte loads), all its loads first so they are in flight together, then
// dequantises them (x * descale in float32, the CPU reference's rounding) and rounds to bf16 into the two 16-byte
// chunks of the swizzled tile they land in. Rows past the tile's end are zero (as the 16-bit path's zero-fill).
template <int D, int kThreads, class TensorQ>
__device__ __forceinline__ void gather_q_fp8(const QArgs& qa, TensorQ& sQ, int64_t q_start, int64_t t, int64_t rows,
                                             int group_size, int kvh, float descale) {
  constexpr int kPerRow = D / 16, kLoads = kTileRows * kPerRow / kThreads;
  static_assert(kTileRows * kPerRow % kThreads == 0, "whole loads per thread");
  uint4 raw[kLoads];
  CUTE_UNROLL
  for (int l = 0; l < kLoads; ++l) {
    const int i = threadIdx.x + l * kThreads, r = i / kPerRow, col = (i % kPerRow) * 16;
    const int pr = int(t) * kTileRows + r;  // packed row within the sequence (Lq * g < 2^31)
    raw[l] = make_uint4(0u, 0u, 0u, 0u);
    if (r >= rows) continue;
    const uint8_t* src = static_cast<const uint8_t*>(qa.q) + (q_start + pr / group_size) * qa.stride_row +
                         (kvh * group_size + pr % group_size) * qa.stride_head + col;
    if (qa.vec16) {
      raw[l] = __ldg(reinterpret_cast<const uint4*>(src));
    } else {
      uint32_t w[4] = {0u, 0u, 0u, 0u};
      for (int e = 0; e < 16; ++e) w[e / 4] |= uint32_t(__ldg(src + e)) << (8 * (e % 4));
      raw[l] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  CUTE_UNROLL
  for (int l = 0; l < kLoads; ++l) {
    const int i = threadIdx.x + l * kThreads, r = i / kPerRow, col = (i % kPerRow) * 16;
    const uint32_t in[4] = {raw[l].x, raw[l].y, raw[l].z, raw[l].w};
    uint32_t out[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};  // rows past the tile: zeros whatever the descale (inf, NaN)
    if (r < rows) {
      CUTE_UNROLL
      for (int p = 0; p < 8; ++p) {  // e4m3 pair p (elements 2p, 2p + 1) -> f16x2 (exact) -> f32 x descale -> bf16x2
        const __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(
            __nv_fp8x2_storage_t((in[p / 2] >> (16 * (p % 2))) & 0xffffu), __NV_E4M3));
        const float2 f = __half22float2(h);
        const __nv_bfloat162 bf = __floats2bfloat162_rn(f.x * descale, f.y * descale);
        out[p] = *reinterpret_cast<const uint32_t*>(&bf);
      }
    }
    *reinterpret_cast<uint4*>(&sQ(r, col)) = make_uint4(out[0], out[1], out[2], out[3]);
    *reinterpret_cast<uint4*>(&sQ(r, col + 8)) = make_uint4(out[4], out[5], out[6], out[7]);
  }
}

// The tile's Q by the gather its dtype and alignment allow (FP8 dequantised with the (sequence, KV head) descale of
// kvh_mem, the memory KV head; 16-bit by 16-byte copies when qa.vec16, else 4-byte ones); the 16-bit paths' cp.async
// are left uncommitted (the caller commits them, with its first loads where it has them).
template <typename T, int D, int kThreads, class TensorQ>
__device__ __forceinline__ void gather_q_tile(const QArgs& qa, TensorQ& sQ, int64_t q_start, int64_t t, int64_t rows,
                                              int group_size, int kvh, float fp8_descale) {
  if constexpr (std::is_same_v<T, __nv_fp8_e4m3>) {
    gather_q_fp8<D, kThreads>(qa, sQ, q_start, t, rows, group_size, kvh, fp8_descale);
  } else if (qa.vec16) {
    gather_q_cp_async<T, D, 8, kThreads>(qa, sQ, q_start, t, rows, group_size, kvh);
  } else {
    gather_q_cp_async<T, D, 2, kThreads>(qa, sQ, q_start, t, rows, group_size, kvh);
  }
}

}  // namespace sparse_prefill::cuda::index_stage
