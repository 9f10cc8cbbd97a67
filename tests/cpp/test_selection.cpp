// build_index (pooling + scoring + thresholding + always-kept rules + CSR) against naive64::select. Lists are compared
// exactly, except blocks whose energy lies within 1e-6 (relative) of the threshold, which may flip; those are counted.
#include "test_util.h"

namespace sptest {

// Shared with test_sparse.cpp / test_union.cpp.
int64_t compare_selection(const Built& B, const BlockIndex& idx, const naive64::Selection& S,
                          const SelectionParams& p) {
  const naive64::Problem& P = B.np;
  std::vector<naive64::Segment> segs = naive64::segments(P);
  EXPECT_EQ(idx.block_size, p.block_size);
  EXPECT_EQ(idx.group_size, P.g());
  EXPECT_EQ(idx.num_kv_heads, P.Hkv);
  EXPECT_EQ(idx.correction, p.correction);
  EXPECT_EQ(idx.segment_start.size(), segs.size()) << "number of segments";
  EXPECT_EQ(idx.segment_end.size(), segs.size()) << "number of segments";
  if (idx.segment_start.size() != segs.size() || idx.segment_end.size() != segs.size()) return 0;
  int64_t ambiguous_flips = 0, bad = 0;
  std::ostringstream msg;
  for (size_t s = 0; s < segs.size(); ++s) {
    const auto& sg = segs[s];
    const int64_t nb = (P.lk[sg.b] + p.block_size - 1) / p.block_size;
    const int32_t a = idx.segment_start[s], e = idx.segment_end[s];
    if (!(0 <= a && a <= e && e <= int32_t(idx.block_ids.size()))) {
      if (bad++ < 8) msg << "  segment " << s << ": bad range [" << a << "," << e << ")\n";
      continue;
    }
    std::vector<int> got(idx.block_ids.begin() + a, idx.block_ids.begin() + e);
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i] < 0 || got[i] >= nb || (i && got[i] <= got[i - 1])) {
        if (bad++ < 8) msg << "  segment " << s << ": list not ascending / out of range " << list_str(got) << "\n";
        break;
      }
    }
    const auto& exp = S.lists[s];
    std::vector<int> diff;
    std::set_symmetric_difference(got.begin(), got.end(), exp.begin(), exp.end(), std::back_inserter(diff));
    for (int J : diff) {
      const auto& amb = S.ambiguous[s];
      if (std::find(amb.begin(), amb.end(), J) != amb.end()) {
        ++ambiguous_flips;
        continue;
      }
      const bool in_got = std::find(got.begin(), got.end(), J) != got.end();
      const bool forced = std::find(S.forced[s].begin(), S.forced[s].end(), J) != S.forced[s].end();
      if (bad++ < 8)
        msg << "  segment " << s << " (b " << sg.b << ", kvh " << sg.kvh << ", tile " << sg.t << ", rows "
            << sg.row_begin << ".." << sg.row_end << "): block " << J << (in_got ? " kept but not expected" : " missing")
            << " (E " << (J < int64_t(S.energy[s].size()) ? S.energy[s][J] : -1.0) << ", threshold "
            << S.threshold[s] << (forced ? ", always-kept" : "") << ")\n    got " << list_str(got) << "\n    exp "
            << list_str(exp) << "\n";
    }
  }
  EXPECT_EQ(bad, 0) << "selection differs from naive64 [" << B.c.str() << " alpha=" << p.alpha << " bs="
                    << p.block_size << " sink=" << p.sink << " window=" << p.window << " last_n=" << p.last_n
                    << "]:\n"
                    << msg.str();
  EXPECT_EQ(idx.visible_blocks, S.visible) << "visible_blocks";
  EXPECT_EQ(idx.kept_blocks, naive64::count_kept(P, p.block_size, lists_of(idx))) << "kept_blocks";
  if (ambiguous_flips == 0) EXPECT_EQ(idx.kept_blocks, S.kept);
  EXPECT_DOUBLE_EQ(idx.density(), S.visible ? double(idx.kept_blocks) / double(S.visible) : 1.0);
  return ambiguous_flips;
}

namespace {

struct SelCase {
  Case c;
  SelectionParams p;
};



void check_selection(const Case& c, const SelectionParams& p) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  auto B = build(c, rng);
  BlockIndex idx = build_index(B->in, p);
  naive64::Pooled pl = naive64::pool(B->np, p.block_size);
  naive64::Selection S = naive64::select(B->np, pl, naive_params(p));
  const int64_t flips = compare_selection(*B, idx, S, p);
  if (flips) std::cout << "[selection] " << flips << " threshold-tie flips tolerated\n";
  // sanity of the workload: the test is only meaningful if something is pruned
  std::cout << "[selection] density " << idx.density() << " (" << idx.kept_blocks << "/" << idx.visible_blocks << ")\n";
}

