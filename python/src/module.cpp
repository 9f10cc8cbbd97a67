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
// (sparse_prefill/_api.py); every function here takes its arrays positionally.
//
// The attention inputs travel as one tuple, in this order (see _api.py `_Call.inputs`):
//   (q, k, v, cu_seqlens_q, cu_seqlens_k | None, block_table | None, seqused_k | None,
//    max_seqlen_q, max_seqlen_k, causal, softmax_scale | None, window_left, window_right, stream, dense_path,
//    split_kv, checked, q_descale | None, k_descale | None, v_descale | None)
//   (dense_path: LaunchOptions::DensePath as int; the descales: FP8 inputs only)
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "core/geometry.h"
#include "sparse_prefill/attention.h"
#include "sparse_prefill/sparse.h"
#include "sparse_prefill/tensor.h"
#include "sparse_prefill/workload.h"

namespace nb = nanobind;
namespace sp = sparse_prefill;

namespace {

using ROArray = nb::ndarray<nb::ro>;
using RWArray = nb::ndarray<>;

// Keeps the imported DLPack arrays alive while a call uses their memory.
struct Held {
  std::vector<ROArray> ro;
  std::vector<RWArray> rw;
};

std::string type_name_of(nb::handle obj) {
  return nb::borrow<nb::str>(nb::handle(obj.type()).attr("__name__")).c_str();
}

const char* dl_dtype_name(nb::dlpack::dtype dt, char* buf, size_t n) {
  using C = nb::dlpack::dtype_code;
  const char* base = "unknown";
  switch (static_cast<C>(dt.code)) {
    case C::Int: base = "int"; break;
    case C::UInt: base = "uint"; break;
    case C::Float: base = "float"; break;
    case C::Bfloat: base = "bfloat"; break;
    case C::Complex: base = "complex"; break;
    case C::Bool: return "bool";
    default: base = "float8/other"; break;
  }
  std::snprintf(buf, n, "%s%d", base, int(dt.bits));
  return buf;
}

template <typename Array>
sp::TensorView view_from(const Array& a, const char* name) {
  sp::TensorView t;
  using C = nb::dlpack::dtype_code;
  const nb::dlpack::dtype dt = a.dtype();
  const C code = static_cast<C>(dt.code);
  if (dt.lanes != 1) throw sp::ArgumentError(name, "vector dtypes (lanes != 1) are not supported", true);
  if (code == C::Float && dt.bits == 32) t.dtype = sp::DType::kFloat32;
  else if (code == C::Float && dt.bits == 16) t.dtype = sp::DType::kFloat16;
  else if (code == C::Bfloat && dt.bits == 16) t.dtype = sp::DType::kBFloat16;
  else if (code == C::Int && dt.bits == 32) t.dtype = sp::DType::kInt32;
  else if (code == C::UInt && dt.bits == 8) t.dtype = sp::DType::kUInt8;  // workspaces
  else if ((code == C::Float8_E4M3FN || code == C::Float8_E4M3) && dt.bits == 8) t.dtype = sp::DType::kFloat8E4M3;
  else {
    char buf[32];
    throw sp::ArgumentError(name,
                            std::string("unsupported dtype ") + dl_dtype_name(dt, buf, sizeof buf) +
                                " (supported: float32, float16, bfloat16, float8_e4m3fn, int32 for index arrays, uint8 for "
                                "workspaces)",
                            true);
  }
  switch (a.device_type()) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:  // pinned host memory is host memory
      t.device = sp::Device::kCPU;
      t.device_id = 0;
      break;
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      t.device = sp::Device::kCUDA;
      t.device_id = a.device_id();
      break;
    default:
      throw sp::ArgumentError(name, "unsupported device type " + std::to_string(a.device_type()) +
                                        " (only CPU and CUDA arrays are supported)", true);
  }
  if (a.ndim() > size_t(sp::TensorView::kMaxDims))
    throw sp::ArgumentError(name, "expected at most " + std::to_string(sp::TensorView::kMaxDims) +
                                      " dimensions, got " + std::to_string(a.ndim()));
  t.ndim = int(a.ndim());
  for (int i = 0; i < t.ndim; ++i) {
    t.shape[i] = int64_t(a.shape(size_t(i)));
    t.stride[i] = a.stride(size_t(i));
  }
  if (t.numel() == 0) {
    // Strides of an empty array are meaningless (producers may report 0): use row-major ones so that layout checks
    // (e.g. "last dimension contiguous") do not reject it.
    int64_t s = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
      t.stride[i] = s;
      s *= std::max<int64_t>(t.shape[i], 1);
    }
  }
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  return t;
}

