// KvCpAsyncGather: paged K/V rows gathered by the whole producer warpgroup with cp.async. See kv_source.h.
//
// Each lane reads the block_table entry of one of its warp's 32 key rows once per block (gather_row), and each warp
// copies those rows as whole 256-byte rows (16 lanes per row, the row's page offset shuffled from the lane that
// loaded it); each producer thread arrives on the stage's full barrier when its copies land (no transaction bytes).
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "cuda/attention/block_schedule.h"
#include "cuda/attention/fwd_problem.h"
#include "cuda/common/device_checks.h"
#include "cuda/attention/fwd_args.h"

namespace sparse_prefill::cuda {

template <class Config>
struct KvCpAsyncGather {
  static constexpr int kProducerThreads = 128;  // the whole producer warpgroup copies
  static constexpr bool kTransposeV = false;
  static constexpr int kTransposeThreads = 0;
  static constexpr bool kGenericProxy = true;   // cp.async writes through the generic proxy
  using Pipeline = typename Config::PipelineGather;
  using PipelineState = typename Config::PipelineState;
  using Element = typename Config::Element;
  static constexpr int kBlockN = Config::kBlockN, kHeadDim = Config::kHeadDim;

  struct Params {
    const void* k;
    const void* v;
    int64_t k_row_stride, k_head_stride, v_row_stride, v_head_stride;  // per token inside the page buffer
    const int* block_table;  // [B, max_pages]
    int64_t block_table_stride;
    int page_size;
    int num_pages;
  };
  template <class MakeGmem>
  static Params to_params(const FwdArgs& a, MakeGmem&&) {
    return {a.in.k, a.in.v, a.k_row_stride(), a.k_head_stride(), a.v_row_stride(), a.v_head_stride(),
            a.in.block_table, a.in.block_table_stride[0], a.page_size(), int(a.in.num_pages)};
  }
  __device__ __forceinline__ static void prefetch(const Params&) {}
  template <class PipeParams>
  __device__ __forceinline__ static Pipeline make_pipeline(typename Config::KVPipelineStorage& ps, PipeParams pp) {
    pp.producer_arv_count = kProducerThreads;  // every producer thread's cp.async arrive (noinc)
    pp.consumer_arv_count = Config::kNumMmaThreads;
    return Pipeline(ps.gather, pp);
  }

  // One inlined copy of each gather (K and V), not three: page 16, causal 32K went from 1.35x to 1.20x the
  // contiguous time with this loop (H200).
  template <class LoadK, class LoadV>
  __device__ __forceinline__ static void run_steps(int n_count, LoadK&& load_k, LoadV&& load_v) {
    for (int i = 0; i <= n_count; ++i) {
      if (i < n_count) load_k(i);
      if (i > 0) load_v(i - 1);
    }
  }

  template <bool kEmptySteps, class Poison>
  struct Producer {  // the parameters come with every call, not held (see SingleTileScheduler::Loop)
    static_assert(!kEmptySteps, "the cp.async gather serves the dense schedule");
    const SeqSpan& seq;
    const int batch, kv_head;  // kv_head: in memory
    Poison& poison;


    // 16-byte chunks per K/V row, and rows one warp-wide cp.async covers.
    static constexpr int kChunks = kHeadDim * int(sizeof(Element)) / 16;
    static constexpr int kRowsPerCopy = 32 / kChunks;

