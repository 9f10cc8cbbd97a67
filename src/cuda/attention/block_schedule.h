// Which key blocks a query tile visits, and which of them need the element-wise mask.
//
// This is the seam between the dense and the block-sparse kernels: producer (TMA issue) and consumers (MMA +
// softmax) each build the same iterator from (blockIdx, params) and walk it with the same index i = 0..count()-1,
// so no block list ever travels between warpgroups and skipping blocks needs no extra synchronisation.
// The block-sparse iterator (CSR list per (sequence, KV head, PackGQA tile), plus mean-correction steps) provides the
// same functions; `is_corr(i)` tells a correction step (pooled means as keys) from a key block.
#pragma once

#include <cstdint>

#include "core/geometry.h"
#include "core/host_device.h"

namespace sparse_prefill::cuda {

template <class T>
SP_HOST_DEVICE T sp_min(T a, T b) { return a < b ? a : b; }
template <class T>
SP_HOST_DEVICE T sp_max(T a, T b) { return a > b ? a : b; }

// Where one sequence lives. Read from cu_seqlens / seqused_k on the device (never on the host).
struct SeqSpan {
  int q_start, q_len, k_start, k_len;
};

SP_HOST_DEVICE SeqSpan load_seq_span(const int* cu_q, const int* cu_k, const int* seqused_k, int b) {
  SeqSpan s;
  s.q_start = cu_q[b];
  s.q_len = cu_q[b + 1] - s.q_start;
  if (seqused_k != nullptr) {  // paged KV
    s.k_start = 0;
    s.k_len = seqused_k[b];
  } else {
    s.k_start = cu_k[b];
    s.k_len = cu_k[b + 1] - s.k_start;
  }
  return s;
}

// Block-sparse work order: index t -> (KV head, sequence, tile). The (sequence, tile) pairs r = sequence + batch *
// (max_tiles - 1 - tile), tiles from the last (most blocks visible under causal, and the dense last_n tiles) to the
// first, are cut into bands of `band` pairs; within a band KV heads are slowest, across bands the order stays
// heaviest first. band 1 (what launches use, SparseFwdArgs::order_band) is KV heads fastest: the tiles in
// flight spread over every KV head. band = the persistent grid keeps them on one or two heads, whose K / V
// blocks then stay in L2 (ncu, 64K, 50 % random blocks: L2 hit rate 30 % -> 96 %). Measured on the H200, banded
// against heads fastest (docs/design/sparse_kernel.md, "Work order"): random blocks at 64K 20 % 0.91, 50 % 0.86;
// FlashPrefill V2's selection 8K 1.14, 32K 1.02, 128K 1.02. Tiles beyond a shorter sequence's count are empty work
// (skipped). For t < num_kv_heads * batch * max_tiles: the band holding t starts below batch * max_tiles, so
// width >= 1.
struct SparseTileCoord {
  int kv_head, tile, batch;
};
SP_HOST_DEVICE SparseTileCoord sparse_tile_coord(int t, int num_kv_heads, int batch, int max_tiles, int band) {
  const int per_band = band * num_kv_heads;
  const int first = (t / per_band) * band;  // the band's first pair
  const int off = t - first * num_kv_heads;
  const int width = sp_min(band, batch * max_tiles - first);
  SparseTileCoord c;
  c.kv_head = off / width;
  const int r = first + off - c.kv_head * width;
  c.batch = r % batch;
  c.tile = max_tiles - 1 - r / batch;
  return c;
}

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
  SP_HOST_DEVICE bool needs_mask(int i, int n) const {
    const int c0 = n * kBlockN, c1 = c0 + kBlockN - 1;
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

  SP_HOST_DEVICE static constexpr bool is_corr(int) { return false; }
  SP_HOST_DEVICE static constexpr int chunk(int) { return 0; }

  SP_HOST_DEVICE bool visible(int row, int col) const {
    if (col >= k_len) return false;
    if (right >= 0 && col > row + diag + right) return false;
    if (left >= 0 && col < row + diag - left) return false;
    return true;
  }
};

// Steps of one block-sparse tile (causal attention, no window; docs/semantics.md / docs/semantics.md):
//   1. the listed blocks of the tile's CSR segment (ascending ids, `block_size` keys each) from the last to the first,
//      each as block_size / kBlockN kernel steps of kBlockN keys (the diagonal block comes first, as in the dense
//      iterator);
//   2. with mean correction, one step per chunk of kBlockN pooled blocks that holds at least one prunable block
//      (fully visible to every row of the tile) that is not listed. Its "keys" are the pooled means of the chunk's
//      blocks; the consumer adds log|B_J| to the logits of the blocks to correct and masks the others.
// Producer and consumers build it from the same segment and walk it with the same i, so chunk skipping needs no
// extra synchronisation. Ids outside [0, nb) (a corrupted index) become fully masked steps: no wrong output
// and no out-of-bounds load (their rows resolve past the end of K/V, which TMA zero-fills).
template <int kBlockN>
struct SparseBlockIterator {
  static constexpr int kTileRows = geometry::kTileRows;  // rows of a PackGQA tile (FwdConfig::kBlockM)
  const int32_t* ids = nullptr;  // the segment's list; null: the full list 0, 1, ..., n_listed - 1 (dense over
                                 // PackGQA tiles, see full_list_blocks)
  int n_listed = 0;
  int ratio = 1;                 // kernel steps per listed block (block_size / kBlockN)
  int n_real = 0;                // n_listed * ratio
  int block_size = kBlockN;
  int p_first = 0;               // position of the tile's first row (sequence-relative)
  int k_len = 0, diag = 0;
  int n_prunable = 0;            // blocks [0, n_prunable) are fully visible to every row of the tile
  int n_chunks = 0;              // correction chunks: ceil(n_prunable / kBlockN) with correction, else 0
  int n_todo_low = 0;            // set bits of todo_low
  uint64_t todo_low = 0;         // bit c (c < 64): chunk c holds a prunable block that is not listed
  int i_begin = 0, n_steps = -1; // split-KV: this work unit runs steps [i_begin, i_begin + n_steps) (-1: all)