sp::TensorView to_view(nb::handle obj, const char* name, Held& held) {
  ROArray a;
  if (obj.is_none() || !nb::try_cast(obj, a, false))
    throw sp::ArgumentError(name, "expected an array supporting DLPack (numpy, torch, cupy, jax), got " +
                                      type_name_of(obj), true);
  held.ro.push_back(a);
  return view_from(a, name);
}

sp::TensorView to_writable_view(nb::handle obj, const char* name, Held& held) {
  RWArray a;
  if (obj.is_none() || !nb::try_cast(obj, a, false))
    throw sp::ArgumentError(name, "expected a writable array supporting DLPack (numpy, torch, cupy), got " +
                                      type_name_of(obj), true);
  held.rw.push_back(a);
  return view_from(a, name);
}

std::optional<sp::TensorView> to_opt_view(nb::handle obj, const char* name, Held& held) {
  if (obj.is_none()) return std::nullopt;
  return to_view(obj, name, held);
}

sp::AttentionInputs make_inputs(nb::tuple t, Held& held) {
  // The last three: LaunchOptions (dense_path code, split_kv, checked), _api.LaunchOptions._codes().
  if (nb::len(t) != 20) throw nb::value_error("internal: attention inputs tuple must have 20 entries");
  sp::AttentionInputs in;
  in.q = to_view(t[0], "q", held);
  in.k = to_view(t[1], "k", held);
  in.v = to_view(t[2], "v", held);
  in.cu_seqlens_q = to_view(t[3], "cu_seqlens_q", held);
  in.cu_seqlens_k = to_opt_view(t[4], "cu_seqlens_k", held);
  in.block_table = to_opt_view(t[5], "block_table", held);
  in.seqused_k = to_opt_view(t[6], "seqused_k", held);
  in.max_seqlen_q = nb::cast<int64_t>(t[7]);
  in.max_seqlen_k = nb::cast<int64_t>(t[8]);
  in.causal = nb::cast<bool>(t[9]);
  if (!t[10].is_none()) in.softmax_scale = float(nb::cast<double>(t[10]));
  in.window_left = nb::cast<int>(t[11]);
  in.window_right = nb::cast<int>(t[12]);
  in.stream = reinterpret_cast<void*>(nb::cast<uintptr_t>(t[13]));
  const int path = nb::cast<int>(t[14]);
  if (path < 0 || path > 2) throw sp::ArgumentError("dense_path", "unknown kernel path");
  in.options.dense_path = static_cast<sp::LaunchOptions::DensePath>(path);
  in.options.split_kv = nb::cast<bool>(t[15]);
  in.options.checked = nb::cast<bool>(t[16]);
  in.q_descale = to_opt_view(t[17], "q_descale", held);
  in.k_descale = to_opt_view(t[18], "k_descale", held);
  in.v_descale = to_opt_view(t[19], "v_descale", held);
  return in;
}

sp::AttentionOutputs make_outputs(nb::handle out, nb::handle lse, Held& held) {
  sp::AttentionOutputs o;
  o.out = to_writable_view(out, "out", held);
  if (!lse.is_none()) o.lse = to_writable_view(lse, "lse", held);
  return o;
}

// A numpy array that owns `v` (moved to the heap, freed by the capsule).
template <typename T>
nb::object numpy_owning(std::vector<T>&& v, std::initializer_list<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::cast(nb::ndarray<nb::numpy, T>(heap->data(), shape, owner));
}

// (alpha, block_size, sink, window, last_n, correction, final_chunk, union_lists, head_subgroups, rule), checked
// by _api._selection_args (rule: the int of sp::SelectionRule, range-checked by the library's validation).
sp::SelectionParams selection_params(nb::tuple t) {
  if (nb::len(t) != 10) throw nb::value_error("internal: the selection tuple must have 10 entries");
  sp::SelectionParams p;
  p.alpha = nb::cast<float>(t[0]);
  p.block_size = nb::cast<int>(t[1]);
  p.sink = nb::cast<int>(t[2]);
  p.window = nb::cast<int>(t[3]);
  p.last_n = nb::cast<int>(t[4]);
  p.correction = nb::cast<bool>(t[5]);
  p.final_chunk = nb::cast<bool>(t[6]);
  p.union_lists = nb::cast<bool>(t[7]);
  p.head_subgroups = nb::cast<int>(t[8]);
  p.rule = static_cast<sp::SelectionRule>(nb::cast<int>(t[9]));
  return p;
}

