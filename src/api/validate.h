// Argument checks shared by every entry point. Each throws ArgumentError naming the argument.
#pragma once

#include <string>

#include "api/problem.h"
#include "core/geometry.h"
#include "sparse_prefill/sparse.h"

namespace sparse_prefill {

std::string shape_string(const TensorView& t);
void check_rank(const TensorView& t, int ndim, const char* name);
void check_dtype(const TensorView& t, DType dtype, const char* name);
void check_last_dim_contiguous(const TensorView& t, const char* name);
void check_same_device(const TensorView& t, const TensorView& ref, const char* name, const char* ref_name);
void check_selection_params(const SelectionParams& params);
// The head dims every backend is built for (64, 128); `name` is the argument that carries it (q, head_dim).
void check_head_dim(int64_t head_dim, const char* name);
// FP8 descales ([B, Hkv] float32, host memory): every value >= 0 (the kernels' running max assumes a non-negative
// logit scale, as softmax_scale > 0 does); NaN and inf propagate.
void check_descale_values(const TensorView& host_descale, const char* name);
// Head sub-groups (SelectionParams::head_subgroups, BlockIndex::head_subgroups): S >= 1 dividing the GQA group size
// g = Hq / Hkv. `name` is the argument reported ("head_subgroups" or "index.head_subgroups").
void check_head_subgroups(int subgroups, int group_size, const char* name);
// SelectionParams::head_subgroups as the index uses it: 0 (one selection per query head) is the group size g.
int resolve_head_subgroups(int subgroups, int group_size);

// Number of selection tiles of a sequence with `q_len` queries and group size g; key blocks of k_len keys
// (core/geometry.h).
inline int64_t num_tiles(int64_t q_len, int group_size) { return geometry::num_tiles(q_len, group_size); }
inline int64_t num_blocks(int64_t k_len, int block_size) { return geometry::num_blocks(k_len, block_size); }
static_assert(geometry::kTileRows == kTileRows, "one tile height (sparse.h, core/geometry.h)");

// An array not given (a default TensorView: BlockIndexView::v_mean of an index without the correction).
inline bool is_absent(const TensorView& t) { return t.data == nullptr && t.ndim == 0; }

// Element i of a host int32 vector (already checked by the caller).
inline int32_t at1(const TensorView& t, int64_t i) { return t.ptr<const int32_t>()[i * t.stride[0]]; }

// validate_index.cpp: the index, its binding to a call and the mean cache.
// Checks an index view against a resolved (host-readable) problem: head sub-groups, segment count, ranges, ascending
// block ids within each sequence's block count, pooled-mean shapes (segments and means over Hkv * S virtual heads).
void validate_index(const Problem& p, const BlockIndexView& index);

// A caller workspace: 1-D, contiguous, on q's device, at least `need` bytes (`sized_by` names the size function for
// the message) and, when need > 0, 256-byte aligned.
void check_workspace(const TensorView& w, const TensorView& q, int64_t need, const std::string& sized_by);

// What an index built from `in` with `params` is bound to (IndexBinding, sparse.h).
IndexBinding bind_index(const AttentionInputs& in, const Problem& p, const SelectionParams& params);
// Throws ArgumentError naming the first argument of the call that differs from what the index was built for (the
// data addresses only when !reuse_index). An unset binding passes.
void check_binding(const IndexBinding& b, const AttentionInputs& in, const Problem& p, bool reuse_index);

// Checks a pooled-means cache against a resolved problem (paged KV, float32 [slots, Hkv, D] contiguous on q's
// device, page size and block size dividing one another).
void validate_mean_cache(const AttentionInputs& in, const Problem& p, int block_size, const MeanCache& cache);

}  // namespace sparse_prefill
