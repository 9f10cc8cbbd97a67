// Shared helpers of the C++ tests: seeded random inputs, host tensors of every dtype (with bf16/fp16 conversion),
// AttentionInputs for contiguous and paged KV (random page permutation, NaN in every unused page slot), comparison
// against naive64 with dtype-aware tolerances, and an ArgumentError assertion.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <utility>
#include <sstream>
#include <string>
#include <vector>

#include "naive64.h"
#include "sparse_prefill/attention.h"
#include "sparse_prefill/sparse.h"
#include "sparse_prefill/tensor.h"

namespace sptest {

using namespace sparse_prefill;

// ---------------------------------------------------------------------------------------------------------------
// Seeds: one per process (SPARSE_PREFILL_TEST_SEED overrides), mixed with the test name so each test is reproducible
// on its own. Every test that uses randomness should call seed_trace() so failures print the seed.
inline uint64_t process_seed() {
  static const uint64_t seed = [] {
    if (const char* e = std::getenv("SPARSE_PREFILL_TEST_SEED")) return uint64_t(std::strtoull(e, nullptr, 0));
    std::random_device rd;
    return (uint64_t(rd()) << 32) ^ uint64_t(rd());
  }();
  return seed;
}
inline uint64_t test_seed() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "";
  return process_seed() ^ std::hash<std::string>{}(name);
}
#define SP_SEED_TRACE()                                                                                    \
  SCOPED_TRACE(::testing::Message() << "SPARSE_PREFILL_TEST_SEED=" << ::sptest::process_seed() \
                                    << " (rerun with this env var to reproduce)")

// ---------------------------------------------------------------------------------------------------------------
// half conversions
inline uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t x = f2u(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40);
  x += 0x7fffu + ((x >> 16) & 1u);
  return uint16_t(x >> 16);
}
inline float bf16_to_float(uint16_t h) { return u2f(uint32_t(h) << 16); }
inline uint16_t float_to_fp16(float f) {
  const uint32_t x = f2u(f);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return uint16_t(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to inf
  if (ax < 0x38800000u) {                                  // half subnormal (< 2^-14)
    const float af = u2f(ax);
    return uint16_t(sign | uint32_t(std::nearbyint(double(af) * 16777216.0)));
  }
  const uint32_t e = (ax >> 23) - 127 + 15, mant = ax & 0x7fffffu;
  uint32_t h = (e << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return uint16_t(sign | h);
}
inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) return (sign ? -1.0f : 1.0f) * float(m) * 5.9604644775390625e-08f;  // m * 2^-24
  if (e == 31) return u2f(sign | 0x7f800000u | (m << 13));
  return u2f(sign | ((e - 15 + 127) << 23) | (m << 13));
}

// ---------------------------------------------------------------------------------------------------------------
// A host tensor of any dtype, row-major, with element access in double.
struct HostTensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
  int64_t numel = 0;

  HostTensor() = default;
  HostTensor(DType dt, std::vector<int64_t> s) { alloc(dt, std::move(s)); }
  void alloc(DType dt, std::vector<int64_t> s) {
    dtype = dt;
    shape = std::move(s);
    numel = 1;
    for (auto d : shape) numel *= d;
    bytes.assign(size_t(std::max<int64_t>(numel, 1)) * size_t(dtype_bytes(dt)), 0);
  }
  void* data() { return bytes.data(); }
  double get(int64_t i) const {
    switch (dtype) {
      case DType::kFloat32: { float f; std::memcpy(&f, &bytes[i * 4], 4); return f; }
      case DType::kFloat16: { uint16_t h; std::memcpy(&h, &bytes[i * 2], 2); return fp16_to_float(h); }
      case DType::kBFloat16: { uint16_t h; std::memcpy(&h, &bytes[i * 2], 2); return bf16_to_float(h); }
      case DType::kInt32: { int32_t v; std::memcpy(&v, &bytes[i * 4], 4); return v; }
      default: return std::numeric_limits<double>::quiet_NaN();
    }
  }
  // stores v rounded to the dtype; returns the stored value
  double set(int64_t i, double v) {
    switch (dtype) {
      case DType::kFloat32: { float f = float(v); std::memcpy(&bytes[i * 4], &f, 4); break; }
      case DType::kFloat16: { uint16_t h = float_to_fp16(float(v)); std::memcpy(&bytes[i * 2], &h, 2); break; }
      case DType::kBFloat16: { uint16_t h = float_to_bf16(float(v)); std::memcpy(&bytes[i * 2], &h, 2); break; }
      case DType::kInt32: { int32_t x = int32_t(v); std::memcpy(&bytes[i * 4], &x, 4); break; }
      default: break;
    }
    return get(i);
  }
  void fill_nan() {
    for (int64_t i = 0; i < numel; ++i) set(i, std::numeric_limits<double>::quiet_NaN());
  }
  TensorView view(Device dev = Device::kCPU) {
    TensorView t;
    t.data = data();
    t.dtype = dtype;
    t.device = dev;
    t.ndim = int(shape.size());
    int64_t st = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
      t.shape[i] = shape[i];
      t.stride[i] = st;
      st *= shape[i];
    }
    return t;
  }
};

