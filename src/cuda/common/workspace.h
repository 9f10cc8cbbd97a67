// Workspace carving for the CUDA backend: every region of a caller workspace (or of a stream-ordered temporary)
// starts on a 256-byte boundary, and one carver both sizes a layout (no base) and hands out its pointers (a base).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/common/check.h"

namespace sparse_prefill::cuda {

constexpr size_t kWorkspaceAlign = 256;  // what check_workspace (validate.h) asks of a caller workspace

inline size_t pad256(size_t bytes) { return (bytes + kWorkspaceAlign - 1) & ~(kWorkspaceAlign - 1); }

// Consecutive 256-byte aligned regions from `base`. With base == nullptr it only sums the sizes (take returns null),
// so a layout function run twice, without and with a base, gives the size and the pointers of one layout.
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(void* base = nullptr) : base_(static_cast<char*>(base)) {}
  char* take(size_t bytes) {
    char* ptr = base_ ? base_ + offset_ : nullptr;
    offset_ += pad256(bytes);
    return ptr;
  }
  template <class T>
  T* take_array(size_t count) {
    return reinterpret_cast<T*>(take(count * sizeof(T)));
  }
  size_t bytes() const { return offset_; }  // of everything taken so far

 private:
  char* base_;
  size_t offset_ = 0;
};

// Device memory from the stream-ordered allocator, returned on scope exit (also when a launch throws): no host
// synchronisation, and capturable in a CUDA graph.
struct StreamBuffer {
  void* ptr = nullptr;
  cudaStream_t stream;
  StreamBuffer(size_t bytes, cudaStream_t s) : stream(s) {
    check_cuda(cudaMallocAsync(&ptr, bytes ? bytes : 1, stream), "cudaMallocAsync");
  }
  ~StreamBuffer() { cudaFreeAsync(ptr, stream); }
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
};

}  // namespace sparse_prefill::cuda
