// Non-owning views of caller memory, and the library's argument errors.
//
// Every public entry point takes TensorViews: a pointer, a dtype, a device, a shape and strides in elements. The
// Python layer builds them from DLPack (numpy, torch, cupy, jax); C++ callers build them by hand (see make_view).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>

namespace sparse_prefill {

// kUInt8: raw bytes (workspaces; never a compute dtype).
enum class DType : int { kFloat32, kFloat16, kBFloat16, kInt32, kFloat8E4M3, kUInt8 };
enum class Device : int { kCPU, kCUDA };

const char* dtype_name(DType dtype);
int dtype_bytes(DType dtype);

struct TensorView {
  static constexpr int kMaxDims = 4;
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device = Device::kCPU;
  int device_id = 0;
  int ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t stride[kMaxDims] = {0, 0, 0, 0};  // in elements

  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
};

// A row-major (contiguous) view of `data` with the given shape.
TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device = Device::kCPU,
                     int device_id = 0);

// Bad arguments raise ArgumentError. `argument()` names the offending argument (Python argument names are used, e.g.
// "cu_seqlens_q"); `is_type_error()` distinguishes dtype/device/kind problems (Python TypeError) from bad values or
// shapes (Python ValueError). The message always starts with the argument name.
class ArgumentError : public std::invalid_argument {
 public:
  ArgumentError(std::string argument, const std::string& message, bool type_error = false)
      : std::invalid_argument(argument + ": " + message), argument_(std::move(argument)), type_error_(type_error) {}
  const std::string& argument() const { return argument_; }
  bool is_type_error() const { return type_error_; }

 private:
  std::string argument_;
  bool type_error_;
};

// Raised when a valid call asks for something a backend does not implement yet (e.g. a CUDA path that is not built).
class NotImplementedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace sparse_prefill
