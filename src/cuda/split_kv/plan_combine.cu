// Split-KV for the block-sparse kernel, all on the device (no host synchronisation, graph-capturable):
//   plan (before the launch): total planned steps of all tiles, then cap = max(kMinCap, ceil(total / SMs))
//     (SplitRule); every tile with more planned steps than cap becomes nsplit = ceil(steps / cap) units (at most 32), each a
//     contiguous share of the tile's steps writing float32 partials (SparseLaunchWorkspace, split_kv.h). Why: one
//     heavy tile (the final chunk's dense last_n tiles see every block: 1032 steps at 128K against ~15 for the
//     others) otherwise runs alone on one SM long after the rest finished. Tiles no heavier than cap keep one unit
//     and write out directly, so balanced shapes pay nothing for the split.
//   order: the split tiles sorted, their units numbered split-major (plan_order_kernel);
//   combine (after the launch): out = sum_s exp(lse_s - lse) O_s, lse = log sum_s exp(lse_s), one warp per row of
//     a split tile, one lane per split.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <stdexcept>
#include <string>

#include "core/geometry.h"
#include "cuda/attention/block_schedule.h"
#include "cuda/attention/fwd_args.h"
#include "cuda/common/check.h"
#include "cuda/common/workspace.h"
#include "cuda/split_kv/rule.h"
#include "cuda/split_kv/split_kv.h"

