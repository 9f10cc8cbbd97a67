// The CUDA backend's entry points (cuda_backend.h): launch arguments, workspace carving, the per-(dtype, head dim)
// forward kernels.
#include "cuda/cuda_backend.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <optional>
#include <string>

#include <cuda_runtime.h>

#include "core/contract.h"
#include "core/geometry.h"
#include "cuda/attention/fwd_args.h"
#include "cuda/common/check.h"
#include "cuda/common/launch_inputs.h"
#include "cuda/common/workspace.h"
#include "cuda/index/index_stage.h"
#include "cuda/split_kv/split_kv.h"

namespace sparse_prefill::cuda {
namespace {

// The attention kernel's launch arguments: the call's packed inputs (launch_inputs.h, held as they are) and what only
// the kernel reads: the outputs and the shape.
FwdArgs make_fwd_args(const LaunchInputs& li, const AttentionInputs& in, const AttentionOutputs& outs,
                      const Problem& p) {
  // What the kernels support was checked by the API layer (check_attention_supported, support.cpp).
  internal_check(p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16 || is_fp8(p), "q",
                 "a dtype the attention kernels are not built for");

  FwdArgs a;
  a.in = li;
  a.out = outs.out.data;
  a.o_row_stride = outs.out.stride[0];
  a.o_head_stride = outs.out.stride[1];
  if (outs.lse) {
    a.lse = outs.lse->ptr<float>();
    a.lse_head_stride = outs.lse->stride[0];
    a.lse_row_stride = outs.lse->stride[1];
  }
  a.batch = p.batch;
  a.num_q_heads = p.num_q_heads;
  a.num_kv_heads = p.num_kv_heads;
  a.head_dim = p.head_dim;
  a.total_q = int(p.total_q);
  a.total_k_rows = int(li.paged ? li.num_pages * li.page_size : p.total_k);
  a.max_seqlen_q = int(std::min<int64_t>(in.max_seqlen_q, INT32_MAX));
  a.softmax_scale = p.softmax_scale;
  a.causal = in.causal;
  a.window_left = in.window_left;
  a.window_right = in.window_right;
  if (a.total_k_rows == 0) {
    // No key at all: every tile is empty (zeros, lse = -inf) and no K/V load is issued, but the TMA descriptors
    // still need a valid non-empty domain: describe q's memory instead (K / V's token and head strides as q's).
    const int r = li.paged ? 1 : 0;
    a.in.k = a.in.v = a.in.q;
    a.in.k_stride[r] = a.in.v_stride[r] = li.q_stride[0];
    a.in.k_stride[r + 1] = a.in.v_stride[r + 1] = li.q_stride[1];
    a.total_k_rows = 1;
  }
  return a;
}

void run(const FwdArgs& a, const Problem& p, const SparseFwdArgs* sparse) {
  if (is_fp8(p)) return run_fwd_e4m3_hdim128(a, sparse);
  const bool bf16 = p.dtype == DType::kBFloat16;
  if (p.head_dim == 64)
    bf16 ? run_fwd_bf16_hdim64(a, sparse) : run_fwd_fp16_hdim64(a, sparse);
  else
    bf16 ? run_fwd_bf16_hdim128(a, sparse) : run_fwd_fp16_hdim128(a, sparse);
}

// The caller's workspace (validated: size, alignment) or, without one, a stream-ordered temporary.
struct Scratch {
  std::optional<StreamBuffer> tmp;
  void* ptr = nullptr;
  Scratch(const AttentionInputs& in, const std::optional<TensorView>& workspace, size_t need, const char* sized_by) {
    if (workspace) {
      check_workspace(*workspace, in.q, int64_t(need), sized_by);
      ptr = workspace->data;
    } else {
      ptr = tmp.emplace(need, static_cast<cudaStream_t>(in.stream)).ptr;
    }
  }
};

// Runs the sparse kernel between the split plan and the combine of its float32 partials (split_kv/plan_combine.cu).
// `plan`: the launch runs the split-KV plan (split_planned for indexes; always for the dense full-list path), when its
// workspace has the split arrays.
void run_sparse(const FwdArgs& a, const Problem& p, SparseFwdArgs s, bool plan) {
  s.launch.plan = plan && s.launch.max_split_units > 0;
  run_split_plan(a, s);
  run(a, p, &s);
  run_split_combine(a, s, p.dtype == DType::kBFloat16 || is_fp8(p));  // FP8 writes bfloat16
}
bool planned(const AttentionInputs& in) {
  return split_planned(in.options.split_kv, in.max_seqlen_q, in.max_seqlen_k);
}

// The kernel's view of an index built on the GPU.
SparseFwdArgs sparse_args_of(const DeviceIndex& index) {
  SparseFwdArgs s;
  s.segment_start = index.segment_start;
  s.segment_end = index.segment_end;
  s.block_ids = index.block_ids;
  s.cu_tiles = index.cu_tiles;
  s.cu_blocks = index.cu_blocks;
  s.k_mean = index.k_mean_kernel;  // the kernel's operand type (FP8: e4m3 in raw units, index_stage.h)
  // Without the correction the index stage writes no V means (pool.cu) and the kernel reads none (fusion.h).
  s.v_mean = index.correction ? index.v_mean_kernel : nullptr;
  s.mean_rows = index.max_blocks;
  s.num_segments = int(std::min<int64_t>(index.max_segments, INT32_MAX));
  s.num_block_ids = int(std::min<int64_t>(index.capacity, INT32_MAX));
  s.launch = index.launch;
  s.block_size = index.block_size;
  s.correction = index.correction;
  s.num_subgroups = index.num_subgroups;
  s.overflow_marks = true;
  return s;
}

// Sparse attention over a device index. A one-shot launch (no split-KV plan) runs the dense kernel when the dense
// rule kept every block (counters[kDense], dense_rule.cu) and the sparse kernel otherwise, both launched and each
// gated on that word: dense attention at dense speed, decided on the device. Planned launches (chunk shapes) run the
// sparse kernel, whose full lists are dense attention the way attention() runs those shapes too.
void run_sparse_index(const AttentionInputs& in, FwdArgs a, const Problem& p, const DeviceIndex& d,
                      float dense_fraction) {
  const bool plan = planned(in);
  if (!plan && dense_fraction < 1.f) {  // 1: the rule is off, the flag stays 0
    FwdArgs dense = a;
    dense.gate = {d.counters + kDense, 1};
    run(dense, p, nullptr);
    a.gate = {d.counters + kDense, 0};
  }
  run_sparse(a, p, sparse_args_of(d), plan);
}

// The host-index path's prepared copies in one workspace: tiles per sequence, the kernel's pooled means (q's dtype;
// FP8: e4m3), launch state.
// Without a base only `bytes` is set.
struct ViewLayout {
  int32_t* cu_tiles = nullptr;
  void* k_mean = nullptr;
  void* v_mean = nullptr;
  SparseLaunchWorkspace launch;
  size_t bytes = 0;
};
ViewLayout view_layout(const AttentionInputs& in, const BlockIndexView& index, const Problem& p, void* base) {
  const int64_t rows = index.correction ? index.k_mean.shape[0] : 0;
  const size_t mean_bytes = size_t(rows) * p.num_kv_heads * p.head_dim * (is_fp8(p) ? 1 : 2);
  WorkspaceCarver ws(base);
  ViewLayout l;
  l.cu_tiles = ws.take_array<int32_t>(size_t(p.batch) + 1);
  l.k_mean = ws.take(mean_bytes);
  l.v_mean = ws.take(mean_bytes);
  const bool split = planned(in);
  const int sms = num_sms();
  char* launch = ws.take(sparse_launch_workspace_bytes(sms, p.head_dim, split));
  if (base) l.launch = carve_sparse_launch_workspace(launch, sms, p.head_dim, split);
  l.bytes = ws.bytes();
  return l;
}

}  // namespace

bool dense_uses_full_list(const AttentionInputs& in, const Problem& p) {
  using Path = LaunchOptions::DensePath;
  // the full-list path is the sparse kernel, built for one head dim
  static_assert(std::size(CudaLimits::kSparseHeadDims) == 1);
  if (in.options.dense_path == Path::kDenseKernel || p.head_dim != CudaLimits::kSparseHeadDims[0]) return false;
  if (is_fp8(p)) return false;  // FP8: the dense kernel only (DenseFp8Fwd)
  if (in.window_left >= 0 || (!in.causal && in.window_right >= 0)) return false;
  if (in.max_seqlen_k <= in.max_seqlen_q) return false;  // only chunk and decode shapes
  if (gathered_pages(p)) return false;  // the sparse kernel loads K/V by TMA only
  if (in.options.dense_path == Path::kSplitKV) return true;
  const int64_t m_blocks = geometry::num_tiles(in.max_seqlen_q, 1);  // dense tiles of one head
  // Measured (H200, Llama heads, docs/design/dense_kernel.md): Lq = 128 against 128K (32 dense tiles) 1.87x faster
  // than the dense kernel, Lq = 512 (128 tiles, one wave already) 0.85x: split only below half a wave.
  return in.max_seqlen_q < 128 || 2 * int64_t(p.num_q_heads) * m_blocks * p.batch <= num_sms();
}

int64_t attention_workspace_bytes(int head_dim) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {  // a CUDA build on a machine without a GPU: nothing to size
    (void)cudaGetLastError();
    return 0;
  }
  return int64_t(sparse_launch_workspace_bytes(num_sms(), head_dim, true));
}

void attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p) {
  const FwdArgs a = make_fwd_args(launch_inputs(in, p), in, outs, p);
  const size_t need = size_t(attention_workspace_bytes(p.head_dim));
  // Checked even when this call takes the dense kernel: a bad buffer fails on every shape.
  if (outs.workspace) check_workspace(*outs.workspace, in.q, int64_t(need), "attention_workspace_bytes(head_dim)");
  if (!dense_uses_full_list(in, p)) return run(a, p, nullptr);
  // Short queries against long keys: the sparse kernel's PackGQA tiles over the full block list, split-KV planned
  // on the device, float32 partials in the caller's workspace or a stream-ordered temporary.
  const Scratch ws(in, outs.workspace, need, "attention_workspace_bytes(head_dim)");
  SparseFwdArgs s;
  s.full_list = true;
  s.block_size = geometry::kKeyStep;
  s.correction = false;
  s.launch = carve_sparse_launch_workspace(ws.ptr, num_sms(), p.head_dim, true);
  run_sparse(a, p, s, /*plan=*/true);  // the full-list path is planned by construction (more keys than queries)
}

void sparse_attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p,
                      const DeviceBlockIndex& index) {
  const FwdArgs a = make_fwd_args(launch_inputs(in, p), in, outs, p);
  const DeviceIndex d = carve_index(index.binding, index.params, index.workspace.data);  // pointers only: no access
  check_workspace(index.workspace, in.q, int64_t(d.workspace_bytes), "index_workspace_bytes(...)");
  run_sparse_index(in, a, p, d, index.params.dense_fraction);
}

