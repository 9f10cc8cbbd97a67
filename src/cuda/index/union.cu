// Index stage, union mode (SelectionParams::union_lists): every tile of a (sequence, virtual KV head) gets the union
// of their lists.
#include <string>

#include "cuda/common/check.h"
#include "cuda/common/device_info.h"
#include "cuda/index/device_args.cuh"

namespace sparse_prefill::cuda::index_stage {
namespace {

// Union mode: one CTA per (sequence, KV head). The lists of the sequence's tiles are OR-ed into a shared-memory
// bitmap of its nb blocks (an overflowed tile's list is its full one), compacted (ascending) into slots taken from the
// block_ids cursor, and every tile's segment is pointed at it; with no room left, every tile of the (sequence, head)
// is marked overflowed instead (its full list). counters[kKept] is recounted as the union blocks each tile can see,
// counters[kOverflow] as the marked tiles; counters[kUnionPerTile] keeps the per-tile count for the report.
constexpr int kUnionThreads = 256;
__global__ void __launch_bounds__(kUnionThreads) union_kernel(SeqArgs seq, int group_size, int block_size,
                                                              int num_kv_heads, const int32_t* cu_tiles,
                                                              const int32_t* cu_blocks, int32_t* segment_start,
                                                              int32_t* segment_end, int32_t* block_ids,
                                                              int64_t capacity, unsigned long long* counters) {
  extern __shared__ uint32_t bits[];  // [words] bitmap, then [words + 1] exclusive prefix counts
  __shared__ int scan[kUnionThreads];
  __shared__ int64_t base;  // the union's first slot (kOverflowStart: no room)
  const int b = blockIdx.x, kvh = blockIdx.y;  // the grid is exactly batch x virtual KV heads (launch_union)
  const int tiles = cu_tiles[b + 1] - cu_tiles[b];
  const int nb = cu_blocks[b + 1] - cu_blocks[b];
  const int words = (nb + 31) / 32;
  uint32_t* prefix = bits + words;
  const int64_t seg0 = int64_t(num_kv_heads) * cu_tiles[b] + int64_t(kvh) * tiles;
  for (int w = threadIdx.x; w < words; w += kUnionThreads) bits[w] = 0;
  __syncthreads();
  unsigned long long per_tile = 0, over_before = 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int t = warp; t < tiles; t += kUnionThreads / 32) {
    const int lo = segment_start[seg0 + t], hi = segment_end[seg0 + t];
    if (lo == kOverflowStart) {  // blocks 0 .. hi - 1
      const int n = min(hi, nb);
      if (lane == 0) {
        per_tile += (unsigned long long)hi;
        ++over_before;
      }
      for (int w = lane; w < (n + 31) / 32; w += 32) {
        atomicOr(&bits[w], n - w * 32 >= 32 ? ~0u : (1u << (n - w * 32)) - 1u);
      }
      continue;
    }
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
  if (threadIdx.x == 0) {
    const unsigned long long at = total ? atomicAdd(&counters[kCursor], (unsigned long long)total) : 0ull;
    base = at + total <= (unsigned long long)capacity ? int64_t(at) : kOverflowStart;
  }
  __syncthreads();
  const bool fits = base != kOverflowStart;
  for (int w = w0; w < w1; ++w) {
    prefix[w] = uint32_t(offset);
    uint32_t m = bits[w];
    while (fits && m) {
      const int j = __ffs(m) - 1;
      m &= m - 1;
      block_ids[base + offset++] = w * 32 + j;
    }
  }
  if (threadIdx.x == 0) prefix[words] = uint32_t(total);
  __syncthreads();
  // Point every tile at the union (or mark it) and count the blocks each tile lists and sees (causal: blocks
  // 0 .. hi(last row)/B).
  const int64_t q_len = seq.q_len(b), k_len = seq.k_len(b), off = k_len - q_len;
  unsigned long long kept = 0;
  for (int t = threadIdx.x; t < tiles; t += kUnionThreads) {
    const int64_t rows = min(int64_t(kTileRows), q_len * group_size - int64_t(t) * kTileRows);
    const int64_t last_pos = (int64_t(t) * kTileRows + rows - 1) / group_size;
    const int64_t hi = min(k_len - 1, last_pos + off);
    const int nvis = hi >= 0 ? int(min(int64_t(nb), hi / block_size + 1)) : 0;
    segment_start[seg0 + t] = fits ? int32_t(base) : kOverflowStart;
    segment_end[seg0 + t] = fits ? int32_t(base + total) : nvis;
    const int w = nvis / 32, r = nvis % 32;
    kept += fits ? prefix[w] + (r ? __popc(bits[w] & ((1u << r) - 1u)) : 0u) : (unsigned long long)nvis;
  }
  for (int o = 16; o > 0; o /= 2) {
    kept += __shfl_xor_sync(0xffffffffu, kept, o);
    per_tile += __shfl_xor_sync(0xffffffffu, per_tile, o);
    over_before += __shfl_xor_sync(0xffffffffu, over_before, o);
  }
  if (lane == 0) {
    // kept and the overflow count replace the score kernel's (unsigned arithmetic wraps correctly).
    atomicAdd(&counters[kKept], kept - per_tile);
    atomicAdd(&counters[kUnionPerTile], per_tile);
    atomicAdd(&counters[kOverflow], (fits || warp != 0 ? 0ull : (unsigned long long)tiles) - over_before);
  }
}

}  // namespace

void launch_union(cudaStream_t stream, const SeqArgs& seq, const VirtualHeads& heads, int batch, int block_size,
                  int64_t nb_max, const DeviceIndex& d) {
  // The bitmap and its prefix counts in dynamic shared memory, within the default limit (no opt-in): the device's
  // per-block limit less the kernel's static scan array.
  const size_t dyn = size_t(2 * ((nb_max + 31) / 32) + 1) * 4;
  static const size_t limit = max_dynamic_smem_default(union_kernel);
  if (dyn > limit) {
    throw NotImplementedError("build_index on CUDA: union mode supports up to " +
                              std::to_string((limit / 4 - 1) / 2 * 32) + " blocks");
  }
  union_kernel<<<dim3(unsigned(batch), unsigned(heads.kv)), kUnionThreads, dyn, stream>>>(
      seq, heads.group, block_size, heads.kv, d.cu_tiles, d.cu_blocks, d.segment_start, d.segment_end, d.block_ids,
      d.capacity, d.counters);
  check_cuda(cudaGetLastError(), "union_kernel launch");
}

}  // namespace sparse_prefill::cuda::index_stage
