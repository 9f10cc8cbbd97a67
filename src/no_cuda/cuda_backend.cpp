// The CUDA backend (core/backend.h) in a build without it: the dispatch calls it for CUDA inputs alone, and every
// support check says that this build cannot run them. Compiled instead of src/cuda/ (CMakeLists.txt).
#include <string>

#include "core/backend.h"

namespace sparse_prefill {
namespace {

[[noreturn]] void absent(const char* what) {
  throw NotImplementedError(std::string(what) + ": this build has no CUDA backend (nvcc was not found when it was "
                                                "configured)");
}

// The dispatch asks a support check before each entry point, so the entries themselves are never reached; they say
// the same all the same.
class NoCudaBackend final : public Backend {
 public:
  void check_attention(const AttentionInputs&, const AttentionOutputs&, const Problem&) const override {
    absent("attention");
  }
  void check_sparse(const AttentionInputs&, const Problem&, int) const override { absent("sparse_attention"); }
  void check_index(const AttentionInputs&, const Problem&, const SelectionParams&) const override {
    absent("build_index");
  }
  void check_index_view(const BlockIndexView&) const override { absent("sparse_attention"); }
  std::string fp8_attention_support(int, int64_t) const override {
    return "FP8 attention on CUDA: this build has no CUDA backend (nvcc was not found when it was configured)";
  }
  void attention(const AttentionInputs&, const AttentionOutputs&, const Problem&) const override {
    absent("attention");
  }
  BlockIndex build_index(const AttentionInputs&, const Problem&, const SelectionParams&) const override {
    absent("build_index");
  }
  void sparse_attention(const AttentionInputs&, const BlockIndexView&, const AttentionOutputs&,
                        const Problem&) const override {
    absent("sparse_attention");
  }
  size_t sparse_attention_workspace_bytes(const AttentionInputs&, const BlockIndexView&,
                                          const Problem&) const override {
    absent("sparse_attention");
  }
  void sparse_prefill(const AttentionInputs&, const SelectionParams&, const AttentionOutputs&, const Problem&,
                      const MeanCache*) const override {
    absent("sparse_prefill");
  }
  size_t index_workspace_bytes(const AttentionInputs&, const Problem&, const SelectionParams&) const override {
    absent("build_index");
  }
  void build_index(const AttentionInputs&, const Problem&, const SelectionParams&, const TensorView&,
                   const MeanCache*) const override {
    absent("build_index");
  }
  void sparse_attention(const AttentionInputs&, const AttentionOutputs&, const Problem&,
                        const DeviceBlockIndex&) const override {
    absent("sparse_attention");
  }
  IndexStats index_stats(const DeviceBlockIndex&, void*) const override { absent("index_stats"); }
  BlockIndex to_host(const DeviceBlockIndex&, void*) const override { absent("to_host"); }
  TensorView download_int32(const TensorView&, void*, std::vector<int32_t>&) const override {
    absent("checked mode");
  }
};

}  // namespace

const Backend& cuda_backend() {
  static const NoCudaBackend backend;
  return backend;
}

}  // namespace sparse_prefill
