// A C ABI over the CUDA backend (dense attention, index stage, sparse attention) for the GPU tests and benchmarks (loaded with ctypes from Python, so
// they run against torch without the nanobind package). Builds the TensorViews and the resolved Problem by hand:
// arguments are trusted (the tests pass valid ones); the library's validation is not part of this shim.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>

#include "cuda/cuda_backend.h"
#include "cuda/index_stage.h"

#include <cuda_runtime.h>

using namespace sparse_prefill;

namespace {
TensorView view(void* data, DType dt, std::initializer_list<int64_t> shape) {
  TensorView t;
  t.data = data;
  t.dtype = dt;
  t.device = Device::kCUDA;
  t.ndim = int(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t st = 1;
  for (int j = t.ndim - 1; j >= 0; --j) {
    t.stride[j] = st;
    st *= t.shape[j];
  }
  return t;
}
}  // namespace

// The arguments every entry point shares: the tensors and shapes of one attention call.
#define SP_CALL_PARAMS                                                                                              \
  void *q, void *k, void *v, void *out, float *lse, const int *cu_q, const int *cu_k, const int *block_table,        \
      const int *seqused_k, int dtype, int batch, int total_q, int total_k, int num_pages, int page_size,            \
      int max_pages, int hq, int hkv, int d, int max_q, int max_k, int causal, float scale, int window_left,         \
      int window_right, void *stream

namespace {
struct Call {
  AttentionInputs in;
  AttentionOutputs outs;
  Problem p;
};

Call make_call(SP_CALL_PARAMS) {
  Call c;
  const DType dt = dtype == 0 ? DType::kBFloat16 : DType::kFloat16;
  AttentionInputs& in = c.in;
  in.q = view(q, dt, {total_q, hq, d});
  const bool paged = block_table != nullptr;
  if (paged) {
    in.k = view(k, dt, {num_pages, page_size, hkv, d});
    in.v = view(v, dt, {num_pages, page_size, hkv, d});
    in.block_table = view(const_cast<int*>(block_table), DType::kInt32, {batch, max_pages});
    in.seqused_k = view(const_cast<int*>(seqused_k), DType::kInt32, {batch});
  } else {
    in.k = view(k, dt, {total_k, hkv, d});
    in.v = view(v, dt, {total_k, hkv, d});
    in.cu_seqlens_k = view(const_cast<int*>(cu_k), DType::kInt32, {batch + 1});
  }
  in.cu_seqlens_q = view(const_cast<int*>(cu_q), DType::kInt32, {batch + 1});
  in.max_seqlen_q = max_q;
  in.max_seqlen_k = max_k;
  in.causal = causal != 0;
  if (scale > 0) in.softmax_scale = scale;
  in.window_left = window_left;
  in.window_right = window_right;
  in.stream = stream;
  c.outs.out = view(out, dt, {total_q, hq, d});
  if (lse) c.outs.lse = view(lse, DType::kFloat32, {hq, total_q});

  Problem& p = c.p;
  p.batch = batch;
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = d;
  p.group_size = hq / hkv;
  p.total_q = total_q;
  p.paged = paged;
  p.page_size = paged ? page_size : 0;
  p.num_pages = paged ? num_pages : 0;
  p.max_pages = paged ? max_pages : 0;
  p.total_k = paged ? int64_t(num_pages) * page_size : total_k;
  p.softmax_scale = scale > 0 ? scale : 1.0f / std::sqrt(float(d));
  p.dtype = dt;
  p.device = Device::kCUDA;
  return c;
}

template <class F>
int guarded(char* err, int err_len, F&& f) {
  try {
    f();
    return 0;
  } catch (const NotImplementedError& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 2;
  }
}

SelectionParams selection(float alpha, int block_size, int sink, int window, int last_n, int correction,
                          int final_chunk = 1, int union_lists = 0, int head_subgroups = 1) {
  SelectionParams s;
  s.head_subgroups = head_subgroups;
  s.final_chunk = final_chunk != 0;
  s.union_lists = union_lists != 0;
  s.alpha = alpha;
  s.block_size = block_size;
  s.sink = sink;
  s.window = window;
  s.last_n = last_n;
  s.correction = correction != 0;
  return s;
}
}  // namespace

#define SP_CALL_ARGS                                                                                                \
  q, k, v, out, lse, cu_q, cu_k, block_table, seqused_k, dtype, batch, total_q, total_k, num_pages, page_size,      \
      max_pages, hq, hkv, d, max_q, max_k, causal, scale, window_left, window_right, stream

extern "C" {

// dtype: 0 = bfloat16, 1 = float16. Contiguous KV when block_table == nullptr (k, v: [total_k, Hkv, D]), else paged
// (k, v: [num_pages, page_size, Hkv, D]). lse may be null. scale <= 0 selects 1/sqrt(D).
// Every entry point returns 0 on success, 1 on NotImplementedError, 2 on another error; the message goes to err.
int sp_cuda_attention(SP_CALL_PARAMS, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    Call c = make_call(SP_CALL_ARGS);
    cuda::attention(c.in, c.outs, c.p);
  });
}

