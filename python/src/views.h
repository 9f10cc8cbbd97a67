// The DLPack <-> sparse_prefill::TensorView conversions of the _C module (module.cpp) and the tuples that carry a
// call's arguments from Python (sparse_prefill/_call.py, _index.py): shared by the bind_*.cpp files.
//
// The attention inputs travel as one tuple, in this order (see _call.py `_Call.inputs`):
//   (q, k, v, cu_seqlens_q, cu_seqlens_k | None, block_table | None, seqused_k | None,
//    max_seqlen_q, max_seqlen_k, causal, softmax_scale | None, window_left, window_right, stream, dense_path,
//    split_kv, checked, sparse_order, q_descale | None, k_descale | None, v_descale | None)
//   (dense_path, sparse_order: LaunchOptions::DensePath / SparseOrder as int; the descales: FP8 inputs only)
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "sparse_prefill/attention.h"
#include "sparse_prefill/sparse.h"
#include "sparse_prefill/tensor.h"

namespace nb = nanobind;
namespace sp = sparse_prefill;

namespace sparse_prefill::bindings {

using ROArray = nb::ndarray<nb::ro>;
using RWArray = nb::ndarray<>;

// Keeps the imported DLPack arrays alive while a call uses their memory.
struct Held {
  std::vector<ROArray> ro;
  std::vector<RWArray> rw;
};

std::string type_name_of(nb::handle obj);

// `obj` (any DLPack producer; None is refused) as a view, read-only or writable; `name` names the argument in errors.
sp::TensorView to_view(nb::handle obj, const char* name, Held& held);
sp::TensorView to_writable_view(nb::handle obj, const char* name, Held& held);
std::optional<sp::TensorView> to_opt_view(nb::handle obj, const char* name, Held& held);

// The memory of `obj` (a uint8 array for dtype "float8_e4m3fn", a uint16 array for "bfloat16"; any DLPack producer)
// as a DLPack array of that dtype: same data, shape, strides and device, keeping `obj` alive. The Python layer's
// qkv_dtype= (sparse_prefill/_call.py) reads bit patterns through it for array libraries without these dtypes.
nb::object bit_view(nb::handle obj, const std::string& dtype, bool writable, const char* name);

// The attention inputs tuple (order above) and the outputs (lse may be None).
sp::AttentionInputs make_inputs(nb::tuple t, Held& held);
sp::AttentionOutputs make_outputs(nb::handle out, nb::handle lse, Held& held);

// A numpy array that owns `v` (moved to the heap, freed by the capsule).
template <typename T>
nb::object numpy_owning(std::vector<T>&& v, std::initializer_list<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::cast(nb::ndarray<nb::numpy, T>(heap->data(), shape, owner));
}

// (alpha, block_size, sink, window, last_n, correction, final_chunk, union_lists, head_subgroups, rule,
// max_kept_blocks, mean_alpha), checked
// by _api._selection_args (rule: the int of sp::SelectionRule, range-checked by the library's validation).
sp::SelectionParams selection_params(nb::tuple t);

// A host BlockIndex as the dict sparse_prefill.Index is built from (its vectors moved into owning numpy arrays;
// v_mean None for an index without the correction).
nb::dict index_to_dict(sp::BlockIndex&& idx);

// Index arrays passed back in: (block_size, correction, head_subgroups, segment_start, segment_end, block_ids,
// cu_blocks, k_mean, v_mean | None, binding | None); v_mean None: absent (an index without the correction).
sp::BlockIndexView make_index_view(nb::tuple t, Held& held);

// The parts of the module, by role (bind_attention.cpp, bind_sparse.cpp, bind_workload.cpp), called by NB_MODULE.
void bind_attention(nb::module_& m);
void bind_sparse(nb::module_& m);
void bind_workload(nb::module_& m);

}  // namespace sparse_prefill::bindings
