#include "naive64.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

namespace naive64 {

namespace {
constexpr int kTile = 128;
const double kNegInf = -std::numeric_limits<double>::infinity();

double dot(const double* a, const double* b, int D) {
  double s = 0;
  for (int d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

// softmax over (logit, value) pairs, written to out[0..D) and returned lse
struct Softmax {
  std::vector<double> logits;
  std::vector<const double*> values;
  void add(double l, const double* v) {
    logits.push_back(l);
    values.push_back(v);
  }
  double finish(int D, double* out) const {
    for (int d = 0; d < D; ++d) out[d] = 0;
    if (logits.empty()) return kNegInf;
    double m = kNegInf;
    for (double l : logits) m = std::max(m, l);
    double sum = 0;
    for (size_t i = 0; i < logits.size(); ++i) {
      double p = std::exp(logits[i] - m);
      sum += p;
      for (int d = 0; d < D; ++d) out[d] += p * values[i][d];
    }
    for (int d = 0; d < D; ++d) out[d] /= sum;
    return m + std::log(sum);
  }
};
}  // namespace

int64_t Problem::total_q() const {
  int64_t n = 0;
  for (auto l : lq) n += l;
  return n;
}

bool Problem::sees(int b, int64_t i, int64_t j) const {
  const int64_t Lq = lq[b], Lk = lk[b], off = Lk - Lq;
  if (i < 0 || i >= Lq) return false;
  if (j < 0 || j >= Lk) return false;
  if (causal && j > i + off) return false;
  if (wr >= 0 && j > i + off + wr) return false;
  if (wl >= 0 && j < i + off - wl) return false;
  return true;
}

Result dense(const Problem& P) {
  Result R;
  const int64_t tq = P.total_q();
  R.out.assign(tq * P.Hq * P.D, 0.0);
  R.lse.assign(P.Hq * tq, kNegInf);
  for (int b = 0; b < P.B; ++b)
    for (int64_t i = 0; i < P.lq[b]; ++i)
      for (int h = 0; h < P.Hq; ++h) {
        const int kvh = h / P.g();
        Softmax sm;
        for (int64_t j = 0; j < P.lk[b]; ++j)
          if (P.sees(b, i, j)) sm.add(P.scale * dot(P.qrow(b, i, h), P.krow(b, j, kvh), P.D), P.vrow(b, j, kvh));
        const int64_t row = P.q_start[b] + i;
        R.lse[h * tq + row] = sm.finish(P.D, &R.out[(row * P.Hq + h) * P.D]);
      }
  return R;
}

Pooled pool(const Problem& P, int bs) {
  Pooled pl;
  pl.bs = bs;
  pl.cu_blocks.assign(P.B + 1, 0);
  for (int b = 0; b < P.B; ++b) pl.cu_blocks[b + 1] = pl.cu_blocks[b] + (P.lk[b] + bs - 1) / bs;
  const int64_t nbt = pl.cu_blocks[P.B];
  pl.count.assign(nbt, 0);
  pl.k_mean.assign(nbt * P.Hkv * P.D, 0.0);
  pl.v_mean.assign(nbt * P.Hkv * P.D, 0.0);
  for (int b = 0; b < P.B; ++b)
    for (int64_t J = 0; J < pl.cu_blocks[b + 1] - pl.cu_blocks[b]; ++J) {
      const int64_t gJ = pl.cu_blocks[b] + J;
      const int64_t j0 = J * bs, j1 = std::min<int64_t>(j0 + bs, P.lk[b]);
      pl.count[gJ] = j1 - j0;
      for (int kvh = 0; kvh < P.Hkv; ++kvh)
        for (int d = 0; d < P.D; ++d) {
          double sk = 0, sv = 0;
          for (int64_t j = j0; j < j1; ++j) {
            sk += P.krow(b, j, kvh)[d];
            sv += P.vrow(b, j, kvh)[d];
          }
          pl.k_mean[(gJ * P.Hkv + kvh) * P.D + d] = sk / double(j1 - j0);
          pl.v_mean[(gJ * P.Hkv + kvh) * P.D + d] = sv / double(j1 - j0);
        }
    }
  return pl;
}

int64_t num_tiles(const Problem& P, int b) { return (P.lq[b] * P.g() + kTile - 1) / kTile; }

std::vector<Segment> segments(const Problem& P) {
  std::vector<Segment> segs;
  for (int b = 0; b < P.B; ++b) {
    const int64_t T = num_tiles(P, b), rows = P.lq[b] * P.g();
    for (int kvh = 0; kvh < P.Hkv; ++kvh)
      for (int64_t t = 0; t < T; ++t) {
        Segment s;
        s.b = b;
        s.kvh = kvh;
        s.t = int(t);
        s.row_begin = t * kTile;
        s.row_end = std::min<int64_t>(t * kTile + kTile, rows);
        segs.push_back(s);
      }
  }
  return segs;
}

TileBlocks analyze(const Problem& P, const Segment& s, int bs) {
  const int64_t Lk = P.lk[s.b], nb = (Lk + bs - 1) / bs;
  TileBlocks tb;
  tb.visible.assign(nb, 0);
  tb.prunable.assign(nb, 1);
  for (int64_t r = s.row_begin; r < s.row_end; ++r) {
    const int64_t p = r / P.g();
    for (int64_t J = 0; J < nb; ++J) {
      bool any = false, all = true;
      for (int64_t j = J * bs; j < std::min<int64_t>(J * bs + bs, Lk); ++j) {
        if (P.sees(s.b, p, j)) any = true;
        else all = false;
      }
      if (any) tb.visible[J] = 1;
      if (!all) tb.prunable[J] = 0;
    }
  }
  if (s.row_end <= s.row_begin) std::fill(tb.prunable.begin(), tb.prunable.end(), 0);
  return tb;
}

Selection select(const Problem& P, const Pooled& pl, const SelParams& sp) {
  Selection S;
  const int bs = sp.bs;
  for (const Segment& s : segments(P)) {
    const int b = s.b;
    const int64_t Lk = P.lk[b], Lq = P.lq[b], off = Lk - Lq, nb = (Lk + bs - 1) / bs;
    const int64_t T = num_tiles(P, b);
    TileBlocks tb = analyze(P, s, bs);
    // scores
    std::vector<double> E(nb, 0.0);
    std::vector<std::vector<double>> sc(s.row_end - s.row_begin, std::vector<double>(nb, kNegInf));
    double M = kNegInf;
    for (int64_t r = s.row_begin; r < s.row_end; ++r) {
      const int64_t p = r / P.g();
      const int h = s.kvh * P.g() + int(r % P.g());
      for (int64_t J = 0; J < nb; ++J) {
        bool sees_block = false;
        for (int64_t j = J * bs; j < std::min<int64_t>(J * bs + bs, Lk); ++j) sees_block |= P.sees(b, p, j);
        if (!sees_block) continue;
        const int64_t gJ = pl.cu_blocks[b] + J;
        double acc = 0;
        for (int d = 0; d < P.D; ++d)
          acc += P.qrow(b, p, h)[d] * double(float(pl.k_mean[(gJ * P.Hkv + s.kvh) * P.D + d]));
        const double sv = P.scale * acc;
        sc[r - s.row_begin][J] = sv;
        M = std::max(M, sv);
      }
    }
    for (int64_t r = s.row_begin; r < s.row_end; ++r)
      for (int64_t J = 0; J < nb; ++J)
        if (sc[r - s.row_begin][J] != kNegInf) E[J] += std::exp(sc[r - s.row_begin][J] - M);
    double maxE = 0;
    for (int64_t J = 0; J < nb; ++J)
      if (tb.visible[J]) maxE = std::max(maxE, E[J]);
    double thr = sp.alpha * maxE;
    if (sp.row_max) {  // E becomes C_J = max over rows r seeing J of s_rJ - (row r's maximum score)
      std::fill(E.begin(), E.end(), kNegInf);
      for (const std::vector<double>& row : sc) {
        double m = kNegInf;
        for (double x : row) m = std::max(m, x);
        for (int64_t J = 0; J < nb; ++J)
          if (row[J] != kNegInf) E[J] = std::max(E[J], row[J] - m);
      }
      thr = sp.alpha > 0 ? std::log(sp.alpha) : kNegInf;
    }
    // always-kept blocks
    std::vector<char> forced(nb, 0);
    for (int64_t J = 0; J < nb; ++J) {
      if (!tb.visible[J]) continue;
      if (!tb.prunable[J]) forced[J] = 1;
      if (int64_t(J) * bs < sp.sink) forced[J] = 1;
      if (s.t >= T - sp.last_n) forced[J] = 1;
    }
    for (int64_t r = s.row_begin; r < s.row_end; ++r) {
      const int64_t p = r / P.g();
      for (int64_t j = std::max<int64_t>(0, p + off - sp.window + 1); j <= p + off && j < Lk; ++j)
        if (P.sees(b, p, j)) forced[j / bs] = 1;
    }
    std::vector<int> list, fl, amb;
    for (int64_t J = 0; J < nb; ++J) {
      if (!tb.visible[J]) continue;
      ++S.visible;
      const bool keep = forced[J] || E[J] >= thr;
      if (keep) {
        list.push_back(int(J));
        ++S.kept;
      }
      if (forced[J]) fl.push_back(int(J));
      else if (sp.row_max ? std::fabs(E[J] - thr) <= 1e-9 : std::fabs(E[J] - thr) <= 1e-6 * thr) amb.push_back(int(J));
    }
    S.lists.push_back(list);
    S.forced.push_back(fl);
    S.ambiguous.push_back(amb);
    S.energy.push_back(E);
    S.threshold.push_back(thr);
  }
  // The dense rule on the kept count; threshold ties that could cross its boundary make the outcome ambiguous.
  int64_t tie_kept = 0, tie_dropped = 0;
  for (size_t s = 0; s < S.lists.size(); ++s)
    for (int J : S.ambiguous[s])
      (std::binary_search(S.lists[s].begin(), S.lists[s].end(), J) ? tie_kept : tie_dropped) += 1;
  auto dense_at = [&](int64_t kept) {
    return sp.dense_fraction < 1.0 && S.visible > 0 && double(kept) >= sp.dense_fraction * double(S.visible);
  };
  S.dense_ambiguous = dense_at(S.kept - tie_kept) != dense_at(S.kept + tie_dropped);
  if (dense_rule(P, sp.bs, sp.dense_fraction, S.lists)) {
    S.dense = true;
    S.kept = S.visible;
    S.forced = S.lists;
    for (auto& a : S.ambiguous) a.clear();
  }
  return S;
}

bool dense_rule(const Problem& P, int bs, double dense_fraction, std::vector<std::vector<int>>& lists) {
  const std::vector<Segment> segs = segments(P);
  std::vector<std::vector<int>> full(segs.size());
  int64_t kept = 0, visible = 0;
  for (size_t s = 0; s < segs.size(); ++s) {
    const TileBlocks tb = analyze(P, segs[s], bs);
    for (int64_t J = 0; J < int64_t(tb.visible.size()); ++J) {
      if (!tb.visible[J]) continue;
      full[s].push_back(int(J));
      ++visible;
      kept += std::binary_search(lists[s].begin(), lists[s].end(), int(J));
    }
  }
  if (dense_fraction >= 1.0 || visible == 0 || double(kept) < dense_fraction * double(visible)) return false;
  lists = full;
  return true;
}

Result sparse(const Problem& P, const Pooled& pl, const std::vector<std::vector<int>>& lists, bool correction) {
  const int bs = pl.bs;
  std::vector<Segment> segs = segments(P);
  std::vector<TileBlocks> tbs;
  for (const auto& s : segs) tbs.push_back(analyze(P, s, bs));
  std::vector<int64_t> seg_off(P.B + 1, 0);
  for (int b = 0; b < P.B; ++b) seg_off[b + 1] = seg_off[b] + P.Hkv * num_tiles(P, b);

  Result R;
  const int64_t tq = P.total_q();
  R.out.assign(tq * P.Hq * P.D, 0.0);
  R.lse.assign(P.Hq * tq, kNegInf);
  for (int b = 0; b < P.B; ++b) {
    const int64_t nb = (P.lk[b] + bs - 1) / bs;
    for (int64_t i = 0; i < P.lq[b]; ++i)
      for (int h = 0; h < P.Hq; ++h) {
        const int kvh = h / P.g();
        const int64_t r = i * P.g() + h % P.g(), t = r / kTile;
        const int64_t sid = seg_off[b] + kvh * num_tiles(P, b) + t;
        std::vector<char> listed(nb, 0);
        for (int J : lists[sid])
          if (J >= 0 && J < nb) listed[J] = 1;
        Softmax sm;
        for (int64_t j = 0; j < P.lk[b]; ++j)
          if (listed[j / bs] && P.sees(b, i, j))
            sm.add(P.scale * dot(P.qrow(b, i, h), P.krow(b, j, kvh), P.D), P.vrow(b, j, kvh));
        if (correction)
          for (int64_t J = 0; J < nb; ++J)
            if (!listed[J] && tbs[sid].prunable[J]) {
              const int64_t gJ = pl.cu_blocks[b] + J;
              const double* km = &pl.k_mean[(gJ * P.Hkv + kvh) * P.D];
              const double* vm = &pl.v_mean[(gJ * P.Hkv + kvh) * P.D];
              sm.add(P.scale * dot(P.qrow(b, i, h), km, P.D) + std::log(double(pl.count[gJ])), vm);
            }
        const int64_t row = P.q_start[b] + i;
        R.lse[h * tq + row] = sm.finish(P.D, &R.out[(row * P.Hq + h) * P.D]);
      }
  }
  return R;
}

std::vector<std::vector<int>> union_lists(const Problem& P, const std::vector<std::vector<int>>& lists, int bs,
                                          double dense_fraction) {
  std::vector<Segment> segs = segments(P);
  std::vector<std::vector<int>> out(segs.size());
  size_t i = 0;
  while (i < segs.size()) {
    size_t j = i;
    std::set<int> u;
    while (j < segs.size() && segs[j].b == segs[i].b && segs[j].kvh == segs[i].kvh) {
      u.insert(lists[j].begin(), lists[j].end());
      ++j;
    }
    for (size_t s = i; s < j; ++s) out[s] = std::vector<int>(u.begin(), u.end());
    i = j;
  }
  dense_rule(P, bs, dense_fraction, out);
  return out;
}

int64_t count_kept(const Problem& P, int bs, const std::vector<std::vector<int>>& lists) {
  std::vector<Segment> segs = segments(P);
  int64_t n = 0;
  for (size_t s = 0; s < segs.size(); ++s) {
    TileBlocks tb = analyze(P, segs[s], bs);
    for (int J : lists[s])
      if (J >= 0 && J < int64_t(tb.visible.size()) && tb.visible[J]) ++n;
  }
  return n;
}

}  // namespace naive64