  SP_HOST_DEVICE static int load_id(const int32_t* p) {
#if defined(__CUDA_ARCH__)
    return __ldg(p);
#else
    return *p;
#endif
  }

  // Blocks [0, n) fully visible to every row of a tile whose first row is at position p_first.
  SP_HOST_DEVICE static int prunable_blocks(int p_first, int q_len, int k_len, int block_size) {
    const int nb = (k_len + block_size - 1) / block_size;
    const int first_hi = sp_min(p_first + k_len - q_len, k_len - 1);  // last key the tile's first row sees
    if (first_hi < 0) return 0;
    return first_hi >= k_len - 1 ? nb : (first_hi + 1) / block_size;
  }

  // Dense attention over PackGQA tiles (the "full list": SparseFwdArgs::full_list, and an overflowed segment of a
  // device index, kOverflowStart): the blocks of `block` keys a tile visits are 0 .. n - 1, every block the tile's
  // last row sees (causal: up to position + k_len - q_len; otherwise the whole sequence). The kernel's tile lookup
  // and the split-KV plan both take n from here, with no index arrays.
  SP_HOST_DEVICE static int full_list_blocks(int row0, int group_size, int q_len, int k_len, bool causal,
                                             int block = kBlockN) {
    const int rows = q_len * group_size - row0;
    if (rows <= 0 || k_len <= 0) return 0;
    const int last_pos = (row0 + sp_min(rows, kTileRows) - 1) / group_size;
    const int hi = causal ? sp_min(k_len - 1, last_pos + k_len - q_len) : k_len - 1;
    return hi < 0 ? 0 : hi / block + 1;
  }
  SP_HOST_DEVICE static int packed_tiles(int q_len, int group_size) {
    return int(geometry::num_tiles(q_len, group_size));
  }

