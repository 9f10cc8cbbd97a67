// KvTmaTransposeV: K/V blocks by TMA exactly as KvTma (contiguous, or paged with whole / half boxes), plus the V
// transpose that FP8 wgmma needs (config_fp8.h): warps 1-3 of the producer warpgroup wait for each V tile's TMA,
// write it transposed into smem_vt (keys contiguous, the keys of every 32-key chunk in Config::vt_key_of order) and
// arrive on the stage's vt_full barrier, which is what the consumers wait on before O = P V.
//
// The transpose: a thread moves 4 x 4 byte blocks (4 keys x 4 head dims): four 32-bit loads of smem_v (one per
// key), a 4 x 4 byte transpose in PRMTs, four 32-bit stores into smem_v^T (one per head dim). Lanes: bits 0-1 and 4
// pick the head-dim quad (the reads of a warp hit 32 distinct banks), bits 2-3 the key quad t. Store s of a lane
// writes head dim d0 + (s + 2*l1 + l4) % 4 (lane bits l1, l4), so that the 32 stores of one instruction hit 32
// distinct banks of the SW128 layout (bank = ((col/16) ^ (d % 8)) * 4 + t); without the stagger they are 4-way
// conflicts. tests/python/test_fp8_layout_model.py models this mapping (coverage, permutation, banks). 32
// warp-iterations per 128 x 128 stage over 3 warps (11, 11, 10). An LDSM / STSM version (FA3's copy_Vt_to_V) would
// need fewer instructions (bench/NOTES_fp8.md).
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

  // 4 x 4 byte transpose, in two halves: interleave(in) then row x: out[x] byte j = in[j] byte x.
  struct Interleaved {
    uint32_t t0, t1, t2, t3;  // t0 = {in0.b0, in1.b0, in0.b1, in1.b1}, t1 = bytes 2-3 of in0/in1; t2, t3 of in2/in3
  };
  __device__ __forceinline__ static Interleaved interleave(const uint32_t (&in)[4]) {
    return {__byte_perm(in[0], in[1], 0x5140), __byte_perm(in[0], in[1], 0x7362), __byte_perm(in[2], in[3], 0x5140),
            __byte_perm(in[2], in[3], 0x7362)};
  }
  __device__ __forceinline__ static uint32_t transposed_row(const Interleaved& v, int x) {  // x in [0, 4), runtime
    const bool hi = x >= 2;
    return __byte_perm(hi ? v.t1 : v.t0, hi ? v.t3 : v.t2, (x & 1) ? 0x7632 : 0x5410);
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
    const int stagger = 2 * ((lane >> 1) & 1) + (lane >> 4);  // store s writes head dim d0 + (s + stagger) % 4
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
        uint32_t in[4];
        CUTE_UNROLL
        for (int j = 0; j < 4; ++j) {
          const int key = key0 + (j & 1) + 8 * (j >> 1);
          in[j] = key < valid ? *reinterpret_cast<const uint32_t*>(&sV(key, d0, s)) : 0u;
        }
        const Interleaved v = interleave(in);
        CUTE_UNROLL
        for (int st_i = 0; st_i < 4; ++st_i) {
          const int x = (st_i + stagger) & 3;
          *reinterpret_cast<uint32_t*>(&sVt(d0 + x, col, s)) = transposed_row(v, x);
        }
      }
      cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> visible to wgmma (async proxy)
      storage.vt_full[s].arrive();
      ++st;
    }
  }
};

}  // namespace sparse_prefill::cuda
