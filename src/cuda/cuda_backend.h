// The CUDA backend (sm_90a): what the API layer calls for CUDA tensors. Plain C++ (no CUDA headers): a build
// without the CUDA backend links src/no_cuda/ instead, whose every entry point says so.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/problem.h"
#include "cuda/common/problem_traits.h"
#include "sparse_prefill/attention.h"
#include "sparse_prefill/sparse.h"

namespace sparse_prefill::cuda {

// --- What the backend supports (support.cpp) ---------------------------------------------------------------------
// Declared once; the API layer asks before it dispatches a CUDA call and the entry points below assume it. Each
// throws NotImplementedError naming what is not built.
// Every attention kernel: bfloat16 / float16 / float8_e4m3fn (FP8: head dim 128, TMA pages), rows below 2^31,
// 16-byte aligned q / out / k / v, pages dense along page_size.
void check_attention_supported(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p);
// The block-sparse kernel: head dim 128, TMA pages (page_size % 64 == 0), causal without a window,
// block_size % 128 == 0.
void check_sparse_supported(const AttentionInputs& in, const Problem& p, int block_size);
// A caller's index view read by the sparse kernel: contiguous int32 arrays of fewer than 2^31 entries.
void check_index_view_supported(const BlockIndexView& index);
// The index stage: causal without a window, bfloat16 / float16 / float8_e4m3fn (FP8: head dim 128), 16-bit q with
// even strides and a 4-byte aligned base.
void check_index_supported(const AttentionInputs& in, const Problem& p, const SelectionParams& params);
// The FP8 kernels' own constraint, by dimensions alone (page_size 0: contiguous KV): "" when they take it, else why
// not (check_attention_supported's message for FP8 inputs). The engine adapters ask it when they set a layer up.
std::string fp8_attention_support(int head_dim, int64_t page_size);

// The facts these checks read (gathered_pages, is_fp8, q_cp_async_aligned): cuda/common/problem_traits.h.

// --- Entry points -------------------------------------------------------------------------------------------------
// Dense forward attention. Launches on in.stream; never synchronises (CUDA-graph capturable). Two paths:
//  - the dense kernel (one 128-row tile per query head), no allocation;
//  - short queries against long keys (dense_uses_full_list): the sparse kernel over PackGQA tiles (one tile holds
//    the g query heads of a KV head) with every visible key block listed implicitly, split-KV planned on the device
//    and combined after; its float32 partials live in outs.workspace when given, else in a stream-ordered
//    temporary (cudaMallocAsync, ~35 MB).
// Arguments are validated by the API layer, support by check_attention_supported; dims come from `p` (p.seqs is not
// filled for device index tensors). Paged KV of any page size: TMA boxes for page_size % 64 == 0, the cp.async gather
// producer otherwise (always on the dense kernel: the split path loads by TMA only).
// As with flash_attn_varlen_func, in.max_seqlen_q / max_seqlen_k must bound every sequence's query / key length:
// they size the grid and pick the path (the device-side cu_seqlens are never read on the host).
void attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p);

// Bytes of outs.workspace attention() may use on the current device (the split path's plan and float32 partials).
int64_t attention_workspace_bytes(int head_dim);

// Whether attention() takes the PackGQA + split-KV path (in.options.dense_path): head dim 128, no window, more keys
// than queries, TMA pages; by default only when max_seqlen_q < 128 (a dense tile would be mostly empty rows; a PackGQA
// tile holds g times more) or at most half as many dense tiles as SMs.
bool dense_uses_full_list(const AttentionInputs& in, const Problem& p);

// Block-sparse attention over a device index (build_index below): the engine path, no allocation, no
// synchronisation. Causal attention without a window; index.params.block_size % 128 == 0.
void sparse_attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p,
                      const DeviceBlockIndex& index);

// Block-sparse attention over a caller's index whose arrays are on the GPU: takes outs.workspace
// (sparse_attention_workspace_bytes) or a small stream-ordered temporary (tiles per sequence, q-dtype copies of the
// pooled means, launch state); no host synchronisation.
void sparse_attention(const AttentionInputs& in, const BlockIndexView& index, const AttentionOutputs& outs,
                      const Problem& p);
size_t sparse_attention_workspace_bytes(const AttentionInputs& in, const BlockIndexView& index, const Problem& p);

// Index stage + sparse attention in one call, in outs.workspace (index_workspace_bytes) or a stream-ordered
// temporary (no host synchronisation either way). cache: the pooled-means cache (validated by the API layer), or null.
void sparse_prefill(const AttentionInputs& in, const SelectionParams& params, const AttentionOutputs& outs,
                    const Problem& p, const MeanCache* cache = nullptr);

// The device index in a caller workspace (validated here: size, alignment), and its host views.
void build_index(const AttentionInputs& in, const Problem& p, const SelectionParams& params,
                 const TensorView& workspace, const MeanCache* cache);
// Workspace bytes of the index stage for one call with these shapes (shape-only bound: no host read of lengths).
size_t index_workspace_bytes(const AttentionInputs& in, const Problem& p, const SelectionParams& params);
// Behind sparse_prefill::build_index for CUDA inputs: the index stage in a temporary workspace, synchronised, the
// index returned compacted on the host (what the CPU reference returns, with the pooled means). It allocates and
// synchronises: engines use build_index() with their own workspace instead (index/host_copy.cpp).
BlockIndex build_index_to_host(const AttentionInputs& in, const Problem& p, const SelectionParams& params);
IndexStats index_stats(const DeviceBlockIndex& index, void* stream);
BlockIndex to_host(const DeviceBlockIndex& index, void* stream);

// The device error word (device_checks.h, device_errors.cu): synchronises `stream`, reads the first violation since
// the last call, clears it, and returns it as the ArgumentError check_errors() throws (nullopt: none).
std::optional<ArgumentError> take_device_error(void* stream);
ArgumentError device_error_message(int code, int seq, int index, int value, int bound);

// Checked mode (LaunchOptions::checked): copies a 1-D or 2-D device array of 4-byte elements (int32 indices, float32
// descales) to the host (synchronises `stream`) and returns a contiguous host view of it (t's dtype) in `storage`.
TensorView download_int32(const TensorView& t, void* stream, std::vector<int32_t>& storage);

}  // namespace sparse_prefill::cuda
