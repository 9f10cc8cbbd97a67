// sparse_attention against naive64::sparse over the same block lists (the reference's own index, random lists, lists
// that drop diagonal blocks), with and without mean correction; alpha = 0 / every block listed equals dense.
#include "test_util.h"

namespace sptest {
namespace {

const DType F32 = DType::kFloat32, F16 = DType::kFloat16, BF16 = DType::kBFloat16;



// Reference index -> reference sparse_attention vs naive64::sparse with the same lists.
void check_sparse(const Case& c, SelectionParams p, bool with_lse = true) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  auto B = build(c, rng);
  p.correction = true;  // V means for the runs with the correction (the selection does not depend on it)
  BlockIndex idx = build_index(B->in, p);
  naive64::Pooled pl = naive64::pool(B->np, p.block_size);
  for (bool corr : {true, false}) {
    BlockIndex ix = idx;
    ix.correction = corr;
    BlockIndexView view = view_of(ix);
    sparse_attention(B->in, view, B->outputs(with_lse));
    expect_matches(*B, naive64::sparse(B->np, pl, lists_of(ix), corr), with_lse,
                   std::string("sparse_attention correction=") + (corr ? "on" : "off") + " density=" +
                       std::to_string(idx.density()));
  }
}

TEST(Sparse, L1763_GQA4_F32) { check_sparse(sc(4, 1, 64, F32, {1763}, {1763}, false, 1), sp(0.1f, 128, 128, 128, 1, true)); }
TEST(Sparse, Chunk_GQA8_BF16_Paged64) {
  check_sparse(sc(8, 1, 64, BF16, {129}, {1763}, true, 64), sp(0.2f, 64, 64, 64, 1, true));
}
TEST(Sparse, Varlen_F16_Paged16_NoLse) {
  check_sparse(sc(2, 2, 64, F16, {11, 127, 300}, {11, 500, 300}, true, 16), sp(0.5f, 64, 0, 0, 0, true), false);
}
TEST(Sparse, NonCausalWindow) {
  check_sparse(sc(4, 1, 64, F32, {400}, {450}, true, 1, false, 200, 30), sp(0.2f, 64, 64, 64, 1, true));
}
TEST(Sparse, CausalLeftWindow_D128) {
  check_sparse(sc(4, 2, 128, BF16, {300}, {700}, true, 128, true, 333, -1), sp(0.3f, 128, 0, 100, 0, true));
}
TEST(Sparse, L1763_GQA8_D128_Paged128_Defaults) {
  check_sparse(sc(8, 1, 128, BF16, {1763}, {1763}, true, 128), defaults_per_group());
}
TEST(Sparse, ManyHeadsNoGQA) { check_sparse(sc(8, 8, 64, F32, {200}, {400}, true, 64), sp(0.5f, 64, 0, 0, 0, true)); }
TEST(Sparse, AllEmpty) { check_sparse(sc(4, 1, 64, F32, {0, 3}, {5, 0}, true, 16), defaults_per_group()); }
TEST(Sparse, OddGroup3) { check_sparse(sc(3, 1, 64, F32, {300}, {700}, true, 16), sp(0.5f, 64, 0, 64, 0, true)); }
TEST(Sparse, OddGroup6_TwoKVHeads) {
  check_sparse(sc(12, 2, 64, BF16, {200, 43}, {600, 300}, false, 1), sp(0.5f, 64, 64, 0, 1, true));
}
TEST(Sparse, OddGroupStraddlingPositionOpensBlock) {
  for (int off : {22, 43})
    check_sparse(sc(3, 1, 64, F32, {200}, {200 + off}, false, 1), sp(0.5f, 64, 0, 0, 0, true));
}
TEST(Sparse, LqGreaterThanLk) { check_sparse(sc(4, 1, 64, F32, {300}, {129}, false, 1), sp(0.3f, 64, 0, 0, 0, true)); }
TEST(Sparse, TailBlocks_BS192) { check_sparse(sc(4, 1, 64, F32, {500}, {700}, false, 1), sp(0.5f, 192, 0, 1, 0, true)); }
TEST(Sparse, EmptySequences) {
  check_sparse(sc(4, 1, 64, F32, {0, 70, 5, 9}, {64, 130, 0, 9}, true, 16), sp(0.5f, 64, 0, 0, 0, true));
}

// alpha = 0: every visible block listed; sparse == dense with correction on and off (naive dense and reference dense).
TEST(Sparse, AlphaZeroEqualsDense) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  std::vector<Case> cases = {sc(4, 1, 64, BF16, {1763}, {1763}, true, 64),
                             sc(8, 1, 64, F32, {129, 11}, {1000, 11}, true, 16),
                             sc(2, 2, 128, F16, {300}, {129}, false, 1),
                             sc(4, 1, 64, F32, {200}, {300}, false, 1, false, 90, 10)};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.str());
    auto B = build(c, rng);
    run_dense(*B);
    HostTensor dense_out = B->out;
    std::vector<float> dense_lse = B->lse;
    const naive64::Result R = naive64::dense(B->np);
    for (bool corr : {true, false}) {
      BlockIndex idx = build_index(B->in, sp(0.0f, 64, 0, 0, 0, corr));
      EXPECT_EQ(idx.kept_blocks, idx.visible_blocks);
      sparse_attention(B->in, view_of(idx), B->outputs());
      expect_matches(*B, R, true, std::string("sparse(alpha=0) vs naive dense, correction=") + (corr ? "on" : "off"));
      const double tol = c.dtype == F32 ? 1e-5 : 2e-2;
      EXPECT_LE(max_abs_diff(B->out, dense_out), tol) << "sparse(alpha=0) vs reference dense";
      for (size_t i = 0; i < dense_lse.size(); ++i)
        if (!(dense_lse[i] == B->lse[i] || std::fabs(dense_lse[i] - B->lse[i]) <= 1e-5 * (1 + std::fabs(dense_lse[i]))))
          FAIL() << "lse " << i << " dense " << dense_lse[i] << " sparse " << B->lse[i];
    }
  }
}

