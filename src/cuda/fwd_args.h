// Plain-C++ description of one forward launch (no CUDA headers), filled by cuda_backend.cpp and consumed by the
// per-dtype translation units (fwd_<dtype>_hdim<D>.cu).
#pragma once

#include <cstdint>

#include "cuda/device_checks.h"

namespace sparse_prefill::cuda {

// A launch that runs or not by a device word written earlier on the stream: the kernel's CTAs return at once unless
// *word == run_if (word == nullptr: always runs). The dense rule's one-shot launches (cuda_backend.cpp) put the dense
// and the sparse kernel on one stream, each gated on the index's counters[kDense]: no host synchronisation.
struct LaunchGate {
  const unsigned long long* word = nullptr;
  unsigned long long run_if = 0;
};

struct FwdArgs {
  // q [total_q, Hq, D]; k, v contiguous [total_k, Hkv, D] or paged [num_pages, page_size, Hkv, D]; out like q.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;                  // [Hq, total_q] or null
  int64_t q_row_stride = 0, q_head_stride = 0;   // elements
  int64_t k_row_stride = 0, k_head_stride = 0;   // per KV row (paged: per token inside the page buffer)
  int64_t v_row_stride = 0, v_head_stride = 0;
  int64_t o_row_stride = 0, o_head_stride = 0;
  int64_t lse_head_stride = 0, lse_row_stride = 0;
  const int* cu_seqlens_q = nullptr;     // [B+1]
  const int* cu_seqlens_k = nullptr;     // [B+1] (contiguous KV)
  const int* block_table = nullptr;      // [B, max_pages] (paged KV)
  const int* seqused_k = nullptr;        // [B] (paged KV)
  int64_t block_table_stride = 0;
  int batch = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  int total_q = 0, total_k_rows = 0;     // total_k_rows: rows of the K row space (paged: num_pages * page_size)
  int max_seqlen_q = 0;
  int page_size = 0;                     // 0 = contiguous KV
  int num_pages = 0;                     // paged KV: pages of the cache
  SeqLimits limits;                      // what a sequence's span may be (device_checks.h): kernel, plan, combine
  float softmax_scale = 0.f;
  // FP8 inputs: float32 descales [B, Hkv] (null = 1) and their (batch, KV head) strides in elements (0 broadcasts).
  const float* q_descale = nullptr;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  int64_t q_descale_stride[2] = {0, 0}, k_descale_stride[2] = {0, 0}, v_descale_stride[2] = {0, 0};
  bool causal = true;
  int window_left = -1, window_right = -1;
  void* stream = nullptr;                // cudaStream_t
  LaunchGate gate;
};

// Per-launch device state of the sparse kernel, carved from caller memory (sparse_launch_workspace_bytes):
//   counters [kCounters]: the persistent scheduler's tile counter and the split-KV plan (zeroed before each launch);
//   split_tiles [max_split_tiles]: {tile, nsplit, 0, 0} of every tile run as nsplit > 1 units, sorted by nsplit
//     (descending) then tile;
//   slot_tile [max_split_units]: unit u (= its partial slot) -> entry | split << 16. Units are ordered split-major
//     (split 0 of every split tile, then split 1, ...): split s of entry e is unit counters[kSplitBase + s] + e, so
//     the tiles that read the same key range at the same time (the g-head tiles of one KV head) share it in L2;
//   o_partial [max_split_units, 128, D] / lse_partial [max_split_units, 128]: float32 partials, one slot per unit.
// Split plan (SplitRule, attention/block_schedule.h): fewer than SMs split tiles and twice as many split units, always.
struct SparseLaunchWorkspace {
  enum : int {
    kTileCounter = 0, kSplitTiles = 1, kSplitUnits = 2, kCap = 3, kTotalLo = 4, kTotalHi = 5, kSplitBase = 8,
    kCounters = 8 + 32
  };
  int* counters = nullptr;
  int32_t* split_tiles = nullptr;       // [max_split_tiles][4]
  int32_t* slot_tile = nullptr;
  float* o_partial = nullptr;
  float* lse_partial = nullptr;
  int num_sms = 0;
  int max_split_tiles = 0, max_split_units = 0;  // 0: carved without the split arrays (counters only)
  bool plan = true;                      // set per launch by run_sparse (split_planned and room for it)
};

// The CSR index a block-sparse launch walks (device pointers; docs/semantics.md). Segment of (b, kvh, tile):
// H * cu_tiles[b] + kvh * (cu_tiles[b+1] - cu_tiles[b]) + tile, H = Hkv * head_subgroups (virtual KV heads).
struct SparseFwdArgs {
  const int32_t* segment_start = nullptr;
  const int32_t* segment_end = nullptr;
  const int32_t* block_ids = nullptr;
  const int32_t* cu_tiles = nullptr;     // [B+1]
  const int32_t* cu_blocks = nullptr;    // [B+1]
  // Extents of segment_start / segment_end and of block_ids: the kernel and the split plan never read a segment or
  // an id beyond them, whatever cu_tiles and the segments hold (device_checks.h).
  int num_segments = 0, num_block_ids = 0;
  // [mean_rows, Hkv, D] in q's dtype; FP8: e4m3 in k's / v's raw units (correction only)
  const void* k_mean = nullptr;
  const void* v_mean = nullptr;
  int64_t mean_rows = 0;
  int block_size = 128;                  // a multiple of 128 (one listed block = block_size / 128 kernel steps)
  bool correction = true;
  // Head sub-groups (SelectionParams::head_subgroups): the index's tiles and segments are over Hkv * S virtual KV
  // heads of g / S query heads each; virtual head v reads K/V (and the pooled means, [mean_rows, Hkv, D]) of head v / S.
  int head_subgroups = 1;
  // Dense attention over PackGQA tiles with the split-KV plan (cuda_backend.cpp, dense_uses_full_list): no index
  // arrays; each tile visits every key block its last row sees (SparseBlockIterator::full_list_blocks), causal or
  // not (FwdArgs::causal), no correction, block_size 128.
  bool full_list = false;
  // A device index (sparse_args_of): a segment whose start is kOverflowStart runs its full list (device_checks.h).
  bool overflow_marks = false;
  // The work order's band (sparse_tile_coord, block_schedule.h), set by run_sparse from LaunchOptions::sparse_order:
  // 1 (KV heads fastest) or the persistent grid (banded). The kernel and the split plan read this one value.
  int order_band = 1;
  // Scheduler counter and split-KV plan (split_kv.cu); launch.counters == nullptr: one CTA per tile, no split.
  SparseLaunchWorkspace launch;
};

// The kernel runs correction steps only with means to load; the split plan counts steps the same way.
inline bool sparse_correction_on(const SparseFwdArgs& s) {
  return s.correction && s.k_mean != nullptr && s.mean_rows > 0;
}

// with_split = false: the counters only (launches that are never planned: split_planned() is false).
size_t sparse_launch_workspace_bytes(int num_sms, int head_dim, bool with_split);
SparseLaunchWorkspace carve_sparse_launch_workspace(void* base, int num_sms, int head_dim, bool with_split);

// Whether a sparse launch with these bounds runs the split-KV plan: chunk shapes (max_seqlen_k > max_seqlen_q) unless
// LaunchOptions::split_kv is off. Sizes the launch workspace and gates the plan. Only chunk shapes are planned: there
// a few tiles (the final chunk's dense last_n tiles) can each outweigh an SM's share of the work. In one-shot prefill
// (Lq = Lk) the heaviest tile is far below that share (128K: 1032 steps against ~3500 per SM) and the heaviest-first
// order balances the SMs; the plan and combine launches would only add ~20 us (8K: 0.548 -> 0.567 ms,
// docs/design/sparse_kernel.md).
inline bool split_planned(bool split_kv, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  return split_kv && max_seqlen_k > max_seqlen_q;
}

// Multiprocessor count of the current device (host attribute query, no synchronisation), cached per device
// (cuda_backend.cpp).
int num_sms();

// Split-KV around a sparse launch (split_kv.cu): zero the counters and build the plan before it, combine the
// partials into out / lse after it. All stream-ordered, no host synchronisation.
void run_split_plan(const FwdArgs& args, const SparseFwdArgs& sparse);
void run_split_combine(const FwdArgs& args, const SparseFwdArgs& sparse, bool bf16);

// One entry point per translation unit (dtype x head dim); sparse == nullptr runs the dense kernel.
void run_fwd_bf16_hdim128(const FwdArgs& args, const SparseFwdArgs* sparse = nullptr);
void run_fwd_fp16_hdim128(const FwdArgs& args, const SparseFwdArgs* sparse = nullptr);
void run_fwd_bf16_hdim64(const FwdArgs& args, const SparseFwdArgs* sparse = nullptr);  // dense only
void run_fwd_fp16_hdim64(const FwdArgs& args, const SparseFwdArgs* sparse = nullptr);  // dense only
// FP8 (float8_e4m3fn q, k, v; bfloat16 out): contiguous or paged KV with page_size % 64 == 0.
void run_fwd_e4m3_hdim128(const FwdArgs& args, const SparseFwdArgs* sparse = nullptr);

}  // namespace sparse_prefill::cuda
