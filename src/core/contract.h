// The contract every backend shares with the API layer: the argument checks that more than one layer makes (a
// caller workspace, the index binding) and the small readers of validated arrays. Nothing here knows a backend.
// Each check throws ArgumentError naming the argument.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "core/geometry.h"
#include "core/problem.h"
#include "sparse_prefill/sparse.h"

namespace sparse_prefill {

std::string shape_string(const TensorView& t);
void check_rank(const TensorView& t, int ndim, const char* name);
void check_dtype(const TensorView& t, DType dtype, const char* name);
void check_last_dim_contiguous(const TensorView& t, const char* name);
void check_same_device(const TensorView& t, const TensorView& ref, const char* name, const char* ref_name);

// A caller workspace: 1-D, contiguous, on q's device, at least `need` bytes (`sized_by` names the size function for
// the message) and, when need > 0, 256-byte aligned.
void check_workspace(const TensorView& w, const TensorView& q, int64_t need, const std::string& sized_by);

// SelectionParams::head_subgroups is the request (0: one selection per query head); the index's S (IndexBinding,
// BlockIndex) is this, resolved where a binding is made (bind_index) and by the reference, which has none.
inline int resolve_head_subgroups(int requested, int group_size) { return requested == 0 ? group_size : requested; }

// What an index built from `in` with `params` is bound to (IndexBinding, sparse.h); its num_subgroups resolved.
IndexBinding bind_index(const AttentionInputs& in, const Problem& p, const SelectionParams& params);
// Throws ArgumentError naming the first argument of the call that differs from what the index was built for (the
// data addresses only when !reuse_index). An unset binding passes.
void check_binding(const IndexBinding& b, const AttentionInputs& in, const Problem& p, bool reuse_index);

// Number of selection tiles of a sequence with `q_len` queries and group size g; key blocks of k_len keys
// (core/geometry.h).
inline int64_t num_tiles(int64_t q_len, int group_size) { return geometry::num_tiles(q_len, group_size); }
inline int64_t num_blocks(int64_t k_len, int block_size) { return geometry::num_blocks(k_len, block_size); }

// An array not given (a default TensorView: BlockIndexView::v_mean of an index without the correction).
inline bool is_absent(const TensorView& t) { return t.data == nullptr && t.ndim == 0; }

// An invariant the API layer established before dispatch (a backend's support checks): failing it is a bug, not a
// caller error. `name` is the argument it concerns.
inline void internal_check(bool ok, const char* name, const char* what) {
  if (!ok) throw std::logic_error(std::string("sparse_prefill internal error: ") + name + ": " + what);
}

// Element i of a host int32 vector (already checked by the caller).
inline int32_t at1(const TensorView& t, int64_t i) { return t.ptr<const int32_t>()[i * t.stride[0]]; }

}  // namespace sparse_prefill
