// _C: the block-sparse path of sparse_prefill/sparse.h: IndexBinding, SelectionParams, the index structures
// (IndexArrays, HostIndex, DeviceIndex, IndexStats), build_index (host and device index), sparse_attention,
// sparse_prefill, their workspace sizes, the mean cache, union_index, pool_kv.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/selection_fields.h"
#include "sparse_prefill/sparse.h"
#include "sparse_prefill/tensor.h"
#include "views.h"

namespace sparse_prefill::bindings {

namespace {

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

std::optional<sp::MeanCache> mean_cache_of(nb::handle mean_k, nb::handle mean_v, int block_size, Held& held) {
  if (mean_k.is_none() != mean_v.is_none())
    throw sp::ArgumentError("mean_cache", "pass both k_mean and v_mean, or neither");
  if (mean_k.is_none()) return std::nullopt;
  return sp::MeanCache{to_writable_view(mean_k, "mean_cache.k_mean", held),
                       to_writable_view(mean_v, "mean_cache.v_mean", held), block_size};
}

// A field's value as Python writes it (the rule as its int).
template <class T>
std::string field_repr(T v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? "True" : "False";
  } else if constexpr (std::is_same_v<T, sp::SelectionRule>) {
    return std::to_string(int(v));
  } else {
    return std::to_string(v);
  }
}

std::string selection_repr(const sp::SelectionParams& p) {
  std::string out = "SelectionParams(";
  sp::for_each_selection_field([&](const char* name, auto member, sp::FieldCheck) {
    if (out.back() != '(') out += ", ";
    out += std::string(name) + "=" + field_repr(p.*member);
  });
  return out + ")";
}

// SelectionParams(**kw): every keyword a field (for_each_selection_field), the rule as its int; a missing keyword
// keeps SelectionParams{}'s value.
sp::SelectionParams selection_from_kwargs(const nb::kwargs& kw) {
  sp::SelectionParams p;
  size_t used = 0;
  sp::for_each_selection_field([&](const char* name, auto member, sp::FieldCheck) {
    if (!kw.contains(name)) return;
    ++used;
    using T = std::remove_reference_t<decltype(p.*member)>;
    using Py = std::conditional_t<std::is_same_v<T, sp::SelectionRule>, int, T>;  // the rule as its int
    Py value{};
    if (!nb::try_cast<Py>(kw[name], value))
      throw nb::type_error((std::string("SelectionParams: ") + name + " has the wrong type").c_str());
    p.*member = static_cast<T>(value);
  });
  if (used != kw.size()) {
    for (auto item : kw) {
      const std::string key = nb::cast<std::string>(item.first);
      bool known = false;
      sp::for_each_selection_field([&](const char* name, auto, sp::FieldCheck) { known = known || key == name; });
      if (!known) throw nb::type_error(("SelectionParams: unknown field " + key).c_str());
    }
  }
  return p;
}

}  // namespace

