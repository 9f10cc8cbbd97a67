#include "sparse_prefill/tensor.h"

namespace sparse_prefill {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
    case DType::kUInt8: return "uint8";
  }
  return "unknown";
}

int dtype_bytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: case DType::kInt32: return 4;
    case DType::kFloat16: case DType::kBFloat16: return 2;
    case DType::kFloat8E4M3: return 1;
    case DType::kUInt8: return 1;
  }
  return 0;
}

TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device, int device_id) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.device_id = device_id;
  t.ndim = int(shape.size());
  if (t.ndim > TensorView::kMaxDims) throw ArgumentError("shape", "at most 4 dimensions are supported");
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

}  // namespace sparse_prefill
