// union_index (chunked-prefill lowering) against naive64::union_lists; shared ranges per (sequence, KV head);
// kept_blocks recount; sparse_attention over the union against naive64.
#include "test_util.h"

namespace sptest {
namespace {

const DType F32 = DType::kFloat32, F16 = DType::kFloat16, BF16 = DType::kBFloat16;



void check_union(const Case& c, const SelectionParams& p) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  auto B = build(c, rng);
  BlockIndex idx = build_index(B->in, p);
  BlockIndex u = union_index(B->in, idx);
  const naive64::Problem& P = B->np;
  auto segs = naive64::segments(P);
  auto tiles = lists_of(idx);
  auto exp = naive64::union_lists(P, tiles, p.block_size, p.dense_fraction);
  ASSERT_EQ(u.segment_start.size(), segs.size());
  ASSERT_EQ(u.segment_end.size(), segs.size());
  EXPECT_EQ(u.block_size, idx.block_size);
  EXPECT_EQ(u.group_size, idx.group_size);
  EXPECT_EQ(u.num_kv_heads, idx.num_kv_heads);
  EXPECT_EQ(u.correction, idx.correction);
  EXPECT_EQ(u.cu_blocks, idx.cu_blocks);
  EXPECT_EQ(u.k_mean, idx.k_mean);
  EXPECT_EQ(u.v_mean, idx.v_mean);
  auto got = lists_of(u);
  for (size_t s = 0; s < segs.size(); ++s) {
    EXPECT_EQ(got[s], exp[s]) << "segment " << s << " (b " << segs[s].b << ", kvh " << segs[s].kvh << ", tile "
                              << segs[s].t << ")";
    // contains the tile's own selection
    for (int J : tiles[s])
      EXPECT_TRUE(std::binary_search(got[s].begin(), got[s].end(), J)) << "union misses block " << J << " of segment " << s;
    // shared range for every segment of (b, kvh)
    if (s > 0 && segs[s - 1].b == segs[s].b && segs[s - 1].kvh == segs[s].kvh) {
      EXPECT_EQ(u.segment_start[s], u.segment_start[s - 1]) << "segment " << s << " does not share the list";
      EXPECT_EQ(u.segment_end[s], u.segment_end[s - 1]) << "segment " << s << " does not share the list";
    }
  }
  EXPECT_EQ(u.visible_blocks, idx.visible_blocks);
  EXPECT_EQ(u.kept_blocks, naive64::count_kept(P, p.block_size, exp)) << "kept_blocks after union";
  EXPECT_GE(u.kept_blocks, idx.kept_blocks);

