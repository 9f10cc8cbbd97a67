// Seeded synthetic Q/K/V generators for long contexts (float32, row-major):
//   q [L, Hq, D], k [L, Hkv, D], v [L, Hkv, D] for one sequence of length L.
// - topic: the speed reference workload of docs/workload.md ("topic"), used for every speed figure.
// - structured: the accuracy workload, with the structure real LLM attention shows (RoPE-rotated heads, attention
//   sinks, local recency, semantic recall of a few earlier blocks, retrieval needles, vertical stripes). Its knobs are
//   documented in StructuredParams and in docs/workload.md (with the measured FlashPrefill V2 densities).
//
// Both generators are deterministic for a given (shape, params, seed), independent of the number of threads, and
// fast (seeded xoshiro256** streams per (tensor, head), Box-Muller normals, threads over heads).
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
// token against one key token. Per KV head h (all heads independent), position i, query head j of the group:
//
//   ordinary part (every token):
//     k~_i = noise_k * N(0, I) + r * z_i,   q~_i = noise_q * N(0, I) + r * z_i           (content, pre-RoPE)
//       z: a drifting "local context" per KV head, z_0 ~ N(0, I), z_i = rho z_{i-1} + sqrt(1 - rho^2) N(0, I),
//       rho = exp(-1 / recency_length), r = sqrt(recency_logit / sqrt(D)): a query meets its own position's key with
//       logit ~recency_logit and older keys with rho^d times the RoPE long-range decay (the recency profile);
//     K_i = RoPE_i(k~_i) + kappa * t_{P(i)},   Q_i = RoPE_i(q~_i) + c * sum_{T in targets(i)} t_T
//       RoPE: rotate-half convention (pairs f, f + D/2), theta_f = rope_base^(-2f/D);
//       recall: a topic t_P ~ N(0, I) per passage P of recall_span blocks of 128 tokens; the query group of
//       positions 128p .. 128p+127 draws `recall_targets` passages uniformly from [0, max(P(128p), 1)) (shared by
//       the g heads); kappa^2 = c^2 * recall_targets and c * kappa * sqrt(D) = recall_logit (each key of a target
//       passage scores +recall_logit). Sink tokens carry no topic.
//   reserved directions: u_sink and one u_n per needle (mutually orthogonal, norm sqrt(D)) are projected out of the
//   ordinary parts, so the components below add exactly their logit and no noise to unrelated scores:
//     sinks:   keys 0 .. sink_tokens-1 get + a_k u_sink, every query + a_q u_sink       (score + sink_logit)
//     stripes: L / stripe_every runs of stripe_tokens keys at uniform random positions get + a_s u_sink
//              (score + stripe_logit against every query: "vertical" lines, too thin for the block means to see)
//     needles: `needles` per KV head (fewer if L is too short); needle n owns `needle_tokens` keys inside one block
//              after block 0 (its key span) and `needle_queries` positions at least needle_min_distance later (its
//              query span); key span keys and query span queries (all g heads) get + a u_n (score + needle_logit),
//              and the key span's values all equal one vector v_n ~ N(0, I): in dense attention those queries put
//              ~all their mass on the needle and output ~v_n (needle_positions() lists them).
//   V_i ~ N(0, I), except on needle key spans.
//
// Defaults are tuned so that FlashPrefill V2 selection (alpha 0.1, block 128, sink 256, window 512, last_n 2) keeps a
// roughly constant number of blocks per tile (sink + window + ~1K tokens of recency + two recalled passages), hence a
// density that falls with length like real models: ~67 % at 4K, ~24 % at 16K, ~7 % at 64K, 3.5 % at 128K (table in
// docs/workload.md); the kept blocks hold ~96 % of the softmax mass up to 64K (~88 % at 128K) and the mean correction
// recovers part of the rest (stripes and within-block spread are what it cannot recover).
struct StructuredParams {
  double rope_base = 10000.0;     // RoPE base (applied to the content part of q and k)
  float noise_q = 0.25f;          // std of the per-token Gaussian noise of q (pre-RoPE)
  float noise_k = 0.25f;          // std of the per-token Gaussian noise of k (pre-RoPE)
  // Local recency (content, rotated by RoPE).
  float recency_logit = 8.0f;     // mean logit of a query against its own position's key (decays with distance)
  int recency_length = 1024;      // correlation length in tokens of the drifting local context z
  // Semantic recall (position-compensated).
  int recall_targets = 2;         // earlier passages each query group (128 positions) recalls
  int recall_span = 6;            // blocks of 128 tokens per passage (keys of one passage share one topic)
  float recall_logit = 5.0f;      // logit of a recalling query against each key of a target passage
  // Attention sinks.
  int sink_tokens = 4;            // the first keys, which every query scores highly
  float sink_logit = 13.0f;
  // Vertical stripes.
  int stripe_every = 4096;        // one stripe per this many tokens (0: none)
  int stripe_tokens = 4;          // keys per stripe
  float stripe_logit = 6.0f;
  // Retrieval needles.
  int needles = 2;                // per KV head
  int needle_tokens = 96;         // keys per needle (inside one 128-token block)
  int needle_queries = 32;        // query positions per needle
  int needle_min_distance = 1024; // tokens between the end of the key span and the start of the query span, at least
  float needle_logit = 20.0f;     // logit of a needle query against each needle key
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
