// The resolved shape of one call, produced once by validation (src/api/validate.cpp) and shared by every backend.
#pragma once

#include <vector>

#include "sparse_prefill/attention.h"

namespace sparse_prefill {

struct SequenceInfo {
  int64_t q_start = 0;  // first row of q
  int64_t q_len = 0;    // Lq
  int64_t k_start = 0;  // first row of k (contiguous KV only)
  int64_t k_len = 0;    // Lk
};

struct Problem {
  int batch = 0;            // B
  int num_q_heads = 0;      // Hq
  int num_kv_heads = 0;     // Hkv
  int head_dim = 0;         // D
  int group_size = 1;       // g = Hq / Hkv
  int64_t total_q = 0;
  int64_t total_k = 0;      // contiguous: rows of k; paged: num_pages * page_size
  bool paged = false;
  int64_t page_size = 0;
  int64_t num_pages = 0;
  int64_t max_pages = 0;    // block_table columns
  float softmax_scale = 0;  // resolved (default 1/sqrt(D))
  DType dtype = DType::kFloat32;      // of q, k, v
  DType out_dtype = DType::kFloat32;  // of out: q's dtype, bfloat16 for float8_e4m3fn inputs
  Device device = Device::kCPU;
  // Per-sequence offsets and lengths, read from cu_seqlens / seqused_k. Filled only when the index tensors live on
  // the host (the CUDA path never synchronises to read them).
  std::vector<SequenceInfo> seqs;
};

}  // namespace sparse_prefill