  // Upper bound of total() from the list length and the geometry alone (no scan of the list): the split-KV plan
  // (split_kv/plan_combine.cu) and the kernel's tile lookup both decide from it, so they agree without sharing state.
  SP_HOST_DEVICE static int planned_steps(int n_listed, int p_first, int q_len, int k_len, int block_size,
                                          bool correction) {
    const int real = sp_max(n_listed, 0) * (block_size / kBlockN);
    if (!correction) return real;
    return real + (prunable_blocks(p_first, q_len, k_len, block_size) + kBlockN - 1) / kBlockN;
  }

  SP_HOST_DEVICE static SparseBlockIterator make(const int32_t* ids, int n_listed, int p_first, int q_len,
                                                 int k_len, int block_size, bool correction) {
    SparseBlockIterator it;
    it.ids = ids;
    it.n_listed = n_listed > 0 ? n_listed : 0;
    it.block_size = block_size;
    it.ratio = block_size / kBlockN;
    it.n_real = it.n_listed * it.ratio;
    it.p_first = p_first;
    it.k_len = k_len;
    it.diag = k_len - q_len;
    it.n_prunable = prunable_blocks(p_first, q_len, k_len, block_size);
    // A full list (ids == nullptr: blocks 0 .. n_listed - 1) that reaches every prunable block leaves nothing to
    // correct (an overflowed segment, whose list is every block its tile sees).
    if (!correction || it.n_prunable == 0 || (ids == nullptr && it.n_listed >= it.n_prunable)) return it;
    it.n_chunks = (it.n_prunable + kBlockN - 1) / kBlockN;
    const int low = sp_min(it.n_chunks, 64);
    it.todo_low = low == 64 ? ~uint64_t(0) : ((uint64_t(1) << low) - 1);
    // Clear the chunks whose prunable blocks are all listed (ascending ids: one pass, counts per chunk).
    int cur = -1, cnt = 0;
    auto flush = [&]() {
      if (cur >= 0 && cur < 64 && cnt == sp_min(kBlockN, it.n_prunable - cur * kBlockN))
        it.todo_low &= ~(uint64_t(1) << cur);
    };
    for (int k = 0; k < it.n_listed; ++k) {
      const int J = ids != nullptr ? load_id(ids + k) : k;
      if (J < 0) continue;
      if (J >= it.n_prunable) break;
      const int c = J / kBlockN;
      if (c != cur) {
        flush();
        cur = c;
        cnt = 0;
      }
      ++cnt;
    }
    flush();
#if defined(__CUDA_ARCH__)
    it.n_todo_low = __popcll(it.todo_low);
#else
    it.n_todo_low = __builtin_popcountll(it.todo_low);
#endif
    return it;
  }

  // Every step of the tile; count() is this work unit's share (split-KV: a contiguous range, see split()).
  SP_HOST_DEVICE int total() const { return n_real + n_todo_low + sp_max(0, n_chunks - 64); }
  SP_HOST_DEVICE int count() const { return n_steps < 0 ? total() : n_steps; }
  SP_HOST_DEVICE void split(int s, int num_splits) {
    const int n = total();
    i_begin = int(int64_t(n) * s / num_splits);
    n_steps = int(int64_t(n) * (s + 1) / num_splits) - i_begin;
  }
  // Local step i of this unit -> step of the tile.
  SP_HOST_DEVICE bool is_corr(int i) const { return i + i_begin >= n_real; }

