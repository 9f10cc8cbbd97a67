// Index stage, the key_max rule's basis and projected keys (SelectionRule::kKeyMax, docs/design/key_max_spec.md
// steps 2 and 3's operands): three kernels on the stage's stream, after the pooling (they read the float32 means),
// before the scorer (key_max.cu), no host synchronisation:
//   key_moment_kernel   C = sum x x^T over the residuals x = k - k_mean of the sampled blocks (core/key_basis.h), per
//                       (sequence, KV head), in float32, in slices of the sampled keys (a CTA and a partial sum each,
//                       added in order by the basis kernel: the same basis on every run);
//   key_basis_kernel    P = kKeyBasisIters steps of subspace iteration from the hash start, one CTA per (sequence,
//                       KV head);
//   key_project_kernel  K' = P^T x for every key in fp16 (the residual GEMM's B operand), zero past the keys, and
//                       each block's radius max |K'_j| (the scorer's bound).
#include <cuda_fp16.h>

#include "core/key_basis.h"
#include "cuda/common/check.h"
#include "cuda/index/device_args.cuh"

namespace sparse_prefill::cuda::index_stage {
namespace {

constexpr int kMomentThreads = 256;
constexpr int kMomentKeys = 32;     // residuals per shared-memory tile of the moment CTA
constexpr int kBasisThreads = 256;
constexpr int kProjectThreads = 256;
constexpr int kProjectKeys = 32;    // keys per shared-memory tile of the projection CTA (block_size % 64 == 0)

// ---- 1. the residuals' second moment --------------------------------------------------------------------------------
// grid (batch, Hkv, key_moment_splits()): each CTA sums x x^T over one contiguous slice of the sampled keys (in key
// order) into its own partial C (key_basis_kernel adds the slices in order: a fixed summation order, the same basis on
// every run). 16 x 16 threads, each a (D / 16)^2 patch of C as float4 columns c * 64 + 4 * t (conflict-free shared
// reads); tiles of kMomentKeys residuals through shared memory, all of a tile's loads in flight at once. The first
// version (one CTA per 8 rows of C over every sampled key: 128 CTAs of 4 warps, 0.2 instructions per cycle) took 3.9 ms
// at every length on the H100, as long as the scorer at 32K.
template <typename T, int D>
__global__ void __launch_bounds__(kMomentThreads) key_moment_kernel(SeqArgs seq, KVArgs kv, int block_size,
                                                                    int num_kv_heads, const int32_t* cu_blocks,
                                                                    const float* k_mean, float* partial) {
  static_assert(D == 64 || D == 128, "patch columns c * 64 + 4 * t cover D");
  constexpr int kT = D / 16, kVec = kT / 4, kKeysPerPass = kMomentThreads / D;
  __shared__ __align__(16) float xs[kMomentKeys][D];
  const int b = blockIdx.x, h = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16, e = threadIdx.x % D, kk = threadIdx.x / D;
  const int64_t k_len = seq.k_len(b), nb = cu_blocks[b + 1] - cu_blocks[b];
  const int64_t stride = key_basis_stride(nb), sampled = (nb + stride - 1) / stride;
  const int64_t keys = sampled * block_size;  // flat index f: block (f / B) * stride, key f % B of it
  const int64_t f0 = keys * split / splits, f1 = keys * (split + 1) / splits;
  const float descale = is_fp8_v<T> ? kv.k_descale.at(b, h) : 1.f;
  float acc[kT][kT] = {};
  for (int64_t f = f0; f < f1; f += kMomentKeys) {
    float x[kMomentKeys / kKeysPerPass];
#pragma unroll
    for (int i = 0; i < kMomentKeys / kKeysPerPass; ++i) {  // every load of the tile issued before any is used
      const int64_t fi = f + i * kKeysPerPass + kk, J = (fi / block_size) * stride;
      const int64_t j = J * block_size + fi % block_size;
      int64_t ko, vo;
      const bool ok = fi < f1 && j < k_len && kv.offsets(b, seq.k_start(b), h, j, ko, vo);  // 0 on a bad page
      x[i] = ok ? to_float(static_cast<const T*>(kv.k)[ko + e]) * descale -
                      k_mean[((int64_t(cu_blocks[b]) + J) * num_kv_heads + h) * D + e]
                : 0.f;
    }
    __syncthreads();  // the previous tile's readers done
#pragma unroll
    for (int i = 0; i < kMomentKeys / kKeysPerPass; ++i) xs[i * kKeysPerPass + kk][e] = x[i];
    __syncthreads();
#pragma unroll 4
    for (int k = 0; k < kMomentKeys; ++k) {
      float a[kT], c[kT];
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        *reinterpret_cast<float4*>(&a[4 * v]) = *reinterpret_cast<const float4*>(&xs[k][v * 64 + 4 * ty]);
        *reinterpret_cast<float4*>(&c[4 * v]) = *reinterpret_cast<const float4*>(&xs[k][v * 64 + 4 * tx]);
      }
#pragma unroll
      for (int i = 0; i < kT; ++i)
#pragma unroll
        for (int j = 0; j < kT; ++j) acc[i][j] = fmaf(a[i], c[j], acc[i][j]);
    }
  }
  float* out = partial + ((int64_t(split) * seq.batch + b) * num_kv_heads + h) * D * D;
#pragma unroll
  for (int i = 0; i < kT; ++i) {
    const int r = (i / 4) * 64 + 4 * ty + i % 4;
#pragma unroll
    for (int v = 0; v < kVec; ++v)
      *reinterpret_cast<float4*>(&out[r * D + v * 64 + 4 * tx]) =
          make_float4(acc[i][4 * v], acc[i][4 * v + 1], acc[i][4 * v + 2], acc[i][4 * v + 3]);
  }
}

// ---- 2. the basis: subspace iteration -------------------------------------------------------------------------------
// One CTA per (sequence, KV head): C (the sum of the moment's slices) in shared memory, X <- MGS(C X) kKeyBasisIters
// times from X0 = hash_unit. Every value is the same bits as the plain statement (one element per thread summing its
// slices, Y's dot products in e order, the Gram-Schmidt column by column against the columns before it): only the
// order of independent work changed, so that the 8 CTAs (one per KV head at batch 1) are not a chain of latencies
// (H100, 6d7776f: 0.293 -> 0.143 ms at every length, bench/lab/results/ab_key_basis_order_h100.json).
//   - The slices: each thread's D * D / 4 / 256 float4 of C, one slice at a time with all of them in flight (the
//     plain loop waited for each load before the next add).
//   - Y = C X reads C by columns: C is symmetric to the bit (the moment kernel computes C[r][c] and C[c][r] with the
//     same products, fmaf(x_r, x_c, acc) = fmaf(x_c, x_r, acc), in the same key order, and the slices are summed in
//     the same order), so thread (d, column group) reads C[e][d] (consecutive d across a warp: no bank conflict) and
//     its columns of X[e] as float4 broadcasts: 1 + cols / 4 shared reads per cols FMAs instead of 2 per FMA.
//   - The Gram-Schmidt right-looking: the warp owning column c finishes it (its norm), then every warp subtracts its
//     projection from the later columns it owns. Each column still sees the projections on X[:, 0], X[:, 1], ... in
//     order, then its norm, with the same lane layout and shuffle tree: the same bits, in R dependent steps per
//     iteration instead of R (R + 1) / 2 (warp 0 alone before).
template <int D, int R>
__global__ void __launch_bounds__(kBasisThreads) key_basis_kernel(int batch, int num_kv_heads, int splits,
                                                                  const float* partial, float* basis) {
  static_assert(D * D % (4 * kBasisThreads) == 0 && D * R % kBasisThreads == 0 && kBasisThreads % D == 0,
                "whole float4 of C, and whole columns groups of Y, per thread");
  constexpr int kWarps = kBasisThreads / 32, kPer = D / 32, kOwn = (R + kWarps - 1) / kWarps;
  constexpr int kCols = D * R / kBasisThreads;  // Y's columns per thread (one row each)
  static_assert(kCols % 4 == 0, "X's columns as float4");
  extern __shared__ float basis_smem[];
  float* C = basis_smem;        // [D][D]
  float* X = C + D * D;         // [D][R]
  float* Y = X + D * R;         // [D][R]
  const int b = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  {
    constexpr int kVec = D * D / 4 / kBasisThreads;
    const float4* part = reinterpret_cast<const float4*>(partial + (int64_t(b) * num_kv_heads + h) * D * D);
    const int64_t split_stride = int64_t(batch) * num_kv_heads * D * D / 4;
    for (int v = 0; v < kVec; ++v) {
      float4 x[kMaxKeyMomentSplits];
#pragma unroll
      for (int s = 0; s < kMaxKeyMomentSplits; ++s)
        if (s < splits) x[s] = part[s * split_stride + threadIdx.x + v * kBasisThreads];
      float4 c = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int s = 0; s < kMaxKeyMomentSplits; ++s) {
        if (s < splits) {
          c.x += x[s].x;
          c.y += x[s].y;
          c.z += x[s].z;
          c.w += x[s].w;
        }
      }
      reinterpret_cast<float4*>(C)[threadIdx.x + v * kBasisThreads] = c;
    }
  }
  for (int i = threadIdx.x; i < D * R; i += kBasisThreads) X[i] = hash_unit(uint32_t(i / R), uint32_t(i % R));
  __syncthreads();
  const int yd = threadIdx.x % D, yc0 = (threadIdx.x / D) * kCols;  // this thread's row of Y and first column
  for (int it = 0; it < kKeyBasisIters; ++it) {
    {
      float y[kCols] = {};
      for (int e2 = 0; e2 < D; ++e2) {
        const float c = C[e2 * D + yd];  // = C[yd][e2]
#pragma unroll
        for (int v = 0; v < kCols / 4; ++v) {
          const float4 x4 = *reinterpret_cast<const float4*>(&X[e2 * R + yc0 + 4 * v]);
          y[4 * v] = fmaf(c, x4.x, y[4 * v]);
          y[4 * v + 1] = fmaf(c, x4.y, y[4 * v + 1]);
          y[4 * v + 2] = fmaf(c, x4.z, y[4 * v + 2]);
          y[4 * v + 3] = fmaf(c, x4.w, y[4 * v + 3]);
        }
      }
#pragma unroll
      for (int v = 0; v < kCols / 4; ++v)
        *reinterpret_cast<float4*>(&Y[yd * R + yc0 + 4 * v]) = make_float4(y[4 * v], y[4 * v + 1], y[4 * v + 2],
                                                                            y[4 * v + 3]);
    }
    __syncthreads();
    // This warp's columns warp + j * kWarps, rows lane + 32 k, in registers through the iteration.
    float y[kOwn][kPer];
#pragma unroll
    for (int j = 0; j < kOwn; ++j) {
      const int col = warp + j * kWarps;
#pragma unroll
      for (int k = 0; k < kPer; ++k) y[j][k] = col < R ? Y[(lane + 32 * k) * R + col] : 0.f;
    }
    for (int c = 0; c < R; ++c) {
#pragma unroll
      for (int j = 0; j < kOwn; ++j) {
        if (warp + j * kWarps != c) continue;  // the owner finishes column c
        float nn = 0.f;
#pragma unroll
        for (int k = 0; k < kPer; ++k) nn = fmaf(y[j][k], y[j][k], nn);
        for (int o = 16; o > 0; o /= 2) nn += __shfl_xor_sync(0xffffffffu, nn, o);
        // n > 0 ? y / n : 0 (the spec, as the reference): a NaN or zero column is exactly 0, never y * 0 (NaN * 0)
        const bool ok = nn > 0.f;
        const float inv = ok ? rsqrtf(nn) : 0.f;
#pragma unroll
        for (int k = 0; k < kPer; ++k) X[(lane + 32 * k) * R + c] = ok ? y[j][k] * inv : 0.f;
      }
      __syncthreads();  // X[:, c] written
#pragma unroll
      for (int j = 0; j < kOwn; ++j) {
        const int col = warp + j * kWarps;
        if (col <= c || col >= R) continue;
        float xc[kPer];
#pragma unroll
        for (int k = 0; k < kPer; ++k) xc[k] = X[(lane + 32 * k) * R + c];
        float dot = 0.f;
#pragma unroll
        for (int k = 0; k < kPer; ++k) dot = fmaf(xc[k], y[j][k], dot);
        for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
#pragma unroll
        for (int k = 0; k < kPer; ++k) y[j][k] = fmaf(-dot, xc[k], y[j][k]);
      }
    }
    // the last column's barrier above: X complete before the next Y = C X, Y read before it is rewritten
  }
  float* p = basis + (int64_t(b) * num_kv_heads + h) * D * R;
  for (int i = threadIdx.x; i < D * R; i += kBasisThreads) p[i] = X[i];
}

