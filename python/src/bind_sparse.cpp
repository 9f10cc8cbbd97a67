// _C: the block-sparse path of sparse_prefill/sparse.h: IndexBinding, the selection defaults, build_index (host and
// device index), sparse_attention, sparse_prefill, their workspace sizes, the mean cache, union_index, pool_kv.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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

}  // namespace

void bind_sparse(nb::module_& m) {
  // What an index was built for (sparse.h); read-only, compared by sparse_attention.
  nb::class_<sp::IndexBinding>(m, "IndexBinding")
      .def_ro("causal", &sp::IndexBinding::causal)
      .def_ro("softmax_scale", &sp::IndexBinding::softmax_scale)
      .def_ro("block_size", &sp::IndexBinding::block_size)
      .def_ro("head_subgroups", &sp::IndexBinding::head_subgroups)
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

  // The device index (CUDA): built into a caller workspace, read in place (sparse.h).
  m.def("selection_defaults", [] {  // SelectionParams{}: the one source of the Python defaults
    sp::SelectionParams p;
    nb::dict d;
    d["alpha"] = p.alpha;
    d["mean_alpha"] = p.mean_alpha;
    d["rule"] = int(p.rule);
    d["block_size"] = p.block_size;
    d["sink"] = p.sink;
    d["window"] = p.window;
    d["last_n"] = p.last_n;
    d["correction"] = p.correction;
    d["head_subgroups"] = p.head_subgroups;
    d["dense_fraction"] = p.dense_fraction;
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
  m.def("device_index_counts",  // (kept, visible, overflow_segments)
        [](nb::handle workspace, nb::tuple selection, const sp::IndexBinding& binding, uintptr_t stream) {
          Held held;
          const sp::DeviceBlockIndex index{to_writable_view(workspace, "index.workspace", held),
                                           selection_params(selection), binding};
          sp::IndexStats s;
          {
            nb::gil_scoped_release release;
            s = sp::index_stats(index, reinterpret_cast<void*>(stream));
          }
          return nb::make_tuple(s.kept_blocks, s.visible_blocks, s.overflow_segments);
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
  //         k_mean, v_mean | None, kept_blocks, visible_blocks, head_subgroups, binding | None), arrays as host
  //         numpy arrays.
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
          if (!index[9].is_none()) idx.v_mean = host_vector<float>(index[9], "index.v_mean", sp::DType::kFloat32);
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
}

}  // namespace sparse_prefill::bindings
