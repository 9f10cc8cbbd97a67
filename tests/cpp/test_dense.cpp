// Dense attention of the reference backend against naive64: odd lengths, GQA, chunks (Lq < Lk) and Lq > Lk, varlen,
// contiguous and paged KV (random page order, NaN in unused slots), windows, causal and not, every dtype.
#include <thread>

#include "test_util.h"

namespace sptest {
namespace {

// Dense cases use plain Gaussian inputs (the structured ones of `sc` target selection).
Case mk(int Hq, int Hkv, int D, DType dt, std::vector<int> lq, std::vector<int> lk, bool paged = false, int ps = 16,
        bool causal = true, int wl = -1, int wr = -1) {
  Case c = sc(Hq, Hkv, D, dt, std::move(lq), std::move(lk), paged, ps, causal, wl, wr);
  c.structured = false;
  return c;
}

void check_dense(const Case& c, bool with_lse = true) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  auto B = build(c, rng);
  run_dense(*B, with_lse);
  expect_matches(*B, naive64::dense(B->np), with_lse, "attention");
}

const DType F32 = DType::kFloat32, F16 = DType::kFloat16, BF16 = DType::kBFloat16;

TEST(Dense, SingleToken) { check_dense(mk(1, 1, 64, F32, {1}, {1})); }
TEST(Dense, L11_GQA4) { check_dense(mk(4, 1, 64, F32, {11}, {11})); }
TEST(Dense, L127_GQA8_D128_Paged16) { check_dense(mk(8, 1, 128, F32, {127}, {127}, true, 16)); }
TEST(Dense, L129_Chunk_Paged1) { check_dense(mk(4, 1, 64, F32, {129}, {300}, true, 1)); }
TEST(Dense, LqGreaterThanLk_EmptyRows) { check_dense(mk(2, 2, 64, F32, {129}, {11})); }
TEST(Dense, LqGreaterThanLk_NonCausal) { check_dense(mk(2, 2, 64, F32, {129}, {11}, false, 16, false)); }
TEST(Dense, Varlen_BF16_Paged64) {
  check_dense(mk(8, 2, 64, BF16, {1, 11, 127, 129}, {1, 40, 200, 129}, true, 64));
}
TEST(Dense, Varlen_F16_Contiguous) { check_dense(mk(4, 4, 64, F16, {11, 1, 129}, {11, 300, 129})); }
TEST(Dense, Window_Causal_F16_Paged64) { check_dense(mk(4, 1, 64, F16, {300}, {300}, true, 64, true, 32, 0)); }
TEST(Dense, Window_LeftOnly_Causal) { check_dense(mk(4, 2, 64, F32, {129, 11}, {257, 11}, false, 16, true, 50, -1)); }
TEST(Dense, Window_NonCausal_Both) { check_dense(mk(4, 1, 64, F32, {200}, {233}, true, 128, false, 20, 7)); }
TEST(Dense, Window_NonCausal_RightOnly) { check_dense(mk(2, 1, 128, F32, {77}, {60}, false, 16, false, -1, 5)); }
TEST(Dense, Window_CausalWithPositiveRight) {
  // causal clamps the right edge at the diagonal
  check_dense(mk(2, 1, 64, F32, {100}, {150}, true, 16, true, 10, 9));
}
TEST(Dense, Window_Zero) { check_dense(mk(2, 1, 64, F32, {64}, {64}, false, 16, true, 0, 0)); }
TEST(Dense, NonCausal_LongKV_BF16_Paged128) { check_dense(mk(4, 1, 64, BF16, {11}, {1763}, true, 128, false)); }
TEST(Dense, L1763_Causal_GQA4) { check_dense(mk(4, 1, 64, F32, {1763}, {1763})); }
TEST(Dense, L1763_Chunk_BF16_Paged16_GQA8) { check_dense(mk(8, 1, 64, BF16, {129}, {1763}, true, 16)); }
TEST(Dense, NoLse) { check_dense(mk(4, 1, 64, F32, {129}, {129}), false); }
TEST(Dense, CustomScale) {
  Case c = mk(4, 2, 64, F32, {57, 3}, {90, 3}, true, 16);
  c.scale = 0.3f;
  check_dense(c);
}
TEST(Dense, PageSizeNotPowerOfTwo) { check_dense(mk(2, 1, 64, F32, {50}, {333}, true, 7)); }
TEST(Dense, ManyUnusedPagesAndColumns) {
  Case c = mk(4, 1, 64, F32, {20, 30}, {100, 31}, true, 16);
  c.extra_pages = 20;
  c.extra_cols = 5;
  check_dense(c);
}

// Sequences with no queries or no keys inside a batch: rows with no key output zeros and lse = -inf.
TEST(Dense, EmptySequences_Contiguous) { check_dense(mk(4, 1, 64, F32, {0, 11, 5, 0}, {7, 11, 0, 0})); }
TEST(Dense, EmptySequences_Paged) { check_dense(mk(4, 1, 64, F32, {0, 11, 5, 3}, {7, 11, 0, 0}, true, 16)); }

TEST(Dense, AllQueriesEmpty) { check_dense(mk(4, 1, 64, F32, {0, 0}, {0, 5})); }
TEST(Dense, AllKeysEmpty_Paged) { check_dense(mk(4, 2, 64, BF16, {3, 1}, {0, 0}, true, 16)); }
TEST(Dense, OddGroup3) { check_dense(mk(6, 2, 64, F32, {129, 50}, {200, 50}, true, 16)); }
TEST(Dense, ManyHeadsNoGQA) { check_dense(mk(8, 8, 64, F16, {77}, {131}, true, 64)); }

// Large softmax logits must not overflow (max subtraction).
TEST(Dense, LargeLogits) {
  Case c = mk(2, 1, 64, F32, {65}, {130});
  c.scale = 40.0f;
  check_dense(c);
}

// out= is written in place: the pointer given is the pointer written, every element (NaN poison) and nothing around.
TEST(Dense, OutWrittenInPlaceNoOverrun) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  auto B = build(mk(4, 1, 64, BF16, {33, 7}, {33, 70}, true, 16), rng);
  const int64_t n = B->total_q * 4 * 64, pad = 64;
  HostTensor buf(DType::kBFloat16, {n + 2 * pad});
  buf.fill_nan();
  for (int64_t i = 0; i < pad; ++i) {
    buf.set(i, 7.0);
    buf.set(n + pad + i, 7.0);
  }
  std::vector<float> lse_buf(4 * B->total_q + 2 * pad, 7.0f);
  AttentionOutputs o;
  o.out = make_view(buf.bytes.data() + pad * 2, DType::kBFloat16, {B->total_q, 4, 64});
  o.lse = make_view(lse_buf.data() + pad, DType::kFloat32, {4, B->total_q});
  attention(B->in, o);
  naive64::Result R = naive64::dense(B->np);
  B->out.alloc(DType::kBFloat16, {B->total_q, 4, 64});
  std::memcpy(B->out.data(), buf.bytes.data() + pad * 2, size_t(n) * 2);
  B->lse.assign(lse_buf.begin() + pad, lse_buf.begin() + pad + 4 * B->total_q);
  expect_matches(*B, R, true, "attention(out=)");
  for (int64_t i = 0; i < pad; ++i) {
    EXPECT_EQ(buf.get(i), 7.0) << "out underrun at " << i - pad;
    EXPECT_EQ(buf.get(n + pad + i), 7.0) << "out overrun at " << i;
    EXPECT_EQ(lse_buf[i], 7.0f) << "lse underrun";
    EXPECT_EQ(lse_buf[pad + 4 * B->total_q + i], 7.0f) << "lse overrun";
  }
}