size_t sparse_attention_workspace_bytes(const AttentionInputs& in, const BlockIndexView& index, const Problem& p) {
  return view_layout(in, index, p, nullptr).bytes;
}

void sparse_attention(const AttentionInputs& in, const BlockIndexView& index, const AttentionOutputs& outs,
                      const Problem& p) {
  const LaunchInputs li = launch_inputs(in, p);
  const FwdArgs a = make_fwd_args(li, in, outs, p);
  const Scratch ws(in, outs.workspace, view_layout(in, index, p, nullptr).bytes,
                   "sparse_attention_workspace_bytes(...)");
  const ViewLayout l = view_layout(in, index, p, ws.ptr);
  SparseFwdArgs s;
  // Contiguous int32 arrays of fewer than 2^31 entries (check_index_view_supported, support.cpp).
  s.segment_start = index.segment_start.ptr<const int32_t>();
  s.segment_end = index.segment_end.ptr<const int32_t>();
  s.block_ids = index.block_ids.ptr<const int32_t>();
  s.cu_tiles = l.cu_tiles;
  s.cu_blocks = index.cu_blocks.ptr<const int32_t>();
  prepare_index_view(li, p, index, l.cu_tiles, l.k_mean, l.v_mean);
  s.num_segments = int(std::min(index.segment_start.shape[0], index.segment_end.shape[0]));
  s.num_block_ids = int(index.block_ids.shape[0]);
  s.k_mean = l.k_mean;
  s.v_mean = l.v_mean;
  s.mean_rows = index.correction ? index.k_mean.shape[0] : 0;
  s.launch = l.launch;
  s.block_size = index.block_size;
  s.correction = index.correction && s.mean_rows > 0;
  s.num_subgroups = index.num_subgroups;
  run_sparse(a, p, s, planned(in));
}

