// The per-row selection rule (SelectionRule::kRowMax): keep J iff max over the rows r of the tile that see J of
// (s_rJ - m_r) >= ln(alpha), m_r the row's maximum score. build_index (the reference) against naive64 (its own
// float64 implementation of the rule), in every mode: varlen, GQA (odd groups too), paged, attention windows, head
// sub-groups, union mode, chunks; properties of the rule (every row's top block is kept, monotone in alpha, alpha = 0
// equals dense); validation of the rule value.
#include "test_util.h"

namespace sptest {
namespace {

const DType F32 = DType::kFloat32, F16 = DType::kFloat16, BF16 = DType::kBFloat16;

SelectionParams rowmax(SelectionParams p) {
  p.rule = SelectionRule::kRowMax;
  return p;
}

int64_t check_rowmax(const Case& c, SelectionParams p, std::mt19937_64& rng) {
  // the given alpha, and high ones at which the small workloads here prune (the rule keeps more than the tile rule)
  p = rowmax(p);
  auto B = build(c, rng);
  const naive64::Pooled pl = naive64::pool(B->np, p.block_size);
  int64_t flips = 0;
  for (float alpha : {p.alpha, 0.9f, 1.0f}) {
    p.alpha = alpha;
    const BlockIndex idx = build_index(B->in, p);
    naive64::SelParams np = naive_params(p);
    if (!p.final_chunk) np.last_n = 0;  // final_chunk = false: the rules with last_n 0 (docs/semantics.md)
    const naive64::Selection S = naive64::select(B->np, pl, np);
    const int64_t f = compare_selection(*B, idx, S, p);
    std::cout << "[rowmax] " << c.str() << " alpha " << p.alpha << ": density " << idx.density() << " ("
              << idx.kept_blocks << "/" << idx.visible_blocks << ")" << (f ? ", ties flipped " : "")
              << (f ? std::to_string(f) : std::string()) << "\n";
    flips += f;
  }
  return flips;
}

TEST(RowMax, MatchesNaive64) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  check_rowmax(sc(4, 1, 64, F32, {1763}, {1763}, false, 1), sp(0.1f, 128, 128, 128, 1), rng);
  check_rowmax(sc(8, 1, 64, BF16, {129}, {1763}, true, 64), sp(0.2f, 64, 64, 64, 1), rng);  // chunk, paged
  check_rowmax(sc(2, 2, 64, F32, {11, 127, 300}, {11, 500, 300}, true, 16), sp(0.5f, 64, 0, 0, 0), rng);  // varlen
  check_rowmax(sc(4, 1, 64, F16, {400}, {450}, false, 1, false, 200, 30), sp(0.1f, 64, 64, 64, 1), rng);  // window
  check_rowmax(sc(4, 2, 64, F32, {300}, {700}, true, 1, true, 333, -1), sp(0.3f, 64, 0, 100, 0), rng);
  check_rowmax(sc(3, 1, 64, F32, {300}, {700}, true, 16), sp(0.5f, 64, 0, 64, 0), rng);  // g = 3 straddles tiles
  check_rowmax(sc(12, 2, 64, BF16, {200, 43}, {600, 300}, false, 1), sp(0.5f, 64, 64, 0, 1), rng);
  check_rowmax(sc(4, 1, 64, F32, {300}, {129}, false, 1), sp(0.3f, 64, 0, 0, 0), rng);  // Lq > Lk
  check_rowmax(sc(8, 2, 128, BF16, {129}, {1000}, true, 128), defaults_per_group(), rng);
  check_rowmax(sc(4, 1, 64, F32, {0, 70, 5}, {64, 130, 0}, false, 1), sp(0.5f, 64, 0, 0, 0), rng);  // empty seqs
  check_rowmax(sc(4, 1, 64, F32, {1000}, {1500}, true, 64), sp(1.0f, 64, 0, 0, 0), rng);  // alpha 1: the row tops
  Case u = sc(4, 1, 64, F32, {700}, {900}, false, 1);
  u.structured = false;  // Gaussian
  check_rowmax(u, sp(0.9f, 192, 0, 1, 0), rng);
}

// The rule prunes something on these workloads (else the comparisons above are vacuous) and is not the tile rule.
TEST(RowMax, PrunesAndDiffersFromTileEnergy) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  auto B = build(sc(4, 1, 64, F32, {1500}, {1500}, false, 1), rng);
  const SelectionParams tile = sp(0.3f, 64, 0, 0, 0);
  const BlockIndex a = build_index(B->in, tile), r = build_index(B->in, rowmax(tile));
  EXPECT_LT(r.density(), 1.0);
  EXPECT_NE(lists_of(a), lists_of(r));
}

