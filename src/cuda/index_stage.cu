// GPU index stage (FlashPrefill V2 selection). See index_stage.h for the design; docs/semantics.md for the rules.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "api/validate.h"
#include "cuda/common/check.h"
#include "cuda/common/workspace.h"
#include "cuda/device_checks.h"
#include "cuda/fwd_args.h"
#include "cuda/fwd_config.h"  // CuTe / CUTLASS: GMMA atoms, swizzled K-major smem atoms, proxy fence
#include "cuda/index_stage.h"
#include "cuda/softmax.h"     // acc_rowcol, fast_exp2
#include "cuda/wgmma.h"

namespace sparse_prefill::cuda {
namespace {

constexpr int kScoreChunk = 128;     // pooled blocks scored per step: S chunk is 128 rows x 128 blocks
constexpr int kScoreThreads = 256;   // 2 warpgroups x 64 packed rows
constexpr int kScoreWarps = kScoreThreads / 32;
constexpr int kPoolThreadsMax = 128;

struct SeqArgs {
  const int32_t* cu_q;
  const int32_t* cu_k;         // contiguous KV (else null)
  const int32_t* seqused_k;    // paged KV (else null)
  int batch;
  __device__ int64_t q_start(int b) const { return cu_q[b]; }
  __device__ int64_t q_len(int b) const { return cu_q[b + 1] - cu_q[b]; }
  __device__ int64_t k_start(int b) const { return cu_k ? cu_k[b] : 0; }
  __device__ int64_t k_len(int b) const { return cu_k ? cu_k[b + 1] - cu_k[b] : seqused_k[b]; }
};

// Largest b in [0, batch) with cu[b] <= idx (skips empty sequences).
__device__ int find_sequence(const int32_t* cu, int batch, int64_t idx) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu[mid] <= idx) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Serial prefix sums over the batch (B is small; microseconds) and counter reset. Device-side checks
// (device_checks.h): a sequence whose span is invalid gets no tile and no block (so no later kernel of the index stage
// addresses memory from its values; the sparse kernel writes its rows NaN) and is reported. The valid spans bound the
// sums by the workspace's host-side bounds (Bounds): lengths within max_seqlen, rows within q and k.
__global__ void plan_kernel(SeqArgs seq, SeqLimits limits, DeviceError* err, int group_size, int block_size,
                            int num_kv_heads, int32_t* cu_tiles, int32_t* cu_blocks, int64_t* cu_capacity,
                            unsigned long long* counters) {
  int64_t tiles = 0, blocks = 0, cap = 0;
  cu_tiles[0] = 0; cu_blocks[0] = 0; cu_capacity[0] = 0;
  for (int b = 0; b < seq.batch; ++b) {
    const SeqSpan span = load_seq_span(seq.cu_q, seq.cu_k, seq.seqused_k, b);
    const int bad = seq_violation(span, b, limits);
    if (bad) report_seq_error(err, bad, b, span, limits);
    const int64_t t = bad ? 0 : (seq.q_len(b) * group_size + kTileRows - 1) / kTileRows;
    const int64_t nb = bad ? 0 : (seq.k_len(b) + block_size - 1) / block_size;
    tiles += t; blocks += nb; cap += num_kv_heads * t * nb;
    cu_tiles[b + 1] = int32_t(tiles); cu_blocks[b + 1] = int32_t(blocks); cu_capacity[b + 1] = cap;
  }
  counters[0] = counters[1] = counters[2] = 0;
}

struct KVArgs {
  const void* k;
  const void* v;
  int64_t k_stride[3], v_stride[3];  // contiguous: row, head; paged: page, slot, head
  const int32_t* block_table;
  int64_t bt_stride0, bt_stride1;
  int64_t page_size;
  int64_t num_pages;   // block_table ids outside [0, num_pages) are skipped and reported (device_checks.h)
  DeviceError* err;

  // Page of key j of sequence b, or -1 (reported) for a bad id.
  __device__ int64_t page(int b, int64_t j) const {
    const int64_t col = j / page_size;
    const int64_t pg = block_table[b * bt_stride0 + col * bt_stride1];
    if (pg >= 0 && pg < num_pages) return pg;
    report_device_error(err, kErrBlockTable, b, int(col), int(pg), int(num_pages));
    return -1;
  }
};

// Pooled-means cache (MeanCache, sparse.h); k == nullptr: none.
struct MeanCacheArgs {
  float* k = nullptr;
  float* v = nullptr;
  int slots_per_page = 1;  // page_size / block_size when pages hold whole blocks, else 1 (slot = the last page)
  // The pooling grid covers, per sequence, the chunk_blocks blocks from the first one its chunk touches (the only
  // ones to pool); copy_cached_means_kernel copies the others from the cache. 0: the grid covers every pooled row.
  int chunk_blocks = 0;

  // Cache slot of complete block J of sequence b (paged KV): the page of its last key; -1 for a bad page id.
  __device__ int64_t slot(const KVArgs& kv, int b, int64_t J, int block_size) const {
    const int64_t j = (J + 1) * block_size - 1;
    const int64_t page = kv.page(b, j);
    if (page < 0) return -1;
    return page * slots_per_page + (slots_per_page > 1 ? (j % kv.page_size) / block_size : 0);
  }
};

// What the pooling does with block J of sequence b: read it from the cache (complete, and ends before the call's
// chunk: written by an earlier chunk's call), or pool it (and store it when complete).
enum class PoolAction { kRead, kPoolStore, kPool };
__device__ PoolAction pool_action(const MeanCacheArgs& cache, const SeqArgs& seq, int b, int64_t J, int block_size) {
  if (cache.k == nullptr) return PoolAction::kPool;
  const int64_t end = (J + 1) * block_size, k_len = seq.k_len(b);
  if (end <= k_len - seq.q_len(b)) return PoolAction::kRead;
  return end <= k_len ? PoolAction::kPoolStore : PoolAction::kPool;
}

template <typename T>
__device__ float to_float(T x);
template <> __device__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ float to_float<__half>(__half x) { return __half2float(x); }
template <typename T>
__device__ T from_float(float x);
template <> __device__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __half from_float<__half>(float x) { return __float2half(x); }

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
// chunks of 128 rows and multiply masked probabilities (0) by them, so they must not be NaN); a block an earlier
// chunk completed is copied from the mean cache (2 x D floats instead of 2 x block x D).
template <typename T>
__device__ bool pool_block(const SeqArgs& seq, const KVArgs& kv, const MeanCacheArgs& cache, int block_size,
                           int num_kv_heads, int head_dim, const int32_t* cu_blocks, float* k_mean, float* v_mean,
                           T* k_mean_lowp, T* v_mean_lowp, PoolBlock& pb) {
  int64_t idx = blockIdx.x;
  const int kvh = blockIdx.y;
  if (cache.chunk_blocks > 0) {  // grid over the blocks each sequence's chunk touches
    const int b = int(blockIdx.x / cache.chunk_blocks);
    if (b >= seq.batch) return false;
    const int64_t first = max(int64_t(0), (seq.k_len(b) - seq.q_len(b)) / block_size);
    const int64_t J = first + blockIdx.x % cache.chunk_blocks;
    if (J >= cu_blocks[b + 1] - cu_blocks[b]) return false;
    idx = cu_blocks[b] + J;
  }
  pb.out = (idx * num_kv_heads + kvh) * head_dim;
  if (idx >= cu_blocks[seq.batch]) {
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
      k_mean_lowp[pb.out + d] = from_float<T>(0.f);
      v_mean_lowp[pb.out + d] = from_float<T>(0.f);
    }
    return false;
  }
  pb.b = find_sequence(cu_blocks, seq.batch, idx);
  const int64_t J = idx - cu_blocks[pb.b];
  pb.k_start = seq.k_start(pb.b);
  pb.lo = J * block_size;
  pb.hi = min(pb.lo + block_size, seq.k_len(pb.b));
  pb.act = pool_action(cache, seq, pb.b, J, block_size);
  const int64_t slot = pb.act == PoolAction::kPool ? -1 : cache.slot(kv, pb.b, J, block_size);
  if (slot < 0) pb.act = PoolAction::kPool;  // no cache slot (a bad page id, reported): pool, store nothing
  pb.cache_row = slot < 0 ? -1 : slot * num_kv_heads + kvh;
  if (pb.act != PoolAction::kRead) return true;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    const float km = cache.k[pb.cache_row * head_dim + d], vm = cache.v[pb.cache_row * head_dim + d];
    k_mean[pb.out + d] = km;
    v_mean[pb.out + d] = vm;
    k_mean_lowp[pb.out + d] = from_float<T>(km);
    v_mean_lowp[pb.out + d] = from_float<T>(vm);
  }
  return false;
}

