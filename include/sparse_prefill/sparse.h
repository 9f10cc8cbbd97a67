// Block-sparse prefill (FlashPrefill V2) and the chunked-prefill block union (CompactAttention).
//
// Semantics (docs/semantics.md): key blocks of `block_size` tokens per KV head; PackGQA query tiles of 128 packed rows
// (row r <-> position r / g, head kvh*g + r % g); a tile keeps block J iff its pooled energy
// E_IJ = sum_r exp(s_rJ - M_I) >= alpha * max_J E_IJ (SelectionRule::kTileEnergy; kRowMax thresholds per row),
// plus sink / window / last_n blocks; kept blocks are listed per
// segment (sequence, KV head, tile) in a CSR index; mean correction adds, for every block fully visible to the whole
// tile and not kept, one virtual key (k_mean_J, v_mean_J) with weight |B_J|.
#pragma once

#include <utility>
#include <vector>

#include "sparse_prefill/attention.h"

namespace sparse_prefill {

constexpr int kTileRows = 128;  // packed query rows per selection tile

// The threshold rule of a tile (docs/semantics.md, "Selection rules"). Both score s_rJ = scale * q_r . k_mean_J over
// the blocks J each packed row r sees; alpha = 0 keeps every visible block under either rule.
enum class SelectionRule : int {
  // FlashPrefill V2: keep J iff E_J = sum_r exp(s_rJ - M) >= alpha * max_J E_J, M the tile-wide maximum score.
  kTileEnergy = 0,
  // Per row: m_r = max_J s_rJ over the blocks row r sees; keep J iff max_r (s_rJ - m_r) >= ln(alpha) over the
  // tile's rows that see J, i.e. J is within a factor alpha of the top block of at least one row.
  kRowMax = 1,
  // Exact scores on probe rows (CUDA: probe_kernel in src/cuda/index/probe.cu, tensor cores with fp32 accumulation):
  // the probe rows are the packed rows of every kProbeStride-th query of the sequence (queries kProbeStride - 1,
  // 2 kProbeStride - 1, ...) and of its last query, all their heads. Each probe row r scores block J by its true
  // softmax log-mass w_rJ = log sum_{j in J} exp(scale q_r . k_j) over the keys it sees; keep J iff some probe row of
  // the tile has w_rJ - max_J' w_rJ' >= ln(alpha), or J passes the kRowMax test at SelectionParams::mean_alpha (the
  // pooled means cover the rows between probes). On SmolLM2-135M (torch emulation, docs/design/selection.md) this
  // meets copy/kv/NLL at 8K at density 0.47-0.53, where pooled means alone need 0.60 and lose 2 points.
  kProbeRowMax = 2,
  // kProbeRowMax with the probe rows' test against the row's whole mass: J passes for probe row r iff
  // w_rJ - log sum_J' exp(w_rJ') >= ln(alpha), i.e. J holds at least alpha of the row's softmax probability. A
  // diffuse row (filler text) then keeps none of its many equal blocks, where kProbeRowMax keeps all of them
  // within a factor alpha of the top one: on the retrieval model (docs/design/selection.md) kProbeRowMax at alpha 0.1
  // kept 76 % of the blocks at 32K, this rule at alpha 0.05 39 %. CUDA: the same probe pass as kProbeRowMax.
  kProbeRowMass = 3,
  // Per-key block maxima on a low-rank residual (issue 44; the exact definition, shared by the CPU reference, the
  // emulator and the CUDA kernels: docs/design/key_max_spec.md). Row r scores block J by
  // sh_rJ = q_r . k_mean_J + max over the keys j of J it sees of (P^T q_r) . (P^T (k_j - k_mean_J)), P the top
  // SelectionParams::key_rank directions of the key residuals of one (sequence, KV head) (src/core/key_basis.h);
  // one pass from the diagonal down keeps J iff scale (sh_rJ - m_rJ) >= ln(alpha), m_rJ the larger of the row's
  // pooled-means bound and the running maximum. Why: a block of alike keys scores as its mean, one spike key as
  // itself, where the pooled mean dilutes it 128x (exact block maxima sit on the oracle's curve,
  // docs/design/selection.md).
  kKeyMax = 4,
  // Two stages (issue 44; the definition: docs/design/exact_max_spec.md): the blocks kRowMax keeps at
  // SelectionParams::candidate_alpha over the pooled means (plus the always-kept ones) are the candidates; row r
  // scores candidate J by its exact maximum e_rJ = max over the keys j of J it sees of q_r . k_j, and one pass over the
  // candidates from the diagonal down keeps J iff scale (e_rJ - m_rJ) >= ln(alpha), m_rJ the larger of kKeyMax's
  // bound (the pooled means over whole blocks, the sink keys exactly) and the running maximum. Why: exact block maxima
  // sit on the oracle's curve (SmolLM2 at 8K, emulated: alpha 0.03-0.05 within a point at 1.0x the oracle's density,
  // docs/design/selection.md), and the candidates bound their cost by the pooled stage's density. On CUDA arrays:
  // src/cuda/index/exact_max.cu.
  kExactMax = 5,
};
// The dense rule (SelectionParams::dense_fraction), after any selection: whether a call whose selection keeps
// kept_blocks of its visible_blocks (summed over sequences, KV heads and tiles, what BlockIndex::density() divides)
// keeps them all. dense_fraction 1 turns the rule off. One double multiply and compare, the same on the host and on
// the device.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline bool keeps_all(int64_t kept_blocks, int64_t visible_blocks, float dense_fraction) {
  return dense_fraction < 1.f && visible_blocks > 0 &&
         double(kept_blocks) >= double(dense_fraction) * double(visible_blocks);
}
constexpr int kProbeStride = 8;          // 1/8 of the rows' Q K^T: ~1/16 of dense attention (stride 16 lost kv)
// The rules with probe rows (their probe pass and bitmap, and the pooled-means term at SelectionParams::mean_alpha).
constexpr bool is_probe_rule(SelectionRule rule) {
  return rule == SelectionRule::kProbeRowMax || rule == SelectionRule::kProbeRowMass;
}
// The rules whose keys are scored one by one (a per-key scorer: key_max.cu, exact_max.cu; their keep bits in the
// probe bitmap).
constexpr bool is_per_key_rule(SelectionRule rule) {
  return rule == SelectionRule::kKeyMax || rule == SelectionRule::kExactMax;
}

