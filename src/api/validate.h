// The API layer's argument checks (the checks the backends share too live in core/contract.h). Each throws
// ArgumentError naming the argument.
#pragma once

#include "core/contract.h"
#include "core/problem.h"
#include "sparse_prefill/sparse.h"

namespace sparse_prefill {

// Validates every argument of `in` (and `outs` when given) and resolves the problem. Throws ArgumentError naming
// the argument. Host-readable index tensors are checked element by element (monotone cu_seqlens matching the totals,
// lengths within max_seqlen, page ids in range, seqused_k within the pages given).
Problem validate_inputs(const AttentionInputs& in, const AttentionOutputs* outs);

// The element checks of validate_inputs on host copies of the index tensors (in's own for CPU inputs; checked mode
// passes copies of device arrays): fills p.seqs. cu_seqlens_k is null with paged KV, block_table / seqused_k without.
void validate_values(const AttentionInputs& in, const TensorView& cu_seqlens_q, const TensorView* cu_seqlens_k,
                     const TensorView* block_table, const TensorView* seqused_k, Problem& p);

// The head dims every backend is built for (64, 128); `name` is the argument that carries it (q, head_dim).
void check_head_dim(int64_t head_dim, const char* name);
// FP8 descales ([B, Hkv] float32, host memory): every value >= 0 (the kernels' running max assumes a non-negative
// logit scale, as softmax_scale > 0 does); NaN and inf propagate.
void check_descale_values(const TensorView& host_descale, const char* name);
// Head sub-groups (SelectionParams::head_subgroups, BlockIndex::num_subgroups): S >= 1 dividing the GQA group size
// g = Hq / Hkv. `name` is the argument reported ("head_subgroups" or "index.num_subgroups").
void check_head_subgroups(int subgroups, int group_size, const char* name);

// validate_index.cpp: the index and the mean cache.
// Checks an index view against a resolved (host-readable) problem: head sub-groups, segment count, ranges, ascending
// block ids within each sequence's block count, pooled-mean shapes (segments and means over Hkv * S virtual heads).
void validate_index(const Problem& p, const BlockIndexView& index);

// Checks a pooled-means cache against a resolved problem (paged KV, float32 [slots, Hkv, D] contiguous on q's
// device, page size and block size dividing one another).
void validate_mean_cache(const AttentionInputs& in, const Problem& p, int block_size, const MeanCache& cache);

}  // namespace sparse_prefill
