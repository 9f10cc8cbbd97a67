// Index stage, SelectionRule::kProbeRowMax / kProbeRowMass: the exact block masses of the probe rows (every
// kProbeStride-th query of a sequence, and its last), on tensor cores; their bits are OR-ed in by the scorer
// (score_select.cu).
#include <cmath>
#include <string>
#include <type_traits>

#include "cuda/common/check.h"
#include "cuda/common/device_info.h"
#include "cuda/index/device_args.cuh"

namespace sparse_prefill::cuda::index_stage {
namespace {

// SelectionRule::kProbeRowMax / kProbeRowMass, the probe rows' half (the pooled-means half is the kRowMax scorer at
// SelectionParams::mean_alpha, which ORs these bits in). The probe rows are the packed rows of the queries i with
// i % kProbeStride == kProbeStride - 1 or i == q_len - 1; for each, w_rJ = log sum_j exp(scale q_r . k_j) over the keys
// of block J it sees, the row's reference m_r = max_J w_rJ (row_mass: m_r = log sum_J exp w_rJ, the row's whole
// mass), and J is set for the row's tile when w_rJ >= m_r + ln(alpha).
// Bits: probe_bits[seg * words + J / 32].
//
// One CTA per (8 consecutive tiles of a sequence, virtual KV head), on the scorer's grid: the CTA of tile t with
// t % 8 == 0 does tiles t .. t + 7, the others exit. Its probe rows (~16 per tile) form 16-row batches, one per warp;
// K streams through shared memory in 64-key chunks (three cp.async stages) read by all 8 warps, so each key is loaded
// once per 8 tiles instead of once per tile (one tile per CTA, the first tensor-core version: 205 ms at 128K, Hq 32,
// Hkv 8, about 2.6 TB/s of K reads; the CUDA-core version before it 1835 ms). The dot products on tensor cores
// (mma.sync m16n8k16 bf16 / fp16, m16n8k32 e4m3 on the raw FP8 values: the descales fold into the scale, one
// (sequence, KV head) per CTA), fp32 accumulation; a row's block mass is a running log2-sum-exp2 over the chunks.
// Two passes over the keys, the first for m_r (a running maximum, or with row_mass a running log2-sum-exp2 of the
// block masses) and the second recomputing the same masses (same instructions, same bits) for the test: no
// per-(row, block) array, so any number of blocks fits. NaN: no bit (the scorer's NaN rule keeps the tile whole).
// Key splits (Split, probe_splits() in layout.h): with S > 1, CTA (blockIdx.z = s) takes the bitmap words
// [s * W, (s + 1) * W) of 32 blocks each, W = ceil(words / S), in two launches: kPass1 runs the first pass over its
// blocks and stores each row's partial reference (max, or log2-sum-exp2 as (m, sum)); kPass2 merges the S partials
// in split order (deterministic) and runs the second pass, writing its words of the bitmap. kBoth: S = 1, one launch.
// A bad page id reads zeros (its tile's rows are NaN anyway, docs/engine.md).
constexpr int kProbeWarps = 8, kProbeThreads = 32 * kProbeWarps, kProbeBatch = 16, kTilesPerCta = kProbeTilesPerCta;
constexpr int kChunkKeys = 64, kStages = 3, kMaxRows = kTilesPerCta * kTileRows;

// A row of q or k in shared memory: the row's bytes plus 16, so the 8 rows of an ldmatrix hit distinct bank groups.
template <typename T, int D>
constexpr int probe_row_bytes() { return D * int(sizeof(T)) + 16; }
template <typename T, int D>
constexpr size_t probe_smem_bytes(int64_t words) {
  return size_t(kProbeWarps * kProbeBatch + kStages * kChunkKeys) * probe_row_bytes<T, D>() + kMaxRows * 4 +
         size_t(kTilesPerCta * words) * 4;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// c += a * b for one m16 x n8 tile and one k step of 32 bytes (16 bf16 / fp16 or 32 e4m3 values).
template <typename T>
__device__ __forceinline__ void mma_k32bytes(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else if constexpr (std::is_same_v<T, __half>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
// (m, l) <- the log2-sum-exp2 of (m, l) and (m2, l2): a running maximum m and the sum l of exp2(x - m). Symmetric
// in its two operands, so the lanes of a butterfly end with the same bits.
__device__ __forceinline__ void lse2_merge(float& m, float& l, float m2, float l2) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;
  l = l * exp2f(m - mn) + l2 * exp2f(m2 - mn);
  m = mn;
}

// kVec16: K's base and strides are multiples of 16 bytes (16-byte cp.async copies), else element copies. Two CTAs
// per SM (128 registers, ~92 KB of shared memory at D 128); e4m3 one: at 128 registers its mma.sync spilled 52-80
// bytes (sm_90 has no native m16n8k32 e4m3 mma.sync; ptxas emulates it).
enum class ProbePhase : int { kBoth = 0, kPass1 = 1, kPass2 = 2 };
struct Split {
  int count;         // S
  ProbePhase phase;
  float* partials;   // S > 1: [S][max_segments][kTileRows][2], slot (cu_tiles[b] + tile) * num_kv_heads + kvh
};

template <typename T, int D, bool kVec16>
__global__ void __launch_bounds__(kProbeThreads, is_fp8_v<T> ? 1 : 2)
    probe_kernel(SeqArgs seq, QArgs qa, KVArgs kv, SelectArgs sel, int group_size, int num_kv_heads, int subgroups,
                 const int32_t* cu_tiles, int64_t words, bool row_mass, Split split, int64_t max_segments,
                 uint32_t* probe_bits) {
  constexpr int kRowBytes = D * int(sizeof(T)), kStride = probe_row_bytes<T, D>(), kSteps = kRowBytes / 32;
  constexpr int kParts = kRowBytes / 16;                       // 16-byte pieces of a row
  constexpr int kCopies = kChunkKeys * kParts / kProbeThreads;  // per thread and chunk
  static_assert(kChunkKeys * kParts % kProbeThreads == 0, "whole copies per thread");
  extern __shared__ __align__(16) unsigned char probe_smem[];
  const SelectTile st = select_tile(seq, cu_tiles);
  if (st.b < 0 || st.t % kTilesPerCta != 0) return;
  const int kvh = st.kvh, b = st.b;
  const int64_t t0 = st.t, tiles = st.tiles, q_len = st.q_len, k_len = st.k_len, off = st.off;
  const int ntl = int(min(int64_t(kTilesPerCta), tiles - t0));
  const int64_t rows = min(int64_t(ntl) * kTileRows, q_len * group_size - t0 * kTileRows);  // the CTA's packed rows
  const int B = sel.block_size;
  const int64_t last_pos = (t0 * kTileRows + rows - 1) / group_size;
  const int64_t hi_last = min(k_len - 1, last_pos + off);
  const int64_t nvis = hi_last >= 0 ? hi_last / B + 1 : 0;      // blocks the CTA's last row sees
  unsigned char* qs = probe_smem;                                           // [warp][16][kStride] raw q rows
  unsigned char* kbuf = qs + kProbeWarps * kProbeBatch * kStride;           // [stage][kChunkKeys][kStride]
  int* probe_rows = reinterpret_cast<int*>(kbuf + kStages * kChunkKeys * kStride);  // [kMaxRows] rows from t0
  uint32_t* bits = reinterpret_cast<uint32_t*>(probe_rows + kMaxRows);              // [tile][words]
  __shared__ int n_probe;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t w = threadIdx.x; w < kTilesPerCta * words; w += kProbeThreads) bits[w] = 0u;
  if (threadIdx.x == 0) n_probe = 0;
  __syncthreads();
  // the probe rows in any order (rows are independent; each carries its tile): a slot per row from a counter
  for (int r = threadIdx.x; r < rows; r += kProbeThreads) {
    const int64_t pos = (t0 * kTileRows + r) / group_size;
    if (pos % kProbeStride == kProbeStride - 1 || pos == q_len - 1) probe_rows[atomicAdd(&n_probe, 1)] = r;
  }
  __syncthreads();
  const int n_rows = n_probe;
  const int kv_mem = kvh / subgroups;
  float scale2 = sel.scale_log2;  // scores in the log2 domain: w2 = log2 sum exp2(scale_log2 q . k)
  if constexpr (is_fp8_v<T>) scale2 *= qa.descale.at(b, kv_mem) * kv.k_descale.at(b, kv_mem);
  const float log2_alpha = sel.alpha > 0.f ? log2f(sel.alpha) : -INFINITY;
  const unsigned char* kbase = static_cast<const unsigned char*>(kv.k);
  const int chunks_per_block = B / kChunkKeys;
  // This split's bitmap words [w_lo, w_hi) and their chunks [c_lo, c_hi) (all of them without splits); 32-bit, as
  // the 16-bit D 128 kernels sit at their 128-register cap: with 64-bit bounds and the rows kept in registers they
  // spilled 52-84 bytes, now 24-40 (ptxas), all outside the chunk loop (SASS: no LDL / STL between its HMMAs).
  const int words_per_split = int((words + split.count - 1) / split.count);
  const int w_lo = int(min(words, int64_t(blockIdx.z) * words_per_split));
  const int w_hi = int(min(words, int64_t(w_lo) + words_per_split));
  const int c_lo = int(min(nvis, int64_t(w_lo) * 32)) * chunks_per_block;
  const int c_hi = int(min(nvis, int64_t(w_hi) * 32)) * chunks_per_block;
  // A row's partial reference in split s (packed row r of this CTA).
  auto partial = [&](int s, int r) {
    const int64_t slot = (cu_tiles[b] + t0 + r / kTileRows) * num_kv_heads + kvh;
    return split.partials + ((int64_t(s) * max_segments + slot) * kTileRows + r % kTileRows) * 2;
  };
  // Chunk c (keys c * 64 + [0, 64)) into stage c % kStages, one commit group (empty past the last chunk, so that
  // wait_group counts stay uniform). Keys past k_len and bad pages are zeros.
  auto load_chunk = [&](int c) {
    if (c < c_hi) {
      unsigned char* dst0 = kbuf + (c % kStages) * kChunkKeys * kStride;
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        const int p = threadIdx.x + i * kProbeThreads, key = p / kParts, part = p % kParts;
        const int64_t j = int64_t(c) * kChunkKeys + key;
        int64_t ko = -1, vo;  // stays -1 past k_len and on a bad page: zeros
        if (j < k_len) kv.offsets(b, seq.k_start(b), kv_mem, j, ko, vo);
        unsigned char* dst = dst0 + key * kStride + part * 16;
        if constexpr (kVec16) {
          const unsigned char* src = ko >= 0 ? kbase + ko * int64_t(sizeof(T)) + part * 16 : kbase;
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                       "r"(ko >= 0 ? 16 : 0));
        } else {
          constexpr int kElems = 16 / int(sizeof(T));
          T* d = reinterpret_cast<T*>(dst);
          const T* src = reinterpret_cast<const T*>(kbase) + ko + part * kElems;
#pragma unroll
          for (int e = 0; e < kElems; ++e) d[e] = ko >= 0 ? src[e] : T{};
        }
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  const int g = lane / 4, tq = lane % 4;  // mma fragment coordinates: rows g, g + 8; key columns 2 tq, 2 tq + 1
  unsigned char* my_q = qs + warp * kProbeBatch * kStride;
  // rounds of 8 batches (one per warp): more than one only when the 8 tiles hold more than 128 probe rows
  for (int base = 0; base < n_rows; base += kProbeWarps * kProbeBatch) {
    const int r0 = base + warp * kProbeBatch, nr = max(0, min(kProbeBatch, n_rows - r0));
    for (int i = lane; i < kProbeBatch * D; i += 32) {
      const int rr = i / D, d = i % D;
      T x{};
      if (rr < nr) {
        const int64_t pr = t0 * kTileRows + probe_rows[r0 + rr];
        x = static_cast<const T*>(qa.q)[(seq.q_start(b) + pr / group_size) * qa.stride_row +
                                        (kvh * group_size + pr % group_size) * qa.stride_head + d];
      }
      reinterpret_cast<T*>(my_q + rr * kStride)[d] = x;
    }
    __syncwarp();
    // the warp's 16 rows as A fragments, every k step (ldmatrix.x4: rows 0-7 / 8-15, bytes 0-15 / 16-31)
    uint32_t a[kSteps][4];
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
      ldmatrix_x4(a[s], smem_addr(my_q + ((lane % 8) + 8 * ((lane / 8) % 2)) * kStride + s * 32 + 16 * (lane / 16)));
    // this thread's two rows: the last key each sees (causal, bottom-right; -1: no row) and its tile
    int64_t lim[2];
    int tile[2];
    // this thread's row h (-1: none), read again from shared memory where needed rather than kept in registers
    auto row_of = [&](int h) { return g + 8 * h < nr ? probe_rows[r0 + g + 8 * h] : -1; };
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row_of(h);
      lim[h] = r >= 0 ? (t0 * kTileRows + r) / group_size + off : -1;
      tile[h] = max(r, 0) / kTileRows;
    }
    float row_ref[2] = {-INFINITY, -INFINITY}, row_sum[2] = {1.f, 1.f};  // m_r (row_mass: with the sum of exp2)
    if (split.phase == ProbePhase::kPass2) {  // the splits' first passes, merged in split order
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row_of(h);
        if (r < 0) continue;
        for (int s = 0; s < split.count; ++s) {
          const float* q = partial(s, r);
          if (row_mass)
            lse2_merge(row_ref[h], row_sum[h], q[0], q[1]);
          else
            row_ref[h] = fmaxf(row_ref[h], q[0]);
        }
        if (row_mass) row_ref[h] += log2f(row_sum[h]);  // -inf stays -inf
      }
    }
    const int pass_lo = split.phase == ProbePhase::kPass2 ? 1 : 0, pass_hi = split.phase == ProbePhase::kPass1 ? 1 : 2;
    for (int pass = pass_lo; pass < pass_hi; ++pass) {
      load_chunk(c_lo);
      load_chunk(c_lo + 1);
      float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // the current block's running log2-sum-exp2
      bool nan[2] = {false, false};                                // a NaN score in it (its mass becomes NaN)
      int J = c_lo / chunks_per_block;                             // the block of chunk c, and c's place in it
      int in_block = 0;
      for (int c = c_lo; c < c_hi; ++c) {
        asm volatile("cp.async.wait_group 1;\n" ::);
        __syncthreads();  // chunk c visible to all; everyone is done with chunk c - 1, whose stage the next load takes
        load_chunk(c + 2);
        const unsigned char* kb = kbuf + (c % kStages) * kChunkKeys * kStride;
        float acc[kChunkKeys / 8][4];
#pragma unroll
        for (int n = 0; n < kChunkKeys / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
#pragma unroll
          for (int np = 0; np < kChunkKeys / 16; ++np) {
            // B fragments of n8 tiles 2 np, 2 np + 1 (keys 0-7 / 8-15 of the pair, bytes 0-15 / 16-31 of the step)
            uint32_t bf[4];
            ldmatrix_x4(bf, smem_addr(kb + (16 * np + (lane % 8) + 8 * (lane / 16)) * kStride + s * 32 +
                                      16 * ((lane / 8) % 2)));
            mma_k32bytes<T>(acc[2 * np], a[s], bf[0], bf[1]);
            mma_k32bytes<T>(acc[2 * np + 1], a[s], bf[2], bf[3]);
          }
        }
        const int64_t j0 = int64_t(c) * kChunkKeys;
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // row g + 8 h: acc[n][2 h], acc[n][2 h + 1] are keys 8 n + 2 tq, + 1
          float x[kChunkKeys / 4];
          float cm = -INFINITY;
#pragma unroll
          for (int e = 0; e < kChunkKeys / 4; ++e) {
            const int64_t j = j0 + 8 * (e / 2) + 2 * tq + (e % 2);
            x[e] = j < k_len && j <= lim[h] ? acc[e / 2][2 * h + (e % 2)] * scale2 : -INFINITY;
            nan[h] |= x[e] != x[e];
            cm = fmaxf(cm, x[e]);  // fmaxf drops NaN: the flag carries it
          }
          if (cm != -INFINITY) {
            float cl = 0.f;
#pragma unroll
            for (int e = 0; e < kChunkKeys / 4; ++e) cl += x[e] != x[e] ? 0.f : exp2f(x[e] - cm);
            lse2_merge(m[h], l[h], cm, cl);
          }
        }
        if (++in_block == chunks_per_block) {  // the block's last chunk: merge the quad's partial sums
#pragma unroll
          for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int o = 1; o < 4; o *= 2) {
              const float m2 = __shfl_xor_sync(0xffffffffu, m[h], o), l2 = __shfl_xor_sync(0xffffffffu, l[h], o);
              nan[h] |= __shfl_xor_sync(0xffffffffu, int(nan[h]), o) != 0;
              lse2_merge(m[h], l[h], m2, l2);
            }
            const float w = nan[h] ? NAN : m[h] == -INFINITY ? -INFINITY : m[h] + log2f(l[h]);
            if (pass == 0) {
              if (!row_mass) {
                row_ref[h] = fmaxf(row_ref[h], w);
              } else if (w == w && w != -INFINITY) {  // a NaN block keeps its tile whole anyway (the scorer)
                lse2_merge(row_ref[h], row_sum[h], w, 1.f);
              }
            } else if (tq == 0 && w != -INFINITY && row_ref[h] != -INFINITY && w - row_ref[h] >= log2_alpha) {
              atomicOr(&bits[tile[h] * words + J / 32], 1u << (J % 32));
            }
            m[h] = -INFINITY, l[h] = 0.f, nan[h] = false;
          }
          ++J, in_block = 0;
        }
      }
      asm volatile("cp.async.wait_group 0;\n" ::);
      __syncthreads();  // the stages are free for the next pass or round
      if (pass == 0 && split.phase == ProbePhase::kPass1) {  // this split's reference, before the row_mass log
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = row_of(h);
          if (r >= 0 && tq == 0) {
            float* q = partial(blockIdx.z, r);
            q[0] = row_ref[h];
            q[1] = row_sum[h];
          }
        }
      } else if (pass == 0 && row_mass) {
#pragma unroll
        for (int h = 0; h < 2; ++h) row_ref[h] += log2f(row_sum[h]);  // -inf stays -inf
      }
    }
  }
  __syncthreads();
  if (split.phase == ProbePhase::kPass1) return;
  for (int tt = 0; tt < ntl; ++tt) {  // this split's words, zeros past the blocks it sees
    const int64_t seg = int64_t(num_kv_heads) * cu_tiles[b] + kvh * tiles + t0 + tt;
    for (int64_t w = w_lo + threadIdx.x; w < w_hi; w += kProbeThreads) probe_bits[seg * words + w] = bits[tt * words + w];
  }
}

}  // namespace

