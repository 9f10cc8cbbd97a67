// One call's inputs as the launches read them: pointers, strides, page table, descales and sequence arrays, packed
// once per call (launch_inputs) from the validated AttentionInputs and Problem. The attention kernel's FwdArgs holds
// it (FwdArgs::in, attention/fwd_args.h; make_fwd_args adds the outputs and the shape) and the index stage's SeqArgs /
// KVArgs / QArgs (index/device_args.cuh) are derived from it, so the two stages cannot read different strides, pages
// or descales. Plain C++ (no CUDA headers).
#pragma once

#include <cstdint>
#include <optional>

#include "core/problem.h"
#include "cuda/common/device_checks.h"
#include "sparse_prefill/attention.h"

namespace sparse_prefill::cuda {

// An FP8 descale, float32 [B, Hkv] (docs/semantics.md "FP8 inputs"): absent, null = 1; (batch, KV head) strides in
// elements, 0 on a size-1 axis (it broadcasts whatever its stride).
struct Descale {
  const float* ptr = nullptr;
  int64_t stride[2] = {0, 0};
};
inline Descale descale_of(const std::optional<TensorView>& t) {
  Descale d;
  if (!t) return d;
  d.ptr = t->ptr<const float>();
  d.stride[0] = t->shape[0] > 1 ? t->stride[0] : 0;
  d.stride[1] = t->shape[1] > 1 ? t->stride[1] : 0;
  return d;
}

struct LaunchInputs {
  // q [total_q, Hq, D]; k, v contiguous [total_k, Hkv, D] or paged [num_pages, page_size, Hkv, D]. Strides in
  // elements as given: q row, head; k / v contiguous row, head, dim, paged page, slot, head.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_stride[2] = {0, 0};
  int64_t k_stride[3] = {0, 0, 0}, v_stride[3] = {0, 0, 0};
  const int32_t* cu_seqlens_q = nullptr;  // [B+1]
  const int32_t* cu_seqlens_k = nullptr;  // [B+1], contiguous KV (else null)
  const int32_t* seqused_k = nullptr;     // [B], paged KV (else null)
  // Paged KV (else null / 0): block_table [B, max_pages] and its strides, the cache's pages.
  const int32_t* block_table = nullptr;
  int64_t block_table_stride[2] = {0, 0};
  int64_t page_size = 0, num_pages = 0;
  bool paged = false;
  Descale q_descale, k_descale, v_descale;  // FP8 only
  SeqLimits limits;                         // what a sequence's span may be (device_checks.h); limits.batch = B
  void* stream = nullptr;                   // cudaStream_t
};

inline LaunchInputs launch_inputs(const AttentionInputs& in, const Problem& p) {
  LaunchInputs l;
  l.q = in.q.data;
  l.k = in.k.data;
  l.v = in.v.data;
  l.q_stride[0] = in.q.stride[0];
  l.q_stride[1] = in.q.stride[1];
  for (int i = 0; i < 3; ++i) {
    l.k_stride[i] = in.k.stride[i];
    l.v_stride[i] = in.v.stride[i];
  }
  l.cu_seqlens_q = in.cu_seqlens_q.ptr<const int32_t>();
  l.paged = p.paged;
  if (p.paged) {
    l.seqused_k = in.seqused_k->ptr<const int32_t>();
    l.block_table = in.block_table->ptr<const int32_t>();
    l.block_table_stride[0] = in.block_table->stride[0];
    l.block_table_stride[1] = in.block_table->stride[1];
    l.page_size = p.page_size;
    l.num_pages = p.num_pages;
  } else {
    l.cu_seqlens_k = in.cu_seqlens_k->ptr<const int32_t>();
  }
  l.q_descale = descale_of(in.q_descale);
  l.k_descale = descale_of(in.k_descale);
  l.v_descale = descale_of(in.v_descale);
  l.limits = seq_limits(in, p);
  l.stream = in.stream;
  return l;
}

}  // namespace sparse_prefill::cuda