// With a mean cache: the blocks that end before each sequence's chunk, copied from the cache (kRead), 4 dims a
// thread over every (row, KV head) with a grid-stride loop, and zero low-precision means for the rows past the real
// blocks (as pool_block writes them without a cache). Replaces a pooling CTA per cached block: at chunk 1024 x
// batch 8 (128K) those 65K CTAs, each a chain of dependent loads, took 176 of the 420 us of a selection.
template <typename T>
__global__ void __launch_bounds__(256) copy_cached_means_kernel(SeqArgs seq, KVArgs kv, MeanCacheArgs cache,
                                                                int block_size, int num_kv_heads, int head_dim,
                                                                int64_t max_blocks, const int32_t* cu_blocks,
                                                                float* k_mean, float* v_mean, T* k_mean_lowp,
                                                                T* v_mean_lowp) {
  const int vecs = head_dim / 4;
  const int64_t per_row = int64_t(num_kv_heads) * vecs, n = max_blocks * per_row, total = cu_blocks[seq.batch];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t idx = i / per_row, rem = i % per_row;
    const int kvh = int(rem / vecs), d = int(rem % vecs) * 4;
    const int64_t out = (idx * num_kv_heads + kvh) * head_dim + d;
    union { T h[4]; uint2 u; } kl, vl;
    if (idx >= total) {
      for (int e = 0; e < 4; ++e) kl.h[e] = vl.h[e] = from_float<T>(0.f);
    } else {
      const int b = find_sequence(cu_blocks, seq.batch, idx);
      const int64_t J = idx - cu_blocks[b];
      if (pool_action(cache, seq, b, J, block_size) != PoolAction::kRead) continue;  // pooled by the pooling kernel
      const int64_t slot = cache.slot(kv, b, J, block_size);
      float4 km = make_float4(0.f, 0.f, 0.f, 0.f), vm = km;  // a bad page id (reported): zero means
      if (slot >= 0) {
        const int64_t row = (slot * num_kv_heads + kvh) * head_dim + d;
        km.x = cache.k[row], km.y = cache.k[row + 1], km.z = cache.k[row + 2], km.w = cache.k[row + 3];
        vm.x = cache.v[row], vm.y = cache.v[row + 1], vm.z = cache.v[row + 2], vm.w = cache.v[row + 3];
      }
      *reinterpret_cast<float4*>(k_mean + out) = km;  // workspace rows: 16-byte aligned
      *reinterpret_cast<float4*>(v_mean + out) = vm;
      kl.h[0] = from_float<T>(km.x), kl.h[1] = from_float<T>(km.y), kl.h[2] = from_float<T>(km.z);
      kl.h[3] = from_float<T>(km.w);
      vl.h[0] = from_float<T>(vm.x), vl.h[1] = from_float<T>(vm.y), vl.h[2] = from_float<T>(vm.z);
      vl.h[3] = from_float<T>(vm.w);
    }
    *reinterpret_cast<uint2*>(k_mean_lowp + out) = kl.u;
    *reinterpret_cast<uint2*>(v_mean_lowp + out) = vl.u;
  }
}

// Element offsets of key j (of sequence b, KV head kvh) in K and V, contiguous or paged; false for a key on a bad
// page (skipped: it adds nothing to the sums).
__device__ __forceinline__ bool kv_offsets(const KVArgs& kv, const PoolBlock& pb, int kvh, int64_t j, int64_t& ko,
                                           int64_t& vo) {
  if (kv.block_table) {
    const int64_t page = kv.page(pb.b, j);
    if (page < 0) return false;
    const int64_t slot = j % kv.page_size;
    ko = page * kv.k_stride[0] + slot * kv.k_stride[1] + kvh * kv.k_stride[2];
    vo = page * kv.v_stride[0] + slot * kv.v_stride[1] + kvh * kv.v_stride[2];
  } else {
    ko = (pb.k_start + j) * kv.k_stride[0] + kvh * kv.k_stride[1];
    vo = (pb.k_start + j) * kv.v_stride[0] + kvh * kv.v_stride[1];
  }
  return true;
}

// Dimension d of the block's means from the key sums: the index's float32 and low-precision rows, and the cache
// row when the block is complete.
template <typename T>
__device__ __forceinline__ void store_means(const PoolBlock& pb, const MeanCacheArgs& cache, int head_dim, int d,
                                            float ksum, float vsum, float* k_mean, float* v_mean, T* k_mean_lowp,
                                            T* v_mean_lowp) {
  const float inv = 1.f / float(pb.hi - pb.lo);
  const float km = ksum * inv, vm = vsum * inv;
  k_mean[pb.out + d] = km;
  v_mean[pb.out + d] = vm;
  k_mean_lowp[pb.out + d] = from_float<T>(km);
  v_mean_lowp[pb.out + d] = from_float<T>(vm);
  if (pb.act == PoolAction::kPoolStore) {
    cache.k[pb.cache_row * head_dim + d] = km;
    cache.v[pb.cache_row * head_dim + d] = vm;
  }
}

// One CTA per (pooled block, KV head); thread d sums dimension d over the block's keys.
template <typename T>
__global__ void pool_kernel(SeqArgs seq, KVArgs kv, MeanCacheArgs cache, int block_size, int num_kv_heads,
                            int head_dim, const int32_t* cu_blocks, float* k_mean, float* v_mean, T* k_mean_lowp,
                            T* v_mean_lowp) {
  PoolBlock pb;
  if (!pool_block(seq, kv, cache, block_size, num_kv_heads, head_dim, cu_blocks, k_mean, v_mean, k_mean_lowp,
                  v_mean_lowp, pb))
    return;
  const int kvh = blockIdx.y;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float ks = 0.f, vs = 0.f;
    for (int64_t j = pb.lo; j < pb.hi; ++j) {
      int64_t ko, vo;
      if (!kv_offsets(kv, pb, kvh, j, ko, vo)) continue;
      ks += to_float(static_cast<const T*>(kv.k)[ko + d]);
      vs += to_float(static_cast<const T*>(kv.v)[vo + d]);
    }
    store_means(pb, cache, head_dim, d, ks, vs, k_mean, v_mean, k_mean_lowp, v_mean_lowp);
  }
}

// The same pooling with 16-byte loads (K/V rows 16-byte aligned): thread (v, g) of 128 sums dims [8v, 8v + 8) over
// the keys j = g, g + G, ... of the block (G = 128 / (D / 8) key groups), so each thread has 2 * block/G independent
// 16-byte loads in flight instead of 2 * block dependent 2-byte ones; the G partial sums meet in shared memory.
// Measured need: chunked prefill re-pools the whole cache every step (4.3 GB for 8 x 128K at Hkv 8), where the
// scalar kernel reached ~1 TB/s.
template <typename T, int D>
__global__ void __launch_bounds__(128) pool_vec_kernel(SeqArgs seq, KVArgs kv, MeanCacheArgs cache, int block_size,
                                                       int num_kv_heads, const int32_t* cu_blocks, float* k_mean,
                                                       float* v_mean, T* k_mean_lowp, T* v_mean_lowp) {
  constexpr int kVec = D / 8, kGroups = 128 / kVec;
  __shared__ float part[2][kGroups][D];
  PoolBlock pb;
  if (!pool_block(seq, kv, cache, block_size, num_kv_heads, D, cu_blocks, k_mean, v_mean, k_mean_lowp, v_mean_lowp,
                  pb))
    return;
  const int kvh = blockIdx.y;
  const int v = threadIdx.x % kVec, grp = threadIdx.x / kVec;
  float ks[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, vs[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
  for (int64_t j = pb.lo + grp; j < pb.hi; j += kGroups) {
    int64_t ko, vo;
    if (!kv_offsets(kv, pb, kvh, j, ko, vo)) continue;
    const uint4 kr = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(kv.k) + ko + v * 8));
    const uint4 vr = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(kv.v) + vo + v * 8));
    const T* ke = reinterpret_cast<const T*>(&kr);
    const T* ve = reinterpret_cast<const T*>(&vr);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      ks[e] += to_float(ke[e]);
      vs[e] += to_float(ve[e]);
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    part[0][grp][v * 8 + e] = ks[e];
    part[1][grp][v * 8 + e] = vs[e];
  }
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += 128) {
    float kt = 0.f, vt = 0.f;
#pragma unroll
    for (int g2 = 0; g2 < kGroups; ++g2) {
      kt += part[0][g2][d];
      vt += part[1][g2][d];
    }
    store_means(pb, cache, D, d, kt, vt, k_mean, v_mean, k_mean_lowp, v_mean_lowp);
  }
}

// Prepares a caller's index view for the sparse kernel: tiles per sequence (prefix sums, from cu_seqlens_q on the
// device) and low-precision copies of the float32 pooled means.
template <typename T>
__global__ void prepare_view_kernel(SeqArgs seq, SeqLimits limits, int batch, int group_size, int32_t* cu_tiles,
                                    const float* k_mean, const float* v_mean, int64_t k_rs, int64_t k_hs,
                                    int64_t v_rs, int64_t v_hs, int64_t rows, int num_kv_heads, int head_dim,
                                    T* k_lowp, T* v_lowp) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    int64_t tiles = 0;
    cu_tiles[0] = 0;
    for (int b = 0; b < batch; ++b) {  // a bad sequence (device_checks.h) gets no tile: the kernel reports it
      const SeqSpan span = load_seq_span(seq.cu_q, seq.cu_k, seq.seqused_k, b);
      if (!seq_violation(span, b, limits)) tiles += (int64_t(span.q_len) * group_size + kTileRows - 1) / kTileRows;
      cu_tiles[b + 1] = int32_t(tiles);
    }
  }
  const int64_t n = rows * num_kv_heads * head_dim;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = i % head_dim, h = (i / head_dim) % num_kv_heads, r = i / (int64_t(head_dim) * num_kv_heads);
    k_lowp[i] = from_float<T>(k_mean[r * k_rs + h * k_hs + d]);
    v_lowp[i] = from_float<T>(v_mean[r * v_rs + h * v_hs + d]);
  }
}

