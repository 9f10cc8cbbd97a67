// The key_max rule's low-rank basis (SelectionRule::kKeyMax, docs/design/key_max_spec.md step 2): the constants and
// the start vectors that the CPU reference (src/reference/key_basis.cpp), the emulator (bench/accuracy/emulate.py,
// key_basis) and the CUDA index stage share, so that all three compute the same basis from the same keys. No CUDA
// dependency when the host compiler reads it: the functions are __host__ __device__ only under nvcc.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace sparse_prefill {

// Subspace iterations Y = C X, X = MGS(Y) from the hash start: a fixed count, so every backend stops at the same X.
constexpr int kKeyBasisIters = 10;
// The basis reads about this many key blocks per (sequence, KV head): every key_basis_stride(nb)-th block from 0.
// The residuals' second moment of 64 blocks (8K keys at block 128) is the whole prompt's to within sampling noise,
// and its cost stays flat in the prompt length.
constexpr int kKeyBasisSampleBlocks = 64;

// The stride of the sampled blocks of a sequence with nb key blocks: max(1, ceil(nb / 64)); blocks 0, s, 2s, ... < nb.
SP_HOST_DEVICE int64_t key_basis_stride(int64_t nb) {
  const int64_t s = (nb + kKeyBasisSampleBlocks - 1) / kKeyBasisSampleBlocks;
  return s > 1 ? s : 1;
}

// The start X0[d][c] = hash_unit(d, c) of the subspace iteration, in [-1, 1): a fixed pseudo-random matrix (no RNG
// state, the same bits on host and device; a multiple of 2^-23, exact in float and double), generic enough not to be
// orthogonal to the top eigenvectors.
SP_HOST_DEVICE float hash_unit(uint32_t d, uint32_t c) {
  uint32_t h = (d * 2654435761u) ^ (c * 2246822519u);
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return float(int32_t(h >> 8) - (1 << 23)) / float(1 << 23);
}

}  // namespace sparse_prefill
