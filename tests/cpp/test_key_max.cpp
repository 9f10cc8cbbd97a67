// SelectionRule::kKeyMax (docs/design/key_max_spec.md) in the CPU reference: the shared basis helpers
// (core/key_basis.h: hash_unit's values, also asserted against the emulator in test_accuracy_emulator.py), the basis
// (orthonormal, spans the directions planted in its group's queries, reads only the sampled positions of its group,
// every head sub-group scores through its KV head's basis), the rule on a needle the pooled means miss, alpha 0 =
// dense in every mode, paged = contiguous, and the validation of rule / key_rank. The selection against the torch
// emulator: test_accuracy_emulator.py.
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
  EXPECT_EQ(kKeyBasisSampleBlocks, 16);
  EXPECT_EQ(key_basis_stride(0), 1);
  EXPECT_EQ(key_basis_stride(kKeyBasisSampleBlocks), 1);
  EXPECT_EQ(key_basis_stride(kKeyBasisSampleBlocks + 1), 2);
  EXPECT_EQ(key_basis_stride(2 * kKeyBasisSampleBlocks + 2), 3);
}

// Unit vectors: `count` random directions of R^D.
std::vector<std::vector<double>> random_units(int count, int D, std::mt19937_64& rng) {
  std::normal_distribution<double> N(0.0, 1.0);
  std::vector<std::vector<double>> out;
  for (int t = 0; t < count; ++t) {
    std::vector<double> u(D);
    double n = 0;
    for (auto& x : u) n += (x = N(rng)) * x;
    for (auto& x : u) x /= std::sqrt(n);
    out.push_back(u);
  }
  return out;
}

// Query heads [h0, h0 + heads) of every position: three planted directions of large variance plus unit noise.
void plant_queries(Built& B, int h0, int heads, const std::vector<std::vector<double>>& planted, std::mt19937_64& rng) {
  std::normal_distribution<double> N(0.0, 1.0);
  const int D = B.c.D, Hq = B.c.Hq;
  for (int64_t i = 0; i < B.total_q; ++i)
    for (int h = h0; h < h0 + heads; ++h) {
      const double a[3] = {20 * N(rng), 14 * N(rng), 9 * N(rng)};
      for (int d = 0; d < D; ++d) {
        double x = N(rng);
        for (int t = 0; t < 3; ++t) x += a[t] * planted[t][d];
        B.q.set((i * Hq + h) * D + d, x);
      }
    }
}

// The basis of KV head 0 from its group's queries (heads 0 and 1 of 4): orthonormal, spans the directions planted in
// them (not those of the other group's heads), and the keys' coordinates are P^T (k_j - k_mean_J).
TEST(KeyMax, BasisIsOrthonormalAndHoldsItsGroupsQueryDirections) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (int D : {64, 128})
    for (int r : {16, 32}) {
      Case c = sc(4, 2, D, F32, {777}, {777}, false, 1);  // 13 blocks of positions, the last one partial
      c.structured = false;
      auto B = build(c, rng);
      const auto planted = random_units(3, D, rng), other = random_units(3, D, rng);
      plant_queries(*B, 0, 2, planted, rng);
      plant_queries(*B, 2, 2, other, rng);
      const Problem p = validate_inputs(B->in, nullptr);
      const std::vector<double> P = reference::key_basis(B->in, p, 0, 0, 2, r, 64);
      ASSERT_EQ(P.size(), size_t(D) * r);
      for (int a = 0; a < r; ++a)
        for (int c2 = 0; c2 < r; ++c2) {
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += P[size_t(d) * r + a] * P[size_t(d) * r + c2];
          EXPECT_NEAR(dot, a == c2 ? 1.0 : 0.0, 1e-12) << "D " << D << " r " << r << " columns " << a << ", " << c2;
        }
      auto in_span = [&](const std::vector<double>& u) {  // |P^T u|^2
        double norm2 = 0;
        for (int cc = 0; cc < r; ++cc) {
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += P[size_t(cc) + size_t(d) * r] * u[d];
          norm2 += dot * dot;
        }
        return norm2;
      };
      // noise variance 1 vs 81..400 over 1554 query rows: the sample moments tilt a direction by ~D / (81 n)
      for (int t = 0; t < 3; ++t) EXPECT_GT(in_span(planted[t]), 0.99) << "D " << D << " r " << r << " planted " << t;
      for (int t = 0; t < 3; ++t)  // the other group's directions: as much as a random direction (~r / D), not 1
        EXPECT_LT(in_span(other[t]), 0.8) << "D " << D << " r " << r << " other group's direction " << t;
      // the coordinates are P^T (k_j - k_mean_J)
      const auto kv = reference::gather_kv(B->in, p);
      std::vector<int32_t> cu;
      std::vector<float> km;
      reference::pool_kv(p, kv, 64, cu, km, nullptr);
      const std::vector<double> Y = reference::key_coordinates(kv[0], km.data(), 2 * D, D, P, r, 64);
      for (int64_t j : {0, 100, 776})
        for (int cc : {0, r - 1}) {
          double dot = 0;
          for (int d = 0; d < D; ++d)
            dot += P[size_t(d) * r + cc] *
                   (double(kv[0].k[size_t(j) * D + d]) - double(km[size_t(j / 64) * 2 * D + d]));
          EXPECT_NEAR(Y[size_t(j) * r + cc], dot, 1e-9 * (1 + std::abs(dot)));
        }
    }
}

