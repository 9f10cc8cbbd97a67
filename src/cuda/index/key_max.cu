// Index stage, the key_max rule (SelectionRule::kKeyMax, docs/design/key_max_spec.md): per-key block maxima on a
// low-rank projection of each key's deviation from its block mean, on tensor cores. Four kernels on the stage's
// stream, after the pooling, no host synchronisation:
//   key_moment_kernel   C = sum x x^T over the residuals x = k - k_mean of the sampled blocks (core/key_basis.h), per
//                       (sequence, KV head), in float32, each CTA a band of 8 rows of C (a fixed summation order: the
//                       same basis on every run);
//   key_basis_kernel    P = kKeyBasisIters steps of subspace iteration from the hash start, one CTA per (sequence,
//                       KV head);
//   key_project_kernel  K' = P^T x for every key in fp16 (the residual GEMM's B operand), zero past the keys;
//   key_max_kernel      per (tile, virtual KV head): the bound b_r over the blocks each row sees whole, then one pass
//                       from the diagonal down to block 0: the pooled score (bf16 / fp16 wgmma, float accumulators)
//                       plus the residual block maximum (fp16 wgmma with fp16 accumulators: two (row, key) pairs per
//                       packed max, half the ALU work of float maxima), the running row maximum and the per-row
//                       test; the tile's keep bits go to d.probe_bits, which score_select's bits-only kernel merges
//                       with the always-kept rules into the CSR (as the probe rules' bits).
// Scores are in log2 units: Q' carries softmax_scale * log2(e), the pooled scores are scaled on their way to shared
// memory, so the test is sh - m >= log2(alpha).
#include <cmath>
#include <string>
#include <type_traits>

#include "core/key_basis.h"
#include "cuda/attention/config.h"  // CuTe / CUTLASS: GMMA atoms, swizzled K-major smem atoms, proxy fence
#include "cuda/common/check.h"
#include "cuda/common/device_info.h"
#include "cuda/common/wgmma.h"
#include "cuda/index/device_args.cuh"
#include "cuda/index/q_gather.cuh"

