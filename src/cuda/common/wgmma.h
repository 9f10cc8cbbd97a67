// One warpgroup-wide wgmma batch, shared by the attention kernel (S = Q K^T, O += P V) and the index stage's scorer
// (S = Q K_mean^T).
#pragma once

#include <cute/tensor.hpp>

namespace sparse_prefill::cuda {

// Issues one warpgroup-wide wgmma batch: C (+)= A * B over all k-steps of the operands. Does not wait.
// kARegs: A comes from registers (RS wgmma) rather than smem descriptors (SS).
template <bool kARegs, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void wgmma_batch(TiledMma& mma, TA const& tA, TB const& tB, TC& tC, bool zero_init) {
  using namespace cute;
  if constexpr (kARegs) warpgroup_fence_operand(const_cast<TA&>(tA));
  warpgroup_fence_operand(tC);
  warpgroup_arrive();
  mma.accumulate_ = zero_init ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tA); ++k) {
    cute::gemm(mma, tA(_, _, k), tB(_, _, k), tC);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(tC);
  if constexpr (kARegs) warpgroup_fence_operand(const_cast<TA&>(tA));
}

}  // namespace sparse_prefill::cuda
