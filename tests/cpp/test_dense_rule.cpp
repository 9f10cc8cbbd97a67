// The dense rule (SelectionParams::dense_fraction) and the per-query-head default (head_subgroups 0): a selection that
// keeps at least dense_fraction of its visible blocks keeps them all (every segment's full list), in the one-shot and
// union modes, against naive64's own implementation; sparse attention over it is dense attention; bad fractions are
// refused naming the argument.
#include "test_util.h"

namespace sptest {
namespace {

const DType F32 = DType::kFloat32, BF16 = DType::kBFloat16;

// The raw selection's kept / visible counts (dense rule off).
std::pair<int64_t, int64_t> raw_counts(Built& B, SelectionParams p) {
  p.dense_fraction = 1.f;
  const BlockIndex idx = build_index(B.in, p);
  return {idx.kept_blocks, idx.visible_blocks};
}

// Every segment lists exactly the blocks its tile sees (naive64's analysis), in order.
void expect_full_lists(const Built& B, const BlockIndex& idx, int bs) {
  const std::vector<naive64::Segment> segs = naive64::segments(B.np);
  ASSERT_EQ(idx.segment_start.size(), segs.size());
  const std::vector<std::vector<int>> got = lists_of(idx);
  for (size_t s = 0; s < segs.size(); ++s) {
    const naive64::TileBlocks tb = naive64::analyze(B.np, segs[s], bs);
    std::vector<int> want;
    for (int J = 0; J < int(tb.visible.size()); ++J)
      if (tb.visible[J]) want.push_back(J);
    EXPECT_EQ(got[s], want) << "segment " << s;
  }
  EXPECT_EQ(idx.kept_blocks, idx.visible_blocks);
  EXPECT_DOUBLE_EQ(idx.density(), 1.0);
}

// At the raw selection's own density the rule fires (>=); just above it, it does not and the index is the raw one.
TEST(DenseRule, FiresAtTheFractionAndNotAbove) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  auto B = build(sc(4, 1, 64, F32, {1500}, {1500}, false, 1), rng);
  SelectionParams p = sp(0.3f, 64, 64, 64, 1);
  const auto [kept, visible] = raw_counts(*B, p);
  ASSERT_LT(kept, visible) << "the raw selection must prune something for the test to mean anything";
  const float at = float(double(kept) / double(visible));
  // the largest float whose product with visible does not exceed kept: the rule fires exactly there
  float f = at;
  while (double(f) * double(visible) > double(kept)) f = std::nextafter(f, 0.f);
  p.dense_fraction = f;
  const BlockIndex fired = build_index(B->in, p);
  expect_full_lists(*B, fired, 64);
  naive64::Selection S = naive64::select(B->np, naive64::pool(B->np, 64), naive_params(p));
  EXPECT_TRUE(S.dense);
  EXPECT_EQ(lists_of(fired), S.lists);

  p.dense_fraction = std::nextafter(float(double(kept + 1) / double(visible)), 1.f);
  const BlockIndex raw = build_index(B->in, p);
  EXPECT_EQ(raw.kept_blocks, kept);
  EXPECT_EQ(raw.visible_blocks, visible);
  naive64::Selection R = naive64::select(B->np, naive64::pool(B->np, 64), naive_params(p));
  EXPECT_FALSE(R.dense);
  if (!R.dense_ambiguous) EXPECT_EQ(compare_selection(*B, raw, R, p), 0);
}

// Sparse attention over a fired index is dense attention (same kernel path as any index: every block listed).
TEST(DenseRule, SparseAttentionOverAFiredIndexIsDense) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  auto B = build(sc(8, 2, 64, BF16, {300, 77}, {900, 500}, true, 16), rng);
  SelectionParams p = sp(0.3f, 64, 0, 64, 1);
  p.dense_fraction = 0.01f;  // any selection fires
  const BlockIndex idx = build_index(B->in, p);
  expect_full_lists(*B, idx, 64);
  sparse_attention(B->in, view_of(const_cast<BlockIndex&>(idx)), B->outputs());
  expect_matches(*B, naive64::dense(B->np), true, "sparse_attention over the dense rule's index");
}

// Union mode: the rule applies to the union (its kept count), here where the per-tile lists alone do not fire it.
TEST(DenseRule, UnionFiresOnTheUnion) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  auto B = build(sc(8, 1, 64, F32, {129}, {1763}, true, 64), rng);
  SelectionParams p = sp(0.2f, 64, 64, 64, 1);
  const auto [kept, visible] = raw_counts(*B, p);
  p.union_lists = true;
  const auto [ukept, uvisible] = raw_counts(*B, p);
  ASSERT_EQ(uvisible, visible);
  ASSERT_LT(kept, ukept) << "the union must add blocks for the test to mean anything";
  p.dense_fraction = float((double(kept) + double(ukept)) / 2.0 / double(visible));  // between the two
  const BlockIndex u = build_index(B->in, p);
  expect_full_lists(*B, u, 64);
  // the same through union_index() of the per-tile index (its binding carries dense_fraction)
  SelectionParams tiles = p;
  tiles.union_lists = false;
  const BlockIndex t = build_index(B->in, tiles);
  EXPECT_LT(t.kept_blocks, t.visible_blocks);
  const BlockIndex u2 = union_index(B->in, t);
  EXPECT_EQ(lists_of(u2), lists_of(u));
  naive64::Selection S = naive64::select(B->np, naive64::pool(B->np, 64), naive_params(tiles));
  if (!S.dense_ambiguous) EXPECT_EQ(naive64::union_lists(B->np, S.lists, 64, p.dense_fraction), lists_of(u));
}

TEST(DenseRule, BadFractionNamesTheArgument) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  auto B = build(sc(4, 1, 64, F32, {300}, {300}, false, 1), rng);
  for (float f : {0.f, -0.5f, 1.0001f, 2.f, std::numeric_limits<float>::quiet_NaN()}) {
    SelectionParams p;
    p.dense_fraction = f;
    EXPECT_ARG_ERROR(build_index(B->in, p), "dense_fraction") << " fraction " << f;
    EXPECT_ARG_ERROR(sparse_prefill::sparse_prefill(B->in, p, B->outputs()), "dense_fraction") << " fraction " << f;
  }
}

// head_subgroups 0 (the default) is one selection per query head: the index of head_subgroups = g.
TEST(Defaults, PerQueryHeadSelection) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (const Case& c : {sc(8, 2, 64, F32, {700}, {700}, false, 1), sc(6, 2, 128, BF16, {300, 41}, {900, 41}, true, 16)}) {
    SCOPED_TRACE(c.str());
    auto B = build(c, rng);
    SelectionParams d;
    ASSERT_EQ(d.head_subgroups, 0);
    SelectionParams g = d;
    g.head_subgroups = c.Hq / c.Hkv;
    const BlockIndex a = build_index(B->in, d), b = build_index(B->in, g);
    EXPECT_EQ(a.num_subgroups, g.head_subgroups);
    EXPECT_EQ(a.group_size, 1);
    EXPECT_EQ(a.num_kv_heads, c.Hq);
    EXPECT_EQ(lists_of(a), lists_of(b));
    EXPECT_EQ(a.kept_blocks, b.kept_blocks);
    EXPECT_EQ(a.binding.num_subgroups, g.head_subgroups);
  }
}

}  // namespace
}  // namespace sptest
