// pool_kv (block means of K and V) against naive64, contiguous and paged, tail blocks, block sizes 64/128/192, and
// the chunked-prefill property: the means of complete blocks do not change when the cache grows; an index's means
// (V only with the correction).
#include "test_util.h"

namespace sptest {
namespace {

void check_pool(const Case& c, int bs) {
  SP_SEED_TRACE();
  SCOPED_TRACE(c.str() + " block_size=" + std::to_string(bs));
  std::mt19937_64 rng(test_seed() + bs);
  auto B = build(c, rng);
  std::vector<int32_t> cu;
  std::vector<float> km, vm;
  pool_kv(B->in, bs, cu, km, vm);
  naive64::Pooled R = naive64::pool(B->np, bs);
  ASSERT_EQ(cu.size(), R.cu_blocks.size());
  for (size_t i = 0; i < cu.size(); ++i) ASSERT_EQ(cu[i], R.cu_blocks[i]) << "cu_blocks[" << i << "]";
  ASSERT_EQ(km.size(), R.k_mean.size());
  ASSERT_EQ(vm.size(), R.v_mean.size());
  int64_t bad = 0;
  std::ostringstream msg;
  for (size_t i = 0; i < km.size(); ++i) {
    for (int which = 0; which < 2; ++which) {
      const double got = which ? vm[i] : km[i], exp = which ? R.v_mean[i] : R.k_mean[i];
      if (!(std::fabs(got - exp) <= 1e-6 * std::fabs(exp) + 1e-6)) {
        if (bad++ < 5) {
          const int64_t blk = int64_t(i) / (c.Hkv * c.D), kvh = (int64_t(i) / c.D) % c.Hkv, d = int64_t(i) % c.D;
          msg << "  " << (which ? "v" : "k") << "_mean[block " << blk << ", kvh " << kvh << ", d " << d << "] got "
              << got << " expected " << exp << "\n";
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << msg.str();
}

Case mk(int Hkv, int D, DType dt, std::vector<int> lk, bool paged, int ps) {
  Case c;
  c.Hq = Hkv * 2;
  c.Hkv = Hkv;
  c.D = D;
  c.dtype = dt;
  c.lk = std::move(lk);
  c.lq.assign(c.lk.size(), 1);
  c.paged = paged;
  c.page_size = ps;
  return c;
}

TEST(Pooling, Contiguous_OddLengths) { check_pool(mk(2, 64, DType::kFloat32, {1, 11, 127, 129, 1763}, false, 1), 128); }
TEST(Pooling, Contiguous_BS64_BF16) { check_pool(mk(1, 128, DType::kBFloat16, {64, 65, 300}, false, 1), 64); }
TEST(Pooling, Contiguous_BS192_F16) { check_pool(mk(2, 64, DType::kFloat16, {191, 192, 193, 500}, false, 1), 192); }
TEST(Pooling, Paged1) { check_pool(mk(2, 64, DType::kFloat32, {129, 11}, true, 1), 128); }
TEST(Pooling, Paged16) { check_pool(mk(1, 64, DType::kBFloat16, {1763, 5}, true, 16), 64); }
TEST(Pooling, Paged64_BS128) { check_pool(mk(2, 128, DType::kFloat32, {257, 128}, true, 64), 128); }
TEST(Pooling, Paged128_BS64) { check_pool(mk(1, 64, DType::kFloat16, {300, 1}, true, 128), 64); }
TEST(Pooling, Paged_PageLargerThanBlockOdd) { check_pool(mk(1, 64, DType::kFloat32, {500}, true, 100), 64); }
TEST(Pooling, EmptySequence) { check_pool(mk(1, 64, DType::kFloat32, {0, 70, 0}, false, 1), 64); }
TEST(Pooling, EmptySequencePaged) { check_pool(mk(1, 64, DType::kFloat32, {70, 0}, true, 16), 64); }

// Chunked prefill: pooling a cache of 300 tokens and then the same cache grown to 450 tokens gives bit-identical means
// for the blocks complete at 300 tokens (they never need to be recomputed).
TEST(Pooling, CompleteBlocksStableWhenCacheGrows) {
  SP_SEED_TRACE();
  for (bool paged : {false, true}) {
    std::mt19937_64 rng(test_seed());
    Case c = mk(2, 64, DType::kBFloat16, {450}, paged, 16);
    auto big = build(c, rng);
    // The short cache: same storage, shorter length.
    AttentionInputs small_in = big->in;
    std::vector<int32_t> cu_k{0, 300}, used{300}, cu_q{0, 1};
    small_in.cu_seqlens_q = make_view(cu_q.data(), DType::kInt32, {2});
    small_in.max_seqlen_k = 300;
    HostTensor kk, vv;
    if (paged) {
      small_in.seqused_k = make_view(used.data(), DType::kInt32, {1});
    } else {
      small_in.k.shape[0] = 300;
      small_in.v.shape[0] = 300;
      small_in.cu_seqlens_k = make_view(cu_k.data(), DType::kInt32, {2});
    }
    for (int bs : {64, 128}) {
      std::vector<int32_t> cu1, cu2;
      std::vector<float> k1, v1, k2, v2;
      pool_kv(small_in, bs, cu1, k1, v1);
      pool_kv(big->in, bs, cu2, k2, v2);
      const int64_t complete = 300 / bs, per = 2 * 64;
      ASSERT_GE(int64_t(k1.size()), complete * per);
      for (int64_t i = 0; i < complete * per; ++i) {
        ASSERT_EQ(k1[i], k2[i]) << (paged ? "paged" : "contiguous") << " bs " << bs << " k_mean element " << i;
        ASSERT_EQ(v1[i], v2[i]) << (paged ? "paged" : "contiguous") << " bs " << bs << " v_mean element " << i;
      }
    }
  }
}

// The index carries the pooled means: they equal pool_kv. V means only with the correction (their only reader).
TEST(Pooling, IndexMeansEqualPoolKv) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  Case c = mk(2, 64, DType::kFloat32, {129, 300}, true, 16);
  c.lq = {129, 100};
  auto B = build(c, rng);
  std::vector<int32_t> cu;
  std::vector<float> km, vm;
  pool_kv(B->in, 64, cu, km, vm);
  for (bool correction : {false, true}) {
    SCOPED_TRACE(correction ? "correction" : "no correction");
    SelectionParams p;
    p.head_subgroups = 1;  // the index's means per KV head, as pool_kv's
    p.block_size = 64;
    p.correction = correction;
    BlockIndex idx = build_index(B->in, p);
    EXPECT_EQ(idx.correction, correction);
    EXPECT_EQ(idx.cu_blocks, cu);
    EXPECT_EQ(idx.k_mean, km);
    if (correction) {
      EXPECT_EQ(idx.v_mean, vm);
    } else {
      EXPECT_TRUE(idx.v_mean.empty());
      EXPECT_EQ(view_of(idx).v_mean.data, nullptr);  // an absent view
      EXPECT_EQ(view_of(idx).v_mean.ndim, 0);
    }
  }
}

// Without the correction an index has no V means (an absent view) and serves sparse_attention and union_index; with
// it, missing V means are an ArgumentError naming index.v_mean.
TEST(Pooling, IndexWithoutVMeans) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  Case c = mk(2, 64, DType::kFloat32, {129, 300}, false, 1);
  c.lq = {129, 100};
  auto B = build(c, rng);
  const AttentionOutputs o = B->outputs(false);
  SelectionParams p;
  p.head_subgroups = 1;
  p.block_size = 64;
  p.alpha = 0.3f;
  p.correction = false;
  const BlockIndex off = build_index(B->in, p);
  ASSERT_TRUE(off.v_mean.empty());
  BlockIndex copy = off;
  EXPECT_NO_THROW(sparse_attention(B->in, view_of(copy), o));
  BlockIndex u = union_index(B->in, off);
  EXPECT_TRUE(u.v_mean.empty());
  EXPECT_NO_THROW(sparse_attention(B->in, view_of(u), o));
  p.correction = true;
  BlockIndex on = build_index(B->in, p);
  ASSERT_EQ(on.v_mean.size(), on.k_mean.size());
  EXPECT_EQ(on.k_mean, off.k_mean);
  EXPECT_EQ(on.block_ids, off.block_ids);  // the correction does not change the selection
  BlockIndexView v = view_of(on);
  EXPECT_NO_THROW(sparse_attention(B->in, v, o));
  v.v_mean = TensorView{};
  EXPECT_ARG_ERROR(sparse_attention(B->in, v, o), "index.v_mean");
  on.v_mean.clear();
  EXPECT_ARG_ERROR(sparse_attention(B->in, view_of(on), o), "index.v_mean");
  EXPECT_ARG_ERROR(union_index(B->in, on), "index.v_mean");
  on.correction = false;  // the same arrays without the correction: valid
  EXPECT_NO_THROW(sparse_attention(B->in, view_of(on), o));
}

}  // namespace
}  // namespace sptest
