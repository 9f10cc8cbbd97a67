// A C ABI over sparse_prefill::cuda::attention for the GPU tests and benchmarks (loaded with ctypes from Python, so
// they run against torch without the nanobind package). Builds the TensorViews and the resolved Problem by hand:
// arguments are trusted (the tests pass valid ones); the library's validation is not part of this shim.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>

#include "cuda/cuda_backend.h"

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

extern "C" {

// dtype: 0 = bfloat16, 1 = float16. Contiguous KV when block_table == nullptr (k, v: [total_k, Hkv, D]), else paged
// (k, v: [num_pages, page_size, Hkv, D]). lse may be null. scale <= 0 selects 1/sqrt(D).
// Returns 0 on success, 1 on NotImplementedError, 2 on another error; the message goes to err.
int sp_cuda_attention(void* q, void* k, void* v, void* out, float* lse, const int* cu_q, const int* cu_k,
                      const int* block_table, const int* seqused_k, int dtype, int batch, int total_q, int total_k,
                      int num_pages, int page_size, int max_pages, int hq, int hkv, int d, int max_q, int max_k,
                      int causal, float scale, int window_left, int window_right, void* stream, char* err,
                      int err_len) {
  try {
    const DType dt = dtype == 0 ? DType::kBFloat16 : DType::kFloat16;
    AttentionInputs in;
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
    AttentionOutputs outs;
    outs.out = view(out, dt, {total_q, hq, d});
    if (lse) outs.lse = view(lse, DType::kFloat32, {hq, total_q});

    Problem p;
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
    cuda::attention(in, outs, p);
    return 0;
  } catch (const NotImplementedError& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 2;
  }
}
}
