// KvTmaTransposeV: K/V blocks by TMA exactly as KvTma (contiguous, or paged with whole / half boxes), plus the V
// transpose that FP8 wgmma needs (config_fp8.h): warps 1-3 of the producer warpgroup wait for each V tile's TMA,
// write it transposed into smem_vt (keys contiguous, the keys of every 32-key chunk in Config::vt_key_of order) and
// arrive on the stage's vt_full barrier, which is what the consumers wait on before O = P V.
//
// The transpose (tests/python/test_fp8_layout_model.py models it: coverage, the key permutation, banks): 32 groups
// per 128 x 128 stage over the 3 warps (11, 11, 10); group g moves keys 16 kb .. 16 kb + 15 (kb = g % 8) x head
// dims 32 (g / 8) .. + 31 with one ldmatrix.x4.trans (four 8-key x 16-byte matrices; lane T = 4 r + c receives keys
// 2c, 2c + 1 x dims 2r, 2r + 1 of each, as b16 pairs), four byte permutes (keys 2c, 2c + 1, 2c + 8, 2c + 9 of one
// dim: exactly smem_vt columns 4c .. 4c + 3 of the key block in vt_key_of order) and one stmatrix.x4 (rows = dims).
// Matrix rows hit 8 distinct 16-byte bank groups: the load rows are 8 consecutive keys; the store matrices take the
// even dims of rows 0-3 and the odd dims of rows 4-7 (and the other way round), so that their dim % 8, which picks
// the swizzled chunk, differs in every row. That is 2 memory and ~10 other instructions per 512 bytes, against 4 x
// the shared-memory instructions and ~30 integer instructions for 4 x 4 bytes per thread with 32-bit LDS / STS.
//
// Paged V tail: the rows of the last page beyond seqused_k may hold anything (NaN bit patterns); 0 x NaN = NaN in
// O = P V, so the transpose writes zeros for the keys of the tail block beyond k_len (the bf16 kernel's consumers
// zero smem_v instead, KvTma::v_tail_block).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "cuda/attention/kv_tma.h"

namespace sparse_prefill::cuda {

template <class Config>
struct KvTmaTransposeV : KvTma<Config> {
  using Base = KvTma<Config>;
  using typename Base::Params;
  using typename Base::Pipeline;
  using typename Base::PipelineState;
  static constexpr bool kTransposeV = true;
  static constexpr int kTransposeThreads = Config::kTransposeThreads;
  static constexpr int kBlockN = Config::kBlockN, kHeadDim = Config::kHeadDim;
  static_assert(kBlockN == 128 && kHeadDim == 128, "the transpose's thread mapping covers 128 x 128 tiles");
  static_assert(kTransposeThreads == 96, "warps 1-3 of the producer warpgroup");

  template <class Storage>
  __device__ __forceinline__ static void init_barriers(Storage& storage) {
    for (int s = 0; s < Config::kStages; ++s) storage.vt_full[s].init(kTransposeThreads);
  }

  // Consumers: V^T of stage s.index() is written (implies the V tile's TMA landed).
  template <class Storage, class State>
  __device__ __forceinline__ static void wait_v(Storage& storage, Pipeline&, const State& s) {
    storage.vt_full[s.index()].wait(s.phase());
  }

  // Raw shared-memory addresses: through CuTe's swizzled tensors with runtime coordinates the compiler lost the
  // address space (generic LD.E / ST.E and ~20 address instructions per access; H200, 16K causal: 8.28 ms with that
  // transpose, 2.76 ms with the transpose skipped). volatile keeps them after the barrier wait and in order.
  __device__ __forceinline__ static void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
  __device__ __forceinline__ static void stsm_x4(uint32_t addr, const uint32_t (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r[0]), "r"(r[1]),
                 "r"(r[2]), "r"(r[3]));
  }