// nbq = 113 blocks of positions: stride 8, blocks 0, 8, ..., 112. A query of block 1 does not move the basis, one of
// block 8 or of the partial tail block does; a query of the other group's heads does not.
TEST(KeyMax, BasisReadsOnlyTheSampledPositionsOfItsGroup) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  const int D = 64, bs = 64, nbq = 113, Hq = 4;
  const int s = int(key_basis_stride(nbq));  // sampled: blocks 0, s, 2s, ...
  ASSERT_GT(s, 1);
  ASSERT_EQ((nbq - 1) % s, 0);  // the partial tail block is sampled
  const int L = nbq * bs - 20;
  Case c = sc(Hq, 2, D, F32, {L}, {L}, false, 1);
  c.structured = false;
  auto B = build(c, rng);
  const Problem p = validate_inputs(B->in, nullptr);
  const std::vector<double> P = reference::key_basis(B->in, p, 0, 0, 2, 16, bs);
  auto moved = [&](int64_t pos, int h) {  // the basis after a change of query (pos, h), then the change undone
    std::vector<double> old(D);
    for (int d = 0; d < D; ++d) {
      const int64_t i = (pos * Hq + h) * D + d;
      old[d] = B->q.get(i);
      B->q.set(i, old[d] + 50.0 * (d % 3));
    }
    const bool differs = reference::key_basis(B->in, p, 0, 0, 2, 16, bs) != P;
    for (int d = 0; d < D; ++d) B->q.set((pos * Hq + h) * D + d, old[d]);
    return differs;
  };
  EXPECT_FALSE(moved(1 * bs + 5, 0));
  EXPECT_TRUE(moved(int64_t(s) * bs + 5, 1));
  EXPECT_TRUE(moved(int64_t(nbq - 1) * bs + 1, 0));  // the partial tail block
  EXPECT_FALSE(moved(int64_t(s) * bs + 5, 2));       // KV head 1's group
  EXPECT_EQ(reference::key_basis(B->in, p, 0, 0, 2, 16, bs), P);
}

