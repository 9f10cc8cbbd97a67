// The index on the host: download_index / download_counts (a device index copied back, compacted into the CSR the
// CPU reference returns, overflowed segments expanded to their full lists) and build_index_to_host (the allocating
// convenience path behind sparse_prefill::build_index).
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "core/contract.h"
#include "cuda/common/check.h"
#include "cuda/cuda_backend.h"
#include "cuda/index/index_stage.h"
#include "cuda/index/layout.h"

namespace sparse_prefill::cuda {

using index_stage::VirtualHeads;
using index_stage::virtual_heads;

BlockIndex download_index(const DeviceIndex& d, const IndexBinding& b, const SelectionParams& params, void* stream_) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  check_cuda(cudaStreamSynchronize(stream), "build_index");
  auto download = [&](const void* src, size_t n_bytes, void* dst) {
    if (n_bytes) check_cuda(cudaMemcpy(dst, src, n_bytes, cudaMemcpyDeviceToHost), "cudaMemcpy(index)");
  };
  const int batch = b.batch, D = b.head_dim, hkv = b.num_kv_heads;
  std::vector<int32_t> cu_tiles(batch + 1);
  unsigned long long counters[kNumCounters] = {};
  BlockIndex idx;
  const VirtualHeads heads = virtual_heads(hkv, b.num_q_heads / hkv, b.num_subgroups);
  idx.binding = b;
  idx.block_size = params.block_size;
  idx.group_size = heads.group;
  idx.num_kv_heads = heads.kv;
  idx.num_subgroups = heads.num_subgroups;
  idx.head_dim = D;
  idx.correction = params.correction;
  idx.cu_blocks.resize(batch + 1);
  download(d.cu_tiles, cu_tiles.size() * 4, cu_tiles.data());
  download(d.cu_blocks, idx.cu_blocks.size() * 4, idx.cu_blocks.data());
  download(d.counters, sizeof(counters), counters);
  const size_t segments = size_t(cu_tiles[batch]) * heads.kv;
  // Every slot handed out lies below the cursor and the capacity (a request that found no room passed the latter).
  std::vector<int32_t> start(segments), end(segments),
      ids(size_t(std::min<unsigned long long>(counters[kCursor], (unsigned long long)d.capacity)));
  download(d.segment_start, segments * 4, start.data());
  download(d.segment_end, segments * 4, end.data());
  download(d.block_ids, ids.size() * 4, ids.data());
  idx.segment_start.resize(segments);
  idx.segment_end.resize(segments);
  for (size_t s = 0; s < segments; ++s) {  // the segments' lists, in segment order, into one dense CSR
    const bool full = start[s] == kOverflowStart;
    if (!full && s > 0 && start[s] == start[s - 1] && end[s] == end[s - 1]) {  // a shared (union) list stays shared
      idx.segment_start[s] = idx.segment_start[s - 1];
      idx.segment_end[s] = idx.segment_end[s - 1];
      continue;
    }
    idx.segment_start[s] = int32_t(idx.block_ids.size());
    if (full) {  // overflowed, or every segment under the dense rule: blocks 0 .. end - 1, what the kernel runs
      for (int32_t J = 0; J < end[s]; ++J) idx.block_ids.push_back(J);
    } else {
      idx.block_ids.insert(idx.block_ids.end(), ids.begin() + start[s], ids.begin() + end[s]);
    }
    idx.segment_end[s] = int32_t(idx.block_ids.size());
  }
  const size_t pooled = size_t(idx.cu_blocks[batch]) * hkv * D;
  // V means only with the correction: without it the pooling does not write them (pool.cu), and the index has none.
  const bool with_v = params.correction;
  std::vector<float> km(pooled), vm(with_v ? pooled : 0);
  download(d.k_mean, pooled * 4, km.data());
  if (with_v) download(d.v_mean, pooled * 4, vm.data());
  if (heads.num_subgroups == 1) {
    idx.k_mean = std::move(km);
    idx.v_mean = std::move(vm);
  } else {  // the index's means are over virtual heads: head h * S + s repeats KV head h
    const size_t rows = size_t(idx.cu_blocks[batch]);
    idx.k_mean.resize(pooled * heads.num_subgroups);
    idx.v_mean.resize(with_v ? pooled * heads.num_subgroups : 0);
    for (size_t r = 0; r < rows; ++r)
      for (int v = 0; v < heads.kv; ++v) {
        const size_t src = (r * hkv + geometry::memory_kv_head(v, heads.num_subgroups)) * D;
        const size_t dst = (r * heads.kv + v) * D;
        std::copy(km.begin() + src, km.begin() + src + D, idx.k_mean.begin() + dst);
        if (with_v) std::copy(vm.begin() + src, vm.begin() + src + D, idx.v_mean.begin() + dst);
      }
  }
  idx.kept_blocks = int64_t(counters[kKept]);
  idx.visible_blocks = int64_t(counters[kVisible]);
  idx.overflow_segments = int64_t(counters[kOverflow]);  // the segments marked for want of room, not the dense rule's
  return idx;
}

IndexStats download_counts(const DeviceIndex& d, void* stream) {
  unsigned long long counters[kNumCounters] = {};
  check_cuda(cudaMemcpyAsync(counters, d.counters, sizeof(counters), cudaMemcpyDeviceToHost,
                             static_cast<cudaStream_t>(stream)),
             "cudaMemcpyAsync(index counts)");
  check_cuda(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "index counts");
  return {int64_t(counters[kKept]), int64_t(counters[kVisible]), int64_t(counters[kOverflow])};
}

BlockIndex build_index_to_host(const AttentionInputs& in, const Problem& p, const SelectionParams& params) {
  const size_t bytes = index_workspace_bytes(in, p, params);
  void* ws = nullptr;
  check_cuda(cudaMalloc(&ws, bytes), "cudaMalloc(index workspace)");
  struct Free {
    void* ptr;
    ~Free() { cudaFree(ptr); }
  } free_ws{ws};
  const DeviceIndex d = build_index(in, launch_inputs(in, p), p, params, ws, bytes);
  return download_index(d, bind_index(in, p, params), params, in.stream);
}

}  // namespace sparse_prefill::cuda
