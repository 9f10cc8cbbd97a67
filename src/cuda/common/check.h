// The one CUDA error check of the backend (every .cu / .cpp under src/cuda except the attention kernel's own files).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace sparse_prefill::cuda {

// Throws std::runtime_error("sparse_prefill cuda: <what>: <CUDA error string>") unless e is cudaSuccess.
inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string("sparse_prefill cuda: ") + what + ": " + cudaGetErrorString(e));
  }
}

}  // namespace sparse_prefill::cuda
