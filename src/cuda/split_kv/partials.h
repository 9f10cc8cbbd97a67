// The split-KV epilogue policy: a split-KV part (Work::slot >= 0) writes float32 partial O and LSE into its slot of
// the launch workspace (plan_combine.cu combines them); a unit that is the whole tile stores directly (DirectStore).
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/attention/epilogue.h"
#include "cuda/attention/fwd_args.h"
#include "cuda/attention/fwd_problem.h"
#include "cuda/attention/softmax.h"

namespace sparse_prefill::cuda {

template <class Config>
struct SplitKvPartials {
  using Direct = DirectStore<Config>;
  static constexpr int kBlockM = Config::kBlockM, kHeadDim = Config::kHeadDim;
  struct Params : Direct::Params {
    float* o_partial;    // [slot, 128, D]
    float* lse_partial;  // [slot, 128]
  };
  static Params to_params(const FwdArgs& a, const SparseFwdArgs* s) {
    Params p;
    static_cast<typename Direct::Params&>(p) = Direct::to_params(a, s);
    p.o_partial = s->launch.o_partial;
    p.lse_partial = s->launch.lse_partial;
    return p;
  }
  template <class Work>
  __device__ __forceinline__ static float* partial_o(const Params& p, const Work& w, int row) {
    return p.o_partial + (int64_t(w.slot) * kBlockM + row) * kHeadDim;
  }
  template <class Work>
  __device__ __forceinline__ static float* partial_lse(const Params& p, const Work& w, int row) {
    return p.lse_partial + int64_t(w.slot) * kBlockM + row;
  }

  template <class Work>
  __device__ __forceinline__ static bool store_empty(const Params& p, const FwdProblem& pr, const Work& w,
                                                     int mma_tidx) {
    const int tile_rows = w.tile_rows(pr);  // rows past the sequence are computed but never stored
    if (w.slot < 0) return Direct::store_empty(p, pr, w, mma_tidx);
    // An empty share of the tile's steps: O = 0, lse = -inf.
    for (int idx = mma_tidx; idx < kBlockM * (kHeadDim / 4); idx += Config::kNumMmaThreads) {
      const int row = idx / (kHeadDim / 4), ch = idx % (kHeadDim / 4);
      if (row < tile_rows) *reinterpret_cast<float4*>(partial_o(p, w, row) + ch * 4) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (mma_tidx < kBlockM && mma_tidx < tile_rows) *partial_lse(p, w, mma_tidx) = -INFINITY;
    return false;
  }

  template <class Storage, class Work, class ThrMma, class TensorO, int kRows>
  __device__ __forceinline__ static void store(const Params& p, const FwdProblem& pr, Storage& storage, const Work& w,
                                               const ThrMma& thr_pv, TensorO& tOrO, const float (&lse)[kRows],
                                               int mma_tidx, int cwg) {
    using namespace cute;
    if (w.slot < 0) return Direct::store(p, pr, storage, w, thr_pv, tOrO, lse, mma_tidx, cwg);
    // Float32 partial O and LSE straight from registers (column pairs are adjacent: 8-byte stores).
    const int tile_rows = w.tile_rows(pr);
    Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor cO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
    Tensor O_rc = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = get<0>(cO_rc(r, 0));
      if (row >= tile_rows) continue;
      float* dst = partial_o(p, w, row);
      CUTE_UNROLL
      for (int c = 0; c < size<1>(O_rc); c += 2)
        *reinterpret_cast<float2*>(dst + get<1>(cO_rc(r, c))) = make_float2(O_rc(r, c), O_rc(r, c + 1));
      if ((mma_tidx % 4) == 0) *partial_lse(p, w, row) = lse[r];
    }
  }
};

}  // namespace sparse_prefill::cuda
