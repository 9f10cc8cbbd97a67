// The contract every layer shares (core/contract.h): argument checks, the workspace check, the index binding.
#include "core/contract.h"

#include <cstdint>
#include <sstream>
#include <string>
#include <tuple>

namespace sparse_prefill {

std::string shape_string(const TensorView& t) {
  std::ostringstream s;
  s << "[";
  for (int i = 0; i < t.ndim; ++i) s << (i ? ", " : "") << t.shape[i];
  s << "]";
  return s.str();
}

void check_rank(const TensorView& t, int ndim, const char* name) {
  if (t.ndim != ndim) {
    throw ArgumentError(name, "expected a " + std::to_string(ndim) + "-dimensional array, got shape " +
                                  shape_string(t));
  }
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0) throw ArgumentError(name, "negative extent in shape " + shape_string(t));
  }
  if (t.data == nullptr && t.numel() > 0) throw ArgumentError(name, "null data pointer");
}

void check_dtype(const TensorView& t, DType dtype, const char* name) {
  if (t.dtype != dtype) {
    throw ArgumentError(name, std::string("expected dtype ") + dtype_name(dtype) + ", got " + dtype_name(t.dtype),
                        /*type_error=*/true);
  }
}

void check_last_dim_contiguous(const TensorView& t, const char* name) {
  if (t.ndim > 0 && t.numel() > 0 && t.shape[t.ndim - 1] > 1 && t.stride[t.ndim - 1] != 1) {
    throw ArgumentError(name, "the last dimension must be contiguous (stride 1), got stride " +
                                  std::to_string(t.stride[t.ndim - 1]));
  }
}

void check_same_device(const TensorView& t, const TensorView& ref, const char* name, const char* ref_name) {
  if (t.device != ref.device || (t.device == Device::kCUDA && t.device_id != ref.device_id)) {
    throw ArgumentError(name, std::string("must be on the same device as ") + ref_name, /*type_error=*/true);
  }
}

void check_workspace(const TensorView& w, const TensorView& q, int64_t need, const std::string& sized_by) {
  check_rank(w, 1, "workspace");
  check_same_device(w, q, "workspace", "q");
  if (w.shape[0] > 1 && w.stride[0] != 1) throw ArgumentError("workspace", "must be contiguous");
  const int64_t have = w.numel() * dtype_bytes(w.dtype);
  if (have < need) {
    throw ArgumentError("workspace", "needs at least " + sized_by + " = " + std::to_string(need) + " bytes, got " +
                                         std::to_string(have));
  }
  if (need > 0 && (reinterpret_cast<uintptr_t>(w.data) & 255) != 0)
    throw ArgumentError("workspace", "must be 256-byte aligned");
}

IndexBinding bind_index(const AttentionInputs& in, const Problem& p, const SelectionParams& params) {
  IndexBinding b;
  b.set = true;
  b.causal = in.causal;
  b.window_left = in.window_left;
  b.window_right = in.window_right;
  b.softmax_scale = p.softmax_scale;
  b.block_size = params.block_size;
  b.num_subgroups = resolve_head_subgroups(params.head_subgroups, p.group_size);  // the index's S
  b.dense_fraction = params.dense_fraction;
  b.union_lists = params.union_lists;
  b.v_means = params.correction;
  b.split_kv = in.options.split_kv;
  b.batch = p.batch;
  b.num_q_heads = p.num_q_heads;
  b.num_kv_heads = p.num_kv_heads;
  b.head_dim = p.head_dim;
  b.total_q = p.total_q;
  b.total_k = p.total_k;
  b.max_seqlen_q = in.max_seqlen_q;
  b.max_seqlen_k = in.max_seqlen_k;
  b.paged = p.paged;
  b.page_size = p.page_size;
  b.dtype = p.dtype;
  b.device = p.device;
  b.device_id = in.q.device_id;
  b.q = in.q.data;
  b.k = in.k.data;
  b.v = in.v.data;
  b.cu_seqlens_q = in.cu_seqlens_q.data;
  b.cu_seqlens_k = in.cu_seqlens_k ? in.cu_seqlens_k->data : nullptr;
  b.block_table = in.block_table ? in.block_table->data : nullptr;
  b.seqused_k = in.seqused_k ? in.seqused_k->data : nullptr;
  return b;
}

