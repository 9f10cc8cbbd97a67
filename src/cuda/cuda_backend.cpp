// Dispatch of sparse_prefill::cuda::attention to the per-(dtype, head dim) forward kernels.
#include "cuda/cuda_backend.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include <cuda_runtime.h>

#include "cuda/fwd_args.h"
#include "cuda/index_stage.h"

namespace sparse_prefill::cuda {
namespace {

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// TMA and the 16-byte epilogue stores need 16-byte aligned bases and strides (8 elements of 16 bits).
void require_aligned(const TensorView& t, const char* name, int first_dim, int last_dim) {
  bool ok = aligned16(t.data);
  for (int i = first_dim; i <= last_dim; ++i) ok = ok && (t.stride[i] % 8 == 0);
  if (!ok)
    throw NotImplementedError(std::string("CUDA attention: ") + name +
                              " needs a 16-byte aligned base and strides that are multiples of 8 elements");
}

// Paged KV whose pages are too small for TMA boxes: only the dense kernel's cp.async gather producer loads it.
bool gathered_pages(const Problem& p) { return p.paged && p.page_size % 64 != 0; }

FwdArgs make_fwd_args(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16)
    throw NotImplementedError("CUDA attention supports bfloat16 and float16 inputs only (got another dtype)");
  if (p.head_dim != 128 && p.head_dim != 64)
    throw NotImplementedError("CUDA attention is built for head dims 64 and 128, got " + std::to_string(p.head_dim));
  if (p.total_q > INT32_MAX || p.total_k > INT32_MAX)
    throw NotImplementedError("CUDA attention: more than 2^31 - 1 rows");

  FwdArgs a;
  a.q = in.q.data;
  a.k = in.k.data;
  a.v = in.v.data;
  a.out = outs.out.data;
  a.lse = outs.lse ? outs.lse->ptr<float>() : nullptr;
  a.q_row_stride = in.q.stride[0];
  a.q_head_stride = in.q.stride[1];
  a.o_row_stride = outs.out.stride[0];
  a.o_head_stride = outs.out.stride[1];
  if (outs.lse) {
    a.lse_head_stride = outs.lse->stride[0];
    a.lse_row_stride = outs.lse->stride[1];
  }
  require_aligned(in.q, "q", 0, 1);
  require_aligned(outs.out, "out", 0, 1);
  if (p.paged) {
    // TMA: one 128-row box per key block (page_size % 128 == 0) or two 64-row boxes, one per page
    // (page_size % 128 == 64); any other page size: the dense kernel's cp.async gather producer (fwd_kernel.h).
    for (const TensorView* t : {&in.k, &in.v}) {
      if (t->stride[0] != p.page_size * t->stride[1])
        throw NotImplementedError("CUDA attention: paged k/v pages must be dense along page_size");
      if (gathered_pages(p) && t->stride[1] >= (int64_t(1) << 31))  // the gather's 32-bit row byte stride
        throw NotImplementedError("CUDA attention: paged k/v token stride must be below 2^31 elements");
    }
    require_aligned(in.k, "k_cache", 1, 2);
    require_aligned(in.v, "v_cache", 1, 2);
    a.k_row_stride = in.k.stride[1];
    a.k_head_stride = in.k.stride[2];
    a.v_row_stride = in.v.stride[1];
    a.v_head_stride = in.v.stride[2];
    a.block_table = in.block_table->ptr<int>();
    a.block_table_stride = in.block_table->stride[0];
    a.seqused_k = in.seqused_k->ptr<int>();
    a.page_size = int(p.page_size);
    a.total_k_rows = int(p.num_pages * p.page_size);
  } else {
    require_aligned(in.k, "k", 0, 1);
    require_aligned(in.v, "v", 0, 1);
    a.k_row_stride = in.k.stride[0];
    a.k_head_stride = in.k.stride[1];
    a.v_row_stride = in.v.stride[0];
    a.v_head_stride = in.v.stride[1];
    a.cu_seqlens_k = in.cu_seqlens_k->ptr<int>();
    a.total_k_rows = int(p.total_k);
  }
  a.cu_seqlens_q = in.cu_seqlens_q.ptr<int>();
  a.batch = p.batch;
  a.num_q_heads = p.num_q_heads;
  a.num_kv_heads = p.num_kv_heads;
  a.head_dim = p.head_dim;
  a.total_q = int(p.total_q);
  a.max_seqlen_q = int(in.max_seqlen_q);
  a.softmax_scale = p.softmax_scale;
  a.causal = in.causal;
  a.window_left = in.window_left;
  a.window_right = in.window_right;
  a.stream = in.stream;
  if (a.total_k_rows == 0) {
    // No key at all: every tile is empty (zeros, lse = -inf) and no K/V load is issued, but the TMA descriptors
    // still need a valid non-empty domain: describe q's memory instead.
    a.k = a.v = a.q;
    a.k_row_stride = a.v_row_stride = a.q_row_stride;
    a.k_head_stride = a.v_head_stride = a.q_head_stride;
    a.total_k_rows = 1;
  }
  return a;
}

void run(const FwdArgs& a, const Problem& p, const SparseFwdArgs* sparse) {
  const bool bf16 = p.dtype == DType::kBFloat16;
  if (p.head_dim == 64)
    bf16 ? run_fwd_bf16_hdim64(a, sparse) : run_fwd_fp16_hdim64(a, sparse);
  else
    bf16 ? run_fwd_bf16_hdim128(a, sparse) : run_fwd_fp16_hdim128(a, sparse);
}


void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e));
}

