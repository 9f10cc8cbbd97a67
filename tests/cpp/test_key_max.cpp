// SelectionRule::kKeyMax (docs/design/key_max_spec.md) in the CPU reference: the shared basis helpers
// (core/key_basis.h: hash_unit's values, also asserted against the emulator in test_accuracy_emulator.py), the basis
// (orthonormal, spans the residuals' planted directions, reads only the sampled blocks, the same for every virtual
// head of a KV head), the rule on a needle the pooled means miss, alpha 0 = dense in every mode, paged = contiguous,
// and the validation of rule / key_rank. The selection against the torch emulator: test_accuracy_emulator.py.
#include <set>

#include "api/validate.h"
#include "core/key_basis.h"
#include "reference/reference.h"
#include "test_util.h"

namespace sptest {
namespace {

const DType F32 = DType::kFloat32, BF16 = DType::kBFloat16;

SelectionParams key_max(SelectionParams p, int rank = 16) {
  p.rule = SelectionRule::kKeyMax;
  p.key_rank = rank;
  return p;
}

// Fixed values: the CUDA kernels and bench/accuracy/emulate.py's hash_unit must return the same (exact multiples of
// 2^-23; the same pairs are asserted in Python).
TEST(KeyMax, HashUnitFixedValues) {
  const struct { uint32_t d, c; int32_t units; } cases[] = {
      {0, 0, -8388608}, {1, 0, -2288744}, {0, 1, -2438505}, {5, 3, 3842360}, {127, 31, -3344486}, {63, 15, -1684295}};
  for (const auto& x : cases) EXPECT_EQ(hash_unit(x.d, x.c), float(x.units) / float(1 << 23)) << x.d << ", " << x.c;
  for (uint32_t d = 0; d < 128; ++d)
    for (uint32_t c = 0; c < 32; ++c) {
      const float h = hash_unit(d, c);
      EXPECT_TRUE(h >= -1.f && h < 1.f);
    }
  EXPECT_EQ(kKeyBasisIters, 10);
  EXPECT_EQ(kKeyBasisSampleBlocks, 64);
  EXPECT_EQ(key_basis_stride(0), 1);
  EXPECT_EQ(key_basis_stride(kKeyBasisSampleBlocks), 1);
  EXPECT_EQ(key_basis_stride(kKeyBasisSampleBlocks + 1), 2);
  EXPECT_EQ(key_basis_stride(2 * kKeyBasisSampleBlocks + 2), 3);
}

// Keys of one (sequence, head): per-block offsets plus three planted residual directions of large variance plus
// unit noise; their pooled means (float, as pool_kv).
struct Keys {
  reference::SequenceKV kv;
  std::vector<float> mean;
  std::vector<std::vector<double>> planted;  // unit vectors
};
Keys planted_keys(int64_t len, int D, int bs, std::mt19937_64& rng) {
  std::normal_distribution<double> N(0.0, 1.0);
  Keys K;
  K.kv.len = len;
  K.kv.k.resize(size_t(len) * D);
  for (int t = 0; t < 3; ++t) {
    std::vector<double> u(D);
    double n = 0;
    for (auto& x : u) n += (x = N(rng)) * x;
    for (auto& x : u) x /= std::sqrt(n);
    K.planted.push_back(u);
  }
  const int64_t nb = (len + bs - 1) / bs;
  std::vector<double> offset(size_t(nb) * D);
  for (auto& x : offset) x = 3 * N(rng);
  for (int64_t j = 0; j < len; ++j) {
    const double a[3] = {20 * N(rng), 14 * N(rng), 9 * N(rng)};
    for (int d = 0; d < D; ++d) {
      double x = offset[size_t(j / bs) * D + d] + N(rng);
      for (int t = 0; t < 3; ++t) x += a[t] * K.planted[t][d];
      K.kv.k[size_t(j) * D + d] = float(x);
    }
  }
  K.mean.assign(size_t(nb) * D, 0.f);
  for (int64_t J = 0; J < nb; ++J) {
    const int64_t lo = J * bs, hi = std::min<int64_t>(lo + bs, len);
    for (int d = 0; d < D; ++d) {
      double s = 0;
      for (int64_t j = lo; j < hi; ++j) s += K.kv.k[size_t(j) * D + d];
      K.mean[size_t(J) * D + d] = float(s / double(hi - lo));
    }
  }
  return K;
}

TEST(KeyMax, BasisIsOrthonormalAndHoldsThePlantedDirections) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (int D : {64, 128})
    for (int r : {16, 32}) {
      const Keys K = planted_keys(777, D, 64, rng);  // 13 blocks, the last one partial
      const std::vector<double> P = reference::key_basis(K.kv, K.mean.data(), D, D, r, 64);
      ASSERT_EQ(P.size(), size_t(D) * r);
      for (int a = 0; a < r; ++a)
        for (int c = 0; c < r; ++c) {
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += P[size_t(d) * r + a] * P[size_t(d) * r + c];
          EXPECT_NEAR(dot, a == c ? 1.0 : 0.0, 1e-12) << "D " << D << " r " << r << " columns " << a << ", " << c;
        }
      for (int t = 0; t < 3; ++t) {  // |P^T u| = 1: u lies in the span (noise variance 1 vs 81..400; the sample moments tilt it by ~D / (81 n))
        double norm2 = 0;
        for (int c = 0; c < r; ++c) {
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += P[size_t(d) * r + c] * K.planted[t][d];
          norm2 += dot * dot;
        }
        EXPECT_GT(norm2, 0.99) << "D " << D << " r " << r << " planted " << t;
      }
      // the coordinates are P^T (k_j - k_mean_J)
      const std::vector<double> Y = reference::key_coordinates(K.kv, K.mean.data(), D, D, P, r, 64);
      for (int64_t j : {0, 100, 776})
        for (int c : {0, r - 1}) {
          double dot = 0;
          for (int d = 0; d < D; ++d)
            dot += P[size_t(d) * r + c] * (double(K.kv.k[size_t(j) * D + d]) - double(K.mean[size_t(j / 64) * D + d]));
          EXPECT_NEAR(Y[size_t(j) * r + c], dot, 1e-9 * (1 + std::abs(dot)));
        }
    }
}

// nb = 130 blocks: stride 3, blocks 0, 3, ..., 129. A key of block 4 does not move the basis; one of block 3 does.
TEST(KeyMax, BasisReadsOnlyTheSampledBlocks) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  const int D = 64, bs = 64, nb = 113;
  const int s = int(key_basis_stride(nb));  // sampled: blocks 0, s, 2s, ...
  ASSERT_GT(s, 1);
  ASSERT_EQ((nb - 1) % s, 0);  // the partial tail block is sampled
  Keys K = planted_keys(nb * bs - 20, D, bs, rng);
  const std::vector<double> P = reference::key_basis(K.kv, K.mean.data(), D, D, 16, bs);
  Keys other = K;
  for (int d = 0; d < D; ++d) other.kv.k[size_t(1 * bs + 5) * D + d] += 50.f * float(d % 3);
  EXPECT_EQ(reference::key_basis(other.kv, other.mean.data(), D, D, 16, bs), P);
  other = K;
  for (int d = 0; d < D; ++d) other.kv.k[size_t(s * bs + 5) * D + d] += 50.f * float(d % 3);
  EXPECT_NE(reference::key_basis(other.kv, other.mean.data(), D, D, 16, bs), P);
  other = K;  // the partial tail block
  for (int d = 0; d < D; ++d) other.kv.k[size_t((nb - 1) * bs + 1) * D + d] += 50.f * float(d % 3);
  EXPECT_NE(reference::key_basis(other.kv, other.mean.data(), D, D, 16, bs), P);
}

