// Compile-time configuration of the sm90 forward kernel: tile sizes, shared-memory layouts, tiled MMAs, TMA types.
//
// Tile choice (hdim 128): 128 query rows x 128 keys per step, 2 consumer warpgroups of 64 rows each, 1 producer
// warpgroup (one thread issues TMA). Q 32 KiB + K 3x32 KiB + V 3x32 KiB = 224 KiB smem -> 1 CTA/SM, 384 threads
// (3-stage K/V pipelines).
// S = Q K^T is an SS wgmma (64x128x16 atoms, 8 k-steps); O += P V is an RS wgmma with P in registers (64x128x16,
// B = V^T read MN-major from the same smem tile, no transpose copy).
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "core/geometry.h"

namespace sparse_prefill::cuda {

template <class Element_, int kHeadDim_>
struct FwdConfig {
  using Element = Element_;
  using ElementOut = Element_;  // out's dtype (the FP8 config, config_fp8.h, writes bfloat16)
  using Accum = float;
  static constexpr bool kTwoLevelPv = false;  // O += P V straight into O (see FwdConfigFp8)
  static constexpr bool kIntraWgOverlap = true;  // softmax(i) under the GEMMs S(i+1), O += P(i) V(i) (mainloop_sm90.h)
  static constexpr int kMaxOffset = 0;        // P = exp2(s - max) in [0, 1]
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = geometry::kTileRows;  // a CTA's query rows: one PackGQA / selection tile
  static constexpr int kBlockN = geometry::kKeyStep;
  // 3 stages (224 KiB smem, still 1 CTA/SM). Measured on the H200 against 2 stages, same process: causal 8K
  // 0.885 ms vs 0.900 (2 stages), 32K 14.68 vs 14.94, 64K 58.49 vs 59.10.
  static constexpr int kStages = 3;
  static constexpr int kNumMmaWarpGroups = kBlockM / 64;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * 128;
  static constexpr int kNumThreads = kNumMmaThreads + 128;  // + producer warpgroup
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;  // 24*128 + 240*256 = 64512 <= 65536

  using TileShapeQK = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kHeadDim>>;
  using TileShapePV = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kBlockN>>;
  using AtomLayout = cute::Layout<cute::Shape<cute::Int<kNumMmaWarpGroups>, cute::_1, cute::_1>>;

  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, Accum, TileShapeQK>(), AtomLayout{}));
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, Accum, TileShapePV, cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      AtomLayout{}));

  template <int kRows, int kCols>  // 128-byte-swizzled K-major GMMA atom for a (rows, cols) tile
  using KMajorAtom = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                              cute::GMMA::Major::K, Element, cute::Int<kRows>, cute::Int<kCols>>());
  using SmemLayoutAtomQ = KMajorAtom<kBlockM, kHeadDim>;
  using SmemLayoutQ =
      decltype(cute::tile_to_shape(SmemLayoutAtomQ{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutAtomK = KMajorAtom<kBlockN, kHeadDim>;
  using SmemLayoutK = decltype(cute::tile_to_shape(
      SmemLayoutAtomK{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  using SmemLayoutV = SmemLayoutK;
  // V^T view (D, N, stages) of the V tiles, for the MN-major B operand of O += P V.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutV{},
      cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStages>>{},
                                cute::Step<cute::_2, cute::_1, cute::_3>{})));

  // Global tensors seen by TMA: (rows, D, heads) with runtime row/head strides.
  using ShapeRows = cute::Shape<int32_t, int32_t, int32_t>;
  using StrideRows = cute::Stride<int64_t, cute::_1, int64_t>;
  using GmemTensor = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                                ShapeRows{}, StrideRows{}));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                            cute::select<0, 2>(TileShapeQK{}), cute::_1{}));
  using TmaKV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, cute::take<0, 2>(SmemLayoutK{}),
                                             cute::select<1, 2>(TileShapeQK{}), cute::_1{}));

  // Paged KV with page_size % 128 != 0 (page_size % 64 == 0): each 128-key block is loaded as two 64-row boxes,
  // each from its own page, into the two row halves of the same smem stage (same mbarrier, same byte count).
  static constexpr int kHalfN = kBlockN / 2;
  // The half is a row slice of one (128, D) stage, so its layout is NOT compact: the two 64-column swizzle blocks
  // of a half lie 128 rows apart. The TMA atom must be built from this strided layout, so that one instruction covers
  // one contiguous (64 rows x 64 cols) chunk (tma_partition splits a copy by the smem tensor's contiguous runs).
  using SmemLayoutKHalf = decltype(cute::composition(
      cute::take<0, 2>(SmemLayoutK{}),
      cute::make_tile(cute::Layout<cute::Int<kHalfN>>{}, cute::Layout<cute::Int<kHeadDim>>{})));
  using TmaKVHalf = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKHalf{},
                                                 cute::Shape<cute::Int<kHalfN>, cute::Int<kHeadDim>>{}, cute::_1{}));

  static constexpr int kMaxCorrChunks = 64;  // 64 x 128 pooled blocks: 1M tokens at block_size 128 (1 KiB)
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  // Paged KV with page_size % 64 != 0 (KvCpAsyncGather, kv_gather.h): the 128 producer threads gather K/V rows with
  // cp.async and each arrives on the stage's full barrier when its copies land (no transaction bytes).
  using PipelineGather = cutlass::PipelineAsync<kStages>;
  using PipelineState = typename cutlass::PipelineState<kStages>;
  union KVPipelineStorage {  // one kernel instantiation uses one of the two (same size: 2 x kStages mbarriers)
    typename Pipeline::SharedStorage tma;
    typename PipelineGather::SharedStorage gather;
  };

  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> smem_q;  // also the O staging buffer
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> smem_k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> smem_v;
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_q;   // Q tile landed (TMA transaction)
    cutlass::arch::ClusterBarrier barrier_q_empty;                     // consumers done with the Q/O buffer
    KVPipelineStorage pipeline_k;
    KVPipelineStorage pipeline_v;
    // Sparse mode: the listed blocks of the tile's first kMaxCorrChunks correction chunks as a bitmap (the
    // correction mask reads 4 words per step instead of walking the list in global memory), and the dynamic tile
    // scheduler's two slots (producer -> consumers).
    uint32_t listed_bits[kMaxCorrChunks * kBlockN / 32];
    int tile_ids[2];
    alignas(16) unsigned char tile_work[2][192];  // ... and the Work of each (scheduler.h)
    int poisoned[4];  // device-side checks: tile publication number + 1 of a tile that met a bad page / block id
    int4 poison_info[4];  // ... and what it met (code, index, value): the consumers report it (kernel_sm90.h)
    cutlass::arch::ClusterBarrier tile_full[2];
    cutlass::arch::ClusterBarrier tile_empty[2];
  };
  // The V^T operand of O += P V (a view of the V tiles) and the O staging buffer (the Q buffer).
  using SmemLayoutO = SmemLayoutQ;
  __device__ __forceinline__ static Element* vt_smem(SharedStorage& s) { return s.smem_v.data(); }
  __device__ __forceinline__ static ElementOut* o_smem(SharedStorage& s) { return s.smem_q.data(); }
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "exceeds the sm90 per-block shared memory limit");
};

}  // namespace sparse_prefill::cuda
