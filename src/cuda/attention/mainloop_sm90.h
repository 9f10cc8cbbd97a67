// The sm90 attention mainloop, composed of four policies:
//   QLoad    (q_load.h):    QTma | QPackGqaGather
//   KvSource (kv_source.h): KvTma (contiguous, paged whole / half boxes) | KvCpAsyncGather
//   Schedule (tile_work.h): DenseRange | CsrBlocks (CSR list or full list)
//   Fusion   (fusion.h):    NoFusion | MeanCorrection | Descaled<either> (FP8)
// load_tile() is the producer's side of one tile (Q, then K/V of every step of the tile's block iterator into the
// 3-stage pipelines), mma() the consumers' side: wgmma S = Q K^T from smem, mask / correction, online softmax in
// registers, wgmma O += P V with P from registers.
//
// Consumer schedule (FA3 "intra-warpgroup overlap"): while the tensor cores run S(i) = Q K(i)^T and
// O += P(i-1) V(i-1), the softmax of block i waits only for S(i) (warpgroup_wait<1>), so the exp2 work of block i
// overlaps the PV GEMM of block i-1. A pingpong between the two consumer warpgroups (named barriers ordering their
// GEMM issue) was measured slower with this mainloop on the H200 (causal 32K: 580 vs 614 TFLOP/s, 128K: 593 vs 602)
// and removed (docs/design/dense_kernel.md).
#pragma once

#include <utility>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "cuda/attention/config.h"
#include "cuda/attention/fusion.h"
#include "cuda/attention/kv_source.h"
#include "cuda/attention/mask.h"
#include "cuda/attention/fwd_problem.h"
#include "cuda/attention/q_load.h"
#include "cuda/attention/tile_work.h"
#include "cuda/attention/softmax.h"
#include "cuda/common/wgmma.h"

namespace sparse_prefill::cuda {

// A bad value met while loading a tile (device_checks.h; cold path): what it was, and the tile's slot of
// storage.poisoned so that the consumers make its rows NaN and report it to the error word in their epilogue.
// The slot is the tile's publication number mod 4 (the producer runs at most 2 tiles ahead of the consumers),
// marked with that number + 1, so it needs no reset; the mark is stored before the stage's full-barrier arrive,
// which the consumers wait on before the epilogue. Reporting here instead costs the producer's 24 registers the
// error word's arguments: the sparse kernel's spills went from 296/404 to 472/592 bytes (ptxas). n: the tile's
// publication number (the scheduler's, read when poisoning).
template <bool kFence, class Storage>
__device__ __forceinline__ void poison_tile(Storage& storage, int n, int code, int index, int value) {
  storage.poison_info[n & 3] = make_int4(code, index, value, 0);
  atomicMax(&storage.poisoned[n & 3], n + 1);
  if constexpr (kFence) __threadfence_block();  // before the cp.async arrive (no release of its own)
}

// Four f32 values -> four e4m3 bytes of one 32-bit register, a in byte 0 ... d in byte 3 (round to nearest,
// saturating to +-448; NaN stays NaN).
__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  uint32_t r;
  asm("{\n\t.reg .b16 lo, hi;\n\t"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n\t"  // lo = {upper: b, lower: a}
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n\t"
      "mov.b32 %0, {lo, hi};\n\t}"
      : "=r"(r)
      : "f"(a), "f"(b), "f"(c), "f"(d));
  return r;
}

template <class Config_, template <class> class QLoad_, template <class> class KvSource_,
          template <class> class Schedule_, template <class> class Fusion_>
