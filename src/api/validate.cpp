#include "api/validate.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/selection_fields.h"

namespace sparse_prefill {

namespace {

bool is_rule(SelectionRule r) {
  return r == SelectionRule::kTileEnergy || r == SelectionRule::kRowMax || r == SelectionRule::kProbeRowMax ||
         r == SelectionRule::kProbeRowMass || r == SelectionRule::kKeyMax || r == SelectionRule::kExactMax;
}

// One field's check (core/selection_fields.h); `value` as the field's own type.
template <class T>
void check_field(const char* name, T value, FieldCheck check) {
  switch (check) {
    case FieldCheck::kNone:
      return;
    case FieldCheck::kUnitInterval:
      if (!(value >= 0 && value <= 1)) throw ArgumentError(name, "must lie in [0, 1], got " + std::to_string(value));
      return;
    case FieldCheck::kOpenUnitInterval:
      if (!(value > 0 && value <= 1)) throw ArgumentError(name, "must lie in (0, 1], got " + std::to_string(value));
      return;
    case FieldCheck::kPositiveMultipleOf64:
      if (value <= 0 || int64_t(value) % 64 != 0)
        throw ArgumentError(name, "must be a positive multiple of 64, got " + std::to_string(value));
      return;
    case FieldCheck::kNonNegative:
      if (value < 0) throw ArgumentError(name, "must be >= 0");
      return;
    case FieldCheck::kRank:
      // checked for every rule (a field of the selection like mean_alpha), used by kKeyMax only: the ranks its
      // kernels are built for (docs/design/key_max_spec.md)
      if (value != 16 && value != 32) throw ArgumentError(name, "must be 16 or 32, got " + std::to_string(value));
      return;
    case FieldCheck::kSubgroups:
      if (value < 0)
        throw ArgumentError(name, "must be 0 (one selection per query head) or >= 1, got " + std::to_string(value));
      return;
    case FieldCheck::kBudget:
      if (value < -1 || value > INT32_MAX)  // int32 ids and segment offsets
        throw ArgumentError(name, "must be -1 (the causal bound) or a budget in [0, 2^31 - 1], got " +
                                      std::to_string(value));
      return;
    case FieldCheck::kRule:
      return;  // an enum: check_field(SelectionRule) below
  }
}

void check_field(const char* name, SelectionRule rule, FieldCheck) {
  if (!is_rule(rule)) {
    throw ArgumentError(name, "must be SelectionRule::kTileEnergy (0), kRowMax (1), kProbeRowMax (2), "
                              "kProbeRowMass (3), kKeyMax (4) or kExactMax (5), got " + std::to_string(int(rule)));
  }
}

}  // namespace

void check_selection_params(const SelectionParams& params) {
  for_each_selection_field([&](const char* name, auto member, FieldCheck check) {
    // the flags (kNone) take any value; their type has no range to compare
    using T = std::decay_t<decltype(params.*member)>;
    if constexpr (!std::is_same_v<T, bool>) check_field(name, params.*member, check);
  });
}


void check_head_subgroups(int subgroups, int group_size, const char* name) {
  if (subgroups < 1) throw ArgumentError(name, "must be >= 1, got " + std::to_string(subgroups));
  if (group_size % subgroups != 0) {
    throw ArgumentError(name, "must divide the GQA group size g = Hq / Hkv = " + std::to_string(group_size) +
                                  ", got " + std::to_string(subgroups));
  }
}

namespace {

bool is_float_input(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16 || d == DType::kFloat8E4M3;
}

// 1-D int32 index tensor of `n` elements on the device of q.
void check_index_vector(const TensorView& t, int64_t n, const TensorView& q, const char* name) {
  check_rank(t, 1, name);
  check_dtype(t, DType::kInt32, name);
  check_same_device(t, q, name, "q");
  if (t.shape[0] != n) {
    throw ArgumentError(name, "expected " + std::to_string(n) + " elements, got " + std::to_string(t.shape[0]));
  }
}


// cu_seqlens: starts at 0, monotone, ends at `total`; every length <= max_len. Returns the lengths via starts.
void check_cu_seqlens(const TensorView& cu, int64_t total, int64_t max_len, const char* name, const char* max_name,
                      std::vector<int64_t>& starts, std::vector<int64_t>& lens) {
  const int64_t batch = cu.shape[0] - 1;
  starts.resize(batch);
  lens.resize(batch);
  if (at1(cu, 0) != 0) throw ArgumentError(name, "must start at 0, got " + std::to_string(at1(cu, 0)));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t lo = at1(cu, b), hi = at1(cu, b + 1);
    if (hi < lo) {
      throw ArgumentError(name, "must be non-decreasing; entry " + std::to_string(b + 1) + " (" +
                                    std::to_string(hi) + ") < entry " + std::to_string(b) + " (" +
                                    std::to_string(lo) + ")");
    }
    if (hi - lo > max_len) {
      throw ArgumentError(max_name, "sequence " + std::to_string(b) + " has length " + std::to_string(hi - lo) +
                                        " > " + max_name + " = " + std::to_string(max_len));
    }
    starts[b] = lo;
    lens[b] = hi - lo;
  }
  if (at1(cu, batch) != total) {
    throw ArgumentError(name, "last entry (" + std::to_string(at1(cu, batch)) + ") must equal the number of rows (" +
                                  std::to_string(total) + ")");
  }
}

}  // namespace

