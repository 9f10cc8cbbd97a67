// Head sub-groups (SelectionParams::head_subgroups = S): the index, sparse attention and the union equal those of
// the model with Hkv * S KV heads, each K/V head repeated S times (the repetition is written here, independently of
// the library); the selection also against naive64 on that model; S = g gives per-query-head lists; the pooled-means
// cache with S = 2. Bad S and mismatched index views are in test_errors.cpp.
#include <set>

#include "test_util.h"

namespace sptest {
namespace {

const DType F32 = DType::kFloat32, F16 = DType::kFloat16, BF16 = DType::kBFloat16;

// B's inputs with every K/V head repeated S times along the head axis (virtual head v = K/V head v / S), element by
// element through HostTensor (contiguous [total_k, Hkv * S, D] or paged [pages, page_size, Hkv * S, D], the unused
// page slots' NaN poison included), and the naive64 problem of that model.
struct Repeated {
  HostTensor k, v;
  AttentionInputs in;
  naive64::Problem np;
};
std::unique_ptr<Repeated> repeat_kv(const Built& B, int S) {
  auto R = std::make_unique<Repeated>();
  const int H = B.c.Hkv, D = B.c.D;
  for (auto [src, dst] : {std::pair{&B.k, &R->k}, std::pair{&B.v, &R->v}}) {
    std::vector<int64_t> shape = src->shape;
    shape[shape.size() - 2] = int64_t(H) * S;
    dst->alloc(src->dtype, shape);
    const int64_t rows = src->numel / (int64_t(H) * D);
    for (int64_t r = 0; r < rows; ++r)
      for (int h = 0; h < H; ++h)
        for (int s = 0; s < S; ++s)
          for (int d = 0; d < D; ++d)
            dst->set(((r * H + h) * S + s) * D + d, src->get((r * H + h) * D + d));
  }
  R->in = B.in;
  R->in.k = R->k.view();
  R->in.v = R->v.view();
  R->np = B.np;
  R->np.Hkv = H * S;
  for (int b = 0; b < B.np.B; ++b) {
    for (auto [src, dst] : {std::pair{&B.np.k[b], &R->np.k[b]}, std::pair{&B.np.v[b], &R->np.v[b]}}) {
      const int64_t L = B.np.lk[b];
      dst->assign(size_t(L) * H * S * D, 0.0);
      for (int64_t j = 0; j < L; ++j)
        for (int h = 0; h < H; ++h)
          for (int s = 0; s < S; ++s)
            for (int d = 0; d < D; ++d) (*dst)[((j * H + h) * S + s) * D + d] = (*src)[(j * H + h) * D + d];
    }
  }
  return R;
}

SelectionParams with_subgroups(SelectionParams p, int S, bool union_lists = false, bool final_chunk = true) {
  p.head_subgroups = S;
  p.union_lists = union_lists;
  p.final_chunk = final_chunk;
  return p;
}

void expect_same_index(const BlockIndex& a, const BlockIndex& b) {
  EXPECT_EQ(a.block_size, b.block_size);
  EXPECT_EQ(a.group_size, b.group_size);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.correction, b.correction);
  EXPECT_EQ(a.segment_start, b.segment_start);
  EXPECT_EQ(a.segment_end, b.segment_end);
  EXPECT_EQ(a.block_ids, b.block_ids);
  EXPECT_EQ(a.cu_blocks, b.cu_blocks);
  EXPECT_EQ(a.k_mean, b.k_mean);
  EXPECT_EQ(a.v_mean, b.v_mean);
  EXPECT_EQ(a.kept_blocks, b.kept_blocks);
  EXPECT_EQ(a.visible_blocks, b.visible_blocks);
}

struct SubCase {
  Case c;
  SelectionParams p;
  int S;
};

std::vector<SubCase> sub_cases() {
  return {
      {sc(8, 2, 64, F32, {700, 130}, {700, 600}, false, 1), sp(0.1f, 64, 64, 64, 1), 2},
      {sc(8, 1, 64, BF16, {129}, {1763}, true, 16), sp(0.2f, 64, 64, 64, 1), 4},
      {sc(6, 2, 64, F16, {301, 0, 7}, {999, 64, 7}, true, 64), sp(0.3f, 128, 0, 128, 1), 3},  // g = 3: g' = 1
      {sc(8, 2, 128, F32, {257}, {513}, true, 1), sp(0.3f, 64, 0, 0, 0), 2},
      {sc(4, 1, 64, F32, {333}, {901}, false, 1, true, 300, -1), sp(0.2f, 64, 0, 64, 1), 2},  // attention window
  };
}

// (1) build_index with S equals build_index on the repeated model with S = 1, field by field, in every mode and under
// both selection rules; the pooled means of virtual head v are those of K/V head v / S; the selection also matches
// naive64 on that model.
TEST(Subgroups, IndexEqualsRepeatedModel) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (const SubCase& sc_ : sub_cases())
  for (SelectionRule rule : {SelectionRule::kTileEnergy, SelectionRule::kRowMax}) {
    SCOPED_TRACE(sc_.c.str() + " S=" + std::to_string(sc_.S) + " rule " + std::to_string(int(rule)));
    SelectionParams p = sc_.p;
    p.rule = rule;
    auto B = build(sc_.c, rng);
    auto R = repeat_kv(*B, sc_.S);
    const int Hkv = sc_.c.Hkv, g = sc_.c.Hq / Hkv, S = sc_.S, D = sc_.c.D;
    for (bool union_lists : {false, true}) {
      for (bool final_chunk : {true, false}) {
        SCOPED_TRACE(std::string("union ") + (union_lists ? "on" : "off") + ", final_chunk " +
                     (final_chunk ? "true" : "false"));
        const BlockIndex idx = build_index(B->in, with_subgroups(p, S, union_lists, final_chunk));
        const BlockIndex ref = build_index(R->in, with_subgroups(p, 1, union_lists, final_chunk));
        EXPECT_EQ(idx.num_subgroups, S);
        EXPECT_EQ(ref.num_subgroups, 1);
        EXPECT_EQ(idx.num_kv_heads, Hkv * S);
        EXPECT_EQ(idx.group_size, g / S);
        expect_same_index(idx, ref);
      }
    }
    const BlockIndex idx = build_index(B->in, with_subgroups(p, S));
    const BlockIndex one = build_index(B->in, with_subgroups(p, 1));
    ASSERT_TRUE(p.correction);  // the V means below: an index without the correction has none
    SelectionParams off = with_subgroups(p, S);
    off.correction = false;
    const BlockIndex no_v = build_index(B->in, off);
    EXPECT_TRUE(no_v.v_mean.empty());
    EXPECT_EQ(no_v.k_mean, idx.k_mean);
    ASSERT_EQ(idx.k_mean.size(), one.k_mean.size() * S);
    for (size_t blk = 0; blk < size_t(one.cu_blocks.back()); ++blk)
      for (int v = 0; v < Hkv * S; ++v)
        for (int d = 0; d < D; ++d) {
          ASSERT_EQ(idx.k_mean[(blk * Hkv * S + v) * D + d], one.k_mean[(blk * Hkv + v / S) * D + d]);
          ASSERT_EQ(idx.v_mean[(blk * Hkv * S + v) * D + d], one.v_mean[(blk * Hkv + v / S) * D + d]);
        }
    // naive64 on the repeated model (an independent oracle of the selection rules per virtual head)
    Built V = *B;
    V.np = R->np;
    V.c.Hkv = Hkv * S;
    const naive64::Selection sel = naive64::select(R->np, naive64::pool(R->np, p.block_size), naive_params(p));
    compare_selection(V, idx, sel, p);
  }
}

