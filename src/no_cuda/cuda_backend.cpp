// The CUDA backend's entry points (cuda/cuda_backend.h) in a build without it: the API layer calls them for CUDA
// inputs alone, and each says that this build cannot run them. Compiled instead of src/cuda/ (CMakeLists.txt).
#include <string>

#include "cuda/cuda_backend.h"

namespace sparse_prefill::cuda {
namespace {

[[noreturn]] void absent(const char* what) {
  throw NotImplementedError(std::string(what) + ": this build has no CUDA backend (nvcc was not found when it was "
                                                "configured)");
}

}  // namespace

void check_attention_supported(const AttentionInputs&, const AttentionOutputs&, const Problem&) { absent("attention"); }
void check_sparse_supported(const AttentionInputs&, const Problem&, int) { absent("sparse_attention"); }
void check_index_view_supported(const BlockIndexView&) { absent("sparse_attention"); }
void check_index_supported(const AttentionInputs&, const Problem&) { absent("build_index"); }
std::string fp8_attention_support(int, int64_t) {
  return "FP8 attention on CUDA: this build has no CUDA backend (nvcc was not found when it was configured)";
}

void attention(const AttentionInputs&, const AttentionOutputs&, const Problem&) { absent("attention"); }
int64_t attention_workspace_bytes(int) { return 0; }  // nothing to size
bool dense_uses_full_list(const AttentionInputs&, const Problem&) { return false; }
void sparse_attention(const AttentionInputs&, const AttentionOutputs&, const Problem&, const DeviceBlockIndex&) {
  absent("sparse_attention");
}
void sparse_attention(const AttentionInputs&, const BlockIndexView&, const AttentionOutputs&, const Problem&) {
  absent("sparse_attention");
}
size_t sparse_attention_workspace_bytes(const AttentionInputs&, const BlockIndexView&, const Problem&) {
  absent("sparse_attention");
}
void sparse_prefill(const AttentionInputs&, const SelectionParams&, const AttentionOutputs&, const Problem&,
                    const MeanCache*) {
  absent("sparse_prefill");
}
void build_index(const AttentionInputs&, const Problem&, const SelectionParams&, const TensorView&, const MeanCache*) {
  absent("build_index");
}
size_t index_workspace_bytes(const AttentionInputs&, const Problem&, const SelectionParams&) { absent("build_index"); }
BlockIndex build_index_to_host(const AttentionInputs&, const Problem&, const SelectionParams&) {
  absent("build_index");
}
IndexStats index_stats(const DeviceBlockIndex&, void*) { absent("index_stats"); }
BlockIndex to_host(const DeviceBlockIndex&, void*) { absent("to_host"); }
std::optional<ArgumentError> take_device_error(void*) { return std::nullopt; }  // no kernel ever ran
TensorView download_int32(const TensorView&, void*, std::vector<int32_t>&) { absent("checked mode"); }

}  // namespace sparse_prefill::cuda