struct Mainloop {
  using Config = Config_;
  using QLoad = QLoad_<Config>;
  using KvSource = KvSource_<Config>;
  using Schedule = Schedule_<Config>;
  using Fusion = Fusion_<Config>;
  using Element = typename Config::Element;
  using SharedStorage = typename Config::SharedStorage;
  using Pipeline = typename KvSource::Pipeline;
  using PipelineState = typename Config::PipelineState;
  using Work = typename Schedule::Work;
  using Iterator = typename Schedule::Iterator;
  static constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN, kHeadDim = Config::kHeadDim;
  // 8-bit operands (FP8): P is the compact A fragment of the 8-bit RS wgmma (convert_p), V^T a K-major smem copy.
  static constexpr bool k8BitP = sizeof(Element) == 1;
  // Rows of the S / O accumulators one consumer thread holds.
  using TensorS = decltype(cute::partition_fragment_C(std::declval<typename Config::TiledMmaQK>(),
                                                      cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  static constexpr int kRows = decltype(cute::size<0>(acc_rowcol(std::declval<TensorS>().layout())))::value;

  struct Params {
    FwdProblem problem;
    typename QLoad::Params q;
    typename KvSource::Params kv;
    typename Schedule::Params schedule;
    typename Fusion::Params fusion;
  };

  static Params to_params(const FwdArgs& a, const SparseFwdArgs* s) {
    using namespace cute;
    auto gmem = [](const void* ptr, int rows, int heads, int64_t row_stride, int64_t head_stride) {
      return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                         make_shape(int32_t(rows), int32_t(kHeadDim), int32_t(heads)),
                         make_stride(row_stride, _1{}, head_stride));
    };
    auto means = [&](const void* ptr, int rows) {  // [rows, Hkv, D], contiguous
      return make_tma_copy(SM90_TMA_LOAD{}, gmem(ptr, rows, a.num_kv_heads, int64_t(a.num_kv_heads) * kHeadDim,
                                                 kHeadDim),
                           take<0, 2>(typename Config::SmemLayoutK{}), select<1, 2>(typename Config::TileShapeQK{}),
                           _1{});
    };
    Params p;
    p.problem = FwdProblem::make(a, Schedule::kPackGqa, s != nullptr ? s->num_subgroups : 1, kBlockM);
    p.q = QLoad::to_params(a, gmem);
    p.kv = KvSource::to_params(a, gmem);
    p.schedule = Schedule::to_params(a, s);
    p.fusion = Fusion::to_params(a, s, means, p.kv);
    return p;
  }

  __device__ __forceinline__ static void prefetch(const Params& p) {
    QLoad::prefetch(p.q);
    KvSource::prefetch(p.kv);
  }

  // ---------------------------------------------------------------- producer
  template <class Poison>
  __device__ __forceinline__ static void load_tile(const Params& p, SharedStorage& storage, const Work& work,
                                                   Pipeline& pipeline_k, Pipeline& pipeline_v, PipelineState& st_k,
                                                   PipelineState& st_v, typename QLoad::Producer& q, bool issuer,
                                                   Poison& poison) {
    using namespace cute;
    const FwdProblem& pr = p.problem;
    const Iterator& iter = work.iter;
    const int kv_head = work.kv_head_mem(pr);
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), typename Config::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), typename Config::SmemLayoutV{});
    if (issuer) q.load(p.q, pr, storage, work);
    typename KvSource::template Producer<Schedule::kEmptySteps, Poison> kv{work.seq, work.batch,
                                                                                          kv_head, poison};
    // Step i of the iterator: a key block, or (fusion) a chunk of pooled means.
    auto load_k_step = [&](int i) {
      if constexpr (Fusion::kSteps) {
        if (iter.is_corr(i))
          return Fusion::load_k(p.fusion, sK, pipeline_k, st_k, pr, p.schedule.cu_blocks, work.batch, iter.chunk(i),
                                kv_head);
      }
      if constexpr (Schedule::kListedIds) {
        if (iter.bad_id(i)) poison(kErrBlockId, i, iter.listed_id(i));  // reported once per step (at the K load)
      }
      kv.load_k(p.kv, pr, sK, pipeline_k, st_k, iter.block(i));
    };
    auto load_v_step = [&](int i) {
      if constexpr (Fusion::kSteps) {
        if (iter.is_corr(i))
          return Fusion::load_v(p.fusion, sV, pipeline_v, st_v, pr, p.schedule.cu_blocks, work.batch, iter.chunk(i),
                                kv_head);
      }
      kv.load_v(p.kv, pr, sV, pipeline_v, st_v, iter.block(i));
    };
    KvSource::run_steps(iter.count(), load_k_step, load_v_step);
  }

  // ---------------------------------------------------------------- consumers
  template <class TensorO, int kN>
  __device__ __forceinline__ static void rescale_o(TensorO& tOrO, const float (&scale)[kN]) {
    using namespace cute;
    Tensor O_rc = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
    CUTE_UNROLL
    for (int r = 0; r < kN; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(O_rc); ++c) O_rc(r, c) *= scale[r];
    }
  }

  // Every step of one tile: O (unnormalised) and the softmax state of this thread's rows.
  template <class QConsumer, class TiledMmaPV, class TensorO, class Softmax>
  __device__ __forceinline__ static void mma(const Params& p, SharedStorage& storage, const Work& work,
                                             Pipeline& pipeline_k, Pipeline& pipeline_v, PipelineState& st,
                                             QConsumer& q, TiledMmaPV& mma_pv, TensorO& tOrO, Softmax& softmax,
                                             int mma_tidx, int cwg) {
    using namespace cute;
    const FwdProblem& pr = p.problem;
    const Iterator& iter = work.iter;
    const SeqSpan& seq = work.seq;
    const int n_count = iter.count();

    typename Config::TiledMmaQK mma_qk;
    auto wg_qk = mma_qk.get_slice(cwg * 128);
    auto wg_pv = mma_pv.get_slice(cwg * 128);
    auto thr_qk = mma_qk.get_slice(mma_tidx);

    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), typename Config::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), typename Config::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(Config::vt_smem(storage)), typename Config::SmemLayoutVt{});
    Tensor tSrQ = wg_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K) descriptors
    Tensor tSrK = wg_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stages)
    Tensor tOrV = wg_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stages)
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
    // P as the A operand of O = P V: the 16-bit S accumulator's register order (acc_to_a_layout), or for FP8 the
    // compact ((4, 2, 2), MMA_M, MMA_K) fragment of the 8-bit RS wgmma filled by convert_p (config_fp8.h).
    auto make_p = [&]() {
      if constexpr (k8BitP)
        return make_tensor<Element>(partition_shape_A(mma_pv, Shape<Int<kBlockM>, Int<kBlockN>>{}));
      else
        return make_tensor<Element>(acc_to_a_layout(tSrS.layout()));
    };
    Tensor tOrP = make_p();
    static_assert(decltype(size(tOrP))::value == decltype(size(tSrS))::value);
    // Two-level accumulation (kTwoLevelPv): each step's P V goes into this fresh accumulator, then into O.
    Tensor tOrPV = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    Tensor S_rc = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
    static_assert(decltype(size<0>(S_rc))::value == kRows);

    // Tile coordinates of this thread's accumulator elements (for the mask and the epilogue).
    Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor cS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
    auto row_pos = [&](int row) { return work.row_pos(pr, row); };

    typename Fusion::Consumer fusion;
    // The correction's log|B| in raw logit units: FP8 descales (Descaled) make the tile's logit scale
    // softmax.scale_log2 = q_descale * k_descale * pr.scale_log2. A zero product makes every logit 0; the bias then
    // stays 0 (finite).
    float corr_bias_scale = 1.f;
    if constexpr (Fusion::kDescale && Fusion::kSteps)
      corr_bias_scale = softmax.scale_log2 > 0.f ? pr.scale_log2 / softmax.scale_log2 : 0.f;
    // Key block of step i (-1 for fusion steps, which hold pooled means, and past the last step). The consumers read
    // it once per step, one step ahead, and hand it to the mask and the V-tail check: a listed block's id is a global
    // load, and reading it again at each use put its latency before the PV issue and before the softmax of every
    // step (ncu at 128K: 12.6 % of the sparse kernel's warp samples on those two lines; mostly hidden under the S
    // GEMM in flight: with the epilogue's loads and the published tile work, 0-2.4 % faster,
    // docs/design/sparse_kernel.md).
    auto step_block = [&](int i) -> int {
      if (i >= n_count) return -1;
      if constexpr (Fusion::kSteps) {
        if (iter.is_corr(i)) return -1;
      }
      return iter.block(i);
    };
    // Element-wise mask of step i with key block n (only called when iter.needs_mask(i, n)).
    auto mask_step = [&](int i, int n) {
      if constexpr (Fusion::kSteps) {
        if (iter.is_corr(i))
          return fusion.apply(p.fusion, pr, S_rc, cS_rc, iter, p.schedule.block_size, seq.k_len, corr_bias_scale);
      }
      apply_mask<kBlockN>(S_rc, cS_rc, iter, row_pos, n);
    };
    auto convert_p = [&]() {
      constexpr int N = decltype(size(tSrS))::value;
      if constexpr (k8BitP) {
        // 8-bit A operand, per 32-key k-step kk: register q holds row r (q even) or r + 8 (q odd) of keys
        // 4t..4t+3 (q < 2) or 16+4t.. (q >= 2) in smem_vt's order; from the S accumulator (index v0 + 2 v1 + 4 v2:
        // column pair, row half, 8-column group) these are elements base, base+1, base+4, base+5.
        static_assert(N % 16 == 0);
        uint32_t* pa = reinterpret_cast<uint32_t*>(tOrP.data());
        CUTE_UNROLL
        for (int kk = 0; kk < N / 16; ++kk) {
          CUTE_UNROLL
          for (int q = 0; q < 4; ++q) {
            const int base = 16 * kk + 8 * (q >> 1) + 2 * (q & 1);
            pa[4 * kk + q] = pack_e4m3x4(tSrS(base), tSrS(base + 1), tSrS(base + 4), tSrS(base + 5));
          }
        }
      } else {
        cutlass::NumericArrayConverter<Element, float, N> conv;
        *reinterpret_cast<cutlass::Array<Element, N>*>(tOrP.data()) =
            conv(*reinterpret_cast<cutlass::Array<float, N> const*>(tSrS.data()));
      }
    };
    // O = P V of one step: into O (zero_init on the first), or (two-level) into the fresh tOrPV.
    auto mma_pv_step = [&](int stage, bool first) {
      if constexpr (Config::kTwoLevelPv)
        wgmma_batch<true>(mma_pv, tOrP, tOrV(_, _, _, stage), tOrPV, true);
      else
        wgmma_batch<true>(mma_pv, tOrP, tOrV(_, _, _, stage), tOrO, first);
    };
    // After warpgroup_wait<0>: the step's product is complete (two-level: O += tOrPV in full f32).
    auto finish_pv = [&]() {
      if constexpr (Config::kTwoLevelPv) {
        warpgroup_fence_operand(tOrPV);
        CUTE_UNROLL
        for (int e = 0; e < size(tOrO); ++e) tOrO(e) += tOrPV(e);
      } else {
        warpgroup_fence_operand(tOrO);
      }
    };

    // Paged V tail (KvSource::v_tail_block): each warpgroup zeroes all tail rows itself and syncs only its own 128
    // threads (the other one writes the same zeros: no cross-warpgroup barrier, so it cannot deadlock with an
    // optional pingpong).
    const int v_tail_block = KvSource::v_tail_block(p.kv, seq);
    auto sanitize_v = [&](int stage, int n_block) {
      if constexpr (KvSource::kTransposeV) return;  // the transpose writes the tail's zeros (kv_tma_vt.h)
      if (n_block < 0 || n_block != v_tail_block) return;
      Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), typename Config::SmemLayoutV{});
      constexpr int kChunks = kHeadDim / 8;
      const int valid = seq.k_len - n_block * kBlockN;
      for (int idx = mma_tidx % 128; idx < (kBlockN - valid) * kChunks; idx += 128) {
        const int row = valid + idx / kChunks, ch = idx % kChunks;
        *reinterpret_cast<uint4*>(&sV(row, ch * 8, stage)) = make_uint4(0, 0, 0, 0);
      }
      cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> visible to wgmma (async proxy)
      cutlass::arch::NamedBarrier::sync(128, 1 + cwg);
    };
    auto wait_kv = [&](Pipeline& pipe, const PipelineState& s) { KvSource::wait(pipe, s); };
    auto wait_v = [&](Pipeline& pipe, const PipelineState& s) {
      if constexpr (KvSource::kTransposeV)
        KvSource::wait_v(storage, pipe, s);  // V^T written (after the V tile's TMA)
      else
        KvSource::wait(pipe, s);
    };

    float o_scale[kRows];
    if constexpr (Config::kTwoLevelPv) clear(tOrO);  // O += tOrPV from the first step
    q.acquire(p.q, pr, storage, work, mma_tidx, cwg);
    fusion.prepare_tile(storage, iter, mma_tidx);

    if constexpr (!Config::kIntraWgOverlap) {
      static_assert(Config::kTwoLevelPv, "the one-step schedule is FP8's, with two-level accumulation");
      // One step at a time (FwdConfigFp8): S(i), softmax, P(i), then O += P(i) V(i) with O's rescale under the PV
      // GEMM. Only P (not S) is live during the PV GEMM: S 64 + O 64 + the two-level accumulator 64 + P 16 registers
      // never coexist in full, which the overlapped schedule below needs (ptxas: 172 bytes of spills there).
      //
      // Pingpong (FA3's warp-scheduler barriers): without it the two consumer warpgroups wait on the same barriers
      // and run the same phase at the same time, both GEMMs then both softmaxes. Named barriers 3 + cwg hand the
      // tensor core from one warpgroup to the other: a turn is O += P(i) V(i) then S(i + 1) (S(0) alone first), so
      // that one warpgroup's softmax runs under the other's two GEMMs. H200, same process (docs/design/fp8.md):
      // 16K / 32K / 128K causal 3.24 / 12.41 / 205.9 ms without, 3.37 / 13.01 / 219.6 with a turn of S(i) alone,
      // 3.18 / 12.20 / 193.1 with this one.
      // Warpgroup 1 pre-arrives for warpgroup 0's first turn and skips its last hand-over: per tile and barrier, as
      // many syncs as arrivals (n_count > 0 here: the kernel skips empty tiles).
      constexpr int kPingBarrier = 3;  // 3, 4 (1, 2: each warpgroup's own syncs; 5: the fusion's)
      auto turn = [&]() { cutlass::arch::NamedBarrier::sync(256, kPingBarrier + cwg); };
      auto hand_over = [&](bool last) {
        if (cwg == 0 || !last) cutlass::arch::NamedBarrier::arrive(256, kPingBarrier + 1 - cwg);
      };
      if (cwg == 1) cutlass::arch::NamedBarrier::arrive(256, kPingBarrier + 0);
      auto issue_s = [&]() {
        wait_kv(pipeline_k, st);
        wgmma_batch<false>(mma_qk, tSrQ, tSrK(_, _, _, st.index()), tSrS, true);
      };
      turn();
      issue_s();
      hand_over(false);
      CUTE_NO_UNROLL
      for (int i = 0; i < n_count; ++i) {
        const int n_block = step_block(i);
        fusion.prepare_step(storage, iter, i);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrS);
        pipeline_k.consumer_release(st);
        if (iter.needs_mask(i, n_block)) mask_step(i, n_block);
        if (i == 0)
          softmax.template step<true>(S_rc, o_scale);
        else
          softmax.template step<false>(S_rc, o_scale);
        convert_p();
        wait_v(pipeline_v, st);
        sanitize_v(st.index(), n_block);
        turn();
        mma_pv_step(st.index(), i == 0);
        if (i > 0) rescale_o(tOrO, o_scale);  // O is not an operand of the GEMM in flight: rescaled under it
        warpgroup_wait<0>();
        finish_pv();
        pipeline_v.consumer_release(st);
        ++st;
        if (i + 1 < n_count) issue_s();  // S(i + 1) in the same turn (st is step i + 1's now)
        hand_over(i + 1 == n_count);
      }
      // Nothing is in flight here, but ptxas cannot tie the loop's exit to the last step's skipped S issue and would
      // inject this wait itself (C7517).
      warpgroup_wait<0>();
      return;
    }

    // Block 0 (descending order: the diagonal block first under causal).
    int n_cur = step_block(0), n_next = step_block(1);
    wait_kv(pipeline_k, st);
    wgmma_batch<false>(mma_qk, tSrQ, tSrK(_, _, _, st.index()), tSrS, true);
    fusion.prepare_step(storage, iter, 0);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    pipeline_k.consumer_release(st);
    if (iter.needs_mask(0, n_cur)) mask_step(0, n_cur);
    softmax.template step<true>(S_rc, o_scale);
    convert_p();

    CUTE_NO_UNROLL
    for (int i = 1; i < n_count; ++i) {
      PipelineState st_v = st;  // V of block i-1
      ++st;
      const int n_prev = n_cur;  // block i-1 (its V)
      n_cur = n_next;
      n_next = step_block(i + 1);
      wait_kv(pipeline_k, st);
      wgmma_batch<false>(mma_qk, tSrQ, tSrK(_, _, _, st.index()), tSrS, true);
      wait_v(pipeline_v, st_v);
      sanitize_v(st_v.index(), n_prev);
      mma_pv_step(st_v.index(), i == 1);
      fusion.prepare_step(storage, iter, i);
      warpgroup_wait<1>();
      warpgroup_fence_operand(tSrS);
      pipeline_k.consumer_release(st);
      if (iter.needs_mask(i, n_cur)) mask_step(i, n_cur);
      softmax.template step<false>(S_rc, o_scale);
      warpgroup_wait<0>();
      finish_pv();
      pipeline_v.consumer_release(st_v);
      convert_p();
      // O (through P(i-1) V(i-1)) to step i's row maximum, after its P V and off the two GEMM issues above (FA3's
      // order for D <= 128): O = (O + P(i-1) V(i-1)) * exp2(m(i-1) - m(i)).
      rescale_o(tOrO, o_scale);
    }
    wait_v(pipeline_v, st);
    sanitize_v(st.index(), n_cur);
    mma_pv_step(st.index(), n_count == 1);
    warpgroup_wait<0>();
    finish_pv();
    pipeline_v.consumer_release(st);
    ++st;
  }
};

}  // namespace sparse_prefill::cuda
