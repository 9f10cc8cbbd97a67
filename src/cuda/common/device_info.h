// Limits of the current device, read from the device once per device (no architecture constants in the backend).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/common/check.h"

namespace sparse_prefill::cuda {

struct DeviceInfo {
  int num_sms = 0;                   // cudaDevAttrMultiProcessorCount
  size_t max_smem_per_block = 0;     // cudaDevAttrMaxSharedMemoryPerBlock: static + dynamic without an opt-in
  size_t max_smem_per_block_optin = 0;  // cudaDevAttrMaxSharedMemoryPerBlockOptin: static + dynamic with one
};

// The current device's limits (queried on first use per device, then cached; attribute queries are not stream
// operations). Throws when there is no current device. num_sms() (fwd_args.h) is device_info().num_sms.
const DeviceInfo& device_info();

// Shared memory a kernel's static __shared__ variables take (cudaFuncGetAttributes).
template <class Kernel>
size_t static_smem_bytes(Kernel kernel) {
  cudaFuncAttributes fa{};
  check_cuda(cudaFuncGetAttributes(&fa, kernel), "cudaFuncGetAttributes");
  return fa.sharedSizeBytes;
}

// The most dynamic shared memory `kernel` can launch with after opting in (cudaFuncSetAttribute with
// cudaFuncAttributeMaxDynamicSharedMemorySize up to this value): the device's opt-in maximum less its static shared
// memory (the opt-in maximum alone is refused for a kernel that has some).
template <class Kernel>
size_t max_dynamic_smem_optin(Kernel kernel) {
  return device_info().max_smem_per_block_optin - static_smem_bytes(kernel);
}

// Opts `kernel` in to max_dynamic_smem_optin(kernel) bytes of dynamic shared memory and all of the unified L1 as
// shared memory (the default carve-out may leave room for one ~100 KB CTA per SM where two fit); returns the bytes.
// Attributes are not stream operations: call once per kernel and keep the value (a function-local static).
template <class Kernel>
size_t opt_in_all_shared_memory(Kernel kernel, const char* name) {
  const size_t bytes = max_dynamic_smem_optin(kernel);
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)), name);
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100), name);
  return bytes;
}

// The most dynamic shared memory `kernel` can launch with without opting in.
template <class Kernel>
size_t max_dynamic_smem_default(Kernel kernel) {
  return device_info().max_smem_per_block - static_smem_bytes(kernel);
}

}  // namespace sparse_prefill::cuda
