// A caller's index view (BlockIndexView, arrays on the GPU) prepared for the sparse kernel: tiles per sequence and
// q-dtype copies of its float32 pooled means.
#include <algorithm>

#include "cuda/common/check.h"
#include "cuda/index/device_args.cuh"

namespace sparse_prefill::cuda {
namespace {

using index_stage::SeqArgs;
using index_stage::from_float;

// Prepares a caller's index view for the sparse kernel: tiles per sequence (prefix sums, from cu_seqlens_q on the
// device) and low-precision copies of the float32 pooled means.
template <typename T>
__global__ void prepare_view_kernel(SeqArgs seq, SeqLimits limits, int batch, int group_size, int32_t* cu_tiles,
                                    const float* k_mean, const float* v_mean, int64_t k_rs, int64_t k_hs,
                                    int64_t v_rs, int64_t v_hs, int64_t rows, int num_kv_heads, int head_dim,
                                    T* k_lowp, T* v_lowp) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    int64_t tiles = 0;
    cu_tiles[0] = 0;
    for (int b = 0; b < batch; ++b) {  // a bad sequence (device_checks.h) gets no tile: the kernel reports it
      const SeqSpan span = load_seq_span(seq.cu_q, seq.cu_k, seq.seqused_k, b);
      if (!seq_violation(span, b, limits)) tiles += geometry::num_tiles(span.q_len, group_size);
      cu_tiles[b + 1] = int32_t(tiles);
    }
  }
  const int64_t n = rows * num_kv_heads * head_dim;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = i % head_dim, h = (i / head_dim) % num_kv_heads, r = i / (int64_t(head_dim) * num_kv_heads);
    k_lowp[i] = from_float<T>(k_mean[r * k_rs + h * k_hs + d]);
    v_lowp[i] = from_float<T>(v_mean[r * v_rs + h * v_hs + d]);
  }
}

}  // namespace

void prepare_index_view(const AttentionInputs& in, const Problem& p, const BlockIndexView& view, int32_t* cu_tiles,
                        void* k_lowp, void* v_lowp) {
  cudaStream_t stream = static_cast<cudaStream_t>(in.stream);
  const int64_t rows = view.correction ? view.k_mean.shape[0] : 0;
  const int64_t n = rows * p.num_kv_heads * p.head_dim;
  const int grid = int(std::min<int64_t>(std::max<int64_t>((n + 255) / 256, 1), 4096));
  // With head sub-groups S the view's means are over Hkv * S virtual heads (virtual head h * S + s holds the means of
  // KV head h): the kernel's copies are per KV head, read from virtual head h * S (head stride x S).
  const int S = view.head_subgroups;
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    prepare_view_kernel<T><<<grid, 256, 0, stream>>>(
        index_stage::seq_args(in, p), seq_limits(in, p), p.batch, p.group_size / S, cu_tiles,
        rows ? view.k_mean.ptr<const float>() : nullptr, rows ? view.v_mean.ptr<const float>() : nullptr,
        view.k_mean.stride[0], view.k_mean.stride[1] * S, view.v_mean.stride[0], view.v_mean.stride[1] * S, rows,
        p.num_kv_heads, p.head_dim, static_cast<T*>(k_lowp), static_cast<T*>(v_lowp));
  };
  if (p.dtype == DType::kBFloat16) launch(__nv_bfloat16{});
  else launch(__half{});
  check_cuda(cudaGetLastError(), "prepare_view_kernel launch");
}

}  // namespace sparse_prefill::cuda
