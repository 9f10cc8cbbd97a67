// Which key blocks a query tile visits, and which of them need the element-wise mask.
//
// This is the seam between the dense and the block-sparse kernels: producer (TMA issue) and consumers (MMA +
// softmax) each build the same iterator from (blockIdx, params) and walk it with the same index i = 0..count()-1,
// so no block list ever travels between warpgroups and skipping blocks needs no extra synchronisation.
// A block-sparse iterator (CSR list per (sequence, KV head, tile)) only has to provide the same three functions.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SP_HOST_DEVICE inline
#endif

namespace sparse_prefill::cuda {

template <class T>
SP_HOST_DEVICE T sp_min(T a, T b) { return a < b ? a : b; }
template <class T>
SP_HOST_DEVICE T sp_max(T a, T b) { return a > b ? a : b; }

// Where one sequence lives. Read from cu_seqlens / seqused_k on the device (never on the host).
struct SeqSpan {
  int q_start, q_len, k_start, k_len;
};

// Dense key range [n_begin, n_end) of a 128-row query tile, visited from the last block to the first (the block on
// the causal diagonal comes first, so its mask is applied while the pipeline is filling).
// Visibility (bottom-right aligned, diag = Lk - Lq): row r sees col c iff c < Lk, and
//   c <= r + diag + right  when right >= 0 (causal: right = 0),   c >= r + diag - left  when left >= 0.
template <int kBlockM, int kBlockN>
struct DenseBlockIterator {
  int n_begin = 0, n_end = 0;
  int m0 = 0;      // first tile row (within the sequence)
  int k_len = 0, diag = 0, left = -1, right = -1;

  SP_HOST_DEVICE static DenseBlockIterator make(int m_block, const SeqSpan& s, int left, int right) {
    DenseBlockIterator it;
    it.m0 = m_block * kBlockM;
    it.k_len = s.k_len;
    it.diag = s.k_len - s.q_len;
    it.left = left;
    it.right = right;
    const int r_last = sp_min(it.m0 + kBlockM, s.q_len) - 1;
    int n_end = (s.k_len + kBlockN - 1) / kBlockN;
    if (right >= 0) {
      const int hi = r_last + it.diag + right;  // last visible column of the last row
      n_end = hi < 0 ? 0 : sp_min(n_end, hi / kBlockN + 1);
    }
    int n_begin = 0;
    if (left >= 0) {
      const int lo = it.m0 + it.diag - left;    // first visible column of the first row
      n_begin = lo <= 0 ? 0 : lo / kBlockN;
    }
    it.n_begin = n_begin;
    it.n_end = n_end;
    return it;
  }

  SP_HOST_DEVICE int count() const { return n_end > n_begin ? n_end - n_begin : 0; }
  SP_HOST_DEVICE int block(int i) const { return n_end - 1 - i; }

  // True when some element of block(i) may be invisible to some row of the tile: the tile-uniform branch that
  // replaces FA3's separate masked / unmasked trip counts (only the diagonal blocks, the sequence tail and the
  // window edge pay for the element-wise mask).
  SP_HOST_DEVICE bool needs_mask(int i) const {
    const int c0 = block(i) * kBlockN, c1 = c0 + kBlockN - 1;
    if (c1 >= k_len) return true;
    if (right >= 0 && c1 > m0 + diag + right) return true;
    if (left >= 0 && c0 < m0 + kBlockM - 1 + diag - left) return true;
    return false;
  }

  // Visible key columns of `row`: [lo, hi] (empty when lo > hi). The mask compares each column against this range
  // (two integer compares and a select per element, no branches).
  SP_HOST_DEVICE void col_range(int row, int& lo, int& hi) const {
    hi = k_len - 1;
    if (right >= 0) hi = sp_min(hi, row + diag + right);
    lo = left >= 0 ? sp_max(0, row + diag - left) : 0;
  }

  SP_HOST_DEVICE bool visible(int row, int col) const {
    if (col >= k_len) return false;
    if (right >= 0 && col > row + diag + right) return false;
    if (left >= 0 && col < row + diag - left) return false;
    return true;
  }
};

}  // namespace sparse_prefill::cuda
