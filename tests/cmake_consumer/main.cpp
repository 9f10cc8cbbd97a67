// Calls the installed library's public API only (headers from include/sparse_prefill/): dense causal attention on the
// CPU, checked against a few lines of plain softmax attention, and an argument error that names its argument.
#include <cmath>
#include <cstdio>
#include <vector>

#include "sparse_prefill/attention.h"

namespace sp = sparse_prefill;

int main() {
  const int64_t L = 16, H = 2, D = 64;  // one sequence, MHA
  std::vector<float> q(L * H * D), k(L * H * D), v(L * H * D), out(L * H * D);
  for (size_t i = 0; i < q.size(); ++i) {
    q[i] = std::sin(0.37f * float(i));
    k[i] = std::cos(0.11f * float(i));
    v[i] = std::sin(0.05f * float(i) + 1.0f);
  }
  std::vector<int32_t> cu = {0, int32_t(L)};
  sp::AttentionInputs in;
  in.q = sp::make_view(q.data(), sp::DType::kFloat32, {L, H, D});
  in.k = sp::make_view(k.data(), sp::DType::kFloat32, {L, H, D});
  in.v = sp::make_view(v.data(), sp::DType::kFloat32, {L, H, D});
  in.cu_seqlens_q = sp::make_view(cu.data(), sp::DType::kInt32, {2});
  in.cu_seqlens_k = in.cu_seqlens_q;
  in.max_seqlen_q = in.max_seqlen_k = L;
  in.causal = true;
  sp::attention(in, {sp::make_view(out.data(), sp::DType::kFloat32, {L, H, D}), std::nullopt});

  double max_err = 0;
  const double scale = 1.0 / std::sqrt(double(D));
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> p(i + 1);
      double m = -1e300, sum = 0;
      for (int64_t j = 0; j <= i; ++j) {
        double s = 0;
        for (int64_t d = 0; d < D; ++d) s += double(q[(i * H + h) * D + d]) * k[(j * H + h) * D + d];
        p[j] = s * scale;
        m = std::max(m, p[j]);
      }
      for (auto& x : p) sum += (x = std::exp(x - m));
      for (int64_t d = 0; d < D; ++d) {
        double o = 0;
        for (int64_t j = 0; j <= i; ++j) o += p[j] * v[(j * H + h) * D + d];
        max_err = std::max(max_err, std::abs(o / sum - out[(i * H + h) * D + d]));
      }
    }
  }

  bool named = false;
  try {
    in.cu_seqlens_k = sp::make_view(cu.data(), sp::DType::kFloat32, {2});  // wrong dtype
    sp::attention(in, {sp::make_view(out.data(), sp::DType::kFloat32, {L, H, D}), std::nullopt});
  } catch (const sp::ArgumentError& e) {
    named = e.argument() == "cu_seqlens_k";
  }
  std::printf("consumer: sp::attention on the CPU, max abs error %.2e vs plain softmax; argument error named: %s\n",
              max_err, named ? "yes" : "no");
  return max_err < 1e-5 && named ? 0 : 1;
}