// Union mode: one CTA per (sequence, KV head). The lists of the sequence's tiles are OR-ed into a shared-memory
// bitmap of its nb blocks, compacted (ascending) into the slice of tile 0 (only this CTA reads those slices), and
// every tile's segment is pointed at it. counters[0] (kept) is recounted as the union blocks each tile can see;
// counters[2] keeps the per-tile count for the report.
constexpr int kUnionThreads = 256;
__global__ void __launch_bounds__(kUnionThreads) union_kernel(SeqArgs seq, int group_size, int block_size,
                                                              int num_kv_heads, const int32_t* cu_tiles,
                                                              const int32_t* cu_blocks, const int64_t* cu_capacity,
                                                              int32_t* segment_start, int32_t* segment_end,
                                                              int32_t* block_ids, unsigned long long* counters) {
  extern __shared__ uint32_t bits[];  // [words] bitmap, then [words + 1] exclusive prefix counts
  __shared__ int scan[kUnionThreads];
  const int b = blockIdx.x, kvh = blockIdx.y;
  if (b >= seq.batch) return;
  const int tiles = cu_tiles[b + 1] - cu_tiles[b];
  const int nb = cu_blocks[b + 1] - cu_blocks[b];
  const int words = (nb + 31) / 32;
  uint32_t* prefix = bits + words;
  const int64_t seg0 = int64_t(num_kv_heads) * cu_tiles[b] + int64_t(kvh) * tiles;
  const int64_t base0 = cu_capacity[b] + int64_t(kvh) * tiles * nb;  // slice of tile 0
  for (int w = threadIdx.x; w < words; w += kUnionThreads) bits[w] = 0;
  __syncthreads();
  unsigned long long per_tile = 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int t = warp; t < tiles; t += kUnionThreads / 32) {
    const int lo = segment_start[seg0 + t], hi = segment_end[seg0 + t];
    if (lane == 0) per_tile += (unsigned long long)(hi - lo);
    for (int k = lo + lane; k < hi; k += 32) {
      const int J = block_ids[k];
      if (J >= 0 && J < nb) atomicOr(&bits[J / 32], 1u << (J % 32));
    }
  }
  __syncthreads();
  // Exclusive prefix of the words' popcounts: each thread owns a contiguous run of words.
  const int per = (words + kUnionThreads - 1) / kUnionThreads;
  const int w0 = min(words, int(threadIdx.x) * per), w1 = min(words, w0 + per);
  int mine = 0;
  for (int w = w0; w < w1; ++w) mine += __popc(bits[w]);
  scan[threadIdx.x] = mine;
  __syncthreads();
  for (int d = 1; d < kUnionThreads; d *= 2) {  // Hillis-Steele inclusive scan
    const int v = threadIdx.x >= d ? scan[threadIdx.x - d] : 0;
    __syncthreads();
    scan[threadIdx.x] += v;
    __syncthreads();
  }
  int offset = scan[threadIdx.x] - mine;
  const int total = scan[kUnionThreads - 1];
  for (int w = w0; w < w1; ++w) {
    prefix[w] = uint32_t(offset);
    uint32_t m = bits[w];
    while (m) {
      const int j = __ffs(m) - 1;
      m &= m - 1;
      block_ids[base0 + offset++] = w * 32 + j;
    }
  }
  if (threadIdx.x == 0) prefix[words] = uint32_t(total);
  __syncthreads();
  // Point every tile at the union and count the union blocks each tile sees (causal: blocks 0 .. hi(last row)/B).
  const int64_t q_len = seq.q_len(b), k_len = seq.k_len(b), off = k_len - q_len;
  unsigned long long kept = 0;
  for (int t = threadIdx.x; t < tiles; t += kUnionThreads) {
    segment_start[seg0 + t] = int32_t(base0);
    segment_end[seg0 + t] = int32_t(base0 + total);
    const int64_t rows = min(int64_t(kTileRows), q_len * group_size - int64_t(t) * kTileRows);
    const int64_t last_pos = (int64_t(t) * kTileRows + rows - 1) / group_size;
    const int64_t hi = min(k_len - 1, last_pos + off);
    const int nvis = hi >= 0 ? int(min(int64_t(nb), hi / block_size + 1)) : 0;
    const int w = nvis / 32, r = nvis % 32;
    kept += prefix[w] + (r ? __popc(bits[w] & ((1u << r) - 1u)) : 0u);
  }
  for (int o = 16; o > 0; o /= 2) {
    kept += __shfl_xor_sync(0xffffffffu, kept, o);
    per_tile += __shfl_xor_sync(0xffffffffu, per_tile, o);
  }
  if (lane == 0) {
    // kept replaces the per-tile count added by the score kernel (unsigned arithmetic wraps correctly).
    atomicAdd(&counters[0], kept - per_tile);
    atomicAdd(&counters[2], per_tile);
  }
}

struct SelectArgs {
  float alpha;
  int block_size, sink, window, last_n;
  float scale_log2;  // softmax_scale * log2(e): energies are computed with exp2
};

struct QArgs {
  const void* q;
  int64_t stride_row, stride_head;
  bool vec16;  // 16-byte aligned base and strides that are multiples of 8 elements: 16-byte copies of Q rows
};

