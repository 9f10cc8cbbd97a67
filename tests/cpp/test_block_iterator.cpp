// Host-side exhaustive check of the block iterators (src/cuda/attention/block_schedule.h), the producer/consumer seam.
// Dense: every visible (row, key) lies in a visited block, a block reported as needing no mask is fully visible to
// every valid row of the tile, and the per-row column range used by the mask equals the visibility rule of docs/semantics.md.
// Sparse: for random CSR lists (block sizes 128 and 256, many chunk counts), the real steps visit exactly the listed
// blocks' keys, an unmasked step is fully visible to every row, and the correction steps (chunks x listed bits)
// select exactly the blocks docs/semantics.md corrects: fully visible to the whole tile and not listed.
#include <algorithm>
#include <cstdio>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "cuda/attention/block_schedule.h"
#include "cuda/split_kv/rule.h"

namespace {

using sparse_prefill::cuda::DenseBlockIterator;
using sparse_prefill::cuda::SeqSpan;
using sparse_prefill::cuda::SparseBlockIterator;

// Returns the number of failures.
long check_sparse(long& checked) {
  constexpr int N = 128;
  using It = SparseBlockIterator<N>;
  std::mt19937 rng(7);
  long failures = 0;
  const int lens[][2] = {{1, 1},         {129, 129},   {1763, 1763}, {300, 4100}, {5000, 5000},
                         {40000, 40000}, {100, 20000}, {2000, 1000}, {9000, 9000}};
  for (const auto& l : lens)
    for (int bs : {128, 256})
      for (int g : {1, 4, 8})
        for (double keep : {0.0, 0.05, 0.5, 1.0}) {
          const int lq = l[0], lk = l[1], diag = lk - lq;
          const int nb = (lk + bs - 1) / bs;
          const int tiles = (lq * g + 127) / 128;
          for (int t = 0; t < tiles; t += std::max(1, tiles / 7)) {
            const int p_first = t * 128 / g, p_last = (std::min(t * 128 + 128, lq * g) - 1) / g;
            std::vector<int> ids;
            for (int J = 0; J < nb; ++J)
              if (std::uniform_real_distribution<double>(0, 1)(rng) < keep) ids.push_back(J);
            for (bool corr : {true, false}) {
              const It it = It::make(ids.data(), int(ids.size()), p_first, lq, lk, bs, corr);
              // Expected corrected set: fully visible to every row of the tile and not listed.
              std::set<int> expect, got, listed(ids.begin(), ids.end());
              const int first_hi = std::min(p_first + diag, lk - 1);
              for (int J = 0; corr && J < nb; ++J) {
                const int last_key = std::min(J * bs + bs, lk) - 1;
                if (first_hi >= 0 && last_key <= first_hi && !listed.count(J)) expect.insert(J);
              }
              // The split plan sizes tiles from planned_steps without scanning the list: an upper bound.
              if (It::planned_steps(int(ids.size()), p_first, lq, lk, bs, corr) != it.n_real + it.n_chunks ||
                  it.total() > it.n_real + it.n_chunks)
                ++failures;
              std::set<int> keys_real;  // kernel blocks visited by real steps
              // Split-KV: the units' ranges tile [0, total) in order.
              for (int S : {1, 3, 8}) {
                int next = 0;
                for (int sp = 0; sp < S; ++sp) {
                  It u = it;
                  u.split(sp, S);
                  if (u.i_begin != next || u.count() < 0) ++failures;
                  next = u.i_begin + u.count();
                  for (int i = 0; i < u.count(); ++i)
                    if (u.is_corr(i) != it.is_corr(u.i_begin + i) ||
                        (!u.is_corr(i) && u.block(i) != it.block(u.i_begin + i)) ||
                        (u.is_corr(i) && u.chunk(i) != it.chunk(u.i_begin + i)))
                      ++failures;
                }
                if (next != it.total()) ++failures;
              }
              int cursor = 0;
              for (int i = 0; i < it.count(); ++i) {
                ++checked;
                if (!it.is_corr(i)) {
                  const int n = it.block(i);
                  if (n >= 0) keys_real.insert(n);
                  if (n >= 0 && !it.needs_mask(i, n)) {  // every row sees every key of the step
                    const int c1 = n * N + N - 1;
                    if (c1 >= lk || c1 > p_first + diag) {
                      if (failures < 5) std::printf("FAIL mask\n");
                      ++failures;
                    }
                  }
                  if (i > 0 && !it.is_corr(i - 1) && it.block(i - 1) >= 0 && n > it.block(i - 1)) {
                    if (failures < 5) std::printf("FAIL order %d %d\n", n, it.block(i - 1));
                    ++failures;
                  }
                } else {
                  const int c = it.chunk(i);
                  uint32_t bits[4];
                  it.listed_bits(c, bits, cursor);
                  int todo = 0;
                  for (int j = 0; j < N; ++j) {
                    const int J = c * N + j;
                    if (J < it.n_prunable && !((bits[j / 32] >> (j % 32)) & 1u)) {
                      got.insert(J);
                      ++todo;
                    }
                  }
                  if (todo == 0) {
                    if (failures < 5) std::printf("FAIL empty chunk %d lq=%d lk=%d\n", c, lq, lk);
                    ++failures;
                  }
                }
              }
              std::set<int> keys_expect;
              for (int J : ids)
                for (int s = 0; s < bs / N; ++s)
                  if ((J * (bs / N) + s) * N < lk) keys_expect.insert(J * (bs / N) + s);
              if (got != expect || keys_real != keys_expect) {
                if (failures < 10)
                  std::printf(
                      "FAIL sparse lq=%d lk=%d bs=%d g=%d keep=%.2f tile=%d corr=%d: corrected %zu vs %zu, "
                      "blocks %zu vs %zu\n",
                      lq, lk, bs, g, keep, t, int(corr), got.size(), expect.size(), keys_real.size(),
                      keys_expect.size());
                ++failures;
              }
              (void)p_last;
            }
          }
        }
  return failures;
}

// Dense attention through the sparse kernel (the full list, SparseFwdArgs::full_list): for every PackGQA tile, causal
// (bottom-right) and non-causal, the steps visit exactly the key blocks some row of the tile sees (each once, in
// descending order); a step reported as needing no mask is fully visible to every row; the per-row column range is the
// visibility rule; the split units cover the steps in order.
long check_full_list(long& checked) {
  constexpr int N = 128;
  using It = SparseBlockIterator<N>;
  long failures = 0;
  const std::vector<int> lens = {1, 2, 11, 127, 128, 129, 300, 1000, 1763, 4100};
  for (int lq : lens)
    for (int lk : lens)
      for (int g : {1, 4, 8, 16})
        for (bool causal : {true, false}) {
          const int diag = lk - lq;
          for (int t = 0; t < It::packed_tiles(lq, g); ++t) {
            const int row0 = t * It::kTileRows, rows = std::min(It::kTileRows, lq * g - row0);
            const int p_first = row0 / g;
            const int n = It::full_list_blocks(row0, g, lq, lk, causal);
            It it = It::make(nullptr, n, p_first, lq, lk, N, false);
            if (!causal) it.make_non_causal();
            if (It::planned_steps(n, p_first, lq, lk, N, false) != it.total()) ++failures;
            std::vector<int> seen((lk + N - 1) / N, 0);
            for (int i = 0; i < it.count(); ++i) {
              const int b = it.block(i);
              if (b < 0 || b >= int(seen.size()) || (i > 0 && b != it.block(i - 1) - 1) || it.is_corr(i)) {
                if (failures++ < 10) std::printf("FAIL full list order lq=%d lk=%d g=%d t=%d\n", lq, lk, g, t);
                continue;
              }
              seen[b] = it.needs_mask(i, b) ? 2 : 1;
            }
            for (int r = 0; r < rows; ++r) {
              const int pos = (row0 + r) / g;
              int lo, hi;
              it.col_range(pos, lo, hi);
              for (int c = 0; c < lk; ++c) {
                const bool ref = !causal || c <= pos + diag;
                bool ok = (lo <= c && c <= hi) == ref;
                if (ref && seen[c / N] == 0) ok = false;   // a visible key in a block never visited
                if (!ref && seen[c / N] == 1) ok = false;  // an unmasked step with an invisible key
                ++checked;
                if (!ok && failures++ < 10)
                  std::printf("FAIL full list lq=%d lk=%d g=%d causal=%d tile=%d row=%d col=%d\n", lq, lk, g,
                              int(causal), t, r, c);
              }
            }
            for (int b = 0; b < int(seen.size()); ++b) {  // no visited block without a visible key
              if (seen[b] == 0) continue;
              bool any = false;
              for (int r = 0; r < rows && !any; ++r) {
                const int pos = (row0 + r) / g;
                any = !causal || b * N <= pos + diag;
              }
              if (!any && failures++ < 10) std::printf("FAIL full list extra block lq=%d lk=%d t=%d b=%d\n", lq, lk, t, b);
            }
            for (int S : {1, 3, 32}) {
              int next = 0;
              for (int sp = 0; sp < S; ++sp) {
                It u = it;
                u.split(sp, S);
                for (int i = 0; i < u.count(); ++i)
                  if (u.block(i) != it.block(u.i_begin + i)) ++failures;
                if (u.i_begin != next) ++failures;
                next = u.i_begin + u.count();
              }
              if (next != it.total()) ++failures;
            }
          }
        }
  return failures;
}

// The split plan's workspace bounds (fewer than SMs split tiles and 2 * SMs split units) for step distributions from uniform to one huge tile among many tiny ones, and tiny totals (cap = kMinCap).
long check_split_rule() {
  using sparse_prefill::cuda::SplitRule;
  std::mt19937 rng(11);
  long failures = 0;
  for (int sms : {1, 8, 132})
    for (int trial = 0; trial < 400; ++trial) {
      const int tiles = 1 + int(rng() % 5000);
      std::vector<int> steps(tiles);
      const int kind = trial % 4;
      for (int& s : steps) {
        if (kind == 0) s = int(rng() % 64);
        else if (kind == 1) s = (rng() % 50 == 0) ? 1032 : int(rng() % 20);
        else if (kind == 2) s = int(rng() % 3000);
        else s = (rng() % 2 == 0) ? 0 : 40;
      }
      unsigned long long total = 0;
      for (int s : steps) total += s;
      const int cap = SplitRule::cap(total, sms);
      long units = 0, split_tiles = 0;
      for (int s : steps) {
        const int n = SplitRule::nsplit(s, cap);
        if (n < 1 || n > SplitRule::kMaxSplits || (s <= cap) != (n == 1)) ++failures;
        if (n > 1) {
          units += n;
          ++split_tiles;
        }
      }
      if ((units > 0 && units >= 2L * sms) || (split_tiles > 0 && split_tiles >= long(sms))) {
        if (failures < 5) std::printf("FAIL split bound: %ld units, %ld tiles, %d SMs\n", units, split_tiles, sms);
        ++failures;
      }
    }
  return failures;
}

long check_dense(long& checked_out) {
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
              if (ref && i < 0) ok = false;                         // visible key in a block that is not visited
              if (i >= 0 && !it.needs_mask(i, it.block(i)) && !ref) ok = false;  // unmasked, an invisible key
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
  checked_out = checked;
  return failures;
}

// An overflowed segment of a device index (kOverflowStart: the full list, ids == nullptr) runs the same real steps
// as the explicit list 0 .. n - 1 of every block its tile sees, in block_size units, and no correction step (every
// prunable block is listed); planned_steps stays an upper bound of its steps.
long check_overflowed_segment(long& checked) {
  constexpr int N = 128;
  using It = SparseBlockIterator<N>;
  long failures = 0;
  const std::vector<int> lens = {1, 127, 129, 300, 1763, 4100, 20000};
  for (int lq : lens)
    for (int lk : lens)
      for (int bs : {128, 256})
        for (int g : {1, 4, 8})
          for (bool corr : {true, false})
            for (int t = 0; t < It::packed_tiles(lq, g); t += std::max(1, It::packed_tiles(lq, g) / 9)) {
              const int row0 = t * It::kTileRows, p_first = row0 / g;
              const int p_last = (std::min(row0 + It::kTileRows, lq * g) - 1) / g;
              const int n = It::full_list_blocks(row0, g, lq, lk, true, bs);
              const int hi = std::min(lk - 1, p_last + lk - lq);  // the last key the tile sees
              const int expect_n = hi < 0 ? 0 : hi / bs + 1;
              std::vector<int> ids(n);
              for (int J = 0; J < n; ++J) ids[J] = J;
              const It full = It::make(nullptr, n, p_first, lq, lk, bs, corr);
              const It listed = It::make(ids.data(), n, p_first, lq, lk, bs, corr);
              bool ok = n == expect_n && full.n_real == listed.n_real && full.total() == full.n_real &&
                        listed.total() == listed.n_real &&
                        It::planned_steps(n, p_first, lq, lk, bs, corr) >= full.total();
              for (int i = 0; ok && i < full.n_real; ++i) {
                ok = full.block(i) == listed.block(i) &&
                     full.needs_mask(i, full.block(i)) == listed.needs_mask(i, listed.block(i));
              }
              ++checked;
              if (!ok && failures++ < 10)
                std::printf("FAIL overflowed segment lq=%d lk=%d bs=%d g=%d corr=%d t=%d n=%d expect %d\n", lq, lk, bs,
                            g, int(corr), t, n, expect_n);
            }
  return failures;
}

}  // namespace

