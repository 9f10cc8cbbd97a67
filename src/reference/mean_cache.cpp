// The reference backend's pooled-means cache writer (reference.h).
#include <algorithm>
#include <stdexcept>

#include "core/geometry.h"
#include "reference/reference.h"

namespace sparse_prefill::reference {

// CPU backend of the pooled-means cache: the reference pools every block; the complete ones are stored in their
// slots (MeanCache, sparse.h), as the CUDA index stage stores the blocks a chunk completes. The cache holds the real
// KV heads: with head sub-groups (S), real head h is the index's virtual head h * S (all S copies are equal).
void write_mean_cache(const Problem& p, const AttentionInputs& in, const BlockIndex& index, const MeanCache& cache) {
  const int B = index.block_size, S = index.num_subgroups, D = p.head_dim;
  const int64_t row = int64_t(p.num_kv_heads) * D;  // one slot of the cache; the index's rows hold row * S floats
  const int32_t* bt = in.block_table->ptr<const int32_t>();
  const int64_t bt0 = in.block_table->stride[0], bt1 = in.block_table->stride[1];
  if (index.v_mean.size() != index.k_mean.size())  // built with v_means (sparse_prefill_impl)
    throw std::logic_error("sparse_prefill: internal: the index for the mean cache has no V means");
  float* kc = cache.k_mean.ptr<float>();
  float* vc = cache.v_mean.ptr<float>();
  for (int b = 0; b < p.batch; ++b) {
    const int64_t k_len = p.seqs[b].k_len;
    for (int64_t J = 0; (J + 1) * B <= k_len; ++J) {
      const int64_t j = (J + 1) * B - 1;
      const int64_t page = bt[b * bt0 + geometry::page_column(j, p.page_size) * bt1];
      const int64_t slot = geometry::mean_cache_slot(page, J, p.page_size, B);
      for (int h = 0; h < p.num_kv_heads; ++h) {
        const int64_t src = ((int64_t(index.cu_blocks[b]) + J) * p.num_kv_heads * S + int64_t(h) * S) * D;
        const int64_t dst = slot * row + int64_t(h) * D;
        std::copy(index.k_mean.begin() + src, index.k_mean.begin() + src + D, kc + dst);
        std::copy(index.v_mean.begin() + src, index.v_mean.begin() + src + D, vc + dst);
      }
    }
  }
}

}  // namespace sparse_prefill::reference