// Random lists: a random subset of the visible blocks per segment (always including the non-prunable ones, which the
// selection always keeps), with correction on and off.
TEST(Sparse, RandomListsWithCorrection) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  std::vector<Case> cases = {sc(4, 1, 64, F32, {600}, {900}, true, 16), sc(8, 2, 64, BF16, {127, 40}, {500, 300}, true, 1),
                             sc(6, 2, 64, F32, {130}, {400}, true, 16),
                             sc(4, 1, 128, F32, {333}, {333}, false, 1, true, 150, -1)};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.str());
    auto B = build(c, rng);
    for (int bs : {64, 128}) {
      BlockIndex base = build_index(B->in, sp(0.0f, bs, 0, 0, 0, true));
      naive64::Pooled pl = naive64::pool(B->np, bs);
      auto segs = naive64::segments(B->np);
      std::vector<std::vector<int>> lists(segs.size());
      for (size_t s = 0; s < segs.size(); ++s) {
        naive64::TileBlocks tb = naive64::analyze(B->np, segs[s], bs);
        for (size_t J = 0; J < tb.visible.size(); ++J)
          if (tb.visible[J] && (!tb.prunable[J] || rng() % 3 == 0)) lists[s].push_back(int(J));
      }
      for (bool corr : {true, false}) {
        BlockIndex idx = index_with_lists(base, lists, corr);
        sparse_attention(B->in, view_of(idx), B->outputs());
        expect_matches(*B, naive64::sparse(B->np, pl, lists, corr), true,
                       "sparse_attention(random lists, bs=" + std::to_string(bs) + ", correction=" +
                           (corr ? "on" : "off") + ")");
      }
    }
  }
}

// Lists that also drop non-prunable blocks (crossing the diagonal) and list invisible ones: the contract still defines
// the result (listed blocks with the token mask; correction only for prunable unlisted blocks).
TEST(Sparse, ArbitraryLists) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  Case c = sc(4, 1, 64, F32, {300, 50}, {400, 60}, true, 16);
  auto B = build(c, rng);
  BlockIndex base = build_index(B->in, sp(0.0f, 64, 0, 0, 0, true));
  naive64::Pooled pl = naive64::pool(B->np, 64);
  auto segs = naive64::segments(B->np);
  std::vector<std::vector<int>> lists(segs.size());
  for (size_t s = 0; s < segs.size(); ++s) {
    const int64_t nb = (B->np.lk[segs[s].b] + 63) / 64;
    for (int J = 0; J < nb; ++J)
      if (rng() % 2) lists[s].push_back(J);
  }
  for (bool corr : {true, false}) {
    BlockIndex idx = index_with_lists(base, lists, corr);
    sparse_attention(B->in, view_of(idx), B->outputs());
    expect_matches(*B, naive64::sparse(B->np, pl, lists, corr), true,
                   std::string("sparse_attention(arbitrary lists, correction=") + (corr ? "on" : "off") + ")");
  }
}