nb::dict index_to_dict(sp::BlockIndex&& idx) {
  const int64_t head_dim = idx.head_dim;
  nb::dict d;
  d["binding"] = nb::cast(idx.binding);
  d["block_size"] = idx.block_size;
  d["group_size"] = idx.group_size;
  d["num_kv_heads"] = idx.num_kv_heads;
  d["head_subgroups"] = idx.head_subgroups;
  d["correction"] = idx.correction;
  d["head_dim"] = idx.head_dim;
  d["kept_blocks"] = idx.kept_blocks;
  d["visible_blocks"] = idx.visible_blocks;
  const size_t S = idx.segment_start.size(), E = idx.segment_end.size(), N = idx.block_ids.size(), C = idx.cu_blocks.size();
  const size_t total_blocks = C ? size_t(idx.cu_blocks.back()) : 0;
  const size_t hkv = size_t(idx.num_kv_heads);
  d["segment_start"] = numpy_owning(std::move(idx.segment_start), {S});
  d["segment_end"] = numpy_owning(std::move(idx.segment_end), {E});
  d["block_ids"] = numpy_owning(std::move(idx.block_ids), {N});
  d["cu_blocks"] = numpy_owning(std::move(idx.cu_blocks), {C});
  d["k_mean"] = numpy_owning(std::move(idx.k_mean), {total_blocks, hkv, size_t(head_dim)});
  d["v_mean"] = numpy_owning(std::move(idx.v_mean), {total_blocks, hkv, size_t(head_dim)});
  return d;
}

// Index arrays passed back in: (block_size, correction, head_subgroups, segment_start, segment_end, block_ids,
// cu_blocks, k_mean, v_mean, binding | None).
sp::BlockIndexView make_index_view(nb::tuple t, Held& held) {
  if (nb::len(t) != 10) throw nb::value_error("internal: index tuple must have 10 entries");
  sp::BlockIndexView v;
  if (!t[9].is_none()) v.binding = nb::cast<sp::IndexBinding>(t[9]);
  v.block_size = nb::cast<int>(t[0]);
  v.correction = nb::cast<bool>(t[1]);
  v.head_subgroups = nb::cast<int>(t[2]);
  v.segment_start = to_view(t[3], "index.segment_start", held);
  v.segment_end = to_view(t[4], "index.segment_end", held);
  v.block_ids = to_view(t[5], "index.block_ids", held);
  v.cu_blocks = to_view(t[6], "index.cu_blocks", held);
  v.k_mean = to_view(t[7], "index.k_mean", held);
  v.v_mean = to_view(t[8], "index.v_mean", held);
  return v;
}

template <typename T>
std::vector<T> host_vector(nb::handle obj, const char* name, sp::DType want) {
  Held held;
  sp::TensorView t = to_view(obj, name, held);
  if (t.device != sp::Device::kCPU) throw sp::ArgumentError(name, "expected a host array", true);
  if (t.dtype != want) throw sp::ArgumentError(name, std::string("expected ") + sp::dtype_name(want), true);
  const int64_t n = t.numel();
  if (n > 0) {
    int64_t expect = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
      if (t.shape[i] != 1 && t.stride[i] != expect) throw sp::ArgumentError(name, "expected a contiguous array");
      expect *= t.shape[i];
    }
  }
  std::vector<T> v(static_cast<size_t>(n));
  if (n) std::memcpy(v.data(), t.data, size_t(n) * sizeof(T));
  return v;
}

sp::workload::Shape workload_shape(int64_t seqlen, int num_q_heads, int num_kv_heads, int head_dim) {
  if (seqlen < 0) throw sp::ArgumentError("seqlen", "must be >= 0");
  if (num_q_heads <= 0) throw sp::ArgumentError("num_q_heads", "must be positive");
  if (num_kv_heads <= 0) throw sp::ArgumentError("num_kv_heads", "must be positive");
  if (num_q_heads % num_kv_heads) throw sp::ArgumentError("num_q_heads", "must be a multiple of num_kv_heads");
  if (head_dim <= 0 || head_dim % 2) throw sp::ArgumentError("head_dim", "must be positive and even");
  sp::workload::Shape shape;
  shape.seqlen = seqlen;
  shape.num_q_heads = num_q_heads;
  shape.num_kv_heads = num_kv_heads;
  shape.head_dim = head_dim;
  return shape;
}