void check_sparse_supported(const AttentionInputs& in, const Problem& p, int block_size) {
  if (p.head_dim != 128)
    throw NotImplementedError("CUDA sparse attention is built for head dim 128 only, got " + std::to_string(p.head_dim));
  if (gathered_pages(p))
    throw NotImplementedError("CUDA sparse attention: paged KV needs page_size % 64 == 0 (TMA loads); got page_size " +
                              std::to_string(p.page_size));
  if (!in.causal || in.window_left >= 0 || in.window_right >= 0)
    throw NotImplementedError("CUDA sparse attention supports causal attention without an attention window only");
  if (block_size % 128 != 0)
    throw NotImplementedError("CUDA sparse attention needs block_size % 128 == 0 (one listed block = whole 128-key "
                              "kernel steps); got block_size " + std::to_string(block_size));
}

// Device memory from the stream-ordered allocator, returned on scope exit (also when a launch throws): no host
// synchronisation, and capturable in a CUDA graph.
struct StreamBuffer {
  void* ptr = nullptr;
  cudaStream_t stream;
  StreamBuffer(size_t bytes, cudaStream_t s) : stream(s) {
    check_cuda(cudaMallocAsync(&ptr, bytes ? bytes : 1, stream), "cudaMallocAsync");
  }
  ~StreamBuffer() { cudaFreeAsync(ptr, stream); }
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
};

const int32_t* int_ptr(const TensorView& t, const char* name) {
  if (t.ndim != 1 || (t.shape[0] > 1 && t.stride[0] != 1))
    throw NotImplementedError(std::string("CUDA sparse attention: ") + name + " must be contiguous");
  return t.ptr<const int32_t>();
}

// Runs the sparse kernel between the split plan and the combine of its float32 partials (split_kv.cu), when the
// launch is planned (split_planned) and its workspace has the split arrays.
void run_sparse(const AttentionInputs& in, const FwdArgs& a, const Problem& p, SparseFwdArgs s) {
  s.launch.plan = split_planned(in.max_seqlen_q, in.max_seqlen_k) && s.launch.max_split_units > 0;
  run_split_plan(a, s);
  run(a, p, &s);
  run_split_combine(a, s, p.dtype == DType::kBFloat16);
}