inline TensorView int_view(std::vector<int32_t>& v, std::initializer_list<int64_t> shape) {
  return make_view(v.data(), DType::kInt32, shape);
}

inline const char* dtype_str(DType d) {
  switch (d) {
    case DType::kFloat32: return "f32";
    case DType::kFloat16: return "f16";
    case DType::kBFloat16: return "bf16";
    default: return "other";
  }
}

// ---------------------------------------------------------------------------------------------------------------
// A problem description and the inputs built from it.
struct Case {
  int Hq = 4, Hkv = 1, D = 64;
  DType dtype = DType::kFloat32;
  std::vector<int> lq, lk;
  bool paged = false;
  int page_size = 16;
  int extra_pages = 3;  // unused pages in the cache (NaN-filled)
  int extra_cols = 1;   // unused block_table columns
  bool causal = true;
  int wl = -1, wr = -1;
  std::optional<float> scale;
  bool structured = false;  // topic-structured keys/queries (selective attention) instead of plain Gaussian
  int topic_block = 64;
  double topic_gain = 1.0;
  int constant_kv_block = 0;  // > 0: every key/value equals the first one of its aligned block of this many tokens

  std::string str() const {
    std::ostringstream os;
    os << "Hq=" << Hq << " Hkv=" << Hkv << " D=" << D << " " << dtype_str(dtype) << " lq={";
    for (size_t i = 0; i < lq.size(); ++i) os << (i ? "," : "") << lq[i];
    os << "} lk={";
    for (size_t i = 0; i < lk.size(); ++i) os << (i ? "," : "") << lk[i];
    os << "} " << (paged ? "paged ps=" + std::to_string(page_size) : std::string("contiguous"))
       << (causal ? " causal" : " noncausal") << " window=(" << wl << "," << wr << ")";
    if (scale) os << " scale=" << *scale;
    if (structured) os << " structured(block=" << topic_block << ",gain=" << topic_gain << ")";
    return os.str();
  }
};

// A structured (topic) test case: the shape used by the selection, sparse and union tests.
inline Case sc(int Hq, int Hkv, int D, DType dt, std::vector<int> lq, std::vector<int> lk, bool paged, int ps,
               bool causal = true, int wl = -1, int wr = -1) {
  Case c;
  c.Hq = Hq;
  c.Hkv = Hkv;
  c.D = D;
  c.dtype = dt;
  c.lq = std::move(lq);
  c.lk = std::move(lk);
  c.paged = paged;
  c.page_size = ps;
  c.causal = causal;
  c.wl = wl;
  c.wr = wr;
  c.structured = true;
  return c;
}

// FlashPrefill V2's tile-energy rule (the tests written for it; the row-max rule's tests take rowmax(sp(...))).
// Tile-energy parameters, one selection per KV group (head_subgroups 1: naive64 has no sub-groups; test_subgroups
// checks them against the repeated model), the selection as selected (dense_fraction 1: no dense rule, which would
// turn the near-dense selections of Gaussian inputs into full lists; the rule has tests of its own).
inline SelectionParams sp(float alpha, int bs, int sink, int window, int last_n, bool corr = true) {
  SelectionParams p;
  p.head_subgroups = 1;
  p.dense_fraction = 1.f;
  p.rule = SelectionRule::kTileEnergy;
  p.alpha = alpha;
  p.block_size = bs;
  p.sink = sink;
  p.window = window;
  p.last_n = last_n;
  p.correction = corr;
  return p;
}

