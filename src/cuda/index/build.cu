// The index stage's entry (index_stage.h): carves the workspace and launches the roles in order: plan (plan.cu) ->
// mean cache and pooling (mean_cache.cu, pool.cu) -> probe rows, score and select (probe.cu, score_select.cu) ->
// union (union.cu) -> the dense rule (dense_rule.cu). FP8 inputs are read raw and dequantised with the call's
// descales by every kernel that reads them (pooling, scorer, probe): no host synchronisation, no copy.
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>

#include "core/contract.h"
#include "cuda/common/math.h"
#include "cuda/common/problem_traits.h"
#include "cuda/index/device_args.cuh"

namespace sparse_prefill::cuda {

using namespace index_stage;

DeviceIndex build_index(const AttentionInputs& in, const LaunchInputs& li, const Problem& p,
                        const SelectionParams& params, void* workspace, size_t workspace_bytes,
                        const MeanCache* mean_cache) {
  // What the index stage supports was checked by the API layer (check_index_supported, support.cpp); the scorer's
  // cp.async of q relies on it.
  const bool fp8 = is_fp8(p);
  internal_check(p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16 || fp8, "q",
                 "a dtype the index stage is not built for");
  internal_check(fp8 || q_cp_async_aligned(in), "q", "odd strides or a base not 4-byte aligned");
  const IndexBinding binding = bind_index(in, p, params);
  const VirtualHeads heads = virtual_heads(p, binding.num_subgroups);
  const Bounds bd = bounds_of(binding, params);  // capacity < 2^31: int32 ids and offsets (checked there)
  const size_t need = carve(binding, bd, nullptr, nullptr);
  if (workspace == nullptr || workspace_bytes < need) {
    throw ArgumentError("workspace", "needs " + std::to_string(need) + " bytes (index_workspace_bytes), got " +
                                         std::to_string(workspace_bytes));
  }
  const DeviceIndex d = carve_index(binding, params, workspace);

  cudaStream_t stream = static_cast<cudaStream_t>(li.stream);
  const SeqArgs seq = seq_args(li);
  launch_plan(stream, seq, li.limits, heads, params.block_size, d);

  const KVArgs kv = kv_args(li);
  MeanCacheArgs cache;
  if (mean_cache != nullptr) {
    cache.k = mean_cache->k_mean.ptr<float>();
    cache.v = mean_cache->v_mean.ptr<float>();
    cache.slots_per_page = int(geometry::mean_cache_slots_per_page(p.page_size, params.block_size));
    cache.chunk_blocks = int(geometry::num_blocks(in.max_seqlen_q, params.block_size) + 1);
  }
  // Pooling CTAs: one per (pooled row, KV head), or with the cache per (block the chunk touches, KV head).
  const int64_t pool_rows = cache.chunk_blocks > 0 ? int64_t(p.batch) * cache.chunk_blocks : bd.max_blocks;
  // 16-byte loads need 16-byte aligned K/V rows
  const bool vec_ok = rows_vec8(li.k, li.k_stride, p.paged) && rows_vec8(li.v, li.v_stride, p.paged);
  launch_copy_cached_means(stream, p.dtype, seq, kv, cache, params.block_size, p.num_kv_heads, p.head_dim,
                           bd.max_blocks, d);
  launch_pooling(stream, p.dtype, p.head_dim, vec_ok, pool_rows, seq, kv, cache, params.block_size, p.num_kv_heads,
                 d);
  const int per16 = fp8 ? 16 : 8;  // elements in 16 bytes
  const bool q_vec16 = reinterpret_cast<uintptr_t>(li.q) % 16 == 0 && li.q_stride[0] % per16 == 0 &&
                       li.q_stride[1] % per16 == 0;
  const QArgs qa = q_args(li, q_vec16);
  const SelectArgs sel{params.alpha, params.block_size, params.sink, params.window,
                       params.final_chunk ? params.last_n : 0,
                       float(p.softmax_scale * kLog2e)};
  launch_select(stream, p, params, bd, heads, seq, qa, kv, sel, d);
  if (params.union_lists && bd.max_tiles > 0) {
    launch_union(stream, seq, heads, p.batch, params.block_size, bd.nb_max, d);
  }
  launch_dense_rule(stream, seq, heads, params.block_size, params.dense_fraction, bd, d);
  return d;
}

}  // namespace sparse_prefill::cuda