void sparse_prefill(const AttentionInputs& in, const SelectionParams& params, const AttentionOutputs& outs,
                    const Problem& p, const MeanCache* cache) {
  const LaunchInputs li = launch_inputs(in, p);  // read by the index stage and the sparse kernel
  const FwdArgs a = make_fwd_args(li, in, outs, p);
  const size_t bytes = index_workspace_bytes(in, p, params);
  const Scratch ws(in, outs.workspace, bytes, "sparse_prefill_workspace_bytes(...)");
  run_sparse_index(in, a, p, build_index(in, li, p, params, ws.ptr, bytes, cache), params.dense_fraction);
}

void build_index(const AttentionInputs& in, const Problem& p, const SelectionParams& params,
                 const TensorView& workspace, const MeanCache* cache) {
  const size_t bytes = index_workspace_bytes(in, p, params);
  check_workspace(workspace, in.q, int64_t(bytes), "index_workspace_bytes(...)");
  build_index(in, launch_inputs(in, p), p, params, workspace.data, bytes, cache);
}

TensorView download_int32(const TensorView& t, void* stream, std::vector<int32_t>& storage) {
  // The strided span of t (any strides), copied whole, then gathered into a contiguous host array.
  storage.resize(size_t(t.numel()));
  TensorView h = t;
  h.device = Device::kCPU;
  h.data = storage.data();
  if (t.numel() == 0) return h;
  int64_t lo = 0, hi = 0;
  for (int d = 0; d < t.ndim; ++d) {
    const int64_t step = (t.shape[d] - 1) * t.stride[d];
    (step < 0 ? lo : hi) += step;
  }
  std::vector<int32_t> span(size_t(hi - lo + 1));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  check_cuda(cudaMemcpyAsync(span.data(), t.ptr<const int32_t>() + lo, span.size() * 4, cudaMemcpyDeviceToHost, s),
             "cudaMemcpyAsync (checked mode)");
  check_cuda(cudaStreamSynchronize(s), "checked mode");
  if (t.ndim == 1) {
    for (int64_t i = 0; i < t.shape[0]; ++i) storage[i] = span[i * t.stride[0] - lo];
    h.stride[0] = 1;
  } else {
    for (int64_t i = 0; i < t.shape[0]; ++i)
      for (int64_t j = 0; j < t.shape[1]; ++j)
        storage[i * t.shape[1] + j] = span[i * t.stride[0] + j * t.stride[1] - lo];
    h.stride[0] = t.shape[1];
    h.stride[1] = 1;
  }
  return h;
}

IndexStats index_stats(const DeviceBlockIndex& index, void* stream) {
  return download_counts(carve_index(index.binding, index.params, index.workspace.data), stream);
}

BlockIndex to_host(const DeviceBlockIndex& index, void* stream) {
  return download_index(carve_index(index.binding, index.params, index.workspace.data), index.binding, index.params,
                        stream);
}

}  // namespace sparse_prefill::cuda