namespace sparse_prefill::cuda::index_stage {
namespace {

constexpr int kMomentBand = 8;      // rows of C per moment CTA
constexpr int kMomentKeys = 64;     // keys per shared-memory tile of the moment CTA (block_size % 64 == 0)
constexpr int kBasisThreads = 256;
constexpr int kProjectThreads = 256;
constexpr int kKeyMaxThreads = 256;  // 2 warpgroups x 64 packed rows
constexpr int kKeyMaxWarps = kKeyMaxThreads / 32;
constexpr int kUnitKeys = 64;        // keys per residual wgmma (N): any block_size % 64 == 0 is whole units
constexpr int kStageUnits = 8;       // units per K' stage (512 keys), double-buffered
constexpr int kPooledN = 32;         // pooled blocks per pooled wgmma (N)

// Key j of sequence b at KV head h as float (FP8: times its descale); 0 for a key on a bad page (reported).
template <typename T>
__device__ __forceinline__ const T* key_row(const KVArgs& kv, const SeqArgs& seq, int b, int h, int64_t j) {
  if (kv.block_table) {
    const int64_t page = kv.page(b, j);
    if (page < 0) return nullptr;
    return static_cast<const T*>(kv.k) + page * kv.k_stride[0] + geometry::page_slot(j, kv.page_size) * kv.k_stride[1] +
           h * kv.k_stride[2];
  }
  return static_cast<const T*>(kv.k) + (seq.k_start(b) + j) * kv.k_stride[0] + h * kv.k_stride[1];
}

// ---- 1. the residuals' second moment --------------------------------------------------------------------------------
// grid (batch, Hkv, D / kMomentBand), D threads: thread e accumulates C[d0 + i][e], i < kMomentBand, over the sampled
// keys in order, tiles of kMomentKeys residuals through shared memory. The next tile's keys are loaded into registers
// while the current one is summed (all kMomentKeys loads of a thread in flight at once: the first version waited for
// each key's load in turn, ~6.5 ms for the 8K sampled keys of every length on the H100).
template <typename T, int D>
__global__ void __launch_bounds__(D) key_moment_kernel(SeqArgs seq, KVArgs kv, int block_size, int num_kv_heads,
                                                       const int32_t* cu_blocks, const float* k_mean, float* moment) {
  __shared__ __align__(16) float xs[kMomentKeys][D + 4];  // rows 16-byte aligned: the band is read as float4
  const int b = blockIdx.x, h = blockIdx.y, d0 = blockIdx.z * kMomentBand, e = threadIdx.x;
  const int64_t k_len = seq.k_len(b), nb = cu_blocks[b + 1] - cu_blocks[b];
  const int64_t stride = key_basis_stride(nb);
  const float descale = is_fp8_v<T> ? kv.k_descale.at(b, h) : 1.f;
  // the sampled keys as a flat sequence of tiles: tile i holds keys [j0, j0 + n) of one sampled block (block_size is
  // a multiple of kMomentKeys, so a tile never spans two blocks)
  const int64_t sampled = (nb + stride - 1) / stride, tiles_per_block = block_size / kMomentKeys;
  const int64_t tiles = sampled * tiles_per_block;
  auto tile_keys = [&](int64_t i, int64_t& J, int64_t& j0, int& n) {
    J = (i / tiles_per_block) * stride;
    j0 = J * block_size + (i % tiles_per_block) * kMomentKeys;
    n = int(max(int64_t(0), min(int64_t(kMomentKeys), k_len - j0)));
  };
  float vals[kMomentKeys];
  auto load_tile = [&](int64_t i) {
    int64_t J, j0;
    int n;
    tile_keys(i, J, j0, n);
#pragma unroll
    for (int k = 0; k < kMomentKeys; ++k) {
      const T* row = k < n ? key_row<T>(kv, seq, b, h, j0 + k) : nullptr;
      vals[k] = row ? to_float(row[e]) : 0.f;
    }
  };
  float acc[kMomentBand] = {};
  if (tiles > 0) load_tile(0);
  for (int64_t i = 0; i < tiles; ++i) {
    int64_t J, j0;
    int n;
    tile_keys(i, J, j0, n);
    const float kbar = k_mean[((int64_t(cu_blocks[b]) + J) * num_kv_heads + h) * D + e];
    __syncthreads();  // the previous tile's readers done
#pragma unroll
    for (int k = 0; k < kMomentKeys; ++k) xs[k][e] = k < n ? vals[k] * descale - kbar : 0.f;
    __syncthreads();
    if (i + 1 < tiles) load_tile(i + 1);  // in flight during the sums below
    for (int k = 0; k < n; ++k) {
      const float xe = xs[k][e];
#pragma unroll
      for (int r = 0; r < kMomentBand; r += 4) {
        const float4 x4 = *reinterpret_cast<const float4*>(&xs[k][d0 + r]);
        acc[r] = fmaf(x4.x, xe, acc[r]);
        acc[r + 1] = fmaf(x4.y, xe, acc[r + 1]);
        acc[r + 2] = fmaf(x4.z, xe, acc[r + 2]);
        acc[r + 3] = fmaf(x4.w, xe, acc[r + 3]);
      }
    }
  }
  float* c = moment + (int64_t(b) * num_kv_heads + h) * D * D;
#pragma unroll
  for (int r = 0; r < kMomentBand; ++r) c[(d0 + r) * D + e] = acc[r];
}

// ---- 2. the basis: subspace iteration -------------------------------------------------------------------------------
// One CTA per (sequence, KV head): C in shared memory, X <- MGS(C X) kKeyBasisIters times from X0 = hash_unit; the
// Gram-Schmidt by warp 0 (R columns in order, each against the columns before it).
template <int D, int R>
__global__ void __launch_bounds__(kBasisThreads) key_basis_kernel(int num_kv_heads, const float* moment, float* basis) {
  extern __shared__ float basis_smem[];
  float* C = basis_smem;        // [D][D]
  float* X = C + D * D;         // [D][R]
  float* Y = X + D * R;         // [D][R]
  const int b = blockIdx.x, h = blockIdx.y;
  const float* c = moment + (int64_t(b) * num_kv_heads + h) * D * D;
  for (int i = threadIdx.x; i < D * D; i += kBasisThreads) C[i] = c[i];
  for (int i = threadIdx.x; i < D * R; i += kBasisThreads) X[i] = hash_unit(uint32_t(i / R), uint32_t(i % R));
  __syncthreads();
  for (int it = 0; it < kKeyBasisIters; ++it) {
    for (int i = threadIdx.x; i < D * R; i += kBasisThreads) {
      const int d = i / R, col = i % R;
      float y = 0.f;
      for (int e2 = 0; e2 < D; ++e2) y = fmaf(C[d * D + e2], X[e2 * R + col], y);
      Y[i] = y;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      constexpr int kPer = D / 32;
      for (int col = 0; col < R; ++col) {
        float y[kPer];
#pragma unroll
        for (int k = 0; k < kPer; ++k) y[k] = Y[(lane + 32 * k) * R + col];
        for (int prev = 0; prev < col; ++prev) {
          float dot = 0.f;
#pragma unroll
          for (int k = 0; k < kPer; ++k) dot = fmaf(X[(lane + 32 * k) * R + prev], y[k], dot);
          for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
#pragma unroll
          for (int k = 0; k < kPer; ++k) y[k] = fmaf(-dot, X[(lane + 32 * k) * R + prev], y[k]);
        }
        float nn = 0.f;
#pragma unroll
        for (int k = 0; k < kPer; ++k) nn = fmaf(y[k], y[k], nn);
        for (int o = 16; o > 0; o /= 2) nn += __shfl_xor_sync(0xffffffffu, nn, o);
        // n > 0 ? y / n : 0 (the spec, as the reference): a NaN or zero column is exactly 0, never y * 0 (NaN * 0)
        const bool ok = nn > 0.f;
        const float inv = ok ? rsqrtf(nn) : 0.f;
#pragma unroll
        for (int k = 0; k < kPer; ++k) X[(lane + 32 * k) * R + col] = ok ? y[k] * inv : 0.f;
        __syncwarp();
      }
    }
    __syncthreads();
  }
  float* p = basis + (int64_t(b) * num_kv_heads + h) * D * R;
  for (int i = threadIdx.x; i < D * R; i += kBasisThreads) p[i] = X[i];
}

// ---- 3. the projected residuals K' = P^T (k - k_mean) ---------------------------------------------------------------
// grid (pooled row idx, Hkv): one block's keys; thread (key, half) computes R / 2 outputs. Rows past the sequence's
// keys (the tail block's) are zero. K' layout: [Hkv][key_rows][R], key row cu_blocks[b] * B + j.
template <typename T, int D, int R>
__global__ void __launch_bounds__(kProjectThreads) key_project_kernel(SeqArgs seq, KVArgs kv, int block_size,
                                                                      int num_kv_heads, const int32_t* cu_blocks,
                                                                      const float* k_mean, const float* basis,
                                                                      __half* proj, int64_t key_rows) {
  __shared__ float sP[D * R];
  __shared__ float sBar[D];
  const int64_t idx = blockIdx.x;
  const int h = blockIdx.y;
  if (idx >= cu_blocks[seq.batch]) return;
  const int b = find_sequence(cu_blocks, seq.batch, idx);
  const int64_t J = idx - cu_blocks[b], k_len = seq.k_len(b);
  const float* p = basis + (int64_t(b) * num_kv_heads + h) * D * R;
  for (int i = threadIdx.x; i < D * R; i += kProjectThreads) sP[i] = p[i];
  for (int i = threadIdx.x; i < D; i += kProjectThreads) sBar[i] = k_mean[(idx * num_kv_heads + h) * D + i];
  __syncthreads();
  const float descale = kv.k_descale.at(b, h);
  constexpr int kHalf = R / 2;
  for (int w = threadIdx.x; w < block_size * 2; w += kProjectThreads) {
    const int64_t jj = w / 2, j = J * block_size + jj;
    const int c0 = (w % 2) * kHalf;
    float acc[kHalf] = {};
    const T* row = j < k_len ? key_row<T>(kv, seq, b, h, j) : nullptr;
    if (row) {
      for (int d = 0; d < D; ++d) {
        const float x = to_float(row[d]) * (is_fp8_v<T> ? descale : 1.f) - sBar[d];
#pragma unroll
        for (int c = 0; c < kHalf; ++c) acc[c] = fmaf(x, sP[d * R + c0 + c], acc[c]);
      }
    }
    __half* out = proj + (int64_t(h) * key_rows + idx * block_size + jj) * R + c0;
#pragma unroll
    for (int c = 0; c < kHalf; c += 2) *reinterpret_cast<__half2*>(out + c) = __floats2half2_rn(acc[c], acc[c + 1]);
  }
}

// ---- 4. the scorer --------------------------------------------------------------------------------------------------
template <typename T, int D, int R>
struct KeyMaxConfig {
  // the pooled GEMM's operands: q's dtype (bf16 for FP8 inputs, dequantised on the way in); the residual GEMM in fp16
  using Element = std::conditional_t<std::is_same_v<T, __half>, cutlass::half_t, cutlass::bfloat16_t>;
  using Half = cutlass::half_t;
  using PooledMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kTileRows>, cute::Int<kPooledN>, cute::Int<D>>>(),
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  using ResidMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Half, Half, Half,
                                 cute::Shape<cute::Int<kTileRows>, cute::Int<kUnitKeys>, cute::Int<R>>>(),
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  template <class E, int kRows, int kCols>
  using Atom = decltype(cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::K, E, cute::Int<kRows>,
                                                                            cute::Int<kCols>>());
  using SmemLayoutQ = decltype(cute::tile_to_shape(Atom<Element, kTileRows, D>{},
                                                   cute::Shape<cute::Int<kTileRows>, cute::Int<D>>{}));
  // two stages: chunk c - 1's means load while chunk c is scored
  using SmemLayoutKm = decltype(cute::tile_to_shape(Atom<Element, kPooledN, D>{},
                                                    cute::Shape<cute::Int<kPooledN>, cute::Int<D>, cute::_2>{}));
  using SmemLayoutQp = decltype(cute::tile_to_shape(Atom<Half, kTileRows, R>{},
                                                    cute::Shape<cute::Int<kTileRows>, cute::Int<R>>{}));
  // K' units: slot = stage * kStageUnits + unit % kStageUnits
  using SmemLayoutKp = decltype(cute::tile_to_shape(
      Atom<Half, kUnitKeys, R>{}, cute::Shape<cute::Int<kUnitKeys>, cute::Int<R>, cute::Int<2 * kStageUnits>>{}));
  struct Smem {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Half, cute::cosize_v<SmemLayoutQp>, 1024> qp;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKm>, 1024> km;
    union {  // P (float [D][R]) for the Q' projection of the prologue, then the K' stages
      cute::array_aligned<Half, cute::cosize_v<SmemLayoutKp>, 1024> kp;
      float p[D * R];
    } u;
    float pooled[kTileRows][kPooledN + 1];  // the current pooled chunk's scores (log2 units), rows by their warp
    int nan_flag;
  };
  static_assert(sizeof(float) * D * R <= sizeof(cute::array_aligned<Half, cute::cosize_v<SmemLayoutKp>, 1024>),
                "P fits the K' stages");
  static size_t smem_bytes(int64_t nb_max) { return sizeof(Smem) + size_t((nb_max + 31) / 32) * sizeof(uint32_t); }
};

__device__ __forceinline__ __half2 half2_max_nan(__half2 a, __half2 b) { return __hmax2_nan(a, b); }

// One CTA per (tile, virtual KV head). Writes the tile's keep bits (words [0, ceil(nvis / 32)) of its segment) of the
// blocks some row keeps by the per-row test (spec step 4); the last tiles (which keep everything) exit at once.
template <typename T, int D, int R>
__global__ void __launch_bounds__(kKeyMaxThreads, 2) key_max_kernel(
    SeqArgs seq, QArgs qa, SelectArgs sel, int group_size, int num_kv_heads, int subgroups, int kv_heads_mem,
    const int32_t* cu_tiles, const int32_t* cu_blocks, const lowp_t<T>* k_mean_lowp, const float* basis,
    const __half* proj, int64_t key_rows, uint32_t* bits_out, int64_t words_out) {
  using namespace cute;
  using Cfg = KeyMaxConfig<T, D, R>;
  using Element = typename Cfg::Element;
  using Half = typename Cfg::Half;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& sm = *reinterpret_cast<typename Cfg::Smem*>(smem_raw);
  uint32_t* bits = reinterpret_cast<uint32_t*>(smem_raw + sizeof(typename Cfg::Smem));

  const SelectTile st = select_tile(seq, cu_tiles);
  if (st.b < 0) return;
  const int kvh = st.kvh, b = st.b, kvh_mem = kvh / subgroups;
  const int64_t t = st.t, q_len = st.q_len, k_len = st.k_len, off = st.off;
  if (t >= st.tiles - sel.last_n) return;  // the last tiles keep every visible block (score_select's force)
  const int64_t nb = cu_blocks[b + 1] - cu_blocks[b];
  const int64_t rows = min(int64_t(kTileRows), q_len * group_size - t * kTileRows);
  const int64_t first_pos = t * kTileRows / group_size, last_pos = (t * kTileRows + rows - 1) / group_size;
  const int64_t hi_first = min(k_len - 1, first_pos + off), hi_last = min(k_len - 1, last_pos + off);
  const int B = sel.block_size;
  const int nvis = hi_last >= 0 ? int(hi_last / B + 1) : 0;
  const int64_t seg = int64_t(num_kv_heads) * cu_tiles[b] + kvh * st.tiles + t;
  const int words = (nvis + 31) / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (nvis == 0) return;

  Tensor sQ = make_tensor(make_smem_ptr(sm.q.data()), typename Cfg::SmemLayoutQ{});
  Tensor sQp = make_tensor(make_smem_ptr(sm.qp.data()), typename Cfg::SmemLayoutQp{});
  Tensor sKm = make_tensor(make_smem_ptr(sm.km.data()), typename Cfg::SmemLayoutKm{});
  Tensor sKp = make_tensor(make_smem_ptr(sm.u.kp.data()), typename Cfg::SmemLayoutKp{});
  const auto smem_addr = [](const auto& e) { return static_cast<uint32_t>(__cvta_generic_to_shared(&e)); };

  for (int w = threadIdx.x; w < words; w += kKeyMaxThreads) bits[w] = 0u;
  if (threadIdx.x == 0) sm.nan_flag = 0;

  // Prologue: Q (as score_select gathers it) and P, then Q' = P^T q * scale_log2 in fp16.
  if constexpr (is_fp8_v<T>) {
    gather_q_fp8<D, kKeyMaxThreads>(qa, sQ, seq.q_start(b), t, rows, group_size, kvh, qa.descale.at(b, kvh_mem));
  } else if (qa.vec16) {
    gather_q_cp_async<T, D, 8, kKeyMaxThreads>(qa, sQ, seq.q_start(b), t, rows, group_size, kvh);
  } else {
    gather_q_cp_async<T, D, 2, kKeyMaxThreads>(qa, sQ, seq.q_start(b), t, rows, group_size, kvh);
  }
  asm volatile("cp.async.commit_group;\n" ::);
  const float* p_global = basis + (int64_t(b) * kv_heads_mem + kvh_mem) * D * R;
  for (int i = threadIdx.x; i < D * R; i += kKeyMaxThreads) sm.u.p[i] = p_global[i];
  asm volatile("cp.async.wait_group 0;\n" ::);
  __syncthreads();
  {
    constexpr int kCols = R / 2;  // two threads per packed row
    const int r = threadIdx.x / 2, c0 = (threadIdx.x % 2) * kCols;
    float acc[kCols] = {};
    for (int d = 0; d < D; ++d) {
      const float qd = float(sQ(r, d));
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[c] = fmaf(qd, sm.u.p[d * R + c0 + c], acc[c]);
    }
#pragma unroll
    for (int c = 0; c < kCols; ++c) sQp(r, c0 + c) = Half(acc[c] * sel.scale_log2);
  }
  cutlass::arch::fence_view_async_shared();  // Q' stores (generic proxy) -> visible to wgmma
  __syncthreads();  // Q' written; P no longer read (its room becomes the K' stages)

  typename Cfg::PooledMma pmma;
  typename Cfg::ResidMma rmma;
  auto wg_p = pmma.get_slice((threadIdx.x / 128) * 128);
  auto wg_r = rmma.get_slice((threadIdx.x / 128) * 128);
  Tensor tPrQ = wg_p.partition_fragment_A(sQ);
  Tensor tPrK = wg_p.partition_fragment_B(sKm);
  Tensor tPrS = partition_fragment_C(pmma, Shape<Int<kTileRows>, Int<kPooledN>>{});
  Tensor cP = pmma.get_slice(threadIdx.x).partition_C(make_identity_tensor(Shape<Int<kTileRows>, Int<kPooledN>>{}));
  Tensor tRrQ = wg_r.partition_fragment_A(sQp);
  Tensor tRrK = wg_r.partition_fragment_B(sKp);
  Tensor cR = rmma.get_slice(threadIdx.x).partition_C(make_identity_tensor(Shape<Int<kTileRows>, Int<kUnitKeys>>{}));
  static_assert(decltype(size(cR))::value == 32, "fp16 accumulators: 16 registers of (row pair, 2 columns)");

  // This thread's two packed rows (the accumulators' rows 0 and 8 of its quad; the same in both GEMMs): the last key
  // each sees (-1: none) and the last block.
  int row_of[2], hi_row[2], last_block[2];
  for (int i = 0; i < 2; ++i) {
    row_of[i] = get<0>(cR(2 * i));  // value 2i: register i, row i of the thread (PTX fp16 accumulator layout)
    const int64_t hi = row_of[i] < rows ? min(k_len - 1, (t * kTileRows + row_of[i]) / group_size + off) : -1;
    hi_row[i] = int(hi);
    last_block[i] = hi >= 0 ? int(hi / B) : -1;
  }
  const int tile_min_hi = rows == kTileRows ? int(hi_first) : -1;  // keys <= it: seen by every row of the tile

  // The pooled chunk c (blocks [32 c, 32 c + 32)) into stage `buf` of sKm (one cp.async group, waited at the next
  // stage barrier); rows past the sequence clamp to its last block. pooled_gemm: the chunk's scores into tPrS.
  const Element* pooled_src =
      reinterpret_cast<const Element*>(k_mean_lowp) + (int64_t(cu_blocks[b]) * kv_heads_mem + kvh_mem) * D;
  auto load_pooled = [&](int c, int buf) {
    constexpr int kVec = D / 8;
    for (int i = threadIdx.x; i < kPooledN * kVec; i += kKeyMaxThreads) {
      const int n = i / kVec, v = i % kVec;
      const int64_t J = min(int64_t(c) * kPooledN + n, nb - 1);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(sKm(n, v * 8, buf))),
                   "l"(pooled_src + J * kv_heads_mem * D + v * 8));
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  auto pooled_gemm = [&](int buf) {
    wgmma_batch<false>(pmma, tPrQ, tPrK(_, _, _, buf), tPrS, /*zero_init=*/true);
    warpgroup_wait<0>();
  };
  auto stage_barrier = [&] {  // every cp.async of this thread landed and visible to wgmma, then the CTA meets
    asm volatile("cp.async.wait_group 0;\n" ::);
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
  };

  // The bound: b_r = max over the blocks the row sees whole of its pooled score (log2 units). The chunks stream
  // through the two stages (chunk c + 1 loads under chunk c's GEMM: a synchronous load per chunk cost ~1-2 us).
  float m_row[2] = {-INFINITY, -INFINITY};
  const int nchunks = (nvis + kPooledN - 1) / kPooledN;
  load_pooled(0, 0);
  for (int c = 0; c < nchunks; ++c) {
    stage_barrier();  // chunk c landed; chunk c - 1's GEMM (the other stage) finished in both warpgroups
    if (c + 1 < nchunks) load_pooled(c + 1, (c + 1) & 1);
    pooled_gemm(c & 1);
    CUTE_UNROLL
    for (int v = 0; v < size(tPrS); ++v) {
      const int r = get<0>(cP(v)), J = c * kPooledN + get<1>(cP(v));
      const int i = r == row_of[0] ? 0 : 1;
      const int64_t last_key = min(int64_t(J + 1) * B, k_len) - 1;
      if (J < nb && last_key <= hi_row[i]) m_row[i] = fmaxf(m_row[i], tPrS(v) * sel.scale_log2);
    }
  }
  for (int i = 0; i < 2; ++i) {
    m_row[i] = fmaxf(m_row[i], __shfl_xor_sync(0xffffffffu, m_row[i], 1));
    m_row[i] = fmaxf(m_row[i], __shfl_xor_sync(0xffffffffu, m_row[i], 2));
  }
  __syncthreads();  // both warpgroups past the last bound GEMM before the stages are reloaded

  // K' stage s: units [8 s, 8 s + 8) of the sequence (keys [512 s, 512 s + 512)), clamped to its key rows.
  const Half* proj_src =
      reinterpret_cast<const Half*>(proj) + (int64_t(kvh_mem) * key_rows + int64_t(cu_blocks[b]) * B) * R;
  const int64_t seq_rows = nb * B;
  auto load_stage = [&](int s, int buf) {
    constexpr int kVec = R / 8;  // 16-byte chunks per key row
    for (int i = threadIdx.x; i < kStageUnits * kUnitKeys * kVec; i += kKeyMaxThreads) {
      const int key = i / kVec, v = i % kVec;
      const int64_t j = min(int64_t(s) * kStageUnits * kUnitKeys + key, seq_rows - 1);
      const int slot = buf * kStageUnits + key / kUnitKeys;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(sKp(key % kUnitKeys, v * 8, slot))),
                   "l"(proj_src + j * R + v * 8));
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };

