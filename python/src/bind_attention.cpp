// _C: dense attention and the device error word (sparse_prefill/attention.h).
#include <nanobind/nanobind.h>

#include <cstdint>

#include "sparse_prefill/attention.h"
#include "views.h"

namespace sparse_prefill::bindings {

void bind_attention(nb::module_& m) {
  // The device error word (sparse_prefill/attention.h): synchronises `stream`, raises the first violation recorded
  // on the current device since the last call (ValueError / TypeError naming the argument) and clears it.
  m.def("check_errors",
        [](uintptr_t stream) {
          nb::gil_scoped_release release;
          sp::check_errors(reinterpret_cast<void*>(stream));
        },
        nb::arg("stream"));

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
}

}  // namespace sparse_prefill::bindings