  // Key block (kBlockN keys) of real step i; -1 for a step past the sequence's keys (the tail of a listed block of
  // block_size > kBlockN keys) and for a listed id outside [0, nb) (a corrupted index): a fully masked step whose loads
  // are zero-filled boxes. The unsigned compare bounds any id (negative or past k_len) before the multiply, so n fits
  // in int; the consumers' mask needs nothing more (32-bit only: the kernel is register-bound).
  SP_HOST_DEVICE int block(int i) const {
    const int J = listed_id(i);
    if (unsigned(J) >= unsigned(k_len)) return -1;
    const int n = ratio == 1 ? J : J * ratio + (ratio - 1 - (i + i_begin) % ratio);
    return n * kBlockN >= k_len ? -1 : n;
  }
  // The listed id of real step i.
  SP_HOST_DEVICE int listed_id(int i) const {
    i += i_begin;
    const int k = ratio == 1 ? i : i / ratio;  // block 128, the default: no integer division (~17 instructions)
    return ids != nullptr ? load_id(ids + (n_listed - 1 - k)) : n_listed - 1 - k;
  }
  // Whether real step i lists an id outside [0, nb) (the producer reports it, device_checks.h).
  SP_HOST_DEVICE bool bad_id(int i) const {
    const int J = listed_id(i);
    return J < 0 || int64_t(J) * block_size >= k_len;
  }

  // Chunk of correction step i: the k-th chunk with work, k = i - n_real.
  SP_HOST_DEVICE int chunk(int i) const {
    int k = i + i_begin - n_real;
    if (k >= n_todo_low) return 64 + (k - n_todo_low);
#if defined(__CUDA_ARCH__)
    // No loop: the producer thread runs with 24 registers (setmaxnreg), an unrolled bit scan would spill.
    const uint32_t lo = uint32_t(todo_low), hi = uint32_t(todo_low >> 32);
    const int n_lo = __popc(lo);
    return k < n_lo ? int(__fns(lo, 0, k + 1)) : 32 + int(__fns(hi, 0, k - n_lo + 1));
#else
    uint64_t m = todo_low;
    for (int c = 0; c < 64; ++c, m >>= 1) {
      if (m & 1) {
        if (k == 0) return c;
        --k;
      }
    }
    return -1;  // unreachable
#endif
  }

  // The diagonal block, the sequence tail and out-of-range ids need the element-wise mask; correction steps always
  // do (blocks to correct vs the rest of the chunk). n: block(i) for a real step (the consumers read it once).
  SP_HOST_DEVICE bool needs_mask(int i, int n) const {
    if (is_corr(i)) return true;
    if (n < 0) return true;
    const int c1 = n * kBlockN + kBlockN - 1;
    return c1 >= k_len || c1 > p_first + diag;
  }

  // Non-causal (full list only): every key of the sequence is visible to every row; only the tail block is masked.
  SP_HOST_DEVICE void make_non_causal() { diag = k_len; }

  // Visible key columns of the row at sequence position `pos` (causal, bottom-right): [0, min(k_len-1, pos+diag)].
  SP_HOST_DEVICE void col_range(int pos, int& lo, int& hi) const {
    lo = 0;
    hi = sp_min(k_len - 1, pos + diag);
  }

  // Bits of the listed blocks in chunk c (block c * kBlockN + j is bit j % 32 of word j / 32). `cursor` (0 at the
  // tile's start) walks the ascending list once over the tile's ascending chunks: independent loads, no search.
  SP_HOST_DEVICE void listed_bits(int c, uint32_t (&bits)[kBlockN / 32], int& cursor) const {
    static_assert(kBlockN == 128, "four bit words");
    for (int w = 0; w < kBlockN / 32; ++w) bits[w] = 0;
    const int lo_id = c * kBlockN;
    while (cursor < n_listed && load_id(ids + cursor) < lo_id) ++cursor;
    for (; cursor < n_listed; ++cursor) {
      const int j = load_id(ids + cursor) - lo_id;
      if (j >= kBlockN) break;
      const uint32_t bit = 1u << (j % 32);  // selects, not bits[j / 32]: keeps the words in registers
      bits[0] |= j < 32 ? bit : 0u;
      bits[1] |= (j >= 32 && j < 64) ? bit : 0u;
      bits[2] |= (j >= 64 && j < 96) ? bit : 0u;
      bits[3] |= j >= 96 ? bit : 0u;
    }
  }
};

}  // namespace sparse_prefill::cuda
