// The CUDA backend (sm_90a): entry point called by the API layer for CUDA tensors.
#pragma once

#include "api/problem.h"
#include "sparse_prefill/attention.h"
#include "sparse_prefill/sparse.h"

namespace sparse_prefill::cuda {

// Dense forward attention. Launches on in.stream; never synchronises, never allocates (CUDA-graph capturable).
// Arguments are validated by the API layer; dims come from `p` (p.seqs is not filled for device index tensors).
// Throws NotImplementedError for combinations not built yet (fp32 / fp8 inputs, head dim other than 128, paged KV
// whose page_size is not a multiple of 128, misaligned strides).
// As with flash_attn_varlen_func, in.max_seqlen_q must bound every sequence's query length: it sizes the grid (the
// device-side cu_seqlens are never read on the host).
void attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p);

struct DeviceIndex;

// Block-sparse attention over an index built on the GPU (cuda::build_index, src/cuda/index_stage.h): the engine
// path, no allocation, no synchronisation. Causal attention without a window; index.block_size % 128 == 0.
void sparse_attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p,
                      const DeviceIndex& index);

// Block-sparse attention over a caller's index whose arrays are on the GPU (the public API's path): takes a small
// stream-ordered temporary (tiles per sequence, q-dtype copies of the pooled means); no host synchronisation.
void sparse_attention(const AttentionInputs& in, const BlockIndexView& index, const AttentionOutputs& outs,
                      const Problem& p);

// Index stage + sparse attention in one call, with a stream-ordered workspace (no host synchronisation).
// cache: the pooled-means cache (validated by the API layer), or null.
void sparse_prefill(const AttentionInputs& in, const SelectionParams& params, const AttentionOutputs& outs,
                    const Problem& p, const MeanCache* cache = nullptr);

}  // namespace sparse_prefill::cuda