// (2) sparse_attention over an S index equals the repeated model's (bit for bit) and naive64 on that model;
// sparse_prefill in one call equals the two steps.
TEST(Subgroups, SparseAttentionEqualsRepeatedModel) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (const SubCase& sc_ : sub_cases()) {
    SCOPED_TRACE(sc_.c.str() + " S=" + std::to_string(sc_.S));
    auto B = build(sc_.c, rng);
    auto R = repeat_kv(*B, sc_.S);
    const naive64::Pooled pooled = naive64::pool(R->np, sc_.p.block_size);
    for (bool corr : {true, false}) {
      for (bool union_lists : {false, true}) {
        SCOPED_TRACE(std::string("correction ") + (corr ? "on" : "off") + ", union " + (union_lists ? "on" : "off"));
        SelectionParams p = with_subgroups(sc_.p, sc_.S, union_lists);
        p.correction = corr;
        BlockIndex idx = build_index(B->in, p);
        BlockIndex ref = build_index(R->in, with_subgroups(p, 1, union_lists));
        sparse_attention(R->in, view_of(ref), B->outputs());
        const HostTensor want = B->out;
        const std::vector<float> want_lse = B->lse;
        sparse_attention(B->in, view_of(idx), B->outputs());
        EXPECT_EQ(B->out.bytes, want.bytes) << "out differs from the repeated model's";
        EXPECT_EQ(B->lse, want_lse) << "lse differs from the repeated model's";
        Built V = *B;
        V.np = R->np;
        expect_matches(V, naive64::sparse(R->np, pooled, lists_of(idx), corr), true, "sparse_attention vs naive64");
        ::sparse_prefill::sparse_prefill(B->in, p, B->outputs());
        EXPECT_EQ(B->out.bytes, want.bytes) << "sparse_prefill differs from build_index + sparse_attention";
      }
    }
  }
}