  const float log2_alpha = log2f(sel.alpha);  // alpha 0: -inf, every visible block
  const int units_per_block = B / kUnitKeys;
  const int top_unit = nvis * units_per_block - 1;
  const int top_stage = top_unit / kStageUnits;
  const __half2 neg2 = __halves2half2(__ushort_as_half(0xFC00u), __ushort_as_half(0xFC00u));
  __half2 run2[2] = {neg2, neg2};  // this block's residual maxima so far, per row (pairs of columns)
  uint32_t word_bits = 0;           // lane 0: the warp's keep bits of the current 32-block word

  // One unit (64 keys) of block J = u / units_per_block scored in `acc`: mask, running maximum; at the block's first
  // unit (the last one visited) the score, the running row maximum and the per-row test. Uniform across the CTA.
  auto consume = [&](auto& acc, int u) {
    if (u > top_unit) return;  // the top stage's units past the tile's last visible block
    const int J = u / units_per_block;
    if (u * kUnitKeys + kUnitKeys - 1 > tile_min_hi) {  // some key of the unit is past some row's last key
      CUTE_UNROLL
      for (int v = 0; v < size(acc); ++v) {
        const int key = u * kUnitKeys + get<1>(cR(v));
        if (key > hi_row[(v / 2) % 2]) acc(v) = Half(-INFINITY);
      }
    }
    const __half2* acc2 = reinterpret_cast<const __half2*>(acc.data());
    CUTE_UNROLL
    for (int k = 0; k < 16; k += 2) {
      run2[0] = half2_max_nan(run2[0], acc2[k]);
      run2[1] = half2_max_nan(run2[1], acc2[k + 1]);
    }
    if (u % units_per_block != 0) return;
    bool keep = false;
    for (int i = 0; i < 2; ++i) {
      // NaN (a NaN key or query reached the scores): flagged here, before fmaxf's quad reduction would drop it
      if (__hisnan(run2[i].x) || __hisnan(run2[i].y)) sm.nan_flag = 1;
      float res = fmaxf(__low2float(run2[i]), __high2float(run2[i]));
      res = fmaxf(res, __shfl_xor_sync(0xffffffffu, res, 1));
      res = fmaxf(res, __shfl_xor_sync(0xffffffffu, res, 2));
      run2[i] = neg2;
      if (J > last_block[i]) continue;
      const float sh = sm.pooled[row_of[i]][J % kPooledN] + res;
      if (sh != sh) sm.nan_flag = 1;
      m_row[i] = fmaxf(m_row[i], sh);
      keep |= sh >= m_row[i] + log2_alpha;
    }
    const unsigned any = __ballot_sync(0xffffffffu, keep);
    if (lane == 0 && any) word_bits |= 1u << (J % 32);
    if (lane == 0 && J % 32 == 0 && word_bits) {
      atomicOr(&bits[J / 32], word_bits);
      word_bits = 0;
    }
  };