  // attention over the union
  naive64::Pooled pl = naive64::pool(P, p.block_size);
  for (bool corr : {true, false}) {
    u.correction = corr;
    sparse_attention(B->in, view_of(u), B->outputs());
    expect_matches(*B, naive64::sparse(P, pl, exp, corr), true,
                   std::string("sparse_attention(union) correction=") + (corr ? "on" : "off"));
  }
}

// Chunks: C new queries against the whole cache (prefix + chunk), paged, several tiles per chunk.
TEST(Union, Chunk129_Cache1763_GQA8_Paged64) {
  check_union(sc(8, 1, 64, BF16, {129}, {1763}, true, 64), sp(0.2f, 64, 64, 64, 1, true));
}
TEST(Union, Chunk300_Cache900_GQA4_Paged16_Batch) {
  check_union(sc(8, 2, 64, F32, {300, 64}, {900, 500}, true, 16), sp(0.3f, 128, 128, 128, 1, true));
}
TEST(Union, FourKVHeads_Sparse) {
  check_union(sc(8, 4, 64, F32, {64, 100}, {1200, 700}, true, 16), sp(0.9f, 64, 0, 0, 0, true));
}
TEST(Union, OddGroup3) { check_union(sc(6, 2, 64, F32, {150}, {900}, true, 16), sp(0.5f, 64, 0, 64, 0, true)); }
TEST(Union, Chunk_Paged1_D128) { check_union(sc(4, 1, 128, F16, {200}, {333}, true, 1), sp(0.5f, 64, 0, 0, 0, true)); }
TEST(Union, Chunk_Paged128_Window) {
  check_union(sc(4, 1, 64, F32, {256}, {1000}, true, 128, true, 400, -1), sp(0.2f, 128, 0, 128, 0, true));
}
TEST(Union, FullPrefill_Contiguous) { check_union(sc(4, 1, 64, F32, {700}, {700}, false, 1), sp(0.4f, 64, 0, 64, 1, true)); }
TEST(Union, SingleTile) { check_union(sc(4, 1, 64, F32, {11}, {500}, true, 16), sp(0.5f, 64, 0, 0, 0, true)); }
TEST(Union, NonCausal) {
  check_union(sc(2, 1, 64, F32, {300}, {500}, false, 1, false, -1, -1), sp(0.5f, 64, 0, 0, 0, true));
}
TEST(Union, EmptySequences) {
  check_union(sc(4, 1, 64, F32, {0, 100, 7}, {128, 300, 0}, true, 16), sp(0.5f, 64, 0, 0, 0, true));
}

// A whole chunked prefill: a prompt processed in chunks of C queries against a paged cache of growing length
// (seqused_k = end of the chunk). Each step: build_index + union_index + sparse_attention vs naive64 on that step;
// with alpha = 0 the concatenated chunk outputs equal one-shot causal attention over the whole prompt.
TEST(Union, ChunkedPrefillLoop) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  const int L = 777, C = 200, Hq = 8, Hkv = 2, D = 64;
  auto B = build(sc(Hq, Hkv, D, F32, {L}, {L}, true, 64), rng);
  const naive64::Result full = naive64::dense(B->np);
  for (float alpha : {0.0f, 0.3f}) {
    for (int start = 0; start < L; start += C) {
      const int end = std::min(L, start + C), n = end - start;
      SCOPED_TRACE("alpha " + std::to_string(alpha) + " chunk [" + std::to_string(start) + "," + std::to_string(end) + ")");
      const ChunkStep step(*B, start, end);
      const AttentionInputs& in = step.in;
      naive64::Problem P = B->np;
      P.lq = {n};
      P.lk = {end};
      P.q.assign(B->np.q.begin() + int64_t(start) * Hq * D, B->np.q.begin() + int64_t(end) * Hq * D);
      P.k[0].resize(int64_t(end) * Hkv * D);
      P.v[0].resize(int64_t(end) * Hkv * D);
      BlockIndex u = union_index(in, build_index(in, sp(alpha, 64, 64, 64, 1, true)));
      HostTensor out(F32, {n, Hq, D});
      out.fill_nan();
      std::vector<float> lse(Hq * n, std::numeric_limits<float>::quiet_NaN());
      AttentionOutputs o;
      o.out = out.view();
      o.lse = make_view(lse.data(), F32, {Hq, n});
      sparse_attention(in, view_of(u), o);
      const naive64::Result R = naive64::sparse(P, naive64::pool(P, 64), lists_of(u), true);
      int64_t bad = 0;
      for (int64_t i = 0; i < out.numel; ++i) {
        const double exp = R.out[i];
        if (!(std::fabs(out.get(i) - exp) <= 1e-5 * std::fabs(exp) + 1e-6) && bad++ < 3)
          ADD_FAILURE() << "out element " << i << " got " << out.get(i) << " expected " << exp;
        if (alpha == 0.0f) {
          const double d = full.out[int64_t(start) * Hq * D + i];
          if (!(std::fabs(out.get(i) - d) <= 1e-5 * std::fabs(d) + 1e-6) && bad++ < 3)
            ADD_FAILURE() << "alpha=0 chunk output differs from one-shot dense at element " << i << ": " << out.get(i)
                          << " vs " << d;
        }
      }
      for (int h = 0; h < Hq; ++h)
        for (int i = 0; i < n; ++i)
          if (!(std::fabs(lse[h * n + i] - R.lse[h * n + i]) <= 1e-5 * std::fabs(R.lse[h * n + i]) + 2e-6) && bad++ < 3)
            ADD_FAILURE() << "lse[" << h << "," << i << "] got " << lse[h * n + i] << " expected " << R.lse[h * n + i];
      EXPECT_EQ(bad, 0);
    }
  }
}

// Union of an already unioned index is the same index.
TEST(Union, Idempotent) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  auto B = build(sc(8, 2, 64, F32, {200}, {600}, true, 16), rng);
  BlockIndex idx = build_index(B->in, sp(0.3f, 64, 0, 64, 0, true));
  BlockIndex u1 = union_index(B->in, idx);
  BlockIndex u2 = union_index(B->in, u1);
  EXPECT_EQ(lists_of(u1), lists_of(u2));
  EXPECT_EQ(u1.kept_blocks, u2.kept_blocks);
}

}  // namespace
}  // namespace sptest