void check_descale_values(const TensorView& d, const char* name) {
  const float* v = d.ptr<const float>();
  for (int64_t b = 0; b < d.shape[0]; ++b)
    for (int64_t h = 0; h < d.shape[1]; ++h)
      if (v[b * d.stride[0] + h * d.stride[1]] < 0.f)
        throw ArgumentError(name, std::string(name) + "[" + std::to_string(b) + ", " + std::to_string(h) +
                                      "] is negative; descales must be >= 0");
}

void check_head_dim(int64_t head_dim, const char* name) {
  std::string supported;
  for (const int d : kHeadDims) {
    if (head_dim == d) return;
    supported += (supported.empty() ? "" : ", ") + std::to_string(d);
  }
  throw ArgumentError(name, "unsupported head dim " + std::to_string(head_dim) + " (supported: " + supported + ")");
}

Problem validate_inputs(const AttentionInputs& in, const AttentionOutputs* outs) {
  Problem p;
  // options: enums from C++ callers may hold any int
  const int path = static_cast<int>(in.options.dense_path);
  if (path < 0 || path > static_cast<int>(LaunchOptions::DensePath::kSplitKV))
    throw ArgumentError("options.dense_path", "unknown kernel path " + std::to_string(path));
  // q
  check_rank(in.q, 3, "q");
  if (!is_float_input(in.q.dtype)) {
    throw ArgumentError("q", std::string("dtype must be float16, bfloat16, float32 or float8_e4m3fn, got ") +
                                 dtype_name(in.q.dtype), true);
  }
  check_last_dim_contiguous(in.q, "q");
  p.dtype = in.q.dtype;
  p.device = in.q.device;
  p.total_q = in.q.shape[0];
  p.num_q_heads = int(in.q.shape[1]);
  p.head_dim = int(in.q.shape[2]);
  if (p.num_q_heads <= 0) throw ArgumentError("q", "needs at least one head, got shape " + shape_string(in.q));
  check_head_dim(in.q.shape[2], "q");

  // k, v
  p.paged = in.block_table.has_value();
  const int kv_rank = p.paged ? 4 : 3;
  for (const auto& [t, name] : {std::pair{&in.k, "k"}, std::pair{&in.v, "v"}}) {
    if (t->ndim != kv_rank) {
      throw ArgumentError(name, std::string("expected ") +
                                    (p.paged ? "[num_pages, page_size, Hkv, D] (paged: block_table given)"
                                             : "[total_k, Hkv, D]") +
                                    ", got shape " + shape_string(*t));
    }
    check_rank(*t, kv_rank, name);
    if (t->dtype != in.q.dtype) {
      throw ArgumentError(name, std::string("dtype ") + dtype_name(t->dtype) + " does not match q's " +
                                    dtype_name(in.q.dtype) + " (q, k and v take one dtype; mixed FP8 operands are "
                                    "not supported)", true);
    }
    check_same_device(*t, in.q, name, "q");
    check_last_dim_contiguous(*t, name);
  }
  for (int d = 0; d < kv_rank; ++d) {
    if (in.v.shape[d] != in.k.shape[d]) {
      throw ArgumentError("v", "shape " + shape_string(in.v) + " must equal k's shape " + shape_string(in.k));
    }
  }
  p.num_kv_heads = int(in.k.shape[kv_rank - 2]);
  if (in.k.shape[kv_rank - 1] != p.head_dim) {
    throw ArgumentError("k", "head dim " + std::to_string(in.k.shape[kv_rank - 1]) + " does not match q's " +
                                 std::to_string(p.head_dim));
  }
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0) {
    throw ArgumentError("k", "the number of query heads (" + std::to_string(p.num_q_heads) +
                                 ") must be a multiple of the number of KV heads (" +
                                 std::to_string(p.num_kv_heads) + ")");
  }
  p.group_size = p.num_q_heads / p.num_kv_heads;
  if (p.paged) {
    p.num_pages = in.k.shape[0];
    p.page_size = in.k.shape[1];
    if (p.page_size < 1) throw ArgumentError("k", "page_size (dim 1) must be >= 1");
    p.total_k = p.num_pages * p.page_size;
  } else {
    p.total_k = in.k.shape[0];
  }

  // scalars
  if (in.max_seqlen_q < 0) throw ArgumentError("max_seqlen_q", "must be >= 0");
  if (in.max_seqlen_k < 0) throw ArgumentError("max_seqlen_k", "must be >= 0");
  if (in.window_left < -1 || in.window_right < -1) {
    throw ArgumentError("window", "entries must be >= -1 (-1 = unbounded), got (" + std::to_string(in.window_left) +
                                      ", " + std::to_string(in.window_right) + ")");
  }
  if (in.softmax_scale.has_value()) {
    const float s = *in.softmax_scale;
    if (!std::isfinite(s) || s <= 0.f) throw ArgumentError("softmax_scale", "must be finite and > 0");
    p.softmax_scale = s;
  } else {
    p.softmax_scale = float(1.0 / std::sqrt(double(p.head_dim)));
  }

  // sequence descriptors
  check_rank(in.cu_seqlens_q, 1, "cu_seqlens_q");
  if (in.cu_seqlens_q.shape[0] < 2) throw ArgumentError("cu_seqlens_q", "needs at least 2 entries (batch + 1)");
  p.batch = int(in.cu_seqlens_q.shape[0] - 1);
  check_index_vector(in.cu_seqlens_q, p.batch + 1, in.q, "cu_seqlens_q");
  if (p.paged) {
    if (in.cu_seqlens_k.has_value()) {
      throw ArgumentError("cu_seqlens_k", "must be None with paged KV (key lengths come from seqused_k)");
    }
    if (!in.seqused_k.has_value()) throw ArgumentError("seqused_k", "is required with paged KV (block_table given)");
    const TensorView& bt = *in.block_table;
    check_rank(bt, 2, "block_table");
    check_dtype(bt, DType::kInt32, "block_table");
    check_same_device(bt, in.q, "block_table", "q");
    if (bt.shape[0] != p.batch) {
      throw ArgumentError("block_table", "expected " + std::to_string(p.batch) + " rows (one per sequence), got " +
                                             std::to_string(bt.shape[0]));
    }
    p.max_pages = bt.shape[1];
    check_index_vector(*in.seqused_k, p.batch, in.q, "seqused_k");
  } else {
    if (in.seqused_k.has_value()) throw ArgumentError("seqused_k", "is only supported with paged KV");
    if (!in.cu_seqlens_k.has_value()) throw ArgumentError("cu_seqlens_k", "is required with contiguous KV");
    check_index_vector(*in.cu_seqlens_k, p.batch + 1, in.q, "cu_seqlens_k");
  }

  // FP8 descales, float32 [B, Hkv] of any strides
  p.out_dtype = p.dtype == DType::kFloat8E4M3 ? DType::kBFloat16 : p.dtype;
  for (const auto& [t, name] : {std::pair{&in.q_descale, "q_descale"}, std::pair{&in.k_descale, "k_descale"},
                                std::pair{&in.v_descale, "v_descale"}}) {
    if (!t->has_value()) continue;
    if (p.dtype != DType::kFloat8E4M3) {
      throw ArgumentError(name, std::string("applies to float8_e4m3fn inputs only; q is ") + dtype_name(p.dtype),
                          true);
    }
    check_rank(**t, 2, name);
    check_dtype(**t, DType::kFloat32, name);
    check_same_device(**t, in.q, name, "q");
    if ((*t)->shape[0] != p.batch || (*t)->shape[1] != p.num_kv_heads) {
      throw ArgumentError(name, "expected shape [" + std::to_string(p.batch) + ", " +
                                    std::to_string(p.num_kv_heads) + "] ([batch, KV heads]), got " +
                                    shape_string(**t));
    }
    // Host values are read here; device values are checked by the kernel (kErrDescale) and, in checked mode, on a
    // host copy before the launch (dispatch.cpp).
    if ((*t)->device == Device::kCPU) check_descale_values(**t, name);
  }

  // outputs
  if (outs) {
    const TensorView& o = outs->out;
    check_rank(o, 3, "out");
    if (o.shape[0] != in.q.shape[0] || o.shape[1] != in.q.shape[1] || o.shape[2] != in.q.shape[2]) {
      throw ArgumentError("out", "shape " + shape_string(o) + " must equal q's shape " + shape_string(in.q));
    }
    if (o.dtype != p.out_dtype) {
      throw ArgumentError("out", std::string("dtype ") + dtype_name(o.dtype) + " must be " +
                                     dtype_name(p.out_dtype) + (p.dtype == DType::kFloat8E4M3
                                                                    ? " for float8_e4m3fn inputs"
                                                                    : " (q's dtype)"), true);
    }
    check_same_device(o, in.q, "out", "q");
    check_last_dim_contiguous(o, "out");
    if (outs->lse.has_value()) {
      const TensorView& l = *outs->lse;
      check_rank(l, 2, "lse");
      check_dtype(l, DType::kFloat32, "lse");
      check_same_device(l, in.q, "lse", "q");
      if (l.shape[0] != p.num_q_heads || l.shape[1] != p.total_q) {
        throw ArgumentError("lse", "expected shape [" + std::to_string(p.num_q_heads) + ", " +
                                       std::to_string(p.total_q) + "], got " + shape_string(l));
      }
      check_last_dim_contiguous(l, "lse");
    }
    if (outs->workspace.has_value()) check_workspace(*outs->workspace, in.q, 0, "");
  }

  // Element checks need host-readable index tensors. The CUDA path never reads them on the host (no
  // synchronisation): its kernels check them on the device (device_checks.h), and checked mode
  // (LaunchOptions::checked) copies them here first (dispatch.cpp).
  if (p.device != Device::kCPU) return p;
  validate_values(in, in.cu_seqlens_q, in.cu_seqlens_k ? &*in.cu_seqlens_k : nullptr,
                  in.block_table ? &*in.block_table : nullptr, in.seqused_k ? &*in.seqused_k : nullptr, p);
  return p;
}

