// Measurement scaffolding for issue 16 ("find where the time goes: variants that skip one stage"), not a feature:
// SP_ABLATE, a bit mask passed as a CUDA flag to a build made only for `scripts/gpu.sh abflags`
// (e.g. SP_AB_FLAGS=";-DSP_ABLATE=1;-DSP_ABLATE=2;-DSP_ABLATE=3"), makes the PackGQA kernels (sparse, split-KV
// units, dense over PackGQA tiles) skip per-tile stages, so that each stage's cost shows as a time delta. Such a
// build computes wrong outputs. The default, 0, compiles every stage and none of these branches (`if constexpr`).
// Why (bench/NOTES_sparse.md, "Issue 16 at 275ed6f"): stall samples put 32 % of the sparse kernel's consumer warp
// time outside its step loop at 128K, yet removing a third of that code moved the kernel 0-2.4 %; only a variant
// without a stage says what the stage costs. Delete this header once the measurement is in the notes.
#pragma once

#ifndef SP_ABLATE
#define SP_ABLATE 0
#endif

namespace sparse_prefill::cuda::ablate {
inline constexpr bool kQGather = (SP_ABLATE & 1) != 0;  // consumers skip the PackGQA Q gather (stale Q in smem)
inline constexpr bool kStoreO = (SP_ABLATE & 2) != 0;   // DirectStore writes no O and no LSE (not even to smem)
inline constexpr bool kMask = (SP_ABLATE & 4) != 0;     // no element-wise mask (diagonal blocks, tails)
}  // namespace sparse_prefill::cuda::ablate
