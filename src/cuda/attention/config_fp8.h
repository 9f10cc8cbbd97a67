// Compile-time configuration of the FP8 (e4m3) forward kernel: the FwdConfig interface (config.h) for float8_e4m3fn
// q, k, v with bfloat16 output.
//
// FP8 wgmma (m64nNk32, e4m3 x e4m3 -> f32) takes K-major operands only:
//   S = Q K^T: Q and K tiles are K-major as loaded (D contiguous): SS wgmma 64x128x32, 4 k-steps over D = 128.
//   O = P V:   the reduction runs over keys, and V as stored (keys x D, D contiguous) is MN-major. The producer
//              warpgroup's warps 1-3 transpose every V tile in shared memory after its TMA load into smem_vt
//              (D x keys, keys contiguous; KvTmaTransposeV, kv_tma_vt.h) and arrive on the stage's vt_full barrier.
//              P stays in registers (RS wgmma 64x128x32, 4 k-steps over the 128 keys).
// The A operand of an 8-bit RS wgmma holds, per thread and k-step, row r: keys 4t..4t+3 and 16+4t..16+4t+3 (t = lane
// % 4), while the f32 S accumulator holds keys 2t, 2t+1, 8+2t, 9+2t, 16+2t, ... of that row. Instead of shuffling P
// between threads, the key order inside every 32-key chunk of smem_vt is permuted the same way (vt_key_of below):
// A slot k holds P[r, sigma(k)] and smem_vt[d, k] holds V[sigma(k), d], so the sum over k is unchanged and the
// conversion is a byte order inside each thread (convert_p_fp8, mainloop_sm90.h).
//
// Two-level accumulation (kTwoLevelPv): Hopper's FP8 wgmma accumulates with a reduced-precision adder, so O = O + P V
// chained over thousands of key tiles loses long-context accuracy (vLLM flash-attention PR #104). Each KV tile's P V
// goes into a fresh zero-initialised f32 accumulator that is then added into O with ordinary FADDs.
//
// Tiles: 128 queries x 128 keys (kBlockN = 128 keeps the paged-KV TMA boxes of KvTma: page_size % 64 == 0, and the
// dense block iterator of the bf16 kernel). Shared memory per stage: K 16 KiB + V 16 KiB + V^T 16 KiB = 48 KiB; with Q
// 16 KiB and the bf16 O staging buffer 32 KiB: 3 stages = 192 KiB (+ barriers), 1 CTA/SM, 384 threads.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "core/geometry.h"

namespace sparse_prefill::cuda {

template <int kHeadDim_>
struct FwdConfigFp8 {
  using Element = cutlass::float_e4m3_t;
  using ElementOut = cutlass::bfloat16_t;
  using Accum = float;
  // Measured against P V accumulated straight into O (H200, random q/k/v, rel L2 against our bf16 kernel on the
  // dequantised values): 32K 0.02224 vs 0.02233, 128K 0.02257 vs 0.02337, at the same speed (12.23 vs 12.35 ms,
  // 199.3 vs 203.8 ms; bench/results/fp8_single_level_pv_h200.json).
  static constexpr bool kTwoLevelPv = true;
  // One step at a time in each consumer warpgroup, the two warpgroups in pingpong (mainloop_sm90.h): the overlapped
  // schedule with the two-level accumulator needs S + O + acc + P = 208 live registers of 240 and spilled 172 bytes.
  static constexpr bool kIntraWgOverlap = false;
  // FA3's offset: P = exp2(s - max + 8) in [0, 256] uses more of e4m3's range than [0, 1] (the normalisation
  // divides the 2^8 out; OnlineSoftmax<kRows, 8>).
  static constexpr int kMaxOffset = 8;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 128, "the FP8 kernel is built for head dim 128");
  static constexpr int kBlockM = geometry::kTileRows;  // a CTA's query rows: one PackGQA / selection tile
  static constexpr int kBlockN = geometry::kKeyStep;
  static constexpr int kStages = 3;
  static constexpr int kNumMmaWarpGroups = kBlockM / 64;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * 128;
  static constexpr int kNumThreads = kNumMmaThreads + 128;  // + producer warpgroup (TMA warp + 3 transpose warps)
  static constexpr int kTransposeThreads = 96;              // warps 1-3 of the producer warpgroup
  // The transpose warps fit in 40 (ptxas: 0 spills); H200, 32K / 128K causal: 40 / 232 11.72 / 195.2 ms, 56 / 224
  // 11.80 / 202.0 ms.
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;  // 40*128 + 232*256 = 64512 <= 65536