const DType F32 = DType::kFloat32, F16 = DType::kFloat16, BF16 = DType::kBFloat16;

TEST(Selection, L1763_GQA4_F32) { check_selection(sc(4, 1, 64, F32, {1763}, {1763}, false, 1), sp(0.1f, 128, 128, 128, 1)); }
TEST(Selection, Chunk_GQA8_BF16_Paged64_BS64) {
  check_selection(sc(8, 1, 64, BF16, {129}, {1763}, true, 64), sp(0.2f, 64, 64, 64, 1));
}
TEST(Selection, Varlen_NoForced_Paged16) {
  check_selection(sc(2, 2, 64, F32, {11, 127, 300}, {11, 500, 300}, true, 16), sp(0.5f, 64, 0, 0, 0));
}
TEST(Selection, NonCausalWindow_F16) {
  check_selection(sc(4, 1, 64, F16, {400}, {450}, false, 1, false, 200, 30), sp(0.1f, 64, 64, 64, 1));
}
TEST(Selection, CausalWindow_Paged1) {
  check_selection(sc(4, 2, 64, F32, {300}, {700}, true, 1, true, 333, -1), sp(0.3f, 64, 0, 100, 0));
}
// Groups that do not divide 128: the heads of one position straddle two tiles.
TEST(Selection, OddGroup3) { check_selection(sc(3, 1, 64, F32, {300}, {700}, true, 16), sp(0.5f, 64, 0, 64, 0)); }
TEST(Selection, OddGroup6_TwoKVHeads) {
  check_selection(sc(12, 2, 64, BF16, {200, 43}, {600, 300}, false, 1), sp(0.5f, 64, 64, 0, 1));
}
TEST(Selection, OddGroup5_Window) {
  check_selection(sc(5, 1, 64, F32, {257}, {400}, true, 64, true, 100, -1), sp(0.4f, 64, 0, 30, 0));
}
// g = 3: position 42 has packed rows 126, 127 (tile 0) and 128 (tile 1); with off = 22 its diagonal key 64 opens
// block 1, which only that position of tile 0 sees (likewise position 85 / off = 43 for tiles 1 and 2).
TEST(Selection, OddGroupStraddlingPositionOpensBlock) {
  for (int off : {22, 43})
    check_selection(sc(3, 1, 64, F32, {200}, {200 + off}, false, 1), sp(0.5f, 64, 0, 0, 0));
}
TEST(Selection, LqGreaterThanLk) { check_selection(sc(4, 1, 64, F32, {300}, {129}, false, 1), sp(0.3f, 64, 0, 0, 0)); }
TEST(Selection, D128_GQA4_Paged128_Defaults) {
  check_selection(sc(8, 2, 128, BF16, {129}, {1000}, true, 128), defaults_per_group());
}
TEST(Selection, Defaults_L1763) { check_selection(sc(4, 1, 64, F32, {1763}, {1763}, true, 16), defaults_per_group()); }
TEST(Selection, Unstructured_BS192) {
  Case c = sc(4, 1, 64, F32, {700}, {900}, false, 1);
  c.structured = false;
  check_selection(c, sp(0.9f, 192, 0, 1, 0));
}
TEST(Selection, OddSinkWindow) {
  // sink / window not multiples of the block size; window of 1 = only the diagonal token
  check_selection(sc(4, 1, 64, F32, {500}, {800}, false, 1), sp(0.4f, 64, 65, 1, 0));
}
TEST(Selection, LastNCoversAllTiles) {
  check_selection(sc(8, 1, 64, F32, {100}, {600}, false, 1), sp(0.5f, 64, 0, 0, 100));
}
TEST(Selection, EmptySequences) {
  check_selection(sc(4, 1, 64, F32, {0, 70, 5}, {64, 130, 0}, false, 1), sp(0.5f, 64, 0, 0, 0));
}