// The scorer's tensor-core GEMM S = Q_tile . K_mean^T: the attention kernel's S GEMM shapes (two consumer
// warpgroups of 64 rows, SS wgmma 64 x 128 x 16 atoms, 128-byte-swizzled K-major tiles), with 128 pooled blocks per
// step in place of 128 keys. Q (32 KiB at D = 128) and two stages of pooled keys (2 x 32 KiB) in shared memory: ~100
// KiB per CTA, so 2 CTAs (16 warps) share an SM and one CTA's exp2 epilogue runs under the other's wgmma.
template <typename T, int D>
struct ScoreConfig {
  using Element = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, cutlass::bfloat16_t, cutlass::half_t>;
  static constexpr int kN = kScoreChunk;
  using TileShape = cute::Shape<cute::Int<kTileRows>, cute::Int<kN>, cute::Int<D>>;
  using TiledMma = decltype(cute::make_tiled_mma(cute::GMMA::ss_op_selector<Element, Element, float, TileShape>(),
                                                 cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  template <int kRows>
  using Atom = decltype(cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::K, Element,
                                                                            cute::Int<kRows>, cute::Int<D>>());
  using SmemLayoutQ =
      decltype(cute::tile_to_shape(Atom<kTileRows>{}, cute::Shape<cute::Int<kTileRows>, cute::Int<D>>{}));
  using SmemLayoutK =
      decltype(cute::tile_to_shape(Atom<kN>{}, cute::Shape<cute::Int<kN>, cute::Int<D>, cute::_2>{}));
  struct Smem {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;  // double buffer: chunk c+1 loads under c
    float partial[kScoreWarps][kN];  // each warp's column sums of a chunk, relative to its own maximum
    float warp_max[kScoreWarps];     // log2 domain; -inf: the warp saw no visible score in the chunk
    float red[kScoreWarps];
    int warp_count[kScoreWarps];
    int nan_flag;  // a NaN score in the tile: keep every visible block
  };
  // Dynamic shared memory: Smem, then energy[nb_max rounded up to 4], then chunk_max[nb_max / kN + 1].
  static size_t smem_bytes(int64_t nb_max) {
    return sizeof(Smem) + (size_t((nb_max + 3) & ~int64_t(3)) + size_t(nb_max / kN + 1)) * sizeof(float);
  }
};

// One step of the column butterfly: lanes that differ in lane bit kBit (rows 8 apart for kBit = 4 ... 32 apart for
// 16, all with the same columns) each keep half of their kBit live values, the upper half when the bit is set, and
// combine them with the partner's copy of that half: a sum (tile energies) or a max (the per-row rule's column maxima).
template <int kBit, class Combine>
__device__ __forceinline__ void butterfly_step(float (&v)[32], int lane, Combine combine) {
  const bool upper = lane & kBit;
#pragma unroll
  for (int k = 0; k < kBit; ++k) {
    const float keep = upper ? v[k + kBit] : v[k], give = upper ? v[k] : v[k + kBit];
    v[k] = combine(keep, __shfl_xor_sync(0xffffffffu, give, kBit));
  }
}
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
// max that propagates NaN (one FMNMX.NAN, the cost of fmaxf): the scorer's maxima see a NaN score (NaN policy of the
// selection, docs/semantics.md: a tile with a NaN score keeps every visible block).
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// One CTA per (tile, KV head), 2 warpgroups of 64 packed rows. Per chunk of 128 pooled blocks: wgmma S, then each
// thread's 2 rows x 32 columns give masked exp2 energies relative to the warp maximum; a butterfly over the 8 row
// groups of the warp (28 shuffles) leaves each lane 4 column sums; 128 threads combine the 8 warps after the
// chunk's barrier. The last tiles (last_n), which keep every visible block, skip the GEMM.
// kRowMax (SelectionRule::kRowMax): two passes over the chunks through the same double-buffered pipeline. Pass 1
// keeps each thread's 2 row maxima m_r (reduced over the 4 lanes of a row at its end); pass 2 recomputes the GEMM
// (no L/B x 128 score buffer: shared memory stays bounded) and takes per block C_J = max over the rows that see J
// of s_rJ - m_r (raw dot products; the scale is folded into the threshold), by a max butterfly over the warp's rows
// and a max over the 8 warps, into energy[]; keep iff C_J >= ln(alpha) / scale = log2(alpha) / scale_log2.
template <typename T, int D, bool kRowMax>
__global__ void __launch_bounds__(kScoreThreads, 2) score_select_kernel(
    SeqArgs seq, QArgs qa, SelectArgs sel, int group_size, int num_kv_heads, int kv_split, int kv_heads_mem,
    const int32_t* cu_tiles, const int32_t* cu_blocks, const int64_t* cu_capacity, const T* k_mean_lowp,
    const uint32_t* probe_bits, int64_t probe_words, int32_t* segment_start,
    int32_t* segment_end, int32_t* block_ids, unsigned long long* counters) {
  using namespace cute;
  using Cfg = ScoreConfig<T, D>;
  using Element = typename Cfg::Element;
  constexpr int kN = Cfg::kN;
  constexpr int kWarps = kScoreWarps;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& sm = *reinterpret_cast<typename Cfg::Smem*>(smem_raw);
  float* energy = reinterpret_cast<float*>(smem_raw + sizeof(typename Cfg::Smem));

  const int64_t tile_idx = blockIdx.x;
  if (tile_idx >= cu_tiles[seq.batch]) return;
  const int kvh = blockIdx.y;
  const int b = find_sequence(cu_tiles, seq.batch, tile_idx);
  const int64_t t = tile_idx - cu_tiles[b];
  const int64_t tiles = cu_tiles[b + 1] - cu_tiles[b];
  const int64_t q_len = seq.q_len(b), k_len = seq.k_len(b), off = k_len - q_len;
  const int64_t nb = cu_blocks[b + 1] - cu_blocks[b];
  const int64_t rows = min(int64_t(kTileRows), q_len * group_size - t * kTileRows);
  const int64_t first_pos = t * kTileRows / group_size, last_pos = (t * kTileRows + rows - 1) / group_size;
  const int64_t hi_first = min(k_len - 1, first_pos + off), hi_last = min(k_len - 1, last_pos + off);
  const int64_t seg = int64_t(num_kv_heads) * cu_tiles[b] + kvh * tiles + t;
  const int64_t base = cu_capacity[b] + (kvh * tiles + t) * nb;
  const int B = sel.block_size;
  const int64_t nvis = hi_last >= 0 ? hi_last / B + 1 : 0;  // blocks 0 .. nvis-1 are visible to the tile
  float* chunk_max = energy + ((nb + 3) & ~int64_t(3));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  Tensor sQ = make_tensor(make_smem_ptr(sm.q.data()), typename Cfg::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(sm.k.data()), typename Cfg::SmemLayoutK{});

  // stage_chunk(c, buf): the 128 pooled keys of chunk c into stage `buf` with cp.async (16 B each; zero-fill past
  // the last block).
  // (num_kv_heads, group_size: virtual KV heads with head sub-groups; the pooled means are per KV head in memory.)
  const Element* pooled =
      reinterpret_cast<const Element*>(k_mean_lowp) + (int64_t(cu_blocks[b]) * kv_heads_mem + kvh / kv_split) * D;
  const int pooled_row_stride = kv_heads_mem * D;  // elements between consecutive blocks' means of one KV head
  const int nb32 = int(nb);
  // Each thread copies the same 16-byte column v of rows n0, n0 + kRowsPerPass, ... of every chunk: its shared
  // addresses are fixed per stage, and the passes of the swizzled tile lie a fixed byte distance apart (whole 8-row
  // swizzle atoms), so a chunk costs kPasses copies and adds (index math per copy was ~1/3 of the loop's issue
  // slots).
  constexpr int kVec = D / 8, kRowsPerPass = kScoreThreads / kVec, kPasses = kN / kRowsPerPass;
  const int v = threadIdx.x % kVec, n0 = threadIdx.x / kVec;
  const auto smem_addr = [](const Element& e) { return static_cast<uint32_t>(__cvta_generic_to_shared(&e)); };
  const uint32_t dst0 = smem_addr(sK(n0, v * 8, 0));
  const uint32_t pass_bytes = smem_addr(sK(n0 + kRowsPerPass, v * 8, 0)) - dst0;
  const uint32_t stage_bytes = smem_addr(sK(n0, v * 8, 1)) - dst0;
  const Element* src0 = pooled + int64_t(n0) * pooled_row_stride + v * 8;
  const int64_t pass_stride = int64_t(kRowsPerPass) * pooled_row_stride;
  auto stage_chunk = [&](int c, int buf) {
    const Element* src = src0 + int64_t(c) * kN * pooled_row_stride;
    const uint32_t dst = dst0 + uint32_t(buf) * stage_bytes;
    CUTE_UNROLL
    for (int p = 0; p < kPasses; ++p) {
      const bool ok = c * kN + n0 + p * kRowsPerPass < nb32;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + p * pass_bytes),
                   "l"(ok ? src + p * pass_stride : pooled), "r"(ok ? 16 : 0));
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };

  const bool last_tile = t >= tiles - sel.last_n;
  const int nchunks = last_tile ? 0 : int((nvis + kN - 1) / kN);
  if (threadIdx.x == 0) sm.nan_flag = 0;  // read after the loop's barriers
  if (nchunks > 0) {
    // PackGQA gather of Q (packed row r: position r / g, head kvh * g + r % g) into the swizzled tile with cp.async,
    // in the same group as chunk 0, so every load is in flight at once (a load-then-store loop serialised 32 global
    // round trips per thread: ~2x slower index stage). 16-byte copies when q allows them, else 4-byte ones
    // (build_index needs only even q strides); zero-fill past the tile's rows.
    const int64_t q_start = seq.q_start(b);
    const int elems = qa.vec16 ? 8 : 2;
    const int per_row = D / elems;
    for (int i = threadIdx.x; i < kTileRows * per_row; i += kScoreThreads) {
      const int r = i / per_row, col = (i % per_row) * elems;
      const int pr = int(t) * kTileRows + min(r, int(rows) - 1);  // packed row within the sequence (Lq * g < 2^31)
      const T* src = static_cast<const T*>(qa.q) + (q_start + pr / group_size) * qa.stride_row +
                     (kvh * group_size + pr % group_size) * qa.stride_head + col;
      const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(&sQ(r, col)));
      if (qa.vec16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(r < rows ? 16 : 0));
      } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(r < rows ? 4 : 0));
      }
    }
    stage_chunk(0, 0);  // commits Q and chunk 0 as one group
  }

  typename Cfg::TiledMma mma;
  auto wg_mma = mma.get_slice((threadIdx.x / 128) * 128);
  auto thr_mma = mma.get_slice(threadIdx.x);
  Tensor tSrQ = wg_mma.partition_fragment_A(sQ);  // (MMA, MMA_M, MMA_K) descriptors
  Tensor tSrK = wg_mma.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_K, stages)
  Tensor tSrS = partition_fragment_C(mma, Shape<Int<kTileRows>, Int<kN>>{});
  Tensor S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));  // (2 rows, kN / 4 columns) of this thread
  Tensor cS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kTileRows>, Int<kN>>{}));
  Tensor cS_rc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  constexpr int kCols = decltype(size<1>(S))::value;  // 32: column c is tile column 8 (c / 2) + 2 (lane % 4) + c % 2
  static_assert(decltype(size<0>(S))::value == 2 && kCols == 32, "accumulator layout assumed by the butterfly");

  // The last block each of this thread's 2 rows sees (-1: none, or past the tile's rows); chunks that every row
  // of the tile sees whole skip the mask (causal: all but the last one or two).
  int row_last_block[2];
  for (int i = 0; i < 2; ++i) {
    const int r = get<0>(cS_rc(i, 0));
    const int64_t hi = r < rows ? min(k_len - 1, (t * kTileRows + r) / group_size + off) : -1;
    row_last_block[i] = hi >= 0 ? int(hi / B) : -1;
  }
  const int tile_min_last_block = (rows == kTileRows && hi_first >= 0) ? int(hi_first / B) : -1;

  // Steps: the chunks once (kRowMax: twice, pass 1 then pass 2); chunk c of step `step` is step % nchunks.
  const int steps = kRowMax ? 2 * nchunks : nchunks;
  float row_max[2] = {-INFINITY, -INFINITY};  // kRowMax: m_r of this thread's 2 rows (raw dot products)
  for (int step = 0; step < steps; ++step) {
    const int c = kRowMax && step >= nchunks ? step - nchunks : step;
    const int buf = step & 1;
    if (step + 1 < steps) {
      // its stage was last read by the previous step's wgmma, finished before its barrier
      stage_chunk(kRowMax && step + 1 >= nchunks ? step + 1 - nchunks : step + 1, buf ^ 1);
      asm volatile("cp.async.wait_group 1;\n" ::);
    } else {
      asm volatile("cp.async.wait_group 0;\n" ::);
    }
    cutlass::arch::fence_view_async_shared();  // cp.async and Q stores (generic proxy) -> visible to wgmma
    __syncthreads();

    wgmma_batch<false>(mma, tSrQ, tSrK(_, _, _, buf), tSrS, /*zero_init=*/true);
    warpgroup_wait<0>();

    if constexpr (kRowMax) {
      const int chunk_first = c * kN;
      const bool unmasked = chunk_first + kN - 1 <= tile_min_last_block;
      if (!unmasked) {  // -inf where the row does not see the block (or lies past the tile)
        CUTE_UNROLL
        for (int i = 0; i < 2; ++i)
          CUTE_UNROLL
          for (int k = 0; k < kCols; ++k) {
            const int J = chunk_first + 8 * (k / 2) + 2 * (lane % 4) + k % 2;
            if (J > row_last_block[i]) S(i, k) = -INFINITY;
          }
      }
      if (step < nchunks) {  // pass 1: row maxima
        CUTE_UNROLL
        for (int i = 0; i < 2; ++i)
          CUTE_UNROLL
          for (int k = 0; k < kCols; ++k) row_max[i] = fmax_nan(row_max[i], S(i, k));
        if (step == nchunks - 1) {
          if (row_max[0] != row_max[0] || row_max[1] != row_max[1]) atomicOr(&sm.nan_flag, 1);
          CUTE_UNROLL
          for (int i = 0; i < 2; ++i) {  // the 4 lanes of a quad hold one row's columns
            row_max[i] = fmaxf(row_max[i], __shfl_xor_sync(0xffffffffu, row_max[i], 1));
            row_max[i] = fmaxf(row_max[i], __shfl_xor_sync(0xffffffffu, row_max[i], 2));
            if (row_max[i] == -INFINITY) row_max[i] = 0.f;  // a row that sees nothing: its -inf scores stay -inf
          }
        }
        __syncthreads();  // every wgmma of this step is done before the next step refills the other stage
        continue;
      }
      // Pass 2: per column max over this thread's rows of s - m_r, then over the warp's 8 row groups.
      float v[kCols];
      CUTE_UNROLL
      for (int k = 0; k < kCols; ++k) v[k] = fmaxf(S(0, k) - row_max[0], S(1, k) - row_max[1]);
      butterfly_step<16>(v, lane, MaxOp{});
      butterfly_step<8>(v, lane, MaxOp{});
      butterfly_step<4>(v, lane, MaxOp{});
      {
        const int c0 = ((lane >> 4) & 1) * 16 + ((lane >> 3) & 1) * 8 + ((lane >> 2) & 1) * 4;
        const int col = 8 * (c0 / 2) + 2 * (lane % 4);
        *reinterpret_cast<float2*>(&sm.partial[warp][col]) = make_float2(v[0], v[1]);
        *reinterpret_cast<float2*>(&sm.partial[warp][col + 8]) = make_float2(v[2], v[3]);
      }
      __syncthreads();
      if (threadIdx.x < kN) {  // max over the warps: C_J of the tile (-inf: no row sees J)
        float cm = sm.partial[0][threadIdx.x];
        for (int w = 1; w < kWarps; ++w) cm = fmaxf(cm, sm.partial[w][threadIdx.x]);
        const int J = chunk_first + threadIdx.x;
        if (J < nb32) energy[J] = cm;
      }
      continue;
    }

    // Raw scores; -inf where the row does not see the block. Warp maximum (scale > 0 commutes with max; the scale
    // is folded into the exp2 argument: one FFMA per element).
    float m = -INFINITY;
    const int chunk_first = c * kN;
    if (chunk_first + kN - 1 <= tile_min_last_block) {
      CUTE_UNROLL
      for (int i = 0; i < 2; ++i)
        CUTE_UNROLL
        for (int k = 0; k < kCols; ++k) m = fmax_nan(m, S(i, k));
    } else {
      CUTE_UNROLL
      for (int i = 0; i < 2; ++i)
        CUTE_UNROLL
        for (int k = 0; k < kCols; ++k) {
          const int J = chunk_first + 8 * (k / 2) + 2 * (lane % 4) + k % 2;
          if (J > row_last_block[i]) S(i, k) = -INFINITY;
          m = fmax_nan(m, S(i, k));
        }
    }
    for (int o = 16; o > 0; o /= 2) m = fmax_nan(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0 && m != m) atomicOr(&sm.nan_flag, 1);
    const float m_log2 = m == -INFINITY ? 0.f : m * sel.scale_log2;  // exp2(-inf - 0) = 0 for masked scores
    float v[kCols];
    CUTE_UNROLL
    for (int k = 0; k < kCols; ++k)
      v[k] = fast_exp2(fmaf(S(0, k), sel.scale_log2, -m_log2)) + fast_exp2(fmaf(S(1, k), sel.scale_log2, -m_log2));
    // Butterfly over the row groups (lane bits 4, 3, 2): each step keeps half of the columns and adds the partner's
    // half, so after 16 + 8 + 4 shuffles lane holds columns c0 .. c0+3 (c0 = 16 h4 + 8 h3 + 4 h2) summed over the
    // warp's 16 rows.
    butterfly_step<16>(v, lane, SumOp{});
    butterfly_step<8>(v, lane, SumOp{});
    butterfly_step<4>(v, lane, SumOp{});
    {
      const int c0 = ((lane >> 4) & 1) * 16 + ((lane >> 3) & 1) * 8 + ((lane >> 2) & 1) * 4;
      const int col = 8 * (c0 / 2) + 2 * (lane % 4);  // columns of c0, c0+1; c0+2, c0+3 are 8 further
      *reinterpret_cast<float2*>(&sm.partial[warp][col]) = make_float2(v[0], v[1]);
      *reinterpret_cast<float2*>(&sm.partial[warp][col + 8]) = make_float2(v[2], v[3]);
    }
    if (lane == 0) sm.warp_max[warp] = m == -INFINITY ? -INFINITY : m_log2;
    __syncthreads();
    // Combine the warps: chunk maximum and energies relative to it.
    if (threadIdx.x < kN) {
      float cm = sm.warp_max[0];
      for (int w = 1; w < kWarps; ++w) cm = fmaxf(cm, sm.warp_max[w]);
      float e = 0.f;
      if (cm != -INFINITY) {
        for (int w = 0; w < kWarps; ++w) {
          if (sm.warp_max[w] != -INFINITY) e += sm.partial[w][threadIdx.x] * fast_exp2(sm.warp_max[w] - cm);
        }
      }
      const int J = chunk_first + threadIdx.x;
      if (J < nb32) energy[J] = e;
      if (threadIdx.x == 0) chunk_max[c] = cm;
    }
  }
  __syncthreads();

  float threshold;
  if constexpr (kRowMax) {
    threshold = log2f(sel.alpha) / sel.scale_log2;  // ln(alpha) / scale; alpha = 0: -inf, every visible block
  } else {
    // Rescale every chunk's energies to the tile maximum M; E_max.
    float tile_max = -INFINITY;
    for (int c = 0; c < nchunks; ++c) tile_max = fmaxf(tile_max, chunk_max[c]);
    float local_emax = 0.f;
    for (int64_t J = threadIdx.x; J < (last_tile ? 0 : nvis); J += kScoreThreads) {
      const float cm = chunk_max[J / kN];
      const float e = cm == -INFINITY ? 0.f : energy[J] * exp2f(cm - tile_max);
      energy[J] = e;
      local_emax = fmaxf(local_emax, e);
    }
    for (int o = 16; o > 0; o /= 2) local_emax = fmaxf(local_emax, __shfl_xor_sync(0xffffffffu, local_emax, o));
    __syncthreads();
    if (lane == 0) sm.red[warp] = local_emax;
    __syncthreads();
    float emax = sm.red[0];
    for (int w = 1; w < kWarps; ++w) emax = fmaxf(emax, sm.red[w]);
    threshold = sel.alpha * emax;
  }

  // Keep rules (causal): threshold, not prunable (crosses the diagonal), sink, window band, last tiles (whose
  // energies were never computed: `last_tile ||` comes first).
  const int64_t diag_first = first_pos + off, diag_last = last_pos + off;
  const int64_t band_lo = max(int64_t(0), diag_first - sel.window + 1), band_hi = min(k_len - 1, diag_last);
  const bool has_band = sel.window > 0 && diag_last >= 0;
  const bool tile_nan = sm.nan_flag != 0;  // written before the loop's last barrier (and the one after it)
  int64_t kept = 0;
  for (int64_t round = 0; round < nvis; round += kScoreThreads) {
    const int64_t J = round + threadIdx.x;
    bool keep = false;
    if (J < nvis) {
      const int64_t last_key = min((J + 1) * B, k_len) - 1;
      const bool prunable = hi_first >= 0 && last_key <= hi_first;
      keep = tile_nan || last_tile || !prunable || energy[J] >= threshold || J * B < sel.sink ||
             (has_band && J * B <= band_hi && last_key >= band_lo) ||
             (probe_bits != nullptr && ((probe_bits[seg * probe_words + J / 32] >> (J % 32)) & 1u));
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, keep);
    __syncthreads();
    if (lane == 0) sm.warp_count[warp] = __popc(ballot);
    __syncthreads();
    int64_t offset = kept;
    for (int w = 0; w < warp; ++w) offset += sm.warp_count[w];
    offset += __popc(ballot & ((1u << lane) - 1u));
    if (keep) block_ids[base + offset] = int32_t(J);
    for (int w = 0; w < kWarps; ++w) kept += sm.warp_count[w];
  }
  if (threadIdx.x == 0) {
    segment_start[seg] = int32_t(base);
    segment_end[seg] = int32_t(base + kept);
    atomicAdd(&counters[0], (unsigned long long)kept);
    atomicAdd(&counters[1], (unsigned long long)nvis);
  }
}

