// A caller's index view (BlockIndexView, arrays on the GPU) prepared for the sparse kernel: tiles per sequence and
// the kernel's copies of its float32 pooled means (q's dtype; FP8: e4m3 in raw units of the call's descales).
#include <algorithm>
#include <optional>

#include "cuda/common/check.h"
#include "cuda/index/device_args.cuh"

namespace sparse_prefill::cuda {
namespace {

using index_stage::DescaleArg;
using index_stage::descale_arg;
using index_stage::SeqArgs;
using index_stage::from_float;
using index_stage::find_sequence;
using index_stage::is_fp8_v;
using index_stage::to_kernel_mean;

// Where the view's means are and, for FP8, the descales and block offsets that give each row its sequence's scale.
struct ViewMeans {
  const float* k;
  const float* v;
  int64_t k_rs, k_hs, v_rs, v_hs;
  int64_t rows;
  const int32_t* cu_blocks;  // FP8 only (contiguous, checked by the caller): row r is sequence find_sequence(r)'s
  DescaleArg k_descale, v_descale;
};

// Prepares a caller's index view for the sparse kernel: tiles per sequence (prefix sums, from cu_seqlens_q on the
// device) and the kernel-type copies of the float32 pooled means.
template <typename T>
__global__ void prepare_view_kernel(SeqArgs seq, SeqLimits limits, int batch, int group_size, int32_t* cu_tiles,
                                    ViewMeans m, int num_kv_heads, int head_dim, T* k_out, T* v_out) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    int64_t tiles = 0;
    cu_tiles[0] = 0;
    for (int b = 0; b < batch; ++b) {  // a bad sequence (device_checks.h) gets no tile: the kernel reports it
      const SeqSpan span = load_seq_span(seq.cu_q, seq.cu_k, seq.seqused_k, b);
      if (!seq_violation(span, b, limits)) tiles += geometry::num_tiles(span.q_len, group_size);
      cu_tiles[b + 1] = int32_t(tiles);
    }
  }
  const int64_t n = m.rows * num_kv_heads * head_dim;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = i % head_dim, h = (i / head_dim) % num_kv_heads, r = i / (int64_t(head_dim) * num_kv_heads);
    const float km = m.k[r * m.k_rs + h * m.k_hs + d], vm = m.v[r * m.v_rs + h * m.v_hs + d];
    if constexpr (is_fp8_v<T>) {
      // bad cu_blocks values give some b in [0, batch): never out of bounds; the sparse kernel reports them
      const int b = find_sequence(m.cu_blocks, batch, r);
      k_out[i] = to_kernel_mean(km, m.k_descale.at(b, int(h)));
      v_out[i] = to_kernel_mean(vm, m.v_descale.at(b, int(h)));
    } else {
      k_out[i] = from_float<T>(km);
      v_out[i] = from_float<T>(vm);
    }
  }
}

}  // namespace

void prepare_index_view(const LaunchInputs& li, const Problem& p, const BlockIndexView& view, int32_t* cu_tiles,
                        void* k_kernel, void* v_kernel) {
  cudaStream_t stream = static_cast<cudaStream_t>(li.stream);
  const int64_t rows = view.correction ? view.k_mean.shape[0] : 0;
  const int64_t n = rows * p.num_kv_heads * p.head_dim;
  const int grid = int(std::min<int64_t>(std::max<int64_t>((n + 255) / 256, 1), 4096));
  // With head sub-groups S the view's means are over Hkv * S virtual heads (virtual head h * S + s holds the means of
  // KV head h): the kernel's copies are per KV head, read from virtual head h * S (head stride x S).
  const int S = view.num_subgroups;
  ViewMeans m{};
  m.rows = rows;
  if (rows) {
    m.k = view.k_mean.ptr<const float>();
    m.v = view.v_mean.ptr<const float>();
    m.k_rs = view.k_mean.stride[0], m.k_hs = view.k_mean.stride[1] * S;
    m.v_rs = view.v_mean.stride[0], m.v_hs = view.v_mean.stride[1] * S;
  }
  m.cu_blocks = view.cu_blocks.ptr<const int32_t>();
  m.k_descale = descale_arg(li.k_descale);
  m.v_descale = descale_arg(li.v_descale);
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    prepare_view_kernel<T><<<grid, 256, 0, stream>>>(index_stage::seq_args(li), li.limits, p.batch,
                                                     p.group_size / S, cu_tiles, m, p.num_kv_heads, p.head_dim,
                                                     static_cast<T*>(k_kernel), static_cast<T*>(v_kernel));
  };
  if (p.dtype == DType::kFloat8E4M3) launch(__nv_fp8_e4m3{});
  else if (p.dtype == DType::kBFloat16) launch(__nv_bfloat16{});
  else launch(__half{});
  check_cuda(cudaGetLastError(), "prepare_view_kernel launch");
}

}  // namespace sparse_prefill::cuda
