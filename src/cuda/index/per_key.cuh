// The per-key scorers' shared steps (key_max.cu, exact_max.cu): one CTA per (tile, virtual KV head) that streams
// pooled chunks and key rows through shared memory by cp.async and lists the tile's candidate blocks from the diagonal
// down. CUDA translation units that include CuTe / CUTLASS (cuda/attention/config.h) first.
#pragma once

#include <cstdint>

#include "cuda/index/device_args.cuh"

namespace sparse_prefill::cuda::index_stage {

// Every cp.async of this thread landed and is visible to wgmma (the async proxy), then the CTA meets.
__device__ __forceinline__ void cp_async_stage_barrier() {
  asm volatile("cp.async.wait_group 0;\n" ::);
  cutlass::arch::fence_view_async_shared();
  __syncthreads();
}

// Eight consecutive elements of a key row as the scorer's GEMM operand (16 bytes): bf16 / fp16 as they are, e4m3 to
// bf16 exactly (raw units: the caller multiplies the scores by the descale). vec: one 16-byte (8-byte for e4m3) load.
template <typename T, typename Element>
__device__ __forceinline__ uint4 load_key8(const T* src, bool vec) {
  union {
    uint4 u;
    Element e[8];
  } out;
  if constexpr (is_fp8_v<T>) {
    union {
      uint2 u;
      T f[8];
    } in;
    if (vec) {
      in.u = __ldg(reinterpret_cast<const uint2*>(src));
    } else {
      for (int i = 0; i < 8; ++i) in.f[i] = src[i];
    }
    for (int i = 0; i < 8; ++i) out.e[i] = Element(float(in.f[i]));
  } else if (vec) {
    out.u = __ldg(reinterpret_cast<const uint4*>(src));
  } else {
    for (int i = 0; i < 8; ++i) out.e[i] = Element(to_float(src[i]));
  }
  return out.u;
}

// Key j of sequence b at KV head h (k_src: the K base, k_start: the sequence's first row when contiguous): its row's
// first element; ok false when !in_range or on a bad page (reported by kv.offsets), the row then read as zeros.
template <typename T>
__device__ __forceinline__ const T* key_row(const KVArgs& kv, const T* k_src, int b, int64_t k_start, int h, int64_t j,
                                            bool in_range, bool& ok) {
  int64_t ko = 0, vo;
  ok = in_range && kv.offsets(b, k_start, h, j, ko, vo);
  return k_src + ko;
}

// Elements [8 part, 8 part + 8) of key j (key_row) into the shared address dst as the scorer's GEMM operand: cp.async
// for aligned 16-bit rows (k_vec), else loads and a shared store (e4m3 exactly in bf16: raw units, the caller scales
// the scores by the descale); zeros when !in_range or on a bad page.
template <typename T, typename Element>
__device__ __forceinline__ void load_key_part(const KVArgs& kv, const T* k_src, int b, int64_t k_start, int h,
                                              int64_t j, bool in_range, int part, bool k_vec, uint32_t dst) {
  bool ok;
  const T* src = key_row(kv, k_src, b, k_start, h, j, in_range, ok) + part * 8;
  if (!is_fp8_v<T> && k_vec) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));
  } else {
    const uint4 x = ok ? load_key8<T, Element>(src, k_vec) : make_uint4(0u, 0u, 0u, 0u);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w));
  }
}

// Warp 0: the blocks of the candidate bits (words [0, words)) as a list from the diagonal down, cand[0, n); returns n
// in every lane. Each lane takes a word, the lanes' counts prefix-summed.
__device__ __forceinline__ int list_candidates(const uint32_t* cand_bits, int words, uint16_t* cand, int lane) {
  int base = 0;
  for (int w0 = words - 1; w0 >= 0; w0 -= 32) {
    const int w = w0 - lane;
    uint32_t x = w >= 0 ? cand_bits[w] : 0u;
    const int n = __popc(x);
    int incl = n;
    for (int o = 1; o < 32; o *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    int pos = base + incl - n;
    while (x) {
      const int bit = 31 - __clz(x);
      cand[pos++] = uint16_t(32 * w + bit);
      x &= ~(1u << bit);
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  return base;
}

// The scoring order of the candidates' 64-key units, by the CTA's kThreads threads: unit n is unit upb - 1 - n % upb
// of candidate n / upb (keys descending within a block), stored as its key row / 64 in the sequence.
template <int kThreads>
__device__ __forceinline__ void list_units(const uint16_t* cand, int units, int upb, uint16_t* cand_units) {
  for (int n = threadIdx.x; n < units; n += kThreads)
    cand_units[n] = uint16_t(int(cand[n / upb]) * upb + upb - 1 - n % upb);
}

// What packed row r of tile t (r >= rows: past the tile, sees nothing) sees, causal bottom-right: its last key hi
// (-1: none), its last block and the last block it sees whole (every block when it sees the sequence's last key).
struct RowLimits {
  int hi, last_block, whole_last;
};
__device__ __forceinline__ RowLimits row_limits(int r, int64_t rows, int64_t t, int group_size, int64_t off,
                                                int64_t k_len, int64_t nb, int block_size) {
  const int64_t hi = r < rows ? min(k_len - 1, (t * kTileRows + r) / group_size + off) : -1;
  return {int(hi), hi >= 0 ? int(hi / block_size) : -1,
          hi < 0 ? -1 : hi == k_len - 1 ? int(nb - 1) : int((hi + 1) / block_size - 1)};
}

}  // namespace sparse_prefill::cuda::index_stage