// SelectionRule::kProbeRowMax, the probe rows' half (the pooled-means half is the kRowMax scorer at
// kProbeMeanAlpha, which ORs these bits in): one CTA per (tile, virtual KV head). The tile's probe rows (packed rows
// of the queries i with i % kProbeStride == kProbeStride - 1 or i == q_len - 1) in batches of kProbeBatch; per batch
// every visible key block's exact log-mass per row, w_rJ = log sum_j exp(scale q_r . k_j) (float, CUDA cores: a warp
// per block, 4 keys per lane at block 128, the batch's rows against each key), kept in shared memory; then
// m_r = max_J w_rJ and J is set when w_rJ >= m_r + ln(alpha) for some row. Bits: probe_bits[seg * words + J / 32].
// Correctness first: every probe row reads all its visible keys (the tensor-core version, K shared by 8 tiles:
// docs/next_sparse_kernel.md). NaN: no bit (the scorer's NaN rule keeps the tile whole).
constexpr int kProbeThreads = 256, kProbeBatch = 16;

template <typename T, int D>
__global__ void __launch_bounds__(kProbeThreads) probe_kernel(SeqArgs seq, QArgs qa, KVArgs kv, SelectArgs sel,
                                                             int group_size, int num_kv_heads, int kv_split,
                                                             const int32_t* cu_tiles, int64_t words,
                                                             uint32_t* probe_bits) {
  extern __shared__ __align__(16) float probe_smem[];
  const int64_t tile_idx = blockIdx.x;
  if (tile_idx >= cu_tiles[seq.batch]) return;
  const int kvh = blockIdx.y;
  const int b = find_sequence(cu_tiles, seq.batch, tile_idx);
  const int64_t t = tile_idx - cu_tiles[b];
  const int64_t tiles = cu_tiles[b + 1] - cu_tiles[b];
  const int64_t q_len = seq.q_len(b), k_len = seq.k_len(b), off = k_len - q_len;
  const int64_t rows = min(int64_t(kTileRows), q_len * group_size - t * kTileRows);
  const int B = sel.block_size;
  const int64_t last_pos = (t * kTileRows + rows - 1) / group_size;
  const int64_t hi_last = min(k_len - 1, last_pos + off);
  const int64_t nvis = hi_last >= 0 ? hi_last / B + 1 : 0;
  const int64_t seg = int64_t(num_kv_heads) * cu_tiles[b] + kvh * tiles + t;
  float* qs = probe_smem;                                  // [kProbeBatch][D] the batch's q rows, times scale
  float* mass = qs + kProbeBatch * D;                      // [kProbeBatch][nvis]
  uint32_t* bits = reinterpret_cast<uint32_t*>(mass + kProbeBatch * nvis);  // [words]
  __shared__ int probe_rows[kTileRows];
  __shared__ int n_probe;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t w = threadIdx.x; w < words; w += kProbeThreads) bits[w] = 0u;
  if (threadIdx.x == 0) {
    int n = 0;
    for (int r = 0; r < rows; ++r) {
      const int64_t pos = (t * kTileRows + r) / group_size;
      if (pos % kProbeStride == kProbeStride - 1 || pos == q_len - 1) probe_rows[n++] = r;
    }
    n_probe = n;
  }
  __syncthreads();
  const float scale = sel.scale_log2 / 1.4426950408889634f;  // softmax_scale
  const float log_alpha = sel.alpha > 0.f ? logf(sel.alpha) : -INFINITY;
  const int kv_mem = kvh / kv_split;
  const T* kbase = static_cast<const T*>(kv.k);
  for (int b0 = 0; b0 < n_probe; b0 += kProbeBatch) {
    const int nr = min(kProbeBatch, n_probe - b0);
    for (int i = threadIdx.x; i < kProbeBatch * D; i += kProbeThreads) {
      const int rr = i / D, d = i % D;
      float x = 0.f;
      if (rr < nr) {
        const int pr = int(t) * kTileRows + probe_rows[b0 + rr];
        const T* src = static_cast<const T*>(qa.q) + (seq.q_start(b) + pr / group_size) * qa.stride_row +
                       (kvh * group_size + pr % group_size) * qa.stride_head;
        x = to_float(src[d]) * scale;
      }
      qs[i] = x;
    }
    __syncthreads();
    for (int64_t J = warp; J < nvis; J += kProbeThreads / 32) {
      float acc[kProbeBatch][4];
#pragma unroll
      for (int rr = 0; rr < kProbeBatch; ++rr)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[rr][c] = -INFINITY;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        for (int64_t j = J * B + c * 32 + lane; j < min((J + 1) * B, k_len); j += 4 * 32) {
          int64_t ko;
          if (kv.block_table) {
            const int64_t page = kv.page(b, j);
            if (page < 0) continue;
            ko = page * kv.k_stride[0] + (j % kv.page_size) * kv.k_stride[1] + kv_mem * kv.k_stride[2];
          } else {
            ko = (seq.k_start(b) + j) * kv.k_stride[0] + kv_mem * kv.k_stride[1];
          }
          float dot[kProbeBatch];
#pragma unroll
          for (int rr = 0; rr < kProbeBatch; ++rr) dot[rr] = 0.f;
          for (int d = 0; d < D; ++d) {
            const float kd = to_float(kbase[ko + d]);
#pragma unroll
            for (int rr = 0; rr < kProbeBatch; ++rr) dot[rr] = fmaf(qs[rr * D + d], kd, dot[rr]);
          }
#pragma unroll
          for (int rr = 0; rr < kProbeBatch; ++rr) {
            const int64_t pos = rr < nr ? (t * kTileRows + probe_rows[b0 + rr]) / group_size : -1;
            const bool sees = rr < nr && j <= pos + off;  // causal, bottom-right
            // log-sum-exp over this lane's keys of the block (several keys per lane when B > 128)
            const float x = sees ? dot[rr] : -INFINITY;
            const float m = fmaxf(acc[rr][c], x);
            acc[rr][c] = m == -INFINITY ? -INFINITY : m + logf(expf(acc[rr][c] - m) + expf(x - m));
          }
        }
      }
#pragma unroll
      for (int rr = 0; rr < kProbeBatch; ++rr) {
        if (rr >= nr) break;
        float v = acc[rr][0];
#pragma unroll
        for (int c = 1; c < 4; ++c) {
          const float m = fmaxf(v, acc[rr][c]);
          v = m == -INFINITY ? -INFINITY : m + logf(expf(v - m) + expf(acc[rr][c] - m));
        }
        for (int o = 16; o > 0; o /= 2) {
          const float y = __shfl_xor_sync(0xffffffffu, v, o);
          const float m = fmaxf(v, y);
          v = m == -INFINITY ? -INFINITY : m + logf(expf(v - m) + expf(y - m));
        }
        if (lane == 0) mass[rr * nvis + J] = v;
      }
    }
    __syncthreads();
    // the row-max test of the batch's rows: warp w takes rows w, w + 8
    for (int rr = warp; rr < nr; rr += kProbeThreads / 32) {
      float m = -INFINITY;
      for (int64_t J = lane; J < nvis; J += 32) m = fmaxf(m, mass[rr * nvis + J]);
      for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      if (m == -INFINITY || m != m) continue;  // sees nothing, or NaN (the scorer's NaN rule)
      for (int64_t J = lane; J < nvis; J += 32) {
        const float w = mass[rr * nvis + J];
        if (w != -INFINITY && w - m >= log_alpha) atomicOr(&bits[J / 32], 1u << (J % 32));
      }
    }
    __syncthreads();
  }
  for (int64_t w = threadIdx.x; w < words; w += kProbeThreads) probe_bits[seg * words + w] = bits[w];
}

