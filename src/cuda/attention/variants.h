// The attention kernels that are built, by name (one set per dtype x head dim, launch.h picks one per launch).
#pragma once

#include "cuda/attention/config_fp8.h"
#include "cuda/attention/kernel_sm90.h"
#include "cuda/attention/kv_tma_vt.h"
#include "cuda/split_kv/partials.h"

namespace sparse_prefill::cuda {

// Dense attention: contiguous or paged KV with page_size % 64 == 0, one tile per CTA.
template <class Config>
using DenseFwd = FwdKernel<Mainloop<Config, QTma, KvTma, DenseRange, NoFusion>, DirectStore, SingleTileScheduler>;
// Dense attention over paged KV whose page_size is not a multiple of 64: the cp.async gather producer.
template <class Config>
using DensePagedGatherFwd =
    FwdKernel<Mainloop<Config, QTma, KvCpAsyncGather, DenseRange, NoFusion>, DirectStore, SingleTileScheduler>;
// Dense FP8 attention (Config = FwdConfigFp8, config_fp8.h): the TMA loads of DenseFwd, V transposed in shared
// memory by the producer warpgroup's warps 1-3, the descales folded into the softmax scale and the normalisation.
template <class Config>
using DenseFp8Fwd =
    FwdKernel<Mainloop<Config, QTma, KvTmaTransposeV, DenseRange, Fp8Descale>, DirectStore, SingleTileScheduler>;
// Block-sparse attention (CSR index or the full list) with mean correction, persistent, one-shot launches.
template <class Config>
using SparseFwd = FwdKernel<Mainloop<Config, QPackGqaGather, KvTma, CsrBlocks, MeanCorrection>, DirectStore,
                            DynamicPersistentScheduler>;
// The same over the split-KV plan's units (chunk shapes, split_kv/plan_combine.cu): split parts write float32 partials.
template <class Config>
using SparseSplitKvFwd = FwdKernel<Mainloop<Config, QPackGqaGather, KvTma, CsrBlocks, MeanCorrection>,
                                   SplitKvPartials, PlannedScheduler>;
// Both without the correction (the library's default, and dense attention over PackGQA tiles): no correction
// steps, so the step loop carries neither their branches nor their registers (the listed-block words and the chunk
// state; MeanCorrection's runtime-off path keeps both).
template <class Config>
using SparseNoCorrFwd = FwdKernel<Mainloop<Config, QPackGqaGather, KvTma, CsrBlocks, NoFusion>, DirectStore,
                                  DynamicPersistentScheduler>;
template <class Config>
using SparseSplitKvNoCorrFwd = FwdKernel<Mainloop<Config, QPackGqaGather, KvTma, CsrBlocks, NoFusion>,
                                         SplitKvPartials, PlannedScheduler>;
// Block-sparse FP8 attention: SparseFwd's schedule with DenseFp8Fwd's operands (V transposed in shared memory, the
// descales folded in); the correction's pooled means are e4m3 in k's and v's raw units (the index stage's
// k_mean_kernel / v_mean_kernel), so the same descales apply to them.
template <class Config>
using SparseFp8Fwd = FwdKernel<Mainloop<Config, QPackGqaGather, KvTmaTransposeV, CsrBlocks, MeanCorrectionFp8>,
                               DirectStore, DynamicPersistentScheduler>;
template <class Config>
using SparseSplitKvFp8Fwd = FwdKernel<Mainloop<Config, QPackGqaGather, KvTmaTransposeV, CsrBlocks, MeanCorrectionFp8>,
                                      SplitKvPartials, PlannedScheduler>;
// FP8 has no variant without the correction: built (Fp8Descale over CsrBlocks), its consumers spilled 224/288 bytes
// against MeanCorrectionFp8's 40/32 with the correction off at run time (ptxas).

}  // namespace sparse_prefill::cuda