    // The paged row (row space of the cache) of one row of key block n per lane, -1 past seqused_k (zero-filled:
    // the tail rows of the last page are never read, so NaN there cannot leak). Lane l of warp w holds block row
    // 32 w + kRowsPerCopy * (l % kChunks) + l / kChunks: copy j then takes its rows from lane j of each kChunks-lane
    // segment, a shuffle with an immediate lane index.
    __device__ __forceinline__ int gather_row(const Params& p, int n, int lane, int warp) const {
      const int tok = n * kBlockN + 32 * warp + kRowsPerCopy * (lane % kChunks) + lane / kChunks;
      if (tok >= seq.k_len) return -1;
      const int page = checked_page(p, batch, tok, poison);
      return page < 0 ? 0 : geometry::paged_row(page, tok, p.page_size);  // bad page: row 0, in bounds
    }
    // Each warp copies its 32 rows, kRowsPerCopy per instruction (the lanes of a row read its contiguous bytes).
    // Smem address of (row, 16-byte chunk c) in a stage, in the 128-byte-swizzled K-major layout the GMMA
    // descriptors read (64-column atoms of 8 x 128-byte rows, stacked along the rows; the 16-byte unit index
    // XOR row % 8): stage + (c / 8) * kBlockN * 128 + row * 128 + ((c % 8) ^ (row % 8)) * 16. A lane's rows are
    // row0 + j * kRowsPerCopy with row0 < kRowsPerCopy (a power of two), so row % 8 = row0 | (j * kRowsPerCopy % 8):
    // the 8 / kRowsPerCopy XOR patterns are computed once per block and the rest of the address is an immediate.
    // A copy is then a shuffle, a wide multiply-add and the cp.async (5 SASS instructions with the 64-bit add;
    // these 4 warps share issue slots with the consumers, and every instruction per copy shows in the time: see
    // the unroll note below). Only the block holding seqused_k pays for predicates (zero-fill past it).
    template <class SmemX>
    __device__ __forceinline__ void gather_block(const Params& p, const void* base, int64_t head_stride,
                                                 uint32_t row_bytes, SmemX& sX, Pipeline& pipe, PipelineState& st,
                                                 int n) const {
      using namespace cute;
      constexpr int kPatterns = 8 / kRowsPerCopy;
      static_assert(kRowsPerCopy == 2 || kRowsPerCopy == 4, "rows of 256 or 128 bytes");
      static_assert(sizeof(Element) == 2);
      using SmemLayoutK = typename Config::SmemLayoutK;  // the layout the formula above assumes
      static_assert(std::is_same_v<decltype(get_swizzle_portion(SmemLayoutK{})), Swizzle<3, 4, 3>>);
      static_assert(get_nonswizzle_portion(SmemLayoutK{})(1, 0, 0) == 64 &&
                    get_nonswizzle_portion(SmemLayoutK{})(kBlockN - 1, 63, 0) == (kBlockN - 1) * 64 + 63 &&
                    get_nonswizzle_portion(SmemLayoutK{})(0, kHeadDim - 1, 0) ==
                        (kHeadDim / 64 - 1) * kBlockN * 64 + 63);
      const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
      const int my_row = gather_row(p, n, lane, warp);  // before the wait: its block_table load overlaps it
      const int ch = lane % kChunks, row0 = lane / kChunks;
      const uint64_t src0 = reinterpret_cast<uint64_t>(base) + uint64_t(int64_t(kv_head) * head_stride + ch * 8) * 2;
      const uint32_t dst0 = cast_smem_ptr_to_uint(&sX(0, 0, st.index())) + (ch / 8) * (kBlockN * 128) +
                            (32 * warp + row0) * 128;
      uint32_t dst[kPatterns];
      CUTE_UNROLL
      for (int k = 0; k < kPatterns; ++k)
        dst[k] = dst0 + ((uint32_t((ch % 8) ^ row0) ^ uint32_t(k * kRowsPerCopy)) * 16);
      auto src_of = [&](uint32_t row) {  // one IMAD.WIDE.U32 with the 64-bit addend
        uint64_t a;
        asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(a) : "r"(row), "r"(row_bytes), "l"(src0));
        return a;
      };
      pipe.producer_acquire(st);
      if ((n + 1) * kBlockN <= seq.k_len) {
        // Fully unrolled (immediate shuffle lanes and smem offsets): at page 16, causal 32K / 128K, the
        // paged/contiguous ratio was 1.19 / 1.26 unrolled, 1.31 / 1.40 unrolled by 4, 1.38 / 1.46 by 2 (H200).
        CUTE_UNROLL
        for (int j = 0; j < kChunks; ++j) {
          const int src_row = __shfl_sync(0xffffffffu, my_row, j, kChunks);
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                       ::"r"(dst[j % kPatterns] + j * kRowsPerCopy * 128), "l"(src_of(uint32_t(src_row))));
        }
      } else {  // the block holding seqused_k: rows past it are zero-filled (src-size 0), never read
#pragma unroll 1
        for (int j = 0; j < kChunks; ++j) {
          const int src_row = __shfl_sync(0xffffffffu, my_row, j, kChunks);
          const uint32_t d = dst0 + j * kRowsPerCopy * 128 +
                             ((uint32_t((ch % 8) ^ row0) ^ uint32_t(j * kRowsPerCopy % 8)) * 16);
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d),
                       "l"(src_of(uint32_t(src_row < 0 ? 0 : src_row))), "r"(src_row < 0 ? 0 : 16));
        }
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(pipe.producer_get_barrier(st));
      ++st;
    }
    template <class SmemX>
    __device__ __forceinline__ void load_k(const Params& p, const FwdProblem&, SmemX& sK, Pipeline& pipe,
                                           PipelineState& st, int n) const {
      gather_block(p, p.k, p.k_head_stride, uint32_t(p.k_row_stride * 2), sK, pipe, st, n);
    }
    template <class SmemX>
    __device__ __forceinline__ void load_v(const Params& p, const FwdProblem&, SmemX& sV, Pipeline& pipe,
                                           PipelineState& st, int n) const {
      gather_block(p, p.v, p.v_head_stride, uint32_t(p.v_row_stride * 2), sV, pipe, st, n);
    }
  };

  // The gather zero-fills the rows past seqused_k itself: no V tail to sanitize.
  __device__ __forceinline__ static constexpr int v_tail_block(const Params&, const SeqSpan&) { return -1; }
  // A stage filled by cp.async (generic proxy) is read by wgmma (async proxy): fence after the barrier wait, as
  // the PTX memory model asks. Measured free (H200, page 16, causal 32K: 19.62 ms with it, 19.63 without, 19.78
  // with one fence per step after waiting V(i-1) early), so it stays.
  template <class PipelineT, class State>
  __device__ __forceinline__ static void wait(PipelineT& pipe, const State& s) {
    pipe.consumer_wait(s);
    cutlass::arch::fence_view_async_shared();
  }
};

}  // namespace sparse_prefill::cuda
