// Seeded synthetic Q/K/V generators for long contexts (float32, row-major):
//   q [L, Hq, D], k [L, Hkv, D], v [L, Hkv, D] for one sequence of length L.
// - topic: the speed reference workload of DESIGN.md ("topic"), used for every speed figure.
// - structured: the accuracy workload, with the structure real LLM attention shows (RoPE-rotated heads, attention
//   sinks, local recency, retrieval needles, vertical stripes). Its knobs are documented in StructuredParams.
#pragma once

#include <cstdint>

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

struct StructuredParams;  // defined in workload_structured.h (knobs documented there)

// Writes the topic workload into caller buffers of the shapes above. Deterministic for a given seed.
void generate_topic(const Shape& shape, const TopicParams& params, uint64_t seed, float* q, float* k, float* v);

}  // namespace workload
}  // namespace sparse_prefill