// The float32 buffers of a generated workload ([L, Hq, D] and twice [L, Hkv, D]); a size that does not fit in
// memory raises an ArgumentError naming seqlen (MemoryError would not say which argument), before any allocation
// when the byte count overflows.
void allocate_workload(const sp::workload::Shape& shape, std::vector<float>& q, std::vector<float>& k,
                       std::vector<float>& v) {
  const double floats = double(shape.seqlen) * double(shape.num_q_heads + 2 * shape.num_kv_heads) * shape.head_dim;
  auto too_large = [&](const std::string& why) {
    return sp::ArgumentError("seqlen", std::to_string(shape.seqlen) + " tokens need " +
                                           std::to_string(floats * 4.0 / 1e9) + " GB of float32 q, k and v: " + why);
  };
  if (floats * 4.0 > double(SIZE_MAX) / 2) throw too_large("more than the address space");
  try {
    q.resize(size_t(shape.seqlen) * size_t(shape.num_q_heads) * size_t(shape.head_dim));
    k.resize(size_t(shape.seqlen) * size_t(shape.num_kv_heads) * size_t(shape.head_dim));
    v.resize(k.size());
  } catch (const std::bad_alloc&) {
    q = {}, k = {}, v = {};
    throw too_large("cannot allocate that much memory");
  } catch (const std::length_error&) {
    q = {}, k = {}, v = {};
    throw too_large("more than a vector holds");
  }
}

// The knobs of StructuredParams by name (the Python keyword arguments of sparse_prefill.workload.structured).
template <typename F>
void for_each_structured_knob(sp::workload::StructuredParams& p, F&& f) {
  f("rope_base", p.rope_base);
  f("noise_q", p.noise_q);
  f("noise_k", p.noise_k);
  f("recency_logit", p.recency_logit);
  f("recency_length", p.recency_length);
  f("recall_targets", p.recall_targets);
  f("recall_span", p.recall_span);
  f("recall_logit", p.recall_logit);
  f("sink_tokens", p.sink_tokens);
  f("sink_logit", p.sink_logit);
  f("stripe_every", p.stripe_every);
  f("stripe_tokens", p.stripe_tokens);
  f("stripe_logit", p.stripe_logit);
  f("needles", p.needles);
  f("needle_tokens", p.needle_tokens);
  f("needle_queries", p.needle_queries);
  f("needle_min_distance", p.needle_min_distance);
  f("needle_logit", p.needle_logit);
}

sp::workload::StructuredParams structured_params(nb::dict knobs) {
  sp::workload::StructuredParams p;
  size_t used = 0;
  for_each_structured_knob(p, [&](const char* name, auto& field) {
    if (!knobs.contains(name)) return;
    ++used;
    using T = std::remove_reference_t<decltype(field)>;
    nb::handle value = knobs[name];
    if (!nb::try_cast(value, field, std::is_floating_point_v<T>))
      throw sp::ArgumentError(name, std::string("expected ") + (std::is_floating_point_v<T> ? "a float" : "an int") +
                                        ", got " + type_name_of(value), true);
  });
  if (used != nb::len(knobs)) {
    for (auto [key, value] : knobs) {
      bool known = false;
      std::string k = nb::cast<std::string>(nb::str(key));
      for_each_structured_knob(p, [&](const char* name, auto&) { known |= (k == name); });
      if (!known) throw sp::ArgumentError(k, "unknown knob of the structured workload", true);
    }
  }
  return p;
}

nb::dict structured_defaults() {
  sp::workload::StructuredParams p;
  nb::dict d;
  for_each_structured_knob(p, [&](const char* name, auto& field) { d[name] = field; });
  return d;
}

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

  // The device error word (sparse_prefill/attention.h): synchronises `stream`, raises the first violation recorded
  // on the current device since the last call (ValueError / TypeError naming the argument) and clears it.
  m.def("check_errors",
        [](uintptr_t stream) {
          nb::gil_scoped_release release;
          sp::check_errors(reinterpret_cast<void*>(stream));
        },
        nb::arg("stream"));

