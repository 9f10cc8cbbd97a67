// Seeded synthetic Q/K/V generators for long contexts (float32, row-major):
//   q [L, Hq, D], k [L, Hkv, D], v [L, Hkv, D] for one sequence of length L.
// - topic: the speed reference workload of DESIGN.md ("topic"), used for every speed figure.
// - structured: the accuracy workload, with the structure real LLM attention shows (RoPE-rotated heads, attention
//   sinks, local recency, semantic recall of a few earlier blocks, retrieval needles, vertical stripes). Its knobs are
//   documented in StructuredParams and in docs/workload.md (with the measured FlashPrefill V2 densities).
//
// Both generators are deterministic for a given (shape, params, seed), independent of the number of threads, and
// fast (counter-free xoshiro256** streams per (tensor, head), Box-Muller normals, threads over heads).
#pragma once

#include <cstdint>
#include <vector>

namespace sparse_prefill {
namespace workload {

struct Shape {
  int64_t seqlen = 4096;
  int num_q_heads = 32;
  int num_kv_heads = 8;
  int head_dim = 128;
};

struct TopicParams {
  int block = 128;        // tokens per topic block (keys) and per query group
  int targets = 4;        // target blocks drawn per query group
};

// Writes the topic workload into caller buffers of the shapes above. Deterministic for a given seed.
//   per KV head h and key block J: t[h,J] ~ N(0, I_D);  K[i,h] = t[h, i/block] + N(0, I_D);  V ~ N(0, I_D);
//   query group p (positions p*block .. p*block+block-1) of KV head h draws `targets` blocks uniformly (with
//   replacement) from [0, max(p, 1)); Q[i, h*g+j] = sum of the targets' topics + N(0, I_D) (independent noise per head).
void generate_topic(const Shape& shape, const TopicParams& params, uint64_t seed, float* q, float* k, float* v);

// The structured (accuracy) workload. "Logit" knobs are in units of the scaled score q.k / sqrt(D) of one query
// token against one key token; a plain N(0, I) query against a plain N(0, I) key has logit standard deviation 1.
//
// Per KV head h (all independent), position i, query head j of the group:
//   content (rotated by RoPE with the token's own position, so its scores depend on the relative distance):
//     k~_i = noise_k * N(0, I) + r * z_i            q~_i = noise_q * N(0, I) + r * z_i
//     z: a drifting "local context" per KV head, z_0 ~ N(0, I), z_i = rho z_{i-1} + sqrt(1-rho^2) N(0, I) with
//        rho = exp(-1 / recency_length); r = sqrt(recency_logit / sqrt(D)), so a query meets its own key with logit
//        recency_logit on average and older keys with rho^d times the RoPE long-range decay (the recency profile).
//   K_i = RoPE_i(k~_i), Q_i = RoPE_i(q~_i) (rotate-half convention, theta_f = rope_base^(-2f/D), f < D/2), then the
//   position-compensated components (they survive RoPE unchanged, as sinks and retrieval do in real models):
//     sinks:   the first `sink_tokens` keys + a * u_sink, every query + a * u_sink   (a^2/sqrt(D) = sink_logit)
//     stripes: every `stripe_every` tokens on average, a run of `stripe_tokens` keys at a random position gets
//              + a * u_stripe, every query + a * u_stripe                            (a^2/sqrt(D) = stripe_logit)
//     recall:  per key block J a topic t_J ~ N(0, I): keys of J + recall_key_scale * t_J; query group p (block-sized
//              runs of positions) draws `recall_targets` blocks uniformly from [0, max(p, 1)) and its queries get
//              + c * sum of their topics with c * recall_key_scale * sqrt(D) = recall_logit (shared by the g heads)
//     needles: `needles` per KV head; needle n owns a run of `needle_tokens` keys inside one block (its "key span")
//              and a later run of `needle_queries` positions (its "query span", at least needle_min_distance after
//              the key span); key span keys + a * u_n, query span queries (all g heads) + a * u_n
//              (a^2/sqrt(D) = needle_logit), and the key span's values are all the same vector v_n ~ N(0, I):
//              in dense attention a query of the span puts most of its mass on the needle and outputs ~ v_n.
//   V_i ~ N(0, I) except on needle key spans.
// u_sink, u_stripe, u_n are random unit vectors times sqrt(D) (drawn per KV head).
struct StructuredParams {
  double rope_base = 10000.0;   // RoPE base (applied to the content part of q and k)
  float noise_q = 1.0f;         // std of the per-token Gaussian noise of q (pre-RoPE)
  float noise_k = 1.0f;         // std of the per-token Gaussian noise of k (pre-RoPE)
  // Local recency (content, rotated).
  float recency_logit = 8.0f;   // mean logit of a query against its own position's key (decays with distance)
  int recency_length = 1024;    // correlation length in tokens of the drifting local context z
  // Semantic recall (position-compensated).
  int recall_targets = 2;       // earlier blocks each query group recalls
  float recall_logit = 5.0f;    // logit of a recalling query against each key of a target block
  float recall_key_scale = 0.5f;// norm of a key's topic part relative to N(0, I) (small: keeps scores sharp)
  // Attention sinks.
  int sink_tokens = 4;          // the first keys that every query scores highly
  float sink_logit = 8.0f;
  // Vertical stripes.
  int stripe_every = 4096;      // one stripe per this many tokens on average (0: none)
  int stripe_tokens = 2;        // keys per stripe
  float stripe_logit = 5.0f;
  // Retrieval needles.
  int needles = 2;              // per KV head (fewer when the sequence is too short to place them)
  int needle_tokens = 32;       // keys per needle (inside one 128-token block)
  int needle_queries = 32;      // query positions per needle
  int needle_min_distance = 1024;  // tokens between the needle's key span and its query span, at least
  float needle_logit = 14.0f;   // logit of a needle query against each needle key
};

void generate_structured(const Shape& shape, const StructuredParams& params, uint64_t seed, float* q, float* k,
                         float* v);

// One retrieval needle of the structured workload: the queries at positions [query_begin, query_end) of every query
// head kv_head*g .. kv_head*g+g-1 match the keys at positions [key_begin, key_end) of KV head kv_head, whose values
// all equal `value` (D floats). key_end <= query_begin.
struct Needle {
  int kv_head = 0;
  int64_t key_begin = 0, key_end = 0;
  int64_t query_begin = 0, query_end = 0;
  std::vector<float> value;
};

// The needles generate_structured(shape, params, seed, ...) plants (cheap: does not generate the tensors).
std::vector<Needle> needle_positions(const Shape& shape, const StructuredParams& params, uint64_t seed);

}  // namespace workload
}  // namespace sparse_prefill
