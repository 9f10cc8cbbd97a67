// Index stage, SelectionRule::kProbeRowMax: the exact block masses of the probe rows (every kProbeStride-th query
// of a sequence, and its last), on CUDA cores; their bits are OR-ed in by the scorer (score_select.cu).
#include <cmath>
#include <string>
#include <type_traits>

#include "cuda/common/check.h"
#include "cuda/common/device_info.h"
#include "cuda/common/math.h"
#include "cuda/index/device_args.cuh"

namespace sparse_prefill::cuda::index_stage {
namespace {

// SelectionRule::kProbeRowMax, the probe rows' half (the pooled-means half is the kRowMax scorer at
// kProbeMeanAlpha, which ORs these bits in): one CTA per (tile, virtual KV head). The tile's probe rows (packed rows
// of the queries i with i % kProbeStride == kProbeStride - 1 or i == q_len - 1) in batches of 16 (one m16 row block);
// per batch every visible key block's exact log-mass per row, w_rJ = log sum_j exp(scale q_r . k_j), kept in shared
// memory; then m_r = max_J w_rJ and J is set when w_rJ >= m_r + ln(alpha) for some row.
// Bits: probe_bits[seg * words + J / 32].
//
// The dot products on tensor cores (mma.sync m16n8k16 bf16 / fp16, m16n8k32 e4m3 on the raw FP8 values: the tile's
// descales fold into the scale, one (sequence, KV head) per CTA), fp32 accumulation: the same dot products as the
// float version up to summation order. Each warp takes whole key blocks (J = warp, warp + 4, ...) and streams them in
// chunks of 16 keys through two cp.async stages of its own; a row's block mass is a running log-sum-exp in the log2
// domain over the chunks. The CUDA-core version this replaces cost 1835 ms at 128K (Hq 32, Hkv 8): every probe row
// read each key as floats, one FMA per byte loaded. K is still read once per tile (the CTA's 16 rows), so at long
// prompts the L2 traffic (the visible keys of every tile) bounds it (docs/next_sparse_kernel.md: K shared by 8 tiles
// is the next step). NaN: no bit (the scorer's NaN rule keeps the tile whole).
constexpr int kProbeWarps = 4, kProbeThreads = 32 * kProbeWarps, kProbeBatch = 16, kChunkKeys = 16;

// A row of q or k in shared memory: the row's bytes plus 16, so the 8 rows of an ldmatrix hit distinct bank groups.
template <typename T, int D>
constexpr int probe_row_bytes() { return D * int(sizeof(T)) + 16; }
template <typename T, int D>
constexpr size_t probe_smem_bytes(int64_t nb_max, int64_t words) {
  return size_t(kProbeBatch + 2 * kProbeWarps * kChunkKeys) * probe_row_bytes<T, D>() +
         size_t(kProbeBatch * nb_max + words) * 4;
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
// (m, l) <- the log2-sum-exp2 of (m, l) and (m2, l2): a running maximum m and the sum l of exp2(x - m).
__device__ __forceinline__ void lse2_merge(float& m, float& l, float m2, float l2) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;
  l = l * exp2f(m - mn) + l2 * exp2f(m2 - mn);
  m = mn;
}

// kVec16: K's base and strides are multiples of 16 bytes (16-byte cp.async copies), else element copies.
template <typename T, int D, bool kVec16>
__global__ void __launch_bounds__(kProbeThreads) probe_kernel(SeqArgs seq, QArgs qa, KVArgs kv, SelectArgs sel,
                                                             int group_size, int num_kv_heads, int subgroups,
                                                             const int32_t* cu_tiles, int64_t words,
                                                             uint32_t* probe_bits) {
  constexpr int kRowBytes = D * int(sizeof(T)), kStride = probe_row_bytes<T, D>(), kSteps = kRowBytes / 32;
  constexpr int kParts = kRowBytes / 16;  // 16-byte pieces of a row
  extern __shared__ __align__(16) unsigned char probe_smem[];
  const SelectTile st = select_tile(seq, cu_tiles);
  if (st.b < 0) return;
  const int kvh = st.kvh, b = st.b;
  const int64_t t = st.t, tiles = st.tiles, q_len = st.q_len, k_len = st.k_len, off = st.off;
  const int64_t rows = min(int64_t(kTileRows), q_len * group_size - t * kTileRows);
  const int B = sel.block_size;
  const int64_t last_pos = (t * kTileRows + rows - 1) / group_size;
  const int64_t hi_last = min(k_len - 1, last_pos + off);
  const int64_t nvis = hi_last >= 0 ? hi_last / B + 1 : 0;
  const int64_t seg = int64_t(num_kv_heads) * cu_tiles[b] + kvh * tiles + t;
  unsigned char* qs = probe_smem;                                        // [kProbeBatch][kStride] raw q rows
  unsigned char* kbuf = qs + kProbeBatch * kStride;                      // [warp][stage][kChunkKeys][kStride]
  float* mass = reinterpret_cast<float*>(kbuf + 2 * kProbeWarps * kChunkKeys * kStride);  // [kProbeBatch][nvis]
  uint32_t* bits = reinterpret_cast<uint32_t*>(mass + kProbeBatch * nvis);               // [words]
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
  const int kv_mem = kvh / subgroups;
  float scale2 = sel.scale_log2;  // scores in the log2 domain: w2 = log2 sum exp2(scale_log2 q . k)
  if constexpr (is_fp8_v<T>) scale2 *= qa.descale.at(b, kv_mem) * kv.k_descale.at(b, kv_mem);
  const float log2_alpha = sel.alpha > 0.f ? log2f(sel.alpha) : -INFINITY;
  const unsigned char* kbase = static_cast<const unsigned char*>(kv.k);
  unsigned char* my_kbuf = kbuf + warp * 2 * kChunkKeys * kStride;
  // The chunks of this warp's blocks, flattened: chunk i of block J covers keys J * B + i * kChunkKeys + [0, 16).
  const int chunks_per_block = B / kChunkKeys;
  const int64_t my_blocks = nvis > warp ? (nvis - warp + kProbeWarps - 1) / kProbeWarps : 0;
  const int64_t my_chunks = my_blocks * chunks_per_block;
  auto chunk_key0 = [&](int64_t c) {
    return (warp + (c / chunks_per_block) * kProbeWarps) * int64_t(B) + (c % chunks_per_block) * kChunkKeys;
  };
  // Loads chunk c into stage c % 2 (one commit group); returns the chunk's valid keys as bits (key < k_len, page
  // id in range). Lanes 0-15 own a key each (address, validity); the 16-byte pieces go round the warp.
  auto load_chunk = [&](int64_t c) -> uint32_t {
    const int64_t j = chunk_key0(c) + lane;
    int64_t ko = -1;
    if (lane < kChunkKeys && j < k_len) {
      if (kv.block_table) {
        const int64_t page = kv.page(b, j);
        if (page >= 0) ko = page * kv.k_stride[0] + (j % kv.page_size) * kv.k_stride[1] + kv_mem * kv.k_stride[2];
      } else {
        ko = (seq.k_start(b) + j) * kv.k_stride[0] + kv_mem * kv.k_stride[1];
      }
    }
    const uint32_t valid = __ballot_sync(0xffffffffu, ko >= 0) & ((1u << kChunkKeys) - 1);
    unsigned char* dst0 = my_kbuf + (c % 2) * kChunkKeys * kStride;
    for (int p = lane; p < kChunkKeys * kParts; p += 32) {
      const int key = p / kParts, part = p % kParts;
      const int64_t kko = __shfl_sync(0xffffffffu, ko, key);
      unsigned char* dst = dst0 + key * kStride + part * 16;
      if constexpr (kVec16) {
        const unsigned char* src = kko >= 0 ? kbase + kko * int64_t(sizeof(T)) + part * 16 : kbase;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                     "r"(kko >= 0 ? 16 : 0));
      } else {
        constexpr int kElems = 16 / int(sizeof(T));
        T* d = reinterpret_cast<T*>(dst);
        const T* src = reinterpret_cast<const T*>(kbase) + kko + part * kElems;
#pragma unroll
        for (int e = 0; e < kElems; ++e) d[e] = kko >= 0 ? src[e] : T{};
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
    return valid;
  };
  const int g = lane / 4, tq = lane % 4;  // mma fragment coordinates: rows g, g + 8; key columns 2 tq, 2 tq + 1
  for (int b0 = 0; b0 < n_probe; b0 += kProbeBatch) {
    const int nr = min(kProbeBatch, n_probe - b0);
    for (int i = threadIdx.x; i < kProbeBatch * D; i += kProbeThreads) {
      const int rr = i / D, d = i % D;
      T x{};
      if (rr < nr) {
        const int pr = int(t) * kTileRows + probe_rows[b0 + rr];
        x = static_cast<const T*>(qa.q)[(seq.q_start(b) + pr / group_size) * qa.stride_row +
                                        (kvh * group_size + pr % group_size) * qa.stride_head + d];
      }
      reinterpret_cast<T*>(qs + rr * kStride)[d] = x;
    }
    __syncthreads();
    // the batch's 16 rows as A fragments, every k step (ldmatrix.x4: rows 0-7 / 8-15, bytes 0-15 / 16-31)
    uint32_t a[kSteps][4];
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
      ldmatrix_x4(a[s], smem_addr(qs + ((lane % 8) + 8 * ((lane / 8) % 2)) * kStride + s * 32 + 16 * (lane / 16)));
    // the key limit of this thread's two rows (causal, bottom-right); rows past the batch see nothing
    int64_t lim[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rr = g + 8 * h;
      lim[h] = rr < nr ? (t * kTileRows + probe_rows[b0 + rr]) / group_size + off : -1;
    }
    uint32_t valid_next = my_chunks > 0 ? load_chunk(0) : 0u;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // the current block's running log2-sum-exp2
    bool nan[2] = {false, false};                                // a NaN score in it (its mass becomes NaN)
    for (int64_t c = 0; c < my_chunks; ++c) {
      const uint32_t valid = valid_next;
      if (c + 1 < my_chunks) {
        valid_next = load_chunk(c + 1);
        asm volatile("cp.async.wait_group 1;\n" ::);
      } else {
        asm volatile("cp.async.wait_group 0;\n" ::);
      }
      __syncwarp();
      const unsigned char* kb = my_kbuf + (c % 2) * kChunkKeys * kStride;
      float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        // B fragments of the chunk's two n8 tiles (keys 0-7 / 8-15, bytes 0-15 / 16-31 of the k step)
        uint32_t bf[4];
        ldmatrix_x4(bf, smem_addr(kb + ((lane % 8) + 8 * (lane / 16)) * kStride + s * 32 + 16 * ((lane / 8) % 2)));
        mma_k32bytes<T>(acc[0], a[s], bf[0], bf[1]);
        mma_k32bytes<T>(acc[1], a[s], bf[2], bf[3]);
      }
      const int64_t j0 = chunk_key0(c);
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // row g + 8 h: acc[n][2 h], acc[n][2 h + 1] are keys 8 n + 2 tq, + 1
        float x[4];
        float cm = -INFINITY;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = 8 * (e / 2) + 2 * tq + (e % 2);
          const bool sees = ((valid >> key) & 1u) && j0 + key <= lim[h];
          x[e] = sees ? acc[e / 2][2 * h + (e % 2)] * scale2 : -INFINITY;
          nan[h] |= x[e] != x[e];
          cm = fmaxf(cm, x[e]);  // fmaxf drops NaN: the flag carries it
        }
        if (cm != -INFINITY) {
          float cl = 0.f;
#pragma unroll
          for (int e = 0; e < 4; ++e) cl += x[e] != x[e] ? 0.f : exp2f(x[e] - cm);
          lse2_merge(m[h], l[h], cm, cl);
        }
      }
      __syncwarp();  // every lane done with this stage before the chunk after next overwrites it
      if ((c + 1) % chunks_per_block == 0) {  // the block's last chunk: merge the quad's partial sums, store
        const int64_t J = warp + (c / chunks_per_block) * kProbeWarps;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int o = 1; o < 4; o *= 2) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m[h], o), l2 = __shfl_xor_sync(0xffffffffu, l[h], o);
            nan[h] |= __shfl_xor_sync(0xffffffffu, int(nan[h]), o) != 0;
            lse2_merge(m[h], l[h], m2, l2);
          }
          const int rr = g + 8 * h;
          if (tq == 0 && rr < nr)
            mass[rr * nvis + J] = nan[h] ? NAN : m[h] == -INFINITY ? -INFINITY : m[h] + log2f(l[h]);
          m[h] = -INFINITY, l[h] = 0.f, nan[h] = false;
        }
      }
    }
    __syncthreads();
    // the row-max test of the batch's rows: warp w takes rows w, w + kProbeWarps, ...
    for (int rr = warp; rr < nr; rr += kProbeWarps) {
      float mx = -INFINITY;
      for (int64_t J = lane; J < nvis; J += 32) mx = fmaxf(mx, mass[rr * nvis + J]);
      for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      if (mx == -INFINITY || mx != mx) continue;  // sees nothing, or NaN (the scorer's NaN rule)
      for (int64_t J = lane; J < nvis; J += 32) {
        const float w = mass[rr * nvis + J];
        if (w != -INFINITY && w - mx >= log2_alpha) atomicOr(&bits[J / 32], 1u << (J % 32));
      }
    }
    __syncthreads();
  }
  for (int64_t w = threadIdx.x; w < words; w += kProbeThreads) probe_bits[seg * words + w] = bits[w];
}

}  // namespace