// The reference selects on the virtual problem under head sub-groups: its K holds each KV head S times, and the
// basis computed for every copy equals the KV head's own, bit for bit (the spec's basis per KV head).
TEST(KeyMax, VirtualHeadsShareTheirKVHeadsBasis) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (bool paged : {false, true}) {
    auto B = build(sc(8, 2, 64, BF16, {300, 129}, {700, 129}, paged, 16), rng);
    const Problem p = validate_inputs(B->in, nullptr);
    const int S = 4, bs = 64, D = 64;
    const reference::VirtualHeadCopies virt = reference::virtual_head_copies(B->in, p, S);
    const auto kv = reference::gather_kv(B->in, p), vkv = reference::gather_kv(virt.in, virt.p);
    std::vector<int32_t> cu, vcu;
    std::vector<float> km, vkm;
    reference::pool_kv(p, kv, bs, cu, km, nullptr);
    reference::pool_kv(virt.p, vkv, bs, vcu, vkm, nullptr);
    for (int b = 0; b < p.batch; ++b)
      for (int h = 0; h < p.num_kv_heads; ++h) {
        const std::vector<double> P = reference::key_basis(kv[size_t(b) * 2 + h], &km[(size_t(cu[b]) * 2 + h) * D],
                                                           2 * D, D, 16, bs);
        for (int s = 0; s < S; ++s) {
          const int v = h * S + s;
          EXPECT_EQ(reference::key_basis(vkv[size_t(b) * 2 * S + v], &vkm[(size_t(vcu[b]) * 2 * S + v) * D],
                                         2 * S * D, D, 16, bs),
                    P)
              << "paged " << paged << " sequence " << b << " head " << h << " copy " << s;
        }
      }
  }
}

