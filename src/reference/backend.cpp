// The CPU reference as a Backend (core/backend.h): exact, every valid call supported, no workspace, no device index.
#include "core/backend.h"
#include "reference/reference.h"

namespace sparse_prefill {
namespace {

class ReferenceBackend final : public Backend {
 public:
  void attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p) const override {
    reference::attention(in, outs, p);
  }
  BlockIndex build_index(const AttentionInputs& in, const Problem& p, const SelectionParams& params) const override {
    return reference::build_index(in, p, params);
  }
  void sparse_attention(const AttentionInputs& in, const BlockIndexView& index, const AttentionOutputs& outs,
                        const Problem& p) const override {
    reference::sparse_attention(in, index, outs, p);
  }
  void sparse_prefill(const AttentionInputs& in, const SelectionParams& params, const AttentionOutputs& outs,
                      const Problem& p, const MeanCache* cache) const override {
    // The cache keeps V means for later steps (which may use the correction) even when this one does not.
    BlockIndex index = reference::build_index(in, p, params, /*v_means=*/cache != nullptr);
    if (cache) reference::write_mean_cache(p, in, index, *cache);
    reference::sparse_attention(in, view_of(index), outs, p);
  }
  using Backend::build_index;       // the device index: the defaults (none)
  using Backend::sparse_attention;
};

}  // namespace

const Backend& reference_backend() {
  static const ReferenceBackend backend;
  return backend;
}

}  // namespace sparse_prefill
