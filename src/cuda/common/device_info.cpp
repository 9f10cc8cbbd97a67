// Device limits, cached per device (device_info.h).
#include "cuda/common/device_info.h"

#include <stdexcept>

#include "cuda/attention/fwd_args.h"

namespace sparse_prefill::cuda {

const DeviceInfo& device_info() {
  constexpr int kMaxDevices = 64;
  static DeviceInfo cache[kMaxDevices];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices)
    throw std::runtime_error("sparse_prefill cuda: no current CUDA device");
  DeviceInfo& info = cache[dev];
  if (info.num_sms == 0) {
    int sms = 0, smem = 0, optin = 0;
    check_cuda(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlock, dev),
               "cudaDeviceGetAttribute(max shared memory per block)");
    check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
               "cudaDeviceGetAttribute(max shared memory per block, opt-in)");
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
               "cudaDeviceGetAttribute(multiprocessor count)");
    info.max_smem_per_block = size_t(smem);
    info.max_smem_per_block_optin = size_t(optin);
    info.num_sms = sms;  // last: the entry counts as filled once num_sms is set
  }
  return info;
}

int num_sms() { return device_info().num_sms; }

}  // namespace sparse_prefill::cuda