// The kernel's view of an index built on the GPU.
SparseFwdArgs sparse_args_of(const DeviceIndex& index) {
  SparseFwdArgs s;
  s.segment_start = index.segment_start;
  s.segment_end = index.segment_end;
  s.block_ids = index.block_ids;
  s.cu_tiles = index.cu_tiles;
  s.cu_blocks = index.cu_blocks;
  s.k_mean = index.k_mean_lowp;
  s.v_mean = index.v_mean_lowp;
  s.mean_rows = index.max_blocks;
  s.launch = index.launch;
  s.block_size = index.block_size;
  s.correction = index.correction;
  s.head_subgroups = index.head_subgroups;
  return s;
}

}  // namespace

// Only chunk shapes (fewer queries than keys) are planned: there a few tiles (the final chunk's dense last_n tiles)
// can each outweigh an SM's share of the work. In one-shot prefill (Lq = Lk) the heaviest tile is far below that
// share (128K: 1032 steps against ~3500 per SM) and the heaviest-first order balances the SMs; the plan and combine
// launches would only add ~20 us (8K: 0.548 -> 0.567 ms, bench/NOTES_sparse.md). The plan needs the persistent
// kernel's scheduler.
bool split_planned(int64_t max_seqlen_q, int64_t max_seqlen_k) {
  static const bool enabled = [] {  // SP_SPARSE_SPLIT=0: never split (A/B runs of the split plan)
    const char* e = std::getenv("SP_SPARSE_SPLIT");
    return e == nullptr || e[0] != '0';
  }();
  return enabled && sparse_persistent() && max_seqlen_k > max_seqlen_q;
}

bool sparse_persistent() {
  static const bool on = [] {
    const char* e = std::getenv("SP_SPARSE_PERSISTENT");
    return e == nullptr || e[0] != '0';
  }();
  return on;
}

int num_sms() {
  static int cache[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 132;
  if (cache[dev] == 0) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    cache[dev] = n > 0 ? n : 132;
  }
  return cache[dev];
}

bool dense_uses_full_list(const AttentionInputs& in, const Problem& p) {
  const char* env = std::getenv("SP_DENSE_SPLIT");  // "0": always the dense kernel (A/B runs; read per call)
  if ((env != nullptr && env[0] == '0') || p.head_dim != 128) return false;  // the sparse kernel is built for head dim 128
  if (in.window_left >= 0 || (!in.causal && in.window_right >= 0)) return false;
  if (!split_planned(in.max_seqlen_q, in.max_seqlen_k)) return false;  // only chunk and decode shapes
  if (gathered_pages(p)) return false;  // the sparse kernel loads K/V by TMA only
  const int64_t m_blocks = (in.max_seqlen_q + 127) / 128;
  // Measured (H200, Llama heads, bench/NOTES.md): Lq = 128 against 128K (32 dense tiles) 1.78x faster than the dense
  // kernel, Lq = 512 (128 tiles, one wave already) 0.85x: split only below half a wave.
  return in.max_seqlen_q < 128 || 2 * int64_t(p.num_q_heads) * m_blocks * p.batch <= num_sms();
}

int64_t attention_workspace_bytes(int head_dim) {
  return int64_t(sparse_launch_workspace_bytes(num_sms(), head_dim, true));
}

void attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p) {
  const FwdArgs a = make_fwd_args(in, outs, p);
  const size_t need = size_t(attention_workspace_bytes(p.head_dim));
  void* ws = nullptr;
  if (outs.workspace) {  // checked even when this call takes the dense kernel: a bad buffer fails on every shape
    const TensorView& w = *outs.workspace;
    const int64_t have = w.numel() * dtype_bytes(w.dtype);
    if (have < int64_t(need))
      throw ArgumentError("workspace", "needs at least attention_workspace_bytes(" + std::to_string(p.head_dim) +
                                           ") = " + std::to_string(need) + " bytes, got " + std::to_string(have));
    if ((reinterpret_cast<uintptr_t>(w.data) & 255) != 0)
      throw ArgumentError("workspace", "must be 256-byte aligned");
    ws = w.data;
  }
  if (!dense_uses_full_list(in, p)) return run(a, p, nullptr);
  // Short queries against long keys: the sparse kernel's PackGQA tiles over the full block list, split-KV planned
  // on the device, float32 partials in the caller's workspace or a stream-ordered temporary.
  cudaStream_t stream = static_cast<cudaStream_t>(in.stream);
  std::optional<StreamBuffer> tmp;
  if (ws == nullptr) ws = tmp.emplace(need, stream).ptr;
  SparseFwdArgs s;
  s.full_list = true;
  s.block_size = 128;
  s.correction = false;
  s.launch = carve_sparse_launch_workspace(ws, num_sms(), p.head_dim, true);
  run_sparse(in, a, p, s);
}

void sparse_attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p,
                      const DeviceIndex& index) {
  check_sparse_supported(in, p, index.block_size);
  run_sparse(in, make_fwd_args(in, outs, p), p, sparse_args_of(index));
}

void sparse_attention(const AttentionInputs& in, const BlockIndexView& index, const AttentionOutputs& outs,
                      const Problem& p) {
  check_sparse_supported(in, p, index.block_size);
  const FwdArgs a = make_fwd_args(in, outs, p);
  cudaStream_t stream = static_cast<cudaStream_t>(in.stream);
  const int64_t rows = index.correction ? index.k_mean.shape[0] : 0;
  const size_t tiles_bytes = size_t(p.batch + 1) * 4, tiles_pad = (tiles_bytes + 255) & ~size_t(255);
  const size_t mean_bytes = size_t(rows) * p.num_kv_heads * p.head_dim * 2, mean_pad = (mean_bytes + 255) & ~size_t(255);
  const bool split = split_planned(in.max_seqlen_q, in.max_seqlen_k);
  const size_t launch_bytes = sparse_launch_workspace_bytes(num_sms(), p.head_dim, split);
  StreamBuffer tmp(tiles_pad + 2 * mean_pad + launch_bytes, stream);
  char* base = static_cast<char*>(tmp.ptr);
  int32_t* cu_tiles = reinterpret_cast<int32_t*>(base);
  prepare_index_view(in, p, index, cu_tiles, base + tiles_pad, base + tiles_pad + mean_pad);
  SparseFwdArgs s;
  s.segment_start = int_ptr(index.segment_start, "index.segment_start");
  s.segment_end = int_ptr(index.segment_end, "index.segment_end");
  s.block_ids = int_ptr(index.block_ids, "index.block_ids");
  s.cu_tiles = cu_tiles;
  s.cu_blocks = int_ptr(index.cu_blocks, "index.cu_blocks");
  s.k_mean = base + tiles_pad;
  s.v_mean = base + tiles_pad + mean_pad;
  s.mean_rows = rows;
  s.launch = carve_sparse_launch_workspace(base + tiles_pad + 2 * mean_pad, num_sms(), p.head_dim, split);
  s.block_size = index.block_size;
  s.correction = index.correction && rows > 0;
  s.head_subgroups = index.head_subgroups;
  run_sparse(in, a, p, s);
}

void sparse_prefill(const AttentionInputs& in, const SelectionParams& params, const AttentionOutputs& outs,
                    const Problem& p, const MeanCache* cache) {
  check_sparse_supported(in, p, params.block_size);
  const FwdArgs a = make_fwd_args(in, outs, p);  // also the kernel's checks, before the index stage launches
  cudaStream_t stream = static_cast<cudaStream_t>(in.stream);
  const size_t bytes = index_workspace_bytes(in, p, params);
  StreamBuffer ws(bytes, stream);
  run_sparse(in, a, p, sparse_args_of(build_index(in, p, params, ws.ptr, bytes, cache)));
}

}  // namespace sparse_prefill::cuda
