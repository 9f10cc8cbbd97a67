// KvTmaTransposeV: K/V blocks by TMA exactly as KvTma (contiguous, or paged with whole / half boxes), plus the V
// transpose that FP8 wgmma needs (config_fp8.h): warps 1-3 of the producer warpgroup wait for each V tile's TMA,
// write it transposed into smem_vt (keys contiguous, the keys of every 32-key chunk in Config::vt_key_of order) and
// arrive on the stage's vt_full barrier, which is what the consumers wait on before O = P V.
//
// The transpose: a thread moves 4 x 4 byte blocks (4 keys x 4 head dims): four 32-bit loads of smem_v (one per
// key), a 4 x 4 byte transpose in 8 PRMTs, four 32-bit stores into smem_v^T (one per head dim). Lanes: bits 0-1 and
// 4 pick the head-dim quad (the reads of a warp hit 32 distinct banks), bits 2-3 the key quad t (the stores of 8
// lanes fill 8 distinct banks of one smem_vt row: 4-way conflicts). 32 warp-iterations per 128 x 128 stage over 3
// warps (11, 11, 10). An LDSM / STSM version (FA3's copy_Vt_to_V) is the known faster route (bench/NOTES_fp8.md).
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

  // 4 x 4 byte transpose: out[x] byte j = in[j] byte x.
  __device__ __forceinline__ static void transpose4x4(const uint32_t (&in)[4], uint32_t (&out)[4]) {
    const uint32_t t0 = __byte_perm(in[0], in[1], 0x5140), t1 = __byte_perm(in[0], in[1], 0x7362);
    const uint32_t t2 = __byte_perm(in[2], in[3], 0x5140), t3 = __byte_perm(in[2], in[3], 0x7362);
    out[0] = __byte_perm(t0, t2, 0x5410);
    out[1] = __byte_perm(t0, t2, 0x7632);
    out[2] = __byte_perm(t1, t3, 0x5410);
    out[3] = __byte_perm(t1, t3, 0x7632);
  }

  // The transpose warps' side of one tile: every V step of the tile's block iterator, in the order the producer
  // thread loads them. tid: 0..95. st: this role's read state of the V pipeline, carried across tiles.
  template <class Storage, class Work>
  __device__ __forceinline__ static void transpose_tile(const Params& p, Storage& storage, const Work& work,
                                                        Pipeline& pipeline_v, PipelineState& st, int tid) {
    using namespace cute;
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), typename Config::SmemLayoutV{});
    Tensor sVt = make_tensor(make_smem_ptr(storage.smem_vt.data()), typename Config::SmemLayoutVt{});
    const int tail = Base::v_tail_block(p, work.seq);
    const int warp = tid / 32, lane = tid % 32;
    const int d_lane = (lane & 3) | ((lane >> 4) << 2);  // head-dim quad bits 0-2
    const int t = (lane >> 2) & 3;                        // key quad inside a 16-key half
    const int n_count = work.iter.count();
    for (int i = 0; i < n_count; ++i) {
      const int n_block = work.iter.block(i);
      const int valid = n_block == tail ? work.seq.k_len - n_block * kBlockN : kBlockN;
      pipeline_v.consumer_wait(st);  // the V tile's TMA landed (waiting on the full barrier only; no release)
      const int s = st.index();
      for (int it = warp; it < 32; it += 3) {
        const int d0 = 4 * (d_lane | ((it & 3) << 3));
        const int col = 32 * (it >> 3) + 16 * ((it >> 2) & 1) + 4 * t;  // first smem_vt column of this block
        const int key0 = Config::vt_key_of(col);                         // its keys: key0 + {0, 1, 8, 9}
        uint32_t in[4], out[4];
        CUTE_UNROLL
        for (int j = 0; j < 4; ++j) {
          const int key = key0 + (j & 1) + 8 * (j >> 1);
          in[j] = key < valid ? *reinterpret_cast<const uint32_t*>(&sV(key, d0, s)) : 0u;
        }
        transpose4x4(in, out);
        CUTE_UNROLL
        for (int x = 0; x < 4; ++x) *reinterpret_cast<uint32_t*>(&sVt(d0 + x, col, s)) = out[x];
      }
      cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> visible to wgmma (async proxy)
      storage.vt_full[s].arrive();
      ++st;
    }
  }
};

}  // namespace sparse_prefill::cuda