// The scorer's dynamic shared memory limit: the opt-in maximum of an sm_90 CTA (227 KB).
constexpr int kScoreSmemMax = 227 * 1024;

struct Bounds {
  int64_t max_tiles, max_blocks, max_segments, capacity, nb_max;
  int64_t probe_words;  // SelectionRule::kProbeRowMax: words of each segment's probe bitmap (else 0)
  bool split;  // the attention launch over this index may be split (split_planned): carve the split arrays
};

// The index's heads: with head sub-groups S, tiles and segments are over Hkv * S virtual KV heads of g / S query
// heads each (sparse.h); pooling and the pooled means stay per KV head in memory (virtual head v reads head v / S).
struct IndexHeads {
  int kv;     // virtual KV heads: Hkv * S
  int group;  // query heads per virtual KV head: g / S
  int split;  // S
};
IndexHeads index_heads(int num_kv_heads, int group_size, int head_subgroups) {
  return {num_kv_heads * head_subgroups, group_size / head_subgroups, head_subgroups};
}
IndexHeads index_heads(const Problem& p, int head_subgroups) {
  return index_heads(p.num_kv_heads, p.group_size, head_subgroups);
}

// Workspace bounds from the shapes the index is bound to (no device reads): the layout of a device index is a
// function of its binding and parameters alone, so sparse_attention and to_host re-carve the same pointers.
Bounds bounds_of(const IndexBinding& b, const SelectionParams& params) {
  const IndexHeads h = index_heads(b.num_kv_heads, b.num_q_heads / b.num_kv_heads, params.head_subgroups);
  const int block_size = params.block_size;
  Bounds bd;
  bd.max_tiles = b.total_q * h.group / kTileRows + b.batch;
  bd.nb_max = (b.max_seqlen_k + block_size - 1) / block_size;
  bd.max_blocks = int64_t(b.batch) * bd.nb_max;
  if (!b.paged) bd.max_blocks = std::min(bd.max_blocks, b.total_k / block_size + b.batch);
  bd.max_segments = int64_t(h.kv) * bd.max_tiles;
  bd.capacity = bd.max_segments * bd.nb_max;
  bd.probe_words = params.rule == SelectionRule::kProbeRowMax ? (bd.nb_max + 31) / 32 : 0;
  bd.split = split_planned(b.split_kv, b.max_seqlen_q, b.max_seqlen_k);
  return bd;
}

// Carves the workspace; with base == nullptr only sums the sizes.
size_t carve(const IndexBinding& b, const Bounds& bd, char* base, DeviceIndex* idx) {
  WorkspaceCarver ws(base);
  auto take = [&](size_t bytes) { return ws.take(bytes); };
  const size_t pooled = size_t(bd.max_blocks) * b.num_kv_heads * b.head_dim;
  DeviceIndex d;
  d.segment_start = reinterpret_cast<int32_t*>(take(bd.max_segments * 4));
  d.segment_end = reinterpret_cast<int32_t*>(take(bd.max_segments * 4));
  d.block_ids = reinterpret_cast<int32_t*>(take(bd.capacity * 4));
  d.cu_blocks = reinterpret_cast<int32_t*>(take((b.batch + 1) * 4));
  d.cu_tiles = reinterpret_cast<int32_t*>(take((b.batch + 1) * 4));
  d.cu_capacity = reinterpret_cast<int64_t*>(take((b.batch + 1) * 8));
  d.k_mean = reinterpret_cast<float*>(take(pooled * 4));
  d.v_mean = reinterpret_cast<float*>(take(pooled * 4));
  d.k_mean_lowp = take(pooled * 2);
  d.v_mean_lowp = take(pooled * 2);
  d.counters = reinterpret_cast<unsigned long long*>(take(32));
  if (bd.probe_words) {
    d.probe_bits = reinterpret_cast<uint32_t*>(take(size_t(bd.max_segments * bd.probe_words) * 4));
    d.probe_words = bd.probe_words;
  }
  const int sms = num_sms();
  char* launch = take(sparse_launch_workspace_bytes(sms, b.head_dim, bd.split));
  if (base) d.launch = carve_sparse_launch_workspace(launch, sms, b.head_dim, bd.split);
  if (idx) *idx = d;
  return ws.bytes();
}

SeqArgs seq_args(const AttentionInputs& in, const Problem& p) {
  return SeqArgs{in.cu_seqlens_q.ptr<const int32_t>(), p.paged ? nullptr : in.cu_seqlens_k->ptr<const int32_t>(),
                 p.paged ? in.seqused_k->ptr<const int32_t>() : nullptr, p.batch};
}

