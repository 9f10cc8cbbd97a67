// The public entry points: validate once, then dispatch by device (CPU reference or CUDA backend).
#include <algorithm>

#include "api/problem.h"
#include "api/validate.h"
#include "reference/reference.h"
#include "sparse_prefill/sparse.h"

#ifdef SPARSE_PREFILL_WITH_CUDA
#include "cuda/cuda_backend.h"
#include "cuda/index_stage.h"
#endif

namespace sparse_prefill {
namespace {

[[noreturn]] void not_on_cuda(const char* what) {
  throw NotImplementedError(std::string(what) + " is not implemented for CUDA yet; pass CPU arrays to use the "
                                                "CPU reference backend");
}

Problem validate_host(const AttentionInputs& in, const AttentionOutputs* outs, const char* what) {
  Problem p = validate_inputs(in, outs);
  if (p.device != Device::kCPU) not_on_cuda(what);
  return p;
}

}  // namespace

void attention(const AttentionInputs& in, const AttentionOutputs& outs) {
  const Problem p = validate_inputs(in, &outs);
  if (p.device == Device::kCPU) return reference::attention(in, outs, p);
#ifdef SPARSE_PREFILL_WITH_CUDA
  cuda::attention(in, outs, p);
#else
  throw NotImplementedError("attention: this build has no CUDA backend (nvcc was not found when it was configured)");
#endif
}

int64_t attention_workspace_bytes(int head_dim) {
#ifdef SPARSE_PREFILL_WITH_CUDA
  return cuda::attention_workspace_bytes(head_dim);
#else
  (void)head_dim;
  return 0;
#endif
}

void pool_kv(const AttentionInputs& in, int block_size, std::vector<int32_t>& cu_blocks, std::vector<float>& k_mean,
             std::vector<float>& v_mean) {
  SelectionParams params;
  params.block_size = block_size;
  check_selection_params(params);
  const Problem p = validate_host(in, nullptr, "pool_kv");
  reference::pool_kv(p, reference::gather_kv(in, p), block_size, cu_blocks, k_mean, v_mean);
}

BlockIndex build_index(const AttentionInputs& in, const SelectionParams& params) {
  check_selection_params(params);
  const Problem p = validate_inputs(in, nullptr);
  check_head_subgroups(params.head_subgroups, p.group_size, "head_subgroups");
  if (p.device == Device::kCPU) return reference::build_index(in, p, params);
#ifdef SPARSE_PREFILL_WITH_CUDA
  return cuda::build_index_to_host(in, p, params);
#else
  not_on_cuda("build_index");
#endif
}

void sparse_attention(const AttentionInputs& in, const BlockIndexView& index, const AttentionOutputs& outs) {
  const Problem p = validate_inputs(in, &outs);
  validate_index(p, index);
  if (p.device == Device::kCPU) return reference::sparse_attention(in, index, outs, p);
#ifdef SPARSE_PREFILL_WITH_CUDA
  cuda::sparse_attention(in, index, outs, p);
#else
  not_on_cuda("sparse_attention");
#endif
}

namespace {

// CPU backend of the pooled-means cache: the reference pools every block; the complete ones are stored in their
// slots (MeanCache, sparse.h), as the CUDA index stage stores the blocks a chunk completes. The cache holds the real
// KV heads: with head sub-groups (S), real head h is the index's virtual head h * S (all S copies are equal).
void write_mean_cache(const Problem& p, const AttentionInputs& in, const BlockIndex& index, const MeanCache& cache) {
  const int B = index.block_size, S = index.head_subgroups, D = p.head_dim;
  const int64_t row = int64_t(p.num_kv_heads) * D;  // one slot of the cache; the index's rows hold row * S floats
  const int32_t* bt = in.block_table->ptr<const int32_t>();
  const int64_t bt0 = in.block_table->stride[0], bt1 = in.block_table->stride[1];
  float* kc = cache.k_mean.ptr<float>();
  float* vc = cache.v_mean.ptr<float>();
  for (int b = 0; b < p.batch; ++b) {
    const int64_t k_len = p.seqs[b].k_len;
    for (int64_t J = 0; (J + 1) * B <= k_len; ++J) {
      const int64_t j = (J + 1) * B - 1;
      const int64_t page = bt[b * bt0 + (j / p.page_size) * bt1];
      const int64_t slot = p.page_size >= B ? page * (p.page_size / B) + (j % p.page_size) / B : page;
      for (int h = 0; h < p.num_kv_heads; ++h) {
        const int64_t src = ((int64_t(index.cu_blocks[b]) + J) * p.num_kv_heads * S + int64_t(h) * S) * D;
        const int64_t dst = slot * row + int64_t(h) * D;
        std::copy(index.k_mean.begin() + src, index.k_mean.begin() + src + D, kc + dst);
        std::copy(index.v_mean.begin() + src, index.v_mean.begin() + src + D, vc + dst);
      }
    }
  }
}

void sparse_prefill_impl(const AttentionInputs& in, const SelectionParams& params, const AttentionOutputs& outs,
                         const MeanCache* cache) {
  check_selection_params(params);
  const Problem p = validate_inputs(in, &outs);
  check_head_subgroups(params.head_subgroups, p.group_size, "head_subgroups");
  if (cache) validate_mean_cache(in, p, params.block_size, *cache);
  if (p.device == Device::kCPU) {
    BlockIndex index = reference::build_index(in, p, params);
    if (cache) write_mean_cache(p, in, index, *cache);
    return reference::sparse_attention(in, view_of(index), outs, p);
  }
#ifdef SPARSE_PREFILL_WITH_CUDA
  cuda::sparse_prefill(in, params, outs, p, cache);
#else
  not_on_cuda("sparse_prefill");
#endif
}

}  // namespace

void sparse_prefill(const AttentionInputs& in, const SelectionParams& params, const AttentionOutputs& outs) {
  sparse_prefill_impl(in, params, outs, nullptr);
}

void sparse_prefill(const AttentionInputs& in, const SelectionParams& params, const AttentionOutputs& outs,
                    const MeanCache& cache) {
  sparse_prefill_impl(in, params, outs, &cache);
}

BlockIndex union_index(const AttentionInputs& in, const BlockIndex& index) {
  const Problem p = validate_host(in, nullptr, "union_index");
  BlockIndex copy = index;
  validate_index(p, view_of(copy));
  return reference::union_index(in, p, index);
}

BlockIndexView view_of(BlockIndex& index) {
  BlockIndexView v;
  v.block_size = index.block_size;
  v.correction = index.correction;
  v.head_subgroups = index.head_subgroups;
  v.segment_start = make_view(index.segment_start.data(), DType::kInt32, {int64_t(index.segment_start.size())});
  v.segment_end = make_view(index.segment_end.data(), DType::kInt32, {int64_t(index.segment_end.size())});
  v.block_ids = make_view(index.block_ids.data(), DType::kInt32, {int64_t(index.block_ids.size())});
  v.cu_blocks = make_view(index.cu_blocks.data(), DType::kInt32, {int64_t(index.cu_blocks.size())});
  // Pooled-mean views take their extent from the vectors themselves, so a mismatched index fails validation
  // instead of being read out of bounds. num_kv_heads is the index's (virtual, Hkv * head_subgroups) head count.
  const int64_t row = int64_t(index.num_kv_heads) * index.head_dim;
  auto pooled_view = [&](std::vector<float>& m, const char* name) {
    if (row <= 0 || int64_t(m.size()) % row != 0) {
      throw ArgumentError(name, "holds " + std::to_string(m.size()) + " floats, not a multiple of Hkv * D = " +
                                    std::to_string(row));
    }
    return make_view(m.data(), DType::kFloat32, {int64_t(m.size()) / row, index.num_kv_heads, index.head_dim});
  };
  v.k_mean = pooled_view(index.k_mean, "index.k_mean");
  v.v_mean = pooled_view(index.v_mean, "index.v_mean");
  return v;
}

}  // namespace sparse_prefill
