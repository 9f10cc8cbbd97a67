// Index stage, step 4: the dense rule (SelectionParams::dense_fraction, keeps_all in sparse.h). A call whose selection
// keeps at least that fraction of its visible blocks keeps them all: every segment becomes a full list (kOverflowStart with
// segment_end = its visible blocks, what an overflowed segment holds), counters[kKept] = counters[kVisible] and
// counters[kDense] = 1. The sparse kernel, the split plan and the host copy then run or list every visible block,
// and a one-shot launch reads counters[kDense] to run the dense kernel instead of the sparse one (cuda_backend.cpp).
// Decided on the device after the last selection kernel (score, or union): no host synchronisation.
#include "cuda/attention/block_schedule.h"
#include "cuda/common/check.h"
#include "cuda/index/device_args.cuh"

namespace sparse_prefill::cuda::index_stage {
namespace {

constexpr int kDenseRuleThreads = 256;

__global__ void __launch_bounds__(kDenseRuleThreads) dense_rule_kernel(SeqArgs seq, int group_size, int block_size,
                                                                       int num_kv_heads, float dense_fraction,
                                                                       const int32_t* cu_tiles, int32_t* segment_start,
                                                                       int32_t* segment_end,
                                                                       unsigned long long* counters) {
  // Thread (0, 0) raises counters[kKept] to counters[kVisible] below; any thread reading it after that sees a
  // selection that keeps everything, the same decision.
  const unsigned long long kept = counters[kKept], visible = counters[kVisible];
  if (!keeps_all(int64_t(kept), int64_t(visible), dense_fraction)) return;
  const int64_t heads = num_kv_heads;
  const int64_t segments = heads * cu_tiles[seq.batch];
  for (int64_t s = int64_t(blockIdx.x) * kDenseRuleThreads + threadIdx.x; s < segments;
       s += int64_t(gridDim.x) * kDenseRuleThreads) {
    // Segment s = H * cu_tiles[b] + kvh * tiles + t (SparseFwdArgs): its sequence and tile.
    const int b = find_sequence(cu_tiles, seq.batch, s / heads);
    const int64_t tiles = cu_tiles[b + 1] - cu_tiles[b];
    const int64_t t = (s - heads * cu_tiles[b]) % tiles;
    segment_start[s] = kOverflowStart;
    segment_end[s] = SparseBlockIterator<geometry::kKeyStep>::full_list_blocks(
        int(t * kTileRows), group_size, int(seq.q_len(b)), int(seq.k_len(b)), /*causal=*/true, block_size);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    counters[kDense] = 1;
    counters[kKept] = visible;
  }
}

}  // namespace

void launch_dense_rule(cudaStream_t stream, const SeqArgs& seq, const VirtualHeads& heads, int block_size,
                       float dense_fraction, const Bounds& bd, const DeviceIndex& d) {
  if (bd.max_segments <= 0 || dense_fraction >= 1.f) return;  // 1: the rule is off
  // One thread per segment bound, at most 8 CTAs per SM's worth: the grid-stride loop covers the rest.
  const int64_t ctas = std::min<int64_t>((bd.max_segments + kDenseRuleThreads - 1) / kDenseRuleThreads, 1024);
  dense_rule_kernel<<<unsigned(ctas), kDenseRuleThreads, 0, stream>>>(seq, heads.group, block_size, heads.kv,
                                                                      dense_fraction, d.cu_tiles, d.segment_start,
                                                                      d.segment_end, d.counters);
  check_cuda(cudaGetLastError(), "dense_rule_kernel launch");
}

}  // namespace sparse_prefill::cuda::index_stage