struct SelectionParams {
  // The threshold of `rule`; alpha = 0 keeps every visible block (dense). 0.003 with one selection per query head:
  // the pooled-means row max that kept SmolLM2-135M within 1 point of dense on every key-value layout and format
  // at 4K and 8K (worst -0.4 points; 0.03 lost 5.2, 0.1 per KV group 14, docs/design/selection.md), at the price
  // of density (0.89 at 8K there, where the dense rule then runs most calls dense).
  float alpha = 0.003f;
  // kProbeRowMax / kProbeRowMass only: the threshold of their pooled-means row-max term, which covers the rows
  // between probes (in [0, 1]; 0 keeps every visible block). 0.5: SmolLM2 4K NLL +0.97 % without the term, +0.23 %
  // with it.
  float mean_alpha = 0.5f;
  // kKeyMax only: the rank r of its residual basis, 16 or 32 (and <= the head dim): the score GEMM at rank 16 costs
  // 1/8 of Q K^T; 16 dimensions missed almost as little mass as exact maxima (0.032 vs 0.028, docs/design/selection.md;
  // docs/design/key_max_spec.md).
  int key_rank = 16;
  // kExactMax only: the kRowMax threshold over the pooled means that proposes its candidates (in [0, 1]; 0: every
  // visible block). 0.003: the default rule's alpha, whose selection keeps SmolLM2 within a point by itself.
  float candidate_alpha = 0.003f;
  // How a tile's scores are thresholded (SelectionRule above). The per-row rule is the default: on a real pretrained
  // LM (SmolLM2-135M, docs/design/selection.md) tile energy loses 47 points of copy top-1 at 8K, row max 2.
  SelectionRule rule = SelectionRule::kRowMax;
  int block_size = 128;   // tokens per key block; a positive multiple of 64
  int sink = 256;         // the blocks holding the first `sink` tokens are always kept
  int window = 512;       // the blocks meeting the `window` tokens before each query are always kept
  int last_n = 2;         // the last `last_n` query tiles of each sequence keep every visible block
  // Add the mean correction for the dropped, fully visible blocks. Off by default: it halves the error on the
  // structured workload but changed nothing measurable on SmolLM2 (< 0.1 point, Jensen: the mean logit underestimates
  // a peaked block's mass 5-20x) and costs +30 % (32K) to +66 % (128K) of the sparse attention time.
  bool correction = false;
  // Chunked prefill: whether the queries of this call end their prompts. The last_n rule (dense tail tiles) is for
  // the prompt's final queries only, so a chunk that does not end its prompt should not pay for it: false = last_n 0.
  bool final_chunk = true;
  // Union mode (CompactAttention): one list per (sequence, KV head), the union of its tiles' lists (what
  // union_index() computes), built in the same call. Suits chunks (few queries against a long cache).
  bool union_lists = false;
  // Sub-groups of a GQA group (CompactAttention's option for large groups): the g = Hq / Hkv query heads of each KV
  // head are split into head_subgroups groups of g / head_subgroups heads, each selected (and, with union_lists,
  // unioned) on its own. Must divide g. The index is then over Hkv * head_subgroups virtual KV heads (BlockIndex).
  // 0 (the default): one selection per query head, S = g. The heads of a KV group attend to different blocks, so one
  // selection for the group keeps the union of what each head needs. This field is the request and the library
  // never rewrites it; the S an index was built with (0 resolved to g) is IndexBinding::num_subgroups (and
  // BlockIndex / BlockIndexView::num_subgroups).
  int head_subgroups = 0;
  // The dense rule, after any selection: a call whose selection keeps at least this fraction of its visible blocks
  // keeps them all and runs as dense attention (exact; in (0, 1], 1 turns the rule off: the selection as selected). Near full
  // density the sparse kernel costs what dense attention costs or more (per-tile lists, a work order tuned for few
  // blocks), so keeping the last few percent out only costs time. The CUDA one-shot launch then runs the dense kernel.
  float dense_fraction = 0.85f;
  // CUDA device index: its budget of block-id slots (int32 each, in the workspace; docs/semantics.md "Device
  // index"). -1: the causal bound, what any selection can keep (each segment at most the blocks its tile's last row
  // sees). A smaller budget in [0, 2^31 - 1] makes the workspace follow the kept blocks instead: segments take
  // their ids from it in the order they finish; a segment that no longer fits runs its full list (every block its
  // tile sees: exact, at dense cost for that tile) and is counted (IndexStats::overflow_segments). In union mode
  // the per-tile lists and the unions share the budget. Not used by the CPU reference.
  int64_t max_kept_blocks = -1;
};
// The checks of a selection that need no inputs (each field's range); every entry point runs them, and a caller that
// builds its parameters once (the Python Selection) can run them then. Throws ArgumentError naming the field.
void check_selection_params(const SelectionParams& params);