void launch_probe(cudaStream_t stream, DType dtype, int head_dim, dim3 grid, const SeqArgs& seq, const QArgs& qa,
                  const KVArgs& kv, const SelectArgs& sel, const VirtualHeads& heads, int64_t nb_max,
                  const DeviceIndex& d) {
  auto launch = [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int kD = decltype(dim)::value;
    const size_t probe_smem = probe_smem_bytes<T, kD>(nb_max, d.probe_words);
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
      if (probe_smem > probe_limit) {
        const size_t fixed = probe_smem_bytes<T, kD>(0, 0);
        throw NotImplementedError("build_index on CUDA: rule='probe_row_max' supports up to " +
                                  std::to_string((probe_limit - fixed) / 4 / (kProbeBatch + 1)) +
                                  " blocks per sequence");
      }
      kernel<<<grid, kProbeThreads, probe_smem, stream>>>(seq, qa, kv, sel, heads.group, heads.kv, heads.subgroups,
                                                          d.cu_tiles, d.probe_words, d.probe_bits);
      check_cuda(cudaGetLastError(), "probe_kernel launch");
    };
    vec16 ? run(std::true_type{}) : run(std::false_type{});
  };
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  const bool bf16 = dtype == DType::kBFloat16;
  if (dtype == DType::kFloat8E4M3) {
    launch(__nv_fp8_e4m3{}, D128{});  // FP8: head dim 128 only (build.cu)
  } else if (head_dim == 128) {
    bf16 ? launch(__nv_bfloat16{}, D128{}) : launch(__half{}, D128{});
  } else {
    bf16 ? launch(__nv_bfloat16{}, D64{}) : launch(__half{}, D64{});
  }
}

}  // namespace sparse_prefill::cuda::index_stage
