// The structured (accuracy) workload: RoPE-rotated content with a drifting local context (recency), plus
// position-compensated sinks, vertical stripes, semantic recall of earlier passages and retrieval needles. The model is
// documented next to StructuredParams in include/sparse_prefill/workload.h and in docs/workload.md.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "reference/parallel.h"
#include "sparse_prefill/workload.h"
#include "workload/random.h"

namespace sparse_prefill::workload {
namespace {

constexpr int kGroup = 128;  // tokens per block: query groups, passages (recall_span blocks), needle key spans (inside one)

enum Tag : uint64_t {
  kLayout = 11, kNeedles = 12, kTopics = 13, kTargets = 14, kDrift = 15, kKeyNoise = 16, kValue = 17, kQueryNoise = 18
};

// A random direction of norm sqrt(D) (so a * u has per-coordinate RMS a).
std::vector<float> direction(detail::Rng& rng, int D) {
  std::vector<float> u(D);
  double n2 = 0;
  for (int d = 0; d < D; ++d) {
    u[d] = rng.normal();
    n2 += double(u[d]) * u[d];
  }
  const float s = float(std::sqrt(double(D) / std::max(n2, 1e-30)));
  for (float& x : u) x *= s;
  return u;
}

// A random direction of norm sqrt(D) orthogonal to the given ones (each of norm sqrt(D)).
std::vector<float> orthogonal_direction(detail::Rng& rng, int D, const std::vector<const std::vector<float>*>& others) {
  std::vector<float> u = direction(rng, D);
  for (const std::vector<float>* o : others) {
    double dot = 0;
    for (int d = 0; d < D; ++d) dot += double(u[d]) * (*o)[d];
    const float c = float(dot / double(D));
    for (int d = 0; d < D; ++d) u[d] -= c * (*o)[d];
  }
  double n2 = 0;
  for (float x : u) n2 += double(x) * x;
  const float s = float(std::sqrt(double(D) / std::max(n2, 1e-30)));
  for (float& x : u) x *= s;
  return u;
}

// Amplitude a of a component a * u (|u| = sqrt(D)) on both sides of a dot product with scaled logit `logit`.
float amplitude(float logit, int D) { return logit > 0 ? std::sqrt(logit / std::sqrt(float(D))) : 0.f; }

struct HeadPlan {
  std::vector<float> u_sink;
  std::vector<std::pair<int64_t, int64_t>> stripes;  // [begin, end)
  std::vector<Needle> needles;
  std::vector<std::vector<float>> u_needle;
};

void check(const Shape& shape, const StructuredParams& p) {
  if (shape.seqlen < 0 || shape.num_kv_heads <= 0 || shape.num_q_heads <= 0 ||
      shape.num_q_heads % shape.num_kv_heads != 0 || shape.head_dim <= 0 || shape.head_dim % 8 != 0) {
    throw std::invalid_argument("generate_structured: bad shape (need Hq % Hkv == 0, D a multiple of 8)");
  }
  if (p.needle_tokens <= 0 || p.needle_tokens > kGroup || p.needle_queries <= 0 || p.needles < 0 ||
      p.needle_min_distance < 0 || p.recall_targets < 0 || p.sink_tokens < 0 || p.stripe_every < 0 ||
      p.stripe_tokens <= 0 || p.recall_span <= 0 || p.recency_length <= 0 || !(p.rope_base > 1.0)) {
    throw std::invalid_argument("generate_structured: bad StructuredParams");
  }
}

HeadPlan plan_head(const Shape& shape, const StructuredParams& p, uint64_t seed, int h) {
  const int64_t L = shape.seqlen;
  const int D = shape.head_dim;
  HeadPlan plan;
  detail::Rng rng(detail::stream_seed(seed, kLayout, uint64_t(h)));
  plan.u_sink = direction(rng, D);
  if (p.stripe_every > 0) {
    const int64_t count = L / p.stripe_every;
    const int64_t lo = std::min<int64_t>(p.sink_tokens, L);
    const int64_t span = std::max<int64_t>(L - lo - p.stripe_tokens + 1, 1);
    for (int64_t s = 0; s < count; ++s) {
      const int64_t b = lo + rng.below(span);
      plan.stripes.push_back({b, std::min<int64_t>(b + p.stripe_tokens, L)});
    }
  }
  // Needles: the key span sits inside one block after block 0, the query span at least needle_min_distance later;
  // key blocks are distinct and query spans do not overlap. Rejection sampling with a bounded number of tries.
  detail::Rng nrng(detail::stream_seed(seed, kNeedles, uint64_t(h)));
  const int64_t max_key_begin = L - p.needle_queries - p.needle_min_distance - p.needle_tokens;
  for (int n = 0; n < p.needles && max_key_begin >= kGroup; ++n) {
    for (int attempt = 0; attempt < 64; ++attempt) {
      const int64_t J = 1 + nrng.below(max_key_begin / kGroup);
      const int64_t kb = J * kGroup + nrng.below(kGroup - p.needle_tokens + 1);
      if (kb > max_key_begin) continue;
      const int64_t ke = kb + p.needle_tokens;
      const int64_t q_lo = ke + p.needle_min_distance;
      const int64_t qb = q_lo + nrng.below(L - p.needle_queries - q_lo + 1);
      const int64_t qe = qb + p.needle_queries;
      bool clash = false;
      for (const Needle& o : plan.needles) {
        clash |= o.key_begin / kGroup == J || (qb < o.query_end && o.query_begin < qe);
      }
      if (clash) continue;
      Needle nd;
      nd.kv_head = h;
      nd.key_begin = kb;
      nd.key_end = ke;
      nd.query_begin = qb;
      nd.query_end = qe;
      nd.value.resize(D);
      nrng.normals(nd.value.data(), D);
      // Orthogonal to the sink direction and to the other needles: the large sink keys must not leak into a needle
      // query's scores, nor one needle into another's.
      std::vector<const std::vector<float>*> others = {&plan.u_sink};
      for (const auto& u : plan.u_needle) others.push_back(&u);
      plan.u_needle.push_back(orthogonal_direction(nrng, D, others));
      plan.needles.push_back(std::move(nd));
      break;
    }
  }
  return plan;
}

// Removes from x (D floats) its components along the reserved directions (mutually orthogonal, norm sqrt(D)).
inline void project_out(float* x, const std::vector<const float*>& reserved, int D) {
  for (const float* u : reserved) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 partial sums: vectorisable without -ffast-math (D % 8 == 0)
    for (int d = 0; d < D; d += 8) {
      for (int l = 0; l < 8; ++l) acc[l] += x[d + l] * u[d + l];
    }
    const float dot = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    const float c = dot / float(D);
    for (int d = 0; d < D; ++d) x[d] -= c * u[d];
  }
}

// Rotate-half RoPE of x (D floats) at the position whose table rows are cs / sn (D/2 floats each), into out.
inline void rope(const float* x, const float* cs, const float* sn, int D, float* out) {
  const int half = D / 2;
  for (int f = 0; f < half; ++f) {
    const float x1 = x[f], x2 = x[f + half];
    out[f] = x1 * cs[f] - x2 * sn[f];
    out[f + half] = x2 * cs[f] + x1 * sn[f];
  }
}

}  // namespace