// (2) alpha = 0 with S = 2 (and S = g) keeps every visible block: sparse attention equals dense attention.
TEST(Subgroups, AlphaZeroEqualsDense) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  const std::vector<Case> cases = {sc(8, 2, 64, F32, {129, 11}, {1001, 11}, true, 16),
                                   sc(4, 1, 64, BF16, {777}, {777}, false, 1),
                                   sc(8, 2, 128, F16, {300}, {129}, true, 64)};
  for (const Case& c : cases) {
    auto B = build(c, rng);
    const naive64::Result dense = naive64::dense(B->np);
    for (int S : {2, c.Hq / c.Hkv}) {
      for (bool corr : {true, false}) {
        SCOPED_TRACE(c.str() + " S=" + std::to_string(S) + (corr ? " correction" : " no correction"));
        BlockIndex idx = build_index(B->in, with_subgroups(sp(0.0f, 64, 0, 0, 0, corr), S));
        EXPECT_EQ(idx.kept_blocks, idx.visible_blocks);
        sparse_attention(B->in, view_of(idx), B->outputs());
        expect_matches(*B, dense, true, "sparse(alpha=0, head_subgroups) vs naive dense");
        ::sparse_prefill::sparse_prefill(B->in, with_subgroups(sp(0.0f, 64, 0, 0, 0, corr), S, true), B->outputs());
        expect_matches(*B, dense, true, "sparse_prefill(alpha=0, union, head_subgroups) vs naive dense");
      }
    }
  }
}

// (3) union mode: each virtual head's list is the union of its own sub-group's tiles only (shared by them), and
// union_index of the per-tile index with S gives the same index.
TEST(Subgroups, UnionPerSubgroup) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  const std::vector<std::pair<Case, int>> cases = {{sc(8, 1, 64, BF16, {300}, {1763}, true, 64), 2},
                                                   {sc(8, 2, 64, F32, {129, 64}, {900, 500}, true, 16), 4},
                                                   {sc(6, 2, 64, F32, {150}, {900}, true, 16), 3}};
  for (const auto& [c, S] : cases) {
    SCOPED_TRACE(c.str() + " S=" + std::to_string(S));
    auto B = build(c, rng);
    auto R = repeat_kv(*B, S);
    const SelectionParams p = with_subgroups(sp(0.3f, 64, 0, 64, 0), S);
    const BlockIndex tiles = build_index(B->in, p);
    const BlockIndex u = build_index(B->in, with_subgroups(p, S, true));
    const BlockIndex u2 = union_index(B->in, tiles);
    EXPECT_EQ(u2.num_subgroups, S);
    expect_same_index(u, u2);
    // per (sequence, virtual head): the union of that head's tiles, nothing else
    const std::vector<std::vector<int>> tl = lists_of(tiles), ul = lists_of(u);
    const int heads = c.Hkv * S, gs = c.Hq / heads;
    size_t seg = 0;
    for (size_t b = 0; b < c.lq.size(); ++b) {
      const int64_t T = (int64_t(c.lq[b]) * gs + kTileRows - 1) / kTileRows;
      for (int v = 0; v < heads; ++v, seg += size_t(T)) {
        std::set<int> want;
        for (int64_t t = 0; t < T; ++t) want.insert(tl[seg + t].begin(), tl[seg + t].end());
        for (int64_t t = 0; t < T; ++t) {
          EXPECT_EQ(ul[seg + t], std::vector<int>(want.begin(), want.end())) << "b " << b << " virtual head " << v;
          EXPECT_EQ(u.segment_start[seg + t], u.segment_start[seg]);
        }
      }
    }
    ASSERT_EQ(seg, ul.size());
    EXPECT_EQ(lists_of(u), naive64::union_lists(R->np, tl, 64, p.dense_fraction));
    EXPECT_EQ(u.kept_blocks, naive64::count_kept(R->np, 64, ul));
    EXPECT_LT(u.kept_blocks, u.visible_blocks) << "the union keeps everything: the test would be trivial";
    EXPECT_GT(u.kept_blocks, tiles.kept_blocks) << "the union adds nothing: the test would be trivial";
  }
}