// What an index was built for: the problem (mask, scale, head geometry, lengths' bounds, dtype, device), the
// selection parameters that shape its layout, and the addresses of the arrays it was built from. build_index fills
// it; sparse_attention rejects an index whose binding does not match its call with an ArgumentError naming the first
// argument that differs (an index built causal is never applied without the mask, an index of other data with the
// same shapes is not taken for this data). Pass reuse_index = true to apply a selection to other arrays of the same
// problem (e.g. another layer's K/V). A binding left unset (set == false, an index made by hand) is not checked.
struct IndexBinding {
  bool set = false;
  bool causal = true;
  int window_left = -1, window_right = -1;
  float softmax_scale = 0.f;       // resolved
  int block_size = 0, num_subgroups = 1;  // the index's S: SelectionParams::head_subgroups resolved (0 -> g)
  bool union_lists = false, split_kv = true;
  float dense_fraction = 1.f;  // SelectionParams::dense_fraction (union_index applies it to the union it lowers)
  // Built with the correction, hence with V means (BlockIndex::v_mean): a device index built without them cannot
  // be applied with the correction (its V means were never written).
  bool v_means = false;
  int batch = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t total_q = 0, total_k = 0, max_seqlen_q = 0, max_seqlen_k = 0;
  bool paged = false;
  int64_t page_size = 0;
  DType dtype = DType::kFloat32;
  Device device = Device::kCPU;
  int device_id = 0;
  const void *q = nullptr, *k = nullptr, *v = nullptr, *cu_seqlens_q = nullptr, *cu_seqlens_k = nullptr,
             *block_table = nullptr, *seqused_k = nullptr;
};