void bind_sparse(nb::module_& m) {
  // What an index was built for (sparse.h); read-only, compared by sparse_attention.
  nb::class_<sp::IndexBinding>(m, "IndexBinding")
      .def_ro("causal", &sp::IndexBinding::causal)
      .def_ro("softmax_scale", &sp::IndexBinding::softmax_scale)
      .def_ro("block_size", &sp::IndexBinding::block_size)
      .def_ro("num_subgroups", &sp::IndexBinding::num_subgroups)
      .def_ro("union", &sp::IndexBinding::union_lists)
      .def_ro("dense_fraction", &sp::IndexBinding::dense_fraction)
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

  // The selection parameters themselves; the keyword defaults are SelectionParams{} (the one place they are set).
  // sparse_prefill.Selection builds one, checked once (check()), and passes it to every call.
  // Its keywords and attributes are the fields of core/selection_fields.h (SelectionParams(**kw), a keyword left out
  // keeps SelectionParams{}'s value; the rule as its int).
  nb::class_<sp::SelectionParams> params(m, "SelectionParams");
  params.def("__init__", [](sp::SelectionParams* self, const nb::kwargs& kw) {
    new (self) sp::SelectionParams(selection_from_kwargs(kw));
  });
  sp::for_each_selection_field([&](const char* name, auto member, sp::FieldCheck) {
    using T = std::remove_reference_t<decltype(std::declval<sp::SelectionParams&>().*member)>;
    if constexpr (std::is_same_v<T, sp::SelectionRule>) {
      params.def_prop_rw(
          name, [](const sp::SelectionParams& p) { return int(p.rule); },
          [](sp::SelectionParams& p, int r) { p.rule = static_cast<sp::SelectionRule>(r); });
    } else {
      params.def_rw(name, member);
    }
  });
  params
      // The checks that need no shapes (ValueError naming the field); a call adds those that do (head_subgroups
      // dividing Hq / Hkv).
      .def("check", [](const sp::SelectionParams& p) { sp::check_selection_params(p); })
      .def("__repr__", &selection_repr);
  // The field names in their order: the Python side's table of the selection (sparse_prefill/_selection.py) reads
  // them here, so that the list exists once.
  nb::list field_names;
  sp::for_each_selection_field([&](const char* name, auto, sp::FieldCheck) { field_names.append(name); });
  m.attr("SELECTION_FIELDS") = nb::tuple(field_names);

  // A host index's arrays (host, or copied to q's device) as sparse_attention reads them (sp::BlockIndexView).
  nb::class_<IndexArrays>(m, "IndexArrays")
      .def(
          "__init__",
          [](IndexArrays* self, int block_size, bool correction, int num_subgroups, nb::handle segment_start,
             nb::handle segment_end, nb::handle block_ids, nb::handle cu_blocks, nb::handle k_mean,
             nb::handle v_mean, std::optional<sp::IndexBinding> binding) {
            IndexArrays x;
            sp::BlockIndexView& v = x.view;
            if (binding) v.binding = *binding;
            v.block_size = block_size;
            v.correction = correction;
            v.num_subgroups = num_subgroups;
            v.segment_start = to_view(segment_start, "index.segment_start", x.held);
            v.segment_end = to_view(segment_end, "index.segment_end", x.held);
            v.block_ids = to_view(block_ids, "index.block_ids", x.held);
            v.cu_blocks = to_view(cu_blocks, "index.cu_blocks", x.held);
            v.k_mean = to_view(k_mean, "index.k_mean", x.held);
            if (!v_mean.is_none()) v.v_mean = to_view(v_mean, "index.v_mean", x.held);  // absent: validate_index
            new (self) IndexArrays(std::move(x));
          },
          nb::kw_only(), nb::arg("block_size"), nb::arg("correction"), nb::arg("num_subgroups"),
          nb::arg("segment_start"), nb::arg("segment_end"), nb::arg("block_ids"), nb::arg("cu_blocks"),
          nb::arg("k_mean"), nb::arg("v_mean").none() = nb::none(), nb::arg("binding").none() = nb::none());

  // A host index as the library's BlockIndex (copied from host arrays): union_index's input.
  nb::class_<sp::BlockIndex>(m, "HostIndex")
      .def(
          "__init__",
          [](sp::BlockIndex* self, int block_size, int group_size, int num_kv_heads, int num_subgroups,
             bool correction, nb::handle segment_start, nb::handle segment_end, nb::handle block_ids,
             nb::handle cu_blocks, nb::handle k_mean, nb::handle v_mean, int64_t kept_blocks,
             int64_t visible_blocks, std::optional<sp::IndexBinding> binding) {
            sp::BlockIndex idx;
            if (binding) idx.binding = *binding;
            idx.block_size = block_size;
            idx.group_size = group_size;
            idx.num_kv_heads = num_kv_heads;
            idx.num_subgroups = num_subgroups;
            idx.correction = correction;
            idx.segment_start = host_vector<int32_t>(segment_start, "index.segment_start", sp::DType::kInt32);
            idx.segment_end = host_vector<int32_t>(segment_end, "index.segment_end", sp::DType::kInt32);
            idx.block_ids = host_vector<int32_t>(block_ids, "index.block_ids", sp::DType::kInt32);
            idx.cu_blocks = host_vector<int32_t>(cu_blocks, "index.cu_blocks", sp::DType::kInt32);
            idx.k_mean = host_vector<float>(k_mean, "index.k_mean", sp::DType::kFloat32);
            if (!v_mean.is_none()) idx.v_mean = host_vector<float>(v_mean, "index.v_mean", sp::DType::kFloat32);
            idx.kept_blocks = kept_blocks;
            idx.visible_blocks = visible_blocks;
            new (self) sp::BlockIndex(std::move(idx));
          },
          nb::kw_only(), nb::arg("block_size"), nb::arg("group_size"), nb::arg("num_kv_heads"),
          nb::arg("num_subgroups"), nb::arg("correction"), nb::arg("segment_start"),
          nb::arg("segment_end"), nb::arg("block_ids"), nb::arg("cu_blocks"), nb::arg("k_mean"),
          nb::arg("v_mean").none() = nb::none(), nb::arg("kept_blocks") = 0, nb::arg("visible_blocks") = 0,
          nb::arg("binding").none() = nb::none())
      .def_ro("block_size", &sp::BlockIndex::block_size)
      .def_ro("group_size", &sp::BlockIndex::group_size)
      .def_ro("num_kv_heads", &sp::BlockIndex::num_kv_heads)
      .def_ro("num_subgroups", &sp::BlockIndex::num_subgroups)
      .def_ro("correction", &sp::BlockIndex::correction)
      .def_ro("kept_blocks", &sp::BlockIndex::kept_blocks)
      .def_ro("visible_blocks", &sp::BlockIndex::visible_blocks);

  nb::class_<sp::IndexStats>(m, "IndexStats")
      .def_ro("kept_blocks", &sp::IndexStats::kept_blocks)
      .def_ro("visible_blocks", &sp::IndexStats::visible_blocks)
      .def_ro("overflow_segments", &sp::IndexStats::overflow_segments);

  // The device index (CUDA): built into a caller workspace, read in place (sparse.h). The object holds the
  // workspace array, the selection and binding of its build and that build's stream; Python passes it back whole.
  nb::class_<DeviceIndex>(m, "DeviceIndex")
      .def_prop_ro("binding", [](const DeviceIndex& x) { return x.index.binding; })
      .def_prop_rw(
          "selection", [](const DeviceIndex& x) { return x.index.params; },
          [](DeviceIndex& x, const sp::SelectionParams& p) { x.index.params = p; })  // tests edit it
      .def_ro("stream", &DeviceIndex::stream)
      .def("stats",  // kept, visible, overflow_segments; synchronises the build's stream
           [](const DeviceIndex& x) {
             nb::gil_scoped_release release;
             return sp::index_stats(x.index, reinterpret_cast<void*>(x.stream));
           })
      .def("to_host", [](const DeviceIndex& x) {
        sp::BlockIndex idx;
        {
          nb::gil_scoped_release release;
          idx = sp::to_host(x.index, reinterpret_cast<void*>(x.stream));
        }
        return index_to_dict(std::move(idx));
      });

  m.def("index_workspace_bytes",
        [](const Inputs& inputs, const sp::SelectionParams& selection) {
          return sp::index_workspace_bytes(inputs.in, selection);
        },
        nb::arg("inputs"), nb::arg("selection"));
  m.def("build_index_device",
        [](const Inputs& inputs, const sp::SelectionParams& selection, nb::handle workspace, nb::handle mean_k,
           nb::handle mean_v, int mean_block_size) {
          DeviceIndex x;
          const sp::TensorView ws = to_writable_view(workspace, "workspace", x.held);
          Held cache_held;
          const std::optional<sp::MeanCache> cache = mean_cache_of(mean_k, mean_v, mean_block_size, cache_held);
          x.stream = reinterpret_cast<uintptr_t>(inputs.in.stream);
          {
            nb::gil_scoped_release release;
            x.index = sp::build_index(inputs.in, selection, ws, cache ? &*cache : nullptr);
          }
          return x;
        },
        nb::arg("inputs"), nb::arg("selection"), nb::arg("workspace"), nb::kw_only(),
        nb::arg("mean_k").none() = nb::none(), nb::arg("mean_v").none() = nb::none(), nb::arg("mean_block_size") = 0);
  m.def("sparse_attention_device",
        [](const Inputs& inputs, const DeviceIndex& index, nb::handle out, nb::handle lse, bool reuse_index) {
          Held held;
          const sp::AttentionOutputs outs = make_outputs(out, lse, held);
          nb::gil_scoped_release release;
          sp::sparse_attention(inputs.in, index.index, outs, reuse_index);
        },
        nb::arg("inputs"), nb::arg("index"), nb::arg("out"), nb::arg("lse").none(), nb::kw_only(),
        nb::arg("reuse_index") = false);
  m.def("sparse_attention_workspace_bytes",
        [](const Inputs& inputs, const IndexArrays& index) {
          return sp::sparse_attention_workspace_bytes(inputs.in, index.view);
        },
        nb::arg("inputs"), nb::arg("index"));
  m.def("sparse_prefill_workspace_bytes",
        [](const Inputs& inputs, const sp::SelectionParams& selection) {
          return sp::sparse_prefill_workspace_bytes(inputs.in, selection);
        },
        nb::arg("inputs"), nb::arg("selection"));
  m.def("sparse_prefill_support",
        [](const Inputs& inputs, const sp::SelectionParams& selection) {
          return sp::sparse_prefill_support(inputs.in, selection);
        },
        nb::arg("inputs"), nb::arg("selection"));

  m.def("build_index",
        [](const Inputs& inputs, const sp::SelectionParams& selection) {
          sp::BlockIndex idx;
          {
            nb::gil_scoped_release release;
            idx = sp::build_index(inputs.in, selection);
          }
          return index_to_dict(std::move(idx));
        },
        nb::arg("inputs"), nb::arg("selection"));

  m.def("sparse_attention",
        [](const Inputs& inputs, const IndexArrays& index, nb::handle out, nb::handle lse, nb::handle workspace,
           bool reuse_index) {
          Held held;
          sp::AttentionOutputs outs = make_outputs(out, lse, held);
          if (!workspace.is_none()) outs.workspace = to_writable_view(workspace, "workspace", held);
          nb::gil_scoped_release release;
          sp::sparse_attention(inputs.in, index.view, outs, reuse_index);
        },
        nb::arg("inputs"), nb::arg("index"), nb::arg("out"), nb::arg("lse").none(), nb::kw_only(),
        nb::arg("workspace").none() = nb::none(), nb::arg("reuse_index") = false);

  // mean_k / mean_v: the pooled-means cache (both or neither); mean_block_size: the block size it was made for (0:
  // not recorded; MeanCache::block_size, checked by the library).
  m.def("sparse_prefill",
        [](const Inputs& inputs, const sp::SelectionParams& selection, nb::handle out, nb::handle lse,
           nb::handle mean_k, nb::handle mean_v, nb::handle workspace, int mean_block_size) {
          Held held;
          sp::AttentionOutputs outs = make_outputs(out, lse, held);
          if (!workspace.is_none()) outs.workspace = to_writable_view(workspace, "workspace", held);
          const std::optional<sp::MeanCache> cache = mean_cache_of(mean_k, mean_v, mean_block_size, held);
          nb::gil_scoped_release release;
          if (cache) sp::sparse_prefill(inputs.in, selection, outs, *cache);
          else sp::sparse_prefill(inputs.in, selection, outs);
        },
        nb::arg("inputs"), nb::arg("selection"), nb::arg("out"), nb::arg("lse").none(), nb::kw_only(),
        nb::arg("mean_k").none() = nb::none(), nb::arg("mean_v").none() = nb::none(),
        nb::arg("workspace").none() = nb::none(), nb::arg("mean_block_size") = 0);

  m.def("mean_cache_slots", &sp::mean_cache_slots, nb::arg("num_pages"), nb::arg("page_size"),
        nb::arg("block_size"));

  m.def("union_index",
        [](const Inputs& inputs, const sp::BlockIndex& index) {
          sp::BlockIndex idx = index;  // the pooled means' row length is q's head dim, as the call's
          idx.head_dim = int(inputs.in.q.ndim == 3 ? inputs.in.q.shape[2] : 0);
          sp::BlockIndex u;
          {
            nb::gil_scoped_release release;
            u = sp::union_index(inputs.in, idx);
          }
          return index_to_dict(std::move(u));
        },
        nb::arg("inputs"), nb::arg("index"));

  m.def("pool_kv",
        [](const Inputs& inputs, int block_size) {
          const sp::AttentionInputs& in = inputs.in;
          std::vector<int32_t> cu_blocks;
          std::vector<float> k_mean, v_mean;
          {
            nb::gil_scoped_release release;
            sp::pool_kv(in, block_size, cu_blocks, k_mean, v_mean);
          }
          const size_t total_blocks = cu_blocks.empty() ? 0 : size_t(cu_blocks.back());
          const size_t hkv = size_t(in.k.ndim >= 2 ? in.k.shape[in.k.ndim - 2] : 0);
          const size_t dim = size_t(in.k.ndim >= 1 ? in.k.shape[in.k.ndim - 1] : 0);
          const size_t c = cu_blocks.size();
          nb::dict r;
          r["cu_blocks"] = numpy_owning(std::move(cu_blocks), {c});
          r["k_mean"] = numpy_owning(std::move(k_mean), {total_blocks, hkv, dim});
          r["v_mean"] = numpy_owning(std::move(v_mean), {total_blocks, hkv, dim});
          return r;
        },
        nb::arg("inputs"), nb::arg("block_size"));
}

}  // namespace sparse_prefill::bindings