// One needle key (logit 20) in a block of zero logits, every other key at logit 2 (small noise orthogonal to the
// queries' direction u): the pooled means see the needle's block at 20/64 and drop it; key_max finds it (u is the residuals'
// top direction) and, one pass from the diagonal, drops the blocks before it (their running maximum is the needle).
TEST(KeyMax, KeepsTheNeedleThePooledMeansMiss) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  const int L = 1024, D = 64, bs = 64, needle_block = 5;
  Case c = sc(1, 1, D, F32, {L}, {L}, false, 1);
  c.structured = false;
  auto B = build(c, rng);
  const double scale = 1.0 / 8, a = 8;  // |q| = a
  std::normal_distribution<double> N(0.0, 1.0);
  std::vector<double> u(D);
  double n = 0;
  for (auto& x : u) n += (x = N(rng)) * x;
  for (auto& x : u) x /= std::sqrt(n);
  for (int64_t i = 0; i < L; ++i)
    for (int d = 0; d < D; ++d) B->q.set(i * D + d, a * u[d]);
  for (int64_t j = 0; j < L; ++j) {
    const double logit = j / bs == needle_block ? (j == needle_block * bs + 17 ? 20.0 : 0.0) : 2.0;
    std::vector<double> x(D);
    double along = 0;
    for (int d = 0; d < D; ++d) along += (x[d] = 0.1 * N(rng)) * u[d];  // small: the needle tops C's spectrum
    for (int d = 0; d < D; ++d) B->k.set(j * D + d, x[d] - along * u[d] + logit / (scale * a) * u[d]);
  }
  SelectionParams p = sp(0.5f, bs, 0, 64, 0, false);
  const BlockIndex km = build_index(B->in, key_max(p)), rm = build_index(B->in, [&] {
    SelectionParams r = p;
    r.rule = SelectionRule::kRowMax;
    return r;
  }());
  const auto kl = lists_of(km), rl = lists_of(rm);
  ASSERT_EQ(kl.size(), size_t(L / 128));
  int checked = 0;
  for (size_t t = 0; t < kl.size(); ++t) {
    const int64_t first_pos = int64_t(t) * 128;
    if (first_pos < (needle_block + 2) * bs) continue;  // tiles that see the needle's block whole, not in the band
    const std::set<int> k(kl[t].begin(), kl[t].end()), r(rl[t].begin(), rl[t].end());
    EXPECT_TRUE(k.count(needle_block)) << "tile " << t << ": " << list_str(kl[t]);
    EXPECT_FALSE(r.count(needle_block)) << "tile " << t << ": " << list_str(rl[t]);
    for (int J = 0; J < needle_block; ++J) EXPECT_FALSE(k.count(J)) << "tile " << t << " block " << J;
    ++checked;
  }
  EXPECT_GE(checked, 3);
}

