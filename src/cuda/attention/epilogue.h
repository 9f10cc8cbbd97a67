// Epilogue policies: where a tile's normalised O and its LSE go.
//   DirectStore:     O in the input dtype through the Q buffer in smem (16-byte stores) into out, LSE into lse.
//   SplitKvPartials: split-KV parts' float32 partials (split_kv/partials.h).
// Both also write the rows of a tile that runs no step (no visible key: O = 0, lse = -inf; a bad tile: NaN).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/memory.h>
#include <cutlass/numeric_conversion.h>

#include "cuda/attention/fwd_problem.h"
#include "cuda/attention/fwd_args.h"
#include "cuda/attention/softmax.h"

namespace sparse_prefill::cuda {

template <class Config>
struct DirectStore {
  using Element = typename Config::ElementOut;
  static constexpr int kBlockM = Config::kBlockM, kHeadDim = Config::kHeadDim;
  struct Params {
    void* out;
    float* lse;  // [Hq, total_q] or null
    int64_t o_row_stride, o_head_stride, lse_head_stride, lse_row_stride;
  };
  static Params to_params(const FwdArgs& a, const SparseFwdArgs*) {
    return {a.out, a.lse, a.o_row_stride, a.o_head_stride, a.lse_head_stride, a.lse_row_stride};
  }
  template <class Work>
  __device__ __forceinline__ static Element* out_ptr(const Params& p, const FwdProblem& pr, const Work& w, int row) {
    return static_cast<Element*>(p.out) + int64_t(w.seq.q_start + w.row_pos(pr, row)) * p.o_row_stride +
           int64_t(w.row_head(pr, row)) * p.o_head_stride;
  }
  template <class Work>
  __device__ __forceinline__ static float* lse_ptr(const Params& p, const FwdProblem& pr, const Work& w, int row) {
    return p.lse + int64_t(w.row_head(pr, row)) * p.lse_head_stride +
           int64_t(w.seq.q_start + w.row_pos(pr, row)) * p.lse_row_stride;
  }

  // No step ran: no visible key for any row of the tile (O = 0, lse = -inf), or a bad tile (Work::bad: NaN).
  // Returns true: a bad tile's violation is reported by the caller (a split-KV part does not report).
  template <class Work>
  __device__ __forceinline__ static bool store_empty(const Params& p, const FwdProblem& pr, const Work& w,
                                                     int mma_tidx) {
    const int tile_rows = w.tile_rows(pr);  // rows past the sequence are computed but never stored
    constexpr int kChunks = kHeadDim / 8;
    constexpr uint32_t kNaN = std::is_same_v<Element, cutlass::bfloat16_t> ? 0x7fc07fc0u : 0x7e007e00u;
    const uint32_t fill = w.bad ? kNaN : 0u;
    for (int idx = mma_tidx; idx < kBlockM * kChunks; idx += Config::kNumMmaThreads) {
      const int row = idx / kChunks, ch = idx % kChunks;
      if (row < tile_rows)
        *reinterpret_cast<uint4*>(out_ptr(p, pr, w, row) + ch * 8) = make_uint4(fill, fill, fill, fill);
    }
    if (p.lse != nullptr && mma_tidx < kBlockM && mma_tidx < tile_rows)
      *lse_ptr(p, pr, w, mma_tidx) = w.bad ? __int_as_float(0x7fc00000) : -INFINITY;
    return true;
  }

  // O (normalised, float32 accumulator tOrO of thr_pv's slice) and lse[] of this thread's rows.
  template <class Storage, class Work, class ThrMma, class TensorO, int kRows>
  __device__ __forceinline__ static void store(const Params& p, const FwdProblem& pr, Storage& storage, const Work& w,
                                               const ThrMma& thr_pv, TensorO& tOrO, const float (&lse)[kRows],
                                               int mma_tidx, int cwg) {
    using namespace cute;
    const int tile_rows = w.tile_rows(pr);
    Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor cO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
    if (p.lse != nullptr && (mma_tidx % 4) == 0) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = get<0>(cO_rc(r, 0));
        if (row < tile_rows) *lse_ptr(p, pr, w, row) = lse[r];
      }
    }
    // O: registers -> smem (this warpgroup's 64 rows of the Q buffer; its own QK GEMMs are complete) -> 16-byte stores.
    Tensor sO = make_tensor(make_smem_ptr(Config::o_smem(storage)), typename Config::SmemLayoutO{});
    Tensor tOsO = thr_pv.partition_C(sO);
    {
      constexpr int N = decltype(size(tOrO))::value;
      cutlass::NumericArrayConverter<Element, float, N> conv;
      Tensor tOrOc = make_tensor_like<Element>(tOrO);
      *reinterpret_cast<cutlass::Array<Element, N>*>(tOrOc.data()) =
          conv(*reinterpret_cast<cutlass::Array<float, N> const*>(tOrO.data()));
      copy(tOrOc, tOsO);
    }
    cutlass::arch::NamedBarrier::sync(128, 1 + cwg);
    {
      constexpr int kChunks = kHeadDim / 8, kLoads = 64 * kChunks / 128;
      const int t = mma_tidx % 128;
      // All the loads, then all the stores, through 32-bit shared addresses: written as one loop, ptxas issued a
      // generic 64-bit load then its global store one pair at a time (ncu at 128K: 5 % of the sparse kernel's warp
      // samples on that line, waiting on each load).
      uint4 vals[kLoads];
      CUTE_UNROLL
      for (int k = 0; k < kLoads; ++k) {
        const int idx = t + 128 * k;
        const int row = cwg * 64 + idx / kChunks, ch = idx % kChunks;
        // Address through the tensor: the swizzle of a GMMA smem layout acts on byte addresses of the smem pointer,
        // so SmemLayoutQ{}(row, col) alone is not the element offset.
        cutlass::arch::shared_load<16>(&vals[k], cast_smem_ptr_to_uint(&sO(row, ch * 8)));
      }
      CUTE_UNROLL
      for (int k = 0; k < kLoads; ++k) {
        const int idx = t + 128 * k;
        const int row = cwg * 64 + idx / kChunks, ch = idx % kChunks;
        if (row < tile_rows) *reinterpret_cast<uint4*>(out_ptr(p, pr, w, row) + ch * 8) = vals[k];
      }
    }
  }
};

}  // namespace sparse_prefill::cuda
