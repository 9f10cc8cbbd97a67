// KvTma: K/V blocks by TMA, contiguous or paged (whole or half boxes). See kv_source.h.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/pipeline/pipeline.hpp>

#include "cuda/attention/block_schedule.h"
#include "cuda/attention/fwd_problem.h"
#include "cuda/common/device_checks.h"
#include "cuda/attention/fwd_args.h"

namespace sparse_prefill::cuda {

template <class Config>
struct KvTma {
  static constexpr int kProducerThreads = 1;  // one thread issues every copy
  static constexpr bool kTransposeV = false;   // V is read MN-major in place (KvTmaTransposeV: FP8)
  static constexpr int kTransposeThreads = 0;  // producer threads that transpose V (KvTmaTransposeV)
  static constexpr bool kGenericProxy = false;
  using Pipeline = typename Config::Pipeline;
  using PipelineState = typename Config::PipelineState;
  static constexpr int kBlockN = Config::kBlockN, kHalfN = Config::kHalfN, kHeadDim = Config::kHeadDim;

  struct Params {
    typename Config::TmaKV tma_k;
    typename Config::TmaKV tma_v;
    typename Config::TmaKVHalf tma_k_half;  // 64-row boxes: paged KV with page_size % 128 == 64 (else unused)
    typename Config::TmaKVHalf tma_v_half;
    int half_boxes;                         // 1: load each K/V block as two 64-row boxes (page_size % 128 == 64)
    const int* block_table;                 // [B, max_pages] (paged KV)
    int64_t block_table_stride;
    int page_size;                          // 0 = contiguous KV
    int num_pages;                          // block_table ids are checked against it where the producer loads them
  };
  template <class MakeGmem>
  static Params to_params(const FwdArgs& a, MakeGmem&& gmem) {
    using namespace cute;
    Params p;
    const auto kv_tile = select<1, 2>(typename Config::TileShapeQK{});
    p.tma_k = make_tma_copy(SM90_TMA_LOAD{},
                            gmem(a.in.k, a.total_k_rows, a.num_kv_heads, a.k_row_stride(), a.k_head_stride()),
                            take<0, 2>(typename Config::SmemLayoutK{}), kv_tile, _1{});
    p.tma_v = make_tma_copy(SM90_TMA_LOAD{},
                            gmem(a.in.v, a.total_k_rows, a.num_kv_heads, a.v_row_stride(), a.v_head_stride()),
                            take<0, 2>(typename Config::SmemLayoutV{}), kv_tile, _1{});
    p.half_boxes = (a.page_size() > 0 && a.page_size() % kBlockN == kHalfN) ? 1 : 0;
    if (p.half_boxes) {
      const auto half_tile = Shape<Int<kHalfN>, Int<kHeadDim>>{};
      p.tma_k_half = make_tma_copy(SM90_TMA_LOAD{},
                                   gmem(a.in.k, a.total_k_rows, a.num_kv_heads, a.k_row_stride(), a.k_head_stride()),
                                   typename Config::SmemLayoutKHalf{}, half_tile, _1{});
      p.tma_v_half = make_tma_copy(SM90_TMA_LOAD{},
                                   gmem(a.in.v, a.total_k_rows, a.num_kv_heads, a.v_row_stride(), a.v_head_stride()),
                                   typename Config::SmemLayoutKHalf{}, half_tile, _1{});
    }
    p.block_table = a.in.block_table;
    p.block_table_stride = a.in.block_table_stride[0];
    p.page_size = a.page_size();
    p.num_pages = int(a.in.num_pages);
    return p;
  }
  __device__ __forceinline__ static void prefetch(const Params& p) {
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    if (p.half_boxes) {
      cute::prefetch_tma_descriptor(p.tma_k_half.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_v_half.get_tma_descriptor());
    }
  }
  template <class PipeParams>
  __device__ __forceinline__ static Pipeline make_pipeline(typename Config::KVPipelineStorage& ps, PipeParams pp) {
    pp.transaction_bytes = Config::kTmaBytesKV;
    pp.is_leader = threadIdx.x == 0;
    pp.num_consumers = Config::kNumMmaThreads;
    return Pipeline(ps.tma, pp, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  }

  // K runs one block ahead of V: the consumer issues S(i) = Q K(i)^T before O += P(i-1) V(i-1).
  template <class LoadK, class LoadV>
  __device__ __forceinline__ static void run_steps(int n_count, LoadK&& load_k, LoadV&& load_v) {
    load_k(0);
    for (int i = 1; i < n_count; ++i) {
      load_k(i);
      load_v(i - 1);
    }
    load_v(n_count - 1);
  }

  // The producer's loads of one tile. kEmptySteps: the schedule has steps without keys (block -1).
  // The parameters come with every call, not held (see SingleTileScheduler::Loop).
  template <bool kEmptySteps, class Poison>
  struct Producer {
    const SeqSpan& seq;
    const int batch, kv_head;  // kv_head: in memory
    Poison& poison;

    // Row of the K/V row space where key block n starts: contiguous (k_start + n*N) or paged (page % N == 0).
    // A step without keys (n < 0) or a bad page: a box past the end, zero-filled by TMA.
    __device__ __forceinline__ int block_row(const Params& p, const FwdProblem& pr, int n) const {
      const int tok = n * kBlockN;
      if constexpr (kEmptySteps) {
        if (n < 0) return pr.total_k_rows;
      }
      if (p.page_size == 0) return seq.k_start + tok;
      const int page = checked_page(p, batch, tok, poison);
      return page < 0 ? pr.total_k_rows : geometry::paged_row(page, tok, p.page_size);
    }
    // Page size % 128 == 64: row of the 64-row half h of key block n, each half from its own page. A half that
    // lies entirely beyond seqused_k reads no block_table entry (the table may have no such page) and points the
    // box past the end of the row space: TMA zero-fills it and still counts its bytes on the mbarrier.
    __device__ __forceinline__ int half_row(const Params& p, const FwdProblem& pr, int n, int h) const {
      const int tok = n * kBlockN + h * kHalfN;
      if (n < 0 || tok >= seq.k_len) return pr.total_k_rows;
      const int page = checked_page(p, batch, tok, poison);
      return page < 0 ? pr.total_k_rows : geometry::paged_row(page, tok, p.page_size);
    }
    // Rows of the K/V row space for one key block: {block row} or {half 0 row, half 1 row} (paged: block_table
    // loads), computed at each K and at each V issue. Computing them once per block and one block ahead was
    // measured slower on the H200 at causal 128K (paged/contiguous 1.057 (page 64) and 1.073 (page 128) against
    // 1.031 and 1.042) and removed (docs/design/dense_kernel.md).
    struct BlockRows {
      int r0, r1;
    };
    __device__ __forceinline__ BlockRows rows_of(const Params& p, const FwdProblem& pr, int n) const {
      if (!p.half_boxes) return {block_row(p, pr, n), 0};
      return {half_row(p, pr, n, 0), half_row(p, pr, n, 1)};
    }
    template <class Tma, class TmaHalf, class SmemX>
    __device__ __forceinline__ void load_block(const Params& p, const FwdProblem& pr, const Tma& tma,
                                               const TmaHalf& tma_half, SmemX& sX, Pipeline& pipe, PipelineState& st,
                                               const BlockRows& rows) const {
      using namespace cute;
      constexpr int kD = kHeadDim;  // a local: make_shape takes its arguments by reference
      Tensor mX = tma.get_tma_tensor(make_shape(pr.total_k_rows, kD, pr.num_kv_heads_mem));
      Tensor mXh = tma_half.get_tma_tensor(make_shape(pr.total_k_rows, kD, pr.num_kv_heads_mem));
      pipe.producer_acquire(st);  // expects kTmaBytesKV on the stage's mbarrier, whatever the box split
      if (!p.half_boxes) {
        Tensor gX = local_tile(domain_offset(make_coord(rows.r0, _0{}), mX(_, _, kv_head)),
                               Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_0{}, _0{}));
        auto [tXgX, tXsX] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(sX), group_modes<0, 2>(gX));
        copy(tma.with(*pipe.producer_get_barrier(st), 0), tXgX, tXsX(_, st.index()));
      } else {
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {
          Tensor gX = local_tile(domain_offset(make_coord(h == 0 ? rows.r0 : rows.r1, _0{}), mXh(_, _, kv_head)),
                                 Shape<Int<kHalfN>, Int<kHeadDim>>{}, make_coord(_0{}, _0{}));
          Tensor sXh = local_tile(sX(_, _, st.index()), Shape<Int<kHalfN>, Int<kHeadDim>>{}, make_coord(h, _0{}));
          auto [tXgX, tXsX] = tma_partition(tma_half, _0{}, Layout<_1>{}, group_modes<0, 2>(sXh),
                                            group_modes<0, 2>(gX));
          copy(tma_half.with(*pipe.producer_get_barrier(st), 0), tXgX, tXsX);
        }
      }
      ++st;
    }
    template <class SmemX>
    __device__ __forceinline__ void load_k(const Params& p, const FwdProblem& pr, SmemX& sK, Pipeline& pipe,
                                           PipelineState& st, int n) const {
      load_block(p, pr, p.tma_k, p.tma_k_half, sK, pipe, st, rows_of(p, pr, n));
    }
    template <class SmemX>
    __device__ __forceinline__ void load_v(const Params& p, const FwdProblem& pr, SmemX& sV, Pipeline& pipe,
                                           PipelineState& st, int n) const {
      load_block(p, pr, p.tma_v, p.tma_v_half, sV, pipe, st, rows_of(p, pr, n));
    }
  };

  // Consumer side. Paged KV: the rows of the last page beyond seqused_k are whatever the engine's cache holds
  // (possibly NaN bit patterns). Their keys are masked (the select replaces even a NaN logit by -inf, so P is exactly
  // 0), but 0 x NaN = NaN in O += P V, so the V rows of the tail block beyond k_len are zeroed in smem before the PV
  // GEMM. At most once per tile; contiguous KV never needs it (rows past a sequence belong to the next sequence or are
  // TMA zero-fill).
  __device__ __forceinline__ static int v_tail_block(const Params& p, const SeqSpan& seq) {
    return (p.page_size != 0 && (seq.k_len % kBlockN) != 0) ? seq.k_len / kBlockN : -1;
  }
  template <class PipelineT, class State>
  __device__ __forceinline__ static void wait(PipelineT& pipe, const State& s) {
    pipe.consumer_wait(s);
  }
};

}  // namespace sparse_prefill::cuda
