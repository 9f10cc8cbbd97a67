// The DLPack <-> sparse_prefill::TensorView conversions of the _C module (module.cpp) and the named structures that
// carry a call's arguments from Python: shared by the bind_*.cpp files.
//
// What crosses the binding, each built once per call by keyword (sparse_prefill/_call.py, _index.py, torch_ops.py):
//   Inputs         sp::AttentionInputs: the arrays as views, the scalars, the stream, the LaunchOptions; it holds the
//                  imported arrays, so one Inputs serves several calls (a workspace size, then the build)
//   SelectionParams  sp::SelectionParams itself (defaults: SelectionParams{}); sparse_prefill.Selection owns one
//   IndexArrays    sp::BlockIndexView of a host index's arrays (on the host or copied to q's device)
//   HostIndex      sp::BlockIndex from a host index's arrays (union_index's input)
//   DeviceIndex    sp::DeviceBlockIndex: the workspace it lives in (held), its selection and binding, the stream
//                  of its build; returned by build_index_device, passed back whole
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
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

// One call's attention inputs, and the arrays their views point into.
struct Inputs {
  sp::AttentionInputs in;
  Held held;
};

// A host index's arrays as the library reads them (sparse_attention over a caller's index).
struct IndexArrays {
  sp::BlockIndexView view;
  Held held;
};

// A device index: the library's DeviceBlockIndex, the workspace array it lives in (kept alive as long as this
// object), the stream it was built on (to_host and the counts synchronise it).
struct DeviceIndex {
  sp::DeviceBlockIndex index;
  Held held;
  uintptr_t stream = 0;
};

sp::AttentionOutputs make_outputs(nb::handle out, nb::handle lse, Held& held);

// A numpy array that owns `v` (moved to the heap, freed by the capsule).
template <typename T>
nb::object numpy_owning(std::vector<T>&& v, std::initializer_list<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::cast(nb::ndarray<nb::numpy, T>(heap->data(), shape, owner));
}

// A host BlockIndex as the dict sparse_prefill.Index is built from (its vectors moved into owning numpy arrays;
// v_mean None for an index without the correction).
nb::dict index_to_dict(sp::BlockIndex&& idx);

// The parts of the module, by role (bind_attention.cpp, bind_sparse.cpp, bind_workload.cpp), called by NB_MODULE.
void bind_attention(nb::module_& m);
void bind_sparse(nb::module_& m);
void bind_workload(nb::module_& m);

}  // namespace sparse_prefill::bindings