// Which path cuda::attention takes for these shapes: *full_list = 1 for the PackGQA + split-KV path.
int sp_cuda_dense_path(SP_CALL_PARAMS, int* full_list, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    Call c = make_call(SP_CALL_ARGS);
    *full_list = cuda::dense_uses_full_list(c.in, c.p) ? 1 : 0;
  });
}

// Workspace bytes of the GPU index stage for these shapes.
int sp_cuda_index_bytes(SP_CALL_PARAMS, int block_size, int head_subgroups, long long* bytes, char* err,
                        int err_len) {
  return guarded(err, err_len, [&] {
    Call c = make_call(SP_CALL_ARGS);
    *bytes = (long long)cuda::index_workspace_bytes(c.in, c.p,
                                                    selection(0.1f, block_size, 0, 0, 0, 1, 1, 0, head_subgroups));
  });
}

// Builds the index in `ws` on the stream. info[12] receives the device pointers and bounds of the index:
// segment_start, segment_end, block_ids, cu_tiles, cu_blocks, k_mean_lowp, v_mean_lowp, counters (pointers), then
// max_segments, capacity, max_blocks, block_size. mean_k / mean_v: a pooled-means cache (float32 [slots, Hkv, D],
// MeanCache in sparse.h) or null.
int sp_cuda_build_index(SP_CALL_PARAMS, float alpha, int block_size, int sink, int window, int last_n, int correction,
                        int final_chunk, int union_lists, int head_subgroups, void* ws, long long ws_bytes,
                        long long* info, void* mean_k, void* mean_v, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    Call c = make_call(SP_CALL_ARGS);
    MeanCache cache;
    cache.k_mean.data = mean_k;
    cache.v_mean.data = mean_v;
    const cuda::DeviceIndex d = cuda::build_index(
        c.in, c.p,
        selection(alpha, block_size, sink, window, last_n, correction, final_chunk, union_lists, head_subgroups), ws,
        size_t(ws_bytes), mean_k != nullptr ? &cache : nullptr);
    const void* ptrs[8] = {d.segment_start, d.segment_end, d.block_ids, d.cu_tiles, d.cu_blocks, d.k_mean_lowp,
                           d.v_mean_lowp, d.counters};
    for (int i = 0; i < 8; ++i) info[i] = (long long)reinterpret_cast<uintptr_t>(ptrs[i]);
    info[8] = d.max_segments;
    info[9] = d.capacity;
    info[10] = d.max_blocks;
    info[11] = d.block_size;
  });
}

// Sparse attention over a CSR index in device memory (built by sp_cuda_build_index or by the caller): the engine
// path of the library (cuda::sparse_attention with a DeviceIndex). k_mean / v_mean: [mean_rows, Hkv, D] in q's dtype.
int sp_cuda_sparse_attention(SP_CALL_PARAMS, const int* seg_start, const int* seg_end, const int* block_ids,
                             const int* cu_tiles, const int* cu_blocks, void* k_mean, void* v_mean,
                             long long mean_rows, int block_size, int correction, int head_subgroups, char* err,
                             int err_len) {
  return guarded(err, err_len, [&] {
    Call c = make_call(SP_CALL_ARGS);
    cuda::DeviceIndex d;
    d.block_size = block_size;
    d.correction = correction != 0;
    d.head_subgroups = head_subgroups;
    d.max_blocks = mean_rows;
    d.segment_start = const_cast<int32_t*>(seg_start);
    d.segment_end = const_cast<int32_t*>(seg_end);
    d.block_ids = const_cast<int32_t*>(block_ids);
    d.cu_tiles = const_cast<int32_t*>(cu_tiles);
    d.cu_blocks = const_cast<int32_t*>(cu_blocks);
    d.k_mean_lowp = k_mean;
    d.v_mean_lowp = v_mean;
    static void* launch_ws = [] {  // the kernel's scheduler and split workspace (test infrastructure: one per process)
      void* ptr = nullptr;
      cudaMalloc(&ptr, cuda::sparse_launch_workspace_bytes(cuda::num_sms(), 128, true));
      return ptr;
    }();
    d.launch = cuda::carve_sparse_launch_workspace(launch_ws, cuda::num_sms(), 128, true);
    cuda::sparse_attention(c.in, c.outs, c.p, d);
  });
}
}