  // Stages of 8 units from the diagonal down. A pooled chunk (32 blocks = 32 * units_per_block units) starts at a
  // stage boundary, so its scores are set at the top of the stage that first needs them, from the stage loaded a
  // chunk earlier. Within a stage the units are pipelined: unit u - 1's wgmma runs while unit u is reduced (two
  // accumulators; the first pass waited on every wgmma: its latency was exposed per unit).
  int cur_chunk = -1, pbuf = 0;
  load_stage(top_stage, 0);
  load_pooled(top_unit / units_per_block / kPooledN, pbuf);
  Tensor accA = partition_fragment_C(rmma, Shape<Int<kTileRows>, Int<kUnitKeys>>{});
  Tensor accB = partition_fragment_C(rmma, Shape<Int<kTileRows>, Int<kUnitKeys>>{});
  for (int s = top_stage; s >= 0; --s) {
    const int buf = (top_stage - s) & 1;
    stage_barrier();  // stage s and any pooled chunk issued before it landed; the other stage's readers done
    if (s > 0) load_stage(s - 1, buf ^ 1);
    const int chunk = min(s * kStageUnits + kStageUnits - 1, top_unit) / units_per_block / kPooledN;
    if (chunk != cur_chunk) {
      pooled_gemm(pbuf);
      CUTE_UNROLL
      for (int v = 0; v < size(tPrS); ++v) sm.pooled[get<0>(cP(v))][get<1>(cP(v))] = tPrS(v) * sel.scale_log2;
      __syncwarp();  // a row's pooled scores are written and read by its own warp
      cur_chunk = chunk;
      pbuf ^= 1;
      if (chunk > 0) load_pooled(chunk - 1, pbuf);  // lands by the stage barrier before it is needed
    }
    const int slot0 = buf * kStageUnits;
    wgmma_batch<false>(rmma, tRrQ, tRrK(_, _, _, slot0 + kStageUnits - 1), accA, /*zero_init=*/true);
    CUTE_UNROLL
    for (int uu = kStageUnits - 1; uu >= 0; --uu) {
      auto& cur = (uu & 1) ? accA : accB;
      auto& nxt = (uu & 1) ? accB : accA;
      if (uu > 0) {
        wgmma_batch<false>(rmma, tRrQ, tRrK(_, _, _, slot0 + uu - 1), nxt, /*zero_init=*/true);
        warpgroup_wait<1>();
      } else {
        warpgroup_wait<0>();
      }
      consume(cur, s * kStageUnits + uu);
    }
  }
  __syncthreads();
  uint32_t* out = bits_out + seg * words_out;
  const bool all = sm.nan_flag != 0;  // a NaN score keeps every visible block of the tile
  for (int w = threadIdx.x; w < words; w += kKeyMaxThreads) out[w] = all ? 0xffffffffu : bits[w];
}

template <typename T, int D, int R>
size_t key_max_smem_limit() {
  // two ~100 KB CTAs per SM at rank 16: one's wgmma under the other's maxima
  static const size_t limit = opt_in_all_shared_memory(key_max_kernel<T, D, R>, "cudaFuncSetAttribute(key_max_kernel)");
  return limit;
}

template <int D, int R>
size_t key_basis_smem_bytes() {
  return size_t(D * D + 2 * D * R) * sizeof(float);
}

template <typename T, int D, int R>
void launch_all(cudaStream_t stream, const Bounds& bd, const VirtualHeads& heads, int batch, int num_kv_heads,
                const SeqArgs& seq, const QArgs& qa, const KVArgs& kv, const SelectArgs& sel, const DeviceIndex& d) {
  const int B = sel.block_size;
  key_moment_kernel<T, D><<<dim3(unsigned(batch), unsigned(num_kv_heads), unsigned(D / kMomentBand)), D, 0, stream>>>(
      seq, kv, B, num_kv_heads, d.cu_blocks, d.k_mean, d.key_moment);
  static const bool basis_attr = [] {
    check_cuda(cudaFuncSetAttribute(key_basis_kernel<D, R>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(key_basis_smem_bytes<D, R>())),
               "cudaFuncSetAttribute(key_basis_kernel)");
    return true;
  }();
  (void)basis_attr;
  key_basis_kernel<D, R><<<dim3(unsigned(batch), unsigned(num_kv_heads)), kBasisThreads,
                           key_basis_smem_bytes<D, R>(), stream>>>(num_kv_heads, d.key_moment, d.key_basis);
  if (bd.max_blocks > 0) {
    key_project_kernel<T, D, R><<<dim3(unsigned(bd.max_blocks), unsigned(num_kv_heads)), kProjectThreads, 0, stream>>>(
        seq, kv, B, num_kv_heads, d.cu_blocks, d.k_mean, d.key_basis, static_cast<__half*>(d.key_proj),
        d.key_rows);
  }
  const size_t dyn = KeyMaxConfig<T, D, R>::smem_bytes(bd.nb_max);
  if (dyn > key_max_smem_limit<T, D, R>()) {
    throw NotImplementedError("build_index on CUDA, rule key_max: " + std::to_string(bd.nb_max) +
                              " blocks per sequence exceed the scorer's shared memory (max_seqlen_k too long)");
  }
  key_max_kernel<T, D, R><<<dim3(unsigned(bd.max_tiles), unsigned(heads.kv)), kKeyMaxThreads, dyn, stream>>>(
      seq, qa, sel, heads.group, heads.kv, heads.subgroups, num_kv_heads, d.cu_tiles, d.cu_blocks,
      static_cast<const lowp_t<T>*>(d.k_mean_lowp), d.key_basis, static_cast<const __half*>(d.key_proj), d.key_rows,
      d.probe_bits, d.probe_words);
}

}  // namespace

