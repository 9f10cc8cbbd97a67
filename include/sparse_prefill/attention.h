// Dense attention: the contract of DESIGN.md ("The semantic contract").
#pragma once

#include "sparse_prefill/tensor.h"

namespace sparse_prefill {

// The keys and values one call attends to, contiguous or paged, and the queries. Shared by dense attention, index
// building and sparse attention.
//   q:  [total_q, Hq, D]                                   sequence b owns rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]
//   contiguous KV: k, v [total_k, Hkv, D] + cu_seqlens_k [B+1]
//   paged KV:      k, v [num_pages, page_size, Hkv, D] + block_table [B, max_pages] + seqused_k [B]
// Index tensors are int32. q, k, v share one dtype (float32, float16 or bfloat16) and one device; the last dimension
// of every tensor must be contiguous.
struct AttentionInputs {
  TensorView q, k, v;
  TensorView cu_seqlens_q;
  std::optional<TensorView> cu_seqlens_k;
  std::optional<TensorView> block_table;
  std::optional<TensorView> seqused_k;
  int64_t max_seqlen_q = 0;  // upper bound of the per-sequence query lengths (checked on the CPU backend)
  int64_t max_seqlen_k = 0;  // upper bound of the per-sequence key lengths
  bool causal = true;        // bottom-right aligned: query i sees key j iff j <= i + (Lk - Lq)
  std::optional<float> softmax_scale;  // default 1/sqrt(D)
  int window_left = -1;      // sliding window (-1 = unbounded), same alignment as causal
  int window_right = -1;
  void* stream = nullptr;    // cudaStream_t for the CUDA backend; ignored on the CPU

  bool paged() const { return block_table.has_value(); }
};

// Outputs: out [total_q, Hq, D] in q's dtype (written in place), lse [Hq, total_q] float32 (optional).
// workspace (optional, CUDA): scratch device memory for the path that runs short queries against long keys (decode,
// small chunks) on PackGQA tiles with split-KV; it holds the float32 partials and the split plan. Without it that path
// takes a stream-ordered temporary (cudaMallocAsync) per call; engines pass a buffer allocated once to keep the launch
// path free of allocations. A contiguous 1-D array of any dtype on q's device, at least attention_workspace_bytes()
// bytes, 256-byte aligned, not used by another stream while the call runs. Ignored by the CPU backend.
struct AttentionOutputs {
  TensorView out;
  std::optional<TensorView> lse;
  std::optional<TensorView> workspace;
};

// Bytes of `workspace` the CUDA backend may use for head dim `head_dim` on the current CUDA device (~35 MB at 128 on
// an H200); 0 in a build without CUDA.
int64_t attention_workspace_bytes(int head_dim);

// out = softmax(q k^T * scale + mask) v. Rows that see no key get zeros and lse = -inf.
void attention(const AttentionInputs& in, const AttentionOutputs& outs);

}  // namespace sparse_prefill