  // The transpose warps' side of one tile: every V step of the tile's block iterator, in the order the producer
  // thread loads them. tid: 0..95. st: this role's read state of the V pipeline, carried across tiles.
  template <class Storage, class Work>
  __device__ __forceinline__ static void transpose_tile(const Params& p, Storage& storage, const Work& work,
                                                        Pipeline& pipeline_v, PipelineState& st, int tid) {
    constexpr uint32_t kStageBytes = kBlockN * kHeadDim;  // one stage of smem_v / smem_vt (1-byte elements)
    // Groups per pass: H200, 32K causal, 2: 11.80 ms, 4: 11.96 ms (and in the first, 32-bit version 1 was 9 % slower
    // than 2: the loop is latency-bound).
    constexpr int kPass = 2;
    const uint32_t v_base = static_cast<uint32_t>(__cvta_generic_to_shared(storage.smem_v.data()));
    const uint32_t vt_base = static_cast<uint32_t>(__cvta_generic_to_shared(storage.smem_vt.data()));
    const int tail = Base::v_tail_block(p, work.seq);
    const int warp = tid / 32, lane = tid % 32;
    // smem_v and smem_vt are K-major SW128 tiles of 128-byte rows (Config::SmemLayoutV / SmemLayoutVt; sw128 in the
    // model): byte (row, col) of a stage at row * 128 + (((col >> 4) ^ row) & 7) * 16 + col % 16. Lane L gives the
    // address of row i = L % 8 of matrix m = L / 8; the addresses split into a lane part and a group part:
    //   load  (key 16 kb + i + 8 (m & 1), dims from 32 dp + 16 (m >> 1)): ld_lane + 2048 kb + ((dp ^ (i >> 1)) << 5)
    //   store (dim 32 dp + 16 (m >> 1) + 2 i + odd, odd = (m & 1) ^ (i >= 4), columns from 16 kb):
    //         st_lane + 4096 dp + ((kb ^ (dim % 8)) << 4)
    const int m = lane >> 3, i8 = lane & 7;
    const int odd = (m & 1) ^ (i8 >= 4 ? 1 : 0);
    const uint32_t ld_lane = uint32_t((i8 + 8 * (m & 1)) * 128 + (((m >> 1) ^ (i8 & 1)) << 4));
    const uint32_t ld_xor = uint32_t(i8 >> 1);
    const uint32_t st_lane = uint32_t((16 * (m >> 1) + 2 * i8 + odd) * 128);
    const uint32_t st_xor = uint32_t((2 * i8 + odd) & 7);
    // The received register of matrix pair (0, 1) / (2, 3) holds keys 2c, 2c + 1 (bytes 0-1: dims 2r, 2r + 1 of key
    // 2c; bytes 2-3 of key 2c + 1) and, in the pair's second matrix, keys 2c + 8, 2c + 9: the even-dim word is bytes
    // {0, 2} of both (0x6420), the odd-dim word bytes {1, 3} (0x7531); store rows 4-7 take them the other way round.
    const int r = lane >> 2, c = lane & 3;
    const uint32_t sel_a = r < 4 ? 0x6420u : 0x7531u, sel_b = sel_a ^ 0x6420u ^ 0x7531u;
    const int n_count = work.iter.count();
    for (int step = 0; step < n_count; ++step) {
      // A correction step (MeanCorrection) holds pooled means (rows past them zero-filled by TMA): no tail. Without a
      // tail block (contiguous KV, whole last block) the step's block is not needed: no listed-id load.
      const int n_block = tail < 0 || work.iter.is_corr(step) ? -1 : work.iter.block(step);
      const int valid = n_block >= 0 && n_block == tail ? work.seq.k_len - n_block * kBlockN : kBlockN;
      pipeline_v.consumer_wait(st);  // the V tile's TMA landed (waiting on the full barrier only; no release)
      const uint32_t v_stage = v_base + st.index() * kStageBytes, vt_stage = vt_base + st.index() * kStageBytes;
      // kPass groups per pass: their loads issue back to back (one load latency exposed per pass).
      for (int g0 = warp; g0 < 32; g0 += 3 * kPass) {
        uint32_t in[kPass][4];
        CUTE_UNROLL
        for (int u = 0; u < kPass; ++u) {
          const int g = g0 + 3 * u, kb = g & 7, dp = g >> 3;
          if (g < 32) ldsm_x4_trans(v_stage + ld_lane + 2048u * kb + ((dp ^ ld_xor) << 5), in[u]);
          if (valid < kBlockN) {  // the paged tail block: zero the keys >= k_len (warp-uniform)
            CUTE_UNROLL
            for (int mm = 0; mm < 4; ++mm) {
              const int key = 16 * kb + 8 * (mm & 1) + 2 * c;
              in[u][mm] &= (key < valid ? 0x0000ffffu : 0u) | (key + 1 < valid ? 0xffff0000u : 0u);
            }
          }
        }
        CUTE_UNROLL
        for (int u = 0; u < kPass; ++u) {
          const int g = g0 + 3 * u, kb = g & 7, dp = g >> 3;
          if (g >= 32) break;
          const uint32_t out[4] = {__byte_perm(in[u][0], in[u][1], sel_a), __byte_perm(in[u][0], in[u][1], sel_b),
                                   __byte_perm(in[u][2], in[u][3], sel_a), __byte_perm(in[u][2], in[u][3], sel_b)};
          stsm_x4(vt_stage + st_lane + 4096u * dp + ((uint32_t(kb) ^ st_xor) << 4), out);
        }
      }
      cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> visible to wgmma (async proxy)
      storage.vt_full[st.index()].arrive();
      ++st;
    }
  }
};

}  // namespace sparse_prefill::cuda