// (3) S = g: one virtual head per query head, so every (union) list is per query head: tiles of 128 positions of
// one head, and the union of query head h covers only h's own tiles.
TEST(Subgroups, UnionPerQueryHead) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  const Case c = sc(4, 2, 64, F32, {300, 45}, {1200, 301}, true, 16);
  const int g = 2;
  auto B = build(c, rng);
  const BlockIndex tiles = build_index(B->in, with_subgroups(sp(0.5f, 64, 0, 64, 0), g));
  const BlockIndex u = build_index(B->in, with_subgroups(sp(0.5f, 64, 0, 64, 0), g, true));
  EXPECT_EQ(u.num_kv_heads, c.Hq);
  EXPECT_EQ(u.group_size, 1);
  EXPECT_LT(u.kept_blocks, u.visible_blocks) << "the union keeps everything: the test would be trivial";
  const std::vector<std::vector<int>> tl = lists_of(tiles), ul = lists_of(u);
  size_t seg = 0;
  for (size_t b = 0; b < c.lq.size(); ++b) {
    const int64_t T = (c.lq[b] + kTileRows - 1) / kTileRows;  // g' = 1: tiles of 128 positions
    for (int h = 0; h < c.Hq; ++h, seg += size_t(T)) {
      std::set<int> want;
      for (int64_t t = 0; t < T; ++t) want.insert(tl[seg + t].begin(), tl[seg + t].end());
      for (int64_t t = 0; t < T; ++t) EXPECT_EQ(ul[seg + t], std::vector<int>(want.begin(), want.end())) << "head " << h;
    }
  }
  EXPECT_EQ(seg, ul.size());
}

// (5) The pooled-means cache (per real KV head) with S = 2 over paged KV: a chunked prefill with the cache gives the
// outputs of the same steps without it, and every complete block's slot holds the real heads' means, V's too when
// the steps run without the correction (whose index has no V means).
TEST(Subgroups, MeanCachePaged) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  const int L = 777, C = 200, Hq = 8, Hkv = 2, D = 64, S = 2, bs = 64, ps = 16;
  auto B = build(sc(Hq, Hkv, D, F32, {L}, {L}, true, ps), rng);
  const int64_t slots = mean_cache_slots(B->num_pages, ps, bs);
  std::vector<float> km(size_t(slots) * Hkv * D, 0.f), vm(km.size(), 0.f);
  const MeanCache cache{make_view(km.data(), F32, {slots, Hkv, D}), make_view(vm.data(), F32, {slots, Hkv, D})};
  std::vector<int32_t> cu_blocks;
  std::vector<float> k_mean, v_mean;
  pool_kv(B->in, bs, cu_blocks, k_mean, v_mean);
  for (bool union_lists : {false, true}) {  // union: without the correction
    SCOPED_TRACE(union_lists ? "union, no correction" : "tiles, correction");
    std::fill(km.begin(), km.end(), 0.f);  // each pass fills its own cache
    std::fill(vm.begin(), vm.end(), 0.f);
    for (int start = 0; start < L; start += C) {
      const int end = std::min(L, start + C), n = end - start;
      SCOPED_TRACE("chunk [" + std::to_string(start) + "," + std::to_string(end) + ")");
      const ChunkStep step(*B, start, end);
      const AttentionInputs& in = step.in;
      const SelectionParams p = with_subgroups(sp(0.3f, bs, 64, 64, 1, !union_lists), S, union_lists, end == L);
      HostTensor with(F32, {n, Hq, D}), without(F32, {n, Hq, D});
      ::sparse_prefill::sparse_prefill(in, p, AttentionOutputs{with.view(), std::nullopt}, cache);
      ::sparse_prefill::sparse_prefill(in, p, AttentionOutputs{without.view(), std::nullopt});
      EXPECT_EQ(with.bytes, without.bytes);
    }
    for (int J = 0; (J + 1) * bs <= L; ++J) {
      const int last = (J + 1) * bs - 1;
      const int64_t slot = B->block_table[last / ps];  // page_size < block_size: the slot of the block's last page
      for (int e = 0; e < Hkv * D; ++e) {
        ASSERT_EQ(km[slot * Hkv * D + e], k_mean[size_t(J) * Hkv * D + e]) << "block " << J;
        ASSERT_EQ(vm[slot * Hkv * D + e], v_mean[size_t(J) * Hkv * D + e]) << "block " << J;
      }
    }
  }
}

}  // namespace
}  // namespace sptest