// ---- 3. the projected residuals K' = P^T (k - k_mean) and each block's radius --------------------------------------
// grid (pooled row idx, Hkv): one block's keys, kProjectKeys at a time through shared memory (coalesced loads: thread e
// reads column e of a key row; the first version read each key row by one thread, 0.67 ms at 128K on the H100); thread
// (key, part) computes R / 8 outputs. Rows past the sequence's keys (the tail block's) are zero. K' layout:
// [Hkv][key_rows][R], key row cu_blocks[b] * B + j. The radius of the block, max over its keys of |K'_j| (of the fp16
// values the scorer reads; NaN if one is NaN): [Hkv][key_rows / B], the scorer's bound on a block's residual maxima.
template <typename T, int D, int R>
__global__ void __launch_bounds__(kProjectThreads) key_project_kernel(SeqArgs seq, KVArgs kv, int block_size,
                                                                      int num_kv_heads, const int32_t* cu_blocks,
                                                                      const float* k_mean, const float* basis,
                                                                      __half* proj, float* radius, int64_t key_rows) {
  constexpr int kParts = kProjectThreads / kProjectKeys, kCols = R / kParts, kKeysPerPass = kProjectThreads / D;
  static_assert(kCols % 2 == 0, "half2 stores");
  __shared__ __align__(16) float sP[D * R];
  __shared__ float sBar[D];
  __shared__ float xs[kProjectKeys][D + 1];  // +1: the kParts threads of a key read one bank per key
  __shared__ unsigned r2_bits;               // max |K'_j|^2 of the block (non-negative floats order as their bits)
  const int64_t idx = blockIdx.x;
  const int h = blockIdx.y;
  if (idx >= cu_blocks[seq.batch]) return;
  const int b = find_sequence(cu_blocks, seq.batch, idx);
  const int64_t J = idx - cu_blocks[b], k_len = seq.k_len(b);
  const float* p = basis + (int64_t(b) * num_kv_heads + h) * D * R;
  for (int i = threadIdx.x; i < D * R; i += kProjectThreads) sP[i] = p[i];
  for (int i = threadIdx.x; i < D; i += kProjectThreads) sBar[i] = k_mean[(idx * num_kv_heads + h) * D + i];
  if (threadIdx.x == 0) r2_bits = 0u;
  const float descale = is_fp8_v<T> ? kv.k_descale.at(b, h) : 1.f;
  const int e = threadIdx.x % D, kk = threadIdx.x / D;
  const int key = threadIdx.x / kParts, c0 = (threadIdx.x % kParts) * kCols;
  unsigned r2_max = 0u;  // this thread's keys' max |K'_j|^2, as bits
  for (int j0 = 0; j0 < block_size; j0 += kProjectKeys) {
    float x[kProjectKeys / kKeysPerPass];
#pragma unroll
    for (int i = 0; i < kProjectKeys / kKeysPerPass; ++i) {
      const int64_t j = J * block_size + j0 + i * kKeysPerPass + kk;
      int64_t ko, vo;
      const bool ok = j < k_len && kv.offsets(b, seq.k_start(b), h, j, ko, vo);  // 0 past k_len and on a bad page
      x[i] = ok ? to_float(static_cast<const T*>(kv.k)[ko + e]) * descale : 0.f;
    }
    __syncthreads();  // sP / sBar written; the previous tile's readers done
#pragma unroll
    for (int i = 0; i < kProjectKeys / kKeysPerPass; ++i) {
      const int64_t j = J * block_size + j0 + i * kKeysPerPass + kk;
      xs[i * kKeysPerPass + kk][e] = j < k_len ? x[i] - sBar[e] : 0.f;
    }
    __syncthreads();
    float acc[kCols] = {};
    for (int d = 0; d < D; ++d) {
      const float xd = xs[key][d];
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[c] = fmaf(xd, sP[d * R + c0 + c], acc[c]);
    }
    __half* out = proj + (int64_t(h) * key_rows + idx * block_size + j0 + key) * R + c0;
    float r2 = 0.f;
#pragma unroll
    for (int c = 0; c < kCols; c += 2) {
      const __half2 v = __floats2half2_rn(acc[c], acc[c + 1]);
      *reinterpret_cast<__half2*>(out + c) = v;
      const float2 f = __half22float2(v);
      r2 = fmaf(f.x, f.x, fmaf(f.y, f.y, r2));
    }
#pragma unroll
    for (int o = 1; o < kParts; o *= 2) r2 += __shfl_xor_sync(0xffffffffu, r2, o);  // the key's kParts lanes
    r2_max = max(r2_max, __float_as_uint(r2));  // a NaN's bits are above every finite square's
  }
  r2_max = __reduce_max_sync(0xffffffffu, r2_max);
  if (threadIdx.x % 32 == 0) atomicMax(&r2_bits, r2_max);
  __syncthreads();
  if (threadIdx.x == 0) radius[int64_t(h) * (key_rows / block_size) + idx] = sqrtf(__uint_as_float(r2_bits));
}

