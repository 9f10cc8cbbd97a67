// What the CUDA backend is built for, declared once (cuda_backend.h): the API layer asks before it dispatches a CUDA
// call; the entry points (cuda_backend.cpp, index/build.cu) assume it. Each check throws NotImplementedError naming
// what is not built.
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <string>

#include "core/geometry.h"
#include "cuda/cuda_backend.h"

namespace sparse_prefill::cuda {
namespace {

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// TMA and the 16-byte epilogue stores need 16-byte aligned bases and strides (8 elements of 16 bits, 16 of FP8).
void require_aligned(const TensorView& t, const char* name, int first_dim, int last_dim) {
  const int per16 = t.dtype == DType::kFloat8E4M3 ? 16 : 8;
  bool ok = aligned16(t.data);
  for (int i = first_dim; i <= last_dim; ++i) ok = ok && (t.stride[i] % per16 == 0);
  if (!ok)
    throw NotImplementedError(std::string("CUDA attention: ") + name +
                              " needs a 16-byte aligned base and strides that are multiples of " +
                              std::to_string(per16) + " elements");
}

void check_fp8_supported(const Problem& p) {
  const std::string why = fp8_attention_support(p.head_dim, p.paged ? p.page_size : 0);
  if (!why.empty()) throw NotImplementedError(why);
}

// CudaLimits (include/sparse_prefill/attention.h), read by the checks below and by their messages.
template <class T, size_t N>
bool listed(const T (&list)[N], T value) {
  return std::find(std::begin(list), std::end(list), value) != std::end(list);
}

std::string cuda_dtypes() {  // "bfloat16, float16 and float8_e4m3fn"
  constexpr size_t n = std::size(CudaLimits::kDTypes);
  std::string names;
  for (size_t i = 0; i < n; ++i)
    names += std::string(i == 0 ? "" : i + 1 == n ? " and " : ", ") + dtype_name(CudaLimits::kDTypes[i]);
  return names;
}

std::string sparse_head_dims() {
  std::string dims;
  for (const int d : CudaLimits::kSparseHeadDims) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
  return dims;
}

const std::string kPageRule = "page_size % " + std::to_string(CudaLimits::kPageMultiple) + " == 0";

void require_contiguous(const TensorView& t, const char* name) {
  if (t.ndim != 1 || (t.shape[0] > 1 && t.stride[0] != 1))
    throw NotImplementedError(std::string("CUDA sparse attention: ") + name + " must be contiguous");
}

}  // namespace

// What the FP8 kernels (DenseFp8Fwd, SparseFp8Fwd: attention/variants.h) are built for: CudaLimits' sparse head dims,
// contiguous KV or paged KV with page_size a multiple of CudaLimits::kPageMultiple (TMA loads).
std::string fp8_attention_support(int head_dim, int64_t page_size) {
  if (!listed(CudaLimits::kSparseHeadDims, head_dim))
    return "CUDA FP8 attention is built for head dim " + sparse_head_dims() + " only, got head dim " +
           std::to_string(head_dim) + " (FP8 runs on the CPU reference for any head dim)";
  if (page_size > 0 && page_size % CudaLimits::kPageMultiple != 0)  // gathered_pages
    return "CUDA FP8 attention: paged KV needs " + kPageRule + " (TMA loads; the cp.async gather of other page "
           "sizes is not built for FP8); got page_size " + std::to_string(page_size);
  return {};
}

void check_attention_supported(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p) {
  if (!listed(CudaLimits::kDTypes, p.dtype))
    throw NotImplementedError("q: CUDA attention supports " + cuda_dtypes() + " inputs only, got " +
                              dtype_name(p.dtype));
  if (is_fp8(p)) check_fp8_supported(p);
  // The head dim (64 or 128) and a mean cache's paged KV are checked once, by validate_inputs / validate_mean_cache.
  if (p.total_q > INT32_MAX || p.total_k > INT32_MAX)
    throw NotImplementedError("CUDA attention: more than 2^31 - 1 rows");
  require_aligned(in.q, "q", 0, 1);
  require_aligned(outs.out, "out", 0, 1);
  if (p.paged) {
    // TMA: one 128-row box per key block (page_size % 128 == 0) or two 64-row boxes, one per page
    // (page_size % 128 == 64); any other page size: the cp.async gather producer (DensePagedGatherFwd,
    // attention/variants.h).
    for (const TensorView* t : {&in.k, &in.v}) {
      if (t->stride[0] != p.page_size * t->stride[1])
        throw NotImplementedError("CUDA attention: paged k/v pages must be dense along page_size");
      if (gathered_pages(p) && t->stride[1] >= (int64_t(1) << 31))  // the gather's 32-bit row byte stride
        throw NotImplementedError("CUDA attention: paged k/v token stride must be below 2^31 elements");
    }
    require_aligned(in.k, "k_cache", 1, 2);
    require_aligned(in.v, "v_cache", 1, 2);
  } else {
    require_aligned(in.k, "k", 0, 1);
    require_aligned(in.v, "v", 0, 1);
  }
}

void check_sparse_supported(const AttentionInputs& in, const Problem& p, int block_size) {
  if (!listed(CudaLimits::kSparseHeadDims, p.head_dim))
    throw NotImplementedError("CUDA sparse attention is built for head dim " + sparse_head_dims() + " only, got " +
                              std::to_string(p.head_dim));
  if (gathered_pages(p))
    throw NotImplementedError("CUDA sparse attention: paged KV needs " + kPageRule + " (TMA loads); got page_size " +
                              std::to_string(p.page_size));
  if (!in.causal || in.window_left >= 0 || in.window_right >= 0)
    throw NotImplementedError("CUDA sparse attention supports causal attention without an attention window only");
  if (block_size % geometry::kKeyStep != 0)
    throw NotImplementedError("CUDA sparse attention needs block_size % " + std::to_string(geometry::kKeyStep) +
                              " == 0 (one listed block = whole " + std::to_string(geometry::kKeyStep) +
                              "-key kernel steps); got block_size " + std::to_string(block_size));
}

void check_index_view_supported(const BlockIndexView& index) {
  require_contiguous(index.segment_start, "index.segment_start");
  require_contiguous(index.segment_end, "index.segment_end");
  require_contiguous(index.block_ids, "index.block_ids");
  require_contiguous(index.cu_blocks, "index.cu_blocks");  // prepare_index_view reads it too
  if (index.segment_start.shape[0] > INT32_MAX || index.block_ids.shape[0] > INT32_MAX)
    throw NotImplementedError("CUDA sparse attention: more than 2^31 - 1 segments or block ids");
}

void check_index_supported(const AttentionInputs& in, const Problem& p, const SelectionParams& params) {
  // The per-key scorers (key_max.cu, exact_max.cu) list a tile's blocks and their 64-key units as uint16.
  if (is_per_key_rule(params.rule) &&
      geometry::num_blocks(in.max_seqlen_k, params.block_size) * (params.block_size / 64) > 65535) {
    throw NotImplementedError("build_index on CUDA, rules key_max and exact_max: max_seqlen_k " +
                              std::to_string(in.max_seqlen_k) + " exceeds the per-key scorers' 65535 units of 64 keys");
  }
  if (!in.causal || in.window_left >= 0 || in.window_right >= 0) {
    throw NotImplementedError("build_index on CUDA supports causal attention without an attention window only");
  }
  const bool fp8 = is_fp8(p);
  if (!listed(CudaLimits::kDTypes, p.dtype)) {
    throw NotImplementedError("build_index on CUDA supports " + cuda_dtypes() + " inputs, got " + dtype_name(p.dtype));
  }
  // what the sparse FP8 kernel is built for; one scorer instantiation
  if (fp8 && !listed(CudaLimits::kSparseHeadDims, p.head_dim)) {
    throw NotImplementedError("build_index on CUDA: float8_e4m3fn inputs need head dim " + sparse_head_dims() +
                              ", got head dim " + std::to_string(p.head_dim));
  }
  // The 16-bit scorer copies q with 4-byte cp.async at least; the FP8 one falls back to byte loads.
  if (!fp8 && !q_cp_async_aligned(in)) {
    throw NotImplementedError("build_index on CUDA needs even q strides and a 4-byte aligned q");
  }
}

}  // namespace sparse_prefill::cuda