std::vector<Needle> needle_positions(const Shape& shape, const StructuredParams& params, uint64_t seed) {
  check(shape, params);
  std::vector<Needle> all;
  for (int h = 0; h < shape.num_kv_heads; ++h) {
    HeadPlan plan = plan_head(shape, params, seed, h);
    for (Needle& n : plan.needles) all.push_back(std::move(n));
  }
  return all;
}

void generate_structured(const Shape& shape, const StructuredParams& p, uint64_t seed, float* q, float* k, float* v) {
  check(shape, p);
  const int64_t L = shape.seqlen;
  const int Hq = shape.num_q_heads, Hkv = shape.num_kv_heads, D = shape.head_dim, g = Hq / Hkv, half = D / 2;
  const int64_t nb = (L + kGroup - 1) / kGroup;

  // RoPE table (angles in double: positions reach 1M).
  std::vector<float> cos_t(size_t(L) * half), sin_t(size_t(L) * half);
  std::vector<double> theta(half);
  for (int f = 0; f < half; ++f) theta[f] = std::pow(p.rope_base, -2.0 * f / D);
  constexpr int64_t kChunk = 4096;
  reference::parallel_for((L + kChunk - 1) / kChunk, [&](int64_t c) {
    for (int64_t i = c * kChunk; i < std::min(L, (c + 1) * kChunk); ++i) {
      for (int f = 0; f < half; ++f) {
        const double a = double(i) * theta[f];
        cos_t[size_t(i) * half + f] = float(std::cos(a));
        sin_t[size_t(i) * half + f] = float(std::sin(a));
      }
    }
  });

  const float r = amplitude(p.recency_logit, D);
  // Sinks and stripes share one direction u_sink (real models give such "no-op" tokens one key direction, often a few
  // "massive activation" channels). u_sink and the needle directions are reserved: they are projected out of every
  // other part of q and k, so these components add exactly their logit and no noise to unrelated scores.
  const float a_sink_q = amplitude(std::max(p.sink_logit, p.stripe_logit), D);
  const float a_sink_k = a_sink_q > 0 ? p.sink_logit / (a_sink_q * std::sqrt(float(D))) : 0.f;
  const float a_stripe_k = a_sink_q > 0 ? p.stripe_logit / (a_sink_q * std::sqrt(float(D))) : 0.f;
  const float a_needle = amplitude(p.needle_logit, D);
  // Recall: keys carry kappa * t, queries c * (sum of recall_targets topics), c * kappa * sqrt(D) = recall_logit; the
  // two sides get equal RMS (kappa^2 = c^2 * targets), which minimises the noise they add to unrelated scores.
  const float kappa = p.recall_targets > 0 ? amplitude(p.recall_logit * std::sqrt(float(p.recall_targets)), D) : 0.f;
  const float c_recall = p.recall_targets > 0 ? kappa / std::sqrt(float(p.recall_targets)) : 0.f;
  const float rho = float(std::exp(-1.0 / double(p.recency_length)));
  const float rho_c = std::sqrt(std::max(0.f, 1.f - rho * rho));

  reference::parallel_for(Hkv, [&](int64_t item) {
    const int h = int(item);
    const HeadPlan plan = plan_head(shape, p, seed, h);
    std::vector<char> stripe(size_t(L), 0);
    for (const auto& s : plan.stripes) std::fill(stripe.begin() + s.first, stripe.begin() + s.second, char(1));
    std::vector<int16_t> needle_key(size_t(L), -1), needle_query(size_t(L), -1);
    for (size_t n = 0; n < plan.needles.size(); ++n) {
      const Needle& nd = plan.needles[n];
      std::fill(needle_key.begin() + nd.key_begin, needle_key.begin() + nd.key_end, int16_t(n));
      std::fill(needle_query.begin() + nd.query_begin, needle_query.begin() + nd.query_end, int16_t(n));
    }
    // Recall: one topic per passage of recall_span blocks; per query group, the sum of its target passages' topics.
    const int64_t passage = int64_t(kGroup) * p.recall_span;
    const int64_t num_passages = (L + passage - 1) / passage;
    std::vector<float> topic(size_t(num_passages) * D), recall(size_t(nb) * D, 0.f);
    detail::Rng(detail::stream_seed(seed, kTopics, uint64_t(h))).normals(topic.data(), int64_t(topic.size()));
    detail::Rng target_rng(detail::stream_seed(seed, kTargets, uint64_t(h)));
    for (int64_t grp = 0; grp < nb; ++grp) {
      const int64_t own = grp / p.recall_span;  // the query group's own passage
      for (int n = 0; n < p.recall_targets; ++n) {
        const int64_t T = target_rng.below(std::max<int64_t>(own, 1));
        for (int d = 0; d < D; ++d) recall[size_t(grp) * D + d] += topic[size_t(T) * D + d];
      }
    }
    // Drifting local context z (stationary AR(1), unit variance per coordinate).
    std::vector<float> z(size_t(L) * D);
    {
      detail::Rng rng(detail::stream_seed(seed, kDrift, uint64_t(h)));
      if (L > 0) rng.normals(z.data(), D);
      std::vector<float> e(D);
      for (int64_t i = 1; i < L; ++i) {
        rng.normals(e.data(), D);
        const float* prev = &z[size_t(i - 1) * D];
        float* cur = &z[size_t(i) * D];
        for (int d = 0; d < D; ++d) cur[d] = rho * prev[d] + rho_c * e[d];
      }
    }
    std::vector<const float*> reserved = {plan.u_sink.data()};
    for (const auto& u : plan.u_needle) reserved.push_back(u.data());
    std::vector<float> x(D);
    // K.
    {
      detail::Rng rng(detail::stream_seed(seed, kKeyNoise, uint64_t(h)));
      for (int64_t i = 0; i < L; ++i) {
        rng.normals(x.data(), D);
        const float* zi = &z[size_t(i) * D];
        for (int d = 0; d < D; ++d) x[d] = p.noise_k * x[d] + r * zi[d];
        float* row = k + (i * Hkv + h) * D;
        rope(x.data(), &cos_t[size_t(i) * half], &sin_t[size_t(i) * half], D, row);
        const float* t = &topic[size_t(i / passage) * D];
        if (i >= p.sink_tokens) {  // sink tokens carry no passage topic (like a BOS token)
          for (int d = 0; d < D; ++d) row[d] += kappa * t[d];
        }
        project_out(row, reserved, D);
        if (i < p.sink_tokens) {
          for (int d = 0; d < D; ++d) row[d] += a_sink_k * plan.u_sink[d];
        }
        if (stripe[i]) {
          for (int d = 0; d < D; ++d) row[d] += a_stripe_k * plan.u_sink[d];
        }
        if (needle_key[i] >= 0) {
          const float* u = plan.u_needle[needle_key[i]].data();
          for (int d = 0; d < D; ++d) row[d] += a_needle * u[d];
        }
      }
    }
    // V.
    {
      detail::Rng rng(detail::stream_seed(seed, kValue, uint64_t(h)));
      for (int64_t i = 0; i < L; ++i) {
        float* row = v + (i * Hkv + h) * D;
        rng.normals(row, D);
        if (needle_key[i] >= 0) std::copy_n(plan.needles[needle_key[i]].value.data(), D, row);
      }
    }
    // Q of the g heads.
    std::vector<float> common(D);
    for (int d = 0; d < D; ++d) common[d] = a_sink_q * plan.u_sink[d];
    for (int j = 0; j < g; ++j) {
      const int hq = h * g + j;
      detail::Rng rng(detail::stream_seed(seed, kQueryNoise, uint64_t(hq)));
      for (int64_t i = 0; i < L; ++i) {
        rng.normals(x.data(), D);
        const float* zi = &z[size_t(i) * D];
        for (int d = 0; d < D; ++d) x[d] = p.noise_q * x[d] + r * zi[d];
        float* row = q + (i * Hq + hq) * D;
        rope(x.data(), &cos_t[size_t(i) * half], &sin_t[size_t(i) * half], D, row);
        const float* rc = &recall[size_t(i / kGroup) * D];
        for (int d = 0; d < D; ++d) row[d] += c_recall * rc[d];
        project_out(row, reserved, D);
        for (int d = 0; d < D; ++d) row[d] += common[d];
        if (needle_query[i] >= 0) {
          const float* u = plan.u_needle[needle_query[i]].data();
          for (int d = 0; d < D; ++d) row[d] += a_needle * u[d];
        }
      }
    }
  });
}

}  // namespace sparse_prefill::workload