void launch_probe(cudaStream_t stream, DType dtype, int head_dim, dim3 grid, const SeqArgs& seq, const QArgs& qa,
                  const KVArgs& kv, const SelectArgs& sel, const VirtualHeads& heads, bool row_mass,
                  const DeviceIndex& d) {
  auto launch = [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int kD = decltype(dim)::value;
    const size_t probe_smem = probe_smem_bytes<T, kD>(d.probe_words);
    // 16-byte copies of K rows need a 16-byte aligned base and strides (the strides a caller's layout may have)
    const int64_t e = int64_t(sizeof(T));
    bool vec16 = reinterpret_cast<uintptr_t>(kv.k) % 16 == 0;
    for (int i = 0; i < (kv.block_table ? 3 : 2); ++i) vec16 = vec16 && (kv.k_stride[i] * e) % 16 == 0;
    auto run = [&](auto vec) {  // vec: std::bool_constant (one static limit per kernel)
      auto kernel = probe_kernel<T, kD, decltype(vec)::value>;
      // the device's opt-in limit less the kernel's static shared memory (the opt-in limit alone is refused)
      static const size_t probe_limit = [&] {
        const size_t limit = max_dynamic_smem_optin(kernel);
        check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(limit)),
                   "cudaFuncSetAttribute(probe_kernel)");
        return limit;
      }();
      if (probe_smem > probe_limit)  // 8 tiles' bits: past ~40M keys per sequence at block 128
        throw NotImplementedError(std::string("build_index on CUDA: rule='") +
                                  (row_mass ? "probe_row_mass" : "probe_row_max") + "' supports up to " +
                                  std::to_string((probe_limit - probe_smem_bytes<T, kD>(0)) / 4 / kTilesPerCta * 32) +
                                  " blocks per sequence");
      const int splits = d.probe_splits > 1 ? d.probe_splits : 1;
      const dim3 split_grid(grid.x, grid.y, unsigned(splits));
      auto go = [&](ProbePhase phase) {
        kernel<<<split_grid, kProbeThreads, probe_smem, stream>>>(
            seq, qa, kv, sel, heads.group, heads.kv, heads.num_subgroups, d.cu_tiles, d.probe_words, row_mass,
            Split{splits, phase, d.probe_partials}, d.max_segments, d.probe_bits);
        check_cuda(cudaGetLastError(), "probe_kernel launch");
      };
      if (splits == 1) {
        go(ProbePhase::kBoth);
      } else {
        go(ProbePhase::kPass1);
        go(ProbePhase::kPass2);
      }
    };
    vec16 ? run(std::true_type{}) : run(std::false_type{});
  };
  with_index_types(dtype, head_dim, launch);
}

}  // namespace sparse_prefill::cuda::index_stage