// Strided q / out rows (q as a slice of a packed qkv buffer, out with padded rows): only the last dim must be
// contiguous per the contract.
TEST(Dense, StridedQAndOut) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  const int Hq = 4, Hkv = 2, D = 64;
  auto B = build(mk(Hq, Hkv, D, F32, {40, 9}, {40, 50}), rng);
  const int64_t tq = B->total_q, row = (Hq + 3) * D;  // padded row pitch
  std::vector<float> qbuf(tq * row, std::numeric_limits<float>::quiet_NaN());
  for (int64_t i = 0; i < tq; ++i)
    for (int e = 0; e < Hq * D; ++e) qbuf[i * row + D + e] = float(B->q.get(i * Hq * D + e));
  AttentionInputs in = B->in;
  in.q.data = qbuf.data() + D;
  in.q.stride[0] = row;
  std::vector<float> obuf(tq * row, std::numeric_limits<float>::quiet_NaN());
  AttentionOutputs o;
  o.out = make_view(obuf.data(), DType::kFloat32, {tq, Hq, D});
  o.out.stride[0] = row;
  std::vector<float> lse(Hq * tq, std::numeric_limits<float>::quiet_NaN());
  o.lse = make_view(lse.data(), DType::kFloat32, {Hq, tq});
  try {
    attention(in, o);
  } catch (const ArgumentError& e) {
    GTEST_SKIP() << "strided q/out rejected by the backend: " << e.what();
  }
  B->out.alloc(DType::kFloat32, {tq, Hq, D});
  for (int64_t i = 0; i < tq; ++i)
    for (int e = 0; e < Hq * D; ++e) B->out.set(i * Hq * D + e, obuf[i * row + e]);
  B->lse = lse;
  expect_matches(*B, naive64::dense(B->np), true, "attention(strided q/out)");
  for (int64_t i = 0; i < tq; ++i)
    for (int e = Hq * D; e < row; ++e) ASSERT_TRUE(std::isnan(obuf[i * row + e])) << "wrote into out's row padding";
}