  using TileShapeQK = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kHeadDim>>;
  using TileShapePV = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kBlockN>>;
  using AtomLayout = cute::Layout<cute::Shape<cute::Int<kNumMmaWarpGroups>, cute::_1, cute::_1>>;

  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, Accum, TileShapeQK>(), AtomLayout{}));
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, Accum, TileShapePV, cute::GMMA::Major::K, cute::GMMA::Major::K>(),
      AtomLayout{}));

  template <int kRows, int kCols>  // 128-byte-swizzled K-major GMMA atom (8 rows x 128 bytes for e4m3)
  using KMajorAtom = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                              cute::GMMA::Major::K, Element, cute::Int<kRows>, cute::Int<kCols>>());
  using SmemLayoutQ =
      decltype(cute::tile_to_shape(KMajorAtom<kBlockM, kHeadDim>{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      KMajorAtom<kBlockN, kHeadDim>{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  using SmemLayoutV = SmemLayoutK;  // V as loaded by TMA: (keys, D, stages), D contiguous
  // V^T written by the transpose warps: (D, keys, stages), keys contiguous (K-major B operand of O = P V), the keys
  // of every 32-key chunk in vt_key_of order.
  using SmemLayoutVt = decltype(cute::tile_to_shape(
      KMajorAtom<kHeadDim, kBlockN>{}, cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStages>>{}));
  // O staging for the bfloat16 epilogue (DirectStore): a 16-bit K-major tile of 128 x D.
  using SmemLayoutO = decltype(cute::tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::K, ElementOut, cute::Int<kBlockM>,
                                                          cute::Int<kHeadDim>>(),
      cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));

  // Key (row of the V tile) stored at column k of smem_vt, inside one 32-key chunk: A-operand slot k = 16h + 4t + j
  // holds S accumulator column 16h + 8(j / 2) + 2t + j % 2 (see the header comment).
  __host__ __device__ static constexpr int vt_key_of(int k) {
    const int h = (k >> 4) & 1, t = (k >> 2) & 3, j = k & 3;
    return (k & ~31) + 16 * h + 8 * (j >> 1) + 2 * t + (j & 1);
  }

  using ShapeRows = cute::Shape<int32_t, int32_t, int32_t>;
  using StrideRows = cute::Stride<int64_t, cute::_1, int64_t>;
  using GmemTensor = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                                ShapeRows{}, StrideRows{}));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                            cute::select<0, 2>(TileShapeQK{}), cute::_1{}));
  using TmaKV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, cute::take<0, 2>(SmemLayoutK{}),
                                             cute::select<1, 2>(TileShapeQK{}), cute::_1{}));
  static constexpr int kHalfN = kBlockN / 2;  // paged KV with page_size % 128 == 64: two 64-row boxes (config.h)
  using SmemLayoutKHalf = decltype(cute::composition(
      cute::take<0, 2>(SmemLayoutK{}),
      cute::make_tile(cute::Layout<cute::Int<kHalfN>>{}, cute::Layout<cute::Int<kHeadDim>>{})));
  using TmaKVHalf = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKHalf{},
                                                 cute::Shape<cute::Int<kHalfN>, cute::Int<kHeadDim>>{}, cute::_1{}));

  static constexpr int kMaxCorrChunks = 64;
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineGather = cutlass::PipelineAsync<kStages>;
  using PipelineState = typename cutlass::PipelineState<kStages>;
  union KVPipelineStorage {
    typename Pipeline::SharedStorage tma;
    typename PipelineGather::SharedStorage gather;
  };

  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> smem_q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> smem_k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> smem_v;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutVt>, 1024> smem_vt;
    cute::array_aligned<ElementOut, cute::cosize_v<SmemLayoutO>, 1024> smem_o;
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_q;
    cutlass::arch::ClusterBarrier barrier_q_empty;
    KVPipelineStorage pipeline_k;
    KVPipelineStorage pipeline_v;
    // V^T of stage s written (kTransposeThreads arrivals per phase). Its stage is freed with V's: the consumers'
    // release of the V stage (after O = P V read smem_vt) is what lets TMA refill smem_v, and the transpose of the
    // refill waits for that TMA, so smem_vt[s] is never overwritten while a GEMM reads it.
    cutlass::arch::ClusterBarrier vt_full[kStages];
    uint32_t listed_bits[kMaxCorrChunks * kBlockN / 32];
    int tile_ids[2];
    alignas(16) unsigned char tile_work[2][192];
    int poisoned[4];
    int4 poison_info[4];
    cutlass::arch::ClusterBarrier tile_full[2];
    cutlass::arch::ClusterBarrier tile_empty[2];
  };
  __device__ __forceinline__ static Element* vt_smem(SharedStorage& s) { return s.smem_vt.data(); }
  __device__ __forceinline__ static ElementOut* o_smem(SharedStorage& s) { return s.smem_o.data(); }
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "exceeds the sm90 per-block shared memory limit");
};

}  // namespace sparse_prefill::cuda
