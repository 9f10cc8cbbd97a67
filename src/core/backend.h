// The interface the public entry points (api/dispatch.cpp) call once they have validated a call: one implementation
// per kind of device, picked by backend_for(). The CPU reference (reference/backend.cpp) and CUDA (cuda/backend.cpp;
// in a build without it, no_cuda/cuda_backend.cpp, whose entries say so) implement it. A new backend: a folder with
// an implementation of this class and its line in backend_for() (core/backend.cpp).
// The support checks throw NotImplementedError naming what the backend is not built for; the dispatch asks them
// before it runs anything, so that nothing launches for a call the backend cannot finish. The entry points assume
// them. Defaults: everything supported, no workspace, no device index, no device error word.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/problem.h"
#include "sparse_prefill/sparse.h"

namespace sparse_prefill {

class Backend {
 public:
  virtual ~Backend() = default;

  // --- what it supports (NotImplementedError naming what is not built) ---
  virtual void check_attention(const AttentionInputs&, const AttentionOutputs&, const Problem&) const {}
  virtual void check_sparse(const AttentionInputs&, const Problem&, int /*block_size*/) const {}
  virtual void check_index(const AttentionInputs&, const Problem&, const SelectionParams&) const {}
  virtual void check_index_view(const BlockIndexView&) const {}
  // The FP8 kernels' constraint by dimensions (page_size 0: contiguous): "" when built for it, else why not.
  virtual std::string fp8_attention_support(int /*head_dim*/, int64_t /*page_size*/) const { return {}; }

  // --- dense attention ---
  virtual void attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p) const = 0;
  virtual int64_t attention_workspace_bytes(int /*head_dim*/) const { return 0; }
  virtual bool dense_uses_full_list(const AttentionInputs&, const Problem&) const { return false; }

  // --- the index on the host, sparse attention over an index view, both in one call ---
  virtual BlockIndex build_index(const AttentionInputs& in, const Problem& p, const SelectionParams& params) const = 0;
  virtual void sparse_attention(const AttentionInputs& in, const BlockIndexView& index, const AttentionOutputs& outs,
                                const Problem& p) const = 0;
  virtual size_t sparse_attention_workspace_bytes(const AttentionInputs&, const BlockIndexView&,
                                                  const Problem&) const {
    return 0;
  }
  // cache: the pooled-means cache (validated by the dispatch), or null.
  virtual void sparse_prefill(const AttentionInputs& in, const SelectionParams& params, const AttentionOutputs& outs,
                              const Problem& p, const MeanCache* cache) const = 0;
  virtual size_t index_workspace_bytes(const AttentionInputs&, const Problem&, const SelectionParams&) const {
    return 0;
  }

  // --- the device index (a backend with memory of its own); the defaults say there is none ---
  virtual void build_index(const AttentionInputs& in, const Problem& p, const SelectionParams& params,
                           const TensorView& workspace, const MeanCache* cache) const;
  virtual void sparse_attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p,
                                const DeviceBlockIndex& index) const;
  virtual IndexStats index_stats(const DeviceBlockIndex& index, void* stream) const;
  virtual BlockIndex to_host(const DeviceBlockIndex& index, void* stream) const;

  // --- checked mode (LaunchOptions::checked) ---
  // The device error word: the first violation since the last call, cleared (nullopt: none).
  virtual std::optional<ArgumentError> take_device_error(void* /*stream*/) const { return std::nullopt; }
  // A 1-D or 2-D array of 4-byte elements copied to the host (synchronises `stream`), as a host view in `storage`.
  virtual TensorView download_int32(const TensorView& t, void* stream, std::vector<int32_t>& storage) const;
};

// What a call for a device index on a backend without one raises (NotImplementedError).
[[noreturn]] void no_device_index();

const Backend& reference_backend();  // reference/backend.cpp
const Backend& cuda_backend();       // cuda/backend.cpp, or no_cuda/cuda_backend.cpp
// The backend of a device: the registry.
const Backend& backend_for(Device device);

}  // namespace sparse_prefill
