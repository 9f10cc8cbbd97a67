// naive64: an independent, deliberately naive float64 implementation of the SparsePrefill contract
// (docs/semantics.md "The semantic contract", block-sparse and chunked sections), used as the test oracle for the reference
// backend. It works on logical per-sequence K/V (no paging, no strides) so that layout bugs in the code under test
// cannot be mirrored here. Every rule is evaluated literally from the mask predicate `sees(b, i, j)`.
#pragma once

#include <cstdint>
#include <vector>

namespace naive64 {

struct Problem {
  int B = 0, Hq = 0, Hkv = 0, D = 0;
  std::vector<int64_t> lq, lk, q_start;        // per sequence
  std::vector<double> q;                       // [total_q][Hq][D]
  std::vector<std::vector<double>> k, v;       // per sequence [Lk][Hkv][D]
  bool causal = true;
  int wl = -1, wr = -1;
  double scale = 0;

  int g() const { return Hq / Hkv; }
  int64_t total_q() const;
  // query i (0-based within sequence b) sees key j
  bool sees(int b, int64_t i, int64_t j) const;
  const double* qrow(int b, int64_t i, int h) const { return &q[((q_start[b] + i) * Hq + h) * D]; }
  const double* krow(int b, int64_t j, int kvh) const { return &k[b][(j * Hkv + kvh) * D]; }
  const double* vrow(int b, int64_t j, int kvh) const { return &v[b][(j * Hkv + kvh) * D]; }
};

struct Result {
  std::vector<double> out;  // [total_q][Hq][D]
  std::vector<double> lse;  // [Hq][total_q]; -inf for rows that see nothing
};

Result dense(const Problem& P);

struct Pooled {
  int bs = 0;
  std::vector<int64_t> cu_blocks;      // [B+1]
  std::vector<int64_t> count;          // [total_blocks] valid tokens of each block
  std::vector<double> k_mean, v_mean;  // [total_blocks][Hkv][D]
};
Pooled pool(const Problem& P, int bs);

struct Segment {
  int b = 0, kvh = 0, t = 0;
  int64_t row_begin = 0, row_end = 0;  // packed rows [row_begin, row_end)
};
// Segments in contract order: id = offset(b) + kvh * T_b + t.
std::vector<Segment> segments(const Problem& P);
int64_t num_tiles(const Problem& P, int b);

// Per (segment, block): visible = some row of the tile sees a key of the block; prunable = every row of the tile sees
// every valid key of the block.
struct TileBlocks {
  std::vector<char> visible, prunable;
};
TileBlocks analyze(const Problem& P, const Segment& s, int bs);

struct SelParams {
  double alpha = 0.1;
  int bs = 128, sink = 256, window = 512, last_n = 2;
  // The per-row rule (SelectionRule::kRowMax): keep J iff max over the rows r that see J of (s_rJ - max_J' s_rJ')
  // >= ln(alpha). Selection::energy then holds that per-block maximum and threshold ln(alpha).
  bool row_max = false;
  double dense_fraction = 1.0;  // the dense rule (SelectionParams::dense_fraction); 1: off
};

struct Selection {
  std::vector<std::vector<int>> lists;      // per segment, ascending
  std::vector<std::vector<int>> forced;     // per segment: always-kept blocks (subset of lists)
  std::vector<std::vector<int>> ambiguous;  // per segment: threshold ties (|E - alpha max E| <= 1e-6 rel; row_max:
                                            // |C - ln alpha| <= 1e-9)
  std::vector<std::vector<double>> energy;  // per segment per block (0 for invisible)
  std::vector<double> threshold;            // per segment: alpha * max E (row_max: ln alpha)
  int64_t kept = 0, visible = 0;
  // The dense rule turned the lists into every visible block; ambiguous: threshold ties decide whether it does.
  bool dense = false, dense_ambiguous = false;
};
// Scores use the pooled means rounded to float32 (the contract's k_mean is float32).
Selection select(const Problem& P, const Pooled& pooled, const SelParams& sp);

// Sparse attention over per-segment block lists (any lists of valid block ids), with optional mean correction.
Result sparse(const Problem& P, const Pooled& pooled, const std::vector<std::vector<int>>& lists, bool correction);

// Union per (sequence, KV head) of the lists of all its tiles, then the dense rule (below); returned per segment.
std::vector<std::vector<int>> union_lists(const Problem& P, const std::vector<std::vector<int>>& lists, int bs,
                                          double dense_fraction);

// The dense rule (SelectionParams::dense_fraction): lists that keep at least that fraction of the visible blocks
// (summed over segments) become every segment's visible blocks. Returns whether it applied.
bool dense_rule(const Problem& P, int bs, double dense_fraction, std::vector<std::vector<int>>& lists);

// sum over segments of |list ∩ visible(tile)|
int64_t count_kept(const Problem& P, int bs, const std::vector<std::vector<int>>& lists);

}  // namespace naive64