namespace sparse_prefill::cuda {
namespace {

using LW = SparseLaunchWorkspace;
constexpr int kRows = geometry::kTileRows;  // rows of a PackGQA tile (FwdConfig::kBlockM)
constexpr int kStepKeys = 128;  // keys of a kernel step (FwdConfig::kBlockN)

// The sparse kernel's work order (sparse_tile_coord) as the plan and the combine see it.
struct TileOrder {
  int num_kv_heads, batch, max_tiles, group_size, band;
  static TileOrder of(const FwdArgs& a, const SparseFwdArgs& s) {  // virtual KV heads with head sub-groups
    const int heads = geometry::virtual_kv_heads(a.num_kv_heads, s.num_subgroups), g = a.num_q_heads / heads;
    return {heads, a.batch, int(geometry::num_tiles(a.max_seqlen_q, g)), g, s.order_band};
  }
  __device__ SparseTileCoord coord(int t) const {
    return sparse_tile_coord(t, num_kv_heads, batch, max_tiles, band);
  }
  int64_t tiles() const { return int64_t(num_kv_heads) * max_tiles * batch; }
};

struct PlanArgs {
  TileOrder order;
  const int* cu_q;
  const int* cu_k;
  const int* seqused_k;
  const int32_t* cu_tiles;
  const int32_t* seg_start;
  const int32_t* seg_end;
  int block_size, correction, num_coord_tiles, num_sms;
  int full_list, causal;  // SparseFwdArgs::full_list: dense PackGQA tiles, no index arrays
  int overflow_marks;     // SparseFwdArgs::overflow_marks
  // Device-side checks (device_checks.h), as the kernel's tile_work makes them: a bad tile has no planned step.
  SeqLimits limits;
  int num_segments, num_block_ids, mean_rows;
  const int32_t* cu_blocks;  // correction on: the pooled rows are checked (else null)
  int* counters;
  int32_t* split_tiles;
  int32_t* slot_tile;
};

// Planned steps of work-order tile t (0 for a tile beyond its sequence); the kernel's CsrBlocks::work()
// (attention/tile_work.h) decides from the same SparseBlockIterator::planned_steps.
__device__ int tile_steps(const PlanArgs& a, int t) {
  using It = SparseBlockIterator<kStepKeys>;
  const SparseTileCoord c = a.order.coord(t);
  const SeqSpan s = load_seq_span(a.cu_q, a.cu_k, a.seqused_k, c.batch);
  if (seq_violation(s, c.batch, a.limits)) return 0;
  if (a.full_list) {
    if (c.tile >= It::packed_tiles(s.q_len, a.order.group_size)) return 0;
    return It::full_list_blocks(c.tile * kRows, a.order.group_size, s.q_len, s.k_len, a.causal != 0);
  }
  const int tile_base = a.cu_tiles[c.batch];
  const int tiles = a.cu_tiles[c.batch + 1] - tile_base;
  if (c.tile >= tiles) return 0;
  const int seg = a.order.num_kv_heads * tile_base + c.kv_head * tiles + c.tile;
  int lo = 0, n_listed = 0;
  if (sparse_index_violation(a.seg_start, a.seg_end, seg, a.num_segments, a.num_block_ids, a.overflow_marks != 0,
                             a.cu_blocks, c.batch, s.k_len, a.block_size, a.mean_rows, lo, n_listed))
    return 0;
  if (lo == kOverflowStart) {  // the full list, as the kernel's tile lookup counts it
    n_listed = It::full_list_blocks(c.tile * kRows, a.order.group_size, s.q_len, s.k_len, true, a.block_size);
  }
  return SparseBlockIterator<kStepKeys>::planned_steps(n_listed, c.tile * kRows / a.order.group_size, s.q_len, s.k_len,
                                                       a.block_size, a.correction != 0);
}

__global__ void __launch_bounds__(256) plan_total_kernel(PlanArgs a) {
  const int t = blockIdx.x * 256 + threadIdx.x;
  unsigned long long v = t < a.num_coord_tiles ? (unsigned long long)tile_steps(a, t) : 0ull;
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  __shared__ unsigned long long warp_sum[8];
  if (threadIdx.x % 32 == 0) warp_sum[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long sum = 0;
    for (int w = 0; w < 8; ++w) sum += warp_sum[w];
    if (sum) atomicAdd(reinterpret_cast<unsigned long long*>(a.counters + LW::kTotalLo), sum);
  }
}

__device__ int plan_cap(const PlanArgs& a) {
  return SplitRule::cap(*reinterpret_cast<const unsigned long long*>(a.counters + LW::kTotalLo), a.num_sms);
}

__global__ void __launch_bounds__(256) plan_split_kernel(PlanArgs a) {
  const int cap = plan_cap(a);
  const int t = blockIdx.x * 256 + threadIdx.x;
  if (t == 0) a.counters[LW::kCap] = cap;
  if (t >= a.num_coord_tiles) return;
  const int steps = tile_steps(a, t);
  const int nsplit = SplitRule::nsplit(steps, cap);  // the bounds of the workspace arrays hold (SplitRule)
  if (nsplit == 1) return;
  const int idx = atomicAdd(a.counters + LW::kSplitTiles, 1);  // arbitrary order: plan_order_kernel sorts
  atomicAdd(a.counters + LW::kSplitUnits, nsplit);
  reinterpret_cast<int4*>(a.split_tiles)[idx] = make_int4(t, nsplit, 0, 0);
}

// One CTA: sorts the split tiles by (nsplit descending, tile) and numbers their units split-major (split 0 of every
// tile, then split 1, ...; the tiles with nsplit > s are a prefix of the sorted list, so split s of entry e is unit
// base_s + e). Deterministic, and the units running together read the same key ranges: the g-head tiles of one KV
// head (neighbours in the tile order) share them in L2 instead of each streaming the whole cache from DRAM.
constexpr int kOrderThreads = 1024, kOrderMax = 2048;  // max_split_tiles <= 2048 (checked on the host)
__global__ void __launch_bounds__(kOrderThreads) plan_order_kernel(PlanArgs a) {
  __shared__ unsigned long long key[kOrderMax];
  __shared__ int count_gt[SplitRule::kMaxSplits + 1];  // count_gt[s]: entries with nsplit > s
  const int n = a.counters[LW::kSplitTiles];
  if (n == 0) return;
  int4* entries = reinterpret_cast<int4*>(a.split_tiles);
  int len = 1;
  while (len < n) len *= 2;
  for (int i = threadIdx.x; i < len; i += kOrderThreads) {
    if (i < n) {
      const int4 e = entries[i];
      key[i] = (static_cast<unsigned long long>(SplitRule::kMaxSplits - e.y) << 32) | static_cast<unsigned>(e.x);
    } else {
      key[i] = ~0ull;
    }
  }
  if (threadIdx.x <= SplitRule::kMaxSplits) count_gt[threadIdx.x] = 0;
  __syncthreads();
  for (int k = 2; k <= len; k *= 2) {  // bitonic sort, ascending
    for (int j = k / 2; j > 0; j /= 2) {
      for (int i = threadIdx.x; i < len; i += kOrderThreads) {
        const int partner = i ^ j;
        if (partner > i) {
          const bool up = (i & k) == 0;
          const unsigned long long x = key[i], y = key[partner];
          if ((x > y) == up) {
            key[i] = y;
            key[partner] = x;
          }
        }
      }
      __syncthreads();
    }
  }
  for (int i = threadIdx.x; i < n; i += kOrderThreads) {
    const int nsplit = SplitRule::kMaxSplits - int(key[i] >> 32);
    const int next = i + 1 < n ? SplitRule::kMaxSplits - int(key[i + 1] >> 32) : 0;
    for (int s = next; s < nsplit; ++s) count_gt[s] = i + 1;  // the last entry with nsplit > s is i
    entries[i] = make_int4(int(key[i] & 0xffffffffu), nsplit, 0, 0);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int base = 0;
    for (int s = 0; s < SplitRule::kMaxSplits; ++s) {
      a.counters[LW::kSplitBase + s] = base;
      base += count_gt[s];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += kOrderThreads) {
    const int nsplit = entries[i].y;
    for (int s = 0; s < nsplit; ++s) a.slot_tile[a.counters[LW::kSplitBase + s] + i] = i | (s << 16);
  }
}

template <typename T>
__device__ void store4(T* dst, float4 v);
template <>
__device__ void store4<__nv_bfloat16>(__nv_bfloat16* dst, float4 v) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  uint2 u;
  u.x = *reinterpret_cast<uint32_t*>(&lo);
  u.y = *reinterpret_cast<uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(dst) = u;
}
template <>
__device__ void store4<__half>(__half* dst, float4 v) {
  __half2 lo = __floats2half2_rn(v.x, v.y), hi = __floats2half2_rn(v.z, v.w);
  uint2 u;
  u.x = *reinterpret_cast<uint32_t*>(&lo);
  u.y = *reinterpret_cast<uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(dst) = u;
}

struct CombineArgs {
  TileOrder order;
  const int* cu_q;
  const int* counters;
  const int32_t* split_tiles;
  const float* o_partial;
  const float* lse_partial;
  void* out;
  float* lse;
  int64_t o_rs, o_hs, l_hs, l_rs;
};

// One warp per row of a split tile (grid-stride over n_split_tiles x 128 rows), one lane per split: the rows of a
// few heavy tiles spread over the whole GPU (one CTA per tile left 16 SMs doing 28 splits x 32 rows each: ~0.8 ms).
constexpr int kCombineWarps = 8;
template <typename T, int D>
__global__ void __launch_bounds__(kCombineWarps * 32) split_combine_kernel(CombineArgs a) {
  const int n_rows = a.counters[LW::kSplitTiles] * kRows;
  const int lane = threadIdx.x % 32;
  constexpr int kPer = D / 32;
  static_assert(kPer == 4, "one float4 per lane");
  for (int item = blockIdx.x * kCombineWarps + threadIdx.x / 32; item < n_rows; item += gridDim.x * kCombineWarps) {
    const int idx = item / kRows, r = item % kRows;
    const int4 e = reinterpret_cast<const int4*>(a.split_tiles)[idx];
    const int nsplit = e.y;
    const SparseTileCoord c = a.order.coord(e.x);
    const int g = a.order.group_size;
    const int q_start = a.cu_q[c.batch], q_len = a.cu_q[c.batch + 1] - q_start;
    const int row0 = c.tile * kRows;
    if (r >= q_len * g - row0) continue;  // rows past the sequence
    const int my_slot = lane < nsplit ? a.counters[LW::kSplitBase + lane] + idx : 0;
    const float l = lane < nsplit ? a.lse_partial[int64_t(my_slot) * kRows + r] : -INFINITY;
    float m = l;
    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float w = m == -INFINITY ? 0.f : expf(l - m);
    float sum = w;
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    // A NaN partial (a unit that met a bad page or block id, device_checks.h) makes the row NaN.
    w = sum > 0.f ? w / sum : (sum != sum ? sum : 0.f);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = 0; s < nsplit; ++s) {
      const float ws = __shfl_sync(0xffffffffu, w, s);
      const int slot = __shfl_sync(0xffffffffu, my_slot, s);
      const float4 v = *reinterpret_cast<const float4*>(a.o_partial + (int64_t(slot) * kRows + r) * D + lane * kPer);
      if (ws != 0.f) {  // an empty share (lse = -inf) has weight 0 (its partial holds zeros)
        acc.x += ws * v.x;
        acc.y += ws * v.y;
        acc.z += ws * v.z;
        acc.w += ws * v.w;
      }
    }
    const int pos = (row0 + r) / g;
    const int head = c.kv_head * g + (row0 + r) % g;
    T* dst = static_cast<T*>(a.out) + int64_t(q_start + pos) * a.o_rs + int64_t(head) * a.o_hs + lane * kPer;
    store4<T>(dst, acc);
    if (a.lse != nullptr && lane == 0)
      a.lse[int64_t(head) * a.l_hs + int64_t(q_start + pos) * a.l_rs] =
          sum != sum ? sum : (m == -INFINITY || !(sum > 0.f)) ? -INFINITY : m + logf(sum);
  }
}

// The launch workspace's layout: counters, then (with_split) the plan arrays and the partials for the bounds of
// SplitRule (num_sms split tiles, 2 x num_sms units). Sizes only when the carver has no base.
SparseLaunchWorkspace carve_launch(WorkspaceCarver& ws, int num_sms, int head_dim, bool with_split) {
  SparseLaunchWorkspace w;
  w.num_sms = num_sms;
  w.counters = ws.take_array<int>(LW::kCounters);
  if (!with_split) return w;
  w.max_split_units = 2 * num_sms;
  w.max_split_tiles = num_sms;
  w.split_tiles = ws.take_array<int32_t>(size_t(w.max_split_tiles) * 4);
  w.slot_tile = ws.take_array<int32_t>(size_t(w.max_split_units));
  w.o_partial = ws.take_array<float>(size_t(w.max_split_units) * kRows * head_dim);
  w.lse_partial = ws.take_array<float>(size_t(w.max_split_units) * kRows);
  return w;
}

}  // namespace

