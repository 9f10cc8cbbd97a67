// _C: the synthetic workloads of sparse_prefill/workload.h (sparse_prefill.workload).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "sparse_prefill/workload.h"
#include "views.h"

namespace sparse_prefill::bindings {

namespace {

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

}  // namespace

void bind_workload(nb::module_& m) {
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

}  // namespace sparse_prefill::bindings
