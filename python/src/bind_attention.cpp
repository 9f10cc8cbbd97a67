// _C: the call's inputs (Inputs, LaunchOptions), dense attention and the device error word
// (sparse_prefill/attention.h).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "sparse_prefill/attention.h"
#include "views.h"

namespace sparse_prefill::bindings {

void bind_attention(nb::module_& m) {
  // The CUDA kernel choices (sparse_prefill.LaunchOptions builds one); the codes are range-checked by the library.
  nb::class_<sp::LaunchOptions>(m, "LaunchOptions")
      .def(
          "__init__",
          [](sp::LaunchOptions* self, int dense_path, bool split_kv, bool checked) {
            sp::LaunchOptions o;
            o.dense_path = static_cast<sp::LaunchOptions::DensePath>(dense_path);
            o.split_kv = split_kv;
            o.checked = checked;
            new (self) sp::LaunchOptions(o);
          },
          nb::kw_only(), nb::arg("dense_path") = int(sp::LaunchOptions{}.dense_path),
          nb::arg("split_kv") = sp::LaunchOptions{}.split_kv, nb::arg("checked") = sp::LaunchOptions{}.checked)
      .def_prop_ro("dense_path", [](const sp::LaunchOptions& o) { return int(o.dense_path); })
      .def_ro("split_kv", &sp::LaunchOptions::split_kv)
      .def_ro("checked", &sp::LaunchOptions::checked);

  // One call's inputs (sp::AttentionInputs), converted once: the arrays (any DLPack producer or capsule) are imported
  // here and held by the object, so one Inputs serves every _C call of a public call.
  nb::class_<Inputs>(m, "Inputs")
      .def(
          "__init__",
          [](Inputs* self, nb::handle q, nb::handle k, nb::handle v, nb::handle cu_seqlens_q, int64_t max_seqlen_q,
             int64_t max_seqlen_k, nb::handle cu_seqlens_k, nb::handle block_table, nb::handle seqused_k, bool causal,
             std::optional<double> softmax_scale, int window_left, int window_right, uintptr_t stream,
             const sp::LaunchOptions* options, nb::handle q_descale, nb::handle k_descale, nb::handle v_descale) {
            Inputs x;  // built whole before the placement: a conversion error leaves nothing half-made
            sp::AttentionInputs& in = x.in;
            in.q = to_view(q, "q", x.held);
            in.k = to_view(k, "k", x.held);
            in.v = to_view(v, "v", x.held);
            in.cu_seqlens_q = to_view(cu_seqlens_q, "cu_seqlens_q", x.held);
            in.cu_seqlens_k = to_opt_view(cu_seqlens_k, "cu_seqlens_k", x.held);
            in.block_table = to_opt_view(block_table, "block_table", x.held);
            in.seqused_k = to_opt_view(seqused_k, "seqused_k", x.held);
            in.max_seqlen_q = max_seqlen_q;
            in.max_seqlen_k = max_seqlen_k;
            in.causal = causal;
            if (softmax_scale) in.softmax_scale = float(*softmax_scale);
            in.window_left = window_left;
            in.window_right = window_right;
            in.stream = reinterpret_cast<void*>(stream);
            if (options) in.options = *options;
            in.q_descale = to_opt_view(q_descale, "q_descale", x.held);
            in.k_descale = to_opt_view(k_descale, "k_descale", x.held);
            in.v_descale = to_opt_view(v_descale, "v_descale", x.held);
            new (self) Inputs(std::move(x));
          },
          nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("cu_seqlens_q"), nb::arg("max_seqlen_q"),
          nb::arg("max_seqlen_k"), nb::kw_only(), nb::arg("cu_seqlens_k").none() = nb::none(),
          nb::arg("block_table").none() = nb::none(), nb::arg("seqused_k").none() = nb::none(),
          nb::arg("causal") = true, nb::arg("softmax_scale").none() = nb::none(), nb::arg("window_left") = -1,
          nb::arg("window_right") = -1, nb::arg("stream") = 0, nb::arg("options").none() = nb::none(),
          nb::arg("q_descale").none() = nb::none(), nb::arg("k_descale").none() = nb::none(),
          nb::arg("v_descale").none() = nb::none())
      .def_prop_ro("max_seqlen_q", [](const Inputs& x) { return x.in.max_seqlen_q; })
      .def_prop_ro("max_seqlen_k", [](const Inputs& x) { return x.in.max_seqlen_k; })
      .def_prop_ro("causal", [](const Inputs& x) { return x.in.causal; })
      .def_prop_ro("softmax_scale", [](const Inputs& x) { return x.in.softmax_scale; })
      .def_prop_ro("window", [](const Inputs& x) { return std::make_pair(x.in.window_left, x.in.window_right); })
      .def_prop_ro("stream", [](const Inputs& x) { return reinterpret_cast<uintptr_t>(x.in.stream); })
      .def_prop_ro("options", [](const Inputs& x) { return x.in.options; })
      .def_prop_ro("paged", [](const Inputs& x) { return x.in.paged(); });

  // The device error word (sparse_prefill/attention.h): synchronises `stream`, raises the first violation recorded
  // on the current device since the last call (ValueError / TypeError naming the argument) and clears it.
  m.def("check_errors",
        [](uintptr_t stream) {
          nb::gil_scoped_release release;
          sp::check_errors(reinterpret_cast<void*>(stream));
        },
        nb::arg("stream"));

  m.def("attention",
        [](const Inputs& inputs, nb::handle out, nb::handle lse, nb::handle workspace) {
          Held held;
          sp::AttentionOutputs outs = make_outputs(out, lse, held);
          if (!workspace.is_none()) outs.workspace = to_writable_view(workspace, "workspace", held);
          nb::gil_scoped_release release;
          sp::attention(inputs.in, outs);
        },
        nb::arg("inputs"), nb::arg("out"), nb::arg("lse").none(), nb::arg("workspace").none() = nb::none());
  m.def("attention_workspace_bytes", &sp::attention_workspace_bytes, nb::arg("head_dim"));
  m.def("fp8_attention_support", &sp::fp8_attention_support, nb::arg("head_dim"), nb::arg("page_size"));
  m.def("attention_path",
        [](const Inputs& inputs) {
          return sp::attention_path(inputs.in) == sp::LaunchOptions::DensePath::kSplitKV ? "split_kv" : "dense";
        },
        nb::arg("inputs"));
}

}  // namespace sparse_prefill::bindings