void launch_key_max(cudaStream_t stream, const Problem& p, const SelectionParams& params, const Bounds& bd,
                    const VirtualHeads& heads, const SeqArgs& seq, const QArgs& qa, const KVArgs& kv,
                    const SelectArgs& sel, const DeviceIndex& d) {
  if (bd.max_tiles <= 0) return;
  auto launch = [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int kD = decltype(dim)::value;
    if (params.key_rank == 32) {
      launch_all<T, kD, 32>(stream, bd, heads, p.batch, p.num_kv_heads, seq, qa, kv, sel, d);
    } else {
      launch_all<T, kD, 16>(stream, bd, heads, p.batch, p.num_kv_heads, seq, qa, kv, sel, d);
    }
  };
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  const bool bf16 = p.dtype == DType::kBFloat16;
  if (p.dtype == DType::kFloat8E4M3) {
    launch(__nv_fp8_e4m3{}, D128{});
  } else if (p.head_dim == 128) {
    bf16 ? launch(__nv_bfloat16{}, D128{}) : launch(__half{}, D128{});
  } else {
    bf16 ? launch(__nv_bfloat16{}, D64{}) : launch(__half{}, D64{});
  }
  check_cuda(cudaGetLastError(), "key_max kernels launch");
}

}  // namespace sparse_prefill::cuda::index_stage