// A random selection problem for the sweeps: 1-2 sequences of odd lengths, GQA 1-8, any dtype, contiguous or paged,
// causal or not, windows, and selection parameters (tile-energy rule) with the alpha `alpha(rng)` returns.
template <class Alpha>
std::pair<Case, SelectionParams> random_selection_case(std::mt19937_64& rng, Alpha alpha) {
  const int lens[] = {1, 11, 64, 127, 129, 200, 333, 600};
  const int groups[] = {1, 3, 4, 6, 8};
  const int pss[] = {1, 16, 64, 128};
  const DType dts[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  const int g = groups[rng() % 5];
  const int Hkv = 1 + int(rng() % 2);
  std::vector<int> lq, lk;
  const int nseq = 1 + int(rng() % 2);
  for (int b = 0; b < nseq; ++b) {
    lq.push_back(lens[rng() % 8]);
    lk.push_back(rng() % 2 ? lq.back() : lens[rng() % 8]);
  }
  const DType dt = dts[rng() % 3];
  const bool paged = rng() % 2;
  const int ps = pss[rng() % 4];
  const bool causal = rng() % 4 != 0;
  const int wl = rng() % 2 ? -1 : int(rng() % 300);
  const int wr = rng() % 2 ? -1 : int(rng() % 50);
  Case c = sc(g * Hkv, Hkv, 64, dt, lq, lk, paged, ps, causal, wl, wr);
  const float a = alpha(rng);
  const int bs = 64 * (1 + int(rng() % 3)), sink = int(rng() % 300), window = int(rng() % 300),
            last_n = int(rng() % 3);
  return {c, sp(a, bs, sink, window, last_n)};
}


struct Built {
  Case c;
  HostTensor q, k, v;  // storage as passed (contiguous [total_k,Hkv,D] or paged [pages,ps,Hkv,D])
  std::vector<int32_t> cu_q, cu_k, block_table, seqused;
  int64_t total_q = 0, total_k = 0, num_pages = 0, max_pages = 0;
  AttentionInputs in;
  naive64::Problem np;
  HostTensor out;
  std::vector<float> lse;

  // Fresh outputs poisoned with NaN.
  AttentionOutputs outputs(bool with_lse = true) {
    out.alloc(c.dtype, {total_q, c.Hq, c.D});
    out.fill_nan();
    lse.assign(size_t(std::max<int64_t>(1, c.Hq * total_q)), std::numeric_limits<float>::quiet_NaN());
    AttentionOutputs o;
    o.out = out.view();
    if (with_lse) o.lse = make_view(lse.data(), DType::kFloat32, {c.Hq, total_q});
    return o;
  }
};

inline std::unique_ptr<Built> build(const Case& c, std::mt19937_64& rng) {
  auto B = std::make_unique<Built>();
  B->c = c;
  const int nseq = int(c.lq.size());
  std::normal_distribution<double> N(0.0, 1.0);
  naive64::Problem& P = B->np;
  P.B = nseq;
  P.Hq = c.Hq;
  P.Hkv = c.Hkv;
  P.D = c.D;
  P.causal = c.causal;
  P.wl = c.wl;
  P.wr = c.wr;
  P.scale = c.scale ? double(*c.scale) : 1.0 / std::sqrt(double(c.D));
  B->cu_q.assign(nseq + 1, 0);
  B->cu_k.assign(nseq + 1, 0);
  for (int b = 0; b < nseq; ++b) {
    B->cu_q[b + 1] = B->cu_q[b] + c.lq[b];
    B->cu_k[b + 1] = B->cu_k[b] + c.lk[b];
    P.lq.push_back(c.lq[b]);
    P.lk.push_back(c.lk[b]);
    P.q_start.push_back(B->cu_q[b]);
  }
  B->total_q = B->cu_q[nseq];
  B->total_k = B->cu_k[nseq];
  const int D = c.D, Hq = c.Hq, Hkv = c.Hkv, g = Hq / std::max(1, Hkv);

  // logical values
  P.k.resize(nseq);
  P.v.resize(nseq);
  B->q.alloc(c.dtype, {B->total_q, Hq, D});
  P.q.assign(B->total_q * Hq * D, 0.0);
  HostTensor tmp(c.dtype, {1});  // for rounding
  auto rnd = [&](double x) { return tmp.set(0, x); };
  for (int b = 0; b < nseq; ++b) {
    const int64_t Lk = c.lk[b], Lq = c.lq[b];
    P.k[b].assign(Lk * Hkv * D, 0.0);
    P.v[b].assign(Lk * Hkv * D, 0.0);
    const int64_t ntop = std::max<int64_t>(1, (Lk + c.topic_block - 1) / c.topic_block);
    std::vector<double> topics(ntop * Hkv * D);
    for (auto& x : topics) x = N(rng);
    for (int64_t j = 0; j < Lk; ++j)
      for (int kvh = 0; kvh < Hkv; ++kvh)
        for (int d = 0; d < D; ++d) {
          double kx = N(rng);
          if (c.structured) kx = c.topic_gain * topics[((j / c.topic_block) * Hkv + kvh) * D + d] + 0.5 * kx;
          P.k[b][(j * Hkv + kvh) * D + d] = rnd(kx);
          P.v[b][(j * Hkv + kvh) * D + d] = rnd(N(rng));
          if (c.constant_kv_block > 0 && j % c.constant_kv_block) {
            const int64_t j0 = j - j % c.constant_kv_block;
            P.k[b][(j * Hkv + kvh) * D + d] = P.k[b][(j0 * Hkv + kvh) * D + d];
            P.v[b][(j * Hkv + kvh) * D + d] = P.v[b][(j0 * Hkv + kvh) * D + d];
          }
        }
    for (int64_t i = 0; i < Lq; ++i) {
      // structured: the heads of one KV group at one query position target 2 random topics of the visible prefix
      std::vector<int64_t> tg(2 * Hkv, 0);
      if (c.structured) {
        const int64_t lim = std::max<int64_t>(1, std::min<int64_t>(ntop, (i + Lk - Lq) / c.topic_block + 1));
        for (auto& x : tg) x = int64_t(rng() % uint64_t(lim));
      }
      for (int h = 0; h < Hq; ++h)
        for (int d = 0; d < D; ++d) {
          double qx = N(rng);
          if (c.structured) {
            const int kvh = h / g;
            qx = 0.5 * qx + c.topic_gain * (topics[(tg[2 * kvh] * Hkv + kvh) * D + d] +
                                             topics[(tg[2 * kvh + 1] * Hkv + kvh) * D + d]);
          }
          const int64_t idx = ((B->cu_q[b] + i) * Hq + h) * D + d;
          P.q[idx] = B->q.set(idx, qx);
        }
    }
  }

  AttentionInputs& in = B->in;
  in.q = B->q.view();
  in.cu_seqlens_q = int_view(B->cu_q, {nseq + 1});
  in.max_seqlen_q = nseq ? *std::max_element(c.lq.begin(), c.lq.end()) : 0;
  in.max_seqlen_k = nseq ? *std::max_element(c.lk.begin(), c.lk.end()) : 0;
  in.causal = c.causal;
  in.softmax_scale = c.scale;
  in.window_left = c.wl;
  in.window_right = c.wr;

  if (!c.paged) {
    B->k.alloc(c.dtype, {B->total_k, Hkv, D});
    B->v.alloc(c.dtype, {B->total_k, Hkv, D});
    for (int b = 0; b < nseq; ++b)
      for (int64_t e = 0; e < int64_t(P.k[b].size()); ++e) {
        B->k.set(B->cu_k[b] * Hkv * D + e, P.k[b][e]);
        B->v.set(B->cu_k[b] * Hkv * D + e, P.v[b][e]);
      }
    in.k = B->k.view();
    in.v = B->v.view();
    in.cu_seqlens_k = int_view(B->cu_k, {nseq + 1});
  } else {
    const int64_t ps = c.page_size;
    std::vector<int64_t> npg(nseq);
    int64_t used = 0, maxp = 0;
    for (int b = 0; b < nseq; ++b) {
      npg[b] = (c.lk[b] + ps - 1) / ps;
      used += npg[b];
      maxp = std::max(maxp, npg[b]);
    }
    B->num_pages = used + c.extra_pages;
    B->max_pages = std::max<int64_t>(1, maxp + c.extra_cols);
    std::vector<int32_t> perm(B->num_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    B->block_table.assign(nseq * B->max_pages, 0);
    B->seqused.assign(std::max(nseq, 1), 0);
    B->k.alloc(c.dtype, {B->num_pages, ps, Hkv, D});
    B->v.alloc(c.dtype, {B->num_pages, ps, Hkv, D});
    B->k.fill_nan();
    B->v.fill_nan();
    int64_t next = 0;
    for (int b = 0; b < nseq; ++b) {
      B->seqused[b] = c.lk[b];
      for (int64_t col = 0; col < B->max_pages; ++col)
        B->block_table[b * B->max_pages + col] =
            col < npg[b] ? perm[next++] : int32_t(rng() % uint64_t(std::max<int64_t>(1, B->num_pages)));
      for (int64_t j = 0; j < c.lk[b]; ++j) {
        const int64_t page = B->block_table[b * B->max_pages + j / ps], slot = j % ps;
        for (int e = 0; e < Hkv * D; ++e) {
          B->k.set(((page * ps + slot) * Hkv) * D + e, P.k[b][j * Hkv * D + e]);
          B->v.set(((page * ps + slot) * Hkv) * D + e, P.v[b][j * Hkv * D + e]);
        }
      }
    }
    in.k = B->k.view();
    in.v = B->v.view();
    in.block_table = make_view(B->block_table.data(), DType::kInt32, {nseq, B->max_pages});
    in.seqused_k = make_view(B->seqused.data(), DType::kInt32, {nseq});
  }
  return B;
}

// ---------------------------------------------------------------------------------------------------------------
// Comparisons.
struct Tol {
  double rel, abs;
};
inline Tol out_tol(DType d) {
  switch (d) {
    case DType::kFloat32: return {1e-5, 1e-6};
    case DType::kFloat16: return {1.0 / 1024, 1e-5};   // one fp16 ulp (output rounding is half an ulp)
    case DType::kBFloat16: return {1.0 / 128, 1e-5};   // one bf16 ulp
    default: return {0, 0};
  }
}

// Compares out/lse of the built problem against a naive64 result; fails with the first few mismatches. Also checks
// that every element was written (no NaN left from the poison) and that lse is -inf exactly where naive says so.
inline void expect_matches(Built& B, const naive64::Result& R, bool with_lse, const std::string& what,
                           std::optional<Tol> tol_override = std::nullopt) {
  const Tol tol = tol_override ? *tol_override : out_tol(B.c.dtype);
  const int Hq = B.c.Hq, D = B.c.D;
  int64_t bad = 0, nan = 0;
  std::ostringstream msg;
  for (int64_t row = 0; row < B.total_q; ++row)
    for (int h = 0; h < Hq; ++h)
      for (int d = 0; d < D; ++d) {
        const int64_t idx = (row * Hq + h) * D + d;
        const double got = B.out.get(idx), exp = R.out[idx];
        if (std::isnan(got)) {
          if (nan++ < 5) msg << "  out[" << row << "," << h << "," << d << "] is NaN (expected " << exp << ")\n";
          continue;
        }
        if (std::fabs(got - exp) > tol.rel * std::fabs(exp) + tol.abs) {
          if (bad++ < 5)
            msg << "  out[" << row << "," << h << "," << d << "] got " << got << " expected " << exp << " (diff "
                << got - exp << ")\n";
        }
      }
  int64_t lbad = 0;
  if (with_lse)
    for (int h = 0; h < Hq; ++h)
      for (int64_t row = 0; row < B.total_q; ++row) {
        const double got = B.lse[h * B.total_q + row], exp = R.lse[h * B.total_q + row];
        bool ok;
        if (std::isinf(exp)) ok = std::isinf(got) && got < 0;
        else ok = std::isfinite(got) && std::fabs(got - exp) <= 1e-5 * std::fabs(exp) + 2e-6;
        if (!ok && lbad++ < 5) msg << "  lse[" << h << "," << row << "] got " << got << " expected " << exp << "\n";
      }
  EXPECT_TRUE(bad == 0 && nan == 0 && lbad == 0)
      << what << " [" << B.c.str() << "]: " << bad << " out mismatches, " << nan << " NaN outputs, " << lbad
      << " lse mismatches (tol rel " << tol.rel << " abs " << tol.abs << ")\n"
      << msg.str();
}

// Max abs difference between two outputs of the library (same dtype), e.g. sparse vs dense.
inline double max_abs_diff(const HostTensor& a, const HostTensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel; ++i) {
    const double x = a.get(i), y = b.get(i);
    if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::infinity();
    m = std::max(m, std::fabs(x - y));
  }
  return m;
}

// The chunked-prefill step whose queries are positions [start, end) of B's single float32 paged sequence: its q
// rows against the cache holding [0, end). The views point into this object's own arrays (neither copied nor moved).
struct ChunkStep {
  std::vector<int32_t> cu_q, used;
  AttentionInputs in;
  ChunkStep(Built& B, int start, int end) : cu_q{0, end - start}, used{end}, in(B.in) {
    const int64_t n = end - start, row = int64_t(B.c.Hq) * B.c.D;
    in.q = make_view(static_cast<float*>(B.q.data()) + start * row, DType::kFloat32, {n, B.c.Hq, B.c.D});
    in.cu_seqlens_q = make_view(cu_q.data(), DType::kInt32, {2});
    in.seqused_k = make_view(used.data(), DType::kInt32, {1});
    in.max_seqlen_q = n;
    in.max_seqlen_k = end;
  }
  ChunkStep(const ChunkStep&) = delete;
  ChunkStep& operator=(const ChunkStep&) = delete;
};

// Runs reference dense attention into B's poisoned outputs.
inline void run_dense(Built& B, bool with_lse = true) { attention(B.in, B.outputs(with_lse)); }

// The library's defaults with one selection per KV group (head_subgroups 0, the default, is one per query head).
inline SelectionParams defaults_per_group() {
  SelectionParams p;
  p.head_subgroups = 1;
  return p;
}

inline naive64::SelParams naive_params(const SelectionParams& p) {
  if (p.head_subgroups != 1) throw std::logic_error("naive64 selects per KV group: pass head_subgroups = 1");
  naive64::SelParams s;
  s.alpha = p.alpha;
  s.bs = p.block_size;
  s.sink = p.sink;
  s.window = p.window;
  s.last_n = p.last_n;
  s.row_max = p.rule == SelectionRule::kRowMax;
  s.dense_fraction = p.dense_fraction;
  return s;
}

// The per-segment lists of a library index.
inline std::vector<std::vector<int>> lists_of(const BlockIndex& idx) {
  std::vector<std::vector<int>> l(idx.segment_start.size());
  for (size_t s = 0; s < l.size(); ++s)
    for (int32_t i = idx.segment_start[s]; i < idx.segment_end[s]; ++i) l[s].push_back(idx.block_ids[i]);
  return l;
}

// An index with the given per-segment lists (pooled means taken from `like`).
inline BlockIndex index_with_lists(const BlockIndex& like, const std::vector<std::vector<int>>& lists, bool correction) {
  BlockIndex idx = like;
  idx.correction = correction;
  idx.segment_start.clear();
  idx.segment_end.clear();
  idx.block_ids.clear();
  for (const auto& l : lists) {
    idx.segment_start.push_back(int32_t(idx.block_ids.size()));
    idx.block_ids.insert(idx.block_ids.end(), l.begin(), l.end());
    idx.segment_end.push_back(int32_t(idx.block_ids.size()));
  }
  return idx;
}

inline std::string list_str(const std::vector<int>& l) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < l.size(); ++i) os << (i ? "," : "") << l[i];
  os << "]";
  return os.str();
}

