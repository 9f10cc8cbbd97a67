// SelectionRule::kKeyMax's residual basis and the keys' coordinates in it (docs/design/key_max_spec.md step 2), in
// double: the residuals x_j = k_j - k_mean_J of the sampled blocks' keys, C = sum_j x_j x_j^T, kKeyBasisIters
// subspace iterations Y = C X, X = MGS(Y) from X0 = hash_unit (core/key_basis.h, shared with the CUDA index stage).
#include <algorithm>
#include <cmath>

#include "core/contract.h"
#include "core/key_basis.h"
#include "reference/reference.h"

namespace sparse_prefill::reference {

std::vector<double> key_basis(const SequenceKV& kv, const float* k_mean, int64_t mean_stride, int head_dim, int rank,
                              int block_size) {
  const int D = head_dim, r = rank;
  const int64_t nb = num_blocks(kv.len, block_size);
  std::vector<double> C(size_t(D) * D, 0.0), x(static_cast<size_t>(D));
  for (int64_t J = 0; J < nb; J += key_basis_stride(nb)) {
    const float* km = k_mean + J * mean_stride;
    for (int64_t j = J * block_size; j < std::min<int64_t>((J + 1) * block_size, kv.len); ++j) {
      for (int d = 0; d < D; ++d) x[d] = double(kv.k[size_t(j) * D + d]) - double(km[d]);
      for (int a = 0; a < D; ++a)
        for (int e = 0; e < D; ++e) C[size_t(a) * D + e] += x[a] * x[e];
    }
  }
  std::vector<double> X(size_t(D) * r), Y(size_t(D) * r), y(static_cast<size_t>(D));  // [D x r] row-major
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