// Same inputs, contiguous vs paged: identical results (bitwise is not required; tolerance of the dtype).
TEST(Dense, PagedEqualsContiguous) {
  SP_SEED_TRACE();
  for (int ps : {1, 16, 64, 128}) {
    std::mt19937_64 rng(test_seed() + ps);
    Case c = mk(8, 2, 64, BF16, {5, 130}, {140, 130});
    auto A = build(c, rng);
    run_dense(*A);
    std::mt19937_64 rng2(test_seed() + ps);
    c.paged = true;
    c.page_size = ps;
    auto P = build(c, rng2);
    run_dense(*P);
    EXPECT_LE(max_abs_diff(A->out, P->out), 1e-2) << "page_size " << ps;
    for (size_t i = 0; i < A->lse.size(); ++i)
      ASSERT_NEAR(A->lse[i], P->lse[i], 1e-4 * (1 + std::fabs(A->lse[i]))) << "page_size " << ps << " lse " << i;
  }
}

// Helpers and oracle sanity: half conversions round to nearest even; the mask predicate on a hand-worked example.
TEST(Naive64, HalfConversions) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(u2f(0x3f808000u)), 0x3f80);  // tie -> even
  EXPECT_EQ(float_to_bf16(u2f(0x3f818000u)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(float_to_fp16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_fp16(1e6f), 0x7c00);
  EXPECT_EQ(float_to_fp16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_fp16(5.9604644775390625e-08f), 0x0001);
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    ASSERT_EQ(float_to_fp16(fp16_to_float(uint16_t(h))), h);
    ASSERT_EQ(float_to_bf16(bf16_to_float(uint16_t(h))), h);
  }
  EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16(NAN))));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
}
TEST(Naive64, MaskPredicate) {
  naive64::Problem P;
  P.B = 1;
  P.lq = {2};
  P.lk = {4};
  // causal, off = 2: query 0 sees 0..2, query 1 sees 0..3
  EXPECT_TRUE(P.sees(0, 0, 2));
  EXPECT_FALSE(P.sees(0, 0, 3));
  EXPECT_TRUE(P.sees(0, 1, 3));
  EXPECT_FALSE(P.sees(0, 1, 4));
  P.wl = 1;  // query 1 sees 2..3
  EXPECT_FALSE(P.sees(0, 1, 1));
  EXPECT_TRUE(P.sees(0, 1, 2));
  P.causal = false;
  P.wl = -1;
  P.wr = 0;
  P.lq = {4};
  P.lk = {2};  // off = -2: query 0 sees nothing, query 2 sees key 0
  EXPECT_FALSE(P.sees(0, 0, 0));
  EXPECT_FALSE(P.sees(0, 1, 0));
  EXPECT_TRUE(P.sees(0, 2, 0));
  EXPECT_FALSE(P.sees(0, 2, 1));
}

// Calls from several caller threads at once (the reference parallelises internally): each result is still exact.
TEST(Dense, ConcurrentCallers) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  std::vector<std::unique_ptr<Built>> bs;
  for (int t = 0; t < 4; ++t) bs.push_back(build(mk(4, 1, 64, F32, {129 + t, 11}, {300, 11 + t}, t % 2 == 1, 16), rng));
  std::vector<AttentionOutputs> outs;
  for (auto& b : bs) outs.push_back(b->outputs());
  std::vector<std::thread> th;
  std::vector<std::string> errors(bs.size());
  for (size_t t = 0; t < bs.size(); ++t)
    th.emplace_back([&, t] {
      try {
        for (int rep = 0; rep < 3; ++rep) attention(bs[t]->in, outs[t]);
        SelectionParams p;
        p.block_size = 64;
        (void)build_index(bs[t]->in, p);
      } catch (const std::exception& e) {
        errors[t] = e.what();
      }
    });
  for (auto& x : th) x.join();
  for (size_t t = 0; t < bs.size(); ++t) {
    EXPECT_EQ(errors[t], "");
    expect_matches(*bs[t], naive64::dense(bs[t]->np), true, "attention (concurrent caller " + std::to_string(t) + ")");
  }
}

// A randomised sweep: random shapes, dtypes, layouts and masks.
TEST(Dense, RandomSweep) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  const int lens[] = {1, 2, 11, 63, 64, 65, 127, 128, 129, 200, 257};
  const int groups[] = {1, 3, 4, 6, 8};
  const int pss[] = {1, 16, 64, 128, 5};
  const DType dts[] = {F32, F16, BF16};
  for (int it = 0; it < 40; ++it) {
    Case c;
    const int g = groups[rng() % 5];
    c.Hkv = 1 + int(rng() % 2);
    c.Hq = g * c.Hkv;
    c.D = (rng() % 4 == 0) ? 128 : 64;
    c.dtype = dts[rng() % 3];
    const int nseq = 1 + int(rng() % 3);
    for (int b = 0; b < nseq; ++b) {
      c.lq.push_back(lens[rng() % 11]);
      c.lk.push_back(rng() % 2 ? c.lq.back() : lens[rng() % 11]);
    }
    c.paged = rng() % 2;
    c.page_size = pss[rng() % 5];
    c.causal = rng() % 3 != 0;
    c.wl = rng() % 2 ? -1 : int(rng() % 80);
    c.wr = rng() % 2 ? -1 : int(rng() % 20);
    SCOPED_TRACE(c.str());
    auto B = build(c, rng);
    run_dense(*B);
    expect_matches(*B, naive64::dense(B->np), true, "attention (sweep)");
  }
}

}  // namespace
}  // namespace sptest
