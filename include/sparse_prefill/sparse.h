// Block-sparse prefill (FlashPrefill V2) and the chunked-prefill block union (CompactAttention).
//
// Semantics (DESIGN.md): key blocks of `block_size` tokens per KV head; PackGQA query tiles of 128 packed rows
// (row r <-> position r / g, head kvh*g + r % g); a tile keeps block J iff its pooled energy
// E_IJ = sum_r exp(s_rJ - M_I) >= alpha * max_J E_IJ, plus sink / window / last_n blocks; kept blocks are listed per
// segment (sequence, KV head, tile) in a CSR index; mean correction adds, for every block fully visible to the whole
// tile and not kept, one virtual key (k_mean_J, v_mean_J) with weight |B_J|.
#pragma once

#include <vector>

#include "sparse_prefill/attention.h"

namespace sparse_prefill {

constexpr int kTileRows = 128;  // packed query rows per selection tile

struct SelectionParams {
  float alpha = 0.1f;     // keep J iff E_IJ >= alpha * max_J E_IJ; alpha = 0 keeps every visible block (dense)
  int block_size = 128;   // tokens per key block; a positive multiple of 64
  int sink = 256;         // the blocks holding the first `sink` tokens are always kept
  int window = 512;       // the blocks meeting the `window` tokens before each query are always kept
  int last_n = 2;         // the last `last_n` query tiles of each sequence keep every visible block
  bool correction = true; // add the mean correction for the dropped, fully visible blocks
  // Chunked prefill: whether the queries of this call end their prompts. The last_n rule (dense tail tiles) is for
  // the prompt's final queries only, so a chunk that does not end its prompt should not pay for it: false = last_n 0.
  bool final_chunk = true;
  // Union mode (CompactAttention): one list per (sequence, KV head), the union of its tiles' lists (what
  // union_index() computes), built in the same call. Suits chunks (few queries against a long cache).
  bool union_lists = false;
  // Sub-groups of a GQA group (CompactAttention's option for large groups): the g = Hq / Hkv query heads of each KV
  // head are split into head_subgroups groups of g / head_subgroups heads, each selected (and, with union_lists,
  // unioned) on its own. Must divide g. The index is then over Hkv * head_subgroups virtual KV heads (BlockIndex).
  int head_subgroups = 1;
};

// Segment order: for sequence b with Lq_b queries, T_b = ceil(Lq_b * g / 128) tiles; segments of b start at
// segment_offset(b) = sum_{b' < b} Hkv * T_b' and are ordered (kvh, tile): id = segment_offset(b) + kvh * T_b + t.
// Segment s lists block_ids[segment_start[s] .. segment_end[s]) ascending (block ids are per sequence, 0-based).
// Several segments may share one list (union mode).
//
// Pooled means: k_mean, v_mean [total_blocks, Hkv, D] float32, where sequence b owns rows
// cu_blocks[b] .. cu_blocks[b+1] (ceil(Lk_b / block_size) blocks; a tail block averages its valid tokens).
// Head sub-groups (SelectionParams::head_subgroups = S): the index is over Hkv * S virtual KV heads. Virtual head v
// holds query heads [v g', (v + 1) g') (g' = g / S) and reads K/V head v / S; num_kv_heads, group_size, the segment
// order above and the pooled means' head axis are all in virtual heads (the means of v are those of K/V head v / S).
struct BlockIndex {
  int block_size = 128;
  int group_size = 1;     // query heads per (virtual) KV head: g / head_subgroups
  int num_kv_heads = 0;   // (virtual) KV heads: Hkv * head_subgroups
  int head_subgroups = 1;
  int head_dim = 0;
  bool correction = true;
  std::vector<int32_t> segment_start, segment_end, block_ids;
  std::vector<int32_t> cu_blocks;
  std::vector<float> k_mean, v_mean;
  int64_t kept_blocks = 0;     // sum over segments of listed blocks visible to the segment's tile
  int64_t visible_blocks = 0;  // sum over segments of blocks visible to the segment's tile
  double density() const { return visible_blocks ? double(kept_blocks) / double(visible_blocks) : 1.0; }
};

// A view of an index held by the caller (Python keeps its arrays as numpy arrays).
struct BlockIndexView {
  int block_size = 128;
  bool correction = true;
  int head_subgroups = 1;                            // see BlockIndex: segments and means over Hkv * S heads
  TensorView segment_start, segment_end, block_ids;  // int32 [S], [S], [N]
  TensorView cu_blocks;                              // int32 [B+1]
  TensorView k_mean, v_mean;                         // float32 [total_blocks, Hkv, D]
};
BlockIndexView view_of(BlockIndex& index);

// Pooled block means of K and V (contiguous or paged KV in `in`; q is only used for its shape checks).
void pool_kv(const AttentionInputs& in, int block_size, std::vector<int32_t>& cu_blocks, std::vector<float>& k_mean,
             std::vector<float>& v_mean);

// Selection: pooling, scoring, thresholding, always-kept rules and CSR compaction. CPU inputs run the reference;
// CUDA inputs (bf16/fp16, causal, no attention window) run the GPU index stage and copy the index back to the host
// (this convenience path allocates and synchronises; the graph-capturable GPU entry point with a caller workspace
// is sparse_prefill::cuda::build_index in src/cuda/index_stage.h).
BlockIndex build_index(const AttentionInputs& in, const SelectionParams& params);

// Sparse attention over the index: every listed block of a row's segment (token-level causal / window masks still
// apply), plus the mean correction when index.correction is set. CUDA inputs need the index arrays on the same GPU
// (contiguous); their contents (segment count, ascending ids in range) are trusted there, as cu_seqlens are.
void sparse_attention(const AttentionInputs& in, const BlockIndexView& index, const AttentionOutputs& outs);

// build_index + sparse_attention in one call. On CUDA the index lives in a stream-ordered temporary workspace: no
// host synchronisation (engines that reuse an index across layers call sparse_prefill::cuda::build_index and
// sparse_prefill::cuda::sparse_attention with their own workspace). CUDA: causal, no attention window,
// block_size % 128 == 0, bfloat16/float16, head dim 128.
void sparse_prefill(const AttentionInputs& in, const SelectionParams& params, const AttentionOutputs& outs);

// Pooled-means cache beside a paged KV cache (chunked prefill): the means of complete key blocks, written once and
// reused by the prompt's later chunks, so a step's selection pools only the blocks its chunk completes and the
// sequence's tail block: O(chunk + L / block_size) instead of re-pooling the whole cache every step.
//   k_mean, v_mean: float32 [mean_cache_slots(num_pages, page_size, block_size), Hkv, D], contiguous, on q's device,
//   written in place. Needs page_size % block_size == 0 or block_size % page_size == 0.
//   Complete block J of sequence b (keys [J B, J B + B), B = block_size) lives in the slot of the page holding its
//   last key j = J B + B - 1: page * (page_size / B) + (j % page_size) / B when page_size >= B, else page. Keyed by the
//   last page, a slot is shared by two sequences exactly when they share the whole block (prefix-shared pages).
// Contract: a call reads the means of the blocks that end before its chunk (last key < seqused_k[b] - chunk length)
// from the cache, so every earlier chunk of the prompt must have gone through a call with the same cache (the first
// chunk finds nothing to read); it pools and writes the blocks its own chunk completes. The CPU backend recomputes
// every mean (the reference) and writes the cache the same way.
struct MeanCache {
  TensorView k_mean, v_mean;
};
int64_t mean_cache_slots(int64_t num_pages, int64_t page_size, int block_size);

// sparse_prefill with a pooled-means cache (paged KV only).
void sparse_prefill(const AttentionInputs& in, const SelectionParams& params, const AttentionOutputs& outs,
                    const MeanCache& cache);

// Chunked-prefill lowering: one ascending list per (sequence, KV head) holding the union of the lists of all tiles
// of that sequence and KV head; every such segment points to the shared list.
BlockIndex union_index(const AttentionInputs& in, const BlockIndex& index);

}  // namespace sparse_prefill
