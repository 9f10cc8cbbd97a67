// Host-side exhaustive check of the dense block iterator (src/cuda/block_iterator.h), the producer/consumer seam:
// every visible (row, key) lies in a visited block, a block reported as needing no mask is fully visible to every
// valid row of the tile, and the per-row column range used by the mask equals the visibility rule of DESIGN.md.
// Build and run (no GPU): g++ -std=c++17 -O2 -Isrc tests/gpu/test_block_iterator.cpp -o /tmp/t && /tmp/t
#include <cstdio>
#include <vector>

#include "cuda/block_iterator.h"

using sparse_prefill::cuda::DenseBlockIterator;
using sparse_prefill::cuda::SeqSpan;

int main() {
  constexpr int M = 128, N = 128;
  using It = DenseBlockIterator<M, N>;
  const std::vector<int> lens = {1, 11, 127, 128, 129, 300, 1000, 1763};
  const int windows[][2] = {{-1, -1}, {-1, 0}, {256, 0}, {300, 40}, {0, 0}, {5, -1}, {-1, 7}, {129, 129}};
  long checked = 0, failures = 0;
  for (int lq : lens)
    for (int lk : lens)
      for (const auto& w : windows) {
        const int left = w[0], right = w[1];
        SeqSpan s{0, lq, 0, lk};
        const int diag = lk - lq;
        for (int mb = 0; mb * M < lq; ++mb) {
          const It it = It::make(mb, s, left, right);
          std::vector<int> visited((lk + N - 1) / N + 1, -1);
          for (int i = 0; i < it.count(); ++i) visited[it.block(i)] = i;
          for (int r = mb * M; r < std::min(mb * M + M, lq); ++r) {
            int lo, hi;
            it.col_range(r, lo, hi);
            for (int c = 0; c < lk; ++c) {
              const bool ref = (right < 0 || c <= r + diag + right) && (left < 0 || c >= r + diag - left);
              const int i = visited[c / N];
              bool ok = it.visible(r, c) == ref && ((lo <= c && c <= hi) == ref);
              if (ref && i < 0) ok = false;                       // visible key in a block that is not visited
              if (i >= 0 && !it.needs_mask(i) && !ref) ok = false;  // unmasked block with an invisible key
              ++checked;
              if (!ok && failures++ < 10)
                std::printf("FAIL lq=%d lk=%d left=%d right=%d m_block=%d row=%d col=%d ref=%d visited=%d\n", lq, lk,
                            left, right, mb, r, c, ref, i);
            }
          }
          // Visited blocks are contiguous and descending.
          for (int i = 1; i < it.count(); ++i)
            if (it.block(i) != it.block(i - 1) - 1 && failures++ < 10) std::printf("FAIL order\n");
        }
      }
  std::printf("block iterator: %ld (row, key) pairs checked, %ld failures\n", checked, failures);
  return failures == 0 ? 0 : 1;
}