// Empty lists everywhere: correction on = attention over the block means of prunable blocks only; off = zeros/-inf.
TEST(Sparse, EmptyLists) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  Case c = sc(4, 1, 64, F32, {129}, {700}, false, 1);
  auto B = build(c, rng);
  BlockIndex base = build_index(B->in, sp(0.0f, 64, 0, 0, 0, true));
  naive64::Pooled pl = naive64::pool(B->np, 64);
  std::vector<std::vector<int>> lists(naive64::segments(B->np).size());
  for (bool corr : {true, false}) {
    BlockIndex idx = index_with_lists(base, lists, corr);
    sparse_attention(B->in, view_of(idx), B->outputs());
    expect_matches(*B, naive64::sparse(B->np, pl, lists, corr), true,
                   std::string("sparse_attention(empty lists, correction=") + (corr ? "on" : "off") + ")");
  }
}

// Sparse output with correction is closer to dense than without (sanity of the correction on a selective workload).
TEST(Sparse, CorrectionImprovesAccuracy) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  Case c = sc(4, 1, 64, F32, {1024}, {1024}, false, 1);
  c.structured = true;
  c.topic_gain = 0.7;
  auto B = build(c, rng);
  naive64::Result R = naive64::dense(B->np);
  double err[2];
  for (bool corr : {true, false}) {
    BlockIndex idx = build_index(B->in, sp(0.3f, 64, 64, 64, 0, corr));
    sparse_attention(B->in, view_of(idx), B->outputs());
    double num = 0, den = 0;
    for (int64_t i = 0; i < B->out.numel; ++i) {
      num += (B->out.get(i) - R.out[i]) * (B->out.get(i) - R.out[i]);
      den += R.out[i] * R.out[i];
    }
    err[corr] = std::sqrt(num / den);
    if (!corr) ::testing::Test::RecordProperty("density", std::to_string(idx.density()));
  }
  std::cout << "[sparse] rel err with correction " << err[1] << ", without " << err[0] << "\n";
  EXPECT_LE(err[1], err[0]);
}

// Blocks whose keys and values are all equal: the virtual key of the correction is exact, so sparse attention with
// correction equals dense attention whatever prunable blocks are dropped.
TEST(Sparse, CorrectionExactForConstantBlocks) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (int bs : {64, 128}) {
    Case c = sc(4, 1, 64, DType::kFloat32, {300, 129}, {700, 129}, true, 16);
    c.structured = false;
    c.constant_kv_block = bs;
    SCOPED_TRACE(c.str() + " bs=" + std::to_string(bs));
    auto B = build(c, rng);
    BlockIndex base = build_index(B->in, sp(0.0f, bs, 0, 0, 0, true));
    auto segs = naive64::segments(B->np);
    std::vector<std::vector<int>> lists(segs.size());
    int64_t dropped = 0;
    for (size_t s = 0; s < segs.size(); ++s) {
      naive64::TileBlocks tb = naive64::analyze(B->np, segs[s], bs);
      for (size_t J = 0; J < tb.visible.size(); ++J) {
        if (tb.visible[J] && (!tb.prunable[J] || rng() % 2)) lists[s].push_back(int(J));
        else if (tb.prunable[J]) ++dropped;
      }
    }
    ASSERT_GT(dropped, 0);
    BlockIndex idx = index_with_lists(base, lists, true);
    sparse_attention(B->in, view_of(idx), B->outputs());
    expect_matches(*B, naive64::dense(B->np), true, "sparse_attention(constant blocks, correction) vs dense",
                   Tol{1e-5, 1e-5});
  }
}

// An index built under one mask used with another (causal index, non-causal / windowed attention): the contract
// defines the result from the attention call's own mask (listed blocks with the token mask, correction for blocks
// fully visible to the tile under that mask).
// An index built for a non-causal or windowed problem: sparse attention over its lists under that mask.
TEST(Sparse, IndexOfAnotherMask) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  Case c = sc(4, 1, 64, F32, {300}, {500}, true, 16);
  auto B = build(c, rng);
  naive64::Pooled pl = naive64::pool(B->np, 64);
  for (int variant = 0; variant < 2; ++variant) {
    AttentionInputs in = B->in;
    naive64::Problem P = B->np;
    if (variant == 0) {
      in.causal = P.causal = false;
    } else {
      in.window_left = P.wl = 150;
    }
    Built& Bref = *B;
    std::swap(Bref.in, in);
    std::swap(Bref.np, P);
    BlockIndex idx = build_index(Bref.in, sp(0.4f, 64, 0, 64, 0, true));
    for (bool corr : {true, false}) {
      idx.correction = corr;
      sparse_attention(Bref.in, view_of(idx), Bref.outputs());
      expect_matches(Bref, naive64::sparse(Bref.np, pl, lists_of(idx), corr), true,
                     std::string(variant ? "window_left=150" : "non-causal") + " attention over its index, correction=" +
                         (corr ? "on" : "off"));
    }
    std::swap(Bref.in, in);
    std::swap(Bref.np, P);
  }
}

