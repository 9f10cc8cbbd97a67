// The CPU reference backend: plain, exact (double accumulation), readable. It is the oracle of every test.
// Entry points take validated arguments (src/api/validate.cpp) and the resolved Problem.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/problem.h"
#include "sparse_prefill/sparse.h"

namespace sparse_prefill::reference {

// a . b over d floats (d a multiple of 8), accumulated in double in 8 independent partial sums: exact to ~1e-16
// relative and vectorisable, about 4x faster than one running sum. Every q . k of the reference.
inline double dot(const float* a, const float* b, int d) {
  double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < d; i += 8) {
    for (int j = 0; j < 8; ++j) s[j] += double(a[i + j]) * double(b[i + j]);
  }
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// The FP8 descale of sequence b and head h of `heads` heads (1 when absent). `descale` is [B, Hkv]; `heads` is the
// query heads or the (possibly virtual, head sub-group) KV heads of the call: head h reads column h / (heads / Hkv).
inline float descale_at(const std::optional<TensorView>& descale, int b, int h, int heads) {
  if (!descale) return 1.f;
  const int per_column = heads / int(descale->shape[1]);
  return descale->ptr<const float>()[b * descale->stride[0] + (h / per_column) * descale->stride[1]];
}

// Keys and values of one (sequence, KV head) gathered into float rows [len, D] (contiguous or paged source), FP8
// descales applied.
struct SequenceKV {
  int64_t len = 0;
  std::vector<float> k, v;
};
// Gathers every (sequence b, KV head h) pair; element [b * Hkv + h].
std::vector<SequenceKV> gather_kv(const AttentionInputs& in, const Problem& p);

// The keys query `i` of a sequence sees: the inclusive range [lo, hi] (empty when lo > hi).
struct KeyRange {
  int64_t lo, hi;
  bool empty() const { return lo > hi; }
};
inline KeyRange visible_keys(int64_t i, int64_t q_len, int64_t k_len, bool causal, int window_left,
                             int window_right) {
  const int64_t diag = i + (k_len - q_len);  // bottom-right alignment
  int64_t lo = 0, hi = k_len - 1;
  if (causal) hi = std::min(hi, diag);
  if (window_right >= 0) hi = std::min(hi, diag + window_right);
  if (window_left >= 0) lo = std::max<int64_t>(lo, diag - window_left);
  return {lo, hi};
}

// Block geometry of one selection tile (sequence, KV head, tile): which blocks each row can see.
struct TileGeometry {
  int64_t first_pos = 0, last_pos = 0;  // query positions covered by the tile's packed rows
  int64_t row_begin = 0, row_end = 0;   // packed rows [row_begin, row_end)
};
TileGeometry tile_geometry(int64_t tile, int64_t q_len, int group_size);

// Block J is fully visible to every row of the tile (the only blocks selection may drop, and the only ones the
// mean correction may stand in for).
bool block_fully_visible(const AttentionInputs& in, const SequenceInfo& s, const TileGeometry& tile, int64_t block,
                         int block_size);

// Head sub-groups (S = BlockIndex::num_subgroups > 1, SelectionParams' resolved, sparse.h): the reference runs its
// S = 1 code on the equivalent model with Hkv * S KV heads, whose virtual head v holds query heads [v g', (v + 1) g'),
// g' = g / S, and is a copy of K/V head v / S. virtual_problem() is that model's Problem; virtual_head_copies() also
// materialises its K/V (each head repeated S times along the head axis, contiguous or paged like the input, any
// dtype), with `in` pointing at the copies (block_table and the rest unchanged). Copies: this is the oracle.
Problem virtual_problem(const Problem& p, int subgroups);
struct VirtualHeadCopies {
  VirtualHeadCopies() = default;
  VirtualHeadCopies(const VirtualHeadCopies&) = delete;  // `in` points into k and v
  VirtualHeadCopies(VirtualHeadCopies&&) = default;
  std::vector<uint8_t> k, v;
  AttentionInputs in;
  Problem p;
};
VirtualHeadCopies virtual_head_copies(const AttentionInputs& in, const Problem& p, int subgroups);

void attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p);
// v_mean == nullptr: K means only (V is not read).
void pool_kv(const Problem& p, const std::vector<SequenceKV>& kv, int block_size, std::vector<int32_t>& cu_blocks,
             std::vector<float>& k_mean, std::vector<float>* v_mean);
// SelectionRule::kKeyMax (docs/design/key_max_spec.md step 2, key_basis.cpp), in double: the basis P [D x rank]
// (row-major, P[d * rank + c]) of one (sequence, KV head) from the residuals of its sampled blocks' keys (kv's keys;
// k_mean: the float32 pooled means, block J's at k_mean + J * mean_stride), and every key's residual coordinates
// P^T (k_j - k_mean_J) ([len x rank]).
std::vector<double> key_basis(const SequenceKV& kv, const float* k_mean, int64_t mean_stride, int head_dim, int rank,
                              int block_size);
std::vector<double> key_coordinates(const SequenceKV& kv, const float* k_mean, int64_t mean_stride, int head_dim,
                                    const std::vector<double>& basis, int rank, int block_size);
// `p` is the caller's problem (real KV heads); head sub-groups are taken from params / the index (virtual_head_copies).
// index.v_mean is pooled only with params.correction or v_means (a mean cache needs them), else left empty.
BlockIndex build_index(const AttentionInputs& in, const Problem& p, const SelectionParams& params,
                       bool v_means = false);
void sparse_attention(const AttentionInputs& in, const BlockIndexView& index, const AttentionOutputs& outs,
                      const Problem& p);
// The complete blocks' pooled means of `index` (built with V means) stored in their slots of `cache` (mean_cache.cpp).
void write_mean_cache(const Problem& p, const AttentionInputs& in, const BlockIndex& index, const MeanCache& cache);
// dense_fraction: the dense rule applied to the union (SelectionParams::dense_fraction; 1: the union as it is).
BlockIndex union_index(const AttentionInputs& in, const Problem& p, const BlockIndex& index, float dense_fraction);

// The dense rule (SelectionParams::dense_fraction): an index that keeps at least that fraction of its visible blocks
// gets every segment's full list of visible blocks (what the CUDA index stage marks with kOverflowStart). `p` has the
// index's (virtual) KV heads.
void apply_dense_rule(const AttentionInputs& in, const Problem& p, BlockIndex& index, float dense_fraction);

// kept / visible counts of an index (listed blocks that the segment's tile can see, and all it can see); `p` has the
// index's (virtual) KV heads.
void count_density(const AttentionInputs& in, const Problem& p, BlockIndex& index);

}  // namespace sparse_prefill::reference