void check_binding(const IndexBinding& b, const AttentionInputs& in, const Problem& p, bool reuse_index) {
  if (!b.set) return;
  const std::string built = " the index was built for ";
  auto differs = [&](const char* name, const std::string& now, const std::string& then) {
    throw ArgumentError(name, "is " + now + " but" + built + then + " (build an index for this call)");
  };
  auto num = [](auto x) { return std::to_string(x); };
  if (b.causal != in.causal) differs("causal", in.causal ? "True" : "False", b.causal ? "True" : "False");
  if (b.window_left != in.window_left || b.window_right != in.window_right) {
    differs("window", "(" + num(in.window_left) + ", " + num(in.window_right) + ")",
            "(" + num(b.window_left) + ", " + num(b.window_right) + ")");
  }
  if (b.softmax_scale != p.softmax_scale) differs("softmax_scale", num(p.softmax_scale), num(b.softmax_scale));
  if (b.num_q_heads != p.num_q_heads || b.num_kv_heads != p.num_kv_heads || b.head_dim != p.head_dim) {
    differs("q", num(p.num_q_heads) + " query heads, " + num(p.num_kv_heads) + " KV heads and head dim " +
                     num(p.head_dim),
            num(b.num_q_heads) + ", " + num(b.num_kv_heads) + " and " + num(b.head_dim));
  }
  if (b.batch != p.batch) differs("cu_seqlens_q", num(p.batch) + " sequences", num(b.batch));
  if (b.total_q != p.total_q) differs("q", num(p.total_q) + " rows", num(b.total_q));
  if (b.paged != p.paged) differs("k", p.paged ? "a paged cache" : "contiguous", b.paged ? "a paged cache" : "contiguous KV");
  if (b.total_k != p.total_k || b.page_size != p.page_size) {
    differs("k", num(p.total_k) + " rows (page size " + num(p.page_size) + ")",
            num(b.total_k) + " (page size " + num(b.page_size) + ")");
  }
  if (b.max_seqlen_q != in.max_seqlen_q) differs("max_seqlen_q", num(in.max_seqlen_q), num(b.max_seqlen_q));
  if (b.max_seqlen_k != in.max_seqlen_k) differs("max_seqlen_k", num(in.max_seqlen_k), num(b.max_seqlen_k));
  if (reuse_index) return;  // the data: where it lives, its dtype, the arrays themselves
  if (b.device != p.device || b.device_id != in.q.device_id) {
    throw ArgumentError("q", "is on another device than the arrays the index was built from (pass reuse_index=True "
                             "to apply this selection there)", true);
  }
  if (b.dtype != p.dtype) differs("q", dtype_name(p.dtype), dtype_name(b.dtype));
  const void* cu_k = in.cu_seqlens_k ? in.cu_seqlens_k->data : nullptr;
  const void* bt = in.block_table ? in.block_table->data : nullptr;
  const void* used = in.seqused_k ? in.seqused_k->data : nullptr;
  using Pair = std::tuple<const void*, const void*, const char*>;
  for (const auto& [now, then, name] :
       {Pair{in.q.data, b.q, "q"}, Pair{in.k.data, b.k, "k"}, Pair{in.v.data, b.v, "v"},
        Pair{in.cu_seqlens_q.data, b.cu_seqlens_q, "cu_seqlens_q"}, Pair{cu_k, b.cu_seqlens_k, "cu_seqlens_k"},
        Pair{bt, b.block_table, "block_table"}, Pair{used, b.seqused_k, "seqused_k"}}) {
    if (now != then) {
      throw ArgumentError(name, std::string("is not the array the index was built from (pass reuse_index=True to "
                                            "apply this selection to other data of the same problem)"));
    }
  }
}

}  // namespace sparse_prefill
