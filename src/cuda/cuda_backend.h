// The CUDA backend (sm_90a): entry point called by the API layer for CUDA tensors.
#pragma once

#include "api/problem.h"
#include "sparse_prefill/attention.h"

namespace sparse_prefill::cuda {

// Dense forward attention. Launches on in.stream; never synchronises, never allocates (CUDA-graph capturable).
// Arguments are validated by the API layer; dims come from `p` (p.seqs is not filled for device index tensors).
// Throws NotImplementedError for combinations not built yet (fp32 / fp8 inputs, head dim other than 128, paged KV
// whose page_size is not a multiple of 128, misaligned strides).
// As with flash_attn_varlen_func, in.max_seqlen_q must bound every sequence's query length: it sizes the grid (the
// device-side cu_seqlens are never read on the host).
void attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p);

}  // namespace sparse_prefill::cuda
