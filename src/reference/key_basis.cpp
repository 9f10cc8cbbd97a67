// SelectionRule::kKeyMax's basis and the keys' coordinates in it (docs/design/key_max_spec.md step 2), in double: the
// second moment C = sum q q^T of the KV head's group's queries at the sampled positions, kKeyBasisIters subspace
// iterations Y = C X, X = MGS(Y) from X0 = hash_unit (core/key_basis.h, shared with the CUDA index stage); the keys'
// residuals x_j = k_j - k_mean_J in that basis.
#include <algorithm>
#include <cmath>

#include "core/contract.h"
#include "core/dtype_convert.h"
#include "core/key_basis.h"
#include "reference/reference.h"

namespace sparse_prefill::reference {
namespace {

// The top `rank` directions of the symmetric D x D matrix C: kKeyBasisIters times Y = C X, X = MGS(Y), from X0 =
// hash_unit; X [D x rank] row-major.
std::vector<double> subspace_basis(const std::vector<double>& C, int D, int r) {
  std::vector<double> X(size_t(D) * r), Y(size_t(D) * r), y(static_cast<size_t>(D));
  for (int d = 0; d < D; ++d)
    for (int c = 0; c < r; ++c) X[size_t(d) * r + c] = double(hash_unit(uint32_t(d), uint32_t(c)));
  for (int it = 0; it < kKeyBasisIters; ++it) {
    for (int a = 0; a < D; ++a)
      for (int c = 0; c < r; ++c) {
        double sum = 0;
        for (int e = 0; e < D; ++e) sum += C[size_t(a) * D + e] * X[size_t(e) * r + c];
        Y[size_t(a) * r + c] = sum;
      }
    // modified Gram-Schmidt: column c against the new columns c' < c, each projection off the updated y
    for (int c = 0; c < r; ++c) {
      for (int d = 0; d < D; ++d) y[d] = Y[size_t(d) * r + c];
      for (int c2 = 0; c2 < c; ++c2) {
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += X[size_t(d) * r + c2] * y[d];
        for (int d = 0; d < D; ++d) y[d] -= dot * X[size_t(d) * r + c2];
      }
      double norm = 0;
      for (int d = 0; d < D; ++d) norm += y[d] * y[d];
      norm = std::sqrt(norm);
      for (int d = 0; d < D; ++d) X[size_t(d) * r + c] = norm > 0 ? y[d] / norm : 0.0;
    }
  }
  return X;
}

}  // namespace

std::vector<double> key_basis(const AttentionInputs& in, const Problem& p, int b, int first_head, int heads, int rank,
                              int block_size) {
  const int D = p.head_dim;
  const SequenceInfo& s = p.seqs[b];
  const int64_t nbq = num_blocks(s.q_len, block_size), stride = key_basis_stride(nbq);
  std::vector<double> C(size_t(D) * D, 0.0), x(static_cast<size_t>(D));
  for (int64_t J = 0; J < nbq; J += stride)
    for (int64_t pos = J * block_size; pos < std::min<int64_t>((J + 1) * block_size, s.q_len); ++pos)
      for (int h = first_head; h < first_head + heads; ++h) {
        const int64_t qo = (s.q_start + pos) * in.q.stride[0] + h * in.q.stride[1];
        const float scale = descale_at(in.q_descale, b, h, p.num_q_heads);
        for (int d = 0; d < D; ++d) x[d] = double(load_as_float(in.q.data, p.dtype, qo + d) * scale);
        for (int a = 0; a < D; ++a)
          for (int e = 0; e < D; ++e) C[size_t(a) * D + e] += x[a] * x[e];
      }
  return subspace_basis(C, D, rank);
}

std::vector<double> key_coordinates(const SequenceKV& kv, const float* k_mean, int64_t mean_stride, int head_dim,
                                    const std::vector<double>& basis, int rank, int block_size) {
  const int D = head_dim, r = rank;
  std::vector<double> out(size_t(kv.len) * r), x(static_cast<size_t>(D));
  for (int64_t j = 0; j < kv.len; ++j) {
    const float* km = k_mean + (j / block_size) * mean_stride;
    for (int d = 0; d < D; ++d) x[d] = double(kv.k[size_t(j) * D + d]) - double(km[d]);
    for (int c = 0; c < r; ++c) {
      double sum = 0;
      for (int d = 0; d < D; ++d) sum += basis[size_t(d) * r + c] * x[d];
      out[size_t(j) * r + c] = sum;
    }
  }
  return out;
}

}  // namespace sparse_prefill::reference
