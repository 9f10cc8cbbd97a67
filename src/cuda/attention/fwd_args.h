// Plain-C++ description of one forward launch (no CUDA headers), filled by cuda_backend.cpp and consumed by the
// per-dtype translation units (fwd_<dtype>_hdim<D>.cu).
#pragma once

#include <cstdint>

#include "cuda/common/device_checks.h"
#include "cuda/common/launch_inputs.h"
#include "cuda/split_kv/split_kv.h"

namespace sparse_prefill::cuda {

// A launch that runs or not by a device word written earlier on the stream: the kernel's CTAs return at once unless
// *word == run_if (word == nullptr: always runs). The dense rule's one-shot launches (cuda_backend.cpp) put the dense
// and the sparse kernel on one stream, each gated on the index's counters[kDense]: no host synchronisation.
struct LaunchGate {
  const unsigned long long* word = nullptr;
  unsigned long long run_if = 0;
};

// One attention launch: the call's packed inputs as given (LaunchInputs: q, k, v and their strides, the sequence
// arrays, the page table, the descales, the limits, the stream; launch_inputs.h, shared with the index stage), the
// outputs and the shape. The kernels address K / V per token whatever the layout: k_row_stride() and k_head_stride()
// (contiguous [total_k, Hkv, D]: row, head; paged [num_pages, page_size, Hkv, D]: slot, head, pages being dense along
// page_size) over total_k_rows token rows.
struct FwdArgs {
  LaunchInputs in;
  void* out = nullptr;                   // like q: [total_q, Hq, D]
  float* lse = nullptr;                  // [Hq, total_q] or null
  int64_t o_row_stride = 0, o_head_stride = 0;
  int64_t lse_head_stride = 0, lse_row_stride = 0;
  int batch = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  int total_q = 0, total_k_rows = 0;     // total_k_rows: rows of the K row space (paged: num_pages * page_size)
  int max_seqlen_q = 0;
  float softmax_scale = 0.f;
  bool causal = true;
  int window_left = -1, window_right = -1;
  LaunchGate gate;

  int64_t k_row_stride() const { return in.k_stride[in.paged ? 1 : 0]; }
  int64_t k_head_stride() const { return in.k_stride[in.paged ? 2 : 1]; }
  int64_t v_row_stride() const { return in.v_stride[in.paged ? 1 : 0]; }
  int64_t v_head_stride() const { return in.v_stride[in.paged ? 2 : 1]; }
  int page_size() const { return int(in.page_size); }  // 0 = contiguous KV
};

// The CSR index a block-sparse launch walks (device pointers; docs/semantics.md). Segment of (b, kvh, tile):
// H * cu_tiles[b] + kvh * (cu_tiles[b+1] - cu_tiles[b]) + tile, H = Hkv * num_subgroups (virtual KV heads).
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
  int num_subgroups = 1;
  // Dense attention over PackGQA tiles with the split-KV plan (cuda_backend.cpp, dense_uses_full_list): no index
  // arrays; each tile visits every key block its last row sees (SparseBlockIterator::full_list_blocks), causal or
  // not (FwdArgs::causal), no correction, block_size 128.
  bool full_list = false;
  // A device index (sparse_args_of): a segment whose start is kOverflowStart runs its full list (device_checks.h).
  bool overflow_marks = false;
  // The work order's band (sparse_tile_coord, block_schedule.h): 1, KV heads fastest. Bands of the persistent grid's
  // size kept the tiles in flight on one or two heads' K / V in L2 (random blocks at 64K: 0.86-0.91 of the time; the
  // topic selection at 8K 1.14, docs/design/sparse_kernel.md, "Work order"); no rule picks between them yet, so the
  // kernel and the split plan read this one value, fixed here.
  int order_band = 1;
  // Scheduler counter and split-KV plan (split_kv/plan_combine.cu); launch.counters == nullptr: one CTA per tile, no
  // split.
  SparseLaunchWorkspace launch;
};

// The kernel runs correction steps only with means to load; the split plan counts steps the same way.
inline bool sparse_correction_on(const SparseFwdArgs& s) {
  return s.correction && s.k_mean != nullptr && s.mean_rows > 0;
}

// Multiprocessor count of the current device (host attribute query, no synchronisation), cached per device
// (cuda_backend.cpp).
int num_sms();

// One entry point per translation unit (dtype x head dim); sparse == nullptr runs the dense kernel.
void run_fwd_bf16_hdim128(const FwdArgs& args, const SparseFwdArgs* sparse = nullptr);
void run_fwd_fp16_hdim128(const FwdArgs& args, const SparseFwdArgs* sparse = nullptr);
void run_fwd_bf16_hdim64(const FwdArgs& args, const SparseFwdArgs* sparse = nullptr);  // dense only
void run_fwd_fp16_hdim64(const FwdArgs& args, const SparseFwdArgs* sparse = nullptr);  // dense only
// FP8 (float8_e4m3fn q, k, v; bfloat16 out): contiguous or paged KV with page_size % 64 == 0.
void run_fwd_e4m3_hdim128(const FwdArgs& args, const SparseFwdArgs* sparse = nullptr);

}  // namespace sparse_prefill::cuda
