// The element-wise mask of one key block: each row keeps the columns of its visible range [lo, hi] (the block
// iterator's col_range: causal bottom-right, window, sequence tail) and sets the others to -inf. Two integer compares
// and a select per element, no branches; called only for the steps whose needs_mask(i, n) is true (the diagonal
// blocks, the sequence tail and the window edge).
#pragma once

#include <cute/tensor.hpp>

namespace sparse_prefill::cuda {

// S_rc: this thread's S accumulator as (rows, cols); cS_rc: the tile coordinates of its elements; row_pos(row): the
// sequence position of tile row `row`.
template <int kBlockN, class Iterator, class TensorS, class TensorC, class RowPos>
__device__ __forceinline__ void apply_mask(TensorS& S_rc, const TensorC& cS_rc, const Iterator& iter, RowPos&& row_pos,
                                           int n_block) {
  using namespace cute;
  constexpr int kRows = decltype(size<0>(S_rc))::value;
  const int col0 = n_block * kBlockN;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    int lo, hi;
    iter.col_range(row_pos(get<0>(cS_rc(r, 0))), lo, hi);
    lo -= col0;
    hi -= col0;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(S_rc); ++c) {
      const int col = get<1>(cS_rc(r, c));
      S_rc(r, c) = (col >= lo && col <= hi) ? S_rc(r, c) : -INFINITY;
    }
  }
}

}  // namespace sparse_prefill::cuda
