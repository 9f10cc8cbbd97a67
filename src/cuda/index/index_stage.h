// GPU index stage of block-sparse prefill (FlashPrefill V2 selection), CUDA end to end, no host synchronisation:
//   1. plan:  per-sequence prefix sums of tiles, blocks and index capacity (from cu_seqlens / seqused_k on the device);
//   2. pool:  block means of K, and of V with the correction or a mean cache (float32 in real units, plus a
//             bf16/fp16 copy of the K means for the tensor-core scorer and the sparse kernel's copies: FP8 inputs,
//             docs/semantics.md "FP8 inputs");
//   3. score: one CTA per (tile, KV head): S = Q_tile . K_mean^T on tensor cores (SS wgmma, 128 pooled blocks per
//             step, Q and two stages of pooled keys in swizzled shared memory), running chunk maxima and block
//             energies kept in shared memory (no L x L/B score buffer), alpha * max threshold (or the per-row rule,
//             SelectionRule::kRowMax: a second pass over the chunks), sink / window / last_n
//             / diagonal rules, and the kept ids bump-allocated into the CSR;
//   4. the dense rule (dense_rule.cu): a selection that keeps nearly every visible block keeps them all.
// The CSR is bump-allocated: each CTA counts its segment's kept blocks, takes that many slots of `block_ids` with one
// atomicAdd on a global cursor and writes its ids there (ascending), so block_ids holds what is kept, in the order
// the CTAs finish, within a budget of `capacity` slots (SelectionParams::max_kept_blocks; default the causal bound).
// A segment that does not fit is marked overflowed (kOverflowStart): the sparse kernel runs its full list and the host
// copy expands it. No global compaction pass and no host read-back of sizes is needed. All buffers are carved from
// one caller-provided workspace, reusable across calls and layers (index_workspace_bytes gives its size from
// host-known bounds).
// Files, by role (src/cuda/index/): build.cu (build_index: checks, then the launches in order), plan.cu, pool.cu and
// mean_cache.cu (step 2), score_select.cu, probe.cu, key_basis.cu + key_max.cu and exact_max.cu (step 3, by rule), union.cu (union mode), dense_rule.cu (step 4),
// view.cu (a caller's index view), layout.{h,cpp} (bounds and workspace carving), host_copy.cpp (download to the
// host); device_args.cuh holds the device structs they share.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "core/problem.h"
#include "cuda/attention/fwd_args.h"
#include "cuda/common/launch_inputs.h"
#include "sparse_prefill/sparse.h"

