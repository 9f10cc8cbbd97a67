// sparse_prefill._C: the nanobind layer between Python and the C++ API.
//
// This module is deliberately thin. It
//   * turns any DLPack array (numpy, torch, cupy, jax, ...) into a non-owning sparse_prefill::TensorView, holding a
//     reference to the producer's array for the duration of the call;
//   * releases the GIL around every compute call;
//   * translates the library's errors: ArgumentError -> ValueError / TypeError (by is_type_error(), with an
//     `argument` attribute naming the offending argument), NotImplementedError -> NotImplementedError;
//   * hands BlockIndex vectors back as numpy arrays that own their memory (no copy).
// Output allocation in the caller's array library, defaults and the user-facing signatures live in Python
// (sparse_prefill/_call.py, _dense.py, _index.py, _selection.py, _sparse.py, torch_ops.py). A call's arguments cross
// as named structures (views.h): Inputs, SelectionParams, IndexArrays / HostIndex / DeviceIndex; no positional tuple.
//
// The module by role:
//   views.{h,cpp}       DLPack <-> TensorView (Held, to_view, ...), the structures Inputs, IndexArrays, DeviceIndex,
//                       make_outputs and index_to_dict
//   bind_attention.cpp  LaunchOptions, Inputs, check_errors, attention, attention_workspace_bytes, attention_path
//   bind_sparse.cpp     IndexBinding, SelectionParams, IndexArrays, HostIndex, IndexStats,
//                       DeviceIndex, build_index (host and device), sparse_attention, sparse_prefill, the workspace
//                       sizes, mean_cache_slots, union_index, pool_kv
//   bind_workload.cpp   the synthetic workloads (workload_topic, workload_structured, workload_needles)
//   module.cpp          NB_MODULE: the error translation, with_cuda, tile_rows, the geometry submodule, bit_view,
//                       bind_*(m)
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <exception>
#include <vector>

#include "core/geometry.h"
#include "sparse_prefill/attention.h"
#include "sparse_prefill/tensor.h"
#include "views.h"

namespace {

void raise_argument_error(PyObject* type, const sp::ArgumentError& e) {
  PyObject* msg = PyUnicode_FromString(e.what());
  PyObject* exc = msg ? PyObject_CallOneArg(type, msg) : nullptr;
  Py_XDECREF(msg);
  if (!exc) return;  // a Python error is already set
  PyObject* arg = PyUnicode_FromString(e.argument().c_str());
  if (arg) {
    PyObject_SetAttrString(exc, "argument", arg);
    Py_DECREF(arg);
  }
  PyErr_SetObject(type, exc);
  Py_DECREF(exc);
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "Low-level bindings of the SparsePrefill C++ library; use the functions of `sparse_prefill` instead.";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const sp::ArgumentError& e) {
      raise_argument_error(e.is_type_error() ? PyExc_TypeError : PyExc_ValueError, e);
    } catch (const sp::NotImplementedError& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what());
    }
  });

#ifdef SPARSE_PREFILL_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.attr("tile_rows") = sp::kTileRows;
  {
    nb::list dims;
    for (const int d : sp::kHeadDims) dims.append(d);
    m.attr("HEAD_DIMS") = nb::tuple(dims);  // include/sparse_prefill/attention.h: the head dims every call takes
  }
  {  // include/sparse_prefill/attention.h: what the CUDA kernels are built for (sparse_prefill.CUDA_LIMITS)
    nb::list dtypes, sparse_dims;
    for (const sp::DType d : sp::CudaLimits::kDTypes) dtypes.append(sp::dtype_name(d));
    for (const int d : sp::CudaLimits::kSparseHeadDims) sparse_dims.append(d);
    nb::dict limits;
    limits["dtypes"] = nb::tuple(dtypes);
    limits["sparse_head_dims"] = nb::tuple(sparse_dims);
    limits["page_multiple"] = sp::CudaLimits::kPageMultiple;
    m.attr("CUDA_LIMITS") = limits;
  }
  // core/geometry.h, the one definition of the call's geometry (C++ layers, CUDA kernels, and Index here).
  nb::module_ geo = m.def_submodule("geometry", "tiles, PackGQA rows, virtual heads (core/geometry.h)");
  geo.attr("tile_rows") = sp::geometry::kTileRows;
  geo.def(
      "num_tiles",
      [](const std::vector<int64_t>& q_lens, int64_t group_size) {
        std::vector<int64_t> tiles(q_lens.size());
        for (size_t i = 0; i < q_lens.size(); ++i) tiles[i] = sp::geometry::num_tiles(q_lens[i], group_size);
        return tiles;
      },
      nb::arg("q_lens"), nb::arg("group_size"), "ceil(q_len * group_size / tile_rows) for each q_len");
  geo.def("num_blocks", &sp::geometry::num_blocks, nb::arg("k_len"), nb::arg("block_size"));
  geo.def("virtual_kv_heads", &sp::geometry::virtual_kv_heads, nb::arg("num_kv_heads"), nb::arg("subgroups"));
  geo.def("virtual_group_size", &sp::geometry::virtual_group_size, nb::arg("group_size"), nb::arg("subgroups"));
  geo.def("memory_kv_head", &sp::geometry::memory_kv_head, nb::arg("virtual_kv_head"), nb::arg("subgroups"));
  m.def(
      "bit_view",
      [](nb::handle obj, const std::string& dtype, bool writable, const std::string& name) {
        return sparse_prefill::bindings::bit_view(obj, dtype, writable, name.c_str());
      },
      nb::arg("array"), nb::arg("dtype"), nb::arg("writable"), nb::arg("name"),
      "uint8 bits as float8_e4m3fn or uint16 bits as bfloat16: a DLPack array of the same memory (qkv_dtype=)");
  sparse_prefill::bindings::bind_attention(m);
  sparse_prefill::bindings::bind_sparse(m);
  sparse_prefill::bindings::bind_workload(m);
}