template <typename T, int D, bool kRowMax>
void launch_score(dim3 grid, size_t dyn_smem, cudaStream_t stream, const SeqArgs& seq, const QArgs& qa,
                  const SelectArgs& sel, const IndexHeads& heads, int kv_heads_mem, const DeviceIndex& d) {
  auto kernel = score_select_kernel<T, D, kRowMax>;
  // Up to ~200 KB of dynamic shared memory, past the 48 KB default, and all of the unified L1 as shared memory so
  // that two ~100 KB CTAs fit on an SM (the default carve-out may leave room for one). Set once per instantiation
  // with the largest size the scorer takes (attributes are not stream operations; no per-call host cost).
  static const cudaError_t attr = [&] {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kScoreSmemMax);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
    return e;
  }();
  check_cuda(attr, "cudaFuncSetAttribute(score_select_kernel)");
  kernel<<<grid, kScoreThreads, dyn_smem, stream>>>(seq, qa, sel, heads.group, heads.kv, heads.split, kv_heads_mem,
                                                    d.cu_tiles,
                                                    d.cu_blocks, d.cu_capacity, static_cast<const T*>(d.k_mean_lowp),
                                                    d.probe_bits, d.probe_words, d.segment_start, d.segment_end,
                                                    d.block_ids, d.counters);
}

}  // namespace

size_t index_workspace_bytes(const AttentionInputs& in, const Problem& p, const SelectionParams& params) {
  const IndexBinding b = bind_index(in, p, params);
  return carve(b, bounds_of(b, params), nullptr, nullptr);
}

DeviceIndex carve_index(const IndexBinding& b, const SelectionParams& params, void* workspace) {
  const Bounds bd = bounds_of(b, params);
  DeviceIndex d;
  const size_t bytes = carve(b, bd, static_cast<char*>(workspace), &d);
  d.workspace_bytes = bytes;
  d.block_size = params.block_size;
  d.correction = params.correction;
  d.max_segments = bd.max_segments;
  d.max_blocks = bd.max_blocks;
  d.capacity = bd.capacity;
  d.head_subgroups = params.head_subgroups;
  return d;
}

DeviceIndex build_index(const AttentionInputs& in, const Problem& p, const SelectionParams& params, void* workspace,
                        size_t workspace_bytes, const MeanCache* mean_cache) {
  if (!in.causal || in.window_left >= 0 || in.window_right >= 0) {
    throw NotImplementedError("build_index on CUDA supports causal attention without an attention window only");
  }
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) {
    throw NotImplementedError(std::string("build_index on CUDA supports bfloat16 and float16 inputs, got ") +
                              dtype_name(p.dtype));
  }
  if ((in.q.stride[0] | in.q.stride[1]) & 1 || reinterpret_cast<uintptr_t>(in.q.data) % 4) {
    throw NotImplementedError("build_index on CUDA needs even q strides and a 4-byte aligned q");
  }
  const IndexHeads heads = index_heads(p, params.head_subgroups);
  const IndexBinding binding = bind_index(in, p, params);
  const Bounds bd = bounds_of(binding, params);
  if (bd.capacity >= (int64_t(1) << 31)) {
    throw NotImplementedError("build_index on CUDA: index capacity exceeds 2^31 block ids for these shapes");
  }
  const size_t need = carve(binding, bd, nullptr, nullptr);
  if (workspace == nullptr || workspace_bytes < need) {
    throw ArgumentError("workspace", "needs " + std::to_string(need) + " bytes (index_workspace_bytes), got " +
                                         std::to_string(workspace_bytes));
  }
  const DeviceIndex d = carve_index(binding, params, workspace);

  cudaStream_t stream = static_cast<cudaStream_t>(in.stream);
  const SeqArgs seq = seq_args(in, p);
  plan_kernel<<<1, 1, 0, stream>>>(seq, seq_limits(in, p), device_error_word(), heads.group, params.block_size,
                                   heads.kv, d.cu_tiles, d.cu_blocks, d.cu_capacity, d.counters);
  check_cuda(cudaGetLastError(), "plan_kernel launch");

  KVArgs kv{};
  kv.k = in.k.data;
  kv.v = in.v.data;
  for (int i = 0; i < 3; ++i) {
    kv.k_stride[i] = in.k.stride[i];
    kv.v_stride[i] = in.v.stride[i];
  }
  if (p.paged) {
    kv.block_table = in.block_table->ptr<const int32_t>();
    kv.bt_stride0 = in.block_table->stride[0];
    kv.bt_stride1 = in.block_table->stride[1];
    kv.page_size = p.page_size;
    kv.num_pages = p.num_pages;
  }
  kv.err = device_error_word();
  MeanCacheArgs cache;
  if (mean_cache != nullptr) {
    if (!p.paged) throw ArgumentError("mean_cache", "needs a paged KV cache (block_table and seqused_k)");
    cache.k = mean_cache->k_mean.ptr<float>();
    cache.v = mean_cache->v_mean.ptr<float>();
    cache.slots_per_page = p.page_size >= params.block_size ? int(p.page_size / params.block_size) : 1;
    cache.chunk_blocks = int((in.max_seqlen_q + params.block_size - 1) / params.block_size + 1);
  }
  // Pooling CTAs: one per (pooled row, KV head), or with the cache per (block the chunk touches, KV head).
  const int64_t pool_rows = cache.chunk_blocks > 0 ? int64_t(p.batch) * cache.chunk_blocks : bd.max_blocks;
  // 16-byte loads need 16-byte aligned K/V rows: bases and row/page/head strides multiples of 8 elements.
  bool vec_ok = (reinterpret_cast<uintptr_t>(in.k.data) % 16 == 0) && (reinterpret_cast<uintptr_t>(in.v.data) % 16 == 0);
  for (int i = 0; i < (p.paged ? 3 : 2); ++i) vec_ok = vec_ok && in.k.stride[i] % 8 == 0 && in.v.stride[i] % 8 == 0;
  if (cache.k != nullptr && bd.max_blocks > 0) {
    const int64_t units = bd.max_blocks * p.num_kv_heads * (p.head_dim / 4);
    const int grid = int(std::min<int64_t>((units + 255) / 256, int64_t(num_sms()) * 8));
    auto launch = [&](auto tag) {
      using T = decltype(tag);
      copy_cached_means_kernel<T><<<grid, 256, 0, stream>>>(seq, kv, cache, params.block_size, p.num_kv_heads,
                                                            p.head_dim, bd.max_blocks, d.cu_blocks, d.k_mean,
                                                            d.v_mean, static_cast<T*>(d.k_mean_lowp),
                                                            static_cast<T*>(d.v_mean_lowp));
    };
    if (p.dtype == DType::kBFloat16) launch(__nv_bfloat16{});
    else launch(__half{});
    check_cuda(cudaGetLastError(), "copy_cached_means_kernel launch");
  }
  if (pool_rows > 0 && vec_ok) {
    const dim3 grid(unsigned(pool_rows), unsigned(p.num_kv_heads));
    auto launch = [&](auto tag, auto dim) {
      using T = decltype(tag);
      pool_vec_kernel<T, decltype(dim)::value><<<grid, 128, 0, stream>>>(
          seq, kv, cache, params.block_size, p.num_kv_heads, d.cu_blocks, d.k_mean, d.v_mean,
          static_cast<T*>(d.k_mean_lowp), static_cast<T*>(d.v_mean_lowp));
    };
    using D64 = std::integral_constant<int, 64>;
    using D128 = std::integral_constant<int, 128>;
    if (p.dtype == DType::kBFloat16) {
      p.head_dim == 128 ? launch(__nv_bfloat16{}, D128{}) : launch(__nv_bfloat16{}, D64{});
    } else {
      p.head_dim == 128 ? launch(__half{}, D128{}) : launch(__half{}, D64{});
    }
    check_cuda(cudaGetLastError(), "pool_vec_kernel launch");
  } else if (pool_rows > 0) {
    const dim3 grid(unsigned(pool_rows), unsigned(p.num_kv_heads));
    const int threads = std::min(p.head_dim, kPoolThreadsMax);
    if (p.dtype == DType::kBFloat16) {
      pool_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(seq, kv, cache, params.block_size, p.num_kv_heads,
                                                                p.head_dim, d.cu_blocks, d.k_mean, d.v_mean,
                                                                static_cast<__nv_bfloat16*>(d.k_mean_lowp),
                                                                static_cast<__nv_bfloat16*>(d.v_mean_lowp));
    } else {
      pool_kernel<__half><<<grid, threads, 0, stream>>>(seq, kv, cache, params.block_size, p.num_kv_heads, p.head_dim,
                                                         d.cu_blocks, d.k_mean, d.v_mean,
                                                         static_cast<__half*>(d.k_mean_lowp),
                                                         static_cast<__half*>(d.v_mean_lowp));
    }
    check_cuda(cudaGetLastError(), "pool_kernel launch");
  }
  if (bd.max_tiles > 0) {
    const bool q_vec16 = reinterpret_cast<uintptr_t>(in.q.data) % 16 == 0 && in.q.stride[0] % 8 == 0 &&
                         in.q.stride[1] % 8 == 0;
    const QArgs qa{in.q.data, in.q.stride[0], in.q.stride[1], q_vec16};
    const SelectArgs sel{params.alpha, params.block_size, params.sink, params.window,
                         params.final_chunk ? params.last_n : 0,
                         float(p.softmax_scale * 1.4426950408889634)};
    const dim3 grid(unsigned(bd.max_tiles), unsigned(heads.kv));
    const bool bf16 = p.dtype == DType::kBFloat16;
    auto launch = [&](auto tag, auto dim) {
      using T = decltype(tag);
      constexpr int kD = decltype(dim)::value;
      const size_t dyn_smem = ScoreConfig<T, kD>::smem_bytes(bd.nb_max);
      if (dyn_smem > size_t(kScoreSmemMax)) {  // energies of every visible block stay in shared memory: ~3.2M keys at block 128
        throw NotImplementedError("build_index on CUDA: " + std::to_string(bd.nb_max) +
                                  " blocks per sequence exceed the scorer's shared memory (max_seqlen_k too long)");
      }
      if (params.rule == SelectionRule::kProbeRowMax) {
        // the probe rows' bits at alpha, then the pooled-means row max at kProbeMeanAlpha ORs them in
        const size_t probe_smem = size_t(kProbeBatch * kD + kProbeBatch * bd.nb_max + bd.probe_words) * 4;
        auto probe = probe_kernel<T, kD>;
        // the device's opt-in limit less the kernel's 1 KB of static shared memory (227 KB alone is refused)
        static const size_t probe_limit = [&] {
          cudaFuncAttributes fa{};
          int dev = 0, optin = 0;
          check_cuda(cudaFuncGetAttributes(&fa, probe), "cudaFuncGetAttributes(probe_kernel)");
          check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
          check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
                     "cudaDeviceGetAttribute(max shared memory per block)");
          const size_t limit = size_t(optin) - fa.sharedSizeBytes;
          check_cuda(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, int(limit)),
                     "cudaFuncSetAttribute(probe_kernel)");
          return limit;
        }();
        if (probe_smem > probe_limit)
          throw NotImplementedError("build_index on CUDA: rule='probe_row_max' supports up to " +
                                    std::to_string((probe_limit / 4 - kProbeBatch * kD) / (kProbeBatch + 1)) +
                                    " blocks per sequence");
        probe<<<grid, kProbeThreads, probe_smem, stream>>>(seq, qa, kv, sel, heads.group, heads.kv, heads.split,
                                                           d.cu_tiles, d.probe_words, d.probe_bits);
        check_cuda(cudaGetLastError(), "probe_kernel launch");
        SelectArgs mean_sel = sel;
        mean_sel.alpha = kProbeMeanAlpha;
        launch_score<T, kD, true>(grid, dyn_smem, stream, seq, qa, mean_sel, heads, p.num_kv_heads, d);
      } else if (params.rule == SelectionRule::kRowMax) {
        launch_score<T, kD, true>(grid, dyn_smem, stream, seq, qa, sel, heads, p.num_kv_heads, d);
      } else {
        launch_score<T, kD, false>(grid, dyn_smem, stream, seq, qa, sel, heads, p.num_kv_heads, d);
      }
    };
    using D64 = std::integral_constant<int, 64>;
    using D128 = std::integral_constant<int, 128>;
    if (p.head_dim == 128) {
      bf16 ? launch(__nv_bfloat16{}, D128{}) : launch(__half{}, D128{});
    } else {
      bf16 ? launch(__nv_bfloat16{}, D64{}) : launch(__half{}, D64{});
    }
    check_cuda(cudaGetLastError(), "score_select_kernel launch");
  }
  if (params.union_lists && bd.max_tiles > 0) {
    const size_t dyn = size_t(2 * ((bd.nb_max + 31) / 32) + 1) * 4;
    if (dyn > 48 * 1024) throw NotImplementedError("build_index on CUDA: union mode supports up to 393216 blocks");
    union_kernel<<<dim3(unsigned(p.batch), unsigned(heads.kv)), kUnionThreads, dyn, stream>>>(
        seq, heads.group, params.block_size, heads.kv, d.cu_tiles, d.cu_blocks, d.cu_capacity,
        d.segment_start, d.segment_end, d.block_ids, d.counters);
    check_cuda(cudaGetLastError(), "union_kernel launch");
  }
  return d;
}