// Segment order: for sequence b with Lq_b queries, T_b = ceil(Lq_b * g / 128) tiles; segments of b start at
// segment_offset(b) = sum_{b' < b} Hkv * T_b' and are ordered (kvh, tile): id = segment_offset(b) + kvh * T_b + t.
// Segment s lists block_ids[segment_start[s] .. segment_end[s]) ascending (block ids are per sequence, 0-based).
// Several segments may share one list (union mode).
//
// Pooled means: k_mean, v_mean [total_blocks, Hkv, D] float32, where sequence b owns rows
// cu_blocks[b] .. cu_blocks[b+1] (ceil(Lk_b / block_size) blocks; a tail block averages its valid tokens).
// v_mean only with the correction (the only reader): an index built with correction = false has none (empty), so
// its build does not read V.
// Head sub-groups (S = num_subgroups: SelectionParams::head_subgroups resolved, 0 -> g): the index is over Hkv * S
// virtual KV heads.
// Virtual head v holds query heads [v g', (v + 1) g') (g' = g / S) and reads K/V head v / S; num_kv_heads,
// group_size, the segment order above and the pooled means' head axis are all in virtual heads (the means of v are
// those of K/V head v / S).
struct BlockIndex {
  IndexBinding binding;   // what it was built for
  int block_size = 128;
  int group_size = 1;     // query heads per (virtual) KV head: g / num_subgroups
  int num_kv_heads = 0;   // (virtual) KV heads: Hkv * num_subgroups
  int num_subgroups = 1;
  int head_dim = 0;
  bool correction = true;
  std::vector<int32_t> segment_start, segment_end, block_ids;
  std::vector<int32_t> cu_blocks;
  std::vector<float> k_mean, v_mean;
  int64_t kept_blocks = 0;     // sum over segments of listed blocks visible to the segment's tile
  int64_t visible_blocks = 0;  // sum over segments of blocks visible to the segment's tile
  int64_t overflow_segments = 0;  // copies of a device index: segments past its budget, listed in full (0 otherwise)
  double density() const { return visible_blocks ? double(kept_blocks) / double(visible_blocks) : 1.0; }
};

// A view of an index held by the caller (Python keeps its arrays as numpy arrays).
struct BlockIndexView {
  IndexBinding binding;                              // what the index was built for (unset: trusted)
  int block_size = 128;
  bool correction = true;
  int num_subgroups = 1;                             // see BlockIndex: segments and means over Hkv * S heads
  TensorView segment_start, segment_end, block_ids;  // int32 [S], [S], [N]
  TensorView cu_blocks;                              // int32 [B+1]
  TensorView k_mean, v_mean;                         // float32 [total_blocks, Hkv, D]
  // v_mean may be absent (a default TensorView) when correction is false; with correction it is required.
};
BlockIndexView view_of(BlockIndex& index);

// Pooled block means of K and V (contiguous or paged KV in `in`; q is only used for its shape checks).
void pool_kv(const AttentionInputs& in, int block_size, std::vector<int32_t>& cu_blocks, std::vector<float>& k_mean,
             std::vector<float>& v_mean);

// Selection on the host: pooling, scoring, thresholding, always-kept rules and CSR compaction. CPU inputs run the
// reference; CUDA inputs (bf16/fp16, causal, no attention window) run the GPU index stage in a temporary and copy
// the index back to the host (this inspection path allocates and synchronises; engines use the device index below).
BlockIndex build_index(const AttentionInputs& in, const SelectionParams& params);

// Sparse attention over an index: every listed block of a row's segment (token-level causal / window masks still
// apply), plus the mean correction when index.correction is set. CUDA inputs need the index arrays on the same GPU
// (contiguous); their contents (segment count, ascending ids in range) are trusted there, as cu_seqlens are.
// outs.workspace (CUDA, optional): sparse_attention_workspace_bytes(in, index) bytes.
void sparse_attention(const AttentionInputs& in, const BlockIndexView& index, const AttentionOutputs& outs,
                      bool reuse_index = false);