void validate_values(const AttentionInputs& in, const TensorView& cu_seqlens_q, const TensorView* cu_seqlens_k,
                     const TensorView* block_table, const TensorView* seqused_k, Problem& p) {
  std::vector<int64_t> q_starts, q_lens, k_starts, k_lens;
  check_cu_seqlens(cu_seqlens_q, p.total_q, in.max_seqlen_q, "cu_seqlens_q", "max_seqlen_q", q_starts, q_lens);
  if (p.paged) {
    const TensorView& bt = *block_table;
    k_lens.resize(p.batch);
    k_starts.assign(p.batch, 0);
    for (int b = 0; b < p.batch; ++b) {
      const int64_t used = at1(*seqused_k, b);
      if (used < 0) {
        throw ArgumentError("seqused_k", "seqused_k[" + std::to_string(b) + "] = " + std::to_string(used) +
                                             " is negative");
      }
      if (used > p.max_pages * p.page_size) {
        throw ArgumentError("seqused_k", "seqused_k[" + std::to_string(b) + "] = " + std::to_string(used) +
                                             " exceeds the " + std::to_string(p.max_pages * p.page_size) +
                                             " rows that block_table row " + std::to_string(b) + "'s pages hold (" +
                                             std::to_string(p.max_pages) + " pages of " +
                                             std::to_string(p.page_size) + " tokens)");
      }
      if (used > in.max_seqlen_k) {
        throw ArgumentError("max_seqlen_k", "sequence " + std::to_string(b) + " uses " + std::to_string(used) +
                                                " keys > max_seqlen_k = " + std::to_string(in.max_seqlen_k));
      }
      const int64_t pages = (used + p.page_size - 1) / p.page_size;
      for (int64_t i = 0; i < pages; ++i) {
        const int64_t page = bt.ptr<const int32_t>()[b * bt.stride[0] + i * bt.stride[1]];
        if (page < 0 || page >= p.num_pages) {
          throw ArgumentError("block_table", "page id " + std::to_string(page) + " at [" + std::to_string(b) + ", " +
                                                 std::to_string(i) + "] is out of range [0, " +
                                                 std::to_string(p.num_pages) + ")");
        }
      }
      k_lens[b] = used;
    }
  } else {
    check_cu_seqlens(*cu_seqlens_k, p.total_k, in.max_seqlen_k, "cu_seqlens_k", "max_seqlen_k", k_starts, k_lens);
  }
  p.seqs.resize(p.batch);
  for (int b = 0; b < p.batch; ++b) p.seqs[b] = {q_starts[b], q_lens[b], k_starts[b], k_lens[b]};
}

}  // namespace sparse_prefill
