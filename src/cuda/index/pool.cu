// Index stage, step 2: pooling. Block means of K and V (float32, and low-precision copies: the scorer's B operand and
// the sparse kernel's correction keys / values), one CTA per (pooled block, KV head); with a mean cache, the blocks a
// chunk completes are stored in it (the ones an earlier chunk completed: mean_cache.cu). V means only where read
// (kWithV: the correction, or a mean cache, whose later steps may use it): without them V is not read at all, half
// of the pooling's traffic. FP8 inputs: the raw e4m3 values are summed (exact in float32 for a block of up to 512
// keys but for the last bits of a sum over 2^16) and the sum scaled by the descale, so every copy starts from the
// real-unit mean (device_args.cuh, lowp_t).
#include <algorithm>
#include <type_traits>

#include "cuda/common/check.h"
#include "cuda/index/device_args.cuh"

namespace sparse_prefill::cuda::index_stage {
namespace {

constexpr int kPoolThreadsMax = 128;

// Where one pooling CTA (pooled row idx, KV head kvh) reads and writes; shared by both pooling kernels.
struct PoolBlock {
  int b;                      // sequence
  int64_t k_start, lo, hi;    // the block's keys [lo, hi) of the sequence (rows from k_start, contiguous KV)
  int64_t out;                // first element of its row in the index's means
  int64_t cache_row;          // row of the mean cache (-1: not cached)
  PoolAction act;
};

// Output elements of this row, and what to do. Returns false when the CTA is done: a row past the real blocks (the
// grid covers the host-side bound) gets zero low-precision means (the sparse kernel's correction steps load whole
// chunks of 128 rows and multiply masked probabilities (0) by them, so they must not be NaN).
// With a mean cache the grid is exactly batch x chunk_blocks CTAs (launch_pooling's caller) and starts each sequence
// at its block first = floor((k_len - q_len) / B), so (J + 1) B > k_len - q_len for every block it pools: pool_action
// never answers kRead here (the blocks that end before the chunk are copy_cached_means_kernel's, mean_cache.cu).
// The output arrays of the pooling: float32 (real units), the scorer's copies (lowp_t<T>), and for FP8 the sparse
// kernel's e4m3 copies (for bf16 / fp16 the kernel's copies are the lowp arrays: k_kernel is unused). The v arrays
// are left unwritten without kWithV: the sparse kernel reads them only with the correction (sparse_correction_on).
template <typename T>
struct PoolOut {
  float* k_mean;
  float* v_mean;
  lowp_t<T>* k_lowp;
  lowp_t<T>* v_lowp;
  T* k_kernel;
  T* v_kernel;
};

template <typename T, bool kWithV>
__device__ __forceinline__ bool pool_block(const SeqArgs& seq, const KVArgs& kv, const MeanCacheArgs& cache,
                                           int block_size, int num_kv_heads, int head_dim, const int32_t* cu_blocks,
                                           const PoolOut<T>& o, PoolBlock& pb) {
  int64_t idx = blockIdx.x;
  const int kvh = blockIdx.y;
  if (cache.chunk_blocks > 0) {  // grid over the blocks each sequence's chunk touches
    const int b = int(blockIdx.x / cache.chunk_blocks);  // < batch: the grid is batch x chunk_blocks
    const int64_t first = max(int64_t(0), (seq.k_len(b) - seq.q_len(b)) / block_size);
    const int64_t J = first + blockIdx.x % cache.chunk_blocks;
    if (J >= cu_blocks[b + 1] - cu_blocks[b]) return false;
    idx = cu_blocks[b] + J;
  }
  pb.out = (idx * num_kv_heads + kvh) * head_dim;
  if (idx >= cu_blocks[seq.batch]) {
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
      o.k_lowp[pb.out + d] = from_float<lowp_t<T>>(0.f);
      if constexpr (is_fp8_v<T>) o.k_kernel[pb.out + d] = to_kernel_mean(0.f, 0.f);
      if constexpr (kWithV) {
        o.v_lowp[pb.out + d] = from_float<lowp_t<T>>(0.f);
        if constexpr (is_fp8_v<T>) o.v_kernel[pb.out + d] = to_kernel_mean(0.f, 0.f);
      }
    }
    return false;
  }
  pb.b = find_sequence(cu_blocks, seq.batch, idx);
  const int64_t J = idx - cu_blocks[pb.b];
  pb.k_start = seq.k_start(pb.b);
  pb.lo = J * block_size;
  pb.hi = min(pb.lo + block_size, seq.k_len(pb.b));
  pb.act = pool_action(cache, seq, pb.b, J, block_size);  // kPoolStore or kPool (above)
  const int64_t slot = pb.act == PoolAction::kPool ? -1 : cache.slot(kv, pb.b, J, block_size);
  if (slot < 0) pb.act = PoolAction::kPool;  // no cache slot (a bad page id, reported): pool, store nothing
  pb.cache_row = slot < 0 ? -1 : slot * num_kv_heads + kvh;
  return true;
}

// Dimension d of the block's means from the key sums (FP8: of the raw values, scaled by the descales kd, vd here): the
// index's float32 and low-precision rows, and the cache row when the block is complete.
template <typename T, bool kWithV>
__device__ __forceinline__ void store_means(const PoolBlock& pb, const MeanCacheArgs& cache, int head_dim, int d,
                                            float ksum, float vsum, float kd, float vd, const PoolOut<T>& o) {
  const float inv = 1.f / float(pb.hi - pb.lo);
  float km = ksum * inv;
  if constexpr (is_fp8_v<T>) km *= kd;
  o.k_mean[pb.out + d] = km;
  o.k_lowp[pb.out + d] = from_float<lowp_t<T>>(km);
  if constexpr (is_fp8_v<T>) o.k_kernel[pb.out + d] = to_kernel_mean(km, kd);
  if constexpr (kWithV) {
    float vm = vsum * inv;
    if constexpr (is_fp8_v<T>) vm *= vd;
    o.v_mean[pb.out + d] = vm;
    o.v_lowp[pb.out + d] = from_float<lowp_t<T>>(vm);
    if constexpr (is_fp8_v<T>) o.v_kernel[pb.out + d] = to_kernel_mean(vm, vd);
    if (pb.act == PoolAction::kPoolStore) cache.v[pb.cache_row * head_dim + d] = vm;
  }
  // kPoolStore implies a mean cache, and launch_pooling pools V whenever there is one.
  if (pb.act == PoolAction::kPoolStore) cache.k[pb.cache_row * head_dim + d] = km;
}

// One CTA per (pooled block, KV head); thread d sums dimension d over the block's keys.
template <typename T, bool kWithV>
__global__ void pool_kernel(SeqArgs seq, KVArgs kv, MeanCacheArgs cache, int block_size, int num_kv_heads,
                            int head_dim, const int32_t* cu_blocks, PoolOut<T> o) {
  PoolBlock pb;
  if (!pool_block<T, kWithV>(seq, kv, cache, block_size, num_kv_heads, head_dim, cu_blocks, o, pb)) return;
  const int kvh = blockIdx.y;
  float kd = 1.f, vd = 1.f;
  if constexpr (is_fp8_v<T>) {
    kd = kv.k_descale.at(pb.b, kvh);
    if constexpr (kWithV) vd = kv.v_descale.at(pb.b, kvh);
  }
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float ks = 0.f, vs = 0.f;
    for (int64_t j = pb.lo; j < pb.hi; ++j) {
      int64_t ko, vo;
      if (!kv.offsets(pb.b, pb.k_start, kvh, j, ko, vo)) continue;
      ks += to_float(static_cast<const T*>(kv.k)[ko + d]);
      if constexpr (kWithV) vs += to_float(static_cast<const T*>(kv.v)[vo + d]);
    }
    store_means<T, kWithV>(pb, cache, head_dim, d, ks, vs, kd, vd, o);
  }
}

