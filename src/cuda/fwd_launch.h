// Host side of the forward kernel: builds the TMA descriptors (host-only encode, no device sync, no allocation)
// and launches. Included by exactly one translation unit per (dtype, head dim).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "cuda/fwd_args.h"
#include "cuda/fwd_kernel.h"

namespace sparse_prefill::cuda {

// Dense (sparse == nullptr) or block-sparse launch.
// kWithSparse = false instantiates the dense kernel only (head dim 64: the block-sparse path is built for 128).
template <class Element, int kHeadDim, bool kWithSparse = true>
void run_fwd(const FwdArgs& a, const SparseFwdArgs* sparse = nullptr) {
  using namespace cute;
  using Config = FwdConfig<Element, kHeadDim>;
  if (!kWithSparse && sparse != nullptr)
    throw std::runtime_error("sparse_prefill cuda: no block-sparse kernel for head dim " + std::to_string(kHeadDim));
  if (a.total_q == 0 || a.batch == 0) return;

  auto gmem = [](const void* ptr, int rows, int heads, int64_t row_stride, int64_t head_stride) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                       make_shape(int32_t(rows), int32_t(kHeadDim), int32_t(heads)),
                       make_stride(row_stride, _1{}, head_stride));
  };
  FwdParams<Config> p;
  p.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gmem(a.q, a.total_q, a.num_q_heads, a.q_row_stride, a.q_head_stride),
                          typename Config::SmemLayoutQ{}, select<0, 2>(typename Config::TileShapeQK{}), _1{});
  const auto kv_tile = select<1, 2>(typename Config::TileShapeQK{});
  p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gmem(a.k, a.total_k_rows, a.num_kv_heads, a.k_row_stride, a.k_head_stride),
                          take<0, 2>(typename Config::SmemLayoutK{}), kv_tile, _1{});
  p.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gmem(a.v, a.total_k_rows, a.num_kv_heads, a.v_row_stride, a.v_head_stride),
                          take<0, 2>(typename Config::SmemLayoutV{}), kv_tile, _1{});
  // Paged KV: page_size % 128 == 0 one 128-row box per key block; % 128 == 64 two 64-row boxes, one per page;
  // other page sizes the cp.async gather instantiation (kGatherKV).
  const bool gather = a.page_size > 0 && a.page_size % Config::kHalfN != 0;
  if (gather && sparse != nullptr)
    throw std::runtime_error("sparse_prefill cuda: the block-sparse kernel needs page_size % 64 == 0");
  p.half_boxes = (a.page_size > 0 && a.page_size % Config::kBlockN == Config::kHalfN) ? 1 : 0;
  if (p.half_boxes) {
    const auto half_tile = Shape<Int<Config::kHalfN>, Int<kHeadDim>>{};
    p.tma_k_half = make_tma_copy(SM90_TMA_LOAD{},
                                 gmem(a.k, a.total_k_rows, a.num_kv_heads, a.k_row_stride, a.k_head_stride),
                                 typename Config::SmemLayoutKHalf{}, half_tile, _1{});
    p.tma_v_half = make_tma_copy(SM90_TMA_LOAD{},
                                 gmem(a.v, a.total_k_rows, a.num_kv_heads, a.v_row_stride, a.v_head_stride),
                                 typename Config::SmemLayoutKHalf{}, half_tile, _1{});
  }
  p.q = a.q;
  p.q_row_stride = a.q_row_stride;
  p.q_head_stride = a.q_head_stride;
  p.k = a.k;
  p.v = a.v;
  p.k_row_stride = a.k_row_stride;
  p.k_head_stride = a.k_head_stride;
  p.v_row_stride = a.v_row_stride;
  p.v_head_stride = a.v_head_stride;
  p.out = a.out;
  p.lse = a.lse;
  p.o_row_stride = a.o_row_stride;
  p.o_head_stride = a.o_head_stride;
  p.lse_head_stride = a.lse_head_stride;
  p.lse_row_stride = a.lse_row_stride;
  p.cu_seqlens_q = a.cu_seqlens_q;
  p.cu_seqlens_k = a.cu_seqlens_k;
  p.block_table = a.block_table;
  p.seqused_k = a.page_size > 0 ? a.seqused_k : nullptr;
  p.block_table_stride = a.block_table_stride;
  p.total_q = a.total_q;
  p.total_k_rows = a.total_k_rows;
  p.num_q_heads = a.num_q_heads;
  p.num_kv_heads = p.num_kv_heads_mem = a.num_kv_heads;
  p.group_size = a.num_q_heads / a.num_kv_heads;
  p.kv_split = 1;
  p.page_size = a.page_size;
  p.num_m_blocks = (a.max_seqlen_q + Config::kBlockM - 1) / Config::kBlockM;
  p.tile_counter = nullptr;
  p.plan = nullptr;
  p.split_tiles = p.slot_tile = nullptr;
  p.o_partial = p.lse_partial = nullptr;
  p.num_coord_tiles = 0;
  p.full_list = 0;
  p.batch = a.batch;
  p.softmax_scale = a.softmax_scale;
  p.scale_log2 = a.softmax_scale * float(M_LOG2E);
  p.window_left = a.window_left;
  p.window_right = a.causal ? 0 : a.window_right;
  p.err = device_error_word();
  p.limits = a.limits;
  p.num_pages = a.num_pages;
  p.num_segments = p.num_block_ids = 0;
  int64_t num_tiles = int64_t(a.num_q_heads) * p.num_m_blocks * a.batch;
  if (sparse != nullptr) {
    // PackGQA tiles: ceil(Lq * g / 128) per (sequence, virtual KV head: g = Hq / Hkv / head_subgroups query heads);
    // the grid covers the longest sequence.
    p.kv_split = sparse->head_subgroups;
    p.num_kv_heads = a.num_kv_heads * p.kv_split;
    p.group_size = a.num_q_heads / p.num_kv_heads;
    const int g = p.group_size;
    p.num_m_blocks = int((int64_t(a.max_seqlen_q) * g + Config::kBlockM - 1) / Config::kBlockM);
    num_tiles = int64_t(p.num_kv_heads) * p.num_m_blocks * a.batch;
    const int mean_rows = int(std::max<int64_t>(sparse->mean_rows, 1));
    auto means = [&](const void* ptr) {  // [mean_rows, Hkv, D], contiguous
      return make_tma_copy(SM90_TMA_LOAD{}, gmem(ptr, mean_rows, a.num_kv_heads, int64_t(a.num_kv_heads) * kHeadDim,
                                                 kHeadDim),
                           take<0, 2>(typename Config::SmemLayoutK{}), kv_tile, _1{});
    };
    // Without correction no mean is ever loaded, but the descriptors need a valid domain: describe k instead.
    const bool have_means = sparse_correction_on(*sparse);
    p.tma_k_mean = have_means ? means(sparse->k_mean) : p.tma_k;
    p.tma_v_mean = have_means ? means(sparse->v_mean) : p.tma_v;
    p.mean_rows = have_means ? mean_rows : 1;
    p.seg_start = sparse->segment_start;
    p.seg_end = sparse->segment_end;
    p.block_ids = sparse->block_ids;
    p.cu_tiles = sparse->cu_tiles;
    p.cu_blocks = sparse->cu_blocks;
    p.num_segments = sparse->num_segments;
    p.num_block_ids = sparse->num_block_ids;
    p.block_size = sparse->block_size;
    p.correction = have_means ? 1 : 0;
    p.full_list = sparse->full_list ? 1 : 0;
    p.corr_bias_full = std::log2(float(sparse->block_size)) / p.scale_log2;
    const SparseLaunchWorkspace& w = sparse->launch;
    p.tile_counter = w.counters != nullptr ? w.counters + SparseLaunchWorkspace::kTileCounter : nullptr;
    p.plan = w.counters != nullptr && w.plan ? w.counters : nullptr;  // planned implies persistent (split_planned)
    p.split_tiles = w.split_tiles;
    p.slot_tile = w.slot_tile;
    p.o_partial = w.o_partial;
    p.lse_partial = w.lse_partial;
    p.num_coord_tiles = int(std::min<int64_t>(num_tiles, INT32_MAX));
    if (p.plan != nullptr) num_tiles += w.max_split_units;
  }
  if (p.num_m_blocks == 0) return;
  if (num_tiles > INT32_MAX) throw std::runtime_error("sparse_prefill cuda: too many tiles");
  p.num_tiles = int(num_tiles);

  // Dense: one CTA per tile. Sparse: persistent with the dynamic scheduler (it tied one CTA per tile on the H200,
  // 128K: 6.64 vs 6.49 ms, NOTES_sparse.md, and is the base for the split-KV plan), so it needs the launch counters.
  if (sparse != nullptr && p.tile_counter == nullptr)
    throw std::runtime_error("sparse_prefill cuda: a sparse launch needs its launch workspace (counters)");
  using Kernel = void (*)(FwdParams<Config>);
  Kernel kernel = gather ? fwd_kernel<Config, false, false, true> : fwd_kernel<Config, false>;
  if constexpr (kWithSparse) {
    if (sparse != nullptr) kernel = p.plan != nullptr ? fwd_kernel<Config, true, true> : fwd_kernel<Config, true>;
  }
  static const cudaError_t attr_err = [] {  // once per instantiation; not a stream operation
    cudaError_t e = cudaSuccess;
    for (Kernel k : {fwd_kernel<Config, false>, fwd_kernel<Config, false, false, true>}) {
      const cudaError_t r = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, Config::kSmemBytes);
      if (r != cudaSuccess) e = r;
    }
    if constexpr (kWithSparse) {
      for (Kernel k : {fwd_kernel<Config, true>, fwd_kernel<Config, true, true>}) {
        const cudaError_t r = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, Config::kSmemBytes);
        if (r != cudaSuccess) e = r;
      }
    }
    return e;
  }();
  if (attr_err != cudaSuccess)
    throw std::runtime_error(std::string("sparse_prefill cuda: cudaFuncSetAttribute: ") + cudaGetErrorString(attr_err));
  int grid = p.num_tiles;
  if (sparse != nullptr) grid = std::min(grid, num_sms());
  // Sparse: the counters (tile counter, plan) were zeroed and the plan built on the stream by run_split_plan.
  kernel<<<grid, Config::kNumThreads, Config::kSmemBytes, static_cast<cudaStream_t>(a.stream)>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("sparse_prefill cuda: forward launch failed: ") + cudaGetErrorString(err));
}

}  // namespace sparse_prefill::cuda