namespace sparse_prefill::cuda {

// counters[]: kept blocks (overflowed segments count their full lists), visible blocks (density = kept / visible),
// union mode's per-tile kept count before the union, overflowed segments, and the block_ids bump cursor (slots
// taken, possibly past capacity: the segments that found no room).
// kDense: 1 when the dense rule (SelectionParams::dense_fraction) turned the selection into the full one (dense_rule.cu).
enum IndexCounter {
  kKept = 0, kVisible = 1, kUnionPerTile = 2, kOverflow = 3, kCursor = 4, kDense = 5, kNumCounters = 6
};

// Device pointers into the workspace; sizes are upper bounds known on the host.
struct DeviceIndex {
  int block_size = 128;
  bool correction = true;
  int num_subgroups = 1;         // S: tiles and segments over Hkv * S virtual KV heads; pooled means per KV head
  int64_t max_segments = 0;      // >= Hkv * S * sum_b T_b
  int64_t max_blocks = 0;        // >= sum_b nb_b (pooled rows)
  int64_t capacity = 0;          // block_ids slots (< 2^31: int32 offsets)
  size_t workspace_bytes = 0;    // of the whole layout (index_workspace_bytes)
  int32_t* segment_start = nullptr;  // [max_segments]; entries beyond the real count are unused
  int32_t* segment_end = nullptr;
  int32_t* block_ids = nullptr;      // [capacity], bump-allocated (counters[kCursor])
  int32_t* cu_blocks = nullptr;      // [B+1]
  int32_t* cu_tiles = nullptr;       // [B+1] tiles per sequence, prefix-summed (segment_offset(b) = Hkv * cu_tiles[b])
  float* k_mean = nullptr;           // [max_blocks, Hkv, D]
  float* v_mean = nullptr;           // the v arrays: written only with the correction or a mean cache (pool.cu)
  // Low-precision copies, [max_blocks, Hkv, D] contiguous, rows past the real blocks zero. lowp: the scorer's B
  // operand, in q's dtype (bfloat16 in real units for FP8). kernel: the sparse kernel's correction keys / values in
  // its operand type: the lowp arrays themselves for bf16 / fp16; for FP8 e4m3 in raw units of the call's descales,
  // e4m3(mean / descale[b, kvh]) (docs/semantics.md "FP8 inputs").
  void* k_mean_lowp = nullptr;
  void* v_mean_lowp = nullptr;
  void* k_mean_kernel = nullptr;
  void* v_mean_kernel = nullptr;
  uint32_t* probe_bits = nullptr;   // kProbeRowMax / kProbeRowMass: [max_segments, probe_words] blocks the probe
  int64_t probe_words = 0;          // rows keep (probe_kernel), OR-ed in by the scorer
  int probe_splits = 0;             // key splits of each probe CTA (probe_splits(), layout.h)
  float* probe_partials = nullptr;  // probe_splits > 1: [probe_splits][max_segments][128][2] row (reference, sum)
  // SelectionRule::kKeyMax (key_basis.cu, key_max.cu): the residuals' second moment in key_moment_splits() partial
  // sums [split][batch][Hkv][D][D] and the basis [batch][Hkv][D][r] (float32), the projected residuals K'
  // [Hkv][key_rows][r] (fp16; key row cu_blocks[b] * block_size + j) and each block's radius max_j |K'_j|
  // [Hkv][key_rows / block_size]; its keep bits go to probe_bits (as SelectionRule::kExactMax's, exact_max.cu).
  float* key_moment = nullptr;
  float* key_basis = nullptr;
  void* key_proj = nullptr;
  float* key_radius = nullptr;
  int64_t key_rows = 0;
  // SelectionRule::kExactMax (exact_max.cu): each key row's values rounded to e4m3 per unit of kExactUnitKeys keys,
  // [Hkv][key_rows / 64][64 x D] bytes, a unit in the swizzled order of the scorer's shared-memory slot (one bulk
  // copy brings it), and the units' scales amax / 448 [Hkv][key_rows / 64] (docs/design/exact_max_spec.md step 3).
  void* exact_keys = nullptr;
  float* exact_key_scales = nullptr;
  unsigned long long* counters = nullptr;  // [kNumCounters] (IndexCounter)
  // The sparse kernel's scheduler counter and, for chunk shapes (split_planned), the split-KV plan and partials
  // (SparseLaunchWorkspace, split_kv/split_kv.h; about 35 MB on 132 SMs): one workspace serves one launch at a time, so
  // launches that share it must be ordered on one stream.
  SparseLaunchWorkspace launch;
};

constexpr int kExactUnitKeys = 64;  // exact_max: keys per unit, its GEMM's N and the keys sharing an e4m3 scale

// key_basis.cu: the moment's sampled keys in this many slices per (sequence, KV head), each its own CTA and partial
// sum: about 256 CTAs in all, at most 16 slices (one CTA per (sequence, KV head) ran at 0.2 instructions per cycle,
// 3.9 ms on the H100 for 8 heads); the partials take splits * batch * Hkv * D^2 floats of the workspace.
constexpr int kMaxKeyMomentSplits = 16;  // the basis kernel keeps one load per slice in flight
inline int key_moment_splits(int batch, int num_kv_heads) {
  const int heads = std::max(1, batch * num_kv_heads);
  return std::max(1, std::min(kMaxKeyMomentSplits, 256 / heads));
}

// index_workspace_bytes and build_index_to_host, which the API layer calls, are declared in cuda/cuda_backend.h.

// Builds the index on in.stream (params.union_lists: union mode, params.final_chunk: last_n only when set). What it
// supports (check_index_supported, cuda_backend.h) was checked by the API layer: causal attention without an
// attention window, bf16/fp16 with D in {64, 128} or FP8 (e4m3, with the call's descales) with D = 128, contiguous or
// paged KV.
// mean_cache (paged KV, validated by the caller: validate_mean_cache): the blocks that end before each sequence's
// chunk are read from it, the blocks the chunk completes are pooled and written to it (MeanCache, sparse.h).
// li: the call's packed inputs (launch_inputs(in, p)), from which the stage's kernel arguments are derived.
DeviceIndex build_index(const AttentionInputs& in, const LaunchInputs& li, const Problem& p,
                        const SelectionParams& params, void* workspace, size_t workspace_bytes,
                        const MeanCache* mean_cache = nullptr);

// For sparse attention over a caller's index view (device arrays): writes cu_tiles [B+1] from cu_seqlens_q and the
// sparse kernel's copies of the float32 pooled means (view.k_mean.shape[0] rows, contiguous [rows, Hkv, D]: q's dtype,
// or e4m3 in raw units of li's descales for FP8) on li.stream (view.cu).
void prepare_index_view(const LaunchInputs& li, const Problem& p, const BlockIndexView& view, int32_t* cu_tiles,
                        void* k_kernel, void* v_kernel);

// The pointers of a device index in `workspace`: a function of its binding and parameters alone (the layout
// build_index wrote).
DeviceIndex carve_index(const IndexBinding& binding, const SelectionParams& params, void* workspace);
// Synchronises `stream`, then copies the index to the host, compacted (what the CPU reference returns).
BlockIndex download_index(const DeviceIndex& d, const IndexBinding& binding, const SelectionParams& params,
                          void* stream);
// Synchronises `stream`; kept, visible blocks and overflowed segments.
IndexStats download_counts(const DeviceIndex& d, void* stream);

}  // namespace sparse_prefill::cuda