template <int D, int R>
size_t key_basis_smem_bytes() {
  return size_t(D * D + 2 * D * R) * sizeof(float);
}

template <typename T, int D, int R>
void launch_all(cudaStream_t stream, const Bounds& bd, int batch, int num_kv_heads, int block_size,
                const SeqArgs& seq, const KVArgs& kv, const DeviceIndex& d) {
  const int splits = key_moment_splits(batch, num_kv_heads);
  key_moment_kernel<T, D><<<dim3(unsigned(batch), unsigned(num_kv_heads), unsigned(splits)), kMomentThreads, 0,
                            stream>>>(seq, kv, block_size, num_kv_heads, d.cu_blocks, d.k_mean, d.key_moment);
  static const bool basis_attr = [] {
    check_cuda(cudaFuncSetAttribute(key_basis_kernel<D, R>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(key_basis_smem_bytes<D, R>())),
               "cudaFuncSetAttribute(key_basis_kernel)");
    return true;
  }();
  (void)basis_attr;
  key_basis_kernel<D, R><<<dim3(unsigned(batch), unsigned(num_kv_heads)), kBasisThreads,
                           key_basis_smem_bytes<D, R>(), stream>>>(batch, num_kv_heads, splits, d.key_moment,
                                                                   d.key_basis);
  if (bd.max_blocks > 0) {
    key_project_kernel<T, D, R><<<dim3(unsigned(bd.max_blocks), unsigned(num_kv_heads)), kProjectThreads, 0, stream>>>(
        seq, kv, block_size, num_kv_heads, d.cu_blocks, d.k_mean, d.key_basis, static_cast<__half*>(d.key_proj),
        d.key_radius, d.key_rows);
  }
}

}  // namespace

void launch_key_basis(cudaStream_t stream, const Problem& p, int key_rank, const Bounds& bd, const SeqArgs& seq,
                      const KVArgs& kv, int block_size, const DeviceIndex& d) {
  auto launch = [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int kD = decltype(dim)::value;
    if (key_rank == 32) {
      launch_all<T, kD, 32>(stream, bd, p.batch, p.num_kv_heads, block_size, seq, kv, d);
    } else {
      launch_all<T, kD, 16>(stream, bd, p.batch, p.num_kv_heads, block_size, seq, kv, d);
    }
  };
  with_index_types(p.dtype, p.head_dim, launch);
}

}  // namespace sparse_prefill::cuda::index_stage