int64_t sparse_attention_workspace_bytes(const AttentionInputs& in, const BlockIndexView& index);

// The device index (CUDA, the engine path): build_index writes the CSR, the pooled means and the sparse launch's
// state into the caller's `workspace` (index_workspace_bytes(in, params) bytes, computed from shapes and parameters
// alone; 1-D, contiguous, 256-byte aligned, on q's device) on in.stream: no allocation, no host synchronisation,
// capturable in a CUDA graph. The index is valid while the workspace is not reused; sparse_attention reads it in
// place, and one index serves one sparse launch at a time (launches over it must be ordered on one stream).
// to_host copies it to the host for inspection (it synchronises in.stream of the build). mean_cache: as for
// sparse_prefill. CUDA: causal, no attention window, bfloat16/float16, head dim 64 or 128 (sparse attention: 128).
struct MeanCache;  // below
struct DeviceBlockIndex {
  TensorView workspace;
  SelectionParams params;
  IndexBinding binding;
};
int64_t index_workspace_bytes(const AttentionInputs& in, const SelectionParams& params);
DeviceBlockIndex build_index(const AttentionInputs& in, const SelectionParams& params, const TensorView& workspace,
                             const MeanCache* mean_cache = nullptr);
void sparse_attention(const AttentionInputs& in, const DeviceBlockIndex& index, const AttentionOutputs& outs,
                      bool reuse_index = false);
// kept and visible block counts (density = kept / visible); synchronises `stream`.
std::pair<int64_t, int64_t> index_counts(const DeviceBlockIndex& index, void* stream);
// The counts above and the segments that overflowed the block-id budget (SelectionParams::max_kept_blocks: they run
// their full list; kept counts their full lists); synchronises `stream`.
struct IndexStats {
  int64_t kept_blocks = 0, visible_blocks = 0, overflow_segments = 0;
};
IndexStats index_stats(const DeviceBlockIndex& index, void* stream);
BlockIndex to_host(const DeviceBlockIndex& index, void* stream);

// build_index + sparse_attention in one call. On CUDA the index lives in outs.workspace
// (sparse_prefill_workspace_bytes(in, params) bytes) or, without it, a stream-ordered temporary: no host
// synchronisation either way. CUDA: causal, no attention window, block_size % 128 == 0, bfloat16/float16, head dim 128.
void sparse_prefill(const AttentionInputs& in, const SelectionParams& params, const AttentionOutputs& outs);
int64_t sparse_prefill_workspace_bytes(const AttentionInputs& in, const SelectionParams& params);
// Whether sparse_prefill (and chunked prefill: paged inputs) runs on these inputs and this device: "" when it does,
// else why not, in the backend's own words (the NotImplementedError the call would raise: what its device's kernels
// are not built for, e.g. a head dim, a page size, a window). Bad arguments raise ArgumentError as the call does.
// Reads shapes, dtypes, strides and base addresses only (no device access); the output is taken as the call would
// allocate it (contiguous, aligned).
std::string sparse_prefill_support(const AttentionInputs& in, const SelectionParams& params);

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
// block_size: the block size the cache was made for, when known (0: not recorded). A call selecting with another
// block size is rejected (ArgumentError naming mean_cache): slot counts of two block sizes can coincide (page_size <=
// both), so the shape alone cannot tell. The Python mean_cache() records it.
struct MeanCache {
  TensorView k_mean, v_mean;
  int block_size = 0;
};
int64_t mean_cache_slots(int64_t num_pages, int64_t page_size, int block_size);

// sparse_prefill with a pooled-means cache (paged KV only).
void sparse_prefill(const AttentionInputs& in, const SelectionParams& params, const AttentionOutputs& outs,
                    const MeanCache& cache);

// Chunked-prefill lowering: one ascending list per (sequence, KV head) holding the union of the lists of all tiles
// of that sequence and KV head; every such segment points to the shared list.
BlockIndex union_index(const AttentionInputs& in, const BlockIndex& index);

}  // namespace sparse_prefill