// alpha = 0 keeps every visible block: density 1 and every list = the tile's visible blocks.
TEST(Selection, AlphaZeroKeepsEveryVisibleBlock) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (bool causal : {true, false}) {
    Case c = sc(4, 1, 64, F32, {300, 11}, {500, 200}, true, 16, causal, causal ? -1 : 100, causal ? -1 : 20);
    auto B = build(c, rng);
    SelectionParams p = sp(0.0f, 64, 0, 0, 0);
    BlockIndex idx = build_index(B->in, p);
    EXPECT_EQ(idx.kept_blocks, idx.visible_blocks);
    EXPECT_DOUBLE_EQ(idx.density(), 1.0);
    auto segs = naive64::segments(B->np);
    auto got = lists_of(idx);
    ASSERT_EQ(got.size(), segs.size());
    for (size_t s = 0; s < segs.size(); ++s) {
      naive64::TileBlocks tb = naive64::analyze(B->np, segs[s], 64);
      std::vector<int> vis;
      for (size_t J = 0; J < tb.visible.size(); ++J)
        if (tb.visible[J]) vis.push_back(int(J));
      EXPECT_EQ(got[s], vis) << "segment " << s << " causal " << causal;
    }
  }
}

// alpha = 1 keeps (besides the max-energy block) only the always-kept ones: sink, window band, last_n tiles and the
// blocks not fully visible to the tile (diagonal / window edges). All of them must be present.
TEST(Selection, AlwaysKeptBlocksPresent) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  Case c = sc(4, 1, 64, F32, {1000}, {1500}, true, 64, true, 700, -1);
  auto B = build(c, rng);
  SelectionParams p = sp(1.0f, 64, 200, 150, 2);
  BlockIndex idx = build_index(B->in, p);
  naive64::Pooled pl = naive64::pool(B->np, 64);
  naive64::Selection S = naive64::select(B->np, pl, naive_params(p));
  auto got = lists_of(idx);
  ASSERT_EQ(got.size(), S.forced.size());
  for (size_t s = 0; s < got.size(); ++s)
    for (int J : S.forced[s])
      EXPECT_TRUE(std::binary_search(got[s].begin(), got[s].end(), J)) << "segment " << s << " misses always-kept block "
                                                                       << J << ": " << list_str(got[s]);
  compare_selection(*B, idx, S, p);
  EXPECT_LT(idx.density(), 1.0) << "workload prunes nothing; the test is vacuous";
  // alpha = 1: the max-energy block passes (E >= 1 * max E), so some block within a hair of the max is listed
  for (size_t s = 0; s < got.size(); ++s) {
    double maxE = 0;
    for (double e : S.energy[s]) maxE = std::max(maxE, e);
    if (maxE <= 0) continue;
    bool found = false;
    for (int J : got[s]) found |= S.energy[s][J] >= maxE * (1 - 1e-6);
    EXPECT_TRUE(found) << "segment " << s << ": no max-energy block listed at alpha = 1";
  }
}

// Off-by-one hunting: sink and window values around block boundaries, small groups (tiles of 128 / 64 positions so
// tile starts line up with block boundaries), a high alpha so that few blocks pass the threshold on their own.
TEST(Selection, SinkWindowBoundaries) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  int64_t flips = 0;
  for (int g : {1, 2}) {
    for (int off : {0, 1, 63, 64}) {
      Case c = sc(g, 1, 64, F32, {520}, {520 + off}, false, 1);
      auto B = build(c, rng);
      naive64::Pooled pl = naive64::pool(B->np, 64);
      for (int window : {0, 1, 63, 64, 65, 127, 128, 129})
        for (int sink : {0, 1, 63, 64, 65}) {
          SelectionParams p = sp(0.9f, 64, sink, window, 0);
          SCOPED_TRACE(c.str() + " sink=" + std::to_string(sink) + " window=" + std::to_string(window));
          BlockIndex idx = build_index(B->in, p);
          flips += compare_selection(*B, idx, naive64::select(B->np, pl, naive_params(p)), p);
        }
    }
  }
  if (flips) std::cout << "[selection boundaries] " << flips << " threshold-tie flips tolerated\n";
}

// A randomised sweep of shapes and parameters.
TEST(Selection, RandomSweep) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  int64_t flips = 0;
  for (int it = 0; it < 30; ++it) {
    const auto [c, p] = random_selection_case(rng, [](std::mt19937_64& r) { return float(r() % 10) / 10.f; });
    SCOPED_TRACE(c.str());
    auto B = build(c, rng);
    BlockIndex idx = build_index(B->in, p);
    naive64::Pooled pl = naive64::pool(B->np, p.block_size);
    flips += compare_selection(*B, idx, naive64::select(B->np, pl, naive_params(p)), p);
  }
  if (flips) std::cout << "[selection sweep] " << flips << " threshold-tie flips tolerated\n";
}

}  // namespace
}  // namespace sptest