// Every row's top block (s_rJ = m_r) passes at any alpha; lists grow as alpha falls.
TEST(RowMax, KeepsEveryRowsTopBlockAndIsMonotone) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  Case c = sc(6, 2, 64, F32, {333, 200}, {900, 200}, true, 16);
  auto B = build(c, rng);
  const naive64::Problem& P = B->np;
  const naive64::Pooled pl = naive64::pool(P, 64);
  std::vector<std::vector<int>> prev;
  for (float alpha : {1.0f, 0.5f, 0.1f, 0.01f, 0.0f}) {
    SCOPED_TRACE("alpha " + std::to_string(alpha));
    const SelectionParams p = rowmax(sp(alpha, 64, 0, 0, 0));
    const BlockIndex idx = build_index(B->in, p);
    const auto lists = lists_of(idx);
    const naive64::Selection S = naive64::select(P, pl, naive_params(p));
    compare_selection(*B, idx, S, p);
    const auto segs = naive64::segments(P);
    for (size_t s = 0; s < segs.size(); ++s) {
      for (size_t J = 0; J < S.energy[s].size(); ++J)  // C_J = 0: the top block of some row
        if (S.energy[s][J] == 0.0)
          EXPECT_TRUE(std::binary_search(lists[s].begin(), lists[s].end(), int(J))) << "segment " << s << " block " << J;
      if (!prev.empty())
        EXPECT_TRUE(std::includes(lists[s].begin(), lists[s].end(), prev[s].begin(), prev[s].end()))
            << "segment " << s << ": " << list_str(lists[s]) << " misses blocks of " << list_str(prev[s]);
    }
    prev = lists;
  }
}

// alpha = 0 keeps every visible block and sparse attention then equals dense attention.
TEST(RowMax, AlphaZeroEqualsDense) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (bool causal : {true, false}) {
    Case c = sc(4, 1, 64, F32, {300, 11}, {500, 200}, true, 16, causal, causal ? -1 : 100, causal ? -1 : 20);
    auto B = build(c, rng);
    const SelectionParams p = rowmax(sp(0.0f, 64, 0, 0, 0));
    const BlockIndex idx = build_index(B->in, p);
    EXPECT_EQ(idx.kept_blocks, idx.visible_blocks);
    EXPECT_DOUBLE_EQ(idx.density(), 1.0);
    for (bool corr : {true, false}) {
      BlockIndex i2 = idx;
      i2.correction = corr;
      sparse_attention(B->in, view_of(i2), B->outputs());
      expect_matches(*B, naive64::dense(B->np), true, std::string("rowmax alpha 0 vs dense, correction ") +
                                                          (corr ? "on" : "off"));
    }
  }
}

// Union mode: the union of naive64's per-tile lists; sparse attention over it against naive64.
TEST(RowMax, UnionMode) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  struct UC {
    Case c;
    SelectionParams p;
  };
  const UC cases[] = {
      {sc(8, 1, 64, BF16, {129}, {1763}, true, 64), sp(0.2f, 64, 64, 64, 1)},
      {sc(8, 2, 64, F32, {300, 64}, {900, 500}, true, 16), sp(0.3f, 128, 128, 128, 1)},
      {sc(6, 2, 64, F32, {150}, {900}, true, 16), sp(0.5f, 64, 0, 64, 0)},
  };
  for (const UC& uc : cases) {
    SCOPED_TRACE(uc.c.str());
    auto B = build(uc.c, rng);
    SelectionParams p = rowmax(uc.p);
    const naive64::Pooled pl = naive64::pool(B->np, p.block_size);
    const naive64::Selection S = naive64::select(B->np, pl, naive_params(p));
    const BlockIndex tiles = build_index(B->in, p);
    const int64_t flips = compare_selection(*B, tiles, S, p);
    p.union_lists = true;
    BlockIndex u = build_index(B->in, p);
    const auto exp = naive64::union_lists(B->np, S.lists, p.block_size, p.dense_fraction);
    if (flips == 0) EXPECT_EQ(lists_of(u), exp);
    EXPECT_EQ(lists_of(u), lists_of(union_index(B->in, tiles)));
    EXPECT_EQ(u.kept_blocks, naive64::count_kept(B->np, p.block_size, lists_of(u)));
    for (bool corr : {true, false}) {
      u.correction = corr;
      sparse_attention(B->in, view_of(u), B->outputs());
      expect_matches(*B, naive64::sparse(B->np, pl, lists_of(u), corr), true,
                     std::string("rowmax union, correction ") + (corr ? "on" : "off"));
    }
  }
}

// Chunked prefill: the chunks of one prompt over a paged cache (final_chunk only on the last), per-tile and union.
TEST(RowMax, ChunkedSteps) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (int done : {0, 256, 640}) {
    const int chunk = 256;
    Case c = sc(8, 2, 64, BF16, {chunk}, {done + chunk}, true, 64);
    SelectionParams p = sp(0.1f, 64, 64, 128, 2);
    p.final_chunk = done == 640;
    check_rowmax(c, p, rng);
  }
}

// A randomised sweep of shapes and parameters.
TEST(RowMax, RandomSweep) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  const float alphas[] = {0.f, 0.01f, 0.1f, 0.3f, 0.7f, 1.f};
  int64_t flips = 0;
  for (int it = 0; it < 30; ++it) {
    const auto [c, p] = random_selection_case(rng, [&](std::mt19937_64& r) { return alphas[r() % 6]; });
    SCOPED_TRACE(c.str());
    flips += check_rowmax(c, p, rng);
  }
  if (flips) std::cout << "[rowmax sweep] " << flips << " threshold-tie flips tolerated\n";
}

TEST(RowMax, UnknownRuleIsAnArgumentError) {
  std::mt19937_64 rng(1);
  auto B = build(sc(4, 1, 64, F32, {100}, {100}, false, 1), rng);
  SelectionParams p;
  p.rule = static_cast<SelectionRule>(6);
  EXPECT_ARG_ERROR(build_index(B->in, p), "rule");
  p.rule = static_cast<SelectionRule>(-1);
  EXPECT_ARG_ERROR(build_index(B->in, p), "rule");
}

}  // namespace
}  // namespace sptest