// Host-side exhaustive check of the CUDA kernel's block iterators (the seam between producer and consumers) and of
// the split rule's workspace bounds: no GPU needed.
TEST(BlockIterator, DenseRangeCoversExactlyTheVisibleKeys) {
  long checked = 0;
  EXPECT_EQ(check_dense(checked), 0);
  EXPECT_GT(checked, 0);
}

TEST(BlockIterator, SparseListAndCorrectionSteps) {
  long checked = 0;
  EXPECT_EQ(check_sparse(checked), 0);
  EXPECT_GT(checked, 0);
}

TEST(BlockIterator, FullListOfPackGqaTiles) {
  long checked = 0;
  EXPECT_EQ(check_full_list(checked), 0);
  EXPECT_GT(checked, 0);
}

TEST(BlockIterator, OverflowedSegmentRunsTheFullList) {
  long checked = 0;
  EXPECT_EQ(check_overflowed_segment(checked), 0);
  EXPECT_GT(checked, 0);
}

TEST(BlockIterator, SplitRuleWorkspaceBounds) { EXPECT_EQ(check_split_rule(), 0); }

// The sparse work order (sparse_tile_coord): a bijection of [0, H * B * T) onto (KV head, sequence, tile) for every
// band; band 1 is KV heads fastest; within a band the (sequence, tile) pairs stay in [first, first + band), so the
// heaviest-first order holds band by band, and the items of one band run one KV head after the other.
TEST(BlockIterator, SparseWorkOrderBands) {
  using sparse_prefill::cuda::sparse_tile_coord;
  for (int heads : {1, 3, 8})
    for (int batch : {1, 2, 5})
      for (int tiles : {1, 7, 130})
        for (int band : {1, 4, 132, 1000}) {
          const int n = heads * batch * tiles, pairs = batch * tiles;
          std::vector<int> seen(n, 0);
          int prev_head = 0;
          for (int t = 0; t < n; ++t) {
            const auto c = sparse_tile_coord(t, heads, batch, tiles, band);
            ASSERT_TRUE(c.kv_head >= 0 && c.kv_head < heads && c.batch >= 0 && c.batch < batch && c.tile >= 0 &&
                        c.tile < tiles)
                << "t " << t << " heads " << heads << " batch " << batch << " tiles " << tiles << " band " << band;
            ++seen[(c.kv_head * batch + c.batch) * tiles + c.tile];
            const int r = c.batch + batch * (tiles - 1 - c.tile), first = (t / (band * heads)) * band;
            EXPECT_TRUE(r >= first && r < std::min(first + band, pairs)) << "t " << t << " band " << band;
            if (band == 1) EXPECT_EQ(c.kv_head, t % heads);
            if (t % (band * heads) == 0) prev_head = 0;
            EXPECT_GE(c.kv_head, prev_head) << "t " << t << " band " << band;  // heads in turn within a band
            prev_head = c.kv_head;
          }
          for (int i = 0; i < n; ++i) ASSERT_EQ(seen[i], 1) << "item " << i << " band " << band;
        }
}