// alpha 0 keeps every visible block (the rowmax lists at alpha 0, themselves dense) in every mode.
TEST(KeyMax, AlphaZeroIsDense) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  const Case cases[] = {
      sc(4, 1, 64, F32, {777}, {777}, false, 1),
      sc(8, 2, 128, BF16, {129}, {1500}, true, 64),                   // chunk, paged
      sc(6, 2, 64, F32, {300, 11}, {300, 500}, true, 16),             // varlen
      sc(4, 1, 64, F32, {400}, {450}, false, 1, false, 200, 30),      // window, not causal
  };
  for (const Case& c : cases) {
    auto B = build(c, rng);
    for (int S : {1, 0}) {
      for (int bs : {64, 128}) {
        SelectionParams p = key_max(sp(0.f, bs, 0, 0, 0, false), 32);
        p.head_subgroups = S;
        const BlockIndex k = build_index(B->in, p);
        p.rule = SelectionRule::kRowMax;
        const BlockIndex r = build_index(B->in, p);
        EXPECT_EQ(k.density(), 1.0) << c.str();
        EXPECT_EQ(lists_of(k), lists_of(r)) << c.str();
      }
    }
  }
}

// The same logical inputs, contiguous and paged (build() draws the values before laying them out): same lists. At
// alpha 1 (a row keeps the blocks that set its running maximum) so that something is pruned: the tiles' union over
// 128 rows of these topic workloads keeps nearly every block at lower alphas.
TEST(KeyMax, PagedEqualsContiguous) {
  SP_SEED_TRACE();
  const uint64_t seed = test_seed();
  std::mt19937_64 r1(seed), r2(seed);
  auto A = build(sc(6, 2, 64, F32, {300, 777}, {500, 777}, false, 1), r1);
  auto P = build(sc(6, 2, 64, F32, {300, 777}, {500, 777}, true, 16), r2);
  for (int S : {1, 3}) {
    SelectionParams p = key_max(sp(1.0f, 64, 0, 0, 0, false));
    p.head_subgroups = S;
    const BlockIndex a = build_index(A->in, p), b = build_index(P->in, p);
    std::cout << "[key_max] paged = contiguous, S " << S << ": density " << a.density() << "\n";
    EXPECT_LT(a.density(), 1.0);
    EXPECT_EQ(lists_of(a), lists_of(b));
  }
}

TEST(KeyMax, Validation) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  auto B = build(sc(4, 1, 64, F32, {200}, {200}, false, 1), rng);
  SelectionParams p = key_max(sp(0.1f, 64, 0, 0, 0));
  EXPECT_NO_THROW(build_index(B->in, p));
  for (int r : {0, 8, 17, 24, 64, -16}) {
    p.key_rank = r;
    EXPECT_ARG_ERROR(build_index(B->in, p), "key_rank") << " key_rank " << r;
    EXPECT_ARG_ERROR(check_selection_params(p), "key_rank") << " key_rank " << r;
  }
  p.key_rank = 32;
  EXPECT_NO_THROW(build_index(B->in, p));
  p.rule = static_cast<SelectionRule>(6);
  EXPECT_ARG_ERROR(build_index(B->in, p), "rule");
}

}  // namespace
}  // namespace sptest