size_t sparse_launch_workspace_bytes(int num_sms, int head_dim, bool with_split) {
  WorkspaceCarver sizing;
  carve_launch(sizing, num_sms, head_dim, with_split);
  return sizing.bytes();
}

SparseLaunchWorkspace carve_sparse_launch_workspace(void* base, int num_sms, int head_dim, bool with_split) {
  if (num_sms > kOrderMax)
    throw std::runtime_error("sparse_prefill cuda: the split plan is built for at most 1024 SMs");
  WorkspaceCarver ws(base);
  return carve_launch(ws, num_sms, head_dim, with_split);
}

void run_split_plan(const FwdArgs& a, const SparseFwdArgs& s) {
  const SparseLaunchWorkspace& w = s.launch;
  if (w.counters == nullptr) return;
  cudaStream_t stream = static_cast<cudaStream_t>(a.in.stream);
  check_cuda(cudaMemsetAsync(w.counters, 0, LW::kCounters * sizeof(int), stream), "cudaMemsetAsync (sparse counters)");
  if (!w.plan || a.total_q == 0 || a.batch == 0) return;
  PlanArgs p;
  p.cu_q = a.in.cu_seqlens_q;
  p.cu_k = a.in.cu_seqlens_k;
  p.seqused_k = a.in.seqused_k;  // null for contiguous KV (launch_inputs)
  p.cu_tiles = s.cu_tiles;
  p.seg_start = s.segment_start;
  p.seg_end = s.segment_end;
  p.order = TileOrder::of(a, s);
  p.block_size = s.block_size;
  p.correction = sparse_correction_on(s) ? 1 : 0;
  p.full_list = s.full_list ? 1 : 0;
  p.overflow_marks = s.overflow_marks ? 1 : 0;
  p.causal = a.causal ? 1 : 0;
  p.limits = a.in.limits;
  p.num_segments = s.num_segments;
  p.num_block_ids = s.num_block_ids;
  p.mean_rows = int(std::max<int64_t>(s.mean_rows, 1));
  p.cu_blocks = nullptr;  // pooled rows: TMA-clipped to the means (in bounds); not checked (the kernel's registers)
  const int64_t coord = p.order.tiles();
  if (coord == 0) return;
  if (coord > INT32_MAX) throw std::runtime_error("sparse_prefill cuda: too many tiles");
  p.num_coord_tiles = int(coord);
  p.num_sms = w.num_sms;
  p.counters = w.counters;
  p.split_tiles = w.split_tiles;
  p.slot_tile = w.slot_tile;
  const unsigned grid = unsigned((coord + 255) / 256);
  plan_total_kernel<<<grid, 256, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "split plan launch");
  plan_split_kernel<<<grid, 256, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "split plan launch");
  plan_order_kernel<<<1, kOrderThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "split plan launch");
}