// Compares a library index with a naive64 selection (defined in test_selection.cpp); returns the number of tolerated
// threshold-tie flips.
int64_t compare_selection(const Built& B, const BlockIndex& idx, const naive64::Selection& S, const SelectionParams& p);

// ---------------------------------------------------------------------------------------------------------------
// ArgumentError assertions: the statement must throw ArgumentError whose argument() is one of `names`.
inline std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (auto& x : v) s += (s.empty() ? "" : "|") + x;
  return s;
}
template <typename F>
::testing::AssertionResult throws_argument(F&& f, const std::vector<std::string>& names) {
  try {
    f();
  } catch (const ArgumentError& e) {
    for (auto& n : names) {
      if (e.argument() == n) return ::testing::AssertionSuccess();
      // "index*" accepts any name starting with "index"
      if (!n.empty() && n.back() == '*' && e.argument().rfind(n.substr(0, n.size() - 1), 0) == 0)
        return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << "ArgumentError names '" << e.argument() << "', expected " << join(names)
                                         << " (message: " << e.what() << ")";
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-ArgumentError exception: " << e.what() << " (expected "
                                         << join(names) << ")";
  } catch (...) {
    return ::testing::AssertionFailure() << "threw an unknown exception (expected " << join(names) << ")";
  }
  return ::testing::AssertionFailure() << "did not throw (expected ArgumentError naming " << join(names) << ")";
}
#define EXPECT_ARG_ERROR(stmt, ...) EXPECT_TRUE(::sptest::throws_argument([&] { stmt; }, {__VA_ARGS__})) << #stmt

}  // namespace sptest
