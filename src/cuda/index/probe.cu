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
// of the queries i with i % kProbeStride == kProbeStride - 1 or i == q_len - 1) in batches of kProbeBatch; per batch
// every visible key block's exact log-mass per row, w_rJ = log sum_j exp(scale q_r . k_j) (float, CUDA cores: a warp
// per block, 4 keys per lane at block 128, the batch's rows against each key), kept in shared memory; then
// m_r = max_J w_rJ and J is set when w_rJ >= m_r + ln(alpha) for some row. Bits: probe_bits[seg * words + J / 32].
// Correctness first: every probe row reads all its visible keys (the tensor-core version, K shared by 8 tiles:
// docs/next_sparse_kernel.md). NaN: no bit (the scorer's NaN rule keeps the tile whole). FP8: the raw e4m3 values
// are read and the tile's descales folded into the q rows' factor (q_descale * k_descale * scale: one (sequence, KV
// head) per CTA), which is the dot product of the dequantised values up to float rounding.
constexpr int kProbeThreads = 256, kProbeBatch = 16;

template <typename T, int D>
__global__ void __launch_bounds__(kProbeThreads) probe_kernel(SeqArgs seq, QArgs qa, KVArgs kv, SelectArgs sel,
                                                             int group_size, int num_kv_heads, int subgroups,
                                                             const int32_t* cu_tiles, int64_t words,
                                                             uint32_t* probe_bits) {
  extern __shared__ __align__(16) float probe_smem[];
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
  float scale = sel.scale_log2 / float(kLog2e);  // softmax_scale
  const float log_alpha = sel.alpha > 0.f ? logf(sel.alpha) : -INFINITY;
  const int kv_mem = kvh / subgroups;
  if constexpr (is_fp8_v<T>) scale *= qa.descale.at(b, kv_mem) * kv.k_descale.at(b, kv_mem);
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

}  // namespace

void launch_probe(cudaStream_t stream, DType dtype, int head_dim, dim3 grid, const SeqArgs& seq, const QArgs& qa,
                  const KVArgs& kv, const SelectArgs& sel, const VirtualHeads& heads, int64_t nb_max,
                  const DeviceIndex& d) {
  auto launch = [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int kD = decltype(dim)::value;
    const size_t probe_smem = size_t(kProbeBatch * kD + kProbeBatch * nb_max + d.probe_words) * 4;
    auto probe = probe_kernel<T, kD>;
    // the device's opt-in limit less the kernel's 1 KB of static shared memory (the opt-in limit alone is refused)
    static const size_t probe_limit = [&] {
      const size_t limit = max_dynamic_smem_optin(probe);
      check_cuda(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, int(limit)),
                 "cudaFuncSetAttribute(probe_kernel)");
      return limit;
    }();
    if (probe_smem > probe_limit)
      throw NotImplementedError("build_index on CUDA: rule='probe_row_max' supports up to " +
                                std::to_string((probe_limit / 4 - kProbeBatch * kD) / (kProbeBatch + 1)) +
                                " blocks per sequence");
    probe<<<grid, kProbeThreads, probe_smem, stream>>>(seq, qa, kv, sel, heads.group, heads.kv, heads.subgroups,
                                                       d.cu_tiles, d.probe_words, d.probe_bits);
    check_cuda(cudaGetLastError(), "probe_kernel launch");
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
