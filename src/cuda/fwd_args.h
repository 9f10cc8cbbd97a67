// Plain-C++ description of one forward launch (no CUDA headers), filled by cuda_backend.cpp and consumed by the
// per-dtype translation units (fwd_<dtype>_hdim<D>.cu).
#pragma once

#include <cstdint>

namespace sparse_prefill::cuda {

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
  float softmax_scale = 0.f;
  bool causal = true;
  int window_left = -1, window_right = -1;
  void* stream = nullptr;                // cudaStream_t
};

// The CSR index a block-sparse launch walks (device pointers; docs/semantics.md). Segment of (b, kvh, tile):
// Hkv * cu_tiles[b] + kvh * (cu_tiles[b+1] - cu_tiles[b]) + tile.
struct SparseFwdArgs {
  const int32_t* segment_start = nullptr;
  const int32_t* segment_end = nullptr;
  const int32_t* block_ids = nullptr;
  const int32_t* cu_tiles = nullptr;     // [B+1]
  const int32_t* cu_blocks = nullptr;    // [B+1]
  const void* k_mean = nullptr;          // [mean_rows, Hkv, D] in q's dtype (correction only)
  const void* v_mean = nullptr;
  int64_t mean_rows = 0;
  int* tile_counter = nullptr;           // one int of device memory for the persistent kernel's tile scheduler
                                         // (zeroed on the stream before each launch); null: one CTA per tile
  int block_size = 128;                  // a multiple of 128 (one listed block = block_size / 128 kernel steps)
  bool correction = true;
  // Split-KV: each tile's steps in num_splits contiguous parts, float32 partials combined by run_split_combine.
  int num_splits = 1;
  float* o_partial = nullptr;            // [num_splits, total_q, Hq, D]
  float* lse_partial = nullptr;          // [num_splits, Hq, total_q]
};

// Multiprocessor count of the current device (host attribute query, no synchronisation), cached per device
// (cuda_backend.cpp).
int num_sms();

// out (and lse) from the split partials of a sparse launch (split_combine.cu).
void run_split_combine(const FwdArgs& args, const SparseFwdArgs& sparse, bool bf16);

// One entry point per translation unit (dtype x head dim); sparse == nullptr runs the dense kernel.
void run_fwd_bf16_hdim128(const FwdArgs& args, const SparseFwdArgs* sparse = nullptr);
void run_fwd_fp16_hdim128(const FwdArgs& args, const SparseFwdArgs* sparse = nullptr);

}  // namespace sparse_prefill::cuda