#ifdef SPARSE_PREFILL_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.attr("tile_rows") = sp::kTileRows;
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

  m.def("attention",
        [](nb::tuple inputs, nb::handle out, nb::handle lse, nb::handle workspace) {
          Held held;
          sp::AttentionInputs in = make_inputs(inputs, held);
          sp::AttentionOutputs outs = make_outputs(out, lse, held);
          if (!workspace.is_none()) outs.workspace = to_writable_view(workspace, "workspace", held);
          nb::gil_scoped_release release;
          sp::attention(in, outs);
        },
        nb::arg("inputs"), nb::arg("out"), nb::arg("lse").none(), nb::arg("workspace").none() = nb::none());
  m.def("attention_workspace_bytes", &sp::attention_workspace_bytes, nb::arg("head_dim"));
  m.def("attention_path",
        [](nb::tuple inputs) {
          Held held;
          const sp::AttentionInputs in = make_inputs(inputs, held);
          return sp::attention_path(in) == sp::LaunchOptions::DensePath::kSplitKV ? "split_kv" : "dense";
        },
        nb::arg("inputs"));

  // What an index was built for (sparse.h); read-only, compared by sparse_attention.
  nb::class_<sp::IndexBinding>(m, "IndexBinding")
      .def_ro("causal", &sp::IndexBinding::causal)
      .def_ro("softmax_scale", &sp::IndexBinding::softmax_scale)
      .def_ro("block_size", &sp::IndexBinding::block_size)
      .def_ro("head_subgroups", &sp::IndexBinding::head_subgroups)
      .def_ro("union", &sp::IndexBinding::union_lists)
      .def_ro("batch", &sp::IndexBinding::batch)
      .def_ro("num_q_heads", &sp::IndexBinding::num_q_heads)
      .def_ro("num_kv_heads", &sp::IndexBinding::num_kv_heads)
      .def_ro("head_dim", &sp::IndexBinding::head_dim)
      .def_ro("total_q", &sp::IndexBinding::total_q)
      .def_ro("total_k", &sp::IndexBinding::total_k)
      .def_ro("max_seqlen_q", &sp::IndexBinding::max_seqlen_q)
      .def_ro("max_seqlen_k", &sp::IndexBinding::max_seqlen_k)
      .def_ro("paged", &sp::IndexBinding::paged)
      .def_ro("page_size", &sp::IndexBinding::page_size)
      .def_prop_ro("dtype", [](const sp::IndexBinding& b) { return std::string(sp::dtype_name(b.dtype)); })
      .def_prop_ro("device", [](const sp::IndexBinding& b) {
        return std::string(b.device == sp::Device::kCPU ? "cpu" : "cuda:" + std::to_string(b.device_id));
      })
      .def("__repr__", [](const sp::IndexBinding& b) {
        return "IndexBinding(causal=" + std::string(b.causal ? "True" : "False") + ", batch=" +
               std::to_string(b.batch) + ", heads=" + std::to_string(b.num_q_heads) + "/" +
               std::to_string(b.num_kv_heads) + ", head_dim=" + std::to_string(b.head_dim) + ", total_q=" +
               std::to_string(b.total_q) + ", total_k=" + std::to_string(b.total_k) + ", block_size=" +
               std::to_string(b.block_size) + ")";
      });

  // The device index (CUDA): built into a caller workspace, read in place (sparse.h).
  m.def("selection_defaults", [] {  // SelectionParams{}: the one source of the Python defaults
    sp::SelectionParams p;
    nb::dict d;
    d["alpha"] = p.alpha;
    d["rule"] = int(p.rule);
    d["block_size"] = p.block_size;
    d["sink"] = p.sink;
    d["window"] = p.window;
    d["last_n"] = p.last_n;
    d["correction"] = p.correction;
    d["head_subgroups"] = p.head_subgroups;
    return d;
  });
  m.def("index_workspace_bytes",
        [](nb::tuple inputs, nb::tuple selection) {
          Held held;
          const sp::AttentionInputs in = make_inputs(inputs, held);
          return sp::index_workspace_bytes(in, selection_params(selection));
        },
        nb::arg("inputs"), nb::arg("selection"));
  m.def("build_index_device",
        [](nb::tuple inputs, nb::tuple selection, nb::handle workspace, nb::handle mean_k, nb::handle mean_v,
           int mean_block_size) {
          Held held;
          const sp::AttentionInputs in = make_inputs(inputs, held);
          const sp::SelectionParams p = selection_params(selection);
          const sp::TensorView ws = to_writable_view(workspace, "workspace", held);
          if (mean_k.is_none() != mean_v.is_none())
            throw sp::ArgumentError("mean_cache", "pass both k_mean and v_mean, or neither");
          std::optional<sp::MeanCache> cache;
          if (!mean_k.is_none())
            cache = sp::MeanCache{to_writable_view(mean_k, "mean_cache.k_mean", held),
                                  to_writable_view(mean_v, "mean_cache.v_mean", held), mean_block_size};
          nb::gil_scoped_release release;
          return sp::build_index(in, p, ws, cache ? &*cache : nullptr).binding;
        },
        nb::arg("inputs"), nb::arg("selection"), nb::arg("workspace"), nb::arg("mean_k").none(),
        nb::arg("mean_v").none(), nb::arg("mean_block_size") = 0);
  m.def("sparse_attention_device",
        [](nb::tuple inputs, nb::handle workspace, nb::tuple selection, const sp::IndexBinding& binding,
           nb::handle out, nb::handle lse, bool reuse_index) {
          Held held;
          const sp::AttentionInputs in = make_inputs(inputs, held);
          const sp::DeviceBlockIndex index{to_writable_view(workspace, "index.workspace", held),
                                           selection_params(selection), binding};
          const sp::AttentionOutputs outs = make_outputs(out, lse, held);
          nb::gil_scoped_release release;
          sp::sparse_attention(in, index, outs, reuse_index);
        },
        nb::arg("inputs"), nb::arg("workspace"), nb::arg("selection"), nb::arg("binding"), nb::arg("out"),
        nb::arg("lse").none(), nb::arg("reuse_index"));
  m.def("device_index_counts",
        [](nb::handle workspace, nb::tuple selection, const sp::IndexBinding& binding, uintptr_t stream) {
          Held held;
          const sp::DeviceBlockIndex index{to_writable_view(workspace, "index.workspace", held),
                                           selection_params(selection), binding};
          nb::gil_scoped_release release;
          return sp::index_counts(index, reinterpret_cast<void*>(stream));
        },
        nb::arg("workspace"), nb::arg("selection"), nb::arg("binding"), nb::arg("stream"));
  m.def("device_index_to_host",
        [](nb::handle workspace, nb::tuple selection, const sp::IndexBinding& binding, uintptr_t stream) {
          Held held;
          const sp::DeviceBlockIndex index{to_writable_view(workspace, "index.workspace", held),
                                           selection_params(selection), binding};
          sp::BlockIndex idx;
          {
            nb::gil_scoped_release release;
            idx = sp::to_host(index, reinterpret_cast<void*>(stream));
          }
          return index_to_dict(std::move(idx));
        },
        nb::arg("workspace"), nb::arg("selection"), nb::arg("binding"), nb::arg("stream"));
  m.def("sparse_attention_workspace_bytes",
        [](nb::tuple inputs, nb::tuple index) {
          Held held;
          const sp::AttentionInputs in = make_inputs(inputs, held);
          return sp::sparse_attention_workspace_bytes(in, make_index_view(index, held));
        },
        nb::arg("inputs"), nb::arg("index"));
  m.def("sparse_prefill_workspace_bytes",
        [](nb::tuple inputs, nb::tuple selection) {
          Held held;
          const sp::AttentionInputs in = make_inputs(inputs, held);
          return sp::sparse_prefill_workspace_bytes(in, selection_params(selection));
        },
        nb::arg("inputs"), nb::arg("selection"));

  m.def("build_index",
        [](nb::tuple inputs, nb::tuple selection) {
          Held held;
          sp::AttentionInputs in = make_inputs(inputs, held);
          const sp::SelectionParams p = selection_params(selection);
          sp::BlockIndex idx;
          {
            nb::gil_scoped_release release;
            idx = sp::build_index(in, p);
          }
          return index_to_dict(std::move(idx));
        },
        nb::arg("inputs"), nb::arg("selection"));

  m.def("sparse_attention",
        [](nb::tuple inputs, nb::tuple index, nb::handle out, nb::handle lse, nb::handle workspace,
           bool reuse_index) {
          Held held;
          sp::AttentionInputs in = make_inputs(inputs, held);
          sp::BlockIndexView iv = make_index_view(index, held);
          sp::AttentionOutputs outs = make_outputs(out, lse, held);
          if (!workspace.is_none()) outs.workspace = to_writable_view(workspace, "workspace", held);
          nb::gil_scoped_release release;
          sp::sparse_attention(in, iv, outs, reuse_index);
        },
        nb::arg("inputs"), nb::arg("index"), nb::arg("out"), nb::arg("lse").none(),
        nb::arg("workspace").none() = nb::none(), nb::arg("reuse_index") = false);

  // mean_k / mean_v: the pooled-means cache (both or neither); mean_block_size: the block size it was made for (0:
  // not recorded; MeanCache::block_size, checked by the library).
  m.def("sparse_prefill",
        [](nb::tuple inputs, nb::tuple selection, nb::handle out, nb::handle lse, nb::handle mean_k,
           nb::handle mean_v, nb::handle workspace, int mean_block_size) {
          Held held;
          sp::AttentionInputs in = make_inputs(inputs, held);
          sp::AttentionOutputs outs = make_outputs(out, lse, held);
          if (!workspace.is_none()) outs.workspace = to_writable_view(workspace, "workspace", held);
          const sp::SelectionParams p = selection_params(selection);
          if (mean_k.is_none() != mean_v.is_none())
            throw sp::ArgumentError("mean_cache", "pass both k_mean and v_mean, or neither");
          if (mean_k.is_none()) {
            nb::gil_scoped_release release;
            sp::sparse_prefill(in, p, outs);
            return;
          }
          sp::MeanCache cache{to_writable_view(mean_k, "mean_cache.k_mean", held),
                              to_writable_view(mean_v, "mean_cache.v_mean", held), mean_block_size};
          nb::gil_scoped_release release;
          sp::sparse_prefill(in, p, outs, cache);
        },
        nb::arg("inputs"), nb::arg("selection"), nb::arg("out"), nb::arg("lse").none(),
        nb::arg("mean_k").none() = nb::none(), nb::arg("mean_v").none() = nb::none(),
        nb::arg("workspace").none() = nb::none(), nb::arg("mean_block_size") = 0);

  m.def("mean_cache_slots", &sp::mean_cache_slots, nb::arg("num_pages"), nb::arg("page_size"),
        nb::arg("block_size"));

  // index: (block_size, group_size, num_kv_heads, correction, segment_start, segment_end, block_ids, cu_blocks,
  //         k_mean, v_mean, kept_blocks, visible_blocks, head_subgroups, binding | None), arrays as host numpy arrays.
  m.def("union_index",
        [](nb::tuple inputs, nb::tuple index) {
          if (nb::len(index) != 14) throw nb::value_error("internal: index tuple must have 14 entries");
          Held held;
          sp::AttentionInputs in = make_inputs(inputs, held);
          sp::BlockIndex idx;
          idx.block_size = nb::cast<int>(index[0]);
          idx.group_size = nb::cast<int>(index[1]);
          idx.num_kv_heads = nb::cast<int>(index[2]);
          idx.correction = nb::cast<bool>(index[3]);
          idx.head_dim = int(in.q.ndim == 3 ? in.q.shape[2] : 0);
          idx.segment_start = host_vector<int32_t>(index[4], "index.segment_start", sp::DType::kInt32);
          idx.segment_end = host_vector<int32_t>(index[5], "index.segment_end", sp::DType::kInt32);
          idx.block_ids = host_vector<int32_t>(index[6], "index.block_ids", sp::DType::kInt32);
          idx.cu_blocks = host_vector<int32_t>(index[7], "index.cu_blocks", sp::DType::kInt32);
          idx.k_mean = host_vector<float>(index[8], "index.k_mean", sp::DType::kFloat32);
          idx.v_mean = host_vector<float>(index[9], "index.v_mean", sp::DType::kFloat32);
          idx.kept_blocks = nb::cast<int64_t>(index[10]);
          idx.visible_blocks = nb::cast<int64_t>(index[11]);
          idx.head_subgroups = nb::cast<int>(index[12]);
          if (!index[13].is_none()) idx.binding = nb::cast<sp::IndexBinding>(index[13]);
          sp::BlockIndex u;
          {
            nb::gil_scoped_release release;
            u = sp::union_index(in, idx);
          }
          return index_to_dict(std::move(u));
        },
        nb::arg("inputs"), nb::arg("index"));

  m.def("pool_kv",
        [](nb::tuple inputs, int block_size) {
          Held held;
          sp::AttentionInputs in = make_inputs(inputs, held);
          std::vector<int32_t> cu_blocks;
          std::vector<float> k_mean, v_mean;
          {
            nb::gil_scoped_release release;
            sp::pool_kv(in, block_size, cu_blocks, k_mean, v_mean);
          }
          const size_t total_blocks = cu_blocks.empty() ? 0 : size_t(cu_blocks.back());
          const size_t hkv = size_t(in.k.ndim >= 2 ? in.k.shape[in.k.ndim - 2] : 0);
          const size_t d = size_t(in.k.ndim >= 1 ? in.k.shape[in.k.ndim - 1] : 0);
          const size_t c = cu_blocks.size();
          nb::dict r;
          r["cu_blocks"] = numpy_owning(std::move(cu_blocks), {c});
          r["k_mean"] = numpy_owning(std::move(k_mean), {total_blocks, hkv, d});
          r["v_mean"] = numpy_owning(std::move(v_mean), {total_blocks, hkv, d});
          return r;
        },
        nb::arg("inputs"), nb::arg("block_size"));

  m.def("workload_topic",
        [](int64_t seqlen, int num_q_heads, int num_kv_heads, int head_dim, uint64_t seed, int block, int targets) {
          const sp::workload::Shape shape = workload_shape(seqlen, num_q_heads, num_kv_heads, head_dim);
          if (block <= 0) throw sp::ArgumentError("block", "must be positive");
          if (targets <= 0) throw sp::ArgumentError("targets", "must be positive");
          sp::workload::TopicParams params;
          params.block = block;
          params.targets = targets;
          const size_t L = size_t(seqlen), D = size_t(head_dim);
          std::vector<float> q, k, v;
          allocate_workload(shape, q, k, v);
          {
            nb::gil_scoped_release release;
            sp::workload::generate_topic(shape, params, seed, q.data(), k.data(), v.data());
          }
          return nb::make_tuple(numpy_owning(std::move(q), {L, size_t(num_q_heads), D}),
                                numpy_owning(std::move(k), {L, size_t(num_kv_heads), D}),
                                numpy_owning(std::move(v), {L, size_t(num_kv_heads), D}));
        },
        nb::arg("seqlen"), nb::arg("num_q_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim"), nb::arg("seed"),
        nb::arg("block"), nb::arg("targets"));

  m.def("workload_structured_defaults", &structured_defaults);

  m.def("workload_structured",
        [](int64_t seqlen, int num_q_heads, int num_kv_heads, int head_dim, uint64_t seed, nb::dict knobs) {
          const sp::workload::Shape shape = workload_shape(seqlen, num_q_heads, num_kv_heads, head_dim);
          const sp::workload::StructuredParams params = structured_params(knobs);
          const size_t L = size_t(seqlen), D = size_t(head_dim);
          std::vector<float> q, k, v;
          allocate_workload(shape, q, k, v);
          {
            nb::gil_scoped_release release;
            sp::workload::generate_structured(shape, params, seed, q.data(), k.data(), v.data());
          }
          return nb::make_tuple(numpy_owning(std::move(q), {L, size_t(num_q_heads), D}),
                                numpy_owning(std::move(k), {L, size_t(num_kv_heads), D}),
                                numpy_owning(std::move(v), {L, size_t(num_kv_heads), D}));
        },
        nb::arg("seqlen"), nb::arg("num_q_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim"), nb::arg("seed"),
        nb::arg("knobs"));

  m.def("workload_needles",
        [](int64_t seqlen, int num_q_heads, int num_kv_heads, int head_dim, uint64_t seed, nb::dict knobs) {
          const sp::workload::Shape shape = workload_shape(seqlen, num_q_heads, num_kv_heads, head_dim);
          const sp::workload::StructuredParams params = structured_params(knobs);
          std::vector<sp::workload::Needle> needles = sp::workload::needle_positions(shape, params, seed);
          nb::list out;
          for (sp::workload::Needle& n : needles) {
            nb::dict d;
            d["kv_head"] = n.kv_head;
            d["key_begin"] = n.key_begin;
            d["key_end"] = n.key_end;
            d["query_begin"] = n.query_begin;
            d["query_end"] = n.query_end;
            const size_t dim = n.value.size();
            d["value"] = numpy_owning(std::move(n.value), {dim});
            out.append(d);
          }
          return out;
        },
        nb::arg("seqlen"), nb::arg("num_q_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim"), nb::arg("seed"),
        nb::arg("knobs"));
}
