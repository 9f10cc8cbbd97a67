// The speed reference workload "topic" (docs/workload.md): per KV head and key block a topic vector, keys = topic + noise,
// query groups of `block` positions recall `targets` earlier blocks (shared by the g heads of the KV head).
#include <stdexcept>
#include <vector>

#include "reference/parallel.h"
#include "sparse_prefill/workload.h"
#include "workload/random.h"

namespace sparse_prefill::workload {
namespace {

enum Tag : uint64_t { kTopics = 1, kTargets = 2, kKeyNoise = 3, kValue = 4, kQueryNoise = 5 };

// The topics t[h, J] of KV head h: [num_blocks, D].
std::vector<float> topics(uint64_t seed, int h, int64_t num_blocks, int D) {
  std::vector<float> t(size_t(num_blocks) * D);
  detail::Rng rng(detail::stream_seed(seed, kTopics, uint64_t(h)));
  rng.normals(t.data(), int64_t(t.size()));
  return t;
}

}  // namespace

void generate_topic(const Shape& shape, const TopicParams& params, uint64_t seed, float* q, float* k, float* v) {
  const int64_t L = shape.seqlen;
  const int Hq = shape.num_q_heads, Hkv = shape.num_kv_heads, D = shape.head_dim;
  if (L < 0 || Hkv <= 0 || Hq <= 0 || Hq % Hkv != 0 || D <= 0 || params.block <= 0 || params.targets < 0) {
    throw std::invalid_argument("generate_topic: bad shape or params");
  }
  const int g = Hq / Hkv, B = params.block;
  const int64_t nb = (L + B - 1) / B;
  // Work items: K of each KV head, V of each KV head, Q of each query head. Each owns its random stream.
  reference::parallel_for(int64_t(2 * Hkv + Hq), [&](int64_t item) {
    if (item < Hkv) {  // K
      const int h = int(item);
      const std::vector<float> t = topics(seed, h, nb, D);
      detail::Rng rng(detail::stream_seed(seed, kKeyNoise, uint64_t(h)));
      for (int64_t i = 0; i < L; ++i) {
        float* row = k + (i * Hkv + h) * D;
        rng.normals(row, D);
        const float* tt = &t[size_t(i / B) * D];
        for (int d = 0; d < D; ++d) row[d] += tt[d];
      }
    } else if (item < 2 * Hkv) {  // V
      const int h = int(item - Hkv);
      detail::Rng rng(detail::stream_seed(seed, kValue, uint64_t(h)));
      for (int64_t i = 0; i < L; ++i) rng.normals(v + (i * Hkv + h) * D, D);
    } else {  // Q of query head hq = h * g + j
      const int hq = int(item - 2 * Hkv), h = hq / g;
      const std::vector<float> t = topics(seed, h, nb, D);
      // Targets of KV head h: one stream, `targets` draws per group in order (identical for the g heads).
      detail::Rng target_rng(detail::stream_seed(seed, kTargets, uint64_t(h)));
      detail::Rng rng(detail::stream_seed(seed, kQueryNoise, uint64_t(hq)));
      std::vector<float> sum(D);
      for (int64_t p = 0; p * B < L; ++p) {
        std::fill(sum.begin(), sum.end(), 0.f);
        for (int n = 0; n < params.targets; ++n) {
          const int64_t T = target_rng.below(std::max<int64_t>(p, 1));
          for (int d = 0; d < D; ++d) sum[d] += t[size_t(T) * D + d];
        }
        for (int64_t i = p * B; i < std::min<int64_t>(L, (p + 1) * B); ++i) {
          float* row = q + (i * Hq + hq) * D;
          rng.normals(row, D);
          for (int d = 0; d < D; ++d) row[d] += sum[d];
        }
      }
    }
  });
}

}  // namespace sparse_prefill::workload
