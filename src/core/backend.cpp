// The backend registry and the defaults of the entries a backend without a device index does not have.
#include "core/backend.h"

namespace sparse_prefill {

void no_device_index() {
  throw NotImplementedError("the device index is built for CUDA inputs; on the CPU build_index() returns the index "
                            "on the host");
}

void Backend::build_index(const AttentionInputs&, const Problem&, const SelectionParams&, const TensorView&,
                          const MeanCache*) const {
  no_device_index();
}
void Backend::sparse_attention(const AttentionInputs&, const AttentionOutputs&, const Problem&,
                               const DeviceBlockIndex&) const {
  no_device_index();
}
IndexStats Backend::index_stats(const DeviceBlockIndex&, void*) const { no_device_index(); }
BlockIndex Backend::to_host(const DeviceBlockIndex&, void*) const { no_device_index(); }
TensorView Backend::download_int32(const TensorView& t, void*, std::vector<int32_t>&) const {
  return t;  // host memory already
}

const Backend& backend_for(Device device) {
  switch (device) {
    case Device::kCPU:
      return reference_backend();
    case Device::kCUDA:
      return cuda_backend();
  }
  return reference_backend();  // unreachable: validate_inputs accepts these two
}

}  // namespace sparse_prefill