// Same call twice: bitwise identical results (the reference is multi-threaded; no races, no order dependence).
TEST(Sparse, Deterministic) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  auto B = build(sc(8, 2, 64, BF16, {700, 129}, {900, 129}, true, 16), rng);
  BlockIndex i1 = build_index(B->in, sp(0.2f, 64, 64, 64, 1, true));
  BlockIndex i2 = build_index(B->in, sp(0.2f, 64, 64, 64, 1, true));
  EXPECT_EQ(i1.block_ids, i2.block_ids);
  EXPECT_EQ(i1.segment_start, i2.segment_start);
  EXPECT_EQ(i1.k_mean, i2.k_mean);
  sparse_attention(B->in, view_of(i1), B->outputs());
  HostTensor o1 = B->out;
  std::vector<float> l1 = B->lse;
  sparse_attention(B->in, view_of(i1), B->outputs());
  EXPECT_EQ(o1.bytes, B->out.bytes);
  EXPECT_EQ(0, std::memcmp(l1.data(), B->lse.data(), l1.size() * 4));
  run_dense(*B);
  o1 = B->out;
  run_dense(*B);
  EXPECT_EQ(o1.bytes, B->out.bytes);
}

// naive64 self-consistency: every visible block listed == dense (with and without correction); union of such lists
// is unchanged.
TEST(Naive64, SparseAllVisibleEqualsDense) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  Case c = sc(4, 2, 64, DType::kFloat32, {130, 7, 0}, {200, 7, 5}, false, 1, true, 100, -1);
  auto B = build(c, rng);
  naive64::Result R = naive64::dense(B->np);
  naive64::Pooled pl = naive64::pool(B->np, 64);
  auto segs = naive64::segments(B->np);
  std::vector<std::vector<int>> lists(segs.size());
  for (size_t s = 0; s < segs.size(); ++s) {
    naive64::TileBlocks tb = naive64::analyze(B->np, segs[s], 64);
    for (size_t J = 0; J < tb.visible.size(); ++J)
      if (tb.visible[J]) lists[s].push_back(int(J));
  }
  for (bool corr : {true, false}) {
    naive64::Result S = naive64::sparse(B->np, pl, lists, corr);
    for (size_t i = 0; i < R.out.size(); ++i) ASSERT_NEAR(S.out[i], R.out[i], 1e-12);
    for (size_t i = 0; i < R.lse.size(); ++i)
      if (std::isinf(R.lse[i])) ASSERT_TRUE(std::isinf(S.lse[i]));
      else ASSERT_NEAR(S.lse[i], R.lse[i], 1e-12);
  }
  naive64::Selection sel = naive64::select(B->np, pl, naive64::SelParams{0.0, 64, 0, 0, 0});
  EXPECT_EQ(sel.lists, lists);
  EXPECT_EQ(sel.kept, sel.visible);
}

// Random sweep of shapes, masks and selection parameters.
TEST(Sparse, RandomSweep) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  const int lens[] = {1, 11, 64, 127, 129, 200, 333};
  const int groups[] = {1, 3, 4, 6, 8};
  const int pss[] = {1, 16, 64, 128, 48, 100};
  const DType dts[] = {F32, F16, BF16};
  for (int it = 0; it < 25; ++it) {
    const int g = groups[rng() % 5];
    const int Hkv = 1 + int(rng() % 2);
    std::vector<int> lq, lk;
    const int nseq = 1 + int(rng() % 2);
    for (int b = 0; b < nseq; ++b) {
      lq.push_back(lens[rng() % 7]);
      lk.push_back(rng() % 2 ? lq.back() : lens[rng() % 7]);
    }
    const bool causal = rng() % 4 != 0;
    Case c = sc(g * Hkv, Hkv, 64, dts[rng() % 3], lq, lk, rng() % 2, pss[rng() % 4], causal,
                rng() % 2 ? -1 : int(rng() % 300), rng() % 2 ? -1 : int(rng() % 50));
    SelectionParams p = sp(float(rng() % 6) / 10.f, 64 * (1 + int(rng() % 2)), int(rng() % 3) * 100,
                           int(rng() % 3) * 70, int(rng() % 3), true);
    SCOPED_TRACE(c.str() + " alpha=" + std::to_string(p.alpha) + " bs=" + std::to_string(p.block_size));
    auto B = build(c, rng);
    BlockIndex idx = build_index(B->in, p);
    naive64::Pooled pl = naive64::pool(B->np, p.block_size);
    for (bool corr : {true, false}) {
      idx.correction = corr;
      sparse_attention(B->in, view_of(idx), B->outputs());
      expect_matches(*B, naive64::sparse(B->np, pl, lists_of(idx), corr), true,
                     std::string("sparse_attention sweep correction=") + (corr ? "on" : "off"));
    }
  }
}

}  // namespace
}  // namespace sptest