void run_split_combine(const FwdArgs& a, const SparseFwdArgs& s, bool bf16) {
  const SparseLaunchWorkspace& w = s.launch;
  if (w.counters == nullptr || !w.plan || a.total_q == 0 || a.batch == 0) return;
  if (a.head_dim != 128) throw std::runtime_error("sparse_prefill cuda: split combine is built for head dim 128");
  CombineArgs c;
  c.order = TileOrder::of(a, s);
  c.cu_q = a.in.cu_seqlens_q;
  c.counters = w.counters;
  c.split_tiles = w.split_tiles;
  c.o_partial = w.o_partial;
  c.lse_partial = w.lse_partial;
  c.out = a.out;
  c.lse = a.lse;
  c.o_rs = a.o_row_stride;
  c.o_hs = a.o_head_stride;
  c.l_hs = a.lse_head_stride;
  c.l_rs = a.lse_row_stride;
  cudaStream_t stream = static_cast<cudaStream_t>(a.in.stream);
  const int grid = w.max_split_units;  // 2 CTAs of 8 warps per SM
  if (bf16)
    split_combine_kernel<__nv_bfloat16, 128><<<grid, kCombineWarps * 32, 0, stream>>>(c);
  else
    split_combine_kernel<__half, 128><<<grid, kCombineWarps * 32, 0, stream>>>(c);
  check_cuda(cudaGetLastError(), "combine launch");
}

}  // namespace sparse_prefill::cuda
