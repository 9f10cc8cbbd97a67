// The device index's default budget (src/cuda/index/layout.h, causal_capacity): an upper bound, from the shapes
// alone, of the blocks every segment's tile sees, for any lengths within the bounds; checked against the exact sum
// over random varlen batches. CUDA builds only (the layout belongs to the CUDA index stage); no GPU needed.
#ifdef SPARSE_PREFILL_WITH_CUDA
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "cuda/index/layout.h"

namespace {

using sparse_prefill::cuda::index_stage::causal_capacity;

// Sum over the segments of one KV head of the blocks their tiles see (causal, bottom-right), as the scorer counts.
int64_t visible_sum(const std::vector<int64_t>& q, const std::vector<int64_t>& k, int g, int bs) {
  int64_t sum = 0;
  for (size_t b = 0; b < q.size(); ++b) {
    const int64_t tiles = (q[b] * g + 127) / 128;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t rows = std::min<int64_t>(128, q[b] * g - t * 128);
      const int64_t hi = std::min(k[b] - 1, (t * 128 + rows - 1) / g + k[b] - q[b]);
      sum += hi >= 0 ? hi / bs + 1 : 0;
    }
  }
  return sum;
}

TEST(IndexLayout, CausalCapacityBoundsEveryBatch) {
  std::mt19937 rng(3);
  auto uni = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int it = 0; it < 4000; ++it) {
    const int batch = int(uni(1, 4)), g = std::vector<int>{1, 2, 4, 8, 16}[uni(0, 4)];
    const int bs = std::vector<int>{64, 128, 256}[uni(0, 2)];
    const int64_t qmax = uni(1, 3000), kmax = uni(1, 3000);
    std::vector<int64_t> q(batch), k(batch);
    for (int b = 0; b < batch; ++b) {
      q[b] = uni(0, qmax);
      k[b] = it % 3 == 0 ? std::max(q[b], uni(0, kmax)) : uni(0, kmax);
    }
    int64_t total_q = 0, max_k = 0;
    for (int b = 0; b < batch; ++b) total_q += q[b], max_k = std::max(max_k, k[b]);
    const int64_t max_tiles = total_q * g / 128 + batch;  // Bounds::max_tiles
    const int64_t bound = causal_capacity(max_tiles, batch, max_k, g, bs, 3);
    ASSERT_GE(bound, 3 * visible_sum(q, k, g, bs)) << "it " << it;
  }
}

TEST(IndexLayout, CausalCapacityIsAboutHalfTheFixedSlicesForOnePrompt) {
  // 128K and 1M, Hq 32, Hkv 8 (g = 4), block 128: the figures of docs/design/index_stage.md.
  for (int64_t L : {int64_t(131072), int64_t(1) << 20}) {
    const int64_t tiles = L * 4 / 128 + 1, nb = L / 128;
    const int64_t bound = causal_capacity(tiles, 1, L, 4, 128, 8);
    EXPECT_GE(bound, 8 * visible_sum({L}, {L}, 4, 128));
    EXPECT_LE(bound, 8 * visible_sum({L}, {L}, 4, 128) + 8 * nb);  // the one slack tile
    EXPECT_LT(bound, 8 * tiles * nb * 51 / 100);  // the former fixed slices: every segment x every block
  }
  EXPECT_EQ(causal_capacity(131072 * 4 / 128 + 1, 1, 131072, 4, 128, 8), 16801792);
  EXPECT_EQ(causal_capacity((int64_t(1) << 22) / 128 + 1, 1, int64_t(1) << 20, 4, 128, 8), 1073938432);
}

// The probe pass's key splits (layout.h, probe_splits): one-shot prompts have CTAs enough and no split; a chunk step
// with one probe CTA per virtual KV head splits its keys into one wave of two CTAs per SM, never past one split per
// bitmap word; non-probe rules have none.
TEST(IndexLayout, ProbeSplits) {
  using sparse_prefill::cuda::index_stage::probe_splits;
  EXPECT_EQ(probe_splits(131072, 4, 8, 131072 / 128 / 32, 132), 1);   // 128K one-shot, Hq 32 / Hkv 8
  EXPECT_EQ(probe_splits(1024, 1, 32, 131072 / 128 / 32, 132), 8);    // chunk 1024, head_subgroups = g: 32 CTAs
  EXPECT_EQ(probe_splits(1024, 1, 32, 2, 132), 2);                   // capped by the bitmap's words
  EXPECT_EQ(probe_splits(16, 4, 8, 32, 132), 32);                    // one CTA per head: as many splits as words
  EXPECT_EQ(probe_splits(0, 4, 8, 4, 132), 4);                       // no queries: harmless
  EXPECT_EQ(probe_splits(1024, 1, 32, 0, 132), 0);                   // not a probe rule
  for (int64_t q : {1, 100, 1024, 5000, 70000})
    for (int64_t words : {1, 3, 32, 256}) {
      const int s = probe_splits(q, 4, 8, words, 132);
      EXPECT_GE(s, 1);
      EXPECT_LE(s, words);
    }
}

}  // namespace
#endif  // SPARSE_PREFILL_WITH_CUDA