void prepare_index_view(const AttentionInputs& in, const Problem& p, const BlockIndexView& view, int32_t* cu_tiles,
                        void* k_lowp, void* v_lowp) {
  cudaStream_t stream = static_cast<cudaStream_t>(in.stream);
  const int64_t rows = view.correction ? view.k_mean.shape[0] : 0;
  const int64_t n = rows * p.num_kv_heads * p.head_dim;
  const int grid = int(std::min<int64_t>(std::max<int64_t>((n + 255) / 256, 1), 4096));
  // With head sub-groups S the view's means are over Hkv * S virtual heads (virtual head h * S + s holds the means of
  // KV head h): the kernel's copies are per KV head, read from virtual head h * S (head stride x S).
  const int S = view.head_subgroups;
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    prepare_view_kernel<T><<<grid, 256, 0, stream>>>(
        seq_args(in, p), seq_limits(in, p), p.batch, p.group_size / S, cu_tiles,
        rows ? view.k_mean.ptr<const float>() : nullptr, rows ? view.v_mean.ptr<const float>() : nullptr,
        view.k_mean.stride[0], view.k_mean.stride[1] * S, view.v_mean.stride[0], view.v_mean.stride[1] * S, rows,
        p.num_kv_heads, p.head_dim, static_cast<T*>(k_lowp), static_cast<T*>(v_lowp));
  };
  if (p.dtype == DType::kBFloat16) launch(__nv_bfloat16{});
  else launch(__half{});
  check_cuda(cudaGetLastError(), "prepare_view_kernel launch");
}

BlockIndex download_index(const DeviceIndex& d, const IndexBinding& b, const SelectionParams& params, void* stream_) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  check_cuda(cudaStreamSynchronize(stream), "build_index");
  auto download = [&](const void* src, size_t n_bytes, void* dst) {
    if (n_bytes) check_cuda(cudaMemcpy(dst, src, n_bytes, cudaMemcpyDeviceToHost), "cudaMemcpy(index)");
  };
  const int batch = b.batch, D = b.head_dim, hkv = b.num_kv_heads;
  std::vector<int32_t> cu_tiles(batch + 1);
  std::vector<int64_t> cu_capacity(batch + 1);
  unsigned long long counters[2] = {0, 0};
  BlockIndex idx;
  const IndexHeads heads = index_heads(hkv, b.num_q_heads / hkv, params.head_subgroups);
  idx.binding = b;
  idx.block_size = params.block_size;
  idx.group_size = heads.group;
  idx.num_kv_heads = heads.kv;
  idx.head_subgroups = heads.split;
  idx.head_dim = D;
  idx.correction = params.correction;
  idx.cu_blocks.resize(batch + 1);
  download(d.cu_tiles, cu_tiles.size() * 4, cu_tiles.data());
  download(d.cu_capacity, cu_capacity.size() * 8, cu_capacity.data());
  download(d.cu_blocks, idx.cu_blocks.size() * 4, idx.cu_blocks.data());
  download(d.counters, sizeof(counters), counters);
  const size_t segments = size_t(cu_tiles[batch]) * heads.kv;
  std::vector<int32_t> start(segments), end(segments), ids(static_cast<size_t>(cu_capacity[batch]));
  download(d.segment_start, segments * 4, start.data());
  download(d.segment_end, segments * 4, end.data());
  download(d.block_ids, ids.size() * 4, ids.data());
  idx.segment_start.resize(segments);
  idx.segment_end.resize(segments);
  for (size_t s = 0; s < segments; ++s) {  // compact the in-place slices into one dense CSR
    if (s > 0 && start[s] == start[s - 1] && end[s] == end[s - 1]) {  // a shared (union) list stays shared
      idx.segment_start[s] = idx.segment_start[s - 1];
      idx.segment_end[s] = idx.segment_end[s - 1];
      continue;
    }
    idx.segment_start[s] = int32_t(idx.block_ids.size());
    idx.block_ids.insert(idx.block_ids.end(), ids.begin() + start[s], ids.begin() + end[s]);
    idx.segment_end[s] = int32_t(idx.block_ids.size());
  }
  const size_t pooled = size_t(idx.cu_blocks[batch]) * hkv * D;
  std::vector<float> km(pooled), vm(pooled);
  download(d.k_mean, pooled * 4, km.data());
  download(d.v_mean, pooled * 4, vm.data());
  if (heads.split == 1) {
    idx.k_mean = std::move(km);
    idx.v_mean = std::move(vm);
  } else {  // the index's means are over virtual heads: head h * S + s repeats KV head h
    const size_t rows = size_t(idx.cu_blocks[batch]);
    idx.k_mean.resize(pooled * heads.split);
    idx.v_mean.resize(pooled * heads.split);
    for (size_t r = 0; r < rows; ++r)
      for (int v = 0; v < heads.kv; ++v) {
        const size_t src = (r * hkv + v / heads.split) * D, dst = (r * heads.kv + v) * D;
        std::copy(km.begin() + src, km.begin() + src + D, idx.k_mean.begin() + dst);
        std::copy(vm.begin() + src, vm.begin() + src + D, idx.v_mean.begin() + dst);
      }
  }
  idx.kept_blocks = int64_t(counters[0]);
  idx.visible_blocks = int64_t(counters[1]);
  return idx;
}

std::pair<int64_t, int64_t> download_counts(const DeviceIndex& d, void* stream) {
  unsigned long long counters[2] = {0, 0};
  check_cuda(cudaMemcpyAsync(counters, d.counters, sizeof(counters), cudaMemcpyDeviceToHost,
                             static_cast<cudaStream_t>(stream)),
             "cudaMemcpyAsync(index counts)");
  check_cuda(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "index counts");
  return {int64_t(counters[0]), int64_t(counters[1])};
}

BlockIndex build_index_to_host(const AttentionInputs& in, const Problem& p, const SelectionParams& params) {
  const size_t bytes = index_workspace_bytes(in, p, params);
  void* ws = nullptr;
  check_cuda(cudaMalloc(&ws, bytes), "cudaMalloc(index workspace)");
  struct Free {
    void* ptr;
    ~Free() { cudaFree(ptr); }
  } free_ws{ws};
  const DeviceIndex d = build_index(in, p, params, ws, bytes);
  return download_index(d, bind_index(in, p, params), params, in.stream);
}

}  // namespace sparse_prefill::cuda