// Under head sub-groups every sub-group scores through its KV head's basis, from the whole group's queries (the
// spec's basis per KV head), not its own heads': head 0 looks for a needle along u at |q| 8, head 1's queries span a
// 16-dimensional W orthogonal to u at |q| 80. The group's rank-16 basis is W, so per query head (S = 2) head 0 scores
// the needle's block at its mean and drops it, where a model of head 0 alone (its queries' basis holds u) keeps it.
TEST(KeyMax, SubGroupsScoreThroughTheWholeGroupsBasis) {
  SP_SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  const int L = 1024, D = 64, bs = 64, needle_block = 5;
  const double scale = 1.0 / 8, a = 8;
  std::normal_distribution<double> N(0.0, 1.0);
  // u and an orthonormal W (Gram-Schmidt of random vectors against u and each other)
  auto basis = random_units(17, D, rng);
  for (int i = 0; i < 17; ++i) {
    for (int j = 0; j < i; ++j) {
      double dot = 0;
      for (int d = 0; d < D; ++d) dot += basis[i][d] * basis[j][d];
      for (int d = 0; d < D; ++d) basis[i][d] -= dot * basis[j][d];
    }
    double n = 0;
    for (int d = 0; d < D; ++d) n += basis[i][d] * basis[i][d];
    for (int d = 0; d < D; ++d) basis[i][d] /= std::sqrt(n);
  }
  const std::vector<double>& u = basis[0];
  auto make = [&](int Hq) {
    Case c = sc(Hq, 1, D, F32, {L}, {L}, false, 1);
    c.structured = false;
    c.scale = float(scale);
    auto B = build(c, rng);
    for (int64_t i = 0; i < L; ++i) {
      for (int d = 0; d < D; ++d) B->q.set((i * Hq) * D + d, a * u[d]);
      if (Hq == 2) {
        std::vector<double> w(D, 0.0);
        double n = 0;
        std::vector<double> coef(16);
        for (auto& x : coef) n += (x = N(rng)) * x;
        for (int t = 0; t < 16; ++t)
          for (int d = 0; d < D; ++d) w[d] += 80.0 * coef[t] / std::sqrt(n) * basis[1 + t][d];
        for (int d = 0; d < D; ++d) B->q.set((i * Hq + 1) * D + d, w[d]);
      }
    }
    for (int64_t j = 0; j < L; ++j) {  // as KeepsTheNeedleThePooledMeansMiss (below)
      const double logit = j / bs == needle_block ? (j == needle_block * bs + 17 ? 20.0 : 0.0) : 2.0;
      std::vector<double> x(D);
      double along = 0;
      for (int d = 0; d < D; ++d) along += (x[d] = 0.1 * N(rng)) * u[d];
      for (int d = 0; d < D; ++d) B->k.set(j * D + d, x[d] - along * u[d] + logit / (scale * a) * u[d]);
    }
    return B;
  };
  SelectionParams p = key_max(sp(0.5f, bs, 0, 64, 0, false));
  p.head_subgroups = 0;  // one selection per query head
  auto pair = make(2), alone = make(1);
  const auto lp = lists_of(build_index(pair->in, p)), la = lists_of(build_index(alone->in, p));
  const size_t tiles = size_t(L / 128);
  ASSERT_EQ(lp.size(), 2 * tiles);  // virtual head 0 (query head 0), then virtual head 1
  ASSERT_EQ(la.size(), tiles);
  int checked = 0;
  for (size_t t = 0; t < tiles; ++t) {
    if (int64_t(t) * 128 < (needle_block + 2) * bs) continue;  // tiles that see the needle's block whole
    const std::set<int> in_pair(lp[t].begin(), lp[t].end()), in_alone(la[t].begin(), la[t].end());
    EXPECT_TRUE(in_alone.count(needle_block)) << "tile " << t << ": " << list_str(la[t]);
    EXPECT_FALSE(in_pair.count(needle_block)) << "tile " << t << ": " << list_str(lp[t]);
    ++checked;
  }
  EXPECT_GE(checked, 3);
}

// One needle key (logit 20) in a block of zero logits, every other key at logit 2 (small noise orthogonal to the
// queries' direction u): the pooled means see the needle's block at 20/64 and drop it; key_max finds it (u is the
// queries' one direction) and, one pass from the diagonal, drops the blocks before it (their running maximum is the
// needle).
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
  p.rule = static_cast<SelectionRule>(5);
  EXPECT_ARG_ERROR(build_index(B->in, p), "rule");
}

}  // namespace
}  // namespace sptest
