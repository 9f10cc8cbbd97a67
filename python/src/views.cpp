// DLPack <-> TensorView conversions of the _C module and index_to_dict (views.h).
#include "views.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <type_traits>

namespace sparse_prefill::bindings {

std::string type_name_of(nb::handle obj) {
  return nb::borrow<nb::str>(nb::handle(obj.type()).attr("__name__")).c_str();
}

namespace {

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

}  // namespace

namespace {

// obj as a read-only (ROArray) or writable (RWArray) DLPack array, else a TypeError naming the argument.
template <class Array>
Array cast_array(nb::handle obj, const char* name) {
  Array a;
  if (obj.is_none() || !nb::try_cast(obj, a, false)) {
    const char* what = std::is_same_v<Array, RWArray> ? "a writable array supporting DLPack (numpy, torch, cupy)"
                                                       : "an array supporting DLPack (numpy, torch, cupy, jax)";
    throw sp::ArgumentError(name, std::string("expected ") + what + ", got " + type_name_of(obj), true);
  }
  return a;
}

}  // namespace

sp::TensorView to_view(nb::handle obj, const char* name, Held& held) {
  held.ro.push_back(cast_array<ROArray>(obj, name));
  return view_from(held.ro.back(), name);
}

sp::TensorView to_writable_view(nb::handle obj, const char* name, Held& held) {
  held.rw.push_back(cast_array<RWArray>(obj, name));
  return view_from(held.rw.back(), name);
}

std::optional<sp::TensorView> to_opt_view(nb::handle obj, const char* name, Held& held) {
  if (obj.is_none()) return std::nullopt;
  return to_view(obj, name, held);
}

namespace {

template <typename Array>
nb::object reinterpret_as(const Array& a, nb::handle owner, nb::dlpack::dtype to) {
  std::vector<size_t> shape(a.ndim());
  std::vector<int64_t> strides(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) {
    shape[i] = a.shape(i);
    strides[i] = a.stride(i);
  }
  return nb::cast(Array(a.data(), a.ndim(), shape.data(), owner, strides.data(), to, a.device_type(), a.device_id()));
}

}  // namespace

nb::object bit_view(nb::handle obj, const std::string& dtype, bool writable, const char* name) {
  using C = nb::dlpack::dtype_code;
  nb::dlpack::dtype from{uint8_t(C::UInt), 8, 1}, to{uint8_t(C::Float8_E4M3FN), 8, 1};
  if (dtype == "bfloat16") {
    from.bits = 16;
    to = nb::dlpack::dtype{uint8_t(C::Bfloat), 16, 1};
  } else if (dtype != "float8_e4m3fn") {
    throw nb::value_error("internal: bit_view reads uint8 as float8_e4m3fn or uint16 as bfloat16");
  }
  auto reinterpret = [&](const auto& a) {
    if (a.dtype() != from) {
      char buf[32];
      throw sp::ArgumentError(name, std::string("expected uint") + std::to_string(from.bits) + " bit patterns of " +
                                        dtype + ", got " + dl_dtype_name(a.dtype(), buf, sizeof buf), true);
    }
    return reinterpret_as(a, obj, to);
  };
  return writable ? reinterpret(cast_array<RWArray>(obj, name)) : reinterpret(cast_array<ROArray>(obj, name));
}

sp::AttentionOutputs make_outputs(nb::handle out, nb::handle lse, Held& held) {
  sp::AttentionOutputs o;
  o.out = to_writable_view(out, "out", held);
  if (!lse.is_none()) o.lse = to_writable_view(lse, "lse", held);
  return o;
}

nb::dict index_to_dict(sp::BlockIndex&& idx) {
  const int64_t head_dim = idx.head_dim;
  nb::dict d;
  d["binding"] = nb::cast(idx.binding);
  d["block_size"] = idx.block_size;
  d["group_size"] = idx.group_size;
  d["num_kv_heads"] = idx.num_kv_heads;
  d["num_subgroups"] = idx.num_subgroups;
  d["correction"] = idx.correction;
  d["head_dim"] = idx.head_dim;
  d["kept_blocks"] = idx.kept_blocks;
  d["visible_blocks"] = idx.visible_blocks;
  d["overflow_segments"] = idx.overflow_segments;
  const size_t S = idx.segment_start.size(), E = idx.segment_end.size(), N = idx.block_ids.size(), C = idx.cu_blocks.size();
  const size_t total_blocks = C ? size_t(idx.cu_blocks.back()) : 0;
  const size_t hkv = size_t(idx.num_kv_heads);
  d["segment_start"] = numpy_owning(std::move(idx.segment_start), {S});
  d["segment_end"] = numpy_owning(std::move(idx.segment_end), {E});
  d["block_ids"] = numpy_owning(std::move(idx.block_ids), {N});
  d["cu_blocks"] = numpy_owning(std::move(idx.cu_blocks), {C});
  d["k_mean"] = numpy_owning(std::move(idx.k_mean), {total_blocks, hkv, size_t(head_dim)});
  // None without the correction: such an index has no V means (sparse.h, BlockIndex).
  if (!idx.correction && idx.v_mean.empty()) d["v_mean"] = nb::none();
  else d["v_mean"] = numpy_owning(std::move(idx.v_mean), {total_blocks, hkv, size_t(head_dim)});
  return d;
}

}  // namespace sparse_prefill::bindings
