// Dispatch of sparse_prefill::cuda::attention to the per-(dtype, head dim) forward kernels.
#include "cuda/cuda_backend.h"

#include <cstdint>
#include <string>

#include "cuda/fwd_args.h"

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

}  // namespace

void attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16)
    throw NotImplementedError("CUDA attention supports bfloat16 and float16 inputs only (got another dtype)");
  if (p.head_dim != 128) throw NotImplementedError("CUDA attention is built for head dim 128 only");
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
    // TMA path: one 128-row box per key block (page_size % 128 == 0) or two 64-row boxes, one per page
    // (page_size % 128 == 64). Smaller pages would need a cp.async producer.
    if (p.page_size <= 0 || p.page_size % 64 != 0)
      throw NotImplementedError("CUDA attention: paged KV needs page_size % 64 == 0 (TMA path); got page_size " +
                                std::to_string(p.page_size));
    for (const TensorView* t : {&in.k, &in.v}) {
      if (t->stride[0] != p.page_size * t->stride[1])
        throw NotImplementedError("CUDA attention: paged k/v pages must be dense along page_size");
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
  if (p.dtype == DType::kBFloat16)
    run_fwd_bf16_hdim128(a);
  else
    run_fwd_fp16_hdim128(a);
}

}  // namespace sparse_prefill::cuda