// The same pooling with 16-byte loads (K/V rows 16-byte aligned; 8-byte loads of 8 e4m3 values for FP8, so the
// thread layout is the same): thread (v, g) of 128 sums dims [8v, 8v + 8) over
// the keys j = g, g + G, ... of the block (G = 128 / (D / 8) key groups), so each thread has 2 * block/G independent
// 16-byte loads in flight instead of 2 * block dependent 2-byte ones; the G partial sums meet in shared memory.
// Measured need: chunked prefill re-pools the whole cache every step (4.3 GB for 8 x 128K at Hkv 8), where the
// scalar kernel reached ~1 TB/s.
// 6 CTAs per SM: the occupancy ptxas chose by itself (80 registers) before the dead kRead branch of pool_block was
// removed; stated, it gives 72-74 registers and no spills (implicit: 80 and 4-36 bytes of spill stores, varying with
// unrelated code changes). Without V (kWithV false): 60-62 registers, half the shared memory.
template <typename T, int D, bool kWithV>
__global__ void __launch_bounds__(128, 6) pool_vec_kernel(SeqArgs seq, KVArgs kv, MeanCacheArgs cache,
                                                          int block_size, int num_kv_heads, const int32_t* cu_blocks,
                                                          PoolOut<T> o) {
  constexpr int kVec = D / 8, kGroups = 128 / kVec;
  using Load = std::conditional_t<sizeof(T) == 1, uint2, uint4>;  // 8 elements
  __shared__ float part[kWithV ? 2 : 1][kGroups][D];
  PoolBlock pb;
  if (!pool_block<T, kWithV>(seq, kv, cache, block_size, num_kv_heads, D, cu_blocks, o, pb)) return;
  const int kvh = blockIdx.y;
  const int v = threadIdx.x % kVec, grp = threadIdx.x / kVec;
  float ks[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, vs[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
  for (int64_t j = pb.lo + grp; j < pb.hi; j += kGroups) {
    int64_t ko, vo;
    if (!kv.offsets(pb.b, pb.k_start, kvh, j, ko, vo)) continue;
    const Load kr = __ldg(reinterpret_cast<const Load*>(static_cast<const T*>(kv.k) + ko + v * 8));
    const T* ke = reinterpret_cast<const T*>(&kr);
#pragma unroll
    for (int e = 0; e < 8; ++e) ks[e] += to_float(ke[e]);
    if constexpr (kWithV) {
      const Load vr = __ldg(reinterpret_cast<const Load*>(static_cast<const T*>(kv.v) + vo + v * 8));
      const T* ve = reinterpret_cast<const T*>(&vr);
#pragma unroll
      for (int e = 0; e < 8; ++e) vs[e] += to_float(ve[e]);
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    part[0][grp][v * 8 + e] = ks[e];
    if constexpr (kWithV) part[1][grp][v * 8 + e] = vs[e];
  }
  __syncthreads();
  float kd = 1.f, vd = 1.f;
  if constexpr (is_fp8_v<T>) {
    kd = kv.k_descale.at(pb.b, kvh);
    if constexpr (kWithV) vd = kv.v_descale.at(pb.b, kvh);
  }
  for (int d = threadIdx.x; d < D; d += 128) {
    float kt = 0.f, vt = 0.f;
#pragma unroll
    for (int g2 = 0; g2 < kGroups; ++g2) {
      kt += part[0][g2][d];
      if constexpr (kWithV) vt += part[1][g2][d];
    }
    store_means<T, kWithV>(pb, cache, D, d, kt, vt, kd, vd, o);
  }
}

}  // namespace

void launch_pooling(cudaStream_t stream, DType dtype, int head_dim, bool vec16, int64_t pool_rows, const SeqArgs& seq,
                    const KVArgs& kv, const MeanCacheArgs& cache, int block_size, int num_kv_heads,
                    const DeviceIndex& d) {
  if (pool_rows <= 0) return;
  const dim3 grid{unsigned(pool_rows), unsigned(num_kv_heads)};
  // V means for the correction, and for a mean cache whatever this call's correction (a later step may use it).
  const bool with_v = d.correction || cache.k != nullptr;
  auto out = [&](auto tag) {
    using T = decltype(tag);
    return PoolOut<T>{d.k_mean, d.v_mean, static_cast<lowp_t<T>*>(d.k_mean_lowp),
                      static_cast<lowp_t<T>*>(d.v_mean_lowp), static_cast<T*>(d.k_mean_kernel),
                      static_cast<T*>(d.v_mean_kernel)};
  };
  if (vec16) {
    auto launch = [&](auto tag, auto dim) {
      using T = decltype(tag);
      constexpr int D = decltype(dim)::value;
      if (with_v) {
        pool_vec_kernel<T, D, true><<<grid, 128, 0, stream>>>(seq, kv, cache, block_size, num_kv_heads, d.cu_blocks,
                                                              out(tag));
      } else {
        pool_vec_kernel<T, D, false><<<grid, 128, 0, stream>>>(seq, kv, cache, block_size, num_kv_heads,
                                                               d.cu_blocks, out(tag));
      }
    };
    with_index_types(dtype, head_dim, launch);
    check_cuda(cudaGetLastError(), "pool_vec_kernel launch");
    return;
  }
  const int threads = std::min(head_dim, kPoolThreadsMax);
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    if (with_v) {
      pool_kernel<T, true><<<grid, threads, 0, stream>>>(seq, kv, cache, block_size, num_kv_heads, head_dim,
                                                         d.cu_blocks, out(tag));
    } else {
      pool_kernel<T, false><<<grid, threads, 0, stream>>>(seq, kv, cache, block_size, num_kv_heads, head_dim,
                                                          d.cu_blocks, out(tag));
    }
  };
  if (dtype == DType::kFloat8E4M3) launch(__nv_fp8_e4m3{});
  else if (dtype == DType::kBFloat16) launch(__nv_bfloat16{});
  else launch(__half{});
  check_cuda(cudaGetLastError(), "pool_kernel launch");
}

}  // namespace sparse_prefill::cuda::index_stage
