// The CUDA backend as a Backend (core/backend.h): its support checks (support.cpp) and entry points
// (cuda_backend.h).
#include "core/backend.h"
#include "cuda/cuda_backend.h"

namespace sparse_prefill {
namespace {

class CudaBackend final : public Backend {
 public:
  void check_attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p) const override {
    cuda::check_attention_supported(in, outs, p);
  }
  void check_sparse(const AttentionInputs& in, const Problem& p, int block_size) const override {
    cuda::check_sparse_supported(in, p, block_size);
  }
  void check_index(const AttentionInputs& in, const Problem& p, const SelectionParams& params) const override {
    cuda::check_index_supported(in, p, params);
  }
  void check_index_view(const BlockIndexView& index) const override { cuda::check_index_view_supported(index); }
  std::string fp8_attention_support(int head_dim, int64_t page_size) const override {
    return cuda::fp8_attention_support(head_dim, page_size);
  }

  void attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p) const override {
    cuda::attention(in, outs, p);
  }
  int64_t attention_workspace_bytes(int head_dim) const override { return cuda::attention_workspace_bytes(head_dim); }
  bool dense_uses_full_list(const AttentionInputs& in, const Problem& p) const override {
    return cuda::dense_uses_full_list(in, p);
  }

  BlockIndex build_index(const AttentionInputs& in, const Problem& p, const SelectionParams& params) const override {
    return cuda::build_index_to_host(in, p, params);
  }
  void sparse_attention(const AttentionInputs& in, const BlockIndexView& index, const AttentionOutputs& outs,
                        const Problem& p) const override {
    cuda::sparse_attention(in, index, outs, p);
  }
  size_t sparse_attention_workspace_bytes(const AttentionInputs& in, const BlockIndexView& index,
                                          const Problem& p) const override {
    return cuda::sparse_attention_workspace_bytes(in, index, p);
  }
  void sparse_prefill(const AttentionInputs& in, const SelectionParams& params, const AttentionOutputs& outs,
                      const Problem& p, const MeanCache* cache) const override {
    cuda::sparse_prefill(in, params, outs, p, cache);
  }
  size_t index_workspace_bytes(const AttentionInputs& in, const Problem& p,
                               const SelectionParams& params) const override {
    return cuda::index_workspace_bytes(in, p, params);
  }

  void build_index(const AttentionInputs& in, const Problem& p, const SelectionParams& params,
                   const TensorView& workspace, const MeanCache* cache) const override {
    cuda::build_index(in, p, params, workspace, cache);
  }
  void sparse_attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p,
                        const DeviceBlockIndex& index) const override {
    cuda::sparse_attention(in, outs, p, index);
  }
  IndexStats index_stats(const DeviceBlockIndex& index, void* stream) const override {
    return cuda::index_stats(index, stream);
  }
  BlockIndex to_host(const DeviceBlockIndex& index, void* stream) const override {
    return cuda::to_host(index, stream);
  }

  std::optional<ArgumentError> take_device_error(void* stream) const override {
    return cuda::take_device_error(stream);
  }
  TensorView download_int32(const TensorView& t, void* stream, std::vector<int32_t>& storage) const override {
    return cuda::download_int32(t, stream, storage);
  }
};

}  // namespace

const Backend& cuda_backend() {
  static const CudaBackend backend;
  return backend;
}

}  // namespace sparse_prefill
